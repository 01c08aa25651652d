"""Sequence- and context-parallel lab helpers: the references of seq_lab's exercises (SP's
conjugate pair along the sequence, the exact merge of two partial attentions, ring attention's
forward, the zigzag assignment), the blocks and rank functions of its measurements, and the
figure of the ring's steps.

    gather_seq(x, group) / scatter_seq(x, group)     SP's pair: all-gather fwd / reduce-scatter bwd,
                                                     and reduce-scatter fwd / all-gather bwd (dim 1)
    o, lse = block_attention(q, k, v, causal)        one block of attention and its log-sum-exp
    o, lse = merge(o1, lse1, o2, lse2)               two partials of the same queries, exactly
    ring_attention(q, k, v, causal, group)           contiguous layout, K/V round a ring (isend/irecv)
    chunked_ring(q, k, v, positions, group)          any layout, causal, work per (q, k) chunk pair

Shapes: activations (B, T, d), sequence dim 1; attention (B, H, T, D), sequence dim 2. Float64
throughout (the checks compare within 1e-12). What this leaves out: a hand-written backward for
ring attention (autograd over the ring's steps here, which keeps every received K/V block for
backward: the real one re-circulates K/V in backward and keeps 1/cp), dropout, overlap of the
send with the block's compute (the isend is posted before the compute and waited after, which is
the overlap on a GPU; on gloo CPU ranks it only orders the messages). The checks are seq_checks.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.comm.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from labkit.strategies.tp import copy_to_tp, reduce_from_tp

if TYPE_CHECKING:  # matplotlib is imported by the figure helper only
    from matplotlib.figure import Figure

DTYPE = torch.float64
SP_SIZE = dict(batch=2, d=16, hidden=32)  # the SP block of the measurements (seq varies)
ATTN = dict(batch=1, heads=2, head_dim=3, seq=24)  # 24 tokens: 6 / 12 per rank, zigzag chunks of 3 / 6


# ---------------------------------------------------------------- exercise 1: SP's pair
def _seq_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).contiguous()


def _all_gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    n = dist.get_world_size(group)
    xt = _seq_first(x)  # labkit's collectives concatenate along dim 0: the sequence goes first
    out = xt.new_empty((n * xt.shape[0], *xt.shape[1:]))
    ring_all_gather(out, xt, group=group)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    n = dist.get_world_size(group)
    xt = _seq_first(x)
    if xt.shape[0] % n:
        raise ValueError(f"a sequence of {xt.shape[0]} does not split over {n} ranks")
    out = xt.new_empty((xt.shape[0] // n, *xt.shape[1:]))
    ring_reduce_scatter(out, xt, op="sum", group=group)
    return out.transpose(0, 1).contiguous()


class GatherSeq(torch.autograd.Function):
    """Megatron-SP's g: all-gather along the sequence forward, reduce-scatter (sum) backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class ScatterSeq(torch.autograd.Function):
    """Megatron-SP's g-bar: reduce-scatter (sum) along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


def gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Exercise 1's reference: (B, T/n, d) on each rank -> the whole (B, T, d)."""
    return GatherSeq.apply(x, group)


def scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Exercise 1's reference: partial sums (B, T, d) -> this rank's piece of their sum (B, T/n, d)."""
    return ScatterSeq.apply(x, group)


# ---------------------------------------------------------------- the SP block
class MLPBlock(nn.Module):
    """Pre-LN MLP sub-block: x + fc2(gelu(fc1(ln(x)))), the part of a layer SP changes."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def make_block(d: int = 5, hidden: int = 8, seed: int = 0) -> MLPBlock:
    torch.manual_seed(seed)
    return MLPBlock(d, hidden).to(DTYPE)


SP_PLAN_NAMES = {"ln": "SequenceParallel", "fc1": "ColwiseParallel(input_layouts=Shard(1))"}


