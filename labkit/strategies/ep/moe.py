"""A mixture-of-experts layer for TinyGPT's MLP slot, and its pieces as plain functions.

    probs, topk_idx, gates = route(router_logits, top_k=2)   # softmax over E, top-k, renormalised
    aux = load_balancing_loss(probs, topk_idx, n_experts)    # Switch Transformer's E * sum f_e P_e
    cap = capacity(n_tokens, n_experts, top_k, 1.25)         # ceil(k T / E * cf) slots per expert
    plan = dispatch_plan(topk_idx, n_experts, cap)           # expert, slot, kept, dropped
    moe = MoE(d_model=64, d_hidden=256, n_experts=4, top_k=2, capacity_factor=None, seed=0)
    y = moe(h)                                               # h [..., d_model]; moe.aux_loss

Conventions (the reference's; labkit.strategies.ep.layer's expert-parallel forward keeps them):
- an assignment is one (token, choice) pair, in token-major order: token t's choice 0, 1, …,
  k-1, then token t+1's; tokens are the input's rows flattened (batch, then position);
- capacity: each expert takes at most `capacity` assignments, first come (in that order) first
  served; a dropped assignment contributes 0 and the token keeps its other gates as they were
  (not renormalised): the residual connection around the layer carries it, as in Switch /
  GShard. capacity_factor=None is dropless: every assignment is kept;
- the load-balancing loss is counted over the whole global batch: f_e is the fraction of the
  (pre-drop) assignments that chose e, P_e the mean router probability of e; E sum_e f_e P_e is 1
  when perfectly balanced. The layer stores it (aux_loss) and TinyGPT adds aux_loss_coef times
  it to the loss (loss_term(): in the summed-loss form the loop uses);
- under expert parallelism (an `ep` plan set by labkit.strategies.ep.layer.expert_parallel) the
  counts of every data rank are gathered first, so capacity, drops and f_e are those of the
  global batch in its order (data rank 0's tokens first), equal to one process's.
  Real systems count capacity per device (GShard's groups); that is left out, so that the split
  changes nothing. Also left out: noisy / jittered routing, expert choice, shared experts,
  the router z-loss.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.models import GPTConfig

__all__ = [
    "DispatchPlan",
    "Expert",
    "MoE",
    "capacity",
    "dispatch_plan",
    "kept_counts",
    "load_balancing_loss",
    "moe_mlp",
    "route",
]


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [N, E]: softmax of the router's logits over the experts; topk_idx [N, k]: each token's
    k experts, most probable first; gates [N, k]: their probabilities renormalised to sum to 1)."""
    n_experts = logits.shape[-1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"route: top_k must be an int in 1..{n_experts} (the experts), got {top_k!r}")
    probs = F.softmax(logits, dim=-1)
    top, topk_idx = probs.topk(top_k, dim=-1)
    return probs, topk_idx, top / top.sum(dim=-1, keepdim=True)


def _aux(prob_sums: torch.Tensor, counts: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """E sum_e f_e P_e with P_e = prob_sums[e] / n_tokens, f_e = counts[e] / counts.sum()."""
    if n_tokens == 0:
        return prob_sums.sum() * 0
    f = counts.to(prob_sums.dtype) / counts.sum()
    return prob_sums.shape[-1] * (f * prob_sums).sum() / n_tokens


def load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over these tokens: E * sum_e f_e * P_e, f_e the fraction
    of the token-assignments (topk_idx, before any drop) that chose e, P_e the mean of probs[:, e]
    (over tokens: axis 0). Differentiable through P only (f is a count)."""
    if probs.shape[-1] != n_experts:
        raise ValueError(f"load_balancing_loss: probs has {probs.shape[-1]} experts, not {n_experts}")
    probs = probs.reshape(-1, n_experts)
    counts = torch.bincount(topk_idx.reshape(-1), minlength=n_experts)
    return _aux(probs.sum(dim=0), counts, probs.shape[0])


def capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(top_k * n_tokens / n_experts * capacity_factor), computed exactly
    (the factor read as the decimal written: 1.1 is 11/10), so 1.25 on 64 tokens, k=2, E=4 is 40."""
    for name, v in (("n_tokens", n_tokens), ("n_experts", n_experts), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "n_tokens" else 1):
            raise ValueError(
                f"capacity: {name} must be an int >= {0 if name == 'n_tokens' else 1}, got {v!r}"
            )
    if (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, (int, float))
        or not capacity_factor > 0
    ):
        raise ValueError(
            f"capacity: capacity_factor must be a number > 0 (None, dropless, has no capacity), got {capacity_factor!r}"
        )
    return math.ceil(Fraction(top_k * n_tokens, n_experts) * Fraction(repr(float(capacity_factor))))


