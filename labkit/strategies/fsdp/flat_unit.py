"""One FSDP unit of labkit.strategies.fsdp.flat: a flat, padded, sharded parameter buffer, and the
autograd.Function whose backward is the unit's post-backward hook.

What it leaves out: see labkit.strategies.fsdp.flat (frozen parameters stay outside the buffer, a
parameter unused while the rest of its unit is used gets a zero gradient, one dtype per unit's
shard: under a policy the shard is the fp32 master, the gathered buffer param_dtype).
"""

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm.collectives import shard_range


def _rank_device():
    from labkit.launch.run import device  # cuda:<local rank> under NCCL, cpu under gloo

    return device()


class _GatherParams(torch.autograd.Function):
    """Identity from the shard to the unit's full parameters, as far as autograd can tell: its
    backward is the unit's post-backward hook, called once with every parameter's gradient."""

    @staticmethod
    def forward(ctx, unit, shard):
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None, not zeros
        return tuple(unit.full[offset : offset + numel].view(shape) for offset, numel, shape in unit.layout)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward(grads)
        return None, None  # the shard's gradient is set by the reduce-scatter, after it lands


class FSDPUnit:
    """One sharding unit: its parameters flattened, padded to a multiple of N, and cut in N shards.

    `slots[i]` lists every (module, attribute) that holds parameter i, so a tied weight inside one
    unit is one segment of the buffer used by two modules (one storage, one gradient)."""

    module: nn.Module  # the module it wraps (set by FSDPModel)

    def __init__(self, owner, label, params, slots, names, group, index, sync_from_rank0=False):
        self.owner, self.label, self.index, self.group = owner, label, index, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.slots, self.names = slots, names
        self.layout, offset = [], 0
        for p in params:
            self.layout.append((offset, p.numel(), tuple(p.shape)))
            offset += p.numel()
        self.numel = offset
        start, end, self.padded = shard_range(offset, self.rank, self.world_size)
        # Buffers follow the parameters' dtype and device (a meta model's shards go to this rank's
        # device, where rank 0's broadcast lands). One dtype per unit: a flat buffer cannot mix them.
        if len({p.dtype for p in params}) > 1:
            raise TypeError(f"unit {label}: parameters of several dtypes cannot share a flat buffer")
        first = params[0] if params else torch.empty(0)
        flat = torch.zeros(
            self.padded, dtype=first.dtype, device=_rank_device() if first.is_meta else first.device
        )
        if params and not params[0].is_meta:
            flat[:offset] = torch.cat([p.detach().reshape(-1) for p in params])
        if sync_from_rank0:
            # Rank 0 holds the real initial values; the others built the model on the meta device.
            # One unit at a time, so no rank ever holds more than one unit in full.
            dist.broadcast(flat, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        chunk = self.padded // self.world_size
        self.shard = nn.Parameter(flat[self.rank * chunk : (self.rank + 1) * chunk].clone())
        self.full: Any = None  # the gathered flat buffer while unsharded
        self.gather_handle: Any = None  # a pending async all-gather
        self._sent: Any = None  # what that all-gather sends (the shard, or its param_dtype copy)
        self.prefetched = False  # gathered ahead of use: counts against the rate limiter
        self.had_grad = [False] * len(self.layout)  # which parameters got a gradient since zero_grad
        self._set_module_params(None)

    # ---------------------------------------------------------------- unshard / reshard
    def start_unshard(self, prefetched: bool = False) -> None:
        """Issue the all-gather into a fresh buffer (no-op if gathered or gathering)."""
        if self.full is not None:
            return
        dtype = self.owner.param_dtype or self.shard.dtype  # mixed precision: gather 16-bit copies
        self.full = torch.empty(self.padded, dtype=dtype, device=self.shard.device)
        self.owner.observe("tag", "all_gather", self.full)
        # (a cast shard is a new tensor: kept until the gather lands, the comm thread reads it)
        self._sent = self.shard.detach().to(dtype)
        self.gather_handle = self.owner.comm.all_gather(
            self.full, self._sent, group=self.group, async_op=True
        )
        self.prefetched = prefetched
        self.owner.gathers_issued += 1

    def wait_unshard(self) -> None:
        self.start_unshard()
        if self.gather_handle is not None:
            self.gather_handle.wait()
            self.gather_handle = None
        self._sent = None
        self.prefetched = False
        self.owner._storage_to_unit[self.full.untyped_storage()._cdata] = self

    def attach(self) -> None:
        """Make the module's parameters views of the full buffer, through autograd if training."""
        if torch.is_grad_enabled() and self.shard.requires_grad:
            views = _GatherParams.apply(self, self.shard)
        else:
            views = tuple(self.full[o : o + n].view(s) for o, n, s in self.layout)
        self._set_module_params(views)

    def reshard(self) -> None:
        """Forget the full buffer: the allocator frees it as soon as no view holds it."""
        if self.full is None:
            return
        if self.gather_handle is not None:  # never drop a buffer the comm thread still writes
            self.gather_handle.wait()
            self.gather_handle = None
        self.owner._storage_to_unit.pop(self.full.untyped_storage()._cdata, None)
        self._set_module_params(None)
        self.full, self.prefetched = None, False
        self.owner.observe("mark", f"reshard {self.label}")

    def _set_module_params(self, views):
        # Written into _parameters directly: nn.Module refuses a plain tensor there through setattr,
        # and None makes a forgotten unshard fail loudly instead of computing with stale weights.
        for i, slots in enumerate(self.slots):
            for module, attr in slots:
                module._parameters[attr] = None if views is None else views[i]

    # ---------------------------------------------------------------- backward
    def post_backward(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        owner = self.owner
        owner._ensure_final_callback()
        # Mixed precision: the 16-bit gradients reduced in reduce_dtype (the shard's dtype without)
        dtype = owner.reduce_dtype or self.shard.dtype
        flat = torch.zeros(self.padded, dtype=dtype, device=self.shard.device)
        owner.observe("tag", "reduce_scatter", flat)
        for i, ((offset, numel, _), grad) in enumerate(zip(self.layout, grads)):
            if grad is not None:
                flat[offset : offset + numel].view_as(grad).copy_(grad)
                self.had_grad[i] = True
        del grads
        out = torch.empty_like(self.shard, dtype=dtype)
        op = owner.reduce_op
        handle = owner.comm.reduce_scatter(out, flat, op=op, group=self.group, async_op=True)
        owner._pending_reductions.append((self, out, handle, flat))
        owner.reduce_scatters_issued += 1
        owner._land_reductions(keep=1)  # frees the previous unit's padded gradient buffer
        if owner.reshard_after_backward:
            self.reshard()
        owner.observe("end", f"bwd {self.label}")

    def full_tensors(self) -> dict[str, torch.Tensor]:
        """{name: full tensor} for every name of every parameter (a synchronous all-gather)."""
        full = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        self.owner.comm.all_gather(full, self.shard.detach(), group=self.group)
        return {
            name: full[o : o + n].view(s).clone()
            for (o, n, s), names in zip(self.layout, self.names)
            for name in names
        }