def torch_sp_block(block: MLPBlock, tp_mesh: Any) -> MLPBlock:
    """The oracle: torch's parallelize_module with SequenceParallel on the norm,
    ColwiseParallel(input_layouts=Shard(1)) on fc1, RowwiseParallel(output_layouts=Shard(1)) on
    fc2. Its forward takes and returns this rank's (B, T/n, d) piece."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "ln": SequenceParallel(),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    }
    return parallelize_module(block, tp_mesh, plan)


class HandBlock(nn.Module):
    """The block by hand, TP (sp=False: the norm on the whole sequence, f / g all-reduces) or TP
    + SP (sp=True: the norm on this rank's piece of the sequence, gather before fc1, scatter after
    fc2). fc1 keeps torch.chunk's rows, fc2 its columns and the whole bias (added once, after the
    sum). With SP the norm's parameters see only this rank's tokens: their gradients are summed
    over the group after backward (`sync_norm_grads`), as Megatron does."""

    def __init__(self, block: MLPBlock, group: Any, sp: bool, gather=gather_seq, scatter=scatter_seq):
        super().__init__()
        rank, n = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.sp, self.gather, self.scatter = group, sp, gather, scatter
        self.ln = nn.LayerNorm(block.ln.normalized_shape).to(DTYPE)
        self.ln.load_state_dict(block.ln.state_dict())
        self.w1 = nn.Parameter(torch.chunk(block.fc1.weight.detach(), n, 0)[rank].clone())
        self.b1 = nn.Parameter(torch.chunk(block.fc1.bias.detach(), n)[rank].clone())
        self.w2 = nn.Parameter(torch.chunk(block.fc2.weight.detach(), n, 1)[rank].clone())
        self.b2 = nn.Parameter(block.fc2.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        h = self.gather(h, self.group) if self.sp else copy_to_tp(h, self.group)
        h = F.linear(F.gelu(F.linear(h, self.w1, self.b1)), self.w2)
        h = self.scatter(h, self.group) if self.sp else reduce_from_tp(h, self.group)
        return x + h + self.b2

    def sync_replicated_grads(self) -> None:
        if self.sp:
            for p in (*self.ln.parameters(), self.b2):
                if p.grad is not None:
                    ring_all_reduce(p.grad, op="sum", group=self.group)


def saved_bytes(fn: Callable, *args: Any, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn(*args) runs (the
    activation memory a forward keeps), leaving out the storages of `exclude` (the parameters)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def sp_input(batch: int, seq: int, d: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, seq, d, dtype=DTYPE, generator=torch.Generator().manual_seed(seed))


def measure_sp_cp(seqs: list, gather=gather_seq, scatter=scatter_seq, size: dict = SP_SIZE) -> dict:
    """Rank function (2 ranks): for each sequence length T, (1) one forward + backward of the MLP
    sub-block under TP and under TP + SP (every collective a ring), the trace windows of each and
    the bytes the norm saved; (2) the bytes the whole sub-block saves on one process and on this
    rank under CP (each rank its T/2 tokens, the weights whole)."""
    from labkit.comm import collectives
    from labkit.observe import tracing

    collectives.DIRECT_MAX_BYTES = 0
    group, rank, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    B, d, H = size["batch"], size["d"], size["hidden"]
    full = make_block(d, H)
    out: dict = {"windows": {}, "norm_saved": {}, "block_saved": {}}
    for T in seqs:
        x = sp_input(B, T, d)
        for sp in (False, True):
            hand = HandBlock(full, group, sp, gather, scatter)
            xin = (torch.chunk(x, n, 1)[rank] if sp else x).clone().requires_grad_()
            out["norm_saved"][("SP" if sp else "TP", T)] = saved_bytes(
                hand.ln, xin, exclude=hand.ln.parameters()
            )
            dist.barrier()
            start = tracing.clock()
            hand(xin).square().sum().backward()
            out["windows"][("SP" if sp else "TP", T)] = (start, tracing.clock())
        for label, xin in (("one process", x), ("CP", torch.chunk(x, n, 1)[rank])):
            xin = xin.clone().requires_grad_()
            out["block_saved"][(label, T)] = saved_bytes(full, xin, exclude=full.parameters())
    return out


def sent_in(trace: dict, window: tuple) -> dict:
    """{op: (calls, tensor bytes, bytes this rank sent)} of the hand-written collectives that
    started inside `window` (the tensor bytes: the whole all-gathered / reduce-scattered tensor)."""
    out: dict = {}
    for e in trace["events"]:
        if window[0] <= e["start"] < window[1] and e["op"].startswith("ring_"):
            calls, nbytes, sent = out.get(e["op"], (0, 0, 0))
            out[e["op"]] = (calls + 1, nbytes + e["nbytes"], sent + (e.get("intra_bytes") or 0))
    return out


def ring_share(op: str, n: int) -> float:
    """The fraction of the tensor a ring collective makes each rank send: reduce-scatter and
    all-gather (n-1)/n, all-reduce (their sum) 2(n-1)/n."""
    return (2 if op == "ring_all_reduce" else 1) * (n - 1) / n


# ---------------------------------------------------------------- exercise 2: the merge
def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ / √D) v for one block of keys, and the log-sum-exp of each query's scores
    (B, H, Tq): what the merge needs. causal=True: the diagonal block (q and k the same
    positions): query i sees keys 0..i. mask (Tq, Tk) bool, True = seen, instead. Every query
    must see at least one key (a fully masked row has lse -inf and no output)."""
    if causal and mask is not None:
        raise ValueError("give causal=True or a mask, not both")
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(f"causal=True is the diagonal block: {q.shape[-2]} queries, {k.shape[-2]} keys")
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 2's reference: the attention of the queries over both blocks of keys, from each
    block's normalized output and log-sum-exp. Shifted by the larger lse (no overflow); an empty
    partial (o 0, lse -inf) leaves the other unchanged."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    o = (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / total.unsqueeze(-1)
    return o, m + torch.log(total)