class DispatchPlan(NamedTuple):
    """Per assignment ([N, k], token-major): its expert, its slot in that expert (0, 1, …: the
    order it arrives in), kept (slot < capacity); dropped: how many were not kept."""

    expert: torch.Tensor
    slot: torch.Tensor
    kept: torch.Tensor
    dropped: int


def dispatch_plan(
    topk_idx: torch.Tensor, n_experts: int, capacity: Optional[int], offsets: Optional[torch.Tensor] = None
) -> DispatchPlan:
    """Where each assignment goes: expert topk_idx, slot = how many assignments to that expert came
    before it (token-major order; plus offsets[e], the assignments of earlier data ranks, under
    expert parallelism), kept while slot < capacity (None: dropless, all kept)."""
    flat = topk_idx.reshape(-1)
    if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < n_experts):
        raise ValueError(f"dispatch_plan: topk_idx holds experts outside 0..{n_experts - 1}")
    one_hot = F.one_hot(flat, n_experts)
    slot = (one_hot.cumsum(dim=0) - 1).gather(1, flat[:, None])[:, 0]
    if offsets is not None:
        slot = slot + offsets.to(slot.dtype)[flat]
    kept = torch.ones_like(flat, dtype=torch.bool) if capacity is None else slot < capacity
    shape = topk_idx.shape
    return DispatchPlan(flat.view(shape), slot.view(shape), kept.view(shape), int((~kept).sum()))


