"""Checks for fsdp_lab's exercises, where the learner writes FSDP2-style per-parameter sharding:
here shard / gather one parameter and unshard / reshard one unit; the forward hooks and the
backward are in fsdp_checks_hooks, the whole strategy on labkit.loop and reshard_after_forward /
prefetch in fsdp_checks_loop.

The ranks run the learner's code and return what they saw; the kernel computes what they should
have seen and raises one AssertionError naming the rank, the parameter, the index, expected vs
got, and a hint for the exercise's typical mistakes (padding left in, wrong shard index, SUM for
AVG, forgetting to refill the storage). What a learner's class must offer, per stage:
    MyUnit(slots)        .shards, .unsharded (lists, slot order), .unshard(), .reshard()
    HookedUnit           .hook(module), .reshard_after_forward
    MyFSDP(model, cfg)   a labkit.strategies strategy with .units; PrefetchingFSDP takes
                         reshard_after_forward, prefetch, max_inflight; a unit's .handle is its
                         all-gather in flight (None when none)
Left out: timing and overlap (too noisy on 2 shared cores): the lab measures those.
"""

import re

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.checks import compare
from labkit.labs.fsdp_lab import assign_params, rows_per_rank, shard_rows

NOT_IMPLEMENTED = "not implemented yet"


expected_shard = shard_rows
RAISED = "raised "  # a shard_fn that raised: the check names the case and the likely cause


def _attempt(fn, *args):
    try:
        return fn(*args)
    except NotImplementedError:
        return NOT_IMPLEMENTED


