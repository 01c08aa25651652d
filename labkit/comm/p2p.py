"""Traced point-to-point messages: torch.distributed's send / recv / isend / irecv, plus sendrecv
(one send and one receive at once, a ring's step), on the same path as labkit's collectives.

    sendrecv(kv, buffer, dst=(r + 1) % n, src=(r - 1) % n, group=g)   # ring attention's step
    h = sendrecv(kv, buffer, dst=..., src=..., async_op=True); ...; h.wait()

Ranks are ranks IN `group` (torch's group_dst / group_src; the default group: global ranks).
Every message goes through labkit.comm._link (its bytes counted within / across nodes, the
inter-node link's cost slept) and the tracer records one collective per call, named "send",
"recv" or "sendrecv", of the bytes this rank sends (recv: the bytes it receives), so p2p traffic
shows in traces and byte counts like every other collective. They run after every labkit
collective issued before them on this process (labkit.comm._comm_thread's order).

sendrecv posts the receive first and then the send, and waits for both: every rank of a ring
can call it at once without a deadlock (gloo's send leaves only once its receive is posted).
isend / irecv post the message on the calling thread and return a handle whose wait() waits for it
(torch's Work), so two ranks may isend to each other and then wait. send / recv block.

What it leaves out: batch_isend_irecv, tags chosen per message beyond `tag`, a cross-rank check of
the two sides' shapes (a mismatch is gloo's error), object messages.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from . import _link
from ._comm_thread import CollectiveHandle
from ._dispatch import Group, check_tensor, group_info, submit

__all__ = ["P2PHandle", "irecv", "isend", "recv", "send", "sendrecv"]


class P2PHandle:
    """What isend / irecv return: wait() blocks until the message has left / arrived."""

    def __init__(self, work: Any, op_name: str, rank: int) -> None:
        self._work, self.op_name, self.rank = work, op_name, rank
        self._done = False

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())

    def wait(self) -> bool:
        # gloo's Work must be waited exactly once (a second wait blocks forever)
        if not self._done:
            self._work.wait()
            self._done = True
        return True


def _work(work: Optional[Any]) -> Any:
    """A p2p call's Work (torch types it Optional: None off the group, which group_info refused)."""
    assert work is not None
    return work


def _peer(peer: int, what: str, name: str, group: Group, alone_ok: bool = False) -> tuple[int, int, int]:
    """(this rank, world size, the peer's GLOBAL rank) after checking `peer` (a rank in group);
    alone_ok: a world of one may name itself (sendrecv then copies)."""
    rank, n = group_info(group)
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < n:
        raise ValueError(f"{name}: {what} must be a rank of the group, 0 ≤ {what} < {n}, got {peer!r}")
    if peer == rank and not (alone_ok and n == 1):
        raise ValueError(f"{name}: {what}={peer} is this rank itself; a rank cannot message itself")
    return rank, n, _link.global_rank(group, peer)


def _check(tensor: torch.Tensor, what: str, name: str) -> None:
    check_tensor(tensor, what, name)
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: {what} must be contiguous (got stride {tensor.stride()})")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _isend(tensor: torch.Tensor, dst: int, group: Group, tag: int) -> Any:
    _link.sending((dst,), _nbytes(tensor))
    return _work(dist.isend(tensor, dst=dst, group=group, tag=tag))


def _irecv(tensor: torch.Tensor, src: int, group: Group, tag: int) -> Any:
    return _work(dist.irecv(tensor, src=src, group=group, tag=tag))


def sendrecv(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    *,
    dst: int,
    src: int,
    group: Group = None,
    tag: int = 0,
    async_op: bool = False,
) -> Optional[CollectiveHandle]:
    """Send `send_tensor` to rank `dst` and receive rank `src`'s into `recv_tensor`, at once (both
    ranks in `group`). recv_tensor must not be send_tensor (its bytes are overwritten while they
    may still be leaving). Async: a handle (labkit's comm thread runs it), else None when done."""
    name = "sendrecv"
    _check(send_tensor, "send_tensor", name)
    _check(recv_tensor, "recv_tensor", name)
    rank, n, to = _peer(dst, "dst", name, group, alone_ok=True)
    _, _, frm = _peer(src, "src", name, group, alone_ok=True)
    if n > 1 and send_tensor.data_ptr() == recv_tensor.data_ptr() and send_tensor.numel():
        raise ValueError(f"{name}: recv_tensor is send_tensor: receiving would overwrite what is being sent")

    def job() -> None:
        if n == 1:
            recv_tensor.copy_(send_tensor)
            return
        incoming = _irecv(recv_tensor, frm, group, tag)
        outgoing = _isend(send_tensor, to, group, tag)
        incoming.wait()
        outgoing.wait()

    return submit(job, name, rank, _nbytes(send_tensor), n, async_op, send_tensor.device)


def send(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> None:
    """Like dist.send (dst a rank in `group`): returns once the message has left."""
    rank, n, to = _peer(dst, "dst", "send", group)
    _check(tensor, "tensor", "send")
    submit(
        lambda: _isend(tensor, to, group, tag).wait(), "send", rank, _nbytes(tensor), n, False, tensor.device
    )


def recv(tensor: torch.Tensor, src: int, group: Group = None, tag: int = 0) -> None:
    """Like dist.recv (src a rank in `group`), into `tensor`; returns once it has arrived."""
    rank, n, frm = _peer(src, "src", "recv", group)
    _check(tensor, "tensor", "recv")
    submit(
        lambda: _irecv(tensor, frm, group, tag).wait(), "recv", rank, _nbytes(tensor), n, False, tensor.device
    )


def _posted(post: Any, tensor: torch.Tensor, name: str, rank: int, n: int) -> P2PHandle:
    """Post one message (traced as `name`, after every labkit collective issued before it)."""
    works: list[Any] = []
    submit(lambda: works.append(post()), name, rank, _nbytes(tensor), n, False, tensor.device)
    return P2PHandle(works[0], name, rank)


def isend(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> P2PHandle:
    """Like dist.isend: the message posted now, handle.wait() until it has left."""
    rank, n, to = _peer(dst, "dst", "isend", group)
    _check(tensor, "tensor", "isend")
    return _posted(lambda: _isend(tensor, to, group, tag), tensor, "isend", rank, n)


def irecv(tensor: torch.Tensor, src: int, group: Group = None, tag: int = 0) -> P2PHandle:
    """Like dist.irecv: the receive posted now, handle.wait() until `tensor` holds the message."""
    rank, n, frm = _peer(src, "src", "irecv", group)
    _check(tensor, "tensor", "irecv")
    return _posted(lambda: _irecv(tensor, frm, group, tag), tensor, "irecv", rank, n)
