"""Checks for the ZeRO lab's first two exercises, each failure naming the case (rank, tensor,
index, expected vs got) and a hint for the exercise's typical mistake:

- check_flat_partition(cls): the flat, padded partition (labkit.strategies.zero.FlatPartition's
  interface) on uneven sizes, with a frozen and a tied parameter: padding counted as a
  parameter's element, a range that runs into the padding, views that are copies;
- check_sharded_optimizer(cls): cls(params, optimizer_cls, **kwargs) with AdamW (two parameter
  groups of different lr and weight decay) and SGD with momentum, on every rank, against
  single-process training and torch's ZeroRedundancyOptimizer on the same run: a skipped
  all-gather, a parameter without a gradient (or the padding) moved by weight decay.
The ZeRO-1 / ZeRO-2 strategies' checks are in labkit.labs.zero_stage_checks.
Left out: timing; optimizers other than AdamW and SGD; state_dict round trips.
"""

import torch

from labkit import loop
from labkit.checks import compare
from labkit.strategies.zero import FlatPartition

# (sizes of the trainable tensors, world sizes): uneven on purpose; 0 and 1 elements too.
PARTITION_CASES = [
    ((10, 3, 7), (1, 2, 3, 4, 8)),
    ((5,), (2, 4)),
    ((1, 1, 1), (2, 5)),
    ((433, 64, 1), (2, 3, 8)),
    ((4, 4), (2, 4)),
]


def _partition_params(sizes):
    """Trainable tensors of `sizes`, a frozen one in the middle, and the first one twice (tied)."""
    params = [torch.arange(n, dtype=torch.float32).add(100 * i).requires_grad_() for i, n in enumerate(sizes)]
    frozen = torch.ones(6)  # requires_grad False: stays out of the partition
    return params[:1] + [frozen] + params[1:] + params[:1], params


def _partition_hint(what, want, got, ref):
    if what == "padded_numel" or what == "chunk":
        return "chunk = ceil(numel / world_size) and padded_numel = world_size * chunk: every chunk the same size"
    if what == "numel":
        return (
            "numel counts each trainable tensor once: skip requires_grad=False ones, and a tied "
            "tensor appears twice in the list but is one Parameter (deduplicate by identity)"
        )
    if what.startswith("rank_range"):
        if got[1] > ref.numel:
            return "end runs into the padding: clip the range to numel (padding is no parameter's element)"
        return "start = min(rank * chunk, numel), end = min(start + chunk, numel)"
    if what.startswith("segments"):
        if got and max(hi for _, _, hi in got) > ref.numel:
            return "a segment reaches into the padding: intersect each tensor's [offset, offset + numel) with rank_range(rank)"
        return (
            "one (param index, lo, hi) per tensor that intersects rank_range(rank): lo = max(offset, start), "
            "hi = min(offset + numel, end), empty pieces left out"
        )
    return ""


