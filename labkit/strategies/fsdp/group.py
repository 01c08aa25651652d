"""One unit of labkit.strategies.fsdp (FSDP2's FSDPParamGroup, by hand): the batched all-gather
that unshards it, the reshard that frees it, the batched reduce-scatter after its backward; and
the state its units share (FSDPContext: counters, reduce-scatters in flight, the end of backward).

The lifecycle of one group:
  start_unshard   copy the unit's shards into this rank's chunk of one buffer, all-gather it
                  asynchronously on labkit's comm thread (prefetch issues this early);
  wait_unshard    wait, copy each parameter's pieces into its unsharded storage, free the buffer,
                  point the modules at the unsharded parameters;
  reshard         resize the unsharded storages to 0, point the modules back at the shards;
  post_backward   once every trainable parameter's gradient has accumulated (a post-accumulate-grad
                  hook counts them), or at the end of backward for a unit with a parameter unused
                  in this step: copy the gradients into one padded buffer (rank-major), free them,
                  reduce-scatter asynchronously; when it lands, each shard's .grad is its piece
                  (added to a .grad already there: gradient accumulation).
CPU offload (offload.py): start_unshard first copies the unit's host shards to the device ("h2d",
traced), land copies each gradient shard to the host ("d2h", traced) before it becomes .grad.
What it leaves out: a parameter used on some ranks and unused on others in the same step (the
ranks' reduce-scatters then differ in size: labkit's cross-rank check raises, FSDP2 hangs); a
parameter saved for backward but detached from autograd (its unit could be resharded before that
backward op runs; frozen parameters are handled: such a unit reshards only at the end of backward).
"""

import contextlib
from typing import Any, Sequence, Union

import torch
import torch.distributed as dist

from labkit.strategies import unobserved
from labkit.strategies.comm_choice import Ring
from labkit.strategies.fsdp.offload import moved, to_device, to_host
from labkit.strategies.fsdp.param import Layout, batched_all_gather


class FSDPContext:
    """What the units of one model share: the observe hook, counters, the rate limiter's limit,
    the reduce-scatters in flight, the end-of-backward callback, and the collectives (comm: a
    labkit.strategies.comm_choice.Collectives, labkit's ring unless the strategy's comm= says;
    the ring's cross-rank check follows VERIFY_ACROSS_RANKS: a unit reduced out of turn on one
    rank raises instead of mixing units)."""

    def __init__(self):
        self.groups = []  # every unit, root first once the root is sharded
        self.observe = unobserved
        self.gathers = self.reduce_scatters = 0
        self.max_inflight = 2  # gathered ahead of use and not used yet (prefetch)
        self.pending = []  # (group, [(fsdp_param, piece)], handle, input, divide_by)
        self.callback_queued = False
        self.comm = Ring()

    def inflight(self) -> int:
        return sum(g.prefetched for g in self.groups)

    def prefetch(self, modules: Sequence[torch.nn.Module]) -> None:
        for module in modules:
            group: FSDPParamGroup = getattr(module, "_fsdp_group")  # an FSDPModule's unit
            if group.state == "sharded" and self.inflight() < self.max_inflight:
                group.start_unshard(prefetched=True)

    def queue_end_of_backward(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)

    def land(self, keep: int) -> None:
        """Wait for all but the newest `keep` reduce-scatters and hand the shards their gradients.
        post_backward lands the previous unit's before it allocates its own: each reduce-scatter
        overlaps the next unit's backward compute, as in FSDP2, and one buffer lives at a time."""
        while len(self.pending) > keep:
            group, pieces, handle, _, divide_by = self.pending.pop(0)
            handle.wait()
            offload = group.offload
            # CPU offload: one traced move per landing, the unit's gradient shards to the host.
            nbytes = sum(p.padded.numel() * p.padded.element_size() for p, _ in pieces)
            with moved("d2h", nbytes) if offload is not None else contextlib.nullcontext():
                for p, piece in pieces:
                    if divide_by is not None:  # a custom divide factor: SUM, then divide
                        piece.div_(divide_by)
                    grad = piece.view(p.padded.shape).to(p.padded.dtype)
                    if offload is not None:
                        grad = to_host(grad, offload)
                    if p.sharded.grad is None:
                        p.sharded.grad = p.to_dtensor(grad)  # the shard's rows, a DTensor like it
                    else:
                        p.local(p.sharded.grad).add_(grad[: p.valid] if p.mesh is not None else grad)

    def end_of_backward(self) -> None:
        """After autograd's last node: units not reduced yet (a parameter unused in this step),
        the reduce-scatters still in flight, then every unit resharded."""
        for group in self.groups:
            if not group.reduced:
                group.post_backward()
        self.land(keep=0)
        for group in self.groups:
            if group.reshard_after_backward:
                group.reshard()
            group.reduced, group.ready, group.backward_started = False, 0, False
        self.callback_queued = False
        self.observe("mark", "after backward")


