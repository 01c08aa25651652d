"""Hand-written collectives from point-to-point send/recv only: ring reduce-scatter, ring
all-gather, ring all-reduce (= reduce-scatter then all-gather), a direct exchange for small
messages, and a naive all-reduce (reduce to rank 0, then broadcast) to contrast with.

Semantics follow torch.distributed (reduce_scatter_tensor, all_gather_into_tensor, all_reduce):
ops "sum"/"avg" (or ReduceOp.SUM / ReduceOp.AVG), any world size, any dtype torch can add
(float32/64, bfloat16, float16, integers), CPU tensors on gloo and CUDA tensors on NCCL.
Differences from torch.distributed, on purpose:
- AVG works on gloo too (gloo itself has no AVG); AVG of an integer tensor raises TypeError (as NCCL).
- ring_all_reduce accepts any numel and non-contiguous tensors (it pads / copies internally).
- Every call starts with a cross-rank check (labkit.comm._crosscheck): every rank sends every other
  rank a header describing its call (kind, op, dtype, input and output numel); if they differ,
  every rank raises the same CollectiveMismatchError (a ValueError) naming each rank's call, in
  milliseconds, instead of hanging (all_reduce on one rank, reduce_scatter on another) or
  returning a wrong tensor (SUM on one, AVG on another). On by default, as a course wants. Before
  a ring it is one round of messages of its own (its cost: docs/dev/measurements.md);
  verify=False (per call) or VERIFY_ACROSS_RANKS = False (globally, on every rank alike) skips it
  there. The direct exchange carries the header in its data messages, so there the check is free
  and always on.
- Float results can differ from the backend's in the last bits (another summation order); bfloat16
  sums are rounded to bfloat16 after every ring step, as NCCL does. Both algorithms give the same
  bits (the direct exchange adds in the ring's order), so the switch below changes no result.
- Async ops run on one communication thread per process (see labkit.comm._comm_thread): they never
  reorder among themselves, but are not ordered with direct dist.* calls made meanwhile.

Two algorithms, picked by size like NCCL picks ring or tree/LL (CPU / gloo; CUDA always rings):
- the ring (labkit.comm._ring): each rank talks to its neighbour only, n-1 steps per half,
  pipelined in pieces; bandwidth-optimal, but every step is a gloo rendezvous (a send leaves only
  once its receive is posted), so below a few MiB it is latency-bound: check + 2(n-1) steps;
- the direct exchange (labkit.comm._direct): one message to every peer at once, header and data
  together, into receive buffers posted at the end of the previous call: one round.
  DIRECT_MAX_BYTES (1 MiB, the most one of its messages carries; capped by the receive size
  _crosscheck.INLINE_CAP_BYTES) is the switch: below it one round beats 2(n-1) rendezvous (the
  measurements behind the choice: docs/dev/measurements.md; today's: benchmarks/collectives.py).
  Past 1 MiB the all-reduce's direct message is n-1 copies of the tensor (the ring moves
  2(n-1)/n), and the (n-1) x 1 MiB receive buffers per process would have to grow.

Built on these (labkit.comm.flat): reduce_scatter_padded / all_gather_padded for any numel, and
all_gather_coalesced, several all-gathers in one collective.

Padding convention (FSDP's): a flat buffer of `numel` elements is split into world_size equal
chunks of ceil(numel / world_size) elements; the last chunk(s) are padded with zeros; rank k owns
chunk k. See shard_range.
"""

from typing import Any, Optional

import torch
import torch.distributed as dist

from . import _crosscheck, _direct, _dispatch, _link, _ring
from ._comm_thread import CollectiveHandle, shutdown  # noqa: F401  (public API)
from ._crosscheck import CollectiveMismatchError
from ._dispatch import Group, Op, check_pair, check_tensor, group_info, resolve_op, ring_for, submit
from ._ring import ring_pass

__all__ = [
    "ring_reduce_scatter",
    "ring_all_gather",
    "ring_all_reduce",
    "naive_all_reduce",
    "shard_range",
    "group_info",
    "CollectiveHandle",
    "clear_buffer_cache",
    "shutdown",
    "VERIFY_ACROSS_RANKS",
    "DIRECT_MAX_BYTES",
    "CollectiveMismatchError",
]

