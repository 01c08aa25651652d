"""The one training loop: notebooks, tests, benchmarks and `python -m labkit` (labkit.cli, torchrun) all run it.

    from labkit import loop
    cfg = loop.PRESETS["fsdp"]
    ref = loop.reference(cfg, steps=5)          # single process: {"losses", "state", "grads"}
    out = labkit.run(loop.train, "fsdp", cfg, steps=5, world_size=2)   # per rank, same keys

A Preset holds everything that must be identical on every rank and in the reference: the model,
the global batch, the seed, the dtype and the optimizer. The loss convention, in `summed_loss` and
`train` only: each rank sums its token losses and divides by the GLOBAL token count, and gradients
are SUM-reduced, so the ranks' gradients add up to the gradient of the global-batch mean for any
split (7 rows on 2 ranks) and any number of micro-batches. A strategy that averages (reduce_op
"avg", like torch's) gets that loss multiplied by the world size, here and nowhere else.

One step is `train_step(strategy, batch, cfg)`: zero_grad; forward_backward (every micro-batch's
forward and backward, all but the last inside no_sync: Strategy's default); after_backward; step.
The data is split over the strategy's data-parallel coordinates (data_rank, data_world_size):
tensor-parallel ranks of one replica see the same rows, and the loss counts each replica once. That is the part to read;
`train` around it makes the batches, times the steps, observes and reports.

Strategies: a name in labkit.strategies.NAMES, or a class with the interface documented in
labkit.strategies. Observation is an option of this loop, not a copy of it: spans (timeline; a
strategy's own, e.g. FSDP's per unit, through its observe hook), track_memory
(labkit.observe.memory), per-step wall time (always). What callers plug in is one loop.Hooks:
shard (the sampler; the drills pass wrong ones), warmup (benchmarks), report (a strategy's
counters), first_step / after_step (resuming and saving a checkpoint:
labkit.labs.checkpoint_runs.train_resumable); sweep() runs several trainings in one launch.
What it leaves out: learning-rate schedules, gradient clipping, evaluation, ranks without rows
(batch_size < world_size * accum_steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit import strategies
from labkit.data import get_batch, micro_batches, shard_batch
from labkit.models import TinyGPT, ToyModel, toy_batch
from labkit.observe import tracing

# Preset and PRESETS live in the base layer (labkit.preset), so the strategies check the same
# class; EPS, OPTIMIZER_KWARGS, Preset and PRESETS stay names of labkit.loop too.
from labkit.preset import EPS, OPTIMIZER_KWARGS, PRESETS, Preset, check_preset

__all__ = [
    "EPS",
    "OPTIMIZER_KWARGS",
    "PRESETS",
    "Batch",
    "Hooks",
    "Preset",
    "build_model",
    "global_batch",
    "reference",
    "summed_loss",
    "sweep",
    "train",
    "train_each",
    "train_step",
]


def build_model(cfg: Preset, device: torch.device | str | None = None) -> nn.Module:
    """The preset's model, in its dtype, on `device`; a pure function of cfg.seed."""
    model: nn.Module
    if cfg.model == "toy":
        model = ToyModel(seed=cfg.seed, tied=True)
    elif cfg.model == "gpt":
        config = cfg.gpt_config()
        if config.n_experts:  # MoE blocks (the "moe" preset): their layer is a strategy family's
            from labkit.strategies.ep.moe import moe_mlp

            model = TinyGPT(config, seed=cfg.seed, mlp=moe_mlp)
        else:
            model = TinyGPT(config, seed=cfg.seed)
    else:
        raise ValueError(f"Preset.model must be 'gpt' or 'toy', got {cfg.model!r}")
    if cfg.activation_checkpointing:
        from labkit.strategies.activation_checkpointing import checkpoint_blocks

        if not hasattr(model, "blocks"):
            raise ValueError(f"activation_checkpointing checkpoints model.blocks; {cfg.model!r} has none")
        checkpoint_blocks(model)
    return model.to(dtype=cfg.dtype, device=device)


