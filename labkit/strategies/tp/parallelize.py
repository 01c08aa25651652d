"""parallelize_by_hand(module, mesh, plan): torch's parallelize_module with ColwiseParallel() /
RowwiseParallel() at their default layouts, by hand, for nn.Linear, and sequence parallelism's
styles (SequenceParallel() for nn.LayerNorm, the two Linear styles with a sequence-sharded side).

    mesh = init_device_mesh("cpu", (2,))                    # or mesh2d["tp"] of a ("dp", "tp") mesh
    parallelize_by_hand(model, mesh, {"0": "colwise", "2": "rowwise"})

"colwise": out_features split (weight rows and bias), the input replicated (copy_to_tp in front),
           the output this rank's last-dim columns (torch's use_local_output=True: a plain tensor);
"rowwise": in_features split (weight columns), the input this rank's last-dim columns, the output
           all-reduced (reduce_from_tp), then the whole bias added once (Megatron's order).
           torch's RowwiseParallel adds it differently: DTensor turns the Replicate() bias into a
           Partial, bias / tp on every rank before the all-reduce ((p0 + b/2) + (p1 + b/2) on 2
           ranks, checked bit for bit), so the two differ in the last bits of the output (measured
           <= 6e-8 in tests/test_tp.py); gradients agree.
Sequence parallelism (Megatron's SP; inputs and outputs (batch, seq, ...), rank r holding the
sequence's r-th of tp equal pieces, labkit.strategies.tp.sequence):
"colwise_sp": torch's ColwiseParallel(input_layouts=Shard(1)): the input this rank's sequence
           piece, all-gathered first (gather_from_sp: its backward reduce-scatters), the output as
           "colwise"'s (every position, this rank's columns);
"rowwise_sp": torch's RowwiseParallel(output_layouts=Shard(1)): "rowwise" with the all-reduce
           replaced by a reduce-scatter along the sequence (reduce_scatter_to_sp: backward
           all-gathers), then the whole bias added to this rank's positions (through copy_to_tp:
           its gradient, each rank's positions' part, summed over the tp ranks);
"sequence": torch's SequenceParallel() on an nn.LayerNorm: it runs on this rank's sequence piece
           as it is; its weight and bias are Replicate() DTensors used through copy_to_tp, so their
           gradients (each rank's positions' part) are summed over the tp ranks. The output is the
           local piece, a plain tensor (torch's default use_local_output=False returns a DTensor).
Uneven sizes follow torch.chunk's split, as DTensor's Shard: ceil(n / tp) per rank, the last
rank(s) fewer (Linear(7, 9) colwise on 2 ranks: 5 and 4 output rows). torch's RowwiseParallel
cannot run an uneven in_features (its input DTensor assumes even shards, and the matmul fails
sharding propagation); here it runs, the input's columns being torch.chunk's split too.

The parameters become DTensors of the global shape, as under parallelize_module: Shard(0) for a
colwise weight and bias, Shard(1) for a rowwise weight, Replicate() for a rowwise bias, so
clip_grad_norm_, state_dict and optimizers see the whole model; the forward computes on their
local tensors (to_local(), whose backward makes the gradient a DTensor of the same placements).
Each parallelized module's class becomes TP<Class> (a subclass of its own) whose forward is the
one above; the collectives are labkit's hand-written ones (conjugate.py).

What it leaves out: non-default layouts (input_layouts / output_layouts / use_local_output),
modules other than nn.Linear (Embedding; attention's heads are gpt.py's, which splits a fused
[q; k; v] Linear by heads as a colwise one whose rows it first permutes), SequenceParallel, plan
keys with wildcards, and a check that the input really is replicated (it is trusted, as torch
trusts from_local).
FSDP x TP: fully_shard_by_hand(module, mesh=mesh2d["dp"]) after parallelize_by_hand(module,
mesh2d["tp"], plan) shards each parameter's TP-LOCAL tensor along dim 0 over "dp" and gathers it
back to the TP-local tensor for this forward; its DTensors live on the 2-D mesh with fully_shard's
placements (labkit/strategies/fsdp/param.py, TPLayout): (_StridedShard(0, split_factor=tp),
Shard(0)) for a colwise weight and bias, (Shard(0), Shard(1)) for a rowwise weight, (Shard(0),
Replicate()) for a rowwise bias, all exact (DTensor.full_tensor() reads the whole tensor back),
checked in tests/test_tp.py against parallelize_module + fully_shard(mesh["dp"]) on 2 x 2.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from labkit.comm.collectives import shard_range
from labkit.strategies.comm_choice import Collectives, choose
from labkit.strategies.tp.conjugate import copy_to_tp, reduce_from_tp
from labkit.strategies.tp.sequence import gather_from_sp, reduce_scatter_to_sp

__all__ = ["STYLES", "parallelize_by_hand", "tp_group"]

STYLES = ("colwise", "rowwise", "colwise_sp", "rowwise_sp", "sequence")
_MODULE_OF = {"sequence": nn.LayerNorm}  # the module class each style takes (nn.Linear otherwise)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local shard (differentiable), a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else _local(bias)


def tp_group(module: nn.Module) -> dist.ProcessGroup:
    """The process group a parallelized module's collectives run over."""
    group = getattr(module, "_tp_group", None)
    if group is None:
        raise ValueError(f"{type(module).__name__} was not parallelized by parallelize_by_hand")
    return group


