"""Checks for hsdp_lab's exercises, on 4 ranks as 2 simulated nodes x 2 (a free inter-node link:
the checks look at values and at the bytes the tracer saw cross nodes, never at time).

    check_hier(fn)                    fn(tensor, mesh): the two-level all-reduce, in place (sum)
    check_shard_gather(shard, gather) shard(full, mesh) -> this rank's shard over the node;
                                      gather(shard, dim0, mesh) -> the whole tensor
    check_grad_path(reduce_grad)      reduce_grad(grad, mesh) -> this rank's shard of the sum over
                                      every rank; then OneUnitHSDP trains with it = one process
    check_choice(choose)              choose(rows, budget_bytes) -> a shard-group size

Each raises one AssertionError naming the rank and case, with a hint for the mistake it
recognises (flat instead of two-level, groups swapped, the all-gather or the cross-node all-reduce
left out, AVG for SUM, sharding over every rank, the global rank as the shard index, padding, a
DeviceMesh or no group where a process group goes, the whole gradient across nodes, the first
row that fits, < for <=). Where the lesson is bytes (exercises 1-3) the check measures what
labkit's collectives sent across nodes; an answer that calls torch.distributed's own collectives
is refused at once, saying why: they bypass the tracer and the simulated link (0 bytes, 0 ms).
"""

import torch
import torch.distributed as dist

from labkit.checks import NOT_IMPLEMENTED
from labkit.checks import attempt as _attempt
from labkit.checks import fail as _fail
from labkit.launch.topology import NodeLink
from labkit.labs import hsdp_lab
from labkit.labs.fsdp_lab import shard_rows
from labkit.observe import trace_stats

FREE = NodeLink(bandwidth_Bps=1e10, latency_s=0.0)
HIER_SIZES = (1001, 2**18)  # odd (padding), and 1 MiB: rings at both levels
SHARD_CASES = ((7, 3), (8,), (1, 5), (5,))


def _run(fn, *args, **kwargs):
    import labkit

    return labkit.run(fn, *args, world_size=4, nodes=2, inter_node=FREE, timeout=120, **kwargs)


def _data(shape, rank):
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randint(-50, 50, shape, generator=g).float()  # exact sums in any order


def _in_place(fn, tensor, *args):
    """Run an in-place exercise: (what the tensor holds afterwards, or _attempt's message;
    what fn returned). fn may return the tensor, another value, or None: only `tensor` counts
    (never `fn(...) or tensor`, which asks a returned tensor for its truth value)."""
    returned = _attempt(fn, tensor, *args)
    if isinstance(returned, str):
        return returned, None
    return tensor, returned if isinstance(returned, torch.Tensor) and returned is not tensor else None


def _window(fn):
    """(fn's value, (start, end) on the trace clock)."""
    from labkit.observe import tracing

    start = tracing.clock()
    value = fn()
    return value, (start, tracing.clock())


def _not_implemented(values):
    if all(v == NOT_IMPLEMENTED for v in values):
        raise NotImplementedError(NOT_IMPLEMENTED)


def _torch_calls(results, windows):
    """The torch.distributed collectives (dist.all_reduce, ...) any rank called itself inside its
    window: labkit.observe.recording sees them, but they carry no byte count and pay no link."""
    names = set()
    for trace, window in zip(results.traces, windows):
        for ev in trace["events"] if trace else ():
            label = ev.get("label") or ""
            if label.startswith("dist.") and window[0] <= ev["start"] < window[1]:
                names.add(label)
    return sorted(names)


def _refuse_torch(results, windows, what, ours):
    """Refuse, at once and with the reason, an answer that called torch.distributed's own
    collectives: its values may be right, but this lab measures what crosses nodes, and only
    labkit's hand-written collectives are counted by the tracer and priced by the simulated link
    (torch's go through gloo directly: 0 bytes, 0 ms). Without this, a flat dist.all_reduce
    passes as "0 bytes crossed" and a right answer fails later, in the lab's measurements."""
    used = _torch_calls(results, windows)
    if used:
        _fail(
            f"{what}: the values are right, but it called torch.distributed's own {', '.join(used)}: "
            f"those bypass the course's tracer and its simulated inter-node link (they send through "
            f"gloo directly: 0 bytes counted, 0 ms on the slow link), so the bytes this exercise "
            f"is about cannot be measured",
            f"use labkit's {ours} (labkit.comm.collectives, the same arguments as torch's) on the "
            f"mesh's groups",
        )


