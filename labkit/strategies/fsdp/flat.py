"""FSDP1 (ZeRO-3; strategy "fsdp-flat") by hand: every unit's parameters live as 1/N of a flat,
padded buffer per rank, and are whole only while that unit computes. The course's main FSDP is
labkit.strategies.fsdp (FSDP2's per-parameter sharding); this one stays for the comparison.

    fsdp = wrap_flat_by_hand(TinyGPT(cfg), units="block", reshard_after_forward=True, prefetch=1)
    opt = make_optimizer(fsdp.parameters())          # AdamW over the shards: no communication
    loss = fsdp(x, y)[1]; loss.backward(); opt.step()

The lifecycle of one unit (FSDPUnit), hooked into autograd:
  pre-forward   all-gather the shards into a fresh full flat buffer (unshard), whose views become
                the module's parameters through `_GatherParams`, a custom autograd.Function;
  post-forward  drop the buffer (reshard) if reshard_after_forward: the ops that saved a parameter
                for backward saved only "unit, offset, shape" (saved_tensors_hooks), not memory;
  pre-backward  a hook on the unit's output re-gathers it (and prefetches the unit before it);
  post-backward `_GatherParams.backward` runs once all of the unit's parameter gradients exist
                (autograd does the counting): flatten them, reduce-scatter (AVG) into this rank's
                shard gradient, drop the buffer.
The root unit (every parameter not in a smaller unit, the tied embedding / LM head included, as
fully_shard does) is gathered before forward and resharded only after its backward.

Collectives are labkit's ring reduce-scatter / all-gather on one FIFO communication thread, issued
asynchronously (so prefetch overlaps compute); `max_inflight` limits how many gathered-but-unused
buffers prefetch may hold (the rate limiter).

What it leaves out: frozen parameters stay replicated and outside the flat buffers; a parameter
unused on every rank in a step while the rest of its unit is used (FSDP1 steps it with a zero
gradient, so AdamW decays it: step() refuses it instead, naming it); fp16 (its loss scaling), frozen parameters under a policy
(they would stay fp32 outside the buffers: refused), CPU offload, HSDP, process subgroups other
than one `group`, a unit's module being called twice in one forward (it works, but gathers twice).
Checkpoints are in labkit.strategies.checkpoint.

Mixed precision (the strategy's mp_policy=MixedPrecision(bf16, reduce_dtype), FSDP1's MixedPrecision(param_dtype,
reduce_dtype)): the flat shard stays fp32 (the master the optimizer steps); each unshard casts it to
param_dtype and all-gathers that, so the module's parameters are 16-bit views of a 16-bit buffer;
post-backward flattens the 16-bit gradients into a reduce_dtype buffer, reduce-scatters it, and the
shard's gradient is that result cast to the shard's dtype.
"""

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from labkit.strategies import Strategy
from labkit.strategies.comm_choice import Collectives, Ring, choose
from labkit.strategies.fsdp.flat_unit import FSDPUnit, _rank_device
from labkit.strategies.fsdp.plan import plan_units
from labkit.strategies.precision import check_policy

__all__ = ["FSDPUnit", "FSDPModel", "wrap_flat_by_hand"]


