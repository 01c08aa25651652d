"""Direct exchange: the small-message algorithm behind labkit.comm.collectives (CPU / gloo).

Every rank sends every other rank, at once, what that rank needs, in ONE message per pair: the
cross-rank check's header (labkit.comm._crosscheck) with the data right behind it. So a small
collective costs one round of n-1 parallel messages, where the ring costs its check plus 2(n-1)
(all-reduce) or n-1 steps in a row, each a gloo rendezvous (a send leaves only once the peer has
posted its receive). Below about a MiB that latency, not bandwidth, is the time (the switch point
and its measurements: labkit.comm.collectives.DIRECT_MAX_BYTES).

    all-gather      rank r sends its shard to every peer; each copies it into place (several
                    all-gathers at once, coalesced: the shards end to end in the one message)
    reduce-scatter  rank r sends chunk k of its input to rank k; rank k adds what it got
    all-reduce      rank r sends its whole tensor to every peer; every rank adds all n copies

Same bits as the ring, by construction: chunk c of a ring sum is added in the order
x[c+1] + x[c+2] + … + x[c+n-1] + x[c] (indices mod n; the chunk starts at rank c+1 and ends at
its owner) with the dtype's rounding after every add, then divided by n for AVG; here every
rank adds chunk c in exactly that order. So every rank holds the same bits, and switching
algorithm at the threshold changes no result.

Cost: an all-gather or reduce-scatter moves what the ring moves ((n-1)/n of the buffer per
rank), only all at once; an all-reduce moves n-1 copies of the tensor per rank where the ring
moves 2(n-1)/n, which is why it stops at a size. Copies: the data is copied into the message
(one memcpy) and, for all-gather, out of it.

Left out: CUDA (NCCL needs equal message sizes: the ring runs there), recursive doubling and
trees (at n = 2…8 on one machine, one parallel round is already the fewest), splitting a message
that exceeds the cap.
"""

from typing import Any, Sequence

import torch

from ._crosscheck import Mailbox, check_headers


def _fold(out, terms, last, divide_by):
    """out = ((terms[0] + terms[1]) + …) + last, rounded after every add like a ring pass;
    terms[0] is scratch and is overwritten (a message buffer this call owns)."""
    acc = terms[0]
    for term in terms[1:]:
        acc.add_(term)
    torch.add(acc, last, out=out)
    if divide_by != 1:
        out.div_(divide_by)


def all_gather(
    box: Mailbox, header: Sequence[int], outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> None:
    """Every pair (outputs[i], inputs[i]) all-gathered in ONE message per peer (one pair: a plain
    all-gather; several: labkit.comm.flat's coalesced one): this rank's inputs end to end, each
    peer's pieces copied into chunk `peer` of every output, and this rank's own into its chunk
    (unless the input is that chunk: in place)."""
    sizes, dtype = [t.numel() for t in inputs], inputs[0].dtype
    numel = sum(sizes)
    message = box.message(0, dtype, numel)
    for piece, t in zip(message[2].split(sizes), inputs):
        piece.copy_(t.view(-1))
    theirs = box.exchange(header, [message] * len(box.peers))
    try:
        check_headers(header, theirs, box.rank)
        for i, peer in enumerate(box.peers):
            for piece, out, size in zip(box.payload(i, dtype, numel).split(sizes), outputs, sizes):
                out.view(-1)[peer * size : (peer + 1) * size].copy_(piece)
        # This rank's own chunks from the message's copy of the inputs, not from the inputs: an
        # input may alias a peer's chunk of an output (all_gather_into_tensor(out, out[:k]) on
        # rank 1), which the peers' data has just overwritten.
        for piece, out, t, size in zip(message[2].split(sizes), outputs, inputs, sizes):
            mine = out.view(-1)[box.rank * size : (box.rank + 1) * size]
            if mine.data_ptr() != t.data_ptr():
                mine.copy_(piece)
    finally:
        box.repost()


def reduce_scatter(
    box: Mailbox, header: Sequence[int], out: torch.Tensor, inputs: Sequence[torch.Tensor], divide_by: int
) -> None:
    """out = the ring-ordered sum of every rank's inputs[me]; inputs is never written."""
    n, me, dtype, numel = box.world_size, box.rank, out.dtype, out.numel()
    messages = []
    for slot, peer in enumerate(box.peers):
        message = box.message(slot, dtype, numel)
        message[2].copy_(inputs[peer])
        messages.append(message)
    theirs = box.exchange(header, messages)
    try:
        check_headers(header, theirs, me)
        got = {peer: box.payload(i, dtype, numel) for i, peer in enumerate(box.peers)}
        _fold(out, [got[(me + k) % n] for k in range(1, n)], inputs[me], divide_by)
    finally:
        box.repost()


def all_reduce(box: Mailbox, header: Sequence[int], tensor: torch.Tensor, divide_by: int) -> None:
    """tensor (any layout) = the ring-ordered sum over ranks, chunk by chunk (ring chunks)."""
    message = box.message(0, tensor.dtype, tensor.numel())
    mine = message[2]  # a copy of this rank's data: scratch after the
    mine.view(tensor.shape).copy_(tensor)  # exchange (the sends have left by then)
    theirs = box.exchange(header, [message] * len(box.peers))
    try:
        check_headers(header, theirs, box.rank)
        _sum_chunks(box, tensor, mine, divide_by)
    finally:
        box.repost()


def _sum_chunks(box, tensor, mine, divide_by):
    contiguous = tensor.is_contiguous()
    out = tensor.view(-1) if contiguous else mine
    for lo, hi, terms, last in _chunk_plan(box, tensor.dtype, tensor.numel(), mine):
        _fold(out[lo:hi], terms, last, divide_by)
    if not contiguous:
        tensor.copy_(out.view(tensor.shape))


def _chunk_plan(box, dtype, numel, mine):
    """Per ring chunk c: (lo, hi, [x[c+1], …, x[c+n-1]], x[c]) as views of the message buffers
    (x[me] is `mine`, the sent copy). The buffers are reused, so the views are made once."""
    key = ("sum", dtype, numel)
    plan = box._views.get(key)
    if plan is None:
        n, me = box.world_size, box.rank
        xs: list[Any] = [None] * n
        xs[me] = mine
        for i, peer in enumerate(box.peers):
            xs[peer] = box.payload(i, dtype, numel)
        chunk = -(-numel // n)
        plan = []
        for c in range(n):
            lo, hi = c * chunk, min((c + 1) * chunk, numel)
            if lo < hi:
                plan.append((lo, hi, [xs[(c + k) % n][lo:hi] for k in range(1, n)], xs[c][lo:hi]))
        box._views[key] = plan
    return plan