class FSDPParamGroup:
    def __init__(self, ctx, module, label, fsdp_params, group, reduce_dtype=None):
        self.ctx, self.module, self.label, self.params, self.group = ctx, module, label, fsdp_params, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        # Where the unit computes and gathers (with CPU offload its shards are on the host).
        self.device = fsdp_params[0].device if fsdp_params else torch.device("cpu")
        self.offload = fsdp_params[0].offload if fsdp_params else None
        self.reduce_dtype, self.param_dtype = reduce_dtype, None
        self._index()
        self.state = "sharded"  # "gathering" (all-gather in flight), "unsharded"
        self.buffer: Any = None  # the all-gather's (N, chunk) buffer while gathering
        self.handle: Any = None
        self.prefetched = False
        self.reshard_after_forward: Union[bool, int] = True
        self.is_root = True
        self.replicate_group = None  # HSDP (hsdp.py): the gradient shard's all-reduce
        self.kept = None  # reshard_after_forward=<int>: this rank's rows of the group
        # What the reduce-scatter divides the summed gradients by: world_size (AVG, fully_shard's
        # default), 1 (SUM: the course loop's convention) or any factor (set_gradient_divide_factor).
        self.divide_factor: float = self.world_size
        self.forward_prefetch, self.backward_prefetch = [], []
        self.gathers = self.reduce_scatters = 0
        self.ready, self.reduced, self.backward_started = 0, False, False
        # FSDP2's set_requires_gradient_sync / set_reshard_after_backward (a pipeline's micro-batches)
        self.reduce_grads, self.reshard_after_backward = True, True
        for p in fsdp_params:
            p.group = self
            _hook(p)

    def check_params(self) -> None:
        """Before each forward: what was done to the unit's parameters since sharding. A frozen
        or unfrozen parameter (requires_grad_) is honoured, as fully_shard does: its unsharded
        parameter follows and the unit's trainable set is rebuilt. A parameter replaced in its
        module, or whose data was swapped (m.double(), m.to(...), .data =), is refused by name:
        its gradient would never be reduced, the ranks would drift apart."""
        changed = False
        for p in self.params:
            for module, attr in p.slots:
                held = module._parameters.get(attr)
                if held is not p.sharded and held is not p.unsharded:
                    raise RuntimeError(
                        f"{_name(p, module, attr)} was replaced after fully_shard_by_hand sharded it "
                        f"(now {type(held).__name__} of shape {tuple(getattr(held, 'shape', ()))}): "
                        f"the unit never gathers nor reduces the new tensor, so the ranks would "
                        f"drift apart. Assign parameters before sharding; to set values afterwards "
                        f"use load_state_dict / torch.distributed.checkpoint.state_dict."
                        f"set_model_state_dict"
                    )
            if not p.aliases_padded():
                local = p.local(p.sharded)
                raise RuntimeError(
                    f"{p.names[0]}: its shard was converted after fully_shard_by_hand "
                    f"(now {local.dtype} on {local.device}, sharded as {p.padded.dtype} on "
                    f"{p.padded.device}; m.double(), m.half() or m.to(...) after sharding): "
                    f"convert the model BEFORE sharding it (model.double(), then "
                    f"fully_shard_by_hand), or use mp_policy= for the compute dtype"
                )
            wants = p.sharded.requires_grad
            if p.unsharded.requires_grad != p.requires_grad:  # frozen while gathered
                wants = p.unsharded.requires_grad
            if wants != p.requires_grad:
                p.requires_grad = wants
                for t in (p.sharded, p.unsharded):
                    if t.requires_grad != wants:
                        t.requires_grad_(wants)
                _hook(p)
                changed = True
        if changed:
            self._index()

    def _index(self):
        self.layout = Layout([(p.numel, p.unsharded_dtype) for p in self.params])
        self.trainable = [p for p in self.params if p.requires_grad]
        self.has_frozen = len(self.trainable) < len(self.params)

    def remove(self, fsdp_param: Any) -> None:
        """Give up a parameter (a tied weight that an enclosing unit takes over)."""
        self.reshard()
        self.params = [p for p in self.params if p is not fsdp_param]
        self._index()

    # ---------------------------------------------------------------- unshard / reshard
    def start_unshard(self, prefetched: bool = False) -> None:
        if self.state != "sharded" or not self.params:
            return
        shards = [p.padded for p in self.params]
        if self.offload is not None:  # CPU offload: the host shards to the device first
            with moved("h2d", sum(t.numel() * t.element_size() for t in shards)):
                shards = [to_device(t, self.device) for t in shards]
        self.buffer, self.handle = batched_all_gather(
            self.layout,
            shards,
            self.group,
            self.device,
            async_op=True,
            observe=self.ctx.observe,
            comm=self.ctx.comm,
        )
        self.state, self.prefetched = "gathering", prefetched
        self.gathers += 1
        self.ctx.gathers += 1

    def wait_unshard(self) -> None:
        if self.state == "resharded_to_group":  # reshard_after_forward=<int> (reshard_to.py)
            from labkit.strategies.fsdp.reshard_to import unshard_from

            unshard_from(self, self.reshard_after_forward)
        self.start_unshard()
        if self.state == "gathering":
            self.handle.wait()
            for i, p in enumerate(self.params):
                p.copy_out(self.layout.piece(self.buffer, i))
                self.ctx.observe("tag", "all_gather", p.padded_full)
            self.buffer = self.handle = None  # the gathered buffer is freed: the copies remain
            self.state = "unsharded"
            self.ctx.observe("mark", f"unshard {self.label}")
        self.prefetched = False
        for p in self.params:
            p.use_unsharded()

    def reshard(self) -> None:
        if self.state == "gathering":  # never free a buffer the comm thread still writes
            self.handle.wait()
            self.buffer = self.handle = None
        self.kept = None  # reshard_after_forward=<int>: the group's rows go too
        was = self.state
        for p in self.params:
            p.free()
            p.use_sharded()
        self.state, self.prefetched = "sharded", False
        if was != "sharded":
            self.ctx.observe("mark", f"reshard {self.label}")

    # ---------------------------------------------------------------- backward
    def grad_ready(self, param: torch.Tensor) -> None:
        self.ready += 1
        if self.ready == len(self.trainable) and not self.reduced:
            self.post_backward()

    def post_backward(self) -> None:
        """One reduce-scatter of the unit's gradients per gradient dtype (one, unless the unit
        mixes dtypes), into the shards' .grad when it lands."""
        self.reduced = True
        if not self.reduce_grads:  # set_requires_gradient_sync(False): .grad keeps adding up
            if self.reshard_after_backward and not self.has_frozen:
                self.reshard()
            self.ctx.observe("end", f"bwd {self.label}")
            return
        # The previous unit's reduce-scatter had this unit's whole backward to finish: land it
        # before allocating this one's buffer, so one padded gradient buffer lives at a time.
        self.ctx.land(keep=0)
        with_grad = [p for p in self.trainable if p.unsharded.grad is not None]
        by_dtype: dict[torch.dtype, list] = {}
        for p in with_grad:
            by_dtype.setdefault(self.reduce_dtype or p.unsharded.grad.dtype, []).append(p)
        batches = []
        for dtype, params in by_dtype.items():
            layout = Layout([(p.numel, dtype) for p in params])
            flat = torch.empty(self.world_size * layout.chunk, dtype=dtype, device=self.device)
            self.ctx.observe("tag", "reduce_scatter", flat)
            flat2d = flat.view(self.world_size, layout.chunk)
            with torch.no_grad():
                for i, p in enumerate(params):
                    layout.piece(flat2d, i).copy_(p.padded_grad(p.unsharded.grad, dtype))
                    p.unsharded.grad = None  # the buffer holds it now
            batches.append((layout, params, flat))
        if not self.has_frozen and self.reshard_after_backward:
            # Before the reduce-scatter is issued: the gradients are copied, the weights done
            # with. A frozen parameter has no gradient to wait for (an op that still needs it may
            # run later in this backward), so such a unit reshards at the end of backward instead.
            self.reshard()
        factor = self.divide_factor
        replicas = 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)
        if factor == self.world_size * replicas:  # AVG over every replica: each level averages
            op, divide_by = "avg", None
        else:  # SUM, then any other factor divided after
            op, divide_by = "sum", None if factor == 1 else factor
        comm = self.ctx.comm
        for layout, params, flat in batches:
            out = torch.empty(layout.chunk, dtype=flat.dtype, device=self.device)
            handle = comm.reduce_scatter(out, flat, op=op, group=self.group, async_op=True)
            if self.replicate_group is not None:  # HSDP: the shard, across nodes, after it
                if not comm.ordered:  # torch's: another group's thread could read `out` early
                    handle.wait()
                handle = _Both(handle, comm.all_reduce(out, op=op, group=self.replicate_group, async_op=True))
            pieces = [(p, out[o : o + n]) for p, (o, _, _, n) in zip(params, layout.offsets)]
            self.ctx.pending.append((self, pieces, handle, flat, divide_by))
            self.reduce_scatters += 1
            self.ctx.reduce_scatters += 1
        self.ctx.observe("end", f"bwd {self.label}")


def _hook(p):
    if p.requires_grad and not getattr(p, "hooked", False):
        # Fires once per backward, after autograd accumulated ALL of this parameter's gradient
        # contributions (a module called twice included); p.group, not the unit it was made in:
        # a tied weight moves to the enclosing unit. A parameter frozen later keeps its hook:
        # it gets no gradient, so the hook never fires.
        p.unsharded.register_post_accumulate_grad_hook(lambda t, p=p: p.group.grad_ready(t))
        p.hooked = True


def _name(p, module, attr):
    for (m, a), name in zip(p.slots, p.names):
        if m is module and a == attr:
            return name
    return p.names[0] if p.names else attr


class _Both:
    """A reduce-scatter's handle and the all-reduce queued after it (HSDP): wait() waits both."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def wait(self):
        try:
            self.first.wait()
        finally:
            self.second.wait()
        return True
