"""The cross-rank check that runs before every labkit collective moves data it could misplace.

Every rank sends every other rank one message that starts with a 64-byte header describing its
call (which collective, op, dtype, input and output numel, the small-message threshold) and
receives theirs: one round of n-1 point-to-point messages per rank, in parallel, on a tag of its
own. Every kind of collective starts with this same exchange, so two ranks that called different
collectives (all_reduce against reduce_scatter, say) still meet here, see that the headers differ
and raise the same error, before the ring (whose messages would never match) starts. Without it a
mismatch hangs until the launcher's timeout or, worse, returns a silently wrong tensor (SUM on one
rank and AVG on another run the same ring).

The small-message algorithm (labkit.comm._direct) puts its data in the same message, right after
the header, so there the check costs no message of its own. That is safe whatever the peer
called because every rank always posts the receive for this first message at one fixed size,
HEADER_BYTES + INLINE_CAP_BYTES, and never sends more: gloo accepts a shorter message than the
posted receive (a longer one would abort the process). The receiver reads the header first and
only then looks at the payload. For the ring the message is the header alone.

The staging buffers (a Mailbox per process group) are made once and reused: (n-1) receive
buffers of HEADER_BYTES + INLINE_CAP_BYTES, and the send messages. They are transport memory,
like gloo's own buffers: made from a bytearray (torch.frombuffer), not by a torch op, so
labkit.observe.memory does not count them, and the header is packed with struct, not torch ops.
The receives for the next call are posted as soon as a call has read its messages (PREPOST): a
gloo send waits until the peer's receive is posted, so this way the peers' next sends leave at
once. Measured (2 ranks, loaded 2-core machine, benchmarks/collectives.py, ours / gloo at 64 KiB,
two runs of each, minutes apart, so noisy): all-gather 2.26x with the receives posted at the start
of each call, 1.45x with them pre-posted; reduce-scatter 1.84x and 1.12x.

Left out: a rank that makes no labkit call at all while the others make one still waits here
(that rank might only be slow; a short timeout would turn a loaded machine into false alarms);
a call with verify=False on one rank but not on another still hangs if it takes the ring (that
skips the exchange); on CUDA (NCCL needs equal sizes) the header goes alone, as an int64 table.
"""

import struct
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from . import _link

CHECK_TAG = 0x6C6B  # ring steps use tags 0 … 2n-3 and the naive all-reduce 0: never matched here
KINDS = (
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_all_gather",
    "naive_all_reduce",
    "all_gather_coalesced",
    "all_to_all_single",
)
_OPS = (None, "sum", "avg")
# Every dtype torch defines, in a fixed order: the same codes on every rank (same torch build).
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_FIELDS = 5  # kind, op, dtype, input numel, output numel: what the error message names

HEADER = struct.Struct("<8q")  # magic, the 5 fields, direct_max, payload bytes (64 B: aligned)
HEADER_BYTES = HEADER.size
MAGIC = 0x6C61626B6974  # "labkit": a header, not stale bytes
INLINE_CAP_BYTES = 1 << 20  # the most payload a first message ever carries (receive size)
PREPOST = True  # post the next call's receives at the end of each call (Mailbox.repost)


class CollectiveMismatchError(ValueError):
    """The ranks called different collectives (kind, op, dtype or size) at the same point."""


def describe(kind: str, op: Optional[str], dtype: torch.dtype, numel_in: int, numel_out: int) -> str:
    """One call as the error message names it, e.g. ring_all_reduce(op=SUM, torch.float32, 8
    elements)."""
    parts = [] if op is None else [f"op={op.upper()}"]
    parts.append(str(dtype))
    if numel_in == numel_out:
        parts.append(f"{numel_in} elements")
    else:
        parts.append(f"{numel_in} elements in, {numel_out} out")
    return f"{kind}({', '.join(parts)})"


_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, len(_DTYPES))


def _dtype_name(code):
    return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "another dtype"


def call_fields(
    kind: str, op: Optional[str], dtype: torch.dtype, numel_in: int, numel_out: int
) -> tuple[int, int, int, int, int]:
    """The 5 header fields that name a call."""
    return (KINDS.index(kind), _OPS.index(op), dtype_code(dtype), numel_in, numel_out)


