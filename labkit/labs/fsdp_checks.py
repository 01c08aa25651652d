"""Checks for fsdp_lab's exercises, where the learner writes FSDP2-style per-parameter sharding:
shard / gather one parameter, unshard / reshard one unit, the forward hooks, the backward (re-gather,
reduce-scatter), the whole strategy on labkit.loop, and reshard_after_forward / prefetch.

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
import torch
import torch.distributed as dist
import torch.nn as nn

from labkit import loop
from labkit.checks import compare
from labkit.data import shard_batch
from labkit.labs.fsdp_lab import assign_params, rows_per_rank, shard_rows
from labkit.strategies.fsdp import plan_units

NOT_IMPLEMENTED = "not implemented yet"


expected_shard = shard_rows


def _attempt(fn, *args):
    try:
        return fn(*args)
    except NotImplementedError:
        return NOT_IMPLEMENTED


def _bytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _same(a, b):
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def _fail(what, report, hint=""):
    raise AssertionError("\n".join(x for x in (what, report, f"hint: {hint}" if hint else "") if x))


def _all_not_implemented(values):
    if values and all(isinstance(v, str) and v == NOT_IMPLEMENTED for v in values):
        raise NotImplementedError(NOT_IMPLEMENTED)


# ---------------------------------------------------------------- 1. one parameter
SHARD_CASES = [(7, 3), (8,), (2, 5)]   # 7 rows on 3 ranks: 2 padding rows; 2 rows: rank 2 all padding


def case_tensor(i):
    shape = SHARD_CASES[i]
    numel = torch.Size(shape).numel()
    return (torch.arange(numel, dtype=torch.float32) + 100 * i + 1).reshape(shape)   # no zeros


def shard_outputs(shard_fn, gather_fn):
    """Rank function: the learner's shard of each case, and its gather of the RIGHT shards."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for i in range(len(SHARD_CASES)):
        full = case_tensor(i)
        shard = _attempt(shard_fn, full.clone(), rank, n)
        gathered = _attempt(gather_fn, expected_shard(full, rank, n).clone(), full.shape[0])
        out.append({k: v if isinstance(v, str) else v.detach().clone()
                    for k, v in (("shard", shard), ("gathered", gathered))})
    return out


def _shard_hint(got, full, rank, n):
    rows = rows_per_rank(full.shape[0], n)
    if got.shape[1:] != full.shape[1:]:
        return "shard along dim 0 only: the shard keeps every other dimension whole"
    if got.shape[0] == full.shape[0]:
        return f"the whole tensor: rank {rank} keeps only rows [{rank * rows}, {(rank + 1) * rows})"
    chunks = torch.chunk(full, n)
    if got.shape[0] != rows and rank < len(chunks) and got.shape[0] == chunks[rank].shape[0] or got.shape[0] < rows:
        return (f"padding missing: every rank's shard has R = ceil({full.shape[0]} / {n}) = {rows} rows, "
                f"the rows past the end are zeros (so one all-gather of equal pieces rebuilds it)")
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
    if got.shape[0] == rows * n and got.shape[0] != full.shape[0]:
        return f"padding left in: the all-gather gives {rows * n} rows; keep the first {full.shape[0]}"
    if got.shape[0] == rows:
        return "got one shard: all-gather every rank's shard into a tensor N times as long"
    return ""


