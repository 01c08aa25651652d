"""FSDP (ZeRO-3) by hand: every unit's parameters live as 1/N of a flat, padded buffer per rank,
and are whole only while that unit computes.

    fsdp = fully_shard_by_hand(TinyGPT(cfg), units="block", reshard_after_forward=True, prefetch=1)
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
unused in a step while the rest of its unit is used gets a zero gradient (FSDP1's flat-parameter
behaviour; AdamW then still decays it); mixed precision, CPU offload, HSDP, process subgroups other
than one `group`, a unit's module being called twice in one forward (it works, but gathers twice).
Checkpoints are in fsdp_checkpoint.py.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from labkit import tracing
from labkit.collectives import ring_all_gather, ring_reduce_scatter, shard_range

__all__ = ["FSDPUnit", "FSDPModel", "fully_shard_by_hand", "plan_units"]

# The ranks' size handshake (two latencies per collective) also keeps the ranks in step: in our runs
# without it, 2 of 4 four-rank runs on a loaded machine hung in a reduce-scatter (cause not found).
VERIFY = True


class _GatherParams(torch.autograd.Function):
    """Identity from the shard to the unit's full parameters, as far as autograd can tell: its
    backward is the unit's post-backward hook, called once with every parameter's gradient."""

    @staticmethod
    def forward(ctx, unit, shard):
        ctx.unit = unit
        ctx.set_materialize_grads(False)   # an unused parameter's gradient stays None, not zeros
        return tuple(unit.full[offset:offset + numel].view(shape)
                     for offset, numel, shape in unit.layout)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward(grads)
        return None, None   # the shard's gradient is set by the reduce-scatter, after it lands


class FSDPUnit:
    """One sharding unit: its parameters flattened, padded to a multiple of N, and cut in N shards.

    `slots[i]` lists every (module, attribute) that holds parameter i, so a tied weight inside one
    unit is one segment of the buffer used by two modules (one storage, one gradient)."""

    def __init__(self, owner, label, params, slots, names, group, index):
        self.owner, self.label, self.index, self.group = owner, label, index, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.slots, self.names = slots, names
        self.layout, offset = [], 0
        for p in params:
            self.layout.append((offset, p.numel(), tuple(p.shape)))
            offset += p.numel()
        self.numel = offset
        start, end, self.padded = shard_range(offset, self.rank, self.world_size)
        flat = torch.zeros(self.padded)
        if params:
            flat[:offset] = torch.cat([p.detach().reshape(-1) for p in params])
        chunk = self.padded // self.world_size
        self.shard = nn.Parameter(flat[self.rank * chunk:(self.rank + 1) * chunk].clone())
        self.full = None            # the gathered flat buffer while unsharded
        self.gather_handle = None   # a pending async all-gather
        self.prefetched = False     # gathered ahead of use: counts against the rate limiter
        self._set_module_params(None)

    # ---------------------------------------------------------------- unshard / reshard
    def start_unshard(self, prefetched=False):
        """Issue the all-gather into a fresh buffer (no-op if gathered or gathering)."""
        if self.full is not None:
            return
        self.full = torch.empty(self.padded)
        self.owner._note_buffer(self.full, "all_gather", f"unshard {self.label}")
        self.gather_handle = ring_all_gather(self.full, self.shard.detach(), group=self.group,
                                             async_op=True, verify=VERIFY)
        self.prefetched = prefetched
        self.owner.gathers_issued += 1

    def wait_unshard(self):
        self.start_unshard()
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None
        self.prefetched = False
        self.owner._storage_to_unit[self.full.untyped_storage()._cdata] = self

    def attach(self):
        """Make the module's parameters views of the full buffer, through autograd if training."""
        if torch.is_grad_enabled() and self.shard.requires_grad:
            views = _GatherParams.apply(self, self.shard)
        else:
            views = tuple(self.full[o:o + n].view(s) for o, n, s in self.layout)
        self._set_module_params(views)

    def reshard(self):
        """Forget the full buffer: the allocator frees it as soon as no view holds it."""
        if self.full is None:
            return
        if self.gather_handle is not None:   # never drop a buffer the comm thread still writes
            self.gather_handle.wait()
            self.gather_handle = None
        self.owner._storage_to_unit.pop(self.full.untyped_storage()._cdata, None)
        self._set_module_params(None)
        self.full, self.prefetched = None, False
        self.owner._mark(f"reshard {self.label}")

    def _set_module_params(self, views):
        # Written into _parameters directly: nn.Module refuses a plain tensor there through setattr,
        # and None makes a forgotten unshard fail loudly instead of computing with stale weights.
        for i, slots in enumerate(self.slots):
            for module, attr in slots:
                module._parameters[attr] = None if views is None else views[i]

    # ---------------------------------------------------------------- backward
    def post_backward(self, grads):
        owner = self.owner
        owner._ensure_final_callback()
        flat = torch.zeros(self.padded)
        owner._note_buffer(flat, "reduce_scatter", None)
        for (offset, numel, _), grad in zip(self.layout, grads):
            if grad is not None:
                flat[offset:offset + numel].view_as(grad).copy_(grad)
        del grads
        out = torch.empty(self.padded // self.world_size)
        op = owner.reduce_op
        handle = ring_reduce_scatter(out, flat, op=op, group=self.group, async_op=True, verify=VERIFY)
        owner._pending_reductions.append((self, out, handle, flat))
        owner.reduce_scatters_issued += 1
        if owner.reshard_after_backward:
            self.reshard()
        owner._end_span(self, "bwd")

    def full_tensors(self):
        """{name: full tensor} for every name of every parameter (a synchronous all-gather)."""
        full = torch.empty(self.padded)
        ring_all_gather(full, self.shard.detach(), group=self.group, verify=VERIFY)
        return {name: full[o:o + n].view(s).clone()
                for (o, n, s), names in zip(self.layout, self.names) for name in names}


def plan_units(model, units):
    """The modules that become units: "root" (none but the model), "block" (each of
    model.blocks), "linear" (every nn.Linear and every block's LayerNorm-free rest goes to the
    root), or an explicit list of modules."""
    if units in (None, "root"):
        return []
    if units == "block":
        return list(model.blocks)
    if units == "linear":
        return [m for m in model.modules() if isinstance(m, nn.Linear) and m is not model]
    return list(units)


class FSDPModel(nn.Module):
    """The wrapped model: `parameters()` are the shards (plus frozen replicated parameters)."""

    def __init__(self, model, units="block", reshard_after_forward=True, prefetch=1,
                 max_inflight=2, reduce_op="avg", reshard_after_backward=True, group=None,
                 spans=False):
        super().__init__()
        self.module = model
        self.reshard_after_forward, self.reshard_after_backward = reshard_after_forward, reshard_after_backward
        self.prefetch, self.max_inflight, self.reduce_op, self.spans = prefetch, max_inflight, reduce_op, spans
        self.tracker = None
        self.gathers_issued = self.reduce_scatters_issued = 0
        self._storage_to_unit, self._pending_reductions, self._open_spans = {}, [], {}
        self._callback_queued = False
        unit_modules = plan_units(model, units)
        self.units = self._build_units(model, unit_modules, group)
        self.flat_shards = nn.ParameterList([u.shard for u in self.units])
        self._forward_order = list(self.units[1:])
        self._this_forward = []
        for unit in self.units[1:]:
            module = unit.module
            module.register_forward_pre_hook(lambda m, args, u=unit: self._pre_forward(u))
            module.register_forward_hook(lambda m, args, out, u=unit: self._post_forward(u, out))

    def _build_units(self, model, unit_modules, group):
        names = {id(m): n for n, m in model.named_modules()}
        owner_of = {}   # id(module) -> index of the innermost unit containing it

        def assign(module, current):
            current = unit_modules.index(module) + 1 if any(module is u for u in unit_modules) else current
            owner_of[id(module)] = current
            for child in module.children():
                assign(child, current)
        assign(model, 0)
        by_param = {}   # id(param) -> [param, [(module, attr)], set of units]
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None and p.requires_grad:
                    entry = by_param.setdefault(id(p), [p, [], set()])
                    entry[1].append((module, attr))
                    entry[2].add(owner_of[id(module)])
        grouped = [([], [], []) for _ in range(len(unit_modules) + 1)]
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
            unit = FSDPUnit(self, label, params, slots, qualnames, group, index)
            unit.module = module
            units.append(unit)
        return units

    # ---------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        root = self.units[0]
        self._this_forward = []
        root.wait_unshard()
        root.attach()
        self._prefetch(self._forward_order, 0)
        with saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        if self._this_forward:
            self._forward_order = self._this_forward   # prefetch follows what really ran
        return out

    def _pre_forward(self, unit):
        self._this_forward.append(unit)
        self._begin_span(unit, "fwd")
        unit.wait_unshard()
        unit.attach()
        self._mark(f"unshard {unit.label}")
        order = self._forward_order
        if unit in order:
            self._prefetch(order, order.index(unit) + 1)

    def _post_forward(self, unit, out):
        self._end_span(unit, "fwd")
        if self.reshard_after_forward:
            unit.reshard()
        outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)] \
            if isinstance(out, (tuple, list)) else []
        for tensor in outs:
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, u=unit: self._pre_backward(u))
                break
        return None

    def _prefetch(self, order, first):
        for unit in order[first:first + self.prefetch]:
            inflight = sum(u.prefetched for u in self.units)
            if unit.full is None and inflight < self.max_inflight:
                unit.start_unshard(prefetched=True)

    # ---------------------------------------------------------------- backward
    def _pre_backward(self, unit):
        self._ensure_final_callback()
        self._begin_span(unit, "bwd")
        unit.wait_unshard()
        self._mark(f"unshard {unit.label}")
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
        unit.wait_unshard()   # normally a no-op: the pre-backward hook already gathered it
        return unit.full.as_strided(shape, stride, offset)

    def _ensure_final_callback(self):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self):
        """After the whole backward: wait for the reduce-scatters, hand the shards their grads."""
        for unit, out, handle, _flat in self._pending_reductions:
            handle.wait()
            shard = unit.shard
            shard.grad = out if shard.grad is None else shard.grad.add_(out)
        self._pending_reductions = []
        if self.reshard_after_backward:
            for unit in self.units:
                unit.reshard()
        self._callback_queued = False
        self._mark("after backward")

    # ---------------------------------------------------------------- memory / trace helpers
    def track_memory(self, tracker):
        """Tag gather / reduce-scatter buffers for a labkit.memory.MemoryTracker and sample it at
        every unshard and reshard (that is what draws the saw-tooth)."""
        self.tracker = tracker
        return self

    def _note_buffer(self, tensor, category, label):
        if self.tracker is not None:
            self.tracker.tag(tensor, category)

    def _mark(self, label):
        if self.tracker is not None:
            try:
                self.tracker.mark(label)
            except RuntimeError:   # outside the tracker's `with`: nothing to sample
                pass

    def _begin_span(self, unit, kind):
        if self.spans and (unit, kind) not in self._open_spans:
            s = tracing.span(f"{kind} {unit.label}")
            s.__enter__()
            self._open_spans[(unit, kind)] = s

    def _end_span(self, unit, kind):
        s = self._open_spans.pop((unit, kind), None)
        if s is not None:
            s.__exit__(None, None, None)

    def reshard_all(self):
        """Free every gathered buffer (e.g. after an evaluation forward under no_grad)."""
        for unit in self.units:
            unit.reshard()

    # ---------------------------------------------------------------- state
    def full_state_dict(self):
        """Every parameter whole, under the original model's state_dict keys (both names of a tied
        weight), plus the buffers and frozen parameters; a collective: call it on every rank."""
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for unit in self.units:
            state.update(unit.full_tensors())
        return state


def fully_shard_by_hand(model, units="block", reshard_after_forward=True, prefetch=1, max_inflight=2,
                        reduce_op="avg", reshard_after_backward=True, group=None, spans=False):
    """Shard `model` in place and return the FSDPModel that trains it (see the module docstring)."""
    return FSDPModel(model, units, reshard_after_forward, prefetch, max_inflight, reduce_op,
                     reshard_after_backward, group, spans)
