"""FSDP by hand, as FSDP2 (torch.distributed.fsdp.fully_shard) does it: every parameter sharded
along dim 0, in place, one batched all-gather and one batched reduce-scatter per unit.

    for block in model.blocks:
        fully_shard_by_hand(block, reshard_after_forward=True)
    fully_shard_by_hand(model)                       # the root: the parameters no inner unit took
    opt = torch.optim.AdamW(model.parameters())      # AFTER sharding: it sees the shards
                                                     # (one built before raises at its first step)

Gradients are averaged over the ranks, as fully_shard's are (a mean loss per rank trains like the
global-batch mean); reduce_op="sum" or unit.set_gradient_divide_factor(1) sums them (the course
loop's convention: its per-rank loss is already divided by the global token count).

fully_shard_by_hand swaps the module's class to a subclass of (FSDPModule, its class), as
fully_shard does, and every parameter stays an nn.Parameter of its module whose data is this rank's
dim-0 shard (param.py: padding, the unsharded parameter, the storage resize). A unit's life,
hooked into the module's forward and into autograd (group.py):
  pre-forward    wait for (or issue) the unit's all-gather, point the modules at the unsharded
                 parameters, issue the all-gathers of the units named by
                 set_modules_to_forward_prefetch;
  post-forward   reshard (unless reshard_after_forward=False, or the unit is the root: it is
                 needed again at once); hook the outputs, whose gradient starts its backward;
  pre-backward   re-gather (the same storage autograd saved), prefetch the backward's next units;
  post-backward  once the unit's gradients have accumulated: one reduce-scatter into param.grad of
                 the shards (the shard's shape), reshard. The end of backward lands what is in flight.
A weight tied across two units belongs to the smallest unit holding every module that uses it (the
root for the toy's head / extra): the outer call takes it over from the inner unit. Frozen
parameters are sharded and gathered too (as FSDP2), never reduced. A parameter unused in a step
gets no gradient (its .grad stays None, as in single-process training): its unit reduce-scatters
only the gradients that exist, at the end of backward. With gradient accumulation every micro-batch
reduce-scatters and the shards' .grad add up (no_sync does not keep unsharded gradients).

Collectives: labkit's ring all-gather / reduce-scatter, asynchronous on labkit's comm thread, so a
prefetched gather overlaps compute; max_inflight (set_max_inflight_gathers) bounds the units
gathered ahead of use, beyond which a prefetch is skipped (the unit gathers when it runs).
mp_policy=MixedPrecision(param_dtype, reduce_dtype) (labkit.strategies.precision, the same fields
as torch's MixedPrecisionPolicy; fp16 gets dynamic loss scaling in the FSDP strategy's step, the ranks
agreeing on a skip by an all-reduce, as torch's ShardedGradScaler): the all-gather and the
compute in param_dtype (floating forward inputs cast to it), the reduce-scatter in reduce_dtype,
the shard in the parameter's own dtype is the master copy the optimizer steps. Device: every
buffer is made on the parameters' device; on CUDA labkit's comm thread synchronizes the stream
(no separate copy / communication streams, so no overlap of copies with compute there; this path
has not been run on a GPU yet). The root stays gathered after a forward under no_grad (no
backward will reshard it): call model.reshard().
reshard_after_forward=<int k> (FSDP2's): after forward keep 1/k, re-gathered in groups of k
consecutive ranks (a node) before backward (reshard_to.py).
mesh= takes a DeviceMesh instead of group=; a 2-D one (replicate, shard) is HSDP (hsdp.py): shards
over the "shard" dim, the gradient shard all-reduced over "replicate" after each reduce-scatter.
FSDP x TP: with mesh=mesh2d["dp"], a tensor-parallel parameter (a DTensor on mesh2d["tp"], from
labkit.strategies.tp.parallelize_by_hand) is sharded as its TP-local tensor, unsharded back to it
for the TP forward, and its shard is a DTensor on the 2-D mesh (param.py's TPLayout); full
dicts gather over dp, then tp (strategy "fsdp-tp", labkit.strategies.tp).
offload_policy=CPUOffloadPolicy(pin_memory) (offload.py; torch's class accepted too): shards,
gradient shards and optimizer state on the host, the optimizer step there; a unit's shards are
copied to the device before its all-gather ("h2d") and its gradient shards back when its
reduce-scatter lands ("d2h"), both traced.
What it leaves out: meta-device init, output_dtype, a module holding tied
weights that torch's fully_shard would split (strategy FSDP drops such units, like torch_ref.py's TorchFSDP;
fully_shard_by_hand handles them), the limits in group.py. The FSDP1 way (one flat buffer
per unit) is flat.py.
"""