def check_flat_partition(cls):
    """cls(params, world_size) against FlatPartition on PARTITION_CASES: numel, chunk,
    padded_numel, rank_range and segments of every rank, and views that alias the flat buffer."""
    for sizes, world_sizes in PARTITION_CASES:
        for world_size in world_sizes:
            given, trainable = _partition_params(sizes)
            ref, got = FlatPartition(given, world_size), cls(given, world_size)
            case = f"sizes={list(sizes)} (plus a frozen and a tied tensor), world_size={world_size}"
            checks = [
                (name, getattr(ref, name), getattr(got, name, None))
                for name in ("numel", "chunk", "padded_numel")
            ]
            for rank in range(world_size):
                checks.append(
                    (f"rank_range({rank})", tuple(ref.rank_range(rank)), tuple(got.rank_range(rank)))
                )
                checks.append(
                    (
                        f"segments({rank})",
                        [tuple(s) for s in ref.segments(rank)],
                        [tuple(s) for s in got.segments(rank)],
                    )
                )
            for what, want, have in checks:
                if want != have:
                    hint = _partition_hint(what, want, have, ref)
                    raise AssertionError(
                        f"{case}: {what}: expected {want}, got {have}" + (f"\nhint: {hint}" if hint else "")
                    )
            flat = torch.arange(ref.padded_numel, dtype=torch.float32)
            views = list(got.views(flat))
            if len(views) != len(trainable):
                raise AssertionError(
                    f"{case}: views(flat) gave {len(views)} tensors, expected "
                    f"{len(trainable)} (one per trainable tensor, tied once)"
                )
            for i, (want, view, p) in enumerate(zip(ref.views(flat), views, trainable)):
                if view.shape != p.shape or not torch.equal(view, want):
                    raise AssertionError(
                        f"{case}: views(flat)[{i}]: expected flat[{ref.offsets[i]}:"
                        f"{ref.offsets[i] + ref.numels[i]}] shaped {tuple(p.shape)}, "
                        f"got {view.flatten()[:4].tolist()}... shaped {tuple(view.shape)}"
                    )
                if view.numel() and view.data_ptr() != want.data_ptr():
                    raise AssertionError(
                        f"{case}: views(flat)[{i}]: expected a view of flat[{ref.offsets[i]}:"
                        f"{ref.offsets[i] + ref.numels[i]}], got a tensor that is a copy\n"
                        f"hint: flat[o:o + n].view_as(p) shares flat's memory; "
                        f"torch.cat / .clone() / .reshape of a non-contiguous slice copy"
                    )
    return True


# ---------------------------------------------------------------- the sharded optimizer
def _optimizer_cases():
    """name -> (optimizer_cls, groups(model) -> param groups, kwargs): what the check runs."""

    def two_groups(model, decayed_lr=None, plain_lr=None):
        params = [p for p in model.parameters() if p.requires_grad]
        decayed = [p for p in params if p.dim() >= 2]
        plain = [p for p in params if p.dim() < 2]
        first = {"params": decayed, "weight_decay": 0.1} | ({"lr": decayed_lr} if decayed_lr else {})
        second = {"params": plain, "weight_decay": 0.0} | ({"lr": plain_lr} if plain_lr else {})
        return [first, second]

    return {
        "AdamW, 2 groups (wd 0.1 / 0.0, lr 1e-2 / 5e-3)": (
            torch.optim.AdamW,
            lambda m: two_groups(m, plain_lr=5e-3),
            dict(lr=1e-2, eps=1e-6),
        ),
        "SGD momentum 0.9, 2 groups (lr 0.1 / 0.05, wd 0.1 / 0.0)": (
            torch.optim.SGD,
            lambda m: two_groups(m, decayed_lr=0.1, plain_lr=0.05),
            dict(lr=0.1, momentum=0.9),
        ),
    }


def _full_batch_backward(model, cfg, step):
    x, y = loop.global_batch(cfg, step)
    (loop.summed_loss(model, cfg, x, y, step) / y.numel()).backward()


def _state_numel(opt):
    """Elements of the optimizer state this rank holds (Adam's moments, SGD's momentum; not the
    scalar step counts), read from opt.state (the exercise's class exposes its inner optimizer's)."""
    state = getattr(opt, "state", None)
    if isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optim"):  # ZeroRedundancyOptimizer
        state = opt.optim.state
    if not isinstance(state, dict):
        return None
    return sum(
        t.numel()
        for per_param in state.values()
        if isinstance(per_param, dict)
        for key, t in per_param.items()
        if key != "step" and isinstance(t, torch.Tensor)
    )


