"""Point-to-point send and receive, traced and priced like labkit's collectives.

    h = p2p.send(activation, dst=1)              # global rank, like dist.isend
    h = p2p.recv(buffer, src=0)                  # fills `buffer` (its shape and dtype must match)
    h.wait()

Both are asynchronous (dist.isend / dist.irecv underneath: on gloo a send leaves once its receive
is posted, so posting every send first and waiting only for receives cannot deadlock unless the
waits form a cycle). Each call is one event on the rank's trace ("p2p_send" / "p2p_recv", its
bytes, start to wait() and the time wait() blocked); a send counts its bytes within / across
nodes and pays the simulated inter-node link like every message labkit.comm sends
(labkit.comm._link). A receive counts no wire bytes: its sender did.

sendrecv(send_tensor, recv_tensor, dst=, src=) is one ring step: a send and a receive at once
(ring attention's K/V), the receive posted first, both waited; one "p2p_sendrecv" event of the
bytes it sends. Unlike send / recv it runs after every labkit collective issued before it (through
labkit.comm._dispatch.submit, like the collectives), and with async_op=True on the comm thread,
so a ring step overlaps compute and stays ordered with labkit's async collectives.

Not through the comm thread (send / recv): a pipeline's transfers are ordered by its schedule, not by issue
order, so they run on the calling thread (ordered with labkit's async collectives only if the
caller waits for those first, as with any direct dist.* call). Left out: NCCL's batch_isend_irecv
(gloo is the course's backend), sends to oneself (a pipeline keeps those local).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from labkit.observe import tracing

from . import _link
from ._comm_thread import CollectiveHandle
from ._dispatch import Group, check_tensor, group_info, submit

__all__ = ["P2PHandle", "send", "recv", "sendrecv"]


class P2PHandle:
    """One send or receive in flight: wait() blocks until it is done (exactly once; later calls
    return at once: gloo's send Work must not be waited twice)."""

    def __init__(self, work: Any, token: Any, tensor: torch.Tensor) -> None:
        self.work, self.token, self.tensor = work, token, tensor
        self.done = False

    def wait(self) -> torch.Tensor:
        """Block until done; returns the tensor (a receive's filled buffer)."""
        if not self.done:
            with tracing.blocked(self.token):
                self.work.wait()
            self.token.finish()
            self.done = True
            self.work = None
        return self.tensor


def _peer(peer: int, group: Group, name: str) -> None:
    if isinstance(peer, bool) or not isinstance(peer, int):
        raise TypeError(f"{name}: the peer must be an int (a global rank), got {peer!r}")
    rank, n = group_info(group)
    members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    if peer not in members:
        raise ValueError(f"{name}: global rank {peer} is not in the group (ranks {members})")
    if peer == dist.get_rank():
        raise ValueError(f"{name}: rank {peer} cannot send to itself (keep the tensor locally)")


def send(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> P2PHandle:
    """Send `tensor` (contiguous) to global rank `dst`; a P2PHandle. Its bytes are counted as this
    rank's wire traffic, within or across nodes."""
    name = "p2p.send"
    check_tensor(tensor, "tensor", name)
    _peer(dst, group, name)
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: tensor must be contiguous (pass .contiguous())")
    nbytes = tensor.numel() * tensor.element_size()
    token = tracing.start_collective("p2p_send", nbytes, 2, async_=True)
    with tracing.attributed(token), tracing.untraced():
        _link.sending((dst,), nbytes)
        work = dist.isend(tensor, dst=dst, group=group, tag=tag)
    return P2PHandle(_work(work), token, tensor)


def recv(tensor: torch.Tensor, src: int, group: Group = None, tag: int = 0) -> P2PHandle:
    """Receive into `tensor` (contiguous, the sent shape and dtype) from global rank `src`."""
    name = "p2p.recv"
    check_tensor(tensor, "tensor", name)
    _peer(src, group, name)
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: tensor must be contiguous (a fresh buffer)")
    token = tracing.start_collective("p2p_recv", tensor.numel() * tensor.element_size(), 2, async_=True)
    with tracing.untraced():
        work = dist.irecv(tensor, src=src, group=group, tag=tag)
    return P2PHandle(_work(work), token, tensor)


def _work(work: Optional[Any]) -> Any:
    assert work is not None  # torch types it Optional: None off the group, which _peer refused
    return work


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
    """Send `send_tensor` to global rank `dst` and receive global rank `src`'s message into
    `recv_tensor`, at once (both contiguous; recv_tensor not send_tensor: receiving would overwrite
    bytes that may still be leaving). Sync: returns None when both are done; async_op=True: a
    handle (labkit's comm thread runs it, after every labkit collective issued before)."""
    name = "p2p.sendrecv"
    for what, t in (("send_tensor", send_tensor), ("recv_tensor", recv_tensor)):
        check_tensor(t, what, name)
        if not t.is_contiguous():
            raise ValueError(f"{name}: {what} must be contiguous (pass .contiguous() / a fresh buffer)")
    _peer(dst, group, name)
    _peer(src, group, name)
    if send_tensor.numel() and send_tensor.data_ptr() == recv_tensor.data_ptr():
        raise ValueError(f"{name}: recv_tensor is send_tensor: receiving would overwrite what is being sent")
    rank, n = group_info(group)
    nbytes = send_tensor.numel() * send_tensor.element_size()

    def job() -> None:
        incoming = _work(dist.irecv(recv_tensor, src=src, group=group, tag=tag))
        _link.sending((dst,), nbytes)
        outgoing = _work(dist.isend(send_tensor, dst=dst, group=group, tag=tag))
        incoming.wait()
        outgoing.wait()

    return submit(job, "p2p_sendrecv", rank, nbytes, n, async_op, send_tensor.device)