import contextlib
import weakref
from typing import Any, Callable, Optional, Sequence, Union, cast

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map_only

from labkit.observe.memory import host_allocations, mark_host
from labkit.strategies import Strategy, unobserved
from labkit.strategies.comm_choice import choose
from labkit.strategies.precision import LossScaler, MixedPrecision, check_policy
from labkit.strategies.fsdp.group import FSDPContext, FSDPParamGroup
from labkit.strategies.fsdp import reshard_to
from labkit.strategies.fsdp.mesh import dtensor_mesh, mesh_groups
from labkit.strategies.fsdp.offload import CPUOffloadPolicy, check_offload
from labkit.strategies.fsdp.param import FSDPParam, Layout, batched_all_gather
from labkit.strategies.fsdp.plan import innermost_first, own_units, plan_units

__all__ = [
    "CPUOffloadPolicy",
    "FSDP",
    "FSDPModule",
    "allow_orphaned_parameters",
    "collective_counts",
    "full_state_dict",
    "full_grad_dict",
    "fully_shard_by_hand",
]


class FSDPModule:
    """The methods fully_shard_by_hand adds to a unit's module (its class becomes
    FSDP<Class>(FSDPModule, Class)), named as FSDP2's."""

    _fsdp_group: FSDPParamGroup  # the unit, set by fully_shard_by_hand

    def unshard(self, async_op: bool = False) -> None:
        """All-gather the unit (async_op: only issue it; the next forward waits)."""
        self._fsdp_group.start_unshard()
        if not async_op:
            self._fsdp_group.wait_unshard()

    def reshard(self) -> None:
        self._fsdp_group.reshard()

    def set_reshard_after_forward(self, value: Union[bool, int]) -> None:
        g = self._fsdp_group
        g.reshard_after_forward = reshard_to.check(value, g.group, g.replicate_group)

    def set_modules_to_forward_prefetch(self, modules: Sequence[Any]) -> None:
        self._fsdp_group.forward_prefetch = _fsdp_modules(modules)

    def set_modules_to_backward_prefetch(self, modules: Sequence[Any]) -> None:
        self._fsdp_group.backward_prefetch = _fsdp_modules(modules)

    def set_max_inflight_gathers(self, limit: int) -> None:
        """How many units may be gathered ahead of use (labkit's own; FSDP2 has none): an int >= 1."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"set_max_inflight_gathers: limit must be an int >= 1, got {limit!r}")
        self._fsdp_group.ctx.max_inflight = limit

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's: False, and a backward reduce-scatters nothing (the unsharded gradients add up
        over backwards, as FSDP2's); True again before the last one. recurse: the inner units too."""
        for g in _units_of(self, recurse):
            g.reduce_grads = bool(requires_gradient_sync)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """FSDP2's: False keeps the unit gathered after its backward (a pipeline's next micro-batch
        reuses it: gathered once per step with reshard_after_forward=False)."""
        for g in _units_of(self, recurse):
            g.reshard_after_backward = bool(reshard_after_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """What this unit divides the summed gradients by (FSDP2's name): by default the number
        of ranks that compute a gradient of it (AVG: the shard group's size, times the replicas
        under HSDP), 1 for SUM (the course loop's loss convention)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive number, got {factor!r}")
        self._fsdp_group.divide_factor = factor


def _units_of(module: Any, recurse: bool) -> list:
    """The unit of FSDPModule `module`, and with recurse the units of the FSDPModules inside it."""
    if not recurse:
        return [module._fsdp_group]
    return [m._fsdp_group for m in module.modules() if isinstance(m, FSDPModule)]


def _fsdp_modules(modules: Any) -> list:
    """modules as a list, each an FSDPModule: what FSDP2's set_modules_to_*_prefetch accept (they
    raise ValueError("Expects FSDPModule but got ...") for anything else, as here)."""
    if not isinstance(modules, (list, tuple)):
        raise ValueError(
            f"Expects a list of FSDPModule (units fully_shard_by_hand made) but got {type(modules)}: {modules!r}"
        )
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(m)}: {m!r}")
    return list(modules)


def _check_prefetch(prefetch: Any, who: str) -> None:
    """The FSDP strategy's prefetch (labkit's own: how many units ahead each unit gathers, turned
    into set_modules_to_*_prefetch lists): an int >= 0. A negative one would slice units off the
    far end, a float fails deep in a slice."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(
            f"{who}: prefetch must be an int >= 0 (how many units ahead each unit gathers; 0: none, "
            f"default 1), got {type(prefetch).__name__} {prefetch!r}"
        )


