"""One training loop for the hand-written FSDP and for PyTorch's fully_shard (FSDP2), so the lab,
the tests and the benchmark compare the two on the same model, data and optimizer.

    results = labkit.run(train_sharded, "hand", steps=5, world_size=2)
    losses, state = train_reference(steps=5)          # labkit.labs.ddp_run's reference
    check_close(state, results[0]["state"], rank=0)

Each rank sums the token losses of its own sequences and divides by the MEAN token count per
rank (global tokens / N); the gradient reduction averages over ranks, so the result is the global
token mean even when the batch does not split evenly (8 rows on 3 ranks). With K micro-batches
each one's summed loss gets the same divisor, so K micro-batches add up to the same mean.

What it leaves out: batches smaller than N*K (a rank or micro-batch with no rows),
learning-rate schedules, gradient clipping, evaluation.
"""
import statistics
import time

import torch
import torch.distributed as dist

from labkit.observe import tracing
from labkit.data import load_corpus, micro_batches, shard_batch
from labkit.observe.memory import MemoryTracker
from labkit.models import make_optimizer
from labkit.labs.ddp_run import LAB_EPS, build_model, global_batch, train_reference  # noqa: F401
from labkit.strategies.fsdp import fully_shard_by_hand, plan_units


def shard_with_torch(model, units="block", reshard_after_forward=True, prefetch=1):
    """fully_shard (FSDP2) on the same units as fully_shard_by_hand, on a gloo CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    unit_modules = plan_units(model, units)
    for module in unit_modules:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    # FSDP2 prefetches one unit ahead implicitly; deeper prefetch is an explicit list per unit.
    if prefetch > 1:
        for i, module in enumerate(unit_modules):
            module.set_modules_to_forward_prefetch(unit_modules[i + 1:i + 1 + prefetch])
            module.set_modules_to_backward_prefetch(unit_modules[max(0, i - prefetch):i][::-1])
    return model


def _full_state(kind, net):
    if kind == "hand":
        return net.full_state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in net.state_dict().items()}


def train_sharded(kind="hand", steps=5, *, batch_size=8, lr=1e-2, seed=0, gpt_config=None,
                  units="block", reshard_after_forward=True, prefetch=1, max_inflight=2,
                  accumulation=1, reshard_between_micro_batches=True, reduce_op="avg",
                  track_memory=False, spans=False, return_state=True, optimizer_first=False,
                  reshard_after_backward=True, shard_data=True):
    """Train TinyGPT with FSDP on this rank. kind: "hand" (fully_shard_by_hand) or "torch".

    Returns a dict: losses (global mean per step), state (full, on every rank) unless
    return_state=False, step_s (wall time per step), peak / peak_by_category (labkit.observe.memory, only
    with track_memory), gathers / reduce_scatters per step (hand-written only).
    Debug drills: optimizer_first=True builds the optimizer BEFORE sharding; reshard_after_backward
    =False never frees a unit's gathered weights after backward (with reshard_after_forward=False:
    nothing is ever resharded); shard_data=False gives every rank the same rows (rank 0's share of
    the batch), what a DataLoader without a DistributedSampler does."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model("gpt", seed, gpt_config)
    early_optimizer = make_optimizer(model.parameters(), lr, eps=LAB_EPS) if optimizer_first else None
    if kind == "hand":
        net = fully_shard_by_hand(model, units=units, reshard_after_forward=reshard_after_forward,
                                  prefetch=prefetch, max_inflight=max_inflight, reduce_op=reduce_op,
                                  reshard_after_backward=reshard_between_micro_batches, spans=spans)
    else:
        net = shard_with_torch(model, units, reshard_after_forward, prefetch)
    opt = early_optimizer or make_optimizer([p for p in net.parameters() if p.requires_grad], lr, eps=LAB_EPS)
    load_corpus()   # the corpus (8 MB of token ids) is read once per process: not the strategy's memory
    tracker = None
    if track_memory and kind == "hand":
        # The shards are the parameters; the module's gathered views are tagged all_gather by net.
        tracker = MemoryTracker(optimizer=opt, device="cpu")
        tracker.register(list(net.flat_shards), "parameters")
        net.track_memory(tracker)
    elif track_memory:
        tracker = MemoryTracker(model=net, optimizer=opt)
    losses, step_s = [], []
    with (tracker if tracker is not None else _nothing()):
        for step in range(steps):
            start = time.perf_counter()
            with tracing.span("step"):
                _one_step(kind, net, opt, step, rank, world_size, batch_size, seed, gpt_config,
                          accumulation, reshard_between_micro_batches, tracker, losses,
                          reshard_after_backward=reshard_after_backward, shard_data=shard_data)
            step_s.append(time.perf_counter() - start)
    out = {"losses": losses, "step_s": step_s}
    if kind == "hand":
        out.update(gathers=net.gathers_issued / steps, reduce_scatters=net.reduce_scatters_issued / steps)
    if tracker is not None:
        peak = tracker.peak()
        out.update(peak=peak.total, peak_by_category=peak.by_category, memory=tracker.record())
    if return_state:
        out["state"] = _full_state(kind, net)
    return out