# ---------------------------------------------------------------- exercise 3: the ring
def ring_neighbours(group: Any) -> tuple[int, int, int, int]:
    """(this rank's index in the group, group size, global rank of the next, of the previous)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    return r, n, dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, group: Any, merge_fn=merge
) -> torch.Tensor:
    """Exercise 3's reference, contiguous layout (rank r holds positions [rT/n, (r+1)T/n)): at
    step s this rank holds the K/V of rank j = (r - s) mod n; causal: j == r is the diagonal
    block (masked), j < r is seen whole, j > r is skipped (all in the future). The K/V go on to
    the next rank while this one computes: isend of the block held, irecv into a fresh buffer."""
    r, n, nxt, prv = ring_neighbours(group)
    kv = torch.stack([k, v]).contiguous()  # one message per step
    o = lse = None
    for s in range(n):
        j = (r - s) % n
        reqs = []
        if s < n - 1:
            incoming = torch.empty_like(kv)  # never receive into the block being sent
            reqs = [dist.isend(kv, dst=nxt, group=group), dist.irecv(incoming, src=prv, group=group)]
        if not causal or j <= r:
            part = block_attention(q, kv[0], kv[1], causal=causal and j == r)
            o, lse = part if o is None else merge_fn(o, lse, *part)
        for req in reqs:
            req.wait()
        if s < n - 1:
            kv = incoming
    assert o is not None
    return o


# ---------------------------------------------------------------- exercise 4: zigzag
def contiguous_positions(rank: int, n: int, T: int) -> torch.Tensor:
    if T % n:
        raise ValueError(f"a sequence of {T} does not split over {n} ranks")
    return torch.arange(rank * T // n, (rank + 1) * T // n)


def zigzag_positions(rank: int, n: int, T: int) -> torch.Tensor:
    """Exercise 4's reference: the sequence in 2n chunks of T/(2n), rank r holds chunk r then
    chunk 2n-1-r (the global positions, in that order)."""
    if T % (2 * n):
        raise ValueError(f"zigzag cuts the sequence in 2n = {2 * n} chunks: {T} does not split")
    c = T // (2 * n)
    return torch.cat([torch.arange(r * c, (r + 1) * c) for r in (rank, 2 * n - 1 - rank)])


def causal_pairs(q_pos, k_pos) -> int:
    """Exercise 4's reference: the (query, key) pairs causal attention computes, key <= query."""
    q, k = torch.as_tensor(q_pos), torch.as_tensor(k_pos)
    return int((k[None, :] <= q[:, None]).sum())