_CLASSES: dict[type, type] = {}


def _swap_class(module):
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        module.__class__ = _CLASSES[cls]


REDUCE_OPS = ("avg", "sum")


def fully_shard_by_hand(
    module: torch.nn.Module,
    *,
    reshard_after_forward: Union[bool, int] = True,
    mp_policy: Optional[MixedPrecision] = None,
    group: Any = None,
    mesh: Any = None,
    reduce_op: str = "avg",
    offload_policy: Any = None,
) -> torch.nn.Module:
    """Shard `module`'s parameters not already in an inner unit, in place; returns `module`
    (now an FSDPModule). Call it on inner modules first, the root last, then build the optimizer.
    offload_policy: None (fully_shard's OffloadPolicy(): nothing offloaded) or CPUOffloadPolicy
    (labkit's or torch's): shards, gradients and optimizer state on the host (offload.py).
    mesh: a DeviceMesh instead of group; a 2-D one (replicate, shard) is HSDP (hsdp.py).
    reduce_op: "avg" (fully_shard's default: each rank's loss is a mean over its own rows) or
    "sum" (the course loop's: each rank's loss is already divided by the global token count);
    module.set_gradient_divide_factor(f) sets any other divisor for this unit."""
    mp_policy = check_policy(mp_policy, "fully_shard_by_hand")
    offload = check_offload(offload_policy, "fully_shard_by_hand")
    if isinstance(module, FSDPModule):
        raise ValueError(f"{type(module).__name__} is already a unit")
    if reduce_op not in REDUCE_OPS:
        raise ValueError(
            f"fully_shard_by_hand: reduce_op must be 'avg' (fully_shard's default) "
            f"or 'sum', got {reduce_op!r}"
        )
    group, replicate = mesh_groups(mesh, group)
    reshard_after_forward = reshard_to.check(reshard_after_forward, group, replicate)
    if not isinstance(reshard_after_forward, bool):
        if offload is not None:
            raise NotImplementedError(
                "fully_shard_by_hand: offload_policy with reshard_after_forward=<int> is left out "
                "(offload.py): use reshard_after_forward=True or False"
            )
        reshard_to.subgroup(reshard_after_forward)  # a collective: made now, on every rank
    param_dtype = getattr(mp_policy, "param_dtype", None)
    reduce_dtype = getattr(mp_policy, "reduce_dtype", None)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    first = next(iter(module.parameters()), None)
    device_type = first.device.type if first is not None else "cpu"
    dmesh, placements = dtensor_mesh(mesh, group, device_type)
    _guard_optimizer_steps()
    names = {id(m): n for n, m in module.named_modules()}
    order = {key: i for i, key in enumerate(names)}
    inner = [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)]
    taken = {id(p.sharded) for m in inner for p in m._fsdp_group.params}
    inside = set(module.modules())
    slots: dict[int, tuple[Any, list]] = {}
    moved: dict[int, FSDPParam] = {}
    for sub in module.modules():
        for attr, p in sub._parameters.items():
            if p is None:
                continue
            if id(p) in taken:
                continue  # an inner unit's shard, held by its own modules
            fp = _taken_original(p)
            if fp is not None:
                # A tied weight an inner unit already took: this slot (outside that unit) still
                # holds the original tensor. If this unit encloses that one, the weight moves
                # here; if not, it waits for a unit that encloses both (the root).
                if fp.group.module in inside:
                    moved.setdefault(id(fp), fp).slots.append((sub, attr))
                continue
            slots.setdefault(id(p), (p, []))[1].append((sub, attr))
    params = []
    for p, where in slots.values():
        outer = _SHARDS.get(id(p))
        if outer is not None and outer.sharded is p:
            raise ValueError(
                f"{type(module).__name__}'s parameter {where[0][1]!r} is already a shard "
                f"of the unit {outer.group.label!r}, which encloses it: shard the inner "
                f"modules first and the root last (fully_shard's order)"
            )
        if offload is not None and p.__class__.__name__ == "DTensor":
            raise NotImplementedError(
                f"fully_shard_by_hand: offload_policy on a tensor-parallel parameter "
                f"({where[0][1]!r}, FSDP x TP) is left out (offload.py)"
            )
        fp = FSDPParam(p, where, [], rank, world_size, param_dtype, dmesh, placements)
        if offload is not None:
            fp.offload_shard(offload)
        _SHARDS[id(fp.sharded)] = fp
        _UNSHARDED[id(fp.unsharded)] = fp
        fp.original = weakref.ref(p)
        _ORIGINALS[id(p)] = fp
        params.append(fp)
    for fp in moved.values():
        if fp.offload != offload:
            raise ValueError(
                f"fully_shard_by_hand: {fp.names[0]} is tied across units with different "
                f"offload_policy ({fp.offload} inside, {offload} here): give every unit the same one"
            )
        fp.group.remove(fp)
        params.append(fp)
        fp.use_sharded()
    ctx = FSDPContext()
    unit = FSDPParamGroup(ctx, module, "root", params, group, reduce_dtype)
    unit.reshard_after_forward, unit.param_dtype = reshard_after_forward, param_dtype
    unit.replicate_group = replicate
    # AVG divides by every rank that holds a replica of the gradient: the shard group's, times
    # the replicas' under HSDP.
    replicas = dist.get_world_size(replicate) if replicate is not None else 1
    unit.divide_factor = world_size * replicas if reduce_op == "avg" else 1
    ctx.groups = [unit]
    for m in inner:  # module order: one context for the whole tree
        m._fsdp_group.is_root = False
        if m._fsdp_group.ctx is not ctx:
            ctx.groups.extend(g for g in m._fsdp_group.ctx.groups if g not in ctx.groups)
    for g in ctx.groups:  # names and labels as seen from the outermost unit
        g.ctx = ctx
        g.label = names.get(id(g.module)) or "root"
        for p in g.params:
            # named_parameters() order, so names[0] is the name it lists a tied weight under
            # (the slot an inner unit took first may come later in the module order).
            p.slots.sort(key=lambda slot: order.get(id(slot[0]), len(order)))
            p.names = [f"{names[id(m)]}.{a}".lstrip(".") for m, a in p.slots]
    _swap_class(module)
    setattr(module, "_fsdp_group", unit)  # (nn.Module's typing takes tensors and modules)
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    module.register_forward_hook(_post_forward)
    _register_state_dict_hooks(unit)
    return module


