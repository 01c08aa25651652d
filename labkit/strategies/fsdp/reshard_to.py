"""FSDP2's reshard_after_forward=<int> by hand: after forward, reshard a unit to groups of k
consecutive ranks (a node) instead of freeing it, so backward re-gathers it within the group.

    fully_shard_by_hand(block, reshard_after_forward=2)   # 4 ranks: keep 1/2 after forward

After the unit's forward each rank keeps, of the gathered (N, chunk) pieces, the N/k rows of its
place l in its group (rank r: group r // k, l = r % k): 1/k of the unit, where True keeps 1/N
and False all of it. The pre-backward all-gather runs in the group only (k pieces of N/k rows
rebuild the N rows), so on a two-level network it never crosses nodes: the middle point between
resharding fully (3 collectives across all N per step) and not at all (the unit's memory). Gradients are
reduce-scattered over all N as always. k must divide N, 1 < k < N (torch's rule; k = N or 1 is
True / False); the group is the default one (not with an HSDP mesh: that reshards to its node
already). Left out: prefetching the group's all-gather (it runs when the unit's backward starts).
"""

from typing import Any, Union

import torch
import torch.distributed as dist


_subgroups: dict[tuple, Any] = {}


def check(value: Union[bool, int], group: Any, replicate: Any) -> Union[bool, int]:
    """reshard_after_forward as given: a bool, or a valid int (raises otherwise)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward must be a bool or an int, got {value!r}")
    n = dist.get_world_size(group)
    if replicate is not None or (group is not None and n != dist.get_world_size()):
        raise ValueError("reshard_after_forward=<int> needs the default group (no HSDP mesh)")
    if not 1 < value < n or n % value:
        raise ValueError(
            f"reshard_after_forward={value}: an int must divide the {n} ranks and "
            f"lie strictly between 1 and {n} (True / False are the ends)"
        )
    return value


def subgroup(k: int) -> Any:
    """This rank's group of k consecutive ranks (made once per k; a collective the first time)."""
    key = (k, id(dist.group.WORLD))
    if key not in _subgroups:
        _subgroups[key] = dist.new_subgroups(group_size=k)[0]
    return _subgroups[key]


def reshard_to(unit: Any, k: int) -> None:
    """After forward: keep this rank's N/k rows of every parameter's pieces, free the rest."""
    n, rank = unit.world_size, unit.rank
    rows = n // k
    lo = (rank % k) * rows
    kept = torch.empty((rows, unit.layout.chunk), dtype=unit.layout.dtype, device=unit.device)
    for i, p in enumerate(unit.params):
        unit.layout.piece(kept, i).copy_(p.padded_full.view(n, p.numel)[lo : lo + rows])
    unit.ctx.observe("tag", "all_gather", kept)
    unit.reshard()
    unit.kept, unit.state = kept, "resharded_to_group"


def unshard_from(unit: Any, k: int) -> None:
    """Before backward: all-gather the kept rows within the group, refill every parameter."""
    full = torch.empty((unit.world_size, unit.layout.chunk), dtype=unit.layout.dtype, device=unit.device)
    unit.ctx.comm.all_gather(full.view(-1), unit.kept.view(-1), group=subgroup(k))
    unit.kept = None
    for i, p in enumerate(unit.params):
        p.copy_out(unit.layout.piece(full, i))
    unit.gathers += 1
    unit.ctx.gathers += 1
    unit.state = "unsharded"