LAYOUTS = {"contiguous": contiguous_positions, "zigzag": zigzag_positions}


def _pieces(length: int, chunks: int) -> list[tuple[int, int]]:
    """(start, end) of each of `chunks` equal pieces of a rank's `length` positions."""
    c = length // chunks
    return [(i * c, (i + 1) * c) for i in range(chunks)]


def chunked_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: Callable,
    group: Any,
    chunks: int,
    merge_fn=merge,
    record: list | None = None,
) -> torch.Tensor:
    """Causal ring attention for any layout: positions(rank, n, T) are the global positions each
    rank holds, in `chunks` equal chunks (contiguous 1, zigzag 2; zigzag's middle ranks hold two
    adjacent chunks, still two). Each step splits this rank's queries and the held K/V into their chunks and, per
    (query chunk, key chunk) pair, skips it (every key after every query), masks it (the two
    overlap: the diagonal) or computes it whole. record: one dict per step appended, {"src": the
    K/V's rank, "flops": matmul FLOPs of the step, counted by torch's FlopCounterMode}."""
    from torch.utils.flop_counter import FlopCounterMode

    r, n, nxt, prv = ring_neighbours(group)
    T = q.shape[-2] * n
    qpos = torch.as_tensor(positions(r, n, T))
    kv = torch.stack([k, v]).contiguous()
    acc: dict = {}
    for s in range(n):
        j = (r - s) % n
        kpos = torch.as_tensor(positions(j, n, T))
        reqs = []
        if s < n - 1:
            incoming = torch.empty_like(kv)
            reqs = [dist.isend(kv, dst=nxt, group=group), dist.irecv(incoming, src=prv, group=group)]
        with FlopCounterMode(display=False) as counter:
            for a, (q0, q1) in enumerate(_pieces(len(qpos), chunks)):
                for k0, k1 in _pieces(len(kpos), chunks):
                    seen = kpos[None, k0:k1] <= qpos[q0:q1, None]
                    if not seen.any():
                        continue
                    part = block_attention(
                        q[..., q0:q1, :],
                        kv[0][..., k0:k1, :],
                        kv[1][..., k0:k1, :],
                        mask=None if seen.all() else seen,
                    )
                    acc[a] = part if a not in acc else merge_fn(*acc[a], *part)
        if record is not None:
            record.append({"src": j, "flops": counter.get_total_flops()})
        for req in reqs:
            req.wait()
        if s < n - 1:
            kv = incoming
    return torch.cat([acc[a][0] for a in sorted(acc)], dim=-2)