def sharded_optimizer_probe(cls, steps=3):
    """Rank function: each case trains the toy preset (frozen, tied, unused-on-even-steps, odd
    sizes) `steps` steps on the FULL batch (so every rank's gradient is the same: the contract)
    with cls, with ZeroRedundancyOptimizer and (for the comparison) single-process."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cfg = loop.PRESETS["toy"]
    out = {}
    for name, (optimizer_cls, groups, kwargs) in _optimizer_cases().items():
        runs = {}
        for kind in ("single", "torch", "yours"):
            model = loop.build_model(cfg)
            if kind == "single":
                opt = optimizer_cls(groups(model), **kwargs)
            elif kind == "torch":
                opt = ZeroRedundancyOptimizer(groups(model), optimizer_class=optimizer_cls, **kwargs)
            else:
                opt = cls(groups(model), optimizer_cls, **kwargs)
            for step in range(steps):
                for p in model.parameters():
                    p.grad = None
                _full_batch_backward(model, cfg, step)
                opt.step()
            flat = getattr(opt, "flat_param", None)
            runs[kind] = {
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "flat": None if flat is None else flat.detach().clone(),
                "numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "state_numel": _state_numel(opt),
            }
        out[name] = runs
    out["initial"] = {k: v.detach().clone() for k, v in loop.build_model(cfg).state_dict().items()}
    return out


# Toy parameters that get no gradient on some steps (labkit.models.ToyModel's `extra`).
_SOMETIMES_UNUSED = ("extra.",)


def _optimizer_hint(results, name, r, entry, initial):
    """The exercise's typical mistakes, recognised from the numbers."""
    world_size = len(results)
    mine = [res[name]["yours"]["state"] for res in results]
    differ = [k for k in range(1, world_size) if not compare(mine[0], mine[k], rtol=0, atol=0).ok]
    if differ or compare(initial, {entry.name: mine[r][entry.name]}, rtol=0, atol=0).ok:
        return (
            "the ranks hold different weights (or this one never moved): each rank stepped only "
            "its own chunk; forgot the all-gather of the updated chunks into flat_param?"
        )
    if entry.name.startswith(_SOMETIMES_UNUSED):
        return (
            "a parameter that had NO gradient in a step was still moved (weight decay or "
            "momentum): give the wrapped optimizer one piece per parameter segment, and set the "
            "piece's grad to None when p.grad is None, so it skips it as torch does"
        )
    return (
        "check which elements each piece reads from p.grad (start inside the parameter = flat "
        "lo - offset) and that every parameter group keeps its own options (lr, weight_decay)"
    )


def diagnose_sharded_optimizer(results):
    """'' when every rank matches single-process and ZeroRedundancyOptimizer, else one message."""
    initial = results[0]["initial"]
    for name in _optimizer_cases():
        for oracle, label in (("single", "single-process"), ("torch", "ZeroRedundancyOptimizer")):
            for r, res in enumerate(results):
                report = compare(
                    res[name][oracle]["state"],
                    res[name]["yours"]["state"],
                    rtol=1e-5,
                    atol=1e-6,
                    rank=r,
                    world_size=len(results),
                    label=f"{name}, 3 steps, vs {label}",
                )
                if not report.ok:
                    hint = _optimizer_hint(
                        results,
                        name,
                        r,
                        report.failures()[0] if report.failures() else report.entries[0],
                        initial,
                    )
                    return f"{report}\nhint ({name}): {hint}"
    n = len(results)
    for name in _optimizer_cases():
        for r, res in enumerate(results):
            held, whole = res[name]["yours"].get("state_numel"), res[name]["single"].get("state_numel")
            if held is not None and whole and n > 1 and held > 0.75 * whole:
                return (
                    f"rank {r}, {name}: the values are right, but this rank holds {held} elements of "
                    f"optimizer state, {held / whole:.0%} of one process's {whole} (its 1/{n} is about "
                    f"{whole / n:.0f})\nhint: every rank steps every rank's segments, so each keeps "
                    f"the whole state: build the inner optimizer over partition.segments(self.rank) "
                    f"only, and let the all-gather bring the other ranks' updated chunks"
                )
    for r, res in enumerate(results):
        yours = res[name]["yours"]
        pad = None if yours["flat"] is None else yours["flat"][yours["numel"] :]
        if pad is not None and pad.numel() and pad.any():
            k = int(pad.nonzero()[0])
            return (
                f"rank {r}, {name}: flat_param[{yours['numel'] + k}] (padding): expected 0, got "
                f"{pad[k].item():.6g}\nhint: the padding after the last real element is no "
                f"parameter: keep it zero and never give it to the optimizer (weight decay and "
                f"momentum would move it)"
            )
    return ""