def _register_state_dict_hooks(unit):
    """As fully_shard's: before state_dict() and load_state_dict() the unit is resharded, so its
    modules hold the DTensor shards (the global shapes). A load given whole plain tensors (a full
    state dict) takes each rank's rows of them, so load_state_dict(full) works."""
    for module in {id(m): m for p in unit.params for m, _ in p.slots}.values():
        if getattr(module, "_labkit_sd_hooks", False):
            continue  # a module of two units (a tied weight that moved): hooked once
        module._labkit_sd_hooks = True
        module.register_state_dict_pre_hook(lambda *_, m=module: _to_sharded(m))
        module._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True)


def _unit_params(module):
    """(fsdp_param, attr) for each parameter slot of `module` that a unit holds."""
    out = []
    for attr, t in module._parameters.items():
        fp = _SHARDS.get(id(t)) or _UNSHARDED.get(id(t))
        if fp is not None and (fp.sharded is t or fp.unsharded is t):
            out.append((fp, attr))
    return out


def _to_sharded(module):
    for fp, _ in _unit_params(module):
        if fp.group.state != "sharded" and not fp.group.backward_started:
            fp.group.reshard()


def _load_pre_hook(module, state_dict, prefix, *_):
    from torch.distributed.tensor import DTensor

    _to_sharded(module)
    for fp, attr in _unit_params(module):
        key = prefix + attr
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or fp.mesh is None:
            continue
        if fp.tp is not None:
            raise NotImplementedError(
                f"load_state_dict: {key} is a tensor-parallel parameter sharded over dp (FSDP x "
                f"TP); loading whole tensors into it is left out: pass the DTensors state_dict() gives"
            )
        if tuple(value.shape) != tuple(fp.shape):
            raise RuntimeError(
                f"load_state_dict: {key} has shape {tuple(value.shape)}; the sharded model's "
                f"parameter is {tuple(fp.shape)} (whole) and a rank's shard "
                f"{tuple(fp.local(fp.sharded).shape)}: pass whole tensors (a full state dict), "
                f"DTensors as state_dict() gives them, or use torch.distributed.checkpoint."
                f"state_dict.set_model_state_dict"
            )
        rows = value.detach().reshape(fp.dim0, *fp.rest)
        start = min(dist.get_rank(fp.group.group) * fp.rows, fp.dim0)
        padded = value.new_zeros((fp.rows, *fp.rest), device=fp.padded.device, dtype=fp.padded.dtype)
        padded[: fp.valid].copy_(rows[start : start + fp.valid])
        state_dict[key] = fp.to_dtensor(padded)