VERIFY_ACROSS_RANKS = True
# The switch point between the two algorithms, in bytes of ONE message of the direct exchange
# (all-reduce: the tensor; reduce-scatter: the output; all-gather: the input): at or below it the
# direct exchange runs (labkit.comm._direct: one round, the check inside the data message), above
# it the ring (check, then 2(n-1) or n-1 pipelined steps). See the module docstring for why here.
# Capped at _crosscheck.INLINE_CAP_BYTES (the receive every rank posts); 0 = always the ring.
# Must be the same on every rank (a rank that differs gets a CollectiveMismatchError).
DIRECT_MAX_BYTES = 1 << 20
_buffers: dict[
    tuple, torch.Tensor
] = {}  # (purpose, device, dtype) -> flat tensor, reused across calls on the comm thread


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(start, end, padded_numel): rank's shard holds elements [start, end) of the flat buffer.

    chunk = ceil(numel / world_size); padded_numel = chunk * world_size. Shard k is the k-th chunk
    of the padded buffer, [k*chunk, (k+1)*chunk); `end - start` can be less than chunk (even 0)
    for the last ranks, whose chunks are (partly) padding."""
    if numel < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"shard_range: need numel ≥ 0 and 0 ≤ rank < world_size, got "
            f"numel={numel}, rank={rank}, world_size={world_size}"
        )
    chunk = -(-numel // world_size)
    start = min(rank * chunk, numel)
    return start, min(start + chunk, numel), chunk * world_size


def clear_buffer_cache() -> None:
    """Free the scratch buffers kept between calls: (n-1)/n of the largest reduced buffer for
    partial sums, plus a padded copy for ring_all_reduce on sizes not divisible by n, and the
    direct exchange's message buffers (labkit.comm._crosscheck.Mailbox)."""
    _buffers.clear()
    _crosscheck.clear()


def _buffer(purpose, numel, like):
    """A cached flat buffer of at least numel elements (only the comm thread touches the cache)."""
    key = (purpose, like.device, like.dtype)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = _buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _plan(kind, op, t, numel_in, numel_out, message_bytes, where):
    return _dispatch.plan(kind, op, t, numel_in, numel_out, message_bytes, where, DIRECT_MAX_BYTES)


def _verify_and_check(verify, ring, kind, op, dtype, numel_in, numel_out):
    """Before a ring: the cross-rank check, unless verify (or VERIFY_ACROSS_RANKS) is off."""
    if _dispatch.verify_on(verify, VERIFY_ACROSS_RANKS):
        _dispatch.check(ring, kind, op, dtype, numel_in, numel_out, DIRECT_MAX_BYTES)


# ---------------------------------------------------------------- public collectives
# Each picks its algorithm by size (DIRECT_MAX_BYTES): the direct exchange always compares the
# headers (they ride in its data messages, free); the ring runs the check first unless verify=False.


def ring_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Op = "sum",
    group: Group = None,
    async_op: bool = False,
    verify: Optional[bool] = None,
) -> Optional[CollectiveHandle]:
    """Like dist.reduce_scatter_tensor: rank k gets the reduced k-th chunk of `input`
    (input.numel() == world_size * output.numel()). `input` is left unchanged."""
    name = "ring_reduce_scatter"
    check_pair(output, input, name)
    op = resolve_op(op, input.dtype, name)
    rank, n = group_info(group)
    if input.numel() != n * output.numel():
        raise ValueError(
            f"{name}: input has {input.numel()} elements but world_size × output "
            f"= {n} × {output.numel()} = {n * output.numel()}; pad the input "
            f"(see labkit.comm.flat.reduce_scatter_padded)"
        )
    header, box = _plan(
        name,
        op,
        input,
        input.numel(),
        output.numel(),
        output.numel() * output.element_size(),
        (group, rank, n),
    )
    divide_by = n if op == "avg" else 1

    def job():
        flat_in, out = input.view(-1), output.view(-1)
        if header is not None:
            return _direct.reduce_scatter(box, header, out, flat_in.view(n, -1).unbind(0), divide_by)
        ring = ring_for(group, rank, n, input.device)
        _verify_and_check(verify, ring, name, op, input.dtype, input.numel(), output.numel())
        if n == 1:
            out.copy_(flat_in)
        else:
            acc = _buffer("recv", (n - 1) * out.numel(), out)
            ring_pass(
                ring,
                out.numel(),
                flat_in.view(n, -1).unbind(0),
                {rank: out},
                acc,
                0,
                n - 1,
                divide_by=divide_by,
            )

    return submit(job, name, rank, input.numel() * input.element_size(), n, async_op, input.device)


def ring_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
    verify: Optional[bool] = None,
) -> Optional[CollectiveHandle]:
    """Like dist.all_gather_into_tensor: output = concat of every rank's `input`
    (output.numel() == world_size * input.numel()). `input` may be the rank's slice of output."""
    name = "ring_all_gather"
    check_pair(output, input, name)
    rank, n = group_info(group)
    if output.numel() != n * input.numel():
        raise ValueError(
            f"{name}: output has {output.numel()} elements but world_size × input "
            f"= {n} × {input.numel()} = {n * input.numel()}"
        )
    header, box = _plan(
        name,
        None,
        output,
        input.numel(),
        output.numel(),
        input.numel() * input.element_size(),
        (group, rank, n),
    )

    def job():
        if header is not None:
            return _direct.all_gather(box, header, [output], [input])
        ring = ring_for(group, rank, n, input.device)
        _verify_and_check(verify, ring, name, None, output.dtype, input.numel(), output.numel())
        _ring.all_gather(ring, output, input)

    return submit(job, name, rank, output.numel() * output.element_size(), n, async_op, output.device)