def check_shard(shard_fn, gather_fn, world_size=3):
    """Exercise 1: shard_fn(full, rank, world_size) and gather_fn(shard, dim0), each on its own
    input (a wrong shard cannot hide behind a right gather), on uneven cases."""
    import labkit
    results = labkit.run(shard_outputs, shard_fn, gather_fn, world_size=world_size)
    _all_not_implemented([c[k] for r in results for c in r for k in c])
    for i, shape in enumerate(SHARD_CASES):
        full = case_tensor(i)
        for rank, got in enumerate(r[i] for r in results):
            for key, want, hint in (("shard", expected_shard(full, rank, world_size),
                                     lambda g: _shard_hint(g, full, rank, world_size)),
                                    ("gathered", full, lambda g: _gather_hint(g, full, world_size))):
                value = got[key]
                if isinstance(value, str):
                    continue
                report = compare(want, value, rank=rank, names=[f"{key} of a {tuple(shape)} tensor"],
                                 world_size=world_size)
                if not report.ok:
                    fn = "shard_dim0" if key == "shard" else "gather_dim0"
                    _fail(f"{fn} on {world_size} ranks, tensor of shape {tuple(shape)}: wrong on rank {rank}",
                          report.first_problem(), hint(value))
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
    seen = {"names": names, "shards": [s.detach().clone() for s in unit.shards],
            "registered_shards": all(m is s for m, s in zip(_module_params(slots), unit.shards)),
            "bytes": [_bytes(unit.unsharded)]}
    unit.unshard()
    seen["bytes"].append(_bytes(unit.unsharded))
    seen["full"] = [t.detach().clone() for t in _module_params(slots)]
    held = list(unit.unsharded)           # what autograd would save in forward
    unit.reshard()
    seen["bytes"].append(_bytes(unit.unsharded))
    seen["registered_after"] = all(m is s for m, s in zip(_module_params(slots), unit.shards))
    unit.unshard()
    seen["held_bytes"] = _bytes(held)
    seen["held"] = [t.detach().clone() for t in held] if seen["held_bytes"] else None
    unit.reshard()
    return seen


def check_unit(unit_cls, world_size=2):
    """Exercise 2: the unit's shards, its unsharded parameters' bytes and values, and that a
    tensor taken at the first unshard (as autograd saves it) sees the data again at the next."""
    import labkit
    results = labkit.run(unit_outputs, unit_cls, world_size=world_size)
    module = unit_module()
    fulls = [p.detach() for p in module.parameters()]
    full_bytes = sum(4 * p.numel() for p in fulls)
    for rank, seen in enumerate(results):
        names = seen["names"]
        report = compare([expected_shard(p, rank, world_size) for p in fulls], seen["shards"],
                         names=[f"shard of {n}" for n in names], rank=rank, world_size=world_size)
        if not report.ok:
            bad = report.failures()[0]
            got = seen["shards"][[f"shard of {n}" for n in names].index(bad.name)]
            _fail("MyUnit's shards are wrong", report.first_problem(),
                  _shard_hint(got, fulls[[f"shard of {n}" for n in names].index(bad.name)], rank, world_size)
                  or "use shard_dim0 from exercise 1")
        if not seen["registered_shards"]:
            _fail(f"rank {rank}: after MyUnit(...) the module does not hold the shards", "",
                  "between steps the module's parameters are the sharded nn.Parameters (self.use(self.shards))")
        before, unsharded, after = seen["bytes"]
        for label, got, want, hint in (
                ("before unshard", before, 0, "the unsharded parameters start empty: untyped_storage().resize_(0)"),
                ("after unshard", unsharded, full_bytes,
                 "unshard gives every unsharded parameter its full storage back (resize_ to numel * element_size)"),
                ("after reshard", after, 0, "reshard frees the storage: untyped_storage().resize_(0)")):
            if got != want:
                _fail(f"rank {rank}: unsharded parameters hold {got} B {label}, expected {want} B", "", hint)
        report = compare(fulls, seen["full"], names=names, rank=rank, world_size=world_size,
                         label="module parameters after unshard")
        if not report.ok:
            shapes = [(tuple(f.shape), tuple(g.shape)) for f, g in zip(fulls, seen["full"])]
            padded = any(g[0] > f[0] for f, g in shapes)
            _fail(f"rank {rank}: wrong full parameters after unshard", report.first_problem(),
                  "padding left in: keep the first dim0 rows" if padded else
                  "rank r's rows come from row r of the all-gather output: view it as (N, shard numel)")
        if not seen["registered_after"]:
            _fail(f"rank {rank}: after reshard the module still computes with the unsharded tensors", "",
                  "reshard hands the module its shards again (self.use(self.shards))")
        if seen["held"] is None:
            _fail(f"rank {rank}: a tensor taken at the first unshard is empty after the second", "",
                  "forgetting to refill storage: unshard made NEW tensors, but autograd saved the old ones "
                  "in forward; resize_ the SAME storage back and copy into it (full.data.copy_(...))")
        report = compare(fulls, seen["held"], names=names, rank=rank, label="refilled storage")
        if not report.ok:
            _fail(f"rank {rank}: the refilled storage holds the wrong values", report.first_problem())
    return True


