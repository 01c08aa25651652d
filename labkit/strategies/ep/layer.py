"""Expert parallelism for one MoE layer: its experts split over the ranks of an "ep" group, the
tokens sent to their experts' ranks and back with labkit's all-to-all.

    expert_parallel(moe, ep_group, data_group=None)    # keeps experts [r E/ep, (r+1) E/ep) here
    y = moe(h)                                         # h: this rank's tokens; y: theirs

Forward on each rank (moe.MoE.forward calls EPPlan.count_table, then experts_forward):
1. every data rank's per-expert counts, all-gathered over data_group (labkit's ring_all_gather,
   E int64 each): capacity, drops and the load-balancing loss are the global batch's (moe.py);
2. this rank's kept assignments, sorted by expert (so by owner rank, then token order), their
   tokens sent with all_to_all_autograd: input_split_sizes[q] = what it keeps for q's experts,
   output_split_sizes[q] = what rank q keeps for this rank's experts, both read off the gathered
   counts (moe.kept_counts), so no rank waits for another's sizes;
3. each local expert runs on the rows it received, from every source (in source order);
4. the outputs go back with the splits swapped, into their assignments' places; the gates are
   applied where the tokens live (moe.py), so the router's gradient stays local.
Backward is the autograd of the same: the all-to-alls' backwards are all-to-alls.

A rank holds only its experts' parameters: the others are `Remote` placeholders (no parameters),
so the state dict's keys keep their global expert numbers (experts.3.fc1.weight on the rank that
holds expert 3). The expert gradients are the sums over this ep group's tokens; over the replicas
(the ranks holding the same experts) the strategy sums them (labkit.strategies.ep.strategy).
Left out: capacity per device, overlapping the all-to-all with the experts' compute, grouped GEMMs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm.all_to_all import all_to_all_autograd, wire_bytes
from labkit.comm.collectives import group_info, ring_all_gather
from labkit.strategies.ep.moe import DispatchPlan, MoE

__all__ = ["EPPlan", "Remote", "a2a_bytes", "expert_parallel", "owner"]


class Remote(nn.Module):
    """An expert another rank holds (rank: its ep rank): no parameters here."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"this expert lives on ep rank {self.rank}; its tokens go there")


def owner(expert: int, n_experts: int, ep: int) -> int:
    """The ep rank that holds `expert`: consecutive blocks of E/ep experts per rank."""
    return expert // (n_experts // ep)


def _members(group: Any) -> list[int]:
    """The group's global ranks (one process outside torch.distributed: [0])."""
    if group is None:
        return list(range(dist.get_world_size())) if dist.is_initialized() else [0]
    return dist.get_process_group_ranks(group)