class _Parallelized:
    """What parallelize_by_hand sets on an nn.Linear (the attributes its forward reads)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    _tp_group: dist.ProcessGroup
    _tp_name: str
    _tp_comm: Collectives


class _Colwise(_Parallelized):
    """forward of a column-parallel Linear: replicated input in, this rank's output columns out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self._tp_group, self._tp_comm)
        return F.linear(x, _local(self.weight), _local_bias(self.bias))


class _Rowwise(_Parallelized):
    """forward of a row-parallel Linear: this rank's input columns in, the whole output out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _local(self.weight)
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"{self._tp_name!r} (rowwise): this rank holds {weight.shape[1]} of its "
                f"{self.in_features} in_features, but its input's last dim is {x.shape[-1]}: a "
                f"rowwise layer takes the input sharded on the last dim (a colwise layer's output)"
            )
        y = reduce_from_tp(F.linear(x, weight), self._tp_group, self._tp_comm)
        bias = _local_bias(self.bias)
        if bias is None:
            return y
        if torch.is_autocast_enabled(y.device.type):
            # torch adds the bias inside the autocast linear (in the autocast dtype); added here,
            # after the all-reduce, a float32 bias would promote a bf16 output back to float32.
            bias = bias.to(y.dtype)
        return y + bias


class _ColwiseSP(_Parallelized):
    """ColwiseParallel(input_layouts=Shard(1)): this rank's sequence piece in, gathered; this
    rank's output columns of every position out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sp(x, self._tp_group, self._tp_comm)
        return F.linear(x, _local(self.weight), _local_bias(self.bias))


class _RowwiseSP(_Parallelized):
    """RowwiseParallel(output_layouts=Shard(1)): this rank's input columns in, this rank's
    sequence piece of the summed output out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _local(self.weight)
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"{self._tp_name!r} (rowwise_sp): this rank holds {weight.shape[1]} of its "
                f"{self.in_features} in_features, but its input's last dim is {x.shape[-1]}"
            )
        y = reduce_scatter_to_sp(F.linear(x, weight), self._tp_group, self._tp_comm)
        if self.bias is None:
            return y
        # added to this rank's positions only: its gradient is summed over the ranks (copy_to_tp)
        bias = copy_to_tp(_local(self.bias), self._tp_group, self._tp_comm)
        if torch.is_autocast_enabled(y.device.type):
            bias = bias.to(y.dtype)  # as torch's (bias inside the autocast linear): no promotion to fp32
        return y + bias


class _SequenceNorm:
    """SequenceParallel() on a LayerNorm: the norm of this rank's positions; the replicated
    weight and bias through copy_to_tp (their gradients summed over the tp ranks)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    normalized_shape: tuple[int, ...]
    eps: float
    _tp_group: dist.ProcessGroup
    _tp_comm: Collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = (
            None if p is None else copy_to_tp(_local(p), self._tp_group, self._tp_comm)
            for p in (self.weight, self.bias)
        )
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


_MIXINS: dict[str, type] = {
    "colwise": _Colwise,
    "rowwise": _Rowwise,
    "colwise_sp": _ColwiseSP,
    "rowwise_sp": _RowwiseSP,
    "sequence": _SequenceNorm,
}
_NAMES = {"colwise_sp": "ColwiseSP", "rowwise_sp": "RowwiseSP", "sequence": "Sequence"}
_CLASSES: dict[tuple[str, type], type] = {}


