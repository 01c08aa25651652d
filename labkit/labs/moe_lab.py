"""Mixture-of-experts lab helpers: the references of moe_lab's exercises (the router, the
dispatch plan, the all-to-all pair, the expert-parallel layer and its gradient sync), the
one-process MoE layer they are checked against, the measurements' rank functions, the at-scale
arithmetic and the tokens-per-expert figure.

    probs, idx, gates = route(logits, top_k)          softmax, top-k, gates renormalised
    load_balancing_loss(probs, idx, n_experts)        Switch's E · Σ_e f_e · P_e
    capacity(n_tokens, n_experts, top_k, factor)      ceil(factor · n_tokens · top_k / E)
    dest, slot, kept = dispatch_plan(idx, E, cap, ep) each assignment's rank, slot, kept or dropped
    received, plan = dispatch(x, dest, group)         rows sorted by rank, one all-to-all
    out = combine(y, plan, group)                     the reverse all-to-all, rows unsorted
    ep_forward(layer, x) / sync_grads(layer, dp)      the EP layer on a ("dp", "ep") mesh
    MoE(d, hidden, E, top_k, capacity_factor, seed)   one process: the layer the EP one must equal

Conventions (the checks' and the notebook's): tokens are rows (N, d); an assignment is one
(token, choice) pair, ordered token-major (token 0's choices, then token 1's ...), which is the
order in which slots fill, so with a capacity the later tokens are dropped; experts are placed in
contiguous blocks, rank r of the ep group holding experts [r·E/ep, (r+1)·E/ep); a dropped
assignment contributes nothing (the residual around the layer carries the token). Capacity
applies per source rank's tokens (GShard's "groups"): the one-process MoE takes `groups` to do
the same. The aux loss is Switch's, f_e the fraction of the N·k assignments routed to e (so a
uniform router scores 1.0), P_e the mean router probability; its gradient flows through P only.

Left out: the expert-parallel layer's overlap of the all-to-all with compute, a shared expert
(DeepSeek's), the router's z-loss, token dropping by score rather than position, and
load-balancing without an aux loss (DeepSeek-V3's bias). Float64 throughout (the checks compare
within 1e-10). The checks are moe_checks.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.comm import all_to_all_single
from labkit.comm.all_to_all import AllToAll
from labkit.strategies.ep import moe as ep_moe
from labkit.strategies.ep.layer import owner
from labkit.strategies.ep.moe import capacity, load_balancing_loss, route

DTYPE = torch.float64


# ---------------------------------------------------------------- exercise 1: the router
# route (softmax, top-k, renormalised gates), load_balancing_loss (E · Σ f_e · P_e) and capacity
# (exercise 2's) are labkit.strategies.ep.moe's, imported above: the strategy "ep" runs them.


# ---------------------------------------------------------------- exercise 2: the dispatch
def dispatch_plan(
    idx: torch.Tensor, n_experts: int, cap: int | None, ep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each assignment (N, k): the rank of the ep group that holds its expert (contiguous
    blocks of E/ep: ep.layer.owner), its slot in that expert's buffer (how many earlier
    assignments, token-major, went to the same expert) and whether it is kept (slot < cap; None:
    dropless): labkit.strategies.ep.moe.dispatch_plan's slot and kept."""
    plan = ep_moe.dispatch_plan(idx, n_experts, cap)
    return owner(idx, n_experts, ep), plan.slot, plan.kept


# ---------------------------------------------------------------- exercise 3: the all-to-all pair
# AllToAll.apply(x, output_split_sizes, input_split_sizes, group) is labkit.comm.all_to_all's:
# the all-to-all forward, the same with the splits swapped backward.


def exchange_counts(send: list[int], group: Any) -> list[int]:
    """How many rows each rank of the group will send this rank: an all-to-all of the counts."""
    out = torch.zeros(len(send), dtype=torch.int64)
    all_to_all_single(out, torch.tensor(send, dtype=torch.int64), group=group)
    return out.tolist()


def dispatch(x: torch.Tensor, dest: torch.Tensor, group: Any) -> tuple[torch.Tensor, tuple]:
    """Rows x (n, d) to the ranks dest (n,) of the group: sorted by destination (stable), one
    all-to-all with uneven splits. Returns the rows received (grouped by source rank, each
    source's in its order) and the plan (order, send, recv) that combine needs."""
    n = dist.get_world_size(group)
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=n).tolist()
    recv = exchange_counts(send, group)
    return AllToAll.apply(x[order], recv, send, group), (order, send, recv)


def combine(y: torch.Tensor, plan: tuple, group: Any) -> torch.Tensor:
    """The rows received back from the experts' ranks, in the order they were given to dispatch."""
    order, send, recv = plan
    back = AllToAll.apply(y, send, recv, group)
    return back[torch.argsort(order)]