class EPPlan:
    """One MoE layer's place in the mesh: its ep group (experts split over it) and data group
    (the ranks whose tokens make the global batch, in data-rank order)."""

    def __init__(self, n_experts: int, ep_group: Any, data_group: Any) -> None:
        self.ep_group, self.data_group = ep_group, data_group
        self.ep_rank, self.ep = group_info(ep_group)
        if n_experts % self.ep:
            raise ValueError(f"expert_parallel: {n_experts} experts do not split over {self.ep} ep ranks")
        self.per = n_experts // self.ep
        self.local = range(self.ep_rank * self.per, (self.ep_rank + 1) * self.per)
        data = _members(data_group)
        me = dist.get_rank() if dist.is_initialized() else 0
        missing = [g for g in _members(ep_group) if g not in data]
        if me not in data or missing:
            raise ValueError(
                f"expert_parallel: every rank of the ep group must be in the data group (ranks {data}); "
                f"not: {missing or [me]}"
            )
        self.data_rank, self.data_size = data.index(me), len(data)
        self.ep_data = [data.index(g) for g in _members(ep_group)]  # each ep rank's data rank

    def count_table(self, counts: torch.Tensor) -> tuple[torch.Tensor, int]:
        """([data ranks, E] every data rank's pre-drop counts, this rank's row)."""
        with torch.no_grad():
            table = counts.new_empty(self.data_size * counts.numel())
            ring_all_gather(table, counts.contiguous(), group=self.data_group)
        return table.view(self.data_size, -1), self.data_rank

    def splits(self, kept: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """(send, recv, from_q) of one forward's dispatch, from the kept table [data ranks, E]:
        send[q] rows to ep rank q (this rank's kept assignments to q's experts), recv[q] rows from
        it, from_q[q, j] of them for local expert j."""
        per = self.per
        blocks = kept[:, : self.ep * per].view(kept.shape[0], self.ep, per)
        from_q = blocks[self.ep_data][:, self.ep_rank]
        return blocks[self.data_rank].sum(dim=1).tolist(), from_q.sum(dim=1).tolist(), from_q

    def experts_forward(
        self, moe: MoE, tokens: torch.Tensor, plan: DispatchPlan, kept: torch.Tensor
    ) -> torch.Tensor:
        """[N k, d]: each assignment's expert output (0 if dropped), the experts on their ranks."""
        k, per = moe.top_k, self.per
        expert, keep = plan.expert.reshape(-1), plan.kept.reshape(-1)
        mine = torch.nonzero(keep)[:, 0]
        sel = mine[torch.argsort(expert[mine], stable=True)]  # by expert: by owner, then token
        send, recv, from_q = self.splits(kept)
        got = all_to_all_autograd(tokens[sel // k], recv, send, self.ep_group)
        starts = (from_q.flatten().cumsum(0) - from_q.flatten()).view(self.ep, per).tolist()
        sizes = from_q.tolist()
        outs = torch.zeros_like(got)
        for j, e in enumerate(self.local):
            rows = [torch.arange(starts[q][j], starts[q][j] + sizes[q][j]) for q in range(self.ep)]
            index = torch.cat(rows).to(tokens.device)
            if index.numel():
                outs = outs.index_copy(0, index, moe.experts[e](got[index]))
        if got.requires_grad and not outs.requires_grad:  # no local expert ran: keep the
            outs = outs + 0 * got  # backward's all-to-alls, which the other ranks make too
        back = all_to_all_autograd(outs, send, recv, self.ep_group)
        return tokens.new_zeros(expert.numel(), tokens.shape[-1]).index_copy(0, sel, back)


def expert_parallel(moe: MoE, ep_group: Any = None, data_group: Any = None) -> MoE:
    """Split `moe`'s experts over `ep_group` (None: the world): this rank keeps its E/ep, the
    others become Remote; its tokens are routed with the all-to-all. data_group (None: the
    world): the ranks whose tokens together are the global batch (rank order = token order)."""
    if not isinstance(moe, MoE):
        raise TypeError(f"expert_parallel: expected a labkit.strategies.ep.MoE, got {type(moe).__name__}")
    if moe.ep is not None:
        raise ValueError("expert_parallel: this MoE layer is expert-parallel already")
    plan = EPPlan(moe.n_experts, ep_group, data_group)
    for e in range(moe.n_experts):
        if e not in plan.local:
            moe.experts[e] = Remote(owner(e, moe.n_experts, plan.ep))
    moe.ep = plan
    return moe


def a2a_bytes(moe: MoE, itemsize: int) -> int:
    """Bytes this rank sends in one forward + backward of `moe`'s last forward, by the formula:
    four all-to-alls (dispatch, combine, and their backwards, the splits swapped), each (ep-1)
    first messages (labkit.comm.all_to_all.wire_bytes) plus its rows to the other ep ranks: the
    dispatch's and the combine's backward send this rank's kept assignments for other ranks'
    experts, the combine and the dispatch's backward what it received from them, d_model
    elements a row."""
    plan = moe.ep
    if plan is None or moe.kept_table is None:
        raise ValueError("a2a_bytes: the layer is not expert-parallel, or has run no forward yet")
    send, recv, _ = plan.splits(moe.kept_table)
    row = moe.router.in_features * itemsize
    return 2 * (wire_bytes(send, plan.ep_rank, row) + wire_bytes(recv, plan.ep_rank, row))
