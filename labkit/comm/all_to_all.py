"""All-to-all by hand: every rank sends a piece of its input to every rank, like
dist.all_to_all_single (torch's signature, defaults and refusals).

    all_to_all_single(out, inp, output_split_sizes=[2, 0, 5], input_split_sizes=[1, 3, 3])
    y = all_to_all_autograd(x, output_split_sizes, input_split_sizes)   # differentiable

Rank i's input rows [sum(in[:j]), sum(in[:j+1])) go to rank j, which puts them at its output rows
for source i: rank i's input_split_sizes[j] must equal rank j's output_split_sizes[i]. None means
equal splits (dim 0 divided by the group size). Rows are dim 0; every other dim must match.

One round of messages, on labkit's cross-rank check (labkit.comm._crosscheck's mailbox): every
rank sends every peer one first message, the 64-byte header (which collective, dtype) followed by
its row size and both split lists; when that peer's rows fit (DIRECT_MAX_BYTES, the receive every
rank posts) they ride in the same message, else they follow as one more message of their own.
So before any data lands every rank holds every rank's splits: a disagreement (rank 0 sends rank 1
3 rows, rank 1 expects 2), another row size, or another collective called at the same point
raises the same error on every rank, naming both ranks and sizes, instead of gloo aborting the
process on a size mismatch. The call is traced (its input's bytes) on the comm thread like every
labkit collective, and every message pays the simulated two-level network (labkit.comm._link): a
rank sends (n-1) first messages of 64 + meta bytes (meta: 8 (2 + 2n) rounded up to 16) plus
the rows it sends to its peers, sum_{j != me} input_split_sizes[j] x row bytes (`wire_bytes`).

The backward of an all-to-all is the all-to-all with the splits swapped (what was sent comes
back): AllToAll / all_to_all_autograd.

Left out: CUDA tensors (the mailbox is CPU memory; NCCL's all_to_all is its own), the list form
dist.all_to_all, non-contiguous tensors (torch copies them; here they are refused: pass
.contiguous()).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from . import _crosscheck, _dispatch, _link, collectives
from ._comm_thread import CollectiveHandle
from ._crosscheck import CollectiveMismatchError
from ._dispatch import Group, group_info, submit

__all__ = ["AllToAll", "all_to_all_autograd", "all_to_all_single", "wire_bytes"]

NAME = "all_to_all_single"
DATA_TAG = 0x6C6D  # the rows that do not fit the first message (ring steps use 0 … 2n-3)
Splits = Optional[Sequence[int]]


def _splits(sizes: Splits, t: torch.Tensor, n: int, what: str) -> list[int]:
    """torch's checkSplitSizes: None = equal (dim 0 divisible by n), else n sizes summing to dim 0."""
    rows = t.shape[0]
    if sizes is None:
        if rows % n:
            raise ValueError(
                f"{NAME}: {what}'s dim 0 ({rows}) does not divide equally across the group size {n}; "
                f"pass {what}_split_sizes"
            )
        return [rows // n] * n
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise TypeError(f"{NAME}: {what}_split_sizes must be a list of ints or None, got {sizes!r}")
    if any(isinstance(s, bool) or not isinstance(s, int) for s in sizes):
        raise TypeError(f"{NAME}: {what}_split_sizes must hold ints, got {list(sizes)!r}")
    if len(sizes) != n:
        raise ValueError(
            f"{NAME}: {what}_split_sizes has {len(sizes)} entries, not the group size {n} (one per rank)"
        )
    if any(s < 0 for s in sizes):
        raise ValueError(f"{NAME}: {what}_split_sizes must be >= 0, got {list(sizes)}")
    if sum(sizes) != rows:
        raise ValueError(
            f"{NAME}: {what}_split_sizes {list(sizes)} sum to {sum(sizes)}, not {what}'s dim 0 ({rows})"
        )
    return list(sizes)


def _check(output: Any, input: Any) -> int:
    """torch's tensor checks (plus contiguity and the row size); returns the elements per row."""
    for what, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{NAME}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{NAME}: {what} is a 0-d tensor; the splits are along dim 0")
        if not t.is_contiguous():
            raise ValueError(f"{NAME}: {what} must be contiguous (pass .contiguous() or a fresh buffer)")
    if output.dtype != input.dtype:
        raise TypeError(f"{NAME}: output dtype {output.dtype} differs from input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{NAME}: output is on {output.device} but input is on {input.device}")
    if input.device.type != "cpu":
        raise NotImplementedError(f"{NAME}: CPU tensors only (gloo); labkit's mailbox is CPU memory")
    if output.shape[1:] != input.shape[1:]:
        raise ValueError(
            f"{NAME}: output's rows {tuple(output.shape[1:])} differ from input's {tuple(input.shape[1:])} "
            f"(every dim but 0 must match)"
        )
    return int(torch.Size(input.shape[1:]).numel())


def _meta_numel(n: int) -> int:
    """int64s of a first message's meta: row size, inlined flag, n input splits, n output splits,
    rounded up to 16 bytes (the rows behind it stay aligned for every dtype)."""
    return -(-(2 + 2 * n) // 2) * 2


def wire_bytes(input_split_sizes: Sequence[int], rank: int, row_bytes: int) -> int:
    """Bytes rank `rank` sends in one call: n-1 first messages (64-byte header + meta) plus its
    rows for the other ranks (what the tracer counts)."""
    n = len(input_split_sizes)
    first = _crosscheck.HEADER_BYTES + 8 * _meta_numel(n)
    return (n - 1) * first + row_bytes * sum(s for j, s in enumerate(input_split_sizes) if j != rank)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Splits = None,
    input_split_sizes: Splits = None,
    group: Group = None,
    async_op: bool = False,
) -> Optional[CollectiveHandle]:
    """Like dist.all_to_all_single: rank j's output rows for source i are rank i's input rows for
    j (the module docstring). Sync: None once done; async_op=True: a handle to wait() on."""
    row = _check(output, input)
    rank, n = group_info(group)
    send = _splits(input_split_sizes, input, n, "input")
    recv = _splits(output_split_sizes, output, n, "output")

    def job() -> None:
        if n == 1:
            output.copy_(input)
            return
        _exchange(output, input, (send, recv, row), (group, rank, n))

    return submit(job, NAME, rank, input.numel() * input.element_size(), n, async_op, input.device)


def _exchange(output: torch.Tensor, input: torch.Tensor, plan: tuple, where: tuple) -> None:
    send, recv, row = plan
    group, rank, n = where
    box = _crosscheck.mailbox(group, rank, n)
    out_rows, in_rows = output.view(output.shape[0], row), input.view(input.shape[0], row)
    ins, outs = in_rows.split(send), out_rows.split(recv)
    meta_n, item = _meta_numel(n), input.element_size()
    limit = _dispatch.direct_limit(collectives.DIRECT_MAX_BYTES)
    header = (
        _crosscheck.MAGIC,
        *_crosscheck.call_fields(NAME, None, input.dtype, input.numel(), output.numel()),
        limit,
        8 * meta_n,
    )
    messages, inline = [], []
    for slot, peer in enumerate(box.peers):
        nbytes = send[peer] * row * item
        inline.append(nbytes <= limit and 8 * meta_n + nbytes <= _crosscheck.INLINE_CAP_BYTES)
        message = box.message(slot, torch.uint8, 8 * meta_n + (nbytes if inline[-1] else 0))
        meta = message[2][: 8 * meta_n].view(torch.int64)
        meta[: 2 + 2 * n] = torch.tensor([row, int(inline[-1]), *send, *recv], dtype=torch.int64)
        if inline[-1] and nbytes:
            message[2][8 * meta_n :].view(input.dtype).view(send[peer], row).copy_(ins[peer])
        messages.append(message)
    theirs = box.exchange(header, messages)
    try:
        metas = _check_all(box, header, theirs, (row, send, recv))
        flags = {peer: bool(metas[peer][1]) for peer in box.peers}
        for i, peer in enumerate(box.peers):
            if flags[peer] and recv[peer]:
                nbytes = recv[peer] * row * item
                got = box.payload(i, torch.uint8, 8 * meta_n + nbytes)[8 * meta_n :]
                outs[peer].copy_(got.view(input.dtype).view(recv[peer], row))
    finally:
        box.repost()
    works = [box.pg.recv([outs[p]], p, DATA_TAG) for p in box.peers if not flags[p]]
    for i, peer in enumerate(box.peers):
        if not inline[i]:
            _link.sending((box.global_peers[i],), send[peer] * row * item)
            works.append(box.pg.send([ins[peer]], peer, DATA_TAG))
    outs[rank].copy_(ins[rank])  # this rank's own rows, while the others travel
    for work in works:  # gloo: each Work waited exactly once
        work.wait()


def _check_all(box: Any, header: tuple, theirs: list, mine: tuple) -> dict[int, list[int]]:
    """Every rank's meta ({group rank: [row, inlined, *in_splits, *out_splits]}) once every rank
    called this all-to-all with the same dtype and row size and matching splits; else the same
    CollectiveMismatchError on every rank (all of them see every rank's meta)."""
    rows = list(theirs)
    rows.insert(box.rank, header)
    if any(h[0] != _crosscheck.MAGIC for h in rows):
        raise CollectiveMismatchError(
            f"{NAME}: a first message without a labkit header arrived (a rank sent on labkit's check tag)"
        )
    calls = [tuple(h[1:6]) for h in rows]  # kind, op, dtype, numel in, numel out
    if any(c[:3] != calls[0][:3] for c in calls):
        raise CollectiveMismatchError(_crosscheck.mismatch_message(calls))
    n = box.world_size
    row, send, recv = mine
    metas = {box.rank: [row, 0, *send, *recv]}
    for i, peer in enumerate(box.peers):
        metas[peer] = box.payload(i, torch.int64, 2 + 2 * n).tolist()
    sizes = {r: m[0] for r, m in metas.items()}
    if len(set(sizes.values())) > 1:
        raise CollectiveMismatchError(
            f"{NAME}: the ranks' rows differ in size (elements per row, every dim but 0): "
            + ", ".join(f"rank {r}: {s}" for r, s in sorted(sizes.items()))
        )
    bad = [
        f"rank {i} sends rank {j} {metas[i][2 + j]} rows (its input_split_sizes[{j}]) but rank {j} "
        f"expects {metas[j][2 + n + i]} (its output_split_sizes[{i}])"
        for i in range(n)
        for j in range(n)
        if metas[i][2 + j] != metas[j][2 + n + i]
    ]
    if bad:
        raise CollectiveMismatchError(
            f"{NAME}: the split sizes disagree: " + "; ".join(bad) + ". Rank i's input_split_sizes[j] "
            "must equal rank j's output_split_sizes[i]."
        )
    return metas


# ---------------------------------------------------------------- autograd


class AllToAll(torch.autograd.Function):
    """y = AllToAll.apply(x, output_split_sizes, input_split_sizes, group): the all-to-all as an
    autograd op; its backward sends the gradient back, the splits swapped."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: Splits, in_splits: Splits, group: Group
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.rows = (out_splits, in_splits), group, x.shape[0]
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((ctx.rows, *grad.shape[1:]))
        all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all_autograd(
    input: torch.Tensor,
    output_split_sizes: Splits = None,
    input_split_sizes: Splits = None,
    group: Group = None,
) -> torch.Tensor:
    """The differentiable all-to-all: a new tensor of sum(output_split_sizes) rows (None: as many
    as input) holding what the ranks sent this one; gradients go back the way they came."""
    out: torch.Tensor = AllToAll.apply(input, output_split_sizes, input_split_sizes, group)
    return out