def check_sharded_optimizer(cls, world_size=2):
    """cls(params, optimizer_cls, **kwargs) on real ranks: AdamW and SGD with momentum, two
    parameter groups each, element-wise against single-process and ZeroRedundancyOptimizer."""
    import labkit

    results = labkit.run(sharded_optimizer_probe, cls, world_size=world_size)
    problem = diagnose_sharded_optimizer(results)
    if problem:
        raise AssertionError(problem)
    return True


# ---------------------------------------------------------------- section 7: exercises with numbers
# The text's model: 12 GB weights, 12 GB gradients, 72 GB optimizer state, 8 ranks; ZeRO-3's
# largest unsharded group 3 GB and the prefetched one 3 GB.
MEMORY_EXERCISE = dict(weights_gb=12, grads_gb=12, optimizer_gb=72, world_size=8, group_gb=3, prefetch_gb=3)
MEMORY_HINTS = {
    "zero1": "ZeRO-1 shards only the optimizer state: weights and gradients stay whole",
    "zero2": "ZeRO-2 shards gradients and optimizer state, not the weights",
    "zero3": "ZeRO-3 shards all three",
    "zero3_peak": "steady state + the gathered group + the prefetched one",
}


def memory_answers(weights_gb, grads_gb, optimizer_gb, world_size, group_gb, prefetch_gb):
    """GB per rank: each stage's steady state, and ZeRO-3's peak lower bound."""
    zero3 = (weights_gb + grads_gb + optimizer_gb) / world_size
    return {
        "zero1": weights_gb + grads_gb + optimizer_gb / world_size,
        "zero2": weights_gb + (grads_gb + optimizer_gb) / world_size,
        "zero3": zero3,
        "zero3_peak": zero3 + group_gb + prefetch_gb,
    }


def check_memory_answers(answer):
    """answer() -> {"zero1", "zero2", "zero3", "zero3_peak"}: GB per rank (numbers)."""
    from labkit.checks import answer_numbers

    want = memory_answers(**MEMORY_EXERCISE)
    got = answer_numbers(answer(), list(want), "my_memory_answers()")
    for key, value in want.items():
        if not abs(got[key] - value) <= 1e-6 * value:
            raise AssertionError(f"{key}: got {got[key]:g} GB per rank\nhint: {MEMORY_HINTS[key]}")
    return True


REDUCE_SCATTER_INPUTS = [[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]]  # g0 on rank 0, g1 on rank 1


def reduce_scatter_on_ranks():
    """Rank function: what ring_reduce_scatter leaves on this rank, with SUM and with AVG."""
    import torch.distributed as dist
    from labkit.comm.collectives import ring_reduce_scatter

    g = torch.tensor(REDUCE_SCATTER_INPUTS[dist.get_rank()])
    out = {}
    for op in ("sum", "avg"):
        shard = torch.empty(2)
        ring_reduce_scatter(shard, g, op=op)
        out[op] = shard.tolist()
    return out


def check_reduce_scatter_answers(answer):
    """answer() -> {"sum": [rank 0's 2 numbers, rank 1's], "avg": [...]}, against real ranks."""
    import labkit
    from labkit.checks import answer_numbers

    got = answer_numbers(answer(), ["sum", "avg"], "my_reduce_scatter_answers()", shape=(2, 2))
    measured = labkit.run(reduce_scatter_on_ranks, world_size=2)
    for op in ("sum", "avg"):
        for rank in range(2):
            if any(abs(a - b) > 1e-6 for a, b in zip(got[op][rank], measured[rank][op])):
                raise AssertionError(
                    f"{op}, rank {rank}: you said {got[op][rank]}, the ranks computed {measured[rank][op]}"
                    + (
                        "\nhint: AVG is the SUM divided by N = 2"
                        if op == "avg"
                        else "\nhint: rank k keeps the k-th half, summed over ranks"
                    )
                )
    return True
