"""Mixed precision by hand: fp32 master weights, 16-bit compute, gradients reduced in reduce_dtype.

    from labkit.strategies.precision import MixedPrecision
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cfg = loop.PRESETS["dp"].replace(mp=mp)        # every strategy and loop.reference follow it

The bill the ZeRO paper counts, per parameter: 2 bytes of 16-bit weights (what forward and
backward compute with), 2 of 16-bit gradients, and K = 12 of optimizer state: the fp32 master
copy of the weights (4) plus Adam's two moments (8). `MasterWeights` holds that split for a
replica: the module's parameters are cast in place to param_dtype (autograd then produces 16-bit
gradients), and an fp32 master per parameter is what the optimizer steps; after each step the
masters are cast back into the module. The master's fp32 gradient exists only between the
reduction and the step (it is built from the reduced gradient and dropped after the step), so at
the end of backward a replica holds exactly 2P + 2P + 12P bytes.

fp16's range is narrow (gradients below 6e-8 flush to zero), so fp16 gets dynamic loss scaling
(`LossScaler`): the loss is multiplied by S before backward, the gradients divided by S before the
step; a step whose gradients hold an inf or nan is skipped and S halved; after `growth_interval`
good steps S doubles. bf16 has fp32's range and needs none.

What it leaves out: autocast-style per-op policies (every op here runs in param_dtype, LayerNorm
and softmax included: the reference does the same, so the comparison is like for like), fp32
buffers, CPU offload of the masters, and the fused "cast on the fly" optimizers of DeepSpeed and
Apex that never materialise the fp32 gradient.
"""