def _bytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _filled(t):
    """Whether t's storage holds all its elements (reading one that does not can crash)."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def _same(a, b):
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def _fail(what, report, hint=""):
    if hint:  # the lab's hint knows the exercise: compare's guess from the numbers alone goes
        report = "\n".join(line for line in report.splitlines() if not line.strip().startswith("hint:"))
    raise AssertionError("\n".join(x for x in (what, report, f"hint: {hint}" if hint else "") if x))


def _all_not_implemented(values):
    if values and all(isinstance(v, str) and v == NOT_IMPLEMENTED for v in values):
        raise NotImplementedError(NOT_IMPLEMENTED)


# ---------------------------------------------------------------- a wrong group=
# FSDP here shards every parameter over all N ranks: the collectives run on the default group. A
# group= that is not the world fails inside labkit's ring before any message is sent, with the
# ring's or torch's words ("pad the input", "Group ... is not registered"): each is named here.
_MESH = (
    "group= takes a ProcessGroup, not a DeviceMesh; and here no group is needed: FSDP shards over "
    "every rank, so leave group= out (the default group, the world's {n} ranks)"
)
_NAME = (
    "group= takes a ProcessGroup object, not a name or a string; here leave group= out (the "
    "default group: FSDP shards over the world's {n} ranks)"
)
_SUBGROUP = (
    "group= is a subgroup of {k}, not the world's {n} ranks: FSDP here shards every parameter "
    "over all {n} ranks, and each shard and buffer is sized for them; leave group= out (the "
    "default group)"
)
_SIZE = (
    "{op}'s {big} must hold N x its {small} (N = dist.get_world_size() = {n} here); yours is "
    "{ratio} x: size it from the world size, not a constant"
)


def group_mistake(failures, world_size):
    """(rank, the error's line, hint) for the first rank whose error is about its collective's
    group= (a DeviceMesh, a string, a subgroup that is not the world) or a buffer not sized for
    the world (the all-gather's output, the reduce-scatter's input), else None.
    failures: RankError.failures, rank -> (exception type name, message)."""
    for rank in sorted(failures):
        kind, message = failures[rank]
        for line in str(message).splitlines():
            size = re.search(r"world_size × (?:input|output) = (\d+) ×", line)
            if "DeviceMesh" in line:
                hint = _MESH
            elif "is not registered" in line or "not initialized in the world group map" in line:
                hint = _NAME
            elif "not a member of the group" in line or (size and int(size.group(1)) != world_size):
                hint = _SUBGROUP
            elif size:  # the world's size, and a buffer sized for another
                big, small = ("output", "input") if "all_gather" in line else ("input", "output")
                numbers = re.search(r"has (\d+) elements .* = \d+ × (\d+)", line)
                ratio = f"{int(numbers.group(1)) / int(numbers.group(2)):g}" if numbers else "not N"
                op = "ring_all_gather" if "all_gather" in line else "ring_reduce_scatter"
                hint = _SIZE.format(op=op, big=big, small=small, n=world_size, ratio=ratio)
            else:
                continue
            members = re.search(r"\(ranks \[([\d, ]*)\]\)", line)
            k = int(size.group(1)) if size else len(members.group(1).split(",")) if members else 0
            line = line.split("; pad the input")[0]  # the ring's advice for a size that is wrong
            return (
                rank,
                f"{kind}: {line}",
                hint.format(n=world_size, k=f"{k} rank{'s' * (k != 1)}" if k else "fewer ranks"),
            )
    return None


def run_ranks(what, fn, *args, world_size, **kwargs):
    """labkit.run(fn, *args, **kwargs), where a rank's error about a wrong group= or a buffer's
    size fails as `what`, with the hint that names the mistake (any other error is raised as it is)."""
    import labkit

    try:
        return labkit.run(fn, *args, world_size=world_size, **kwargs)
    except labkit.RankError as exc:
        found = group_mistake(exc.failures, world_size)
        if found is None:
            raise
        rank, line, hint = found
        _fail(f"{what} on {world_size} ranks: rank {rank} raised {line}", "", hint)


# ---------------------------------------------------------------- 1. one parameter
# 7 rows on 3 ranks: 2 padding rows; 2 rows: rank 2 all padding; 6 rows: ceil(6 / 3) = 2 rows
# per rank, where 6 // 3 + 1 = 3 (the cases before cannot tell the two apart)
SHARD_CASES = [(7, 3), (8,), (2, 5), (6, 2)]


def case_tensor(i):
    shape = SHARD_CASES[i]
    numel = torch.Size(shape).numel()
    return (torch.arange(numel, dtype=torch.float32) + 100 * i + 1).reshape(shape)  # no zeros


def shard_outputs(shard_fn, gather_fn):
    """Rank function: the learner's shard of each case, and its gather of the RIGHT shards."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for i in range(len(SHARD_CASES)):
        full = case_tensor(i)
        try:  # no collectives in shard_fn: its error can be named here, with the case
            shard = _attempt(shard_fn, full.clone(), rank, n)
        except (RuntimeError, IndexError, ValueError) as exc:
            shard = f"{RAISED}{type(exc).__name__}: {exc}"
        gathered = _attempt(gather_fn, expected_shard(full, rank, n).clone(), full.shape[0])
        out.append(
            {
                k: v if isinstance(v, str) else v.detach().clone()
                for k, v in (("shard", shard), ("gathered", gathered))
            }
        )
    return out


def _shard_hint(got, full, rank, n):
    rows = rows_per_rank(full.shape[0], n)
    if got.shape[1:] != full.shape[1:]:
        return "shard along dim 0 only: the shard keeps every other dimension whole"
    if got.shape[0] == full.shape[0] // n + 1 and full.shape[0] % n == 0:
        return (
            f"rows // N + 1 = {got.shape[0]} rows: one too many when N divides the rows; "
            f"R = ceil({full.shape[0]} / {n}) = -(-rows // N) = {rows}"
        )
    if got.shape[0] == full.shape[0]:
        return f"the whole tensor: rank {rank} keeps only rows [{rank * rows}, {(rank + 1) * rows})"
    chunks = torch.chunk(full, n)
    if (
        got.shape[0] != rows
        and rank < len(chunks)
        and got.shape[0] == chunks[rank].shape[0]
        or got.shape[0] < rows
    ):
        return (
            f"padding missing: every rank's shard has R = ceil({full.shape[0]} / {n}) = {rows} rows, "
            f"the rows past the end are zeros (so one all-gather of equal pieces rebuilds it)"
        )
    for k in range(n):
        if k != rank and torch.equal(got, expected_shard(full, k, n)):
            return f"wrong shard index: rank {rank} holds rank {k}'s rows; rank r keeps rows [r*R, (r+1)*R)"
    want = expected_shard(full, rank, n)
    real = max(0, min(rows, full.shape[0] - rank * rows))
    if got.shape == want.shape and torch.equal(got[:real], want[:real]):
        return "the real rows are right but the padding rows are not zeros (new_zeros, not new_empty)"
    return ""


def _gather_hint(got, full, n):
    rows = rows_per_rank(full.shape[0], n)
    row = full[0].numel() if full.dim() else 1
    if got.shape[1:] != full.shape[1:] and got.numel() in (full.numel(), rows * n * row):
        return (
            f"the all-gather's rows, flattened and trimmed by a flat size ({got.numel()} elements, shape "
            f"{tuple(got.shape)}): gather into an (N R, ...) tensor, shaped like the shards, and keep its "
            f"first dim0 = {full.shape[0]} ROWS, out[:dim0]"
        )
    if got.shape[0] == rows * n and got.shape[0] != full.shape[0]:
        return f"padding left in: the all-gather gives {rows * n} rows; keep the first {full.shape[0]}"
    if got.shape[0] == rows:
        return "got one shard: all-gather every rank's shard into a tensor N times as long"
    return ""


def check_shard(shard_fn, gather_fn, world_size=3):
    """Exercise 1: shard_fn(full, rank, world_size) and gather_fn(shard, dim0), each on its own
    input (a wrong shard cannot hide behind a right gather), on uneven cases."""
    results = run_ranks("gather_dim0", shard_outputs, shard_fn, gather_fn, world_size=world_size)
    _all_not_implemented([c[k] for r in results for c in r for k in c])
    for i, shape in enumerate(SHARD_CASES):
        full = case_tensor(i)
        for rank, got in enumerate(r[i] for r in results):
            for key, want, hint in (
                (
                    "shard",
                    expected_shard(full, rank, world_size),
                    lambda g: _shard_hint(g, full, rank, world_size),
                ),
                ("gathered", full, lambda g: _gather_hint(g, full, world_size)),
            ):
                value = got[key]
                if isinstance(value, str) and value.startswith(RAISED):
                    rows = rows_per_rank(full.shape[0], world_size)
                    floor = full.shape[0] // world_size
                    _fail(
                        f"shard_dim0 on {world_size} ranks, tensor of shape {tuple(shape)}: {value} "
                        f"on rank {rank}",
                        "",
                        f"R = rows // N (floor) = {floor} makes the padded tensor {floor * world_size} "
                        f"rows, too short for the {full.shape[0]} rows copied into it: R = ceil(rows / "
                        f"N) = -(-rows // N) = {rows} (as zero1_lab's flat partition)"
                        if rows != floor and ("size" in value or "shape" in value)
                        else "see the error: it is raised inside your shard_dim0",
                    )
                if isinstance(value, str):
                    continue
                report = compare(
                    want, value, rank=rank, names=[f"{key} of a {tuple(shape)} tensor"], world_size=world_size
                )
                if not report.ok:
                    fn = "shard_dim0" if key == "shard" else "gather_dim0"
                    _fail(
                        f"{fn} on {world_size} ranks, tensor of shape {tuple(shape)}: wrong on rank {rank}",
                        report.first_problem(),
                        hint(value),
                    )
    missing = {k for r in results for c in r for k, v in c.items() if isinstance(v, str)}
    if missing:
        raise NotImplementedError(f"{', '.join(sorted(missing))}: {NOT_IMPLEMENTED} (the rest passed)")
    return True


# ---------------------------------------------------------------- 2. one unit
def unit_module():
    """A unit with odd sizes (7 rows on 2 ranks: 1 padding row; LayerNorm's 5-vectors)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7))


def _module_params(slots):
    return [module._parameters[attr] for _, uses in slots for module, attr in uses[:1]]


def unit_outputs(unit_cls):
    """Rank function: the learner's unit through unshard, reshard, unshard, reshard."""
    module = unit_module()
    names = [n for n, _ in module.named_parameters()]
    slots = assign_params(module, [])[-1]
    unit = unit_cls(slots)
    seen = {
        "names": names,
        "shards": [s.detach().clone() for s in unit.shards],
        "registered_shards": all(m is s for m, s in zip(_module_params(slots), unit.shards)),
        "bytes": [_bytes(unit.unsharded)],
    }
    from labkit.observe import tracing

    start, waited = tracing.clock(), []
    try:
        unit.start_unshard()
        handle, seen["started"] = unit.handle, tracing.clock()
        if handle is not None and not hasattr(handle, "wait"):  # one handle per parameter's gather
            for h in handle if isinstance(handle, (list, tuple)) else ():
                getattr(h, "wait", lambda: None)()  # the gathers finish before the check goes on
            size = f" of {len(handle)}" if isinstance(handle, (list, tuple)) else ""
            return {
                "error": f"start_unshard left self.handle a {type(handle).__name__}{size}, not one all-gather's handle",
                "when": "the first unshard",
                "many": True,
            }
        if handle is not None:  # seen: is the gather waited for before its buffer is read?
            wait = handle.wait
            handle.wait = lambda *a, **k: (waited.append(True), wait(*a, **k))[1]
        unit.unshard()
        if handle is not None and not waited:
            wait()  # the check's own: the ring must finish before the next collective
    except RuntimeError as exc:  # e.g. full.copy_ on a leaf that requires grad
        return {"error": str(exc).splitlines()[0], "when": "the first unshard"}
    seen["window"] = (start, tracing.clock())
    seen["waited"] = handle is None or bool(waited)
    seen["no_handle"] = handle is None
    seen["bytes"].append(_bytes(unit.unsharded))
    if not all(_filled(t) for t in _module_params(slots)):  # a forward would read freed memory
        return dict(seen, empty=True)
    seen["full"] = [t.detach().clone() for t in _module_params(slots)]
    held = list(unit.unsharded)  # what autograd would save in forward
    # ... and does save: a forward now, its backward after reshard + unshard (as FSDP's backward)
    saved = module(torch.ones(3, 5, requires_grad=True)).square().sum()
    unit.reshard()
    seen["bytes"].append(_bytes(unit.unsharded))
    seen["registered_after"] = all(m is s for m, s in zip(_module_params(slots), unit.shards))
    try:
        unit.unshard()
    except RuntimeError as exc:
        return {"error": str(exc).splitlines()[0], "when": "the second unshard"}
    seen["held_bytes"] = _bytes(held)
    seen["held"] = [t.detach().clone() for t in held] if all(_filled(t) for t in held) else None
    try:
        saved.backward()
        seen["backward"] = None
    except RuntimeError as exc:
        seen["backward"] = str(exc).splitlines()[0]
    unit.reshard()
    return seen


COPY_INTO_PARAMETER = (
    "unshard wrote into the unsharded nn.Parameter itself (full.copy_(...)): "
    "autograd tracks that tensor, and the copy bumps the version it saved in "
    "forward; copy through full.data (full.data.copy_(...)), as the text says"
)


ONE_GATHER = (
    "one all-gather per unit, not one per parameter: copy every shard into one send buffer "
    "(torch.cat of the flattened shards), all-gather it once (self.handle is its handle), then "
    "copy each parameter's rows out"
)


NO_HANDLE = (
    "ring_all_gather without async_op=True runs to the end and returns None, so unshard's "
    "`if self.handle is not None` skips the copy (and its start_unshard gathers again): pass "
    "async_op=True and keep the handle in self.handle"
)


def check_unit(unit_cls, world_size=2):
    """Exercise 2: the unit's shards, its unsharded parameters' bytes and values, and that a
    tensor taken at the first unshard (as autograd saves it) sees the data again at the next."""
    results = run_ranks("MyUnit's unshard", unit_outputs, unit_cls, world_size=world_size)
    module = unit_module()
    for rank, (seen, trace) in enumerate(zip(results, results.traces)):
        if "window" not in seen:
            continue
        if not seen["waited"]:
            _fail(
                f"rank {rank}: unshard copied out of the receive buffer without waiting for the all-gather",
                "",
                "the gather started with async_op=True runs in the background: self.handle.wait() "
                "before reading self.recv (until then it may hold anything)",
            )
        lo, hi = seen["window"]
        ops = [e["op"] for e in trace["events"] if lo <= e["start"] < hi]
        gathers = [o for o in ops if "all_gather" in o]
        theirs = sorted(
            {o for o in ops if not o.startswith("ring_") and o not in ("send", "recv", "barrier")}
        )
        if theirs:
            _fail(
                f"rank {rank}: unshard called torch.distributed's {theirs}",
                "",
                "torch's own collectives bypass the course's traced ring (the memory and traffic "
                "sections count labkit's): ring_all_gather(self.recv, self.send, async_op=True)",
            )
        if seen["no_handle"] and any(
            lo <= e["start"] < seen["started"] and "all_gather" in e["op"] for e in trace["events"]
        ):
            _fail(f"rank {rank}: start_unshard all-gathered but left self.handle None", "", NO_HANDLE)
        if len(gathers) != 1:
            _fail(
                f"rank {rank}: unshard ran {len(gathers)} all-gathers for one unit of "
                f"{len(seen['names'])} parameters, expected 1",
                "",
                "one all-gather per unit: copy every shard into one send buffer (torch.cat of the "
                "flattened shards), all-gather it once, then copy each parameter's rows out"
                if gathers
                else "unshard must all-gather the unit's shards (start_unshard issues it)",
            )
    fulls = [p.detach() for p in module.parameters()]
    full_bytes = sum(4 * p.numel() for p in fulls)
    for rank, seen in enumerate(results):
        if "error" in seen:
            msg = seen["error"]
            if seen.get("many"):
                _fail(f"rank {rank}: {seen['when']}: {msg}", "", ONE_GATHER)
            _fail(
                f"rank {rank}: {seen['when']} raised: {msg}",
                "",
                COPY_INTO_PARAMETER if "in-place" in msg or "inplace" in msg else "",
            )
        if seen.get("empty"):
            _fail(
                f"rank {rank}: after unshard the module's parameters hold {seen['bytes'][1]} B of "
                f"{full_bytes} B",
                "",
                NO_HANDLE
                if seen["no_handle"]
                else "unshard gives every unsharded parameter its full storage back (resize_ to "
                "numel * element_size) and copies its rows in, before the module uses it",
            )
        names = seen["names"]
        report = compare(
            [expected_shard(p, rank, world_size) for p in fulls],
            seen["shards"],
            names=[f"shard of {n}" for n in names],
            rank=rank,
            world_size=world_size,
        )
        if not report.ok:
            bad = report.failures()[0]
            got = seen["shards"][[f"shard of {n}" for n in names].index(bad.name)]
            _fail(
                "MyUnit's shards are wrong",
                report.first_problem(),
                _shard_hint(got, fulls[[f"shard of {n}" for n in names].index(bad.name)], rank, world_size)
                or "use shard_dim0 from exercise 1",
            )
        if not seen["registered_shards"]:
            _fail(
                f"rank {rank}: after MyUnit(...) the module does not hold the shards",
                "",
                "between steps the module's parameters are the sharded nn.Parameters (self.use(self.shards))",
            )
        before, unsharded, after = seen["bytes"]
        for label, got, want, hint in (
            (
                "before unshard",
                before,
                0,
                "the unsharded parameters start empty: untyped_storage().resize_(0)",
            ),
            (
                "after unshard",
                unsharded,
                full_bytes,
                "unshard gives every unsharded parameter its full storage back (resize_ to numel * element_size)",
            ),
            ("after reshard", after, 0, "reshard frees the storage: untyped_storage().resize_(0)"),
        ):
            if got != want:
                _fail(f"rank {rank}: unsharded parameters hold {got} B {label}, expected {want} B", "", hint)
        report = compare(
            fulls,
            seen["full"],
            names=names,
            rank=rank,
            world_size=world_size,
            label="module parameters after unshard",
        )
        if not report.ok:
            shapes = [(tuple(f.shape), tuple(g.shape)) for f, g in zip(fulls, seen["full"])]
            padded = any(g[0] > f[0] for f, g in shapes)
            _fail(
                f"rank {rank}: wrong full parameters after unshard",
                report.first_problem(),
                "padding left in: keep the first dim0 rows"
                if padded
                else "rank r's rows come from row r of the all-gather output: view it as (N, shard numel)",
            )
        if not seen["registered_after"]:
            _fail(
                f"rank {rank}: after reshard the module still computes with the unsharded tensors",
                "",
                "reshard hands the module its shards again (self.use(self.shards))",
            )
        if seen["held"] is None:
            _fail(
                f"rank {rank}: a tensor taken at the first unshard is empty after the second",
                "",
                "forgetting to refill storage: unshard made NEW tensors, but autograd saved the old ones "
                "in forward; resize_ the SAME storage back and copy into it (full.data.copy_(...))",
            )
        report = compare(fulls, seen["held"], names=names, rank=rank, label="refilled storage")
        if not report.ok:
            _fail(f"rank {rank}: the refilled storage holds the wrong values", report.first_problem())
        if seen["backward"] is not None:
            msg = seen["backward"]
            _fail(
                f"rank {rank}: a backward through weights saved at the first unshard, run after "
                f"reshard + unshard, raised: {msg}",
                "",
                COPY_INTO_PARAMETER if "inplace" in msg else "",
            )
    return True