def global_batch(cfg: Preset, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch (x, y) of `step`, identical on every rank and in the reference."""
    if cfg.model == "toy":
        return tuple(t.to(cfg.dtype) for t in toy_batch(step, cfg.batch_size, seed=cfg.seed))
    return get_batch(step, cfg.batch_size, cfg.seq_len, seed=cfg.seed)


def summed_loss(
    net: Callable[..., Any], cfg: Preset, x: torch.Tensor, y: torch.Tensor, step: int
) -> torch.Tensor:
    """SUM (not mean) of the token (toy: element) losses of rows x, y at `step`, in fp32 at least
    (float inputs are cast to the compute dtype first, as FSDP2's cast_forward_inputs does)."""
    if cfg.model == "toy":
        use_extra = bool(cfg.extra_every) and step % cfg.extra_every == 1
        out = net(x.to(cfg.compute_dtype), use_extra=use_extra)
        if out.dtype in (torch.float16, torch.bfloat16):  # the loss in fp32, as autocast does
            out = out.float()
        return F.mse_loss(out, y.to(out.dtype), reduction="sum")
    return net(x, y, reduction="sum")[1]


def reference(cfg: Preset, steps: int | None = None) -> dict[str, Any]:
    """Single-process training on the whole global batch: {"losses", "state", "grads"}; grads
    are step 0's (before the optimizer moves anything: they catch a SUM-vs-AVG slip, which AdamW's
    scale invariance would hide in the state)."""
    check_preset(cfg, "loop.reference")
    model = build_model(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = None
    if cfg.mp is not None:  # the same casts as every strategy's: fp32 masters, 16-bit compute
        from labkit.strategies.precision import MasterWeights

        masters = MasterWeights.of_module(model, cfg.mp, params)
        params = masters.masters
    optimizer = cfg.make_optimizer(params)
    losses, grads = [], None
    for step in range(_check_steps(cfg.steps if steps is None else steps, "steps", "loop.reference")):
        x, y = global_batch(cfg, step)
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        loss = summed_loss(model, cfg, x, y, step) / y.numel()
        (masters.scale_loss(loss) if masters else loss).backward()
        if masters is not None:  # one rank's "reduction": the 16-bit gradient into fp32
            masters.load_grads()
        if step == 0:
            grads = strategies.replica_grads(model)
            if masters is not None:  # the fp32 gradient the optimizer sees, unscaled
                names = {id(p): n for n, p in model.named_parameters()}
                scale = masters.scaler.scale if masters.scaler else 1.0
                grads = {
                    names[id(p)]: m.grad.clone() / scale
                    for p, m in zip(masters.params, masters.masters)
                    if m.grad is not None
                }
        if masters is not None:
            masters.step(optimizer)
        else:
            optimizer.step()
        losses.append(loss.item())
    state = (
        masters.state_dict(model)
        if masters is not None  # the fp32 masters: the weights
        else {k: v.detach().clone() for k, v in model.state_dict().items()}
    )
    return {"losses": losses, "grads": grads, "state": state}


@dataclasses.dataclass
class Batch:
    """One step's data on this rank: its micro-batches [(x, y), ...] (on its device), the GLOBAL
    batch's token count (what every rank's summed loss is divided by) and the step number (the
    toy's sometimes-unused layer follows it)."""

    parts: list[tuple[torch.Tensor, torch.Tensor]]
    count: int
    step: int


def train_step(
    s: strategies.Strategy,
    batch: Batch,
    cfg: Preset,
    *,
    scale: float = 1,
    watch: strategies.Watch = strategies.unwatched,
) -> torch.Tensor:
    """One optimizer step of strategy `s` on this rank's `batch`: what every strategy lives in.
    scale: what the loss is multiplied by (the data-parallel world size for a strategy that
    averages); watch(phase) is a context around each phase (the loop's spans and memory phases).
    Returns this rank's share of the global-batch mean loss (a float64 tensor)."""

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return summed_loss(s, cfg, x, y, batch.step) / batch.count

    s.zero_grad()
    # Every micro-batch's forward and backward, all but the last inside no_sync() (the strategy's
    # forward_backward; Strategy's default is that loop, strategies.Strategy.forward_backward).
    total = s.forward_backward(batch.parts, loss_fn, scale=scale, watch=watch)
    with watch("sync"):  # the gradient communication still in flight, finished
        s.after_backward()
    with watch("optimizer"):
        s.step()
    return total


class _Watched:
    """Two contexts entered as one (a span and a memory phase)."""

    def __init__(self, *contexts: ContextManager[Any]) -> None:
        self.contexts = contexts

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What a caller plugs into loop.train around the steps; Hooks() trains plainly.

    shard(x, y, rank, world_size): this rank's rows of the global batch (the sampler: a drill
        passes a wrong one); rank and world_size are the strategy's data-parallel coordinates
        (data_rank(), data_world_size(): tensor-parallel ranks of one replica get the same rows);
    warmup: steps run first and left out of the timings (a benchmark's);
    first_step: the data position to start from (a resumed run's);
    after_step(strategy, steps_done): runs after every step (a checkpoint's save);
    report(strategy) -> dict: called after the last step, merged into the result (e.g.
        labkit.strategies.fsdp.collective_counts)."""

    shard: Callable[..., Any] = shard_batch
    warmup: int = 0
    first_step: int = 0
    after_step: Callable[..., Any] | None = None
    report: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        _check_steps(self.warmup, "Hooks.warmup")
        _check_steps(self.first_step, "Hooks.first_step")
        for name in ("shard", "after_step", "report"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(
                    f"loop.Hooks: {name} must be callable (see its docstring), got "
                    f"{type(value).__name__} {value!r}"
                )
        if self.shard is None:
            raise TypeError("loop.Hooks: shard must be callable (the default: data.shard_batch)")


def train(
    strategy: str | type,
    cfg: Preset,
    steps: int | None = None,
    *,
    accum_steps: int = 1,
    spans: bool = True,
    track_memory: bool = False,
    return_state: bool = True,
    hooks: Hooks | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Rank function: train `strategy` (a name in labkit.strategies.NAMES or a class) under preset
    `cfg` for `steps` steps (cfg.steps by default) of `accum_steps` micro-batches on this rank's
    rows, one train_step each; hooks: a loop.Hooks (sampler, warm-up, resume, after-step, report).

    options go to the strategy (e.g. bucket_cap_mb=1 for ddp-bucketed, prefetch=2 for fsdp).
    Returns {"losses": global mean loss per step, "state": full state on CPU (unless
    return_state=False), "grads": step 0's reduced gradients by name (None with track_memory:
    the loop's copy of them would be measured as the strategy's memory), "step_s": wall time of each
    step after the warm-up, "median_step_s"}, plus "peak", "peak_by_category" and "memory" (the
    tracker's record) with track_memory."""
    from labkit.launch.run import device as rank_device

    check_preset(cfg, "loop.train")
    steps = _check_steps(cfg.steps if steps is None else steps, "steps")
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"loop.train: accum_steps must be an int >= 1, got {accum_steps!r}")
    if not (isinstance(cfg.optimizer, type) and issubclass(cfg.optimizer, torch.optim.Optimizer)):
        raise TypeError(
            f"loop.train: cfg.optimizer must be a torch.optim.Optimizer subclass (e.g. "
            f"torch.optim.AdamW; its options go in cfg.optimizer_kwargs), got {cfg.optimizer!r}"
        )
    hooks = Hooks() if hooks is None else hooks
    if not isinstance(hooks, Hooks):
        raise TypeError(f"loop.train: hooks must be a loop.Hooks, got {type(hooks).__name__} {hooks!r}")
    warmup = hooks.warmup
    device = rank_device()
    model = build_model(cfg, device)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    if cfg.mp is not None:
        options.setdefault("mp_policy", cfg.mp)
    s = strategies.build(strategy, model, cfg, **options)
    # The data is split over the strategy's data-parallel coordinates only: tensor-parallel ranks
    # of one replica see the same rows (and their loss is counted once, below).
    rank, world_size = s.data_rank(), s.data_world_size()
    if cfg.batch_size < world_size * accum_steps:  # the docstring's "left out": ranks without rows
        raise ValueError(
            f"loop.train: batch_size={cfg.batch_size} rows cannot give each of "
            f"{world_size} ranks (data-parallel ones) x {accum_steps} micro-batch(es) at least one row; "
            f"use cfg.replace(batch_size={world_size * accum_steps}) or more"
        )
    # Copies of one replica's loss: the all-reduce below sums every rank's, each counted this often.
    copies = dist.get_world_size() // world_size
    scale = world_size if s.reduce_op == "avg" else 1
    span = tracing.span if spans else (lambda name: contextlib.nullcontext())
    if track_memory:
        global_batch(cfg, 0)  # reads (and caches) the corpus: not the strategy's memory
    tracker = _tracker(s, model, device) if track_memory else None
    if spans or tracker is not None:
        s.observe = _Observer(spans, tracker)
    losses, step_s, grads = [], [], None

    def watch(
        name: str,
    ) -> ContextManager[Any]:  # one phase of a step: a span on the timeline, a phase of the tracker
        return _Watched(span(name), _phase(tracker, name))

    with tracker if tracker is not None else contextlib.nullcontext():
        for index in range(warmup + steps):
            step = hooks.first_step + index  # batches (and the toy's unused layer) follow the step
            x, y = global_batch(cfg, step)
            rows_x, rows_y = hooks.shard(x, y, rank, world_size)
            parts = [(mx.to(device), my.to(device)) for mx, my in micro_batches(rows_x, rows_y, accum_steps)]
            batch = Batch(parts, count=y.numel(), step=step)
            start = time.perf_counter()
            with span("step"):
                total = train_step(s, batch, cfg, scale=scale, watch=watch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if index >= warmup:
                step_s.append(time.perf_counter() - start)
            # The loss report and the gathered gradients are not the strategy's traffic.
            with tracing.untraced():
                if index == 0 and tracker is None:
                    grads = {n: g.cpu() for n, g in s.full_grad_dict().items() if n in names}
                dist.all_reduce(total)
            losses.append(total.item() / copies)
            if tracker is not None:
                tracker.mark("after step")
            if hooks.after_step is not None:
                hooks.after_step(s, step + 1)
    out = {
        "losses": losses,
        "grads": grads,
        "step_s": step_s,
        "median_step_s": statistics.median(step_s[1:] or step_s) if step_s else None,
    }
    if hooks.report is not None:
        out.update(hooks.report(s))
    if return_state:
        with tracing.untraced():
            out["state"] = {k: v.cpu() for k, v in s.full_state_dict().items()}
    if tracker is not None:
        peak = tracker.peak()
        out.update(peak=peak.total, peak_by_category=peak.by_category, memory=tracker.record())
    return out


def _check_steps(value: object, name: str, where: str = "loop.train") -> int:
    """A count of steps: an int >= 0 (a negative one would train nothing and say nothing)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {name} must be an int >= 0, got {value!r}")
    return value


def train_each(
    strategy: str | type, cfgs: Sequence[Preset], steps: int | None = None, **options: Any
) -> list[dict[str, Any]]:
    """train() once per preset in `cfgs`, on the same ranks: one launch for several runs."""
    return [train(strategy, cfg, steps, **options) for cfg in cfgs]


def sweep(runs: Sequence[dict[str, Any]], **common: Any) -> list[dict[str, Any]]:
    """train() once per dict in `runs` (keyword arguments of train, over `common`: strategy, cfg,
    steps, options), on the same ranks: one launch for a comparison."""
    return [train(**{**common, **run}) for run in runs]


def _tracker(s: Any, model: nn.Module, device: torch.device) -> Any:
    from labkit.observe.memory import MemoryTracker

    # A sharded strategy's parameters are its shards (its sharded_parameters()): the flat buffers
    # of fsdp-flat and its frozen parameters, the per-parameter shards of fsdp (registered on the
    # model between uses). During a step the model also holds the unsharded parameters, which the
    # strategy tags all_gather through the observe hook (a tag beats every root), so the tracker
    # gets the shards, not the model.
    shards = s.sharded_parameters()
    tracker = MemoryTracker(
        model=None if shards is not None else model,
        optimizer=s.optimizer,
        device=device.type,
    )
    if shards is not None:
        tracker.register(shards, "parameters")
    return tracker


class _Observer:
    """The strategies' instrumentation hook (labkit.strategies' interface): spans on the timeline,
    samples and buffer categories for the memory tracker. A strategy's span may open in one
    autograd hook and close in another, so spans are entered and left here, by name."""

    def __init__(self, spans: bool, tracker: Any) -> None:
        self.spans, self.tracker = spans, tracker
        self.open: dict[str, Any] = {}

    def __call__(self, event: str, label: str, tensor: torch.Tensor | None = None) -> None:
        if event == "begin" and self.spans and label not in self.open:
            self.open[label] = tracing.span(label).__enter__()
        elif event == "end" and label in self.open:
            self.open.pop(label).__exit__(None, None, None)
        elif event == "tag" and self.tracker is not None:
            self.tracker.tag(tensor, label)
        elif event == "mark" and self.tracker is not None:
            try:
                self.tracker.mark(label)
            except RuntimeError:  # outside the tracker's `with` (build, final state): no sample
                pass


def _phase(tracker: Any, name: str) -> ContextManager[Any]:
    return tracker.phase(name) if tracker is not None else contextlib.nullcontext()