def _one_step(kind, net, opt, step, rank, world_size, batch_size, seed, gpt_config, accumulation,
              reshard_between, tracker, losses, *, reshard_after_backward=True, shard_data=True):
    batch = global_batch(step, "gpt", batch_size, seed, gpt_config)
    x, y = shard_batch(*batch, rank if shard_data else 0, world_size)
    # The reduce-scatter AVERAGES over ranks, so each rank divides its summed loss by the mean
    # token count per rank, not by its own: with an uneven split (8 rows on 3 ranks: 3, 3, 2) its
    # own count would weight the 2-row rank's tokens 1.5x the others'. Even splits: the same number
    # as before, bit for bit.
    per_rank_tokens = batch[1].numel() / world_size
    opt.zero_grad(set_to_none=True)
    total = torch.zeros(())
    pieces = micro_batches(x, y, accumulation)
    for i, (mx, my) in enumerate(pieces):
        last = i == len(pieces) - 1
        # Both reduce-scatter after every micro-batch (the gradients must stay sharded); whether
        # the parameters are freed between micro-batches is the knob.
        reshard = reshard_after_backward and (last or reshard_between)
        if kind == "torch":
            net.set_reshard_after_backward(reshard)
        else:
            net.reshard_after_backward = reshard
        with _phase(tracker, "forward"), tracing.span("forward"):
            loss = net(mx, my, reduction="sum")[1] / per_rank_tokens
        with _phase(tracker, "backward"), tracing.span("backward"):
            loss.backward()
        total += loss.detach()
    with _phase(tracker, "optimizer"), tracing.span("optimizer"):
        opt.step()
    with tracing.untraced():   # the loss report is not part of the strategy's traffic
        dist.all_reduce(total)
    losses.append(total.item() / world_size)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _phase(tracker, name):
    return tracker.phase(name) if tracker is not None else _nothing()


def sweep(configs, **common):
    """train_sharded once per config (a dict of overrides), on the same ranks: one launch."""
    return [train_sharded(**{**common, **config}) for config in configs]


def median_step(result, skip=1):
    """Median step time of one rank's result, skipping the first `skip` steps (warm-up)."""
    return statistics.median(result["step_s"][skip:] or result["step_s"])


def unit_sizes(model, units="block"):
    """numel per unit, root first (the tied embedding counted once), as fully_shard_by_hand cuts."""
    unit_modules = plan_units(model, units)
    inner = {id(p) for m in unit_modules for p in m.parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    sizes = [sum(p.numel() for p in trainable if id(p) not in inner)]
    sizes += [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in unit_modules]
    return sizes


def peak_formula(model, world_size, units="block", prefetch=1, activation_bytes=0):
    """M_peak ≈ (4+4+8)P/N shards + root + largest unit + prefetch buffers + that unit's gradient
    temporaries (the unsharded grads and the padded reduce-scatter input) + activations, fp32.
    The root counts whole because it stays gathered from the first forward to its backward."""
    sizes = unit_sizes(model, units)
    total = sum(sizes)
    pad = -(-total // world_size) * world_size
    largest = max(sizes[1:] or [0])
    parts = {"shards 16P/N": 16 * pad / world_size, "root (gathered)": 4 * sizes[0],
             "largest unit": 4 * largest, "prefetch": 4 * largest * min(prefetch, len(sizes) - 2),
             "grad temporaries": 2 * 4 * largest, "activations": activation_bytes}
    return sum(parts.values()), parts