import dataclasses
import math
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """param_dtype: what forward/backward compute in (and what FSDP all-gathers);
    reduce_dtype: what gradients are reduced in (None: param_dtype, as FSDP2's policy).
    Master weights and optimizer state stay in the model's own dtype (fp32).
    init_scale, growth_interval: fp16's dynamic loss scale (LossScaler) starts at init_scale and
    doubles after growth_interval steps without an overflow (torch.amp.GradScaler's defaults)."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    init_scale: float = 2.0**16
    growth_interval: int = 2000

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
                raise TypeError(f"MixedPrecision.{name} must be a floating torch.dtype, got {dtype!r}")
        if self.reduce_dtype is None:
            object.__setattr__(self, "reduce_dtype", self.param_dtype)
        _check_scaling(self.init_scale, self.growth_interval, "MixedPrecision")

    @property
    def loss_scaling(self) -> bool:
        """fp16 needs dynamic loss scaling; bf16 and fp32 do not."""
        return self.param_dtype == torch.float16


def check_policy(mp_policy: object, owner: str) -> Optional[MixedPrecision]:
    """`mp_policy` if it is None or a MixedPrecision; anything else raises TypeError naming it,
    at the API boundary (before any sharding or process-group work). torch's fully_shard takes a
    string like "bf16" and fails only at the first forward (AttributeError: 'str' object has no
    attribute 'param_dtype'); labkit refuses it where it is passed. torch's MixedPrecisionPolicy
    is refused too: its output_dtype and cast_forward_inputs have no labkit counterpart, so they
    would be accepted and ignored."""
    if mp_policy is None or isinstance(mp_policy, MixedPrecision):
        return mp_policy
    hint = ""
    if type(mp_policy).__name__ == "MixedPrecisionPolicy":
        hint = " (torch's MixedPrecisionPolicy: pass its param_dtype and reduce_dtype to labkit's)"
    elif isinstance(mp_policy, (str, torch.dtype)):
        hint = " (a dtype or its name is not a policy)"
    raise TypeError(
        f"{owner}: mp_policy must be None or labkit.strategies.precision.MixedPrecision"
        f"(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), got "
        f"{type(mp_policy).__name__} {mp_policy!r}{hint}"
    )


def _check_scaling(init_scale, growth_interval, owner):
    """Refuse a loss scale that cannot work, at construction: a scale of 0 turns one fp16 step's
    weights into NaN (the gradients are divided by it), a negative one flips every update, and a
    growth_interval of 0 divides by zero at the first good step."""
    if (
        isinstance(init_scale, bool)
        or not isinstance(init_scale, (int, float))
        or not math.isfinite(init_scale)
        or init_scale <= 0
    ):
        raise ValueError(
            f"{owner}: init_scale must be a positive, finite number (the fp16 loss "
            f"scale; torch.amp.GradScaler's default is 2.0**16), got {init_scale!r}"
        )
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(
            f"{owner}: growth_interval must be an int >= 1 (good steps before the "
            f"scale doubles; GradScaler's default is 2000), got {growth_interval!r}"
        )


class LossScaler:
    """Dynamic loss scaling for fp16 (torch.amp.GradScaler's rule, by hand)."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        _check_scaling(init_scale, growth_interval, "LossScaler")
        if not growth_factor > 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                f"LossScaler: growth_factor must be > 1 and backoff_factor in (0, 1), "
                f"got {growth_factor!r} and {backoff_factor!r}"
            )
        self.scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, backoff_factor
        self.growth_interval, self.good_steps, self.skipped = growth_interval, 0, 0

    def update(self, found_inf: bool) -> bool:
        """After a step's gradients are reduced: True if the step must be skipped."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return True
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor
        return False


class MasterWeights:
    """fp32 masters for `params` (a replica's trainable parameters), which become param_dtype;
    `frozen` parameters (requires_grad=False) are cast too, with no master (they never change:
    cast_back() restores their original values for a state dict).

    The optimizer is built over `self.masters`. Per step: after the gradients are reduced, call
    `master_grad(p)` for each parameter's fp32 gradient target (or `load_grads()` to copy the
    local .grad), then `step(optimizer)`: unscale, check inf/nan (fp16), optimizer.step(), copy the
    masters back into the 16-bit parameters. optimizer.zero_grad() drops the master gradients."""

    def __init__(self, params, policy, frozen=()):
        self.policy, self.params = policy, list(params)
        self.masters = [torch.nn.Parameter(p.detach().clone(), requires_grad=True) for p in self.params]
        self.master_of = dict(zip(map(id, self.params), self.masters))
        self.frozen = {id(p): p.detach().clone() for p in frozen if p.is_floating_point()}
        with torch.no_grad():
            for p in self.params + [p for p in frozen if id(p) in self.frozen]:
                cast_in_place(p, policy.param_dtype)
        self.scaler = (
            LossScaler(policy.init_scale, growth_interval=policy.growth_interval)
            if policy.loss_scaling
            else None
        )

    @classmethod
    def of_module(
        cls,
        module: torch.nn.Module,
        policy: MixedPrecision,
        params: Optional[Sequence[torch.Tensor]] = None,
    ) -> "MasterWeights":
        """Masters for `params` (default: module's trainable parameters), every other floating
        parameter of `module` cast to param_dtype without one."""
        params = [p for p in module.parameters() if p.requires_grad] if params is None else list(params)
        ids = set(map(id, params))
        return cls(params, policy, frozen=[p for p in module.parameters() if id(p) not in ids])

    def full_value(self, p: torch.Tensor) -> torch.Tensor:
        """The full-precision value of parameter `p` (its master, or a frozen one's original)."""
        return self.master_of[id(p)] if id(p) in self.master_of else self.frozen.get(id(p), p)

    def state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """module.state_dict() with every parameter at full precision (both keys of a tied one)."""
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        for key, p in module.named_parameters(remove_duplicate=False):
            state[key] = self.full_value(p).detach().clone()
        return state

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def master_grad(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 tensor the reduced gradient of `p` goes into (created on first use)."""
        master = self.master_of[id(p)]
        if master.grad is None:
            master.grad = torch.zeros_like(master)
        return master.grad

    def load_grads(self) -> None:
        """Copy every 16-bit .grad into its master's fp32 gradient (None stays None: skipped)."""
        for p in self.params:
            if p.grad is not None:
                self.master_grad(p).copy_(p.grad)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, skip on inf/nan (fp16), step the masters, cast them back. True if stepped."""
        grads = [m.grad for m in self.masters if m.grad is not None]
        if self.scaler is not None:
            scale = self.scaler.scale  # the factor this step's loss was multiplied by
            found_inf = any(not torch.isfinite(g).all() for g in grads)
            if self.scaler.update(found_inf):
                self.drop_grads()
                return False
            for g in grads:
                g.div_(scale)
        optimizer.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                p.copy_(master)
        return True  # the master gradients stay for inspection until the next zero_grad

    def drop_grads(self) -> None:
        for master in self.masters:
            master.grad = None

    def reduce_into_masters(self, reduce: Optional[Callable[[torch.Tensor], Any]] = None) -> None:
        """Every 16-bit gradient into its fp32 master's: cast to reduce_dtype, `reduce(tensor)`
        in place (an all-reduce over the strategy's data-parallel ranks; None: no reduction), then
        copied into the master gradient. DTensors (tensor parallelism) by their local tensors: a
        rank reduces and keeps its own piece."""
        for p in self.params:
            if p.grad is None:
                continue
            grad = p.grad
            if hasattr(grad, "placements") and grad.placements != p.placements:
                # A pending Partial (torch's sequence-parallel LayerNorms): reduced first, by torch
                grad = grad.redistribute(placements=p.placements)
            grad = _local(grad)
            if reduce is not None:
                grad = grad.to(self.policy.reduce_dtype)
                reduce(grad)
            _local(self.master_grad(p)).copy_(grad)


def cast_in_place(p: torch.Tensor, dtype: torch.dtype) -> None:
    """Parameter `p`, the same Python object (the optimizer's, the hooks'), now in `dtype`. A
    DTensor's `.data = ...` changes its metadata but not its local tensor, so a DTensor is
    swapped whole (torch.utils.swap_tensors) for its cast copy."""
    if hasattr(p, "to_local"):
        torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))
    else:
        p.data = p.data.to(dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (its storage, outside autograd), a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class WithMasters:
    """Mixed precision for a strategy whose optimizer steps the parameters it holds, whole tensors
    or DTensors (tp, sp, cp, pp, torch-tp / torch-sp / torch-pp): `optimizer_for` builds the
    optimizer over fp32 masters when a policy is given (the module's parameters become 16-bit);
    after backward the strategy calls `into_masters(reduce)` (its data-parallel all-reduce, in
    reduce_dtype); step / zero_grad / scale_loss follow the masters; `trained_state` and
    `trained_grads` are what the full dicts report (the fp32 masters and their gradients).
    Without a policy every method is the plain optimizer's."""

    mp: Optional[MasterWeights] = None
    model: Any = None
    optimizer: Any = None

    def optimizer_for(
        self, cfg: Any, params: Iterable[torch.Tensor], mp_policy: object, owner: str
    ) -> torch.optim.Optimizer:
        policy = check_policy(mp_policy, owner)
        params = list(params)
        if policy is None:
            return cfg.make_optimizer(params)
        self.mp = MasterWeights.of_module(self.model, policy, params)
        return cfg.make_optimizer(self.mp.masters)

    def into_masters(self, reduce: Optional[Callable[[torch.Tensor], Any]] = None) -> None:
        if self.mp is not None:
            self.mp.reduce_into_masters(reduce)

    def step(self) -> None:
        if self.mp is not None:
            self.mp.step(self.optimizer)  # unscale (fp16), step the fp32 masters, cast back
        else:
            self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.mp is not None:  # the optimizer holds the masters: the 16-bit grads are ours
            for p in self.mp.params:
                p.grad = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.mp.scale_loss(loss) if self.mp is not None else loss

    def trained_state(self) -> dict[str, torch.Tensor]:
        """model.state_dict(keep_vars=True), each parameter replaced by its fp32 master."""
        state = self.model.state_dict(keep_vars=True)
        return state if self.mp is None else {k: self.mp.full_value(v) for k, v in state.items()}

    def trained_grads(self) -> dict[str, torch.Tensor]:
        """{name: the gradient the optimizer steps with} (the master's under a policy)."""
        out = {}
        for name, p in self.model.named_parameters():
            owner = self.mp.master_of.get(id(p)) if self.mp is not None else p
            if owner is not None and owner.grad is not None:
                out[name] = owner.grad
        return out