def _swap_class(module: nn.Module, style: str) -> None:
    key = (style, type(module))
    if key not in _CLASSES:
        cls = type(module)
        label = _NAMES.get(style, style.capitalize())
        _CLASSES[key] = type(f"TP{label}{cls.__name__}", (_MIXINS[style], cls), {})
    module.__class__ = _CLASSES[key]


def _shard(param: nn.Parameter, dim: int, rank: int, n: int) -> tuple[torch.Tensor, tuple[Placement, ...]]:
    """This rank's torch.chunk piece of `param` along `dim` (a copy) and its placements."""
    start, end, _ = shard_range(param.shape[dim], rank, n)
    return param.detach().narrow(dim, start, end - start).clone(), (Shard(dim),)


def _distribute(module: nn.Module, attr: str, dim: int | None, mesh: DeviceMesh, rank: int, n: int) -> None:
    """module.<attr> as a DTensor parameter of the same global shape: Shard(dim) or Replicate()."""
    param = getattr(module, attr)
    if param is None:
        return
    placements: tuple[Placement, ...]
    if dim is None:
        local, placements = param.detach().clone(), (Replicate(),)
    else:
        local, placements = _shard(param, dim, rank, n)
    dtensor = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    module._parameters[attr] = nn.Parameter(dtensor, requires_grad=param.requires_grad)


def _check_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"parallelize_by_hand: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"parallelize_by_hand: mesh must be 1-D (the tensor-parallel ranks), got {mesh.ndim}-D "
            f"{mesh!r}; of a ('dp', 'tp') mesh pass mesh['tp']"
        )


def _check_plan(module: nn.Module, plan: Mapping[str, str], n: int) -> dict[str, nn.Module]:
    """name -> module for every entry of `plan`, after checking all of them (nothing is changed
    unless the whole plan is valid)."""
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"parallelize_by_hand: plan must map module names to {STYLES}, got {type(plan).__name__}"
        )
    modules = dict(module.named_modules())
    targets: dict[str, nn.Module] = {}
    for name, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"parallelize_by_hand: plan[{name!r}] = {style!r}; the styles are {STYLES}")
        if name not in modules:
            raise ValueError(
                f"parallelize_by_hand: plan names {name!r}, which is not a submodule of "
                f"{type(module).__name__} (named_modules(): {sorted(k for k in modules if k)})"
            )
        target = modules[name]
        wanted = _MODULE_OF.get(style, nn.Linear)
        if not isinstance(target, wanted):
            raise TypeError(
                f"parallelize_by_hand: plan[{name!r}] = {style!r}, but {name!r} is a "
                f"{type(target).__name__}; {style!r} takes an nn.{wanted.__name__} here"
            )
        if isinstance(target, tuple(_MIXINS.values())):
            raise ValueError(f"parallelize_by_hand: {name!r} is already parallelized")
        targets[name] = target
    return targets


def parallelize_by_hand(
    module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, str], *, comm: str = "ring"
) -> nn.Module:
    """Split each Linear named in `plan` across the 1-D `mesh`, in place; returns `module`.
    plan: {name as in module.named_modules(): one of STYLES} (see the module docstring).
    comm: the conjugate ops' all-reduce, "ring" (labkit's) or "torch" (labkit.strategies.comm_choice;
    labkit's own keyword, torch's parallelize_module has none)."""
    collectives = choose(comm, "parallelize_by_hand")
    _check_mesh(mesh)
    targets = _check_plan(module, plan, mesh.size())
    group = mesh.get_group()
    rank, n = mesh.get_local_rank(), mesh.size()
    for name, target in targets.items():
        style = plan[name]
        if style in ("colwise", "colwise_sp"):
            _distribute(target, "weight", 0, mesh, rank, n)
            _distribute(target, "bias", 0, mesh, rank, n)
        elif style == "sequence":
            _distribute(target, "weight", None, mesh, rank, n)
            _distribute(target, "bias", None, mesh, rank, n)
        else:
            _distribute(target, "weight", 1, mesh, rank, n)
            _distribute(target, "bias", None, mesh, rank, n)
        setattr(target, "_tp_group", group)
        setattr(target, "_tp_name", name)
        setattr(target, "_tp_comm", collectives)
        _swap_class(target, style)
    return module