def _twice(total, lo, hi, half):
    """What an all-gather across nodes leaves: this rank's summed shard in both halves."""
    mine = torch.zeros(half, dtype=total.dtype)
    mine[: hi - lo] = total[lo:hi]
    return torch.cat([mine, mine])[: total.numel()]


def _error_hint(message, numel=None):
    """The hint for an exception a learner's collective raised, by what it says."""
    if "DeviceMesh" in message:
        return (
            "group= takes a process group, not the DeviceMesh: mesh.get_group('shard') within the "
            "node, mesh.get_group('replicate') across nodes"
        )
    if "not registered" in message or "not initialized in the world group map" in message:
        return (
            "group= takes a process group object: mesh.get_group('shard') or "
            "mesh.get_group('replicate'), not a name"
        )
    if "world_size × " in message and " 4 × " in message:
        return (
            "that collective ran over every rank (no group=: the world's 4 ranks) where your "
            "buffers are sized for the node's 2: pass group=mesh.get_group('shard')"
        )
    if numel is not None and numel % 2:
        return (
            f"{numel} elements do not split into 2 equal shards: pad to a multiple of the "
            "node's size, and cut the padding off at the end"
        )
    return "see the error above"


def _node_bytes(results, windows, kind):
    """Per rank, the bytes it sent across nodes ("inter") or within ("intra") in its window."""
    return [trace_stats.node_bytes(t, t_range=w)[kind] for t, w in zip(results.traces, windows)]


# ---------------------------------------------------------------- 1. the two-level all-reduce
def _hier_rank(fn):
    from labkit.comm.hierarchical import node_mesh

    mesh, rank = node_mesh(), dist.get_rank()
    out = []
    for numel in HIER_SIZES:
        x = _data((numel,), rank)
        (got, returned), window = _window(lambda: _in_place(fn, x.clone(), mesh))
        out.append((x, got, window, returned))
    return out


