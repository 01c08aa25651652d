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

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.comm import all_to_all_single
from labkit.comm.all_to_all import AllToAll
from labkit.strategies.ep import moe as ep_moe
from labkit.strategies.ep.moe import capacity, load_balancing_loss, route

if TYPE_CHECKING:  # matplotlib is imported by the figure helper only
    from matplotlib.figure import Figure

DTYPE = torch.float64


# ---------------------------------------------------------------- exercise 1: the router
# route (softmax, top-k, renormalised gates), load_balancing_loss (E · Σ f_e · P_e) and capacity
# (exercise 2's) are labkit.strategies.ep.moe's, imported above: the strategy "ep" runs them.


# ---------------------------------------------------------------- exercise 2: the dispatch
def dispatch_plan(
    idx: torch.Tensor, n_experts: int, cap: int | None, ep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each assignment (N, k): the rank of the ep group that holds its expert (contiguous
    blocks of E/ep: labkit.strategies.ep.layer.owner's rule), its slot in that expert's buffer (how many earlier
    assignments, token-major, went to the same expert) and whether it is kept (slot < cap; None:
    dropless): labkit.strategies.ep.moe.dispatch_plan's slot and kept."""
    plan = ep_moe.dispatch_plan(idx, n_experts, cap)
    return idx // (n_experts // ep), plan.slot, plan.kept  # ep.layer.owner's rule, per element


# ---------------------------------------------------------------- exercise 3: the all-to-all pair
# AllToAll.apply(x, output_split_sizes, input_split_sizes, group) is labkit.comm.all_to_all's:
# the all-to-all forward, the same with the splits swapped backward.


def exchange_counts(send: list[int], group: Any) -> list[int]:
    """How many rows each rank of the group will send this rank: an all-to-all of the counts.
    send holds one count per rank of the group (a ValueError names a list of another length: a
    bincount without minlength leaves out the ranks after the last one any row goes to)."""
    n = dist.get_world_size(group)
    if isinstance(send, torch.Tensor):
        send = send.tolist()
    if len(send) != n:
        raise ValueError(
            f"exchange_counts(send, group): send has {len(send)} count(s), the group {n} ranks "
            f"(send = {list(send)}): one count per rank of the group, 0 for a rank no row goes to "
            "(torch.bincount(dest, minlength=dist.get_world_size(group)))"
        )
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
        self.seen: list = []  # the local_expert tensors experts() was given, in order

    def experts(self, rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        """Each received row through its expert: local_expert is a tensor of local indices
        (0..E/ep-1), one per row. A row with another index comes out zero and its index is
        recorded in `out_of_range` (raising here, on some ranks only, would leave their peers
        waiting in the combine's all-to-all); every index given is kept in `seen` (the checks read
        them). A local_expert that is not such a tensor raises, naming what it takes."""
        if not isinstance(local_expert, torch.Tensor):
            raise TypeError(
                f"layer.experts(rows, local_expert): local_expert is a tensor of local expert indices, one "
                f"per row (shape ({len(rows)},), each 0..{self.local - 1}), got {type(local_expert).__name__} "
                f"{local_expert!r}; for every row through local expert i: torch.full((len(rows),), i)"
            )
        if local_expert.numel() != len(rows):
            raise ValueError(
                f"layer.experts(rows, local_expert): local_expert holds one local expert index per row, "
                f"{len(rows)} here, got shape {tuple(local_expert.shape)}"
            )
        local_expert = local_expert.reshape(-1)
        self.seen.append(local_expert.detach().clone())
        bad = (local_expert < 0) | (local_expert >= self.local)
        self.out_of_range = sorted(set(self.out_of_range) | set(local_expert[bad].tolist()))
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


# ---------------------------------------------------------------- measurements
MEASURE = dict(d=16, hidden=32, experts=4, top_k=2, tokens=48)  # per rank, 2 x 2 (dp, ep) mesh


def measure_ep(ep_forward_fn=ep_forward, sync_fn=sync_grads, size: dict = MEASURE) -> dict:
    """Rank function (4 ranks, a 2 x 2 ("dp", "ep") mesh): one forward and backward of the EP
    layer (dropless) with the tracer's window around the forward, what the plan sent where (rows
    per destination and per source, for the byte formula), and the parameter bytes this rank
    holds against the whole layer's."""
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.observe import tracing

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    full = MoE(size["d"], size["hidden"], size["experts"], size["top_k"], None, seed=11)
    layer = EPLayer(full, mesh.get_group("ep"))
    g = torch.Generator().manual_seed(12 + dist.get_rank())
    x = torch.randn(size["tokens"], size["d"], dtype=DTYPE, generator=g)
    _, idx, _ = route(x @ layer.router.detach().T, layer.top_k)
    dest = (idx // (layer.n_experts // layer.ep)).reshape(-1)
    dist.barrier()
    start = tracing.clock()
    y, aux = ep_forward_fn(layer, x)
    window = (start, tracing.clock())
    y.square().sum(-1).mean().backward()
    sync_fn(layer, mesh.get_group("dp"))
    return {
        "window": window,
        "send": torch.bincount(dest, minlength=layer.ep).tolist(),
        "ep_rank": dist.get_rank(layer.group),
        "param_bytes": {n: p.numel() * p.element_size() for n, p in layer.named_parameters()},
        "full_bytes": {n: p.numel() * p.element_size() for n, p in full.named_parameters()},
    }


def a2a_sent(trace: dict, window: tuple) -> list[int]:
    """Bytes this rank sent in each all-to-all that started inside `window` (the tracer's)."""
    return [
        (e.get("intra_bytes") or 0) + (e.get("inter_bytes") or 0)
        for e in trace["events"]
        if window[0] <= e["start"] < window[1] and e["op"] == "all_to_all_single"
    ]


def skewed_moe(size: dict = MEASURE, skew: float = 3.0, seed: int = 21) -> MoE:
    """A one-process MoE whose router starts biased towards expert 0 (its row scaled by `skew`
    along the inputs' mean direction): the imbalance the aux loss has to undo."""
    moe = MoE(size["d"], size["hidden"], size["experts"], size["top_k"], None, seed=seed)
    with torch.no_grad():
        moe.router[0] += skew * torch.ones(size["d"], dtype=DTYPE) / size["d"] ** 0.5
    return moe


def skewed_tokens(n: int, size: dict = MEASURE, seed: int = 22) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, size["d"], dtype=DTYPE, generator=g) + 0.5  # a mean the bias lines up with


def tokens_per_expert(moe: MoE, x: torch.Tensor) -> list[int]:
    """Assignments per expert (before any capacity), N·k in all."""
    _, idx, _ = route(x @ moe.router.detach().T, moe.top_k)
    return torch.bincount(idx.reshape(-1), minlength=moe.n_experts).tolist()


def train_aux(moe: MoE, x: torch.Tensor, steps: int, lr: float = 0.05) -> list[float]:
    """`steps` of Adam on the router alone, the aux loss alone (to isolate what it does): the
    aux loss after each step."""
    opt = torch.optim.Adam([moe.router], lr=lr)
    losses = []
    for _ in range(steps):
        probs, idx, _ = route(x @ moe.router.T, moe.top_k)
        loss = load_balancing_loss(probs, idx, moe.n_experts)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def dropped(counts: list[int], cap: int | None) -> int:
    """Assignments over capacity: Σ_e max(0, count_e - cap) (the formula the run checks)."""
    return 0 if cap is None else sum(max(0, c - cap) for c in counts)


def plot_tokens_per_expert(before: list[int], after: list[int], cap: int | None = None) -> "Figure":
    """One bar chart: assignments per expert before and after the aux loss trained the router."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    xs = range(len(before))
    ax.bar([x - 0.2 for x in xs], before, 0.4, label="before")
    ax.bar([x + 0.2 for x in xs], after, 0.4, label="after the aux loss trained")
    ax.axhline(sum(before) / len(before), color="k", ls=":", lw=1, label="even share")
    if cap is not None:
        ax.axhline(cap, color="r", ls="--", lw=1, label="capacity (factor 1.0)")
    ax.set_xticks(list(xs), [f"expert {e}" for e in xs])
    ax.set_ylabel("assignments")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    return fig


# ---------------------------------------------------------------- at scale
def a2a_time(n: int, bytes_per_rank: float, link: Any) -> float:
    """Seconds for one all-to-all in which each of n ranks holds `bytes_per_rank` spread evenly
    over the n ranks (it keeps 1/n): n - 1 messages of S/n each. On a TwoLevel link (n ranks in
    nodes of g) the (g - 1)/n of S that stays in the node goes over NVLink, the (n - g)/n that
    leaves over this GPU's NIC, one after the other (no overlap: a bound). Latency: one alpha per
    message. Left out: congestion, NCCL's per-peer channel limits."""
    from labkit.costmodel.links import Link

    if n <= 1:
        return 0.0
    if isinstance(link, Link):
        return (n - 1) * link.alpha_s + (n - 1) / n * bytes_per_rank / link.busbw_Bps
    g = min(n, link.gpus_per_node)
    intra = (g - 1) * link.intra.alpha_s + (g - 1) / n * bytes_per_rank / link.intra.busbw_Bps
    inter = (n - g) * link.inter.alpha_s + (n - g) / n * bytes_per_rank / link.inter.busbw_Bps
    return intra + inter


# Published figures (recorded, not measured). Mixtral: Jiang et al., "Mixtral of Experts",
# arXiv:2401.04088 (January 2024), sections 1-2 and table 1. DeepSeek-V3: DeepSeek-AI, "DeepSeek-V3
# Technical Report", arXiv:2412.19437 (December 2024), sections 2.1, 3.1 and 4.2: 61 layers, the
# first 3 dense; each MoE layer 1 shared + 256 routed experts, 8 routed per token; trained with
# 64-way expert parallelism across 8 nodes, 16-way pipeline parallelism and ZeRO-1 data parallelism on
# 2048 H800 GPUs (section 3.1). Both experts are SwiGLU MLPs: 3·d·hidden parameters.
MOE_MODELS = {
    "Mixtral-8x7B": dict(
        total=46.7e9,
        active=12.9e9,
        layers=32,
        moe_layers=32,
        d_model=4096,
        hidden=14336,
        experts=8,
        top_k=2,
        source="Jiang et al., Mixtral of Experts, arXiv:2401.04088, Jan 2024",
    ),
    "DeepSeek-V3": dict(
        total=671e9,
        active=37e9,
        layers=61,
        moe_layers=58,
        d_model=7168,
        hidden=2048,
        experts=256,
        top_k=8,
        source="DeepSeek-AI, DeepSeek-V3 Technical Report, arXiv:2412.19437, Dec 2024",
    ),
}


def split_params(m: dict) -> tuple[float, float]:
    """(routed expert parameters from the shape: moe_layers · E · 3·d·hidden, the rest)."""
    experts = m["moe_layers"] * m["experts"] * 3 * m["d_model"] * m["hidden"]
    return experts, m["total"] - experts


def active_params(m: dict) -> float:
    """What one token uses: the rest whole, k of E routed experts."""
    experts, rest = split_params(m)
    return rest + experts * m["top_k"] / m["experts"]


BYTES = 2  # bf16 weights, gradients and activations on the wire
STATE_BYTES = 16  # per parameter with mixed-precision Adam (ZeRO's 2 + 2 + 12)


def states_per_rank(m: dict, n: int, ep: int) -> float:
    """Model-state bytes per rank on n ranks: ep = 1 plain FSDP of everything over n; ep > 1 the
    experts split over ep and everything FSDP over dp = n / ep (the same n ranks)."""
    experts, rest = split_params(m)
    return STATE_BYTES * (rest + experts / ep) / (n // ep)


def step_bytes(m: dict, n: int, ep: int, tokens: float) -> dict:
    """Bytes one rank sends in one training step: FSDP's all-gather (forward, backward) and
    reduce-scatter of what it shards, 3·(dp-1)/dp·BYTES per parameter; with ep > 1 the four
    all-to-alls per MoE layer (dispatch and combine, forward and backward) of its tokens' k copies,
    (ep-1)/ep of which leave the rank."""
    experts, rest = split_params(m)
    dp = n // ep
    fsdp = 3 * (dp - 1) / dp * BYTES * (rest + experts / ep)
    a2a = 4 * m["moe_layers"] * tokens * m["top_k"] * m["d_model"] * BYTES * (ep - 1) / ep if ep > 1 else 0.0
    return {"fsdp": fsdp, "a2a": a2a, "total": fsdp + a2a}


def crossover_tokens(m: dict, n: int, ep: int) -> float:
    """Tokens per rank per step below which EP x FSDP sends fewer bytes than FSDP over n."""
    per_token = step_bytes(m, n, ep, 1.0)["a2a"]
    return (step_bytes(m, n, 1, 0)["total"] - step_bytes(m, n, ep, 0)["total"]) / per_token