# ---------------------------------------------------------------- 3. forward hooks
FORWARD_CFG = loop.PRESETS["dp"]   # a 2-block TinyGPT, 7 rows: fast on 2 ranks


def wrap_units(model, unit_cls, units="block"):
    """The learner's units on `model` as MyFSDP builds them: inner units first, the root last
    (kept gathered from its forward to its backward, as fully_shard does for the root)."""
    modules = plan_units(model, units)
    built = [unit_cls(slots) for slots in assign_params(model, modules)]
    for unit, module in zip(built, modules + [model]):
        unit.reshard_after_forward = module is not model
        unit.hook(module)
    return modules, built


def _gathered(built):
    return [_bytes(u.unsharded) > 0 for u in built]


def forward_outputs(unit_cls):
    """Rank function: the learner's hooked units through one forward; which units were
    gathered during and after each block's forward, and the logits."""
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = FORWARD_CFG
    model, plain = loop.build_model(cfg), loop.build_model(cfg)
    x, y = shard_batch(*loop.global_batch(cfg, 0), rank, n)
    blocks, built = wrap_units(model, unit_cls)
    seen = {"during": [], "after": []}
    for block in blocks:   # registered after the learner's hooks: they run after them
        block.register_forward_pre_hook(lambda m, a: seen["during"].append(_gathered(built)))
        block.register_forward_hook(lambda m, a, o: seen["after"].append(_gathered(built)))
    try:
        logits = model(x, y)[0]
    except RuntimeError as exc:
        return {"error": str(exc).splitlines()[0]}
    seen["end"] = _gathered(built)
    seen["logits"], seen["want"] = logits.detach(), plain(x, y)[0].detach()
    return seen


def check_forward(unit_cls, world_size=2):
    """Exercise 3: the block being computed is gathered, the others are not, each block is
    resharded after its forward, the root stays gathered, and the logits are the unsharded model's."""
    import labkit
    results = labkit.run(forward_outputs, unit_cls, world_size=world_size)
    for rank, seen in enumerate(results):
        if "error" in seen:
            msg = seen["error"]
            hint = ("a block computed with its shards: pre_forward must unshard" if "shape" in msg or "size" in msg
                    else "the forward touched a freed storage: unshard must resize_ it back before copying"
                    if "storage" in msg else "")
            _fail(f"rank {rank}: the forward raised: {msg}", "", hint)
        for i, (during, after) in enumerate(zip(seen["during"], seen["after"])):
            if not during[i]:
                _fail(f"rank {rank}: block {i} computed with its weights not gathered", "",
                      "pre_forward must unshard the unit (self.unshard())")
            if any(during[j] for j in range(len(during) - 1) if j != i):
                _fail(f"rank {rank}: during block {i}'s forward other blocks are gathered: {during[:-1]}", "",
                      "reshard_after_forward: each block frees its full weights in post_forward")
            if after[i]:
                _fail(f"rank {rank}: block {i} still gathered after its forward", "",
                      "post_forward must reshard when self.reshard_after_forward")
        if not seen["end"][-1]:
            _fail(f"rank {rank}: the root was resharded by the end of the forward", "",
                  "the root keeps reshard_after_forward=False: its weights are needed again at once")
        report = compare(seen["want"], seen["logits"], rank=rank, names=["logits"], atol=1e-6)
        if not report.ok:
            _fail(f"rank {rank}: the logits differ from the unsharded model's", report.first_problem(),
                  "the gathered weights are wrong (exercise 2's check) or the module kept its shards")
    return True


# ---------------------------------------------------------------- 4. backward
BACKWARD_CFG = loop.PRESETS["toy"]   # frozen, tied across units, unused on step 0, called twice, 7 rows
BACKWARD_STEPS = (0, 1)              # step 0 leaves `extra` unused, step 1 uses it


def _names(model):
    by_id = {id(m): n for n, m in model.named_modules()}
    return lambda uses: f"{by_id[id(uses[0][0])]}.{uses[0][1]}".lstrip(".")