class FSDPModel(nn.Module, Strategy):
    """The wrapped model: `parameters()` are the shards (plus frozen replicated parameters). Also
    the loop's strategy "fsdp-flat" (a Strategy: nn.Module's __call__ is the forward)."""

    # Cleared only inside no_sync() when reshard_between_micro_batches is off (the strategy's
    # option): the units then keep their gathered buffers between micro-batches.
    reshard_after_backward = True
    # The units' collectives (labkit.strategies.comm_choice): labkit's ring unless from_preset's
    # comm= says otherwise (set before any unit gathers; building the units sends nothing else).
    comm: Collectives = Ring()
    # Mixed precision (from_preset sets them from mp_policy): what the units gather in and reduce in;
    # None: the shards' dtype.
    param_dtype: Any = None
    reduce_dtype: Any = None

    def __init__(
        self,
        model,
        units="block",
        reshard_after_forward=True,
        prefetch=1,
        max_inflight=2,
        reduce_op="avg",
        group=None,
        sync_from_rank0=False,
    ):
        super().__init__()
        if sync_from_rank0:
            _materialize_the_rest(model, group)
        self.module = model
        self.reshard_after_forward = reshard_after_forward
        self.prefetch, self.max_inflight, self.reduce_op = prefetch, max_inflight, reduce_op
        self.gathers_issued = self.reduce_scatters_issued = 0
        self._storage_to_unit, self._pending_reductions = {}, []
        self._callback_queued = False
        unit_modules = plan_units(model, units)
        self.units = self._build_units(model, unit_modules, group, sync_from_rank0)
        self.flat_shards = nn.ParameterList([u.shard for u in self.units])
        self._forward_order = list(self.units[1:])
        self._this_forward = []
        for unit in self.units[1:]:
            module = unit.module
            module.register_forward_pre_hook(lambda m, args, u=unit: self._pre_forward(u))
            module.register_forward_hook(lambda m, args, out, u=unit: self._post_forward(u, out))

    def _build_units(self, model, unit_modules, group, sync_from_rank0):
        names = {id(m): n for n, m in model.named_modules()}
        owner_of = {}  # id(module) -> index of the innermost unit containing it

        def assign(module, current):
            current = unit_modules.index(module) + 1 if any(module is u for u in unit_modules) else current
            owner_of[id(module)] = current
            for child in module.children():
                assign(child, current)

        assign(model, 0)
        by_param: dict[int, list] = {}  # id(param) -> [param, [(module, attr)], set of units]
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None and p.requires_grad:
                    entry = by_param.setdefault(id(p), [p, [], set()])
                    entry[1].append((module, attr))
                    entry[2].add(owner_of[id(module)])
        grouped: list[tuple[list, list, list]] = [([], [], []) for _ in range(len(unit_modules) + 1)]
        for p, slots, owners in by_param.values():
            # A parameter shared by modules of two units (the tied embedding) goes to the root.
            index = owners.pop() if len(owners) == 1 else 0
            params, slot_lists, qualnames = grouped[index]
            params.append(p)
            slot_lists.append(slots)
            qualnames.append([f"{names[id(m)]}.{a}".lstrip(".") for m, a in slots])
        units = []
        for index, (params, slots, qualnames) in enumerate(grouped):
            module = model if index == 0 else unit_modules[index - 1]
            label = "root" if index == 0 else names[id(module)]
            unit = FSDPUnit(self, label, params, slots, qualnames, group, index, sync_from_rank0)
            unit.module = module
            units.append(unit)
        return units

    # ---------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        root = self.units[0]
        self._this_forward = []
        root.wait_unshard()
        root.attach()
        self._prefetch(self._forward_order, 0)
        with saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        if self._this_forward:
            self._forward_order = self._this_forward  # prefetch follows what really ran
        return out

    def _pre_forward(self, unit):
        self._this_forward.append(unit)
        self.observe("begin", f"fwd {unit.label}")
        unit.wait_unshard()
        unit.attach()
        self.observe("mark", f"unshard {unit.label}")
        order = self._forward_order
        if unit in order:
            self._prefetch(order, order.index(unit) + 1)

    def _post_forward(self, unit, out):
        self.observe("end", f"fwd {unit.label}")
        if self.reshard_after_forward:
            unit.reshard()
        outs = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (tuple, list)) else []
        # One hook is enough: the unit's backward starts when the gradient reaches its output.
        for tensor in (t for t in outs if isinstance(t, torch.Tensor)):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, u=unit: self._pre_backward(u))
                break
        return None

    def _prefetch(self, order, first):
        for unit in order[first : first + self.prefetch]:
            inflight = sum(u.prefetched for u in self.units)
            if unit.full is None and inflight < self.max_inflight:
                unit.start_unshard(prefetched=True)

    # ---------------------------------------------------------------- backward
    def _pre_backward(self, unit):
        self._ensure_final_callback()
        self.observe("begin", f"bwd {unit.label}")
        unit.wait_unshard()
        self.observe("mark", f"unshard {unit.label}")
        backward_order = list(reversed(self._forward_order))
        if unit in backward_order:
            self._prefetch(backward_order, backward_order.index(unit) + 1)

    def _pack(self, tensor):
        # A tensor on a unit's gathered buffer is saved as (unit, layout), not as memory.
        try:
            unit = self._storage_to_unit.get(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            unit = None
        if unit is None:
            return tensor
        return (unit, tuple(tensor.shape), tensor.stride(), tensor.storage_offset())

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        unit, shape, stride, offset = packed
        unit.wait_unshard()  # normally a no-op: the pre-backward hook already gathered it
        return unit.full.as_strided(shape, stride, offset)

    def _ensure_final_callback(self):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _land_reductions(self, keep):
        """Wait for all but the newest `keep` reduce-scatters and give their shards the result.
        Keeping one in flight overlaps it with the next unit's backward, as FSDP2 does, while the
        older units' padded gradient buffers are freed instead of piling up until the end."""
        while len(self._pending_reductions) > keep:
            unit, out, handle, _flat = self._pending_reductions.pop(0)
            handle.wait()
            shard = unit.shard
            out = out.to(shard.dtype)  # mixed precision: reduce_dtype into the fp32 master's
            shard.grad = out if shard.grad is None else shard.grad.add_(out)

    def _finish_backward(self):
        """After the whole backward: wait for the reduce-scatters, hand the shards their grads."""
        self._land_reductions(keep=0)
        if self.reshard_after_backward:
            for unit in self.units:
                unit.reshard()
        self._callback_queued = False
        self.observe("mark", "after backward")

    # ---------------------------------------------------------------- instrumentation
    # The one hook, Strategy's `observe` (labkit.strategies.unobserved unless labkit.loop.train
    # sets it): a span per unit's forward and backward ("begin"/"end": they open in one autograd
    # hook and close in another), a memory sample at every unshard and reshard ("mark": the
    # saw-tooth), and the category of the gather / reduce-scatter buffers ("tag").

    # ---------------------------------------------------------------- labkit.strategies interface
    # Gradients are reduce-scattered inside backward, after every micro-batch (the gradient must
    # stay sharded), so after_backward() has nothing to do and no_sync() (a micro-batch before the
    # step's last) only decides whether the gathered weights are kept for the next micro-batch.
    optimizer: Any = None  # set by from_preset
    reshard_between_micro_batches = True
    steps_taken = 0

    @classmethod
    def from_preset(
        cls,
        model: torch.nn.Module,
        cfg: Any,
        reshard_between_micro_batches: bool = True,
        mp_policy: Any = None,
        comm: str = "ring",
        **options: Any,
    ) -> "FSDPModel":
        options.setdefault("units", cfg.units)
        options.setdefault("reduce_op", "sum")
        collectives = choose(comm, cls.__name__)
        policy = _check_mixed_precision(model, mp_policy)
        fsdp = cls(model, **options)
        if policy is not None:  # read at each gather and reduce-scatter (none has run yet)
            fsdp.param_dtype, fsdp.reduce_dtype = policy.param_dtype, policy.reduce_dtype
        fsdp.comm = collectives
        fsdp.reshard_between_micro_batches = reshard_between_micro_batches
        fsdp.optimizer = cfg.make_optimizer([p for p in fsdp.parameters() if p.requires_grad])
        return fsdp

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        keep = self.reshard_after_backward
        self.reshard_after_backward = keep and self.reshard_between_micro_batches
        try:
            yield
        finally:
            self.reshard_after_backward = keep

    def after_backward(self) -> None:
        pass

    def step(self) -> None:
        self.check_every_parameter_reduced()
        self.optimizer.step()
        self.steps_taken += 1

    def check_every_parameter_reduced(self) -> None:
        """Raise, on every rank, naming them, if a parameter of a unit that took part in backward
        got a gradient on no rank since the last zero_grad (whose .grad one process would hold). Its segment of the flat shard gradient is
        zeros, so AdamW would step it (decay it, and move it by Adam's earlier moments) where one
        process and fully_shard (per-parameter: its grad stays None) leave it untouched -- FSDP1's
        flat-parameter behaviour, refused here rather than reproduced. One small all-reduce of a
        flag per parameter (untraced: a check, not the algorithm)."""
        units = [u for u in self.units if u.shard.grad is not None]
        flags = [float(f) for u in units for f in u.had_grad]
        if not flags:
            return
        used = torch.tensor(flags, device=units[0].shard.device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.units[0].group)
        names, i = [], 0
        for u in units:
            for n in u.names:
                if not used[i]:
                    names.append(n[0])
                i += 1
        if names:
            raise RuntimeError(
                f"fsdp-flat: {', '.join(names)} got no gradient on any rank since zero_grad, but "
                f"the rest of its unit did. A flat shard steps every element: AdamW would decay it "
                f"and Adam's moments move it, where one process and fully_shard leave it. Use 'fsdp' "
                f"(per-parameter shards), freeze it (requires_grad_(False) before wrapping), or put it "
                f"in a unit of its own"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module's, over the leaves only (shards, frozen parameters): a unit still gathered
        holds non-leaf views of its buffer, which have no .grad of their own."""
        for u in self.units:  # zeroed, not None: one process would step them too (AdamW decays zeros)
            u.had_grad = [not set_to_none] * len(u.had_grad)
        for p in self.parameters():
            if p.is_leaf and p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Every unit's shard gradient gathered (a collective), under each parameter's first name."""
        grads = {}
        for unit in self.units:
            if unit.shard.grad is None:
                continue
            full = torch.empty(unit.padded, dtype=unit.shard.dtype, device=unit.shard.device)
            self.comm.all_gather(full, unit.shard.grad, group=unit.group)
            for (o, n, shape), names in zip(unit.layout, unit.names):
                grads[names[0]] = full[o : o + n].view(shape).clone()
        return grads

    def sharded_parameters(self) -> list[torch.Tensor]:
        """What this rank holds of the model: every unit's flat shard, and the frozen parameters
        (replicated, outside the flat buffers)."""
        return list(self.flat_shards) + list(self.module.parameters())

    def reshard_all(self) -> None:
        """Free every gathered buffer (e.g. after an evaluation forward under no_grad)."""
        for unit in self.units:
            unit.reshard()

    # ---------------------------------------------------------------- state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, under the original model's state_dict keys (both names of a tied
        weight), plus the buffers and frozen parameters; a collective: call it on every rank."""
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for unit in self.units:
            state.update(unit.full_tensors())
        return state


def _check_mixed_precision(model, mp_policy):
    """The policy fsdp-flat can honour (bf16, no frozen parameter), else raise saying why."""
    policy = check_policy(mp_policy, "fsdp-flat")
    if policy is not None and policy.loss_scaling:
        raise NotImplementedError(
            "fsdp-flat: fp16 is left out (its dynamic loss scaling); bf16 (MixedPrecision(torch.bfloat16)) "
            "runs, and the per-parameter 'fsdp' takes fp16"
        )
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.is_floating_point()]
    if policy is not None and frozen:
        raise NotImplementedError(
            f"fsdp-flat: a frozen parameter ({frozen[0]}) under mp_policy is left out: frozen "
            f"parameters stay outside the flat buffers, so nothing would cast them to param_dtype"
        )
    return policy


def _materialize_the_rest(model, group):
    """Buffers and frozen parameters (not in any flat buffer) of a meta-device model: rank 0's."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for module in model.modules():
        for table in (module._buffers, module._parameters):
            for name, tensor in table.items():
                if tensor is None or (table is module._parameters and tensor.requires_grad):
                    continue
                real = (
                    torch.empty(tensor.shape, dtype=tensor.dtype, device=_rank_device())
                    if tensor.is_meta
                    else tensor.detach()
                )
                dist.broadcast(real, src=src, group=group)
                if tensor.is_meta:
                    table[name] = (
                        nn.Parameter(real, requires_grad=False) if table is module._parameters else real
                    )


def collective_counts(fsdp: "FSDPModel") -> dict[str, float]:
    """{"gathers", "reduce_scatters"} issued per optimizer step so far (loop.train's report=)."""
    steps = max(fsdp.steps_taken, 1)
    return {"gathers": fsdp.gathers_issued / steps, "reduce_scatters": fsdp.reduce_scatters_issued / steps}


def wrap_flat_by_hand(model: torch.nn.Module, units: Any = "block", **options: Any) -> "FSDPModel":
    """FSDP1 (FullyShardedDataParallel(model, auto_wrap_policy=...)) by hand: shard `model` in
    place into flat units and return the FSDPModel that trains it (see the module docstring;
    options are FSDPModel's). Not labkit.strategies.fsdp.fully_shard_by_hand, which is FSDP2's
    per-parameter fully_shard.

    sync_from_rank0=True: rank 0 built `model` for real, the others on the meta device
    (`with torch.device("meta"): ...`, no memory); every unit is broadcast from rank 0 one at a
    time and each rank keeps only its shard (FSDP1's sync_module_states)."""
    return FSDPModel(model, units, **options)
