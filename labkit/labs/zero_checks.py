"""Checks for the ZeRO lab's exercises, with hints tied to the lab's common mistakes:
SUM where AVG was meant, no all-gather after the step (ranks' parameters differ), a wrong shard
range or padding left in, and (ZeRO-2) a full gradient that is still alive after the step.

Each check raises AssertionError with a precise message; labkit.exercise.check prints it.
Left out: checks of timing or overlap (the 2-core machine is too noisy for them).
"""
import torch
import torch.distributed as dist

from labkit import loop
from labkit.checks import compare
from labkit.comm.collectives import shard_range
from labkit.data import shard_batch
from labkit.strategies.zero import FlatPartition, ZeRO1, ZeRO2

SHARD_RANGE_CASES = [(10, 4), (8, 4), (3, 4), (433, 2), (433, 3), (433, 8), (0, 2), (1, 1)]


def check_shard_range(fn):
    """fn(numel, rank, world_size) -> (start, end, padded_numel), compared on uneven cases."""
    for numel, world_size in SHARD_RANGE_CASES:
        for rank in range(world_size):
            want, got = shard_range(numel, rank, world_size), tuple(fn(numel, rank, world_size))
            if got == want:
                continue
            where = f"numel={numel}, rank={rank}, world_size={world_size}: expected {want}, got {got}"
            if got[2] != want[2]:
                hint = "padded_numel = world_size * ceil(numel / world_size): every chunk the same size"
            elif got[1] > numel:
                hint = "end runs past numel: padding not removed (clip the range to [0, numel))"
            elif got[0] != want[0]:
                hint = "start = rank * chunk (clipped to numel), chunk = ceil(numel / world_size)"
            else:
                hint = "end = min(start + chunk, numel): the last ranks' chunks are partly padding"
            raise AssertionError(f"wrong shard range for {where}\nhint: {hint}")
    return True


def _preset(kind, batch_size):
    """The probe's labkit.loop preset: the toy's hard cases, or the ZeRO lab's TinyGPT ("zero")."""
    return loop.PRESETS["toy" if kind == "toy" else "zero"].replace(batch_size=batch_size)


def _mean_loss(model, cfg, x, y):
    """This rank's MEAN loss on step 0: the exercise's AVG convention (equal shards)."""
    return loop.summed_loss(model, cfg, x, y, 0) / y.numel()


def zero_step_probe(step_fn, stage=1, kind="toy", batch_size=8):
    """Rank function: one step (step 0 of labkit.loop's preset, its AdamW) of ZeRO1/ZeRO2 whose
    step() body is `step_fn(zero)`, taken apart so that a wrong step is diagnosed, not crashed on.
    Returns this rank's gradient shard, its state after the step, and its gradient bytes."""
    from labkit.observe.memory import MemoryTracker
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = _preset(kind, batch_size)
    model = loop.build_model(cfg)
    zero = (ZeRO1 if stage == 1 else ZeRO2)(model, step_fn=step_fn, verify=True,
                                            optimizer_factory=cfg.make_optimizer)
    x, y = loop.global_batch(cfg, 0)
    with MemoryTracker(model=model, optimizer=zero.optimizer) as tracker:
        zero.zero_grad()
        _mean_loss(model, cfg, *shard_batch(x, y, rank, world_size)).backward()
        zero.step()
        grad_bytes = tracker.current().by_category["gradients"]
    shard = None if zero.grad_shard is None else zero.grad_shard.detach().clone()
    return {"grad_shard": shard, "chunk": zero.partition.chunk, "grad_bytes": grad_bytes,
            "state": {n: t.detach().clone() for n, t in model.state_dict().items()}}


def _grad_chunks(kind, batch_size, world_size, rank=None):
    """The whole-batch gradient (rank=None) or `rank`'s local one, flattened and cut the way
    FlatPartition cuts it."""
    cfg = _preset(kind, batch_size)
    model = loop.build_model(cfg)
    x, y = loop.global_batch(cfg, 0)
    if rank is not None:
        x, y = shard_batch(x, y, rank, world_size)
    _mean_loss(model, cfg, x, y).backward()
    partition = FlatPartition(model.parameters(), world_size)
    flat = partition.flatten([p.grad for p in partition.params])
    return [flat[partition.chunk_slice(r)] for r in range(world_size)]