def _name(call):
    kind, op, dtype, numel_in, numel_out = call
    return describe(
        KINDS[kind] if 0 <= kind < len(KINDS) else f"an unknown collective ({kind})",
        _OPS[op] if 0 <= op < len(_OPS) else f"#{op}",
        _dtype_name(dtype),
        numel_in,
        numel_out,
    )


def mismatch_message(rows: Sequence[Sequence[int]]) -> str:
    """Name each rank's call (ranks with the same call share one entry)."""
    by_call: dict[str, list[int]] = {}
    for rank, call in enumerate(rows):
        by_call.setdefault(_name(call), []).append(rank)
    entries = [
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} called {call}"
        for call, ranks in by_call.items()
    ]
    return (
        "collective mismatch: " + "; ".join(entries) + ". Every rank must make the same "
        "collective calls (kind, op, dtype, size), in the same order."
    )


def _raw(nbytes):
    """A byte buffer made outside torch's ops: (bytearray, uint8 tensor over the same memory)."""
    raw = bytearray(max(nbytes, 1))
    return raw, torch.frombuffer(raw, dtype=torch.uint8)


class Mailbox:
    """One process group's staging for first messages, reused by every call on that group.

    peers: the other ranks, in group-rank order; recv[i]: peer i's first message lands here;
    send slots: messages this rank sends (slot 0 for a message every peer gets)."""

    def __init__(self, pg, rank, world_size):
        self.pg, self.rank, self.world_size = pg, rank, world_size
        self.peers = [r for r in range(world_size) if r != rank]
        self.global_peers = [_link.global_rank(pg, r) for r in self.peers]
        self.recv = [_raw(HEADER_BYTES + INLINE_CAP_BYTES) for _ in self.peers]
        self.posted: list[Any] = [None] * len(self.peers)  # receives already posted for the next call
        self._send = []
        self._views = {}  # (slot or peer index, dtype, numel) -> views made once, reused

    def message(
        self, slot: int, dtype: torch.dtype, numel: int
    ) -> tuple[bytearray, torch.Tensor, torch.Tensor]:
        """(bytearray, message, payload) for send slot `slot`: the message is the uint8 header
        plus numel elements, the payload those elements as `dtype` (fill it before exchange)."""
        key = ("send", slot, dtype, numel)
        views = self._views.get(key)
        if views is None:
            while len(self._send) <= slot:
                self._send.append(None)
            need = HEADER_BYTES + numel * dtype.itemsize
            have = self._send[slot]
            if have is None or len(have[0]) < need:
                # Grow to a power of two (capped): a few sizes cover every later call.
                have = self._send[slot] = _raw(
                    min(max(1 << (need - 1).bit_length(), 4096), HEADER_BYTES + INLINE_CAP_BYTES)
                )
                self._views.clear()  # views of the old buffer must not be handed out again
            message = have[1][:need]
            views = self._views[key] = (have[0], message, message[HEADER_BYTES:].view(dtype))
        return views

    def payload(self, i: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Peer i's payload, numel elements of `dtype`, from its last first message."""
        key = ("recv", i, dtype, numel)
        view = self._views.get(key)
        if view is None:
            nbytes = numel * dtype.itemsize
            view = self._views[key] = self.recv[i][1][HEADER_BYTES : HEADER_BYTES + nbytes].view(dtype)
        return view

    def exchange(self, header: Sequence[int], messages: Sequence[Any]) -> list[tuple[int, ...]]:
        """Send messages[i] (a `message()`, header packed in front) to peer i, receive every
        peer's first message; returns the peers' headers (tuples, in peer order). Waits for
        everything. Call repost() once the payloads have been read."""
        pg, peers, recvs = self.pg, self.peers, self.posted
        for i, peer in enumerate(peers):
            if recvs[i] is None:
                recvs[i] = pg.recv([self.recv[i][1]], peer, CHECK_TAG)
        self.posted = [None] * len(peers)
        sends = []
        last = None
        sizes = [m[1].numel() for m in messages]
        if peers and len(set(sizes)) == 1:  # one size (every collective but the all-to-all)
            _link.sending(self.global_peers, sizes[0])
        else:  # the all-to-all's messages differ by peer
            for peer, size in zip(self.global_peers, sizes):
                _link.sending((peer,), size)
        for i, peer in enumerate(peers):
            raw, msg, _ = messages[i]
            if raw is not last:  # a message every peer gets is packed once
                HEADER.pack_into(raw, 0, *header)
                last = raw
            sends.append(pg.send([msg], peer, CHECK_TAG))
        for work in recvs:
            work.wait()
        # gloo's send Work must be waited exactly once: a second wait blocks forever.
        for work in sends:
            work.wait()
        return [HEADER.unpack_from(self.recv[i][0], 0) for i in range(len(peers))]

    def repost(self) -> None:
        """Post the receives of the next call's first messages now that this call's are read:
        a gloo send leaves only once the peer's receive is posted, so the peers' next sends go
        out at once, from their own thread, instead of waiting for our notice (one message
        less on every call's critical path)."""
        if PREPOST:
            self.posted = [
                self.pg.recv([self.recv[i][1]], peer, CHECK_TAG) for i, peer in enumerate(self.peers)
            ]


_mailboxes: dict[
    int, Mailbox
] = {}  # id(process group) -> Mailbox (the group is kept in it, so the id stays unique)


def mailbox(group: Any, rank: int, world_size: int) -> Mailbox:
    pg = dist.group.WORLD if group is None else group
    box = _mailboxes.get(id(pg))
    if box is None or box.pg is not pg or box.world_size != world_size:
        box = _mailboxes[id(pg)] = Mailbox(pg, rank, world_size)
    return box


def clear() -> None:
    """Free the send messages. The receive buffers stay: a receive posted into one cannot be
    taken back, and the peer's next first message is on its way to it."""
    for box in _mailboxes.values():
        box._send.clear()
        box._views.clear()


def check_headers(mine: Sequence[int], theirs: Sequence[Sequence[int]], rank: int) -> None:
    """Raise CollectiveMismatchError (the same text on every rank) unless every header is mine."""
    if all(h == mine for h in theirs):
        return
    rows = list(theirs)
    rows.insert(rank, mine)
    if any(h[0] != MAGIC for h in rows):
        raise CollectiveMismatchError(
            "collective mismatch: a first message without a labkit "
            "header arrived (a rank sent on labkit's check tag itself)"
        )
    calls = [tuple(h[1 : 1 + _FIELDS]) for h in rows]
    if any(c != calls[0] for c in calls):
        raise CollectiveMismatchError(mismatch_message(calls))
    limits = ", ".join(f"rank {r}: {h[6]}" for r, h in enumerate(rows))
    raise CollectiveMismatchError(
        f"collective mismatch: every rank called {_name(calls[0])}, but the ranks chose different "
        f"algorithms (labkit.comm.collectives.DIRECT_MAX_BYTES differs: {limits}); set it alike "
        f"on every rank."
    )


def check_same_call(
    ring: Any,
    kind: str,
    op: Optional[str],
    dtype: torch.dtype,
    numel_in: int,
    numel_out: int,
    direct_max: int = 0,
) -> None:
    """Raise CollectiveMismatchError on every rank unless every rank of ring.group makes this
    same call now. `ring` is labkit.comm._ring.Ring; op is "sum", "avg" or None (all-gather).
    The message is the header alone (labkit.comm._direct sends its data behind it instead)."""
    n, me = ring.world_size, ring.rank
    if n == 1:
        return
    fields = call_fields(kind, op, dtype, numel_in, numel_out)
    if ring.device.type != "cpu":
        return _check_table(ring, fields)
    box = mailbox(ring.group, me, n)
    header = (MAGIC, *fields, direct_max, 0)
    message = box.message(0, torch.uint8, 0)
    theirs = box.exchange(header, [message] * len(box.peers))
    box.repost()
    check_headers(header, theirs, me)


def _check_table(ring, fields):
    """NCCL: every rank's 5 fields in an int64 table on the device, one batch of sends/recvs
    (NCCL needs matching sizes, and separate isend/irecv around several peers can deadlock)."""
    n, me = ring.world_size, ring.rank
    i64 = dict(dtype=torch.int64, device=ring.device)
    table = torch.empty(n, _FIELDS, **i64)
    table[me] = torch.tensor(fields, **i64)
    peers = [r for r in range(n) if r != me]
    ops = [dist.P2POp(dist.irecv, table[r], ring.to_global(r), ring.group) for r in peers]
    ops += [dist.P2POp(dist.isend, table[me], ring.to_global(r), ring.group) for r in peers]
    _link.sending([ring.to_global(r) for r in peers], table[me].numel() * table.element_size())
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    rows = table.tolist()
    if any(row != rows[0] for row in rows):
        raise CollectiveMismatchError(mismatch_message(rows))