def attn_inputs(seed: int = 0, size: dict = ATTN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (size["batch"], size["heads"], size["seq"], size["head_dim"])
    return tuple(torch.randn(shape, dtype=DTYPE, generator=g) for _ in range(3))  # type: ignore[return-value]


def one_process(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The oracle: torch's scaled_dot_product_attention on the whole sequence."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def measure_ring(
    ring_fn=ring_attention, positions=zigzag_positions, merge_fn=merge, size: dict = ATTN
) -> dict:
    """Rank function (n ranks): the ring (ring_fn, contiguous, causal) once, its outputs and the
    trace window of its sends; then chunked_ring in both layouts (contiguous, zigzag with
    `positions`), each step's source rank and FLOPs, and the outputs (to compare with one process)."""
    from labkit.observe import tracing

    group, r, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    q, k, v = attn_inputs(0, size)
    out: dict = {}
    dist.barrier()
    start = tracing.clock()
    out["ring"] = ring_fn(*(torch.chunk(t, n, 2)[r].contiguous() for t in (q, k, v)), True, group).detach()
    out["ring_window"] = (start, tracing.clock())
    for name, pos_fn, chunks in (("contiguous", contiguous_positions, 1), ("zigzag", positions, 2)):
        pos = torch.as_tensor(pos_fn(r, n, size["seq"]))
        steps: list = []
        o = chunked_ring(
            *(t[..., pos, :].contiguous() for t in (q, k, v)), pos_fn, group, chunks, merge_fn, steps
        )
        out[name] = {"out": o, "positions": pos, "steps": steps}
    return out


def ring_work_flops(layout: str, rank: int, n: int, T: int, batch: int, heads: int, head_dim: int) -> int:
    """The formula for chunked_ring's FLOPs on one rank: every (query chunk, key chunk) pair it
    does not skip is computed whole (the diagonal with a mask), 2 matmuls of 2·c_q·c_k·D each
    per head. Contiguous: rank r computes r + 1 blocks of T/n; zigzag: 2n + 1 blocks of T/(2n)
    on every rank (chunk r sees chunks 0..r, chunk 2n-1-r sees chunks 0..2n-1-r)."""
    per_pair = 4 * batch * heads * head_dim
    if layout == "contiguous":
        c = T // n
        return per_pair * (rank + 1) * c * c
    c = T // (2 * n)
    return per_pair * (2 * n + 1) * c * c


def sends_in(trace: dict, window: tuple) -> list[dict]:
    """The point-to-point sends (dist.isend / send, recorded by labkit's tracer) in `window`."""
    return [e for e in trace["events"] if e["op"] == "send" and window[0] <= e["start"] < window[1]]


# ---------------------------------------------------------------- at scale
def activation_share(tp: int, cp: int, sp: bool) -> float:
    """The share of a layer's activations (the cost model's 34·s·d bytes per token, 16-bit) one
    rank keeps: with SP all of it is split tp ways; TP without SP splits the 24·s·d inside its
    matmuls and keeps the 10·s·d of the norms, dropout and residuals whole (Korthikanti et al.
    2022, s·b·d·(10 + 24/t)); CP splits the tokens cp ways."""
    inside = 24 / 34
    per_tp = 1 / tp if sp or tp == 1 else (1 - inside) + inside / tp
    return per_tp / cp


def longest_sequence(
    model: Any, budget: float, states: float, tp: int, cp: int, sp: bool, quantum: int = 1024
) -> int:
    """The longest sequence (a multiple of `quantum` tokens, batch 1) whose activations fit
    `budget - states` bytes per rank, searched on labkit's cost model: costmodel.activation_bytes
    (Korthikanti's 34·s·d bytes per layer in 16-bit, no score matrix: flash attention) times
    this rank's activation_share."""
    from labkit.costmodel import activation_bytes

    room = budget - states
    share = activation_share(tp, cp, sp)

    def fits(T: int) -> bool:
        return activation_bytes(model, T) * share <= room

    if room <= 0 or not fits(quantum):
        return 0
    lo, hi = quantum, 2 * quantum
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > quantum:
        mid = (lo + hi) // 2 // quantum * quantum
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ---------------------------------------------------------------- the figure
def plot_ring_steps(runs: Any, layouts=("contiguous", "zigzag")) -> Figure:
    """The ring's steps per rank, one panel per layout: a cell per (rank, step), its shade the
    step's measured FLOPs (blank: skipped), labelled with the rank whose K/V it holds; the total
    per rank on the right."""
    import matplotlib.pyplot as plt

    from labkit.observe.style import show_own, use_course_style

    use_course_style()
    n = len(runs)
    fig, axes = plt.subplots(1, len(layouts), figsize=(6.2 * len(layouts), 0.55 * n + 1.6), squeeze=False)
    top = max(s["flops"] for res in runs for name in layouts for s in res[name]["steps"]) or 1
    for ax, name in zip(axes[0], layouts):
        grid = [[s["flops"] for s in res[name]["steps"]] for res in runs]
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=top * 1.15, aspect="auto")
        for r, res in enumerate(runs):
            for s, step in enumerate(res[name]["steps"]):
                label = f"K/V {step['src']}" if step["flops"] else "skip"
                color = "white" if step["flops"] > 0.6 * top else "black"
                ax.text(s, r, label, ha="center", va="center", fontsize=8, color=color)
            ax.text(n - 0.4, r, f" {sum(grid[r]) / 1e3:.1f} kFLOP", va="center", fontsize=8)
        ax.set_xticks(range(n), [f"step {s}" for s in range(n)])
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
        ax.set_title(f"causal ring, {name}: FLOPs per step")
    fig.tight_layout()
    return show_own(fig)