def _prepare_in_place(tensor, op, group, name):
    """Validate an in-place collective's tensor and op; this rank's (op, rank, n)."""
    check_tensor(tensor, "tensor", name)
    op = resolve_op(op, tensor.dtype, name)
    rank, n = group_info(group)
    return op, rank, n


def ring_all_reduce(
    tensor: torch.Tensor,
    op: Op = "sum",
    group: Group = None,
    async_op: bool = False,
    verify: Optional[bool] = None,
) -> Optional[CollectiveHandle]:
    """Like dist.all_reduce, in place, for any numel: a ring reduce-scatter then a ring
    all-gather over the (zero-padded) tensor, each rank sending 2(n-1)/n of the data; at or
    below DIRECT_MAX_BYTES the direct exchange instead (the same bits)."""
    name = "ring_all_reduce"
    op, rank, n = _prepare_in_place(tensor, op, group, name)
    numel = tensor.numel()
    header, box = _plan(name, op, tensor, numel, numel, numel * tensor.element_size(), (group, rank, n))
    divide_by = n if op == "avg" else 1

    def job():
        if header is not None:
            return _direct.all_reduce(box, header, tensor, divide_by)
        ring = ring_for(group, rank, n, tensor.device)
        _verify_and_check(verify, ring, name, op, tensor.dtype, numel, numel)
        if n == 1:
            return
        chunk = -(-numel // n)
        in_place = tensor.is_contiguous() and numel == chunk * n
        if in_place:
            flat = tensor.view(-1)
        else:  # pad (and make contiguous) in a cached workspace, copy back at the end
            flat = _buffer("pad", chunk * n, tensor)
            flat[:numel].view_as(tensor).copy_(tensor)
            flat[numel:].zero_()
        chunks = flat.view(n, -1).unbind(0)
        acc = _buffer("recv", (n - 1) * chunk, tensor)
        # One pass: gather steps start per piece as soon as that piece is reduced (and, for AVG,
        # divided: each rank divides only the chunk it owns, before it is gathered).
        ring_pass(ring, chunk, chunks, dict(enumerate(chunks)), acc, 0, 2 * n - 2, divide_by=divide_by)
        if not in_place:
            tensor.copy_(flat[:numel].view_as(tensor))

    return submit(job, name, rank, numel * tensor.element_size(), n, async_op, tensor.device)


def naive_all_reduce(
    tensor: torch.Tensor,
    op: Op = "sum",
    group: Group = None,
    async_op: bool = False,
    verify: Optional[bool] = None,
) -> Optional[CollectiveHandle]:
    """All-reduce the simple way: every rank sends its whole tensor to rank 0, which sums and
    sends the result back to each rank. Rank 0 moves 2(n-1) tensors, so it is the bottleneck;
    compare with ring_all_reduce, where every rank moves 2(n-1)/n."""
    name = "naive_all_reduce"
    op, rank, n = _prepare_in_place(tensor, op, group, name)

    def job():
        ring = ring_for(group, rank, n, tensor.device)
        _verify_and_check(verify, ring, name, op, tensor.dtype, tensor.numel(), tensor.numel())
        if n == 1 or tensor.numel() == 0:
            return
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        if rank == 0:
            received = _buffer("recv", work.numel(), work).view_as(work)
            for src in range(1, n):
                _work(dist.irecv(received, src=ring.to_global(src), group=group)).wait()
                work.add_(received)
            if op == "avg":
                work.div_(n)
            _link.sending([ring.to_global(d) for d in range(1, n)], work.numel() * work.element_size())
            sends = [_work(dist.isend(work, dst=ring.to_global(d), group=group)) for d in range(1, n)]
            for s in sends:
                s.wait()
        else:
            _link.sending([ring.to_global(0)], work.numel() * work.element_size())
            _work(dist.isend(work, dst=ring.to_global(0), group=group)).wait()
            _work(dist.irecv(work, src=ring.to_global(0), group=group)).wait()
        if work is not tensor:
            tensor.copy_(work)

    return submit(job, name, rank, tensor.numel() * tensor.element_size(), n, async_op, tensor.device)


def _work(work: Optional[Any]) -> Any:
    """A p2p call's Work (torch types it Optional: None off the group, which group_info refused)."""
    assert work is not None
    return work