class Expert(nn.Module):
    """One expert: TinyGPT's MLP, fc1 (d -> hidden), GELU, fc2 (hidden -> d)."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """The MoE layer (the module docstring): router nn.Linear(d, E, bias=False), E Experts, top-k
    gating. forward(h [..., d]) -> [..., d]; after it: aux_loss (this rank's share of the global
    batch's load-balancing loss: the whole of it in one process), tokens_per_expert (the global
    pre-drop assignments per expert), kept_per_expert, kept_table ([data ranks, E]: kept assignments
    per data rank and expert), dropped (global), capacity (None: dropless)."""

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        n_experts: int,
        top_k: int = 2,
        capacity_factor: Optional[float] = None,
        aux_loss_coef: float = 0.01,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1:
            raise ValueError(f"MoE: n_experts must be an int >= 1, got {n_experts!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE: top_k must be an int in 1..n_experts={n_experts}, got {top_k!r}")
        if capacity_factor is not None:
            capacity(1, n_experts, top_k, capacity_factor)  # its checks
        if (
            isinstance(aux_loss_coef, bool)
            or not isinstance(aux_loss_coef, (int, float))
            or aux_loss_coef < 0
        ):
            raise ValueError(f"MoE: aux_loss_coef must be a number >= 0, got {aux_loss_coef!r}")
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor, self.aux_loss_coef = capacity_factor, float(aux_loss_coef)
        with torch.random.fork_rng(devices=[]):
            self.router = nn.Linear(d_model, n_experts, bias=False)
            self.experts = nn.ModuleList(Expert(d_model, d_hidden) for _ in range(n_experts))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(
                    torch.zeros_like(p)
                    if name.endswith("bias")
                    else torch.randn(p.shape, generator=generator) * 0.02
                )
        self.ep: Any = None  # set by labkit.strategies.ep.layer.expert_parallel
        self.aux_loss: Optional[torch.Tensor] = None
        self.tokens_global = 0
        self.tokens_per_expert: Optional[torch.Tensor] = None
        self.kept_per_expert: Optional[torch.Tensor] = None
        self.kept_table: Optional[torch.Tensor] = None  # [data ranks, E]: kept per rank and expert
        self.dropped = 0
        self.capacity: Optional[int] = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        tokens = h.reshape(-1, shape[-1])
        probs, topk_idx, gates = route(self.router(tokens), self.top_k)
        counts = torch.bincount(topk_idx.reshape(-1), minlength=self.n_experts)
        # Every data rank's counts (one process: its own), in data-rank order.
        table, me = (counts[None], 0) if self.ep is None else self.ep.count_table(counts)
        total = table.sum(dim=0)
        n_tokens = int(total.sum()) // self.top_k
        cap = (
            None
            if self.capacity_factor is None
            else capacity(n_tokens, self.n_experts, self.top_k, self.capacity_factor)
        )
        plan = dispatch_plan(topk_idx, self.n_experts, cap, offsets=table[:me].sum(dim=0))
        self.capacity, self.tokens_global, self.tokens_per_expert = cap, n_tokens, total
        kept = kept_counts(table, cap)
        self.kept_table, self.kept_per_expert = kept, kept.sum(dim=0)
        self.dropped = int((table - kept).sum())
        self.aux_loss = _aux(probs.sum(dim=0), total, n_tokens)
        if self.ep is None:
            outs = self._local(tokens, plan)
        else:
            outs = self.ep.experts_forward(self, tokens, plan, kept)
        # Per assignment, its expert's output (0 if dropped) times its gate; summed over the k
        # choices in order, the same order in every layout.
        y = (outs.view(*gates.shape, -1) * gates[..., None]).sum(dim=1)
        return y.view(shape)

    def _local(self, tokens: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Every expert here: each runs on its kept assignments' tokens (in slot order)."""
        k = self.top_k
        expert, kept = plan.expert.reshape(-1), plan.kept.reshape(-1)
        outs = tokens.new_zeros(expert.numel(), tokens.shape[-1])
        for e, module in enumerate(self.experts):
            mine = torch.nonzero((expert == e) & kept)[:, 0]
            if mine.numel():
                outs = outs.index_copy(0, mine, module(tokens[mine // k]))
        return outs

    def loss_term(self) -> torch.Tensor:
        """What the summed loss gains: aux_loss_coef * aux_loss * the global token count (divided
        by that count, as the loop does, it is aux_loss_coef times this rank's share of the loss)."""
        if self.aux_loss is None:
            raise RuntimeError("MoE.loss_term: no forward yet")
        return self.aux_loss_coef * self.aux_loss * self.tokens_global


def kept_counts(table: torch.Tensor, cap: Optional[int]) -> torch.Tensor:
    """[R, E]: how many of data rank r's assignments to e are kept, first come first served in
    data-rank order (table: every rank's pre-drop counts)."""
    if cap is None:
        return table
    before = table.cumsum(dim=0) - table
    return (cap - before).clamp(min=0).minimum(table)


def moe_mlp(config: GPTConfig) -> MoE:
    """TinyGPT's MLP slot as a MoE layer (GPTConfig's n_experts, top_k, capacity_factor,
    aux_loss_coef; each expert mlp_ratio * d_model wide): the factory loop.build_model passes."""
    return MoE(
        config.d_model,
        config.mlp_ratio * config.d_model,
        config.n_experts,
        top_k=config.top_k,
        capacity_factor=config.capacity_factor,
        aux_loss_coef=config.aux_loss_coef,
    )