# id(original parameter) -> the FSDPParam that sharded it, both held weakly (fp.original checks
# against a reused id): the original is freed once no module holds it, the entry with its model.
_ORIGINALS: "weakref.WeakValueDictionary[int, FSDPParam]" = weakref.WeakValueDictionary()
_SHARDS: "weakref.WeakValueDictionary[int, FSDPParam]" = (
    weakref.WeakValueDictionary()
)  # id(shard parameter) -> its FSDPParam (the same rule)
_UNSHARDED: "weakref.WeakValueDictionary[int, FSDPParam]" = (
    weakref.WeakValueDictionary()
)  # id(unsharded parameter) -> its FSDPParam
_step_guard = None  # the optimizer step pre-hook below, registered at the first sharding


def _refuse_orphaned_parameters(optimizer, args, kwargs):
    """Every torch optimizer's step pre-hook (registered once fully_shard_by_hand has run):
    refuse to step a parameter that fully_shard_by_hand has sharded away. The model now holds
    a new nn.Parameter (the shard); the optimizer's old tensor gets no gradient and is never read,
    so the step would change nothing and nothing would say so (fully_shard is silent too)."""
    if not _ORIGINALS or getattr(optimizer, "_labkit_allow_orphans", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            fp = _taken_original(p)
            if fp is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} was built before fully_shard_by_hand sharded "
                    f"{fp.names[0]}: it holds "
                    f"the original, now unused tensors, so its step would change nothing. Build "
                    f"the optimizer AFTER sharding: opt = {type(optimizer).__name__}"
                    f"(model.parameters(), ...)"
                )


