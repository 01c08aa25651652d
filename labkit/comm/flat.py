"""Collectives over flat buffers, built on labkit.comm.collectives' ring and direct exchange:

    reduce_scatter_padded / all_gather_padded   any numel: padded to N equal chunks (FSDP's convention,
                                                collectives.shard_range), the padding dropped again
    all_gather_coalesced                        several all-gathers as one collective (ZeRO-2's buckets)

Same semantics, checks and comm thread as the collectives they use; DIRECT_MAX_BYTES and
VERIFY_ACROSS_RANKS are collectives' (set them there).
"""

from typing import Optional, Sequence, Union

import torch

from . import _direct, _ring, collectives as C
from ._comm_thread import CollectiveHandle
from ._dispatch import (
    Group,
    Op,
    check,
    check_pair,
    check_tensor,
    direct_limit,
    group_info,
    plan,
    ring_for,
    submit,
    verify_on,
)

__all__ = ["reduce_scatter_padded", "all_gather_padded", "all_gather_coalesced"]


def reduce_scatter_padded(
    flat: torch.Tensor,
    op: Op = "sum",
    group: Group = None,
    async_op: bool = False,
    verify: Optional[bool] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, Optional[CollectiveHandle]]]:
    """Reduce-scatter a flat tensor of any numel: returns this rank's shard (a new tensor of
    ceil(numel / world_size) elements; see shard_range). With async_op=True: (shard, handle)."""
    name = "reduce_scatter_padded"
    check_tensor(flat, "flat", name)
    rank, n = group_info(group)
    numel = flat.numel()
    _, _, padded = C.shard_range(numel, rank, n)
    shard = torch.empty(padded // n, dtype=flat.dtype, device=flat.device)
    if padded == numel and flat.is_contiguous():
        handle = C.ring_reduce_scatter(shard, flat.view(-1), op, group, async_op, verify)
    else:
        full = torch.zeros(padded, dtype=flat.dtype, device=flat.device)
        full[:numel].copy_(flat.reshape(-1))
        handle = C.ring_reduce_scatter(shard, full, op, group, async_op, verify)
    return (shard, handle) if async_op else shard


def all_gather_padded(
    shard: torch.Tensor,
    numel: int,
    group: Group = None,
    async_op: bool = False,
    verify: Optional[bool] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, Optional[CollectiveHandle]]]:
    """Inverse of reduce_scatter_padded: gathers every rank's shard and drops the padding.
    Returns the full flat tensor of `numel` elements; with async_op=True: (full, handle)."""
    name = "all_gather_padded"
    check_tensor(shard, "shard", name)
    rank, n = group_info(group)
    _, _, padded = C.shard_range(numel, rank, n)
    if shard.numel() * n != padded:
        raise ValueError(
            f"{name}: a shard of {numel} elements over {n} ranks has "
            f"{padded // n} elements, got {shard.numel()}"
        )
    full = torch.empty(padded, dtype=shard.dtype, device=shard.device)
    handle = C.ring_all_gather(full, shard.reshape(-1).contiguous(), group, async_op, verify)
    return (full[:numel], handle) if async_op else full[:numel]


def all_gather_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    group: Group = None,
    async_op: bool = False,
    verify: Optional[bool] = None,
) -> Optional[CollectiveHandle]:
    """ring_all_gather(outputs[i], inputs[i]) for every i, as ONE collective (torch's
    all_gather_into_tensor_coalesced): the direct exchange sends consecutive inputs together, in
    one message per peer of at most DIRECT_MAX_BYTES, one round per message instead of one per
    pair, and nothing is gathered into a temporary (each piece is copied straight into place:
    ZeRO-2's buckets, whose chunks of a rank are not contiguous in the flat buffer). A pair whose
    input alone exceeds DIRECT_MAX_BYTES runs as a ring. One dtype and device."""
    name = "all_gather_coalesced"
    if not inputs or len(outputs) != len(inputs):
        raise ValueError(
            f"{name}: needs as many outputs as inputs (at least one), got {len(outputs)} and {len(inputs)}"
        )
    rank, n = group_info(group)
    for output, input in zip(outputs, inputs):
        check_pair(output, input, name)
        if output.numel() != n * input.numel():
            raise ValueError(
                f"{name}: an output has {output.numel()} elements but world_size × "
                f"its input = {n} × {input.numel()} = {n * input.numel()}"
            )
        if (input.dtype, input.device) != (inputs[0].dtype, inputs[0].device):
            raise TypeError(
                f"{name}: every tensor needs one dtype and device, got {input.dtype} "
                f"on {input.device} and {inputs[0].dtype} on {inputs[0].device}"
            )
    first, itemsize = inputs[0], inputs[0].element_size()
    direct_max = C.DIRECT_MAX_BYTES
    plans = []  # (indices, header, box): one message per peer each (header None: a ring)
    for run in _runs([t.numel() * itemsize for t in inputs], direct_limit(C.DIRECT_MAX_BYTES)):
        numel = sum(inputs[i].numel() for i in run)
        plans.append(
            (run, *plan(name, None, first, numel, n * numel, numel * itemsize, (group, rank, n), direct_max))
        )

    def job():
        for run, header, box in plans:
            outs, ins = [outputs[i] for i in run], [inputs[i] for i in run]
            if header is not None and box is not None:  # (one is None only with the other)
                _direct.all_gather(box, header, outs, ins)
                continue
            ring = ring_for(group, rank, n, first.device)
            numel = sum(t.numel() for t in ins)
            if verify_on(verify, C.VERIFY_ACROSS_RANKS):
                check(ring, name, None, first.dtype, numel, n * numel, C.DIRECT_MAX_BYTES)
            for output, input in zip(outs, ins):
                _ring.all_gather(ring, output, input)

    total = sum(t.numel() for t in inputs)
    return submit(job, name, rank, n * total * itemsize, n, async_op, first.device)


def _runs(sizes, limit):
    """Consecutive indices grouped so that each group's sizes add up to at most `limit`; an item
    over the limit (or any, with limit 0) is a group of its own."""
    runs: list[list[int]] = []
    size = 0
    for i, nbytes in enumerate(sizes):
        if runs and size + nbytes <= limit:
            runs[-1].append(i)
            size += nbytes
        else:
            runs.append([i])
            size = nbytes
    return runs
