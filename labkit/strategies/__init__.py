"""Reference parallel training strategies (the labs' solutions) behind one interface, by one name.

    from labkit import loop, strategies
    strategies.NAMES                          # every strategy loop.train accepts by name
    s = strategies.build("zero1", model, loop.PRESETS["zero"], **options)

The interface is the base class Strategy alone: what `labkit.loop.train` calls, directly (build()
refuses a class that does not subclass it), and all a learner's class has to implement.

    class MyStrategy(strategies.Strategy):      # the base class supplies the defaults marked (*)
        reduce_op = "sum"                 (*)   # "sum" or "avg": how gradients are reduced
        optimizer = None                  (*)   # the torch optimizer (the memory tracker's)
        def __init__(self, model, cfg, **options)
        from_preset(model, cfg, **options)  (*) # classmethod, what build() calls: cls(model, cfg,
                                                # **options) unless a class builds otherwise
                                                # cfg: a labkit.preset.Preset (loop.Preset);
                                                # cfg.make_optimizer(params)
                                                # builds the course's optimizer
        def __call__(self, *args, **kwargs) (*) # forward: self.model(*args, **kwargs)
        def no_sync(self)                   (*) # context: backward inside communicates nothing
        def after_backward(self)            (*) # once per step, after the last backward
        def scale_loss(self, loss)          (*) # what backward starts from (fp16: loss * scale)
        def forward_backward(self, batch, loss_fn, *, scale=1, watch=unwatched)
                                            (*) # every micro-batch's forward + backward (below);
                                                # returns the sum of the losses (float64)
        def data_rank(self)                 (*) # this rank's data-parallel coordinate, which rows
        def data_world_size(self)           (*) # it reads: the global rank / world size, but a
                                                # tensor-parallel strategy's dp ones
        def step(self)                          # the optimizer step (and whatever sharding needs)
        def zero_grad(self)                     # before the step's first backward
        def full_state_dict(self)           (*) # every rank: {state_dict key: whole tensor}
        def full_grad_dict(self)            (*) # every rank, after step(): {param name: whole grad}
        def clip_grad_norm_(self, max_norm, norm_type=2.0)
                                            (*) # torch's, for the whole model (every rank, after
                                                # after_backward): one process's norm and clip;
                                                # scales held_grads(), what the optimizer steps from
        def sharded_parameters(self)        (*) # what this rank holds of the model when it is
                                                # sharded (a list of tensors); None: a whole replica
        observe                             (*) # set by the loop: instrumentation's one hook,
                                                # observe("begin" | "end", span name),
                                                # observe("mark", label): a memory sample,
                                                # observe("tag", category, tensor): a buffer's kind

One step of the loop: zero_grad(); forward_backward() (the default: for each micro-batch but the
last, backward inside no_sync(); the last one's backward); after_backward(); step(). The loss
each rank backpropagates is (sum of
its token losses) / (global token count), multiplied by the data-parallel world size when reduce_op == "avg":
SUM-reducing those gradients gives exactly the gradient of the global-batch mean, for any split.
full_state_dict and full_grad_dict are collectives: every rank calls them, at the same point.

One constructor shape for every name in NAMES: from_preset(model, cfg, **options), where options
are the class's own keywords plus two every strategy takes, reduce_op ("sum" / "avg"; torch's own
ones can only average) and mp_policy (a MixedPrecision, or None; a strategy that cannot honour
one raises). An unknown or misspelled option raises TypeError (ZeRO's go on to the optimizer,
whose constructor refuses them), so nothing is accepted and ignored; every rank must pass the same
options (build() compares them across the world and names the one that differs). reduce_op is
checked once, by check_reduce_op (build() on every instance). The loop calls the interface's
methods, never a class's other attributes.

Promises every name keeps (tests/contract, over NAMES): two backwards without zero_grad leave
2 G as in one process (KeepsReduced, for a strategy that reduces in place); clip_grad_norm_ gives
one process's norm and clip; full_state_dict loads into a plain model, and the model object's own
state_dict agrees with it or refuses; a frozen parameter trains as in one process.

What it leaves out: evaluation, checkpoints (strategies/checkpoint/ has the FSDP ones), learning-rate
schedules, strategies that change the model's forward signature.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.preset import Preset, check_preset

# name -> (module, class); torch-* are PyTorch's own implementations, the oracles.
_REGISTRY = {
    "ddp-naive": ("labkit.strategies.ddp.by_hand", "DDPNaive"),
    "ddp-flat": ("labkit.strategies.ddp.by_hand", "DDPFlat"),
    "ddp-bucketed": ("labkit.strategies.ddp.by_hand", "DDPBucketed"),
    "zero1": ("labkit.strategies.zero.stages", "ZeRO1"),
    "zero2": ("labkit.strategies.zero.stages", "ZeRO2"),
    "fsdp": ("labkit.strategies.fsdp.fully_shard", "FSDP"),
    "fsdp-flat": ("labkit.strategies.fsdp.flat", "FSDPModel"),
    "hsdp": ("labkit.strategies.fsdp.hsdp", "HSDP"),
    "tp": ("labkit.strategies.tp.strategy", "TP"),
    "fsdp-tp": ("labkit.strategies.tp.strategy", "FSDPTP"),
    "sp": ("labkit.strategies.tp.strategy", "SP"),
    "cp": ("labkit.strategies.cp.strategy", "CP"),
    "ulysses": ("labkit.strategies.ulysses.strategy", "Ulysses"),
    "pp": ("labkit.strategies.pp.strategy", "PP"),
    "pp-zero1": ("labkit.strategies.pp.strategy", "PPZeRO1"),
    "ep": ("labkit.strategies.ep.strategy", "EP"),
    "zero1-tp-pp": ("labkit.strategies.three_d.zero1", "ZeRO1TPPP"),
    "fsdp-tp-pp": ("labkit.strategies.three_d.fsdp", "FSDPTPPP"),
    "torch-ddp": ("labkit.strategies.ddp.torch_ref", "TorchDDP"),
    "torch-zero1": ("labkit.strategies.zero.torch_ref", "TorchZeRO1"),
    "torch-fsdp": ("labkit.strategies.fsdp.torch_ref", "TorchFSDP"),
    "torch-hsdp": ("labkit.strategies.fsdp.hsdp", "TorchHSDP"),
    "torch-tp": ("labkit.strategies.tp.torch_ref", "TorchTP"),
    "torch-fsdp-tp": ("labkit.strategies.tp.torch_ref", "TorchFSDPTP"),
    "torch-sp": ("labkit.strategies.tp.torch_ref", "TorchSP"),
    "torch-pp": ("labkit.strategies.pp.torch_ref", "TorchPP"),
}
NAMES = tuple(_REGISTRY)
HAND_WRITTEN = tuple(n for n in NAMES if not n.startswith("torch-"))
REQUIRED = ("step", "zero_grad")

MicroBatches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # one step's [(x, y), ...] on this rank
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, y) -> what backward starts from
Watch = Callable[[str], ContextManager[Any]]  # phase name -> a context around that phase


def unobserved(event: str, label: str, tensor: torch.Tensor | None = None) -> None:
    """The observe hook when nothing observes (see the interface above): does nothing."""


def unwatched(phase: str) -> ContextManager[Any]:
    """forward_backward's watch when nothing watches: no context."""
    return contextlib.nullcontext()