# ---------------------------------------------------------------- the layer
class MoE(nn.Module):
    """One process's MoE layer (no residual): router Linear(d, E, no bias), E two-layer GELU
    experts stacked as w1 (E, d, h), w2 (E, h, d). forward(x (N, d), groups) applies the capacity
    per group of N/groups tokens (what each rank of an EP layer sees) and returns (y, aux)."""

    def __init__(self, d, hidden, n_experts, top_k=2, capacity_factor=None, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.router = nn.Parameter(torch.randn(n_experts, d, generator=g, dtype=DTYPE) / d**0.5)
        self.w1 = nn.Parameter(torch.randn(n_experts, d, hidden, generator=g, dtype=DTYPE) / d**0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, d, generator=g, dtype=DTYPE) / hidden**0.5)
        self.last: dict = {}

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.gelu(rows @ self.w1[e]) @ self.w2[e]

    def forward(self, x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        ys, auxes, drops = [], [], 0
        for xg in torch.chunk(x, groups):
            probs, idx, gates = route(xg @ self.router.T, self.top_k)
            cap = (
                None
                if self.capacity_factor is None
                else capacity(len(xg), self.n_experts, self.top_k, self.capacity_factor)
            )
            _, _, kept = dispatch_plan(idx, self.n_experts, cap, 1)
            y = torch.zeros_like(xg)
            for e in range(self.n_experts):
                tok, j = torch.nonzero((idx == e) & kept, as_tuple=True)
                y = y.index_add(0, tok, gates[tok, j, None] * self.expert(e, xg[tok]))
            ys.append(y)
            auxes.append(load_balancing_loss(probs, idx, self.n_experts))
            drops += int((~kept).sum())
        self.last = {"dropped": drops, "assignments": len(x) * self.top_k, "aux": [a.detach() for a in auxes]}
        return torch.cat(ys), torch.stack(auxes).mean()


class EPLayer(nn.Module):
    """This rank's part of `full` on an ep group: the router whole (replicated), the experts
    [first, first + E/ep) only. What the learner's ep_forward runs on."""

    def __init__(self, full: MoE, ep_group: Any):
        super().__init__()
        r, ep = dist.get_rank(ep_group), dist.get_world_size(ep_group)
        self.group, self.ep, self.n_experts, self.top_k = ep_group, ep, full.n_experts, full.top_k
        self.capacity_factor, self.local = full.capacity_factor, full.n_experts // ep
        self.first = r * self.local
        self.router = nn.Parameter(full.router.detach().clone())
        self.w1 = nn.Parameter(full.w1.detach()[self.first : self.first + self.local].clone())
        self.w2 = nn.Parameter(full.w2.detach()[self.first : self.first + self.local].clone())
        self.out_of_range: list = []

    def experts(self, rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        """Each received row through its expert (local index 0..E/ep-1). A row with another index
        comes out zero and its index is recorded in `out_of_range` (raising here, on some ranks
        only, would leave their peers waiting in the combine's all-to-all)."""
        bad = (local_expert < 0) | (local_expert >= self.local)
        self.out_of_range = sorted(set(local_expert[bad].tolist()))
        out = torch.zeros_like(rows)
        for e in range(self.local):
            at = torch.nonzero(local_expert == e, as_tuple=True)[0]
            out = out.index_copy(0, at, F.gelu(rows[at] @ self.w1[e]) @ self.w2[e])
        return out


def ep_forward(layer: EPLayer, x: torch.Tensor, dispatch_fn=dispatch, combine_fn=combine) -> tuple:
    """Exercise 4's reference: route, plan, send each kept assignment's row (and its expert's
    index) to the expert's rank, run the experts, send the outputs back, weight by the gates and
    sum per token. Returns (y, aux)."""
    probs, idx, gates = route(x @ layer.router.T, layer.top_k)
    cap = (
        None
        if layer.capacity_factor is None
        else capacity(len(x), layer.n_experts, layer.top_k, layer.capacity_factor)
    )
    dest, _, kept = dispatch_plan(idx, layer.n_experts, cap, layer.ep)
    tok, j = torch.nonzero(kept, as_tuple=True)
    rows, plan = dispatch_fn(x[tok], dest[tok, j], layer.group)
    experts, _ = dispatch_fn(idx[tok, j].to(DTYPE)[:, None], dest[tok, j], layer.group)
    out = combine_fn(layer.experts(rows, experts[:, 0].long() - layer.first), plan, layer.group)
    y = torch.zeros_like(x).index_add(0, tok, gates[tok, j, None] * out)
    return y, load_balancing_loss(probs, idx, layer.n_experts)


def sync_grads(layer: EPLayer, dp_group: Any) -> None:
    """After backward of each rank's mean loss: the router (replicated on every rank) summed over
    the world, the experts over the dp group (the ranks holding the same experts; the all-to-all's
    backward already brought back the ep peers' contributions), both divided by the world size."""
    world = dist.get_world_size()
    dist.all_reduce(layer.router.grad)
    layer.router.grad /= world
    for p in (layer.w1, layer.w2):
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= world