def allow_orphaned_parameters(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Let `optimizer` step tensors fully_shard_by_hand sharded away (what fully_shard silently
    does): only for showing that mistake's symptom, as the FSDP lab's drill does. Returns it."""
    setattr(optimizer, "_labkit_allow_orphans", True)
    return optimizer


def _guard_optimizer_steps():
    global _step_guard
    if _step_guard is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_guard = register_optimizer_step_pre_hook(_refuse_orphaned_parameters)


def _taken_original(tensor):
    fp = _ORIGINALS.get(id(tensor))
    return fp if fp is not None and fp.original() is tensor else None


def _pre_forward(module, args, kwargs):
    unit = module._fsdp_group
    unit.check_params()
    unit.ctx.observe("begin", f"fwd {unit.label}")
    unit.wait_unshard()
    unit.ctx.prefetch(unit.forward_prefetch)
    if unit.param_dtype is not None:  # FSDP2's cast_forward_inputs
        cast = lambda t: t.to(unit.param_dtype) if t.is_floating_point() else t  # noqa: E731
        args, kwargs = tree_map_only(torch.Tensor, cast, (args, kwargs))
    return args, kwargs


def _post_forward(module, args, output):
    unit = module._fsdp_group
    unit.ctx.observe("end", f"fwd {unit.label}")
    if unit.reshard_after_forward is not True and unit.reshard_after_forward and not unit.is_root:
        reshard_to.reshard_to(unit, unit.reshard_after_forward)  # an int: keep 1/k (reshard_to.py)
    elif unit.reshard_after_forward and not unit.is_root:
        unit.reshard()
    if torch.is_grad_enabled():
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, u=unit: _pre_backward(u))
    return output


def _pre_backward(unit):
    unit.ctx.queue_end_of_backward()
    if not unit.backward_started:  # once per backward (a unit called twice has two outputs)
        unit.backward_started = True
        unit.ctx.observe("begin", f"bwd {unit.label}")
        unit.wait_unshard()
        unit.ctx.prefetch(unit.backward_prefetch)


def _groups(model):
    """Every unit in `model`, in module order (the same on every rank: collectives follow it)."""
    return [m._fsdp_group for m in model.modules() if isinstance(m, FSDPModule)]


def _gather(groups, tensor_of):
    """{id(tensor): full tensor} for tensor_of(fsdp_param) (None: skipped), one batched all-gather
    per unit, synchronous: a collective, every rank calls it alike."""
    full = {}
    for g in groups:
        params = [p for p in g.params if tensor_of(p) is not None]
        if not params:
            continue
        layout = Layout([(p.numel, tensor_of(p).dtype) for p in params])
        with torch.no_grad():
            buffer, _ = batched_all_gather(
                layout,
                [p.pad(tensor_of(p)) for p in params],
                g.group,
                g.device,
                async_op=False,
                comm=g.ctx.comm,
            )
        for i, p in enumerate(params):
            full[p] = p.full_from(layout.piece(buffer, i))
            if p.tp is not None:  # FSDP x TP: the TP-local tensor gathered over "tp" too
                full[p] = p.tp.whole(full[p])
    return full


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{state_dict key: full tensor} on every rank (a collective): original keys, both keys of a
    tied weight, buffers included, padding stripped, each parameter in its shard's dtype."""
    full = _gather(_groups(model), lambda p: p.padded)
    by_id = {id(t): v for p, v in full.items() for t in (p.sharded, p.unsharded)}
    return {
        k: by_id[id(v)] if id(v) in by_id else _whole(v) for k, v in model.state_dict(keep_vars=True).items()
    }


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor no unit holds, whole: a DTensor (a parameter parallelize_by_hand split, with no
    FSDP unit over it) through full_tensor(), a collective over its mesh in state_dict order (the
    same on every rank); anything else a detached copy."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach().clone()
    return tensor.detach().clone()


def full_grad_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: full gradient} of the shards' .grad (a collective), each parameter under its
    first name, as named_parameters() lists it."""
    full = _gather(_groups(model), lambda p: p.sharded.grad)
    out = {p.names[0]: v for p, v in full.items()}
    held = {id(t) for g in _groups(model) for p in g.params for t in (p.sharded, p.unsharded)}
    for name, param in model.named_parameters():  # no unit holds it: whole, as full_state_dict
        if id(param) not in held and param.grad is not None:
            out[name] = _whole(param.grad)
    return out


def collective_counts(fsdp: "FSDP") -> dict[str, float]:
    """{"gathers", "reduce_scatters"} per optimizer step so far (loop.train's report=)."""
    ctx = fsdp.ctx
    steps = max(fsdp.steps_taken, 1)
    return {"gathers": ctx.gathers / steps, "reduce_scatters": ctx.reduce_scatters / steps}


class FSDP(Strategy):
    """The loop strategy "fsdp": fully_shard_by_hand on the preset's units (innermost first), then
    the root; the optimizer over the shards; prefetch = how many units ahead each unit gathers, in
    the units' module order (forward) and its reverse (backward)."""

    steps_taken = 0
    model: torch.nn.Module
    optimizer: Any = None
    scaler: Optional[LossScaler]

    # Where the units shard (mesh= a DeviceMesh, 2-D for HSDP, or group= a process group),
    # like_torch (False: keep a unit fully_shard could not have, one whose weight is tied to
    # another unit's) and over which collectives (comm= "ring", labkit's, or "torch"; see
    # labkit.strategies.comm_choice): FSDP's **sharding, nothing else.
    # offload_policy: where the shards live (None: on the device; a CPUOffloadPolicy: the host).
    SHARDING = {"mesh": None, "group": None, "like_torch": True, "comm": "ring", "offload_policy": None}

    def __init__(
        self,
        model,
        cfg,
        units=None,
        reshard_after_forward=True,
        prefetch=1,
        max_inflight=2,
        reduce_op="sum",
        mp_policy=None,
        **sharding,
    ):
        mp_policy = check_policy(mp_policy, type(self).__name__)
        _check_prefetch(prefetch, type(self).__name__)
        unknown = sorted(set(sharding) - set(self.SHARDING))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}: unknown option(s) {', '.join(unknown)}; its "
                f"sharding options are {', '.join(self.SHARDING)}"
            )
        mesh, group, like_torch, comm, offload = ({**self.SHARDING, **sharding}[k] for k in self.SHARDING)
        self.offload = check_offload(offload, type(self).__name__)
        collectives = choose(comm, type(self).__name__)
        self.model, self.reduce_op = model, reduce_op
        planned = plan_units(model, cfg.units if units is None else units)
        order = own_units(model, planned) if like_torch else planned
        for m in innermost_first(model, order):
            fully_shard_by_hand(
                m,
                reshard_after_forward=reshard_after_forward,
                mp_policy=mp_policy,
                group=group,
                mesh=mesh,
                reduce_op=reduce_op,
                offload_policy=self.offload,
            )
        fully_shard_by_hand(
            model,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            group=group,
            mesh=mesh,
            reduce_op=reduce_op,
            offload_policy=self.offload,
        )
        root = cast(FSDPModule, model)
        self.ctx = root._fsdp_group.ctx
        self.ctx.comm = collectives  # before the first all-gather (none runs while sharding)
        root.set_max_inflight_gathers(max_inflight)
        self.units = _groups(model)  # root first, then module order
        inner = [m for m in model.modules() if m is not model and isinstance(m, FSDPModule)]
        root.set_modules_to_forward_prefetch(inner[:prefetch])
        root.set_modules_to_backward_prefetch(inner[::-1][:prefetch])
        for i, unit in enumerate(inner):
            unit.set_modules_to_forward_prefetch(inner[i + 1 : i + 1 + prefetch])
            unit.set_modules_to_backward_prefetch(inner[:i][::-1][:prefetch])
        self.optimizer = cfg.make_optimizer([p for p in model.parameters() if p.requires_grad])
        # fp16: dynamic loss scaling over the shards' gradients (FSDP2 leaves it to the training
        # loop, e.g. torch's ShardedGradScaler; here the strategy is that loop's step).
        self.scaler = (
            LossScaler(mp_policy.init_scale, growth_interval=mp_policy.growth_interval)
            if getattr(mp_policy, "loss_scaling", False)
            else None
        )
        self.group = group  # a mesh spans every rank: the loss scaler's all-reduce too

    @classmethod
    def from_preset(cls, model: torch.nn.Module, cfg: Any, **options: Any) -> "FSDP":
        return cls(model, cfg, **options)

    @property
    def observe(self) -> Callable[..., None]:
        return self.ctx.observe

    @observe.setter
    def observe(self, hook: Optional[Callable[..., None]]) -> None:
        self.ctx.observe = hook or unobserved

    def sharded_parameters(self) -> list[torch.Tensor]:
        """Every shard (trainable and frozen): what this rank holds of the model."""
        return [p.sharded for g in self.units for p in g.params]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def step(self) -> None:
        if self.scaler is not None and not self._unscale():
            return  # an overflow on some rank: every rank skips this step
        # CPU offload: the shards, their gradients and the state are host tensors, so the step
        # runs on the host; what it allocates (the state, its temporaries) is host memory.
        with host_allocations() if self.offload is not None else contextlib.nullcontext():
            self.optimizer.step()
        if self.offload is not None:  # state made where the tracker cannot see it (torch.tensor)
            for state in self.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        mark_host(value)
        self.steps_taken += 1

    def _unscale(self):
        """Divide the shards' gradients by the loss scale; False (skip) if any rank's shard holds
        an inf or nan: each rank sees only its shard, so the ranks agree by an all-reduce (MAX)."""
        # The gradients' local rows (DTensors: a check on the DTensor itself would be a collective).
        grads = [
            getattr(p.grad, "_local_tensor", p.grad)
            for g in self.optimizer.param_groups
            for p in g["params"]
            if p.grad is not None
        ]
        assert self.scaler is not None  # fp16 only
        scale = self.scaler.scale
        found = torch.tensor(
            [float(any(not torch.isfinite(g).all() for g in grads))],
            # the compute device: with CPU offload the gradients are on the host, NCCL is not
            device=self.units[0].device if self.units else None,
        )
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        if self.scaler.update(bool(found.item())):
            return False
        for g in grads:
            g.div_(scale)
        return True

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        return full_grad_dict(self.model)
