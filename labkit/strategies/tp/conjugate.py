"""The conjugate operations of tensor parallelism, as torch.autograd.Functions on labkit's
hand-written collectives (labkit.comm.collectives), over one process group (the "tp" ranks):

    copy_to_tp(x, group)          f: forward x itself;      backward: all-reduce (sum) the gradient
    reduce_from_tp(x, group)      g: forward all-reduce;    backward: the gradient itself
    gather_from_tp(x, size, group)   forward: all-gather the last dim (torch.chunk's split of
                                     `size`); backward: this rank's slice of the gradient

f goes in front of a column-parallel layer: every rank uses the whole (replicated) input, so the
input's gradient is the sum of every rank's part. g goes after a row-parallel layer: each rank's
output is a partial sum over its input features. The two are each other's transpose.

What it leaves out: async overlap of the all-reduce with compute, sequence parallelism's
reduce-scatter / all-gather pair, any reduction but a sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.comm.collectives import ring_all_gather, shard_range
from labkit.strategies.comm_choice import Collectives, Ring

__all__ = ["copy_to_tp", "gather_from_tp", "reduce_from_tp"]


def _all_reduced(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, comm: Collectives | None
) -> torch.Tensor:
    """A new contiguous tensor: the sum of `tensor` over `group` (comm's all-reduce, labkit's ring
    by default, in place on a copy)."""
    out = tensor.contiguous().clone()
    (comm or Ring()).all_reduce(out, op="sum", group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, comm):
        ctx.group, ctx.comm = group, comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(grad, ctx.group, ctx.comm), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, comm):
        return _all_reduced(x, group, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _chunk_sizes(size: int, world_size: int) -> list[int]:
    """torch.chunk's split of `size` over `world_size` ranks (ceil-sized, the last ones shorter or 0)."""
    return [end - start for start, end, _ in (shard_range(size, r, world_size) for r in range(world_size))]


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, size, group):
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        sizes = _chunk_sizes(size, n)
        if x.shape[-1] != sizes[rank]:
            raise ValueError(
                f"gather_from_tp: rank {rank} holds {x.shape[-1]} of the last dim, but torch.chunk's "
                f"split of size={size} over {n} ranks gives it {sizes[rank]} (sizes {sizes})"
            )
        ctx.start, ctx.width = sum(sizes[:rank]), sizes[rank]
        chunk = max(sizes)
        # Rank-major buffer: the last dim moved to the front, padded to equal pieces.
        piece = x.new_zeros((chunk, *x.shape[:-1]))
        piece[: x.shape[-1]].copy_(x.movedim(-1, 0))
        gathered = x.new_empty((n * chunk, *x.shape[:-1]))
        ring_all_gather(gathered, piece, group=group)
        pieces = [gathered[r * chunk : r * chunk + sizes[r]] for r in range(n)]
        return torch.cat(pieces, 0).movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.start : ctx.start + ctx.width].contiguous(), None, None


def copy_to_tp(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, comm: Collectives | None = None
) -> torch.Tensor:
    """Megatron's f: `x` unchanged forward; in backward the gradient is summed over `group` (by
    comm's all-reduce: labkit.strategies.comm_choice, labkit's ring when None)."""
    return _CopyToTP.apply(x, group, comm)


def reduce_from_tp(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, comm: Collectives | None = None
) -> torch.Tensor:
    """Megatron's g: the sum of `x` over `group` forward (a new tensor, by comm's all-reduce,
    labkit's ring when None); the gradient unchanged."""
    return _ReduceFromTP.apply(x, group, comm)


def gather_from_tp(x: torch.Tensor, size: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dim into `size` columns (rank k holds torch.chunk's
    k-th piece, as a column-parallel output does); backward returns this rank's columns of the gradient."""
    return _GatherFromTP.apply(x, size, group)