def _same(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def _shard_hint(got, rank, expected, local):   # local: this rank's unreduced gradient chunk
    """What a wrong gradient shard is, when it is something the lab's mistakes produce."""
    for k, chunk in enumerate(expected):
        if k != rank and _same(got, chunk):
            return (f"hint: rank {rank} holds chunk {k} of the averaged gradient: it must keep "
                    f"its own chunk, zero.partition.chunk_slice(zero.rank)")
    if _same(got, local):
        return ("hint: this is the rank's own local gradient chunk, not reduced: reduce-scatter "
                "zero.flat_grad into zero.grad_shard (or use the output you reduced into)")
    return ""


def _who(ranks):
    return f"ranks {', '.join(map(str, ranks))}" if len(ranks) > 1 else f"rank {ranks[0]}"


def diagnose_zero_step(results, stage=1, kind="toy", batch_size=8):
    """One message for the first half of the step that is wrong ('' when all is right): the
    reduce-scatter (gradient shards), then the all-gather (parameters), then ZeRO-2's freeing."""
    world_size = len(results)
    missing = [r for r, got in enumerate(results) if got["grad_shard"] is None]
    if missing:
        return (f"{_who(missing)}: zero.grad_shard is None after the step: reduce-scatter the "
                f"flat gradient into zero.grad_shard")
    expected = _grad_chunks(kind, batch_size, world_size)
    reports = [compare(expected[r], got["grad_shard"], rtol=1e-5, atol=1e-7, rank=r, names=["zero.grad_shard"],
                       world_size=world_size, label="gradient shard after the reduce-scatter")
               for r, got in enumerate(results)]
    bad = [r for r, rep in enumerate(reports) if not rep.ok]
    if bad:
        r = bad[0]
        local = _grad_chunks(kind, batch_size, world_size, rank=r)[r]
        hint = _shard_hint(results[r]["grad_shard"], r, expected, local)
        return "\n".join(x for x in (f"reduce-scatter wrong on {_who(bad)} (shown: rank {r})",
                                     str(reports[r]), hint) if x)
    reference = loop.reference(_preset(kind, batch_size), 1)["state"]
    reports = [compare(reference, got["state"], rtol=1e-5, atol=1e-6, rank=r,
                       world_size=world_size, label="parameters after the step")
               for r, got in enumerate(results)]
    bad = [r for r, rep in enumerate(reports) if not rep.ok]
    if bad:
        r = bad[0]
        differ = [k for k in range(1, world_size)
                  if not compare(results[0]["state"], results[k]["state"], rtol=0, atol=0).ok]
        hint = (f"hint: the gradient shards were right, but rank 0 and {_who(differ)} hold "
                f"different parameters: each rank updated only its own chunk; forgot the "
                f"all-gather after the step?" if differ else
                "hint: the gradient shards were right and the ranks agree with each other, but "
                "not with single-process training: check what the all-gather sends "
                "(zero.param_shard, after zero.local_step()) and where it lands (zero.flat_param)")
        return "\n".join((f"parameters wrong on {_who(bad)} (shown: rank {r})", str(reports[r]), hint))
    if stage == 2:
        chunk_bytes = results[0]["chunk"] * 4
        alive = [r for r, got in enumerate(results)
                 if abs(got["grad_bytes"] - chunk_bytes) > 0.01 * chunk_bytes]
        if alive:
            return (f"{_who(alive)}: {results[alive[0]]['grad_bytes']} gradient bytes alive after "
                    f"the step, expected one chunk ({chunk_bytes} B)\nhint: after the "
                    f"reduce-scatter set every p.grad = None and drop zero.flat_grad, so only "
                    f"zero.grad_shard survives")
    return ""


def check_zero_step(step_fn, world_size=2, stage=1, kind="toy", batch_size=8):
    """Run one step with `step_fn` on real ranks and compare with single-process training;
    one AssertionError naming the first wrong half and every rank that got it wrong."""
    import labkit
    results = labkit.run(zero_step_probe, step_fn, stage=stage, kind=kind, batch_size=batch_size,
                         world_size=world_size)
    problem = diagnose_zero_step(results, stage, kind, batch_size)
    if problem:
        raise AssertionError(problem)
    return True
