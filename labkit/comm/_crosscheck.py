"""The cross-rank check that runs before every labkit collective moves any data.

Every rank sends a small descriptor of its call (which collective, op, dtype, input and output
numel) straight to every other rank and receives theirs: one round of n-1 tiny point-to-point
messages per rank, in parallel, on a tag of its own. Every kind of collective starts with this
same exchange, so two ranks that called different collectives (all_reduce against
reduce_scatter, say) still meet here, see that the descriptors differ and raise the same error,
before the ring (whose messages would never match) starts.
Without it a mismatch hangs until the launcher's timeout or, worse, returns a silently wrong
tensor (SUM on one rank and AVG on another run the same ring).

Cost: one round of messages per collective (measured in benchmarks/collectives.py; the figures
are in labkit.comm.collectives' docstring).

Left out: a rank that makes no labkit call at all while the others make one still waits here
(that rank might only be slow; a short timeout would turn a loaded machine into false alarms),
and a call with verify=False on one rank but not on another still hangs (it skips the exchange).
"""
import torch
import torch.distributed as dist

CHECK_TAG = 0x6C6B   # ring steps use tags 0 … 2n-3 and the naive all-reduce 0: never matched here
KINDS = ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "naive_all_reduce")
_OPS = (None, "sum", "avg")
# Every dtype torch defines, in a fixed order: the same codes on every rank (same torch build).
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_FIELDS = 5          # kind, op, dtype, input numel, output numel


class CollectiveMismatchError(ValueError):
    """The ranks called different collectives (kind, op, dtype or size) at the same point."""


def describe(kind, op, dtype, numel_in, numel_out):
    """One call as the error message names it, e.g. ring_all_reduce(op=SUM, torch.float32, 8
    elements)."""
    parts = [] if op is None else [f"op={op.upper()}"]
    parts.append(str(dtype))
    if numel_in == numel_out:
        parts.append(f"{numel_in} elements")
    else:
        parts.append(f"{numel_in} elements in, {numel_out} out")
    return f"{kind}({', '.join(parts)})"


def _dtype_code(dtype):
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _dtype_name(code):
    return str(_DTYPES[code]) if code < len(_DTYPES) else "another dtype"


def mismatch_message(rows):
    """Name each rank's call (ranks with the same call share one entry)."""
    by_call = {}
    for rank, (kind, op, dtype, numel_in, numel_out) in enumerate(rows):
        call = describe(KINDS[kind], _OPS[op], _dtype_name(dtype), numel_in, numel_out)
        by_call.setdefault(call, []).append(rank)
    entries = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} called {call}"
               for call, ranks in by_call.items()]
    return ("collective mismatch: " + "; ".join(entries) + ". Every rank must make the same "
            "collective calls (kind, op, dtype, size), in the same order.")


def check_same_call(ring, kind, op, dtype, numel_in, numel_out):
    """Raise CollectiveMismatchError on every rank unless every rank of ring.group makes this
    same call now. `ring` is labkit.comm._ring.Ring; op is "sum", "avg" or None (all-gather)."""
    n, me = ring.world_size, ring.rank
    if n == 1:
        return
    i64 = dict(dtype=torch.int64, device=ring.device)
    table = torch.empty(n, _FIELDS, **i64)
    table[me] = torch.tensor([KINDS.index(kind), _OPS.index(op), _dtype_code(dtype),
                              numel_in, numel_out], **i64)
    peers = [r for r in range(n) if r != me]
    if ring.device.type == "cpu":
        # All non-blocking, so no order can deadlock; receives first, so a send leaves at once
        # (a gloo send waits for the peer's receive to be posted).
        works = [dist.irecv(table[r], src=ring.to_global(r), group=ring.group, tag=CHECK_TAG)
                 for r in peers]
        works += [dist.isend(table[me], dst=ring.to_global(r), group=ring.group, tag=CHECK_TAG)
                  for r in peers]
    else:   # NCCL: one batch, as separate isend/irecv around several peers can deadlock there
        ops = [dist.P2POp(dist.irecv, table[r], ring.to_global(r), ring.group) for r in peers]
        ops += [dist.P2POp(dist.isend, table[me], ring.to_global(r), ring.group) for r in peers]
        works = dist.batch_isend_irecv(ops)
    for work in works:
        work.wait()
    rows = table.tolist()
    if any(row != rows[0] for row in rows):
        raise CollectiveMismatchError(mismatch_message(rows))
