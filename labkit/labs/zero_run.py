"""ZeRO on real ranks: the rank function that tests, benchmarks/zero.py and the notebook share,
the single-process reference it is checked against, and the baselines it is compared with.

    results = labkit.run(train_zero, 1, steps=5, world_size=2)          # hand-written ZeRO-1
    ref = reference_run(steps=5)                                        # single process
    labkit.checks.check_close(ref["state"], results[0]["state"])

Strategies (the `stage` argument): 0 = hand-written DDP (labkit.strategies.ddp.DDPBucketed, AVG),
1 = ZeRO1, 2 = ZeRO2, "torch" = torch's DistributedDataParallel + ZeroRedundancyOptimizer.
Models (`kind`): "lab" (the lab's TinyGPT, big enough that model state outweighs activations),
"gpt" (TinyGPT's default config), "toy" (ToyModel: frozen, sometimes-unused, odd-sized params;
with extra_every=k the `extra` layer is used only on steps where step % k == 1).
Left out: gradient accumulation, checkpoints, a torchrun entry point of its own (train_zero works
under torchrun as is: it only needs an initialized process group).
"""
import contextlib
import time

import torch
import torch.distributed as dist

from labkit.data import get_batch, load_corpus, shard_batch
from labkit.models import (ADAMW_DEFAULTS, GPTConfig, TinyGPT, ToyModel, make_optimizer,
                           toy_batch, toy_loss, train_single_process)
from labkit.strategies.zero import ZeRO1, ZeRO2
from labkit.observe.tracing import span

# The lab's model: 4 layers of width 128 (0.8 M parameters, 13 MB of fp32 model state) on short
# sequences, so with a few sequences per rank the model state, not the activations, fills memory.
LAB_CONFIG = GPTConfig(d_model=128, n_heads=4, n_layers=4, seq_len=32)
STRATEGY_NAMES = {0: "DDP (hand-written)", 1: "ZeRO-1 (hand-written)", 2: "ZeRO-2 (hand-written)",
                  "torch": "DDP + ZeroRedundancyOptimizer"}


def build_model(kind="lab", seed=0):
    if kind == "toy":
        return ToyModel(seed=seed)
    return TinyGPT(LAB_CONFIG if kind == "lab" else GPTConfig(), seed=seed)


def global_batch(kind, step, batch_size, seed=0, extra_every=0):
    """(x, y, use_extra): the same global batch on every rank and in the reference."""
    use_extra = bool(kind == "toy" and extra_every and step % extra_every == 1)
    if kind == "toy":
        return (*toy_batch(step, batch_size, seed), use_extra)
    seq_len = (LAB_CONFIG if kind == "lab" else GPTConfig()).seq_len
    return (*get_batch(step, batch_size, seq_len, seed), use_extra)


def loss_of(model, batch):
    x, y, use_extra = batch
    if isinstance(getattr(model, "module", model), ToyModel):
        return toy_loss(model, (x, y), use_extra=use_extra)
    return model(x, y)[1]


def reference_run(kind="lab", steps=5, batch_size=8, lr=1e-2, seed=0, extra_every=0):
    """Single-process training on the whole global batch: {"losses", "state"}."""
    model = build_model(kind, seed)
    losses, state = train_single_process(
        model, lambda s: global_batch(kind, s, batch_size, seed, extra_every), steps, lr=lr,
        loss_fn=loss_of)
    return {"losses": losses, "state": state}


class _Strategy:
    """What the training loop needs from any strategy: the module to call, zero_grad, step."""

    def __init__(self, forward_module, zero_grad, step, optimizer, engine=None):
        self.forward_module, self.zero_grad, self.step = forward_module, zero_grad, step
        self.optimizer, self.engine = optimizer, engine


