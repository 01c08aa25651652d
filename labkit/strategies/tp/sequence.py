"""Sequence parallelism's conjugate operations (Megatron-LM's SP), along the sequence dim (dim 1
of (batch, seq, ...)), as torch.autograd.Functions on labkit's hand-written collectives (or comm=):

    gather_from_sp(x, group)        forward: all-gather the sequence;   backward: reduce-scatter
    reduce_scatter_to_sp(x, group)  forward: reduce-scatter (sum);      backward: all-gather
    split_to_sp(x, group)           forward: this rank's slice;         backward: all-gather
    unsplit_from_sp(x, group)       forward: all-gather the sequence;   backward: this rank's slice

gather_from_sp goes in front of a column-parallel Linear under SP (torch's ColwiseParallel(
input_layouts=Shard(1))): every rank needs the whole sequence, and every rank's part of the input's
gradient is partial (its own output columns), so backward sums and scatters it. reduce_scatter_to_sp
ends a row-parallel Linear (RowwiseParallel(output_layouts=Shard(1))): the partial sums are summed
and each rank keeps its slice of the sequence. The pair replaces TP's all-reduce (= reduce-scatter
+ all-gather): the same bytes, but between them every activation is 1/tp of the sequence.
split_to_sp / unsplit_from_sp enter and leave the sequence-parallel region from REPLICATED compute
(the embeddings before the first block, the final LayerNorm and head after the last), whose
gradients are already whole on every rank: torch's Replicate() <-> Shard(1) redistributions.

Rank r holds positions [r T / tp, (r + 1) T / tp). What it leaves out: a sequence tp does not
divide (raises), async overlap with compute, sequence dims other than 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from labkit.strategies.comm_choice import Collectives, Ring

__all__ = ["gather_from_sp", "reduce_scatter_to_sp", "split_to_sp", "unsplit_from_sp"]


def _place(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _check_splits(length: int, n: int, where: str) -> None:
    if length % n:
        raise ValueError(
            f"{where}: a sequence of {length} positions does not split evenly over {n} tp ranks "
            f"(sequence parallelism here needs seq_len to be a multiple of tp)"
        )


def _all_gather(x: torch.Tensor, group: Any, comm: Collectives | None) -> torch.Tensor:
    """(B, T/n, ...) pieces -> (B, T, ...): the sequence moved to the front, so each rank's piece
    is one contiguous chunk of the gathered buffer."""
    n = dist.get_world_size(group)
    piece = x.movedim(1, 0).contiguous()
    out = piece.new_empty((n * piece.shape[0], *piece.shape[1:]))
    (comm or Ring()).all_gather(out, piece, group=group)
    return out.movedim(0, 1)


def _reduce_scatter(x: torch.Tensor, group: Any, comm: Collectives | None, where: str) -> torch.Tensor:
    """(B, T, ...) partial sums -> (B, T/n, ...): this rank's slice of their sum."""
    n = dist.get_world_size(group)
    _check_splits(x.shape[1], n, where)
    whole = x.movedim(1, 0).contiguous()
    out = whole.new_empty((whole.shape[0] // n, *whole.shape[1:]))
    (comm or Ring()).reduce_scatter(out, whole, op="sum", group=group)
    return out.movedim(0, 1)


def _slice(x: torch.Tensor, group: Any, where: str) -> torch.Tensor:
    rank, n = _place(group)
    _check_splits(x.shape[1], n, where)
    width = x.shape[1] // n
    return x[:, rank * width : (rank + 1) * width]


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, comm: Any) -> torch.Tensor:
        ctx.group, ctx.comm = group, comm
        return _all_gather(x, group, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _reduce_scatter(grad, ctx.group, ctx.comm, "gather_from_sp (backward)"), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, comm: Any) -> torch.Tensor:
        ctx.group, ctx.comm = group, comm
        return _reduce_scatter(x, group, comm, "reduce_scatter_to_sp")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _all_gather(grad, ctx.group, ctx.comm), None, None


class _SplitToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, comm: Any) -> torch.Tensor:
        ctx.group, ctx.comm = group, comm
        return _slice(x, group, "split_to_sp").contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _all_gather(grad, ctx.group, ctx.comm), None, None


class _UnsplitFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, comm: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group, comm).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _slice(grad, ctx.group, "unsplit_from_sp (backward)").contiguous(), None, None


def gather_from_sp(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, comm: Collectives | None = None
) -> torch.Tensor:
    """Every rank's sequence piece (B, T/tp, ...) gathered into (B, T, ...); backward: the
    gradient summed over `group` and scattered (this rank's piece of the sum)."""
    return _GatherFromSP.apply(x, group, comm)


def reduce_scatter_to_sp(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, comm: Collectives | None = None
) -> torch.Tensor:
    """This rank's sequence piece (B, T/tp, ...) of the sum of every rank's x (B, T, ...);
    backward: the gradient's pieces gathered (every rank's x gets the whole gradient)."""
    return _ReduceScatterToSP.apply(x, group, comm)


def split_to_sp(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, comm: Collectives | None = None
) -> torch.Tensor:
    """This rank's sequence piece of a replicated x; backward: the pieces' gradients gathered."""
    return _SplitToSP.apply(x, group, comm)


def unsplit_from_sp(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, comm: Collectives | None = None
) -> torch.Tensor:
    """The whole sequence from every rank's piece, to replicated compute; backward: this rank's
    slice of the (replicated) gradient."""
    return _UnsplitFromSP.apply(x, group, comm)
