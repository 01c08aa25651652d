"""Checks for the ZeRO lab's exercises, with hints tied to the lab's common mistakes:
SUM where AVG was meant, no all-gather after the step (ranks' parameters differ), a wrong shard
range or padding left in, and (ZeRO-2) a full gradient that is still alive after the step.

Each check raises AssertionError with a precise message; labkit.exercise.check prints it.
Left out: checks of timing or overlap (the 2-core machine is too noisy for them).
"""
import torch
import torch.distributed as dist

from labkit.checks import compare
from labkit.collectives import shard_range
from labkit.data import shard_batch
from labkit.strategies.zero import FlatPartition, ZeRO1, ZeRO2
from labkit.strategies.zero_run import build_model, global_batch, loss_of, reference_run

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


def zero_step_probe(step_fn, stage=1, kind="toy", batch_size=8, lr=1e-2):
    """Rank function: one step of ZeRO1/ZeRO2 whose step() body is `step_fn(zero)`.
    Returns this rank's gradient shard, its state after the step, and its gradient bytes."""
    from labkit.memory import MemoryTracker
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(kind)
    zero = (ZeRO1 if stage == 1 else ZeRO2)(model, lr=lr, step_fn=step_fn, verify=True)
    x, y, use_extra = global_batch(kind, 0, batch_size)
    with MemoryTracker(model=model, optimizer=zero.optimizer) as tracker:
        zero.zero_grad()
        loss_of(model, (*shard_batch(x, y, rank, world_size), use_extra)).backward()
        zero.step()
        grad_bytes = tracker.current().by_category["gradients"]
    shard = None if zero.grad_shard is None else zero.grad_shard.detach().clone()
    return {"grad_shard": shard, "chunk": zero.partition.chunk, "grad_bytes": grad_bytes,
            "state": {n: t.detach().clone() for n, t in model.state_dict().items()}}


def _expected_grad_chunks(kind, batch_size, world_size):
    """The whole-batch gradient, flattened and cut the way FlatPartition cuts it."""
    model = build_model(kind)
    loss_of(model, global_batch(kind, 0, batch_size)).backward()
    partition = FlatPartition(model.parameters(), world_size)
    flat = partition.flatten([p.grad for p in partition.params])
    return [flat[partition.chunk_slice(r)] for r in range(world_size)]


def check_zero_step(step_fn, world_size=2, stage=1, kind="toy", batch_size=8):
    """Run one step with `step_fn` on real ranks and compare with single-process training."""
    import labkit
    results = labkit.run(zero_step_probe, step_fn, stage=stage, kind=kind, batch_size=batch_size,
                         world_size=world_size)
    expected = _expected_grad_chunks(kind, batch_size, world_size)
    for rank, got in enumerate(results):
        if got["grad_shard"] is None:
            raise AssertionError(f"rank {rank}: zero.grad_shard is None after the step: "
                                 f"reduce-scatter the flat gradient into zero.grad_shard")
        report = compare(expected[rank], got["grad_shard"], rtol=1e-5, atol=1e-7, rank=rank,
                         world_size=world_size, label="gradient shard after the reduce-scatter")
        if not report.ok:
            raise AssertionError(str(report))
    reference = reference_run(kind, steps=1, batch_size=batch_size)["state"]
    for rank, got in enumerate(results):
        report = compare(reference, got["state"], rtol=1e-5, atol=1e-6, rank=rank,
                         world_size=world_size, label="parameters after the step")
        if not report.ok:
            others = compare(results[0]["state"], got["state"], rtol=0, atol=0)
            hint = ("\nhint: ranks hold different parameters: each rank updated only its own chunk - "
                    "forgot the all-gather after the step?" if not others.ok or rank == 0 else "")
            raise AssertionError(str(report) + hint)
    if stage == 2:
        chunk_bytes = results[0]["chunk"] * 4
        for rank, got in enumerate(results):
            if abs(got["grad_bytes"] - chunk_bytes) > 0.01 * chunk_bytes:
                raise AssertionError(
                    f"rank {rank}: {got['grad_bytes']} gradient bytes alive after the step, expected "
                    f"one chunk ({chunk_bytes} B)\nhint: after the reduce-scatter set every p.grad = "
                    f"None and drop zero.flat_grad, so only zero.grad_shard survives")
    return True