def check_hier(fn):
    results = _run(_hier_rank, fn)
    _not_implemented([r[0][1] for r in results])
    for c, numel in enumerate(HIER_SIZES):
        xs = [r[c][0] for r in results]
        total, nodes = sum(xs), [xs[0] + xs[1], xs[2] + xs[3]]
        for rank, r in enumerate(results):
            got = r[c][1]
            where = f"rank {rank}, {numel} elements"
            if isinstance(got, str):
                _fail(f"{where}: {got}", _error_hint(got, numel))
            if got.shape != total.shape:
                _fail(
                    f"{where}: shape {tuple(got.shape)}, expected {tuple(total.shape)}",
                    "reduce in place: the tensor keeps its shape (drop the padding)",
                )
            if torch.equal(got, total):
                continue
            returned = r[c][3]
            if returned is not None and returned.shape == total.shape and torch.equal(returned, total):
                _fail(
                    f"{where}: the returned tensor holds the sum, but the tensor passed in does not",
                    "the exercise reduces IN PLACE: write the result into it, tensor.copy_(...)",
                )
            half, mine = -(-numel // 2), rank % 2
            lo, hi = mine * half, min((mine + 1) * half, numel)
            if torch.equal(got, nodes[rank // 2]):
                hint = "only your node's ranks are summed: all-reduce the shard across nodes too"
            elif torch.equal(got, _twice(total, lo, hi, half)):
                hint = (
                    "every half holds this rank's shard: the all-gather ran across nodes (group "
                    "'replicate', where the other node holds the SAME rows); all-gather within "
                    "the node, mesh.get_group('shard')"
                )
            elif torch.equal(got[lo:hi], total[lo:hi]):
                hint = "only this rank's shard holds the sum: all-gather it within the node"
            elif torch.allclose(got * 2, total) or torch.allclose(got * 4, total):
                hint = "an average: the exercise asks for the SUM (op='sum' at every level)"
            elif torch.allclose(got, total * 2):
                hint = "twice the sum: each level must add a contribution once"
            else:
                hint = (
                    "reduce-scatter within the node (mesh.get_group('shard')), all-reduce the "
                    "shard across nodes (mesh.get_group('replicate')), all-gather within the node"
                )
            _fail(f"{where}: wrong sum (max |diff| {(got - total).abs().max():.3g})", hint)
    for c in range(len(HIER_SIZES)):
        _refuse_torch(
            results,
            [r[c][2] for r in results],
            f"{HIER_SIZES[c]} elements",
            "ring_reduce_scatter, ring_all_reduce and ring_all_gather",
        )
    windows = [r[1][2] for r in results]
    crossed, inside = _node_bytes(results, windows, "inter"), _node_bytes(results, windows, "intra")
    expected = 2**18 * 4 // 2  # each rank sends its half across: 2(2-1)/2 x S/2
    worst = max(crossed)
    if worst > 1.1 * expected:
        size = 2**18 * 4
        # per rank (across, within), S = 1 MiB: two-level (S/2, S); the whole tensor all-reduced
        # across nodes before the reduce-scatter or after the all-gather (S, S); swapped groups
        # (S, S/2); a flat all-reduce: a ring (0 or 1.5 S, 1.5 S or 0), a direct exchange (2 S, S)
        if all(abs(c - size) <= 0.1 * size and abs(i - size) <= 0.1 * size for c, i in zip(crossed, inside)):
            hint = (
                "each rank sent the WHOLE tensor across nodes (and S within): the cross-node "
                "all-reduce ran on the whole tensor, before the in-node reduce-scatter or after "
                "the all-gather. Reduce-scatter within the node first, then all-reduce only this "
                "rank's shard across nodes (group 'replicate'), then all-gather within the node"
            )
        elif worst > 1.4 * size:  # a ring's boundary ranks send 1.5 S, a direct exchange 2 S
            hint = (
                f"one flat all-reduce over all 4 ranks: the busiest rank sent {worst / expected:.0f}x "
                "the shard across nodes. Reduce-scatter within the node (group 'shard'), all-reduce "
                "the shard across nodes (group 'replicate'), all-gather within the node"
            )
        else:
            hint = (
                "reduce-scatter and all-gather within the node (group 'shard'), all-reduce across "
                "nodes (group 'replicate'): swapped groups or a flat all-reduce cross more"
            )
        _fail(
            f"the sum is right, but a rank sent {worst} bytes across nodes for 1 MiB "
            f"(per rank across: {crossed}, within: {inside}); the two-level all-reduce sends "
            f"{expected} (its shard, once)",
            hint,
        )
    print(
        f"two-level all-reduce: sums right on all 4 ranks ({', '.join(map(str, HIER_SIZES))} "
        f"elements); labkit's collectives sent at most {worst} bytes per rank across nodes for "
        f"1 MiB (its shard, {expected} B, and the cross-rank checks' headers)"
    )


# ---------------------------------------------------------------- 2. shard and gather in the node
def _shard_rank(shard_fn, gather_fn):
    from labkit.comm.hierarchical import node_mesh

    mesh = node_mesh()
    out = []
    for shape in SHARD_CASES:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1
        shard = _attempt(shard_fn, full.clone(), mesh)
        right = shard_rows(full, mesh.get_local_rank("shard"), 2)
        gathered, window = _window(lambda: _attempt(gather_fn, right.clone(), shape[0], mesh))
        out.append((full, shard, gathered, window))
    return out


def check_shard_gather(shard_fn, gather_fn):
    results = _run(_shard_rank, shard_fn, gather_fn)
    _not_implemented([r[0][1] for r in results] + [r[0][2] for r in results])
    for c, shape in enumerate(SHARD_CASES):
        for rank, r in enumerate(results):
            full, shard, gathered, _ = r[c]
            where = f"rank {rank} (node {rank // 2}, local rank {rank % 2}), a {shape} tensor"
            want = shard_rows(full, rank % 2, 2)
            if isinstance(shard, str):
                _fail(f"{where}: shard {shard}", "see the error above")
            if not torch.equal(shard, want):
                if shard.shape == shard_rows(full, 0, 4).shape and shard.shape != want.shape:
                    hint = (
                        "sharded over all 4 ranks: HSDP shards over the node only (mesh.size(1) "
                        "ranks, mesh.get_local_rank('shard') is yours)"
                    )
                elif torch.equal(shard, shard_rows(full, rank, 2)):
                    hint = (
                        "the rows of your global rank: use your rank in the node, "
                        "mesh.get_local_rank('shard')"
                    )
                elif shard.shape != want.shape:
                    hint = f"every rank holds ceil(rows / 2) = {want.shape[0]} rows, padded with zeros"
                else:
                    hint = "rank r of the node keeps rows [r*R, (r+1)*R) of the zero-padded tensor"
                _fail(f"{where}: shard {shard.tolist()}, expected {want.tolist()}", hint)
            if isinstance(gathered, str):
                _fail(f"{where}: gather {gathered}", _error_hint(gathered))
            if not torch.equal(gathered, full):
                hint = (
                    "drop the padding rows: [:dim0]"
                    if gathered.shape[0] > full.shape[0]
                    else "all-gather the node's shards: ring_all_gather(out, shard, "
                    "group=mesh.get_group('shard'))"
                )
                _fail(f"{where}: gathered {gathered.tolist()}, expected {full.tolist()}", hint)
    for c in range(len(SHARD_CASES)):
        _refuse_torch(
            results, [r[c][3] for r in results], f"gather, a {SHARD_CASES[c]} tensor", "ring_all_gather"
        )
    crossed = [
        sum(trace_stats.node_bytes(t, t_range=case[3])["inter"] for case in r)
        for t, r in zip(results.traces, results)
    ]
    if max(crossed) > 0:
        _fail(
            f"the values are right, but the gathers sent {max(crossed)} bytes across nodes",
            "HSDP gathers within the node only: group=mesh.get_group('shard')",
        )
    print(
        f"shard and gather within the node: right on all 4 ranks for {len(SHARD_CASES)} shapes; "
        f"0 bytes crossed nodes"
    )


# ---------------------------------------------------------------- 3. the gradient path
GRAD_CASES = (*SHARD_CASES[:2], (512, 256))  # the last, 512 KiB, for the bytes: headers are noise
GRAD_BYTES = 512 * 256 * 4


def _grad_rank(reduce_fn):
    from labkit.comm.hierarchical import node_mesh

    mesh, rank = node_mesh(), dist.get_rank()
    out = []
    for shape in GRAD_CASES:
        g = _data(shape, rank)
        got, window = _window(lambda: _attempt(reduce_fn, g.clone(), mesh))
        out.append((g, got, window))
    return out


def check_grad_path(reduce_fn):
    results = _run(_grad_rank, reduce_fn)
    _not_implemented([r[0][1] for r in results])
    for c, shape in enumerate(GRAD_CASES):
        gs = [r[c][0] for r in results]
        total, nodes = sum(gs), [gs[0] + gs[1], gs[2] + gs[3]]
        for rank, r in enumerate(results):
            got, local = r[c][1], rank % 2
            want = shard_rows(total, local, 2)
            where = f"rank {rank}, a {shape} gradient"
            if isinstance(got, str):
                _fail(f"{where}: {got}", _error_hint(got, shape[0]))
            if not isinstance(got, torch.Tensor):
                _fail(
                    f"{where}: returned {type(got).__name__}, expected a tensor",
                    "return this rank's shard of the summed gradient: a new tensor of ceil(rows / 2) rows",
                )
            if got.shape != want.shape:
                _fail(
                    f"{where}: shape {tuple(got.shape)}, expected the shard's {tuple(want.shape)}",
                    "return this rank's shard: ceil(rows / 2) rows (pad before the reduce-scatter)",
                )
            if torch.equal(got, want):
                continue
            if torch.equal(got, shard_rows(nodes[rank // 2], local, 2)):
                hint = (
                    "only your node's gradients: all-reduce the shard across nodes "
                    "(mesh.get_group('replicate'))"
                )
            elif torch.allclose(got * 2, want) or torch.allclose(got * 4, want):
                hint = "SUM, not AVG: the loop already divides each rank's loss by the global count"
            else:
                hint = (
                    "reduce-scatter within the node first (group 'shard'), then all-reduce "
                    "the shard across nodes (group 'replicate')"
                )
            _fail(
                f"{where}: wrong values (max |diff| {(got - want).abs().max():.3g})"
                if got.numel() > 64
                else f"{where}: {got.tolist()}, expected {want.tolist()}",
                hint,
            )
    _grad_bytes(results)
    _train_one_unit(reduce_fn)


def _grad_bytes(results):
    """Exercise 3's lesson is the bytes: only the shard's all-reduce crosses nodes (S/2 per rank
    for a gradient of S bytes: 2(2-1)/2 of the shard), and within the node only the
    reduce-scatter runs (S/2 per rank). Measured by the tracer in the 512 KiB case."""
    windows = [r[-1][2] for r in results]
    _refuse_torch(results, windows, f"a {GRAD_CASES[-1]} gradient", "ring_reduce_scatter and ring_all_reduce")
    crossed, inside = _node_bytes(results, windows, "inter"), _node_bytes(results, windows, "intra")
    shard, slack = GRAD_BYTES // 2, 1024  # the cross-rank checks' headers
    worst = max(crossed)
    said = (
        f"a {GRAD_BYTES // 1024} KiB gradient: per rank across nodes {crossed}, within {inside} "
        f"bytes; HSDP's path sends {shard} across (the shard's all-reduce) and {shard} within "
        f"(the reduce-scatter)"
    )
    if worst > shard + slack:
        if worst > 1.4 * GRAD_BYTES:  # a ring's boundary ranks send 1.5 S, a direct exchange 2 S
            hint = (
                f"one flat all-reduce over all 4 ranks, then a slice: {worst / shard:.1f}x the "
                f"bytes crossed nodes on the ranks at the node boundary. Reduce-scatter within the "
                f"node first (group 'shard'), then all-reduce only the shard across (group 'replicate')"
            )
        else:
            hint = (
                f"{worst / shard:.1f}x too many bytes crossed nodes: the whole gradient was "
                f"all-reduced across nodes (before the in-node reduce-scatter). Reduce-scatter "
                f"within the node first, then all-reduce only this rank's shard across nodes"
            )
        _fail(f"the values are right, but too many bytes crossed nodes: {said}", hint)
    if min(crossed) < shard - slack:
        _fail(
            f"the values are right, but too few bytes crossed nodes: {said}",
            "all-reduce the shard across nodes (group 'replicate') with labkit's ring_all_reduce",
        )
    if max(inside) > shard + slack:
        _fail(
            f"the values are right, but {max(inside) / shard:.1f}x the bytes moved within the node: {said}",
            "the gradient path ends at this rank's shard: no all-gather after the reduce-scatter "
            "(the next forward's gather brings the parameters back, not the gradients)",
        )
    print(
        f"gradient path: every rank's shard right ({len(GRAD_CASES)} shapes); labkit's collectives sent "
        f"{worst} bytes per rank across nodes for {GRAD_BYTES // 1024} KiB (the shard once, "
        f"{shard} B, and the cross-rank checks' headers)"
    )


def _train_one_unit(reduce_fn):
    from labkit import loop
    from labkit.checks import compare

    cfg = loop.PRESETS["toy"].replace(batch_size=8)
    reference = loop.reference(cfg, 2)
    results = _run(loop.train, hsdp_lab.OneUnitHSDP, cfg, 2, reduce_grad=reduce_fn)
    for rank, got in enumerate(results):
        compare(
            reference["grads"],
            got["grads"],
            rank=rank,
            world_size=4,
            label="OneUnitHSDP with your reduce_grad vs one process",
        ).raise_if_failed()
        compare(reference["state"], got["state"], rank=rank, world_size=4).raise_if_failed()
    print(
        "gradient path: every rank's shard right; OneUnitHSDP with it trains the toy model "
        "(tied, frozen and unused weights) equal to one process on 4 ranks as 2 x 2"
    )


# ---------------------------------------------------------------- 4. choosing the shard group
CHOICE_ROWS = [
    {"shard": 1, "step_s": 0.30, "state_bytes": 64e6},
    {"shard": 2, "step_s": 0.20, "state_bytes": 32e6},
    {"shard": 4, "step_s": 0.35, "state_bytes": 16e6},
    {"shard": 8, "step_s": 0.25, "state_bytes": 8e6},
]
# (budget, the answer): the least memory (8), the slowest that fits (4), the first row that fits
# (1 at 100 MB) and the fastest overall (2 at 20 MB) are each wrong somewhere; 32 MB is shard 2's
# state exactly (fits: <=); 5 MB fits no row
CHOICE_CASES = ((40e6, 2), (100e6, 2), (20e6, 8), (32e6, 2), (5e6, ValueError))
CHOICE_KEYS = "rows is a list of dicts with keys 'shard', 'step_s', 'state_bytes'"


def _choice_hint(got, budget, want):
    """The hint for choose(rows, budget) -> got where `want` was right (one per mistake)."""
    by_shard = {r["shard"]: r for r in CHOICE_ROWS}
    fits = [r for r in CHOICE_ROWS if r["state_bytes"] <= budget]
    if isinstance(got, dict):
        return "return the row's 'shard' (an int), not the row"
    if got not in by_shard:
        return f"return one row's 'shard' value; {CHOICE_KEYS}"
    row = by_shard[got]
    if any(r["state_bytes"] == budget for r in fits) and row["state_bytes"] < budget:
        return (
            f"shard {want} needs exactly the budget ({budget / 1e6:.0f} MB) and fits: a row fits "
            f"when state_bytes <= budget_bytes (<=, not <)"
        )
    if row["state_bytes"] > budget:
        return (
            f"shard {got} needs {row['state_bytes'] / 1e6:.0f} MB per rank, over the "
            f"{budget / 1e6:.0f} MB budget: keep only the rows whose state_bytes <= budget_bytes"
        )
    if row is fits[0]:
        return (
            "the first row that fits is not the fastest: among ALL the rows that fit, the one "
            "with the smallest step_s"
        )
    if row is min(fits, key=lambda r: r["state_bytes"]):
        return "the least memory is not the goal: the fastest size that fits the budget is"
    if row is max(fits, key=lambda r: r["step_s"]):
        return "the slowest row that fits: the smallest step_s (min, not max)"
    return "among the rows with state_bytes <= budget_bytes, the one with the smallest step_s"


def check_choice(choose):
    for budget, want in CHOICE_CASES:
        got = _attempt(choose, [dict(r) for r in CHOICE_ROWS], budget)
        _not_implemented([got])
        where = f"budget {budget / 1e6:.0f} MB"
        if want is ValueError:
            if isinstance(got, str) and got.startswith("raised ValueError"):
                continue
            _fail(
                f"{where}: no row fits, and it {got if isinstance(got, str) else f'returned {got!r}'}",
                "when no row's state fits the budget, raise ValueError (min() of an empty list does)",
            )
        if isinstance(got, str):
            hint = (
                CHOICE_KEYS
                if got.startswith("raised KeyError") or got.startswith("raised TypeError")
                else "see the error above"
            )
            _fail(f"{where}: {got}", hint)
        if got == want:
            continue
        _fail(f"{where}: chose shard size {got!r}, expected {want}", _choice_hint(got, budget, want))
    print(
        f"shard-group choice: right for budgets {[b / 1e6 for b, _ in CHOICE_CASES]} MB "
        "(the last fits no row: ValueError)"
    )