class Strategy:
    """Defaults for a strategy that keeps a whole replica in `self.model` (see the module doc).
    A subclass sets self.model in __init__ and writes step() and zero_grad() at least."""

    reduce_op = "sum"
    # set by every subclass's __init__ (Any: a subclass may hold a wrapper, e.g. torch's DDP)
    model: Any = None
    optimizer: Any = None
    observe = staticmethod(unobserved)

    @classmethod
    def from_preset(cls, model: nn.Module, cfg: Preset, **options: Any) -> Strategy:
        factory: Any = cls  # subclasses define __init__(model, cfg, **options); this base has none
        return factory(model, cfg, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def step(self) -> None:
        """The optimizer step (and whatever sharding needs): every strategy writes its own."""
        raise NotImplementedError(f"{type(self).__name__} must define step()")

    def zero_grad(self) -> None:
        """Before the step's first backward: every strategy writes its own."""
        raise NotImplementedError(f"{type(self).__name__} must define zero_grad()")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def after_backward(self) -> None:
        pass

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor backward starts from: the loss itself (fp16 strategies multiply it by the
        loss scale)."""
        return loss

    def forward_backward(
        self, batch: MicroBatches, loss_fn: LossFn, *, scale: float = 1, watch: Watch = unwatched
    ) -> torch.Tensor:
        """Every micro-batch's forward (loss_fn(x, y): this rank's share of the global-batch mean)
        and backward from scale_loss(loss * scale), all but the last inside no_sync(); returns the
        sum of the losses (float64, detached). `self` may be any class with the interface: the
        calls are the strategy's own methods (a subclass overrides any of them)."""
        if not isinstance(batch, Sequence) or isinstance(batch, (str, bytes)) or len(batch) == 0:
            raise ValueError(
                "forward_backward: batch must be a non-empty list of (x, y) micro-batches (one "
                f"step's, on this rank), got {type(batch).__name__} of length "
                f"{len(batch) if hasattr(batch, '__len__') else '?'}: with no micro-batch there "
                "is no backward, so no gradient to reduce"
            )
        total = torch.zeros((), dtype=torch.float64, device=batch[0][1].device)
        for i, (x, y) in enumerate(batch):
            last = i == len(batch) - 1
            # Every micro-batch but the last accumulates locally: no_sync() communicates nothing.
            with contextlib.nullcontext() if last else self.no_sync():
                with watch("forward"):
                    loss = loss_fn(x, y)
                with watch("backward"):  # fp16: from the scaled loss
                    self.scale_loss(loss * scale).backward()
            total += loss.detach()
        return total

    def data_rank(self) -> int:
        """Which rows this rank reads: its data-parallel rank (a whole replica: the global rank)."""
        return dist.get_rank()

    def data_world_size(self) -> int:
        """How many ways the batch is split: the data-parallel ranks (here every rank)."""
        return dist.get_world_size()

    def replica(self) -> nn.Module:
        """The whole model this rank holds (a wrapper such as torch's DDP returns what it wraps,
        so the state dict's keys are the model's own)."""
        return self.model

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.replica().state_dict().items()}

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        return replica_grads(self.replica())

    def sharded_parameters(self) -> list[torch.Tensor] | None:
        """None: this strategy holds a whole replica (`replica()`), nothing sharded."""
        return None

    def held_grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer steps from, after after_backward(): its parameters'
        .grad (fp32 masters' under a policy; shards' and DTensors' as they are). A strategy whose
        reduced gradients live elsewhere (ZeRO's flat shard) says where."""
        if self.optimizer is None:
            raise NotImplementedError(f"{type(self).__name__} has no optimizer: no gradients to clip")
        return [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for the whole model, on every strategy: after
        after_backward() and before step(), every rank calls it (a collective). The total norm is
        one process's (the norm of full_grad_dict(): every gradient whole, a tied weight once), and
        every gradient this rank steps from (held_grads) is multiplied by the same
        min(1, max_norm / (total + 1e-6)), torch's coefficient. Returns the total (a tensor, the
        same on every rank). What it leaves out: a cheap norm (it gathers every gradient whole;
        pp.clip_grad_norm_ adds stage norms instead, as torchtitan does)."""
        grads = list(self.full_grad_dict().values())
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        coefficient = min(1.0, float(max_norm) / (float(total) + 1e-6))
        with torch.no_grad():
            for g in self.held_grads():
                g.mul_(coefficient)
        return total


class KeepsReduced:
    """Two backwards without zero_grad add up as in one process (2 G, not (N+1) G), for a strategy
    whose after_backward reduces the gradients where backward left them (.grad, or a flat shard):
    a backward after that would add this rank's new gradient onto the already-reduced sum, and the
    next reduction would sum the old one again over every rank. So the first forward with grad
    enabled after a reduction sets the reduced gradients aside (`set_aside_reduced`), backward and
    the reduction see only the new ones, and `add_back_reduced` adds the old ones after it, as
    torch's DDP does with an averaged gradient. zero_grad() needs no hook: a gradient it dropped
    is not set aside (None), a zeroed one adds zeros.

    Default (a whole replica, full-precision .grad): the trainable parameters' .grad. Under a
    MixedPrecision the 16-bit .grad is never reduced in place (the reduction writes the fp32
    masters' gradients, overwriting them), so the local sums accumulate and nothing is set aside.
    A subclass calls `resume_accumulation()` in its forward and `mark_reduced()` at the end of its
    after_backward; the base's __call__ does the first."""

    _synced = False
    _aside: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.resume_accumulation()
        return super().__call__(*args, **kwargs)  # type: ignore[misc]

    def resume_accumulation(self) -> None:
        if self._synced and torch.is_grad_enabled():
            self._synced = False
            self._aside = self.set_aside_reduced()

    def mark_reduced(self) -> None:
        """The end of a reduction: what was set aside added back."""
        if self._aside is not None:
            self.add_back_reduced(self._aside)
            self._aside = None
        self._synced = True

    def set_aside_reduced(self) -> Any:
        if getattr(self, "mp", None) is not None:
            return None
        aside = {}
        for p in self.model.parameters():  # type: ignore[attr-defined]
            if p.grad is not None:
                aside[p], p.grad = p.grad, None
        return aside

    def add_back_reduced(self, aside: Any) -> None:
        for p, old in aside.items():
            p.grad = old if p.grad is None else p.grad.add_(old)


class SyncSwitch:
    """no_sync() for a strategy whose backward hooks communicate (DDPBucketed's buckets, ZeRO2's
    reduce-scatters): the hooks read self.syncing, which no_sync() turns off for its block, so
    backward inside accumulates into .grad locally and communicates nothing."""

    syncing = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = previous


def replica_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: grad clone} of a whole replica (tied weights once, under their first name)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def get(name: str) -> type:
    """The class registered under `name` (one of NAMES)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; one of {', '.join(NAMES)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def _fingerprint(value: Any) -> str:
    """What ranks must agree on of an option's value: plain values (and tuples / lists / dicts of
    them) by repr, a dtype by name, anything else (a mesh, a function, a policy) by its type."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_fingerprint(v) for v in value)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_fingerprint(v)}" for k, v in sorted(value.items(), key=str)) + "}"
    return type(value).__name__