def backward_outputs(unit_cls):
    """Rank function: per step, each trainable shard's .grad after one forward + backward, and
    whether any unit was still gathered after the backward."""
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = BACKWARD_CFG
    model = loop.build_model(cfg)
    name_of = _names(model)
    _, built = wrap_units(model, unit_cls, cfg.units)
    shards = {name_of(uses): s for u in built for s, (_, uses) in zip(u.shards, u.slots) if s.requires_grad}
    out = []
    for step in BACKWARD_STEPS:
        for s in shards.values():
            s.grad = None
        x, y = loop.global_batch(cfg, step)
        mx, my = shard_batch(x, y, rank, n)
        try:
            (loop.summed_loss(model, cfg, mx, my, step) / y.numel()).backward()
        except RuntimeError as exc:
            return {"error": str(exc).splitlines()[0], "step": step}
        out.append({"grads": {k: None if s.grad is None else s.grad.detach().clone() for k, s in shards.items()},
                    "gathered": _gathered(built)})
    return {"steps": out}


def _global_grads(cfg, step, rank=None, world_size=1):
    """{name: grad} of the whole batch (the loop's convention), or of `rank`'s rows alone."""
    model = loop.build_model(cfg)
    x, y = loop.global_batch(cfg, step)
    count = y.numel()
    if rank is not None:
        x, y = shard_batch(x, y, rank, world_size)
    (loop.summed_loss(model, cfg, x, y, step) / count).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _grad_hint(got, want, local, name, rank, n, others):
    if got.shape != want.shape:
        return (f"param.grad has the shard's shape {tuple(want.shape)}: reduce-scatter the padded "
                f"gradients and keep rank {rank}'s piece")
    if _same(got, want / n):
        return (f"1/{n} of the gradient: AVG where the loop SUMs (its loss is already divided by the "
                f"GLOBAL token count); reduce with op='sum'")
    if _same(got, want * n):
        return f"{n}x the gradient: the loss or the gradient was multiplied by the world size"
    if _same(got, local):
        return "this rank's own local gradient, not reduced: reduce-scatter it with the other ranks'"
    for k, other in others.items():
        if _same(got, other):
            return f"wrong shard index: rank {rank} got rank {k}'s piece; rank r keeps row r of the (N, ...) layout"
    return ""


def check_backward(unit_cls, world_size=2):
    """Exercise 4: after one backward every trainable shard's .grad is its piece of the
    reduce-scattered (SUM) gradient, on the toy's hard cases; every unit resharded."""
    import labkit
    results = labkit.run(backward_outputs, unit_cls, world_size=world_size)
    for rank, seen in enumerate(results):
        if "error" in seen:
            msg = seen["error"]
            hint = ("forgetting to refill storage: autograd saved the unsharded weights in forward and "
                    "reshard freed them; pre_backward must unshard (refill the SAME storage) before the "
                    "unit's backward" if "storage" in msg or "size 0" in msg or "numel" in msg else "")
            _fail(f"rank {rank}: the backward of step {seen['step']} raised: {msg}", "", hint)
        for step, got in zip(BACKWARD_STEPS, seen["steps"]):
            want_full = _global_grads(BACKWARD_CFG, step)
            local_full = _global_grads(BACKWARD_CFG, step, rank, world_size)
            for name, grad in got["grads"].items():
                if name not in want_full:
                    if grad is not None and grad.any():
                        _fail(f"rank {rank}, step {step}: '{name}' is unused this step but its shard got a gradient", "")
                    continue
                want = expected_shard(want_full[name], rank, world_size)
                if grad is None:
                    _fail(f"rank {rank}, step {step}: the shard of '{name}' has no .grad after backward", "",
                          "post-backward never reduce-scattered: count the unit's accumulated gradients "
                          "(register_post_accumulate_grad_hook) and reduce when all are in")
                report = compare(want, grad, names=[f"{name} (shard .grad)"], rank=rank, world_size=world_size)
                if not report.ok:
                    others = {k: expected_shard(want_full[name], k, world_size) for k in range(world_size) if k != rank}
                    _fail(f"rank {rank}, step {step}: wrong gradient shard", report.first_problem(),
                          _grad_hint(grad, want, expected_shard(local_full[name], rank, world_size),
                                     name, rank, world_size, others))
            if any(got["gathered"]):
                _fail(f"rank {rank}, step {step}: units still gathered after the backward: {got['gathered']}", "",
                      "reshard once the unit's gradients are reduce-scattered")
    return True
