"""The ring schedule behind labkit.comm.collectives, from isend/irecv only.

With n ranks and the buffer cut into n chunks, ring step t (0 ≤ t < 2n-2) has rank r send chunk
(r-t-1) mod n to rank r+1 and receive chunk (r-t-2) mod n from rank r-1:
- steps 0 … n-2 are the reduce-scatter: the received partial sum is added to the local
  contribution and forwarded; after the last one rank r holds the full sum of chunk r;
- steps n-1 … 2n-3 are the all-gather: rank r first sends its own chunk r, and every received
  chunk lands directly in its final place and is forwarded unchanged.

Speed (gloo on CPU): each chunk is cut into pieces of PIECE_BYTES, and piece j of step t+1 is sent
as soon as piece j of step t has arrived and been added, so transfers and additions pipeline and
several messages are in flight (gloo runs each on its own I/O threads). Every receive of the
pass is posted up front, because a gloo send only leaves once its receive is posted (a
rendezvous: that round trip is why a p2p ring stays latency-bound below a few MiB). Partial sums
go into a preallocated scratch buffer, one slot per reduce step, (n-1)/n of the buffer's size,
kept between calls (the input is never written). On CUDA (NCCL) a step is one batch_isend_irecv
of the whole chunk (NCCL pipelines internally; separate isend/irecv around a ring can deadlock).

Before any of this, labkit.comm.collectives runs the cross-rank check (labkit.comm._crosscheck, on a tag of
its own), so ranks that called different collectives raise instead of exchanging ring messages.
Small messages skip the ring: labkit.comm._direct sends them in the check's own messages.

Left out: bidirectional rings, trees, topology awareness, and overlapping the cross-rank check
with the ring's data.
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, cast

import torch
import torch.distributed as dist

from . import _link

PIECE_BYTES = 4 << 20  # best of 128 KiB … 16 MiB here at 16–64 MiB (1 MiB: ~1.2× slower)


@dataclass
class Ring:
    rank: int  # rank in the group
    world_size: int
    group: Optional[Any]  # a ProcessGroup; None: the default group
    device: torch.device
    next: int  # global rank of rank+1 (torch's p2p calls take global ranks)
    prev: int  # global rank of rank-1
    to_global: Callable[[int], int]

    def isend(self, tensor: torch.Tensor, tag: int = 0) -> Any:
        _link.sending((self.next,), tensor.numel() * tensor.element_size())
        return dist.isend(tensor, dst=self.next, group=self.group, tag=tag)

    def irecv(self, tensor: torch.Tensor, tag: int = 0) -> Any:
        return dist.irecv(tensor, src=self.prev, group=self.group, tag=tag)


def ring_pass(
    ring: Ring,
    chunk: int,
    inputs: Optional[Sequence[torch.Tensor]],
    finals: dict[int, torch.Tensor],
    acc: Optional[torch.Tensor],
    t_begin: int,
    t_end: int,
    divide_by: int = 1,
) -> None:
    """Run ring steps t_begin … t_end-1 (see the module docstring) over chunks of `chunk` elements.

    inputs[c]: this rank's contribution to chunk c (needed by reduce steps, never written);
    finals[c]: where the final value of chunk c goes (reduce steps write only finals[rank]);
    acc: (n-1)*chunk elements of scratch, one slot per reduce step (reduce steps only);
    divide_by: AVG divides each piece of the fully reduced chunk right away, before it is sent on."""
    n, r = ring.world_size, ring.rank
    if chunk == 0 or t_begin >= t_end:
        return
    # None only where no step of this pass reads them (inputs, acc: reduce steps only).
    inputs, acc = cast(Sequence[torch.Tensor], inputs), cast(torch.Tensor, acc)
    last_reduce = n - 2

    def partial(t, lo, hi):  # the partial sum received at reduce step t
        return acc[t * chunk + lo : t * chunk + hi]

    def send_src(t, lo, hi):
        c = (r - t - 1) % n
        if t == 0:
            return inputs[c][lo:hi]
        if t <= last_reduce:
            return partial(t - 1, lo, hi)  # completed at step t-1
        return finals[c][lo:hi]

    def recv_dst(t, lo, hi):
        if t <= last_reduce:
            return partial(t, lo, hi)
        return finals[(r - t - 2) % n][lo:hi]  # all-gather: straight into place, no copy

    def complete(t, lo, hi):
        if t > last_reduce:
            return
        c = (r - t - 2) % n
        if t < last_reduce:
            partial(t, lo, hi).add_(inputs[c][lo:hi])
        else:
            torch.add(partial(t, lo, hi), inputs[c][lo:hi], out=finals[c][lo:hi])
            if divide_by != 1:
                finals[c][lo:hi].div_(divide_by)

    if ring.device.type != "cpu":
        for t in range(t_begin, t_end):
            _link.sending((ring.next,), chunk * _element_size(acc, finals))
            ops = [
                dist.P2POp(dist.irecv, recv_dst(t, 0, chunk), ring.prev, ring.group),
                dist.P2POp(dist.isend, send_src(t, 0, chunk), ring.next, ring.group),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            complete(t, 0, chunk)
        return

    piece = max(1, PIECE_BYTES // _element_size(acc, finals))
    bounds = [(lo, min(lo + piece, chunk)) for lo in range(0, chunk, piece)]
    # gloo sends a message only once the receiver has posted its recv (a rendezvous), so post
    # every receive of the whole pass now: each step has its own destination (a scratch slot or
    # the final place) and its own tag, so nothing is overwritten early or matched out of order.
    recvs = {
        (t, j): ring.irecv(recv_dst(t, lo, hi), tag=t)
        for t in range(t_begin, t_end)
        for j, (lo, hi) in enumerate(bounds)
    }
    sends = [ring.isend(send_src(t_begin, lo, hi), tag=t_begin) for lo, hi in bounds]
    for t in range(t_begin, t_end):
        for j, (lo, hi) in enumerate(bounds):
            recvs.pop((t, j)).wait()
            complete(t, lo, hi)
            if t + 1 < t_end:  # piece j of step t is final: forward it while the rest arrive
                sends.append(ring.isend(send_src(t + 1, lo, hi), tag=t + 1))
    # gloo's send Work must be waited exactly once: a second wait blocks forever.
    for work in sends:
        work.wait()


def _element_size(acc, finals):
    return (acc if acc is not None else next(iter(finals.values()))).element_size()


def all_gather(ring: Ring, output: torch.Tensor, input: torch.Tensor) -> None:
    """The ring all-gather into `output` (world_size chunks, this rank's is `input`; it may be
    that chunk itself): n-1 steps, each received chunk landing in its place."""
    chunks = output.view(ring.world_size, -1).unbind(0)
    if chunks[ring.rank].data_ptr() != input.data_ptr() or input.numel() == 0:
        chunks[ring.rank].copy_(input.view(-1))
    if ring.world_size > 1:
        n = ring.world_size
        ring_pass(ring, input.numel(), None, dict(enumerate(chunks)), None, n - 1, 2 * n - 2)