def make_strategy(stage, model, lr=1e-2, find_unused=False, step_fn=None):
    """stage 1 / 2 take step_fn(zero), a replacement for ZeRO1.step's body (the lab's exercise)."""
    if stage in (1, 2):
        zero = (ZeRO1 if stage == 1 else ZeRO2)(model, lr=lr, step_fn=step_fn)
        return _Strategy(model, zero.zero_grad, zero.step, zero.optimizer, zero)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if stage == 0:
        from labkit.strategies.ddp import DDPBucketed
        ddp = DDPBucketed(model, op="avg", find_unused_parameters=find_unused)
        optimizer = make_optimizer(trainable, lr=lr)

        def step():
            ddp.sync_gradients()
            with span("optimizer step"):
                optimizer.step()
        return _Strategy(model, lambda: optimizer.zero_grad(set_to_none=True), step, optimizer, ddp)
    if stage == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from labkit.strategies.ddp import TorchDDP
        ddp = TorchDDP(model, find_unused_parameters=find_unused)
        zro = ZeroRedundancyOptimizer(trainable, optimizer_class=torch.optim.AdamW, lr=lr,
                                      **ADAMW_DEFAULTS)
        # zro.optim is this rank's local AdamW: the one whose state the memory tracker must see.
        return _Strategy(ddp.model, lambda: zro.zero_grad(set_to_none=True), zro.step, zro.optim, zro)
    raise ValueError(f"stage must be 0, 1, 2 or 'torch', got {stage!r}")


@contextlib.contextmanager
def _phase(tracker, name, traced=True):
    # The update phase is not a span: its inner "optimizer step" span must be the compute bar,
    # between the reduce-scatter and the all-gather on the timeline.
    with span(name) if traced else contextlib.nullcontext(), (
            tracker.phase(name) if tracker is not None else contextlib.nullcontext()):
        yield


def train_zero(stage=1, steps=5, kind="lab", batch_size=8, lr=1e-2, seed=0, extra_every=0,
               track_memory=False, warmup=0, step_fn=None):
    """Rank function: train with strategy `stage` on this rank's shard of each global batch.

    Returns {"losses": this rank's loss per step, "state": model.state_dict() clone,
    "step_s": wall time per step (after `warmup` untimed steps), "after_step": bytes by category
    after the last step, "peak_bytes" (true high-water) and "peak_by_category" (None unless
    track_memory)}. With track_memory=True the MemoryTracker's
    record comes back in results.memory[rank] (phases forward / backward / update)."""
    from labkit.observe.memory import MemoryTracker
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if batch_size % world_size:
        raise ValueError(f"batch_size {batch_size} must be divisible by world_size {world_size}: "
                         f"the per-rank mean losses are averaged (AVG), which needs equal shards")
    model = build_model(kind, seed)
    strategy = make_strategy(stage, model, lr, find_unused=bool(extra_every), step_fn=step_fn)
    load_corpus()   # read (and cache) the 8 MB corpus before tracking: it is not training memory
    tracker = MemoryTracker(model=model, optimizer=strategy.optimizer) if track_memory else None
    losses, step_s, after_step = [], [], None
    with tracker if tracker is not None else contextlib.nullcontext():
        for step in range(warmup + steps):
            x, y, use_extra = global_batch(kind, step, batch_size, seed, extra_every)
            batch = (*shard_batch(x, y, rank, world_size), use_extra)
            start = time.perf_counter()
            with span("step"):
                strategy.zero_grad()
                with _phase(tracker, "forward"):
                    loss = loss_of(strategy.forward_module, batch)
                with _phase(tracker, "backward"):
                    loss.backward()
                with _phase(tracker, "update", traced=False):
                    strategy.step()
            if step >= warmup:
                step_s.append(time.perf_counter() - start)
                losses.append(loss.item())
            del loss
            if tracker is not None:
                tracker.mark("after step")
                after_step = tracker.samples[-1].by_category
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    peak = tracker.peak() if tracker is not None else None
    return {"losses": losses, "state": state, "step_s": step_s, "after_step": after_step,
            "peak_bytes": peak.total if peak else None,
            "peak_by_category": peak.by_category if peak else None}


def wire_bytes(trace, in_steps=True):
    """Bytes this rank sent, from its trace: a ring all-reduce of S bytes sends 2(n-1)/n S,
    a reduce-scatter or all-gather of S (full tensor) sends (n-1)/n S. in_steps: count only
    collectives inside the "step" spans (not DDP's start-up broadcast)."""
    windows = [(sp["start"], sp["end"]) for sp in trace["spans"] if sp["name"] == "step"]
    total = 0.0
    for ev in trace["events"]:
        if in_steps and not any(lo <= ev["start"] <= hi for lo, hi in windows):
            continue
        n = ev.get("world_size", trace["world_size"])
        if "all_reduce" in ev["op"]:
            total += ev["nbytes"] * 2 * (n - 1) / n
        elif "reduce_scatter" in ev["op"] or "all_gather" in ev["op"]:
            total += ev["nbytes"] * (n - 1) / n
    return total