def _check_ranks_agree(where: str, options: dict[str, Any]) -> None:
    """Every rank of the world builds the same strategy with the same options, or every rank
    raises, naming the option and each rank's value (one all_gather_object, before any collective
    of the strategy's could wait forever for a rank that took another path)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = (where, {k: _fingerprint(v) for k, v in options.items()})
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if all(e == mine for e in every):
        return
    names = {e[0] for e in every}
    if len(names) > 1:
        raise ValueError(
            "strategies.build: the ranks build different strategies: "
            + ", ".join(f"rank {r} {e[0]}" for r, e in enumerate(every))
        )
    keys = sorted({k for e in every for k in e[1]})
    differ = [k for k in keys if len({e[1].get(k, "(not passed)") for e in every}) > 1]
    raise ValueError(
        f"{where}: the ranks disagree on option(s) {', '.join(map(repr, differ))}: "
        + "; ".join(
            f"{k}: " + ", ".join(f"rank {r} {e[1].get(k, '(not passed)')}" for r, e in enumerate(every))
            for k in differ
        )
        + " (every rank must pass the same options)"
    )


def build(strategy: str | type, model: nn.Module, cfg: Preset, **options: Any) -> Strategy:
    """An instance of `strategy` (a name in NAMES, or a class) for `model` under preset `cfg`."""
    cls = get(strategy) if isinstance(strategy, str) else strategy
    if not isinstance(cls, type):
        raise TypeError(
            f"strategy must be a name in labkit.strategies.NAMES or a class, got {type(cls).__name__} {cls!r}"
        )
    if not issubclass(cls, Strategy):
        raise TypeError(
            f"{cls.__name__} must subclass labkit.strategies.Strategy (the interface: the base class "
            f"supplies every method but step() and zero_grad(), and the loop calls them directly)"
        )
    check_preset(cfg, cls.__name__)
    _check_ranks_agree(cls.__name__, options)
    instance = cls.from_preset(model, cfg, **options)
    missing = [m for m in REQUIRED if getattr(type(instance), m) is getattr(Strategy, m)]
    if missing:
        raise TypeError(f"{cls.__name__} lacks {', '.join(missing)}: see labkit.strategies' docstring")
    check_reduce_op(instance.reduce_op, f"{cls.__name__}.reduce_op")
    return instance


def check_reduce_op(op: object, where: str) -> str:
    """`op` if it is "sum" or "avg" (how a strategy reduces gradients: the loop scales the loss for
    "avg"), else a ValueError naming `where`: the one check of it (build() runs it on every
    strategy; a class built directly runs it in its constructor)."""
    if op not in ("sum", "avg"):
        raise ValueError(
            f"{where} must be 'sum' or 'avg' (how it reduces gradients: the loop scales the loss "
            f"for 'avg'), got {op!r}"
        )
    return op  # type: ignore[return-value]
