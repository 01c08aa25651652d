"""Sequence- and context-parallel lab helpers: the references of seq_lab's exercises (SP's
conjugate pair along the sequence, the exact merge of two partial attentions, ring attention's
forward, the zigzag assignment), the blocks and rank functions of its measurements, and the
figure of the ring's steps.

    gather_seq(x, group) / scatter_seq(x, group)     SP's pair: all-gather fwd / reduce-scatter bwd,
                                                     and reduce-scatter fwd / all-gather bwd (dim 1)
    o, lse = block_attention(q, k, v, causal)        one block of attention and its log-sum-exp
    o, lse = merge(o1, lse1, o2, lse2)               two partials of the same queries, exactly
    ring_attention(q, k, v, causal, group)           contiguous layout, K/V round a ring
    zigzag_positions(rank, n, T)                     the zigzag assignment's positions
    chunked_ring(q, k, v, positions, group)          any layout, causal, work per (q, k) chunk pair
    seq_to_heads(x, group) / heads_to_seq(x, group)  Ulysses' all-to-all pair: (B, H, T/n, D) <->
                                                     (B, H/n, T, D) (labkit.strategies.ulysses)
    measure_ulysses(to_heads, to_seq)                Ulysses and the ring on the same pieces, traced

One name, one path: where an exercise's reference computes what the strategies compute, it is a
thin call into them (gather_from_sp / reduce_scatter_to_sp of labkit.strategies.tp;
merge_partials, ring_attention and positions of labkit.strategies.cp; seq_to_heads /
heads_to_seq of labkit.strategies.ulysses), so the lab's fallback and
the strategies "sp" / "cp" are the same code; the FLOP formula and the ring's schedule the
notebook checks against are cp's attention_flops / ring_schedule. chunked_ring stays the lab's:
it runs the learner's merge and positions and counts each step's FLOPs with torch's
FlopCounterMode, an independent measurement of what cp's formula says.

Shapes: activations (B, T, d), sequence dim 1; attention (B, H, T, D), sequence dim 2. Float64
throughout (the checks compare within 1e-12). What this leaves out: chunked_ring's backward
(autograd over its steps, which keeps every received K/V block; the strategy's ring_attention has
the hand-written one that re-circulates K/V), dropout, overlap measured (K/V are posted before a
step's compute and waited after it, which is the overlap on a GPU; on gloo CPU ranks it only
orders the messages). The checks are seq_checks.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.comm import p2p
from labkit.labs.tp_lab import saved_bytes  # one definition, shared with tp_lab
from labkit.comm.collectives import ring_all_reduce
from labkit.strategies.cp import count_attention_flops, merge_partials, shard
from labkit.strategies.cp import positions as layout_positions
from labkit.strategies.cp import ring_attention as cp_ring_attention
from labkit.strategies.ulysses import heads_to_seq as ulysses_heads_to_seq
from labkit.strategies.ulysses import seq_to_heads as ulysses_seq_to_heads
from labkit.strategies.tp import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp

if TYPE_CHECKING:  # matplotlib is imported by the figure helper only
    from matplotlib.figure import Figure

DTYPE = torch.float64
SP_SIZE = dict(batch=2, d=16, hidden=32)  # the SP block of the measurements (seq varies)
ATTN = dict(batch=1, heads=2, head_dim=3, seq=24)  # 24 tokens: 6 / 12 per rank, zigzag chunks of 3 / 6


# ---------------------------------------------------------------- exercise 1: SP's pair
def gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Exercise 1's reference: (B, T/n, d) on each rank -> the whole (B, T, d); backward a
    reduce-scatter (sum). Megatron-SP's g, labkit.strategies.tp's gather_from_sp (the strategy
    "sp" runs the same function)."""
    return gather_from_sp(x, group)


def scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Exercise 1's reference: partial sums (B, T, d) -> this rank's piece of their sum (B, T/n,
    d); backward an all-gather. Megatron-SP's g-bar, labkit.strategies.tp's reduce_scatter_to_sp."""
    return reduce_scatter_to_sp(x, group)


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
    block's normalized output and log-sum-exp: lse = logaddexp(lse1, lse2) (shifted by the larger,
    no overflow), o = o1·exp(lse1 - lse) + o2·exp(lse2 - lse). An empty partial (o 0, lse -inf)
    leaves the other unchanged. The strategy's merge_partials (labkit.strategies.cp), which its
    ring_attention runs."""
    return merge_partials(o1, lse1, o2, lse2)


# ---------------------------------------------------------------- exercise 3: the ring
def ring_neighbours(group: Any) -> tuple[int, int, int, int]:
    """(this rank's index in the group, group size, global rank of the next, of the previous)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    return r, n, dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, group: Any
) -> torch.Tensor:
    """Exercise 3's reference, contiguous layout (rank r holds positions [rT/n, (r+1)T/n)): the
    strategy's ring_attention (labkit.strategies.cp). At step s this rank holds the K/V of rank
    j = (r - s) mod n; causal: j == r is the diagonal block (masked), j < r is seen whole, j > r
    is skipped (all in the future). Its K/V travel on labkit.comm.p2p.sendrecv (traced as
    "p2p_sendrecv", into the other of two buffers: never the one being sent).

    The exercise itself keeps torch's dist.isend / dist.irecv (the learner posts both and picks
    the buffers: the lesson), and seq_checks watches exactly those calls for a deadlock and for a
    buffer received into while it is sent. p2p.sendrecv would take both mistakes out of the
    learner's hands (it posts the pair itself and refuses recv_tensor is send_tensor), so the
    watcher would have nothing left to catch."""
    return cp_ring_attention(q, k, v, causal=causal, group=group, layout="contiguous")


# ---------------------------------------------------------------- exercise 4: zigzag
def contiguous_positions(rank: int, n: int, T: int) -> torch.Tensor:
    """Rank r's positions [rT/n, (r+1)T/n): labkit.strategies.cp.positions, layout "contiguous"."""
    return layout_positions(T, "contiguous", rank, n)


def zigzag_positions(rank: int, n: int, T: int) -> torch.Tensor:
    """Exercise 4's reference: the sequence in 2n chunks of T/(2n), rank r holds chunk r then
    chunk 2n-1-r (the global positions, in that order): labkit.strategies.cp.positions, layout
    "zigzag", which the strategy "cp" shards its batches with."""
    return layout_positions(T, "zigzag", rank, n)


def causal_pairs(q_pos, k_pos) -> int:
    """Exercise 4's reference: the (query, key) pairs causal attention computes, key <= query."""
    q, k = torch.as_tensor(q_pos), torch.as_tensor(k_pos)
    return int((k[None, :] <= q[:, None]).sum())


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
        handle = None
        if s < n - 1:  # K/V on labkit's traced point-to-point, into a fresh buffer (kv is being sent)
            incoming = torch.empty_like(kv)
            handle = p2p.sendrecv(kv, incoming, dst=nxt, src=prv, group=group, async_op=True)
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
        if handle is not None:
            handle.wait()
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
    `positions`), each step's source rank and FLOPs, and the outputs (to compare with one process);
    last the strategy's ring_attention (labkit.strategies.cp) in both layouts, its outputs and the
    FLOPs it counted (count_attention_flops), to compare the lab's path with."""
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
    for layout in ("contiguous", "zigzag"):
        with count_attention_flops() as counted:
            o = cp_ring_attention(*(shard(t, 2, layout, r, n) for t in (q, k, v)), causal=True, layout=layout)
        out["strategy", layout] = {"out": o.detach(), "flops": counted["flops"]}
    return out


SEND_OPS = ("send", "p2p_sendrecv")  # torch's dist.isend / send (the exercise), labkit's p2p (the reference)


def sends_in(trace: dict, window: tuple) -> list[dict]:
    """The point-to-point sends in `window`: dist.isend / send (recorded by labkit's tracer) and
    labkit.comm.p2p.sendrecv (its own event: the bytes it sends)."""
    return [e for e in trace["events"] if e["op"] in SEND_OPS and window[0] <= e["start"] < window[1]]


# ---------------------------------------------------------------- Ulysses
ULYSSES = dict(batch=1, heads=4, head_dim=4, seq=16)  # the measurement's: n = 2 and 4 divide heads and seq


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Ulysses' exercise's reference: (B, H, T/n, D), this rank's positions of every head ->
    (B, H/n, T, D), every position of heads [r H/n, (r+1) H/n); one differentiable all-to-all
    (labkit.strategies.ulysses.seq_to_heads, what the strategy "ulysses" runs)."""
    return ulysses_seq_to_heads(x, group)


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """seq_to_heads' inverse: (B, H/n, T, D) -> (B, H, T/n, D) (labkit.strategies.ulysses)."""
    return ulysses_heads_to_seq(x, group)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    group: Any,
    to_heads=seq_to_heads,
    to_seq=heads_to_seq,
) -> torch.Tensor:
    """This rank's (B, H, T/n, D) output of attention over the whole sequence, from the pair
    `to_heads` / `to_seq` (the learner's or the reference): three all-to-alls in, torch's
    scaled_dot_product_attention on whole sequences of H/n heads, one all-to-all back."""
    qh, kh, vh = (to_heads(t, group) for t in (q, k, v))
    return to_seq(F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal), group)


def ulysses_layout(to_heads=seq_to_heads, heads: int = 4, seq: int = 8) -> dict:
    """Rank function (n ranks): which heads and positions this rank holds before and after
    `to_heads`, read off values that name them (100 h + t), and the shapes."""
    r, n = dist.get_rank(), dist.get_world_size()
    h, t = torch.meshgrid(torch.arange(heads), torch.arange(seq), indexing="ij")
    mine = torch.chunk((100 * h + t).to(DTYPE)[None, :, :, None], n, 2)[r].contiguous()  # (1, H, T/n, 1)

    def held(y: torch.Tensor) -> dict:
        v = y[0, :, :, 0].long()
        return {
            "shape": tuple(y.shape),
            "heads": sorted(set((v // 100).flatten().tolist())),
            "positions": sorted(set((v % 100).flatten().tolist())),
        }

    return {"before": held(mine), "after": held(to_heads(mine, dist.group.WORLD))}


def measure_ulysses(to_heads=seq_to_heads, to_seq=heads_to_seq, size: dict = ULYSSES) -> dict:
    """Rank function (4 ranks): on the groups {0, 2} / {1, 3} (n = 2) and on the world (n = 4), the
    same causal attention on this rank's contiguous pieces as Ulysses (the pair given) and as the
    ring (labkit.strategies.cp.ring_attention), forward and backward, each in a trace window of its
    own; the largest difference of output and dq, dk, dv from one process's."""
    from labkit.observe import tracing

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    q, k, v = attn_inputs(5, size)
    dout = attn_inputs(6, size)[0]
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = one_process(whole[0], whole[1], whole[2], True)
    want_grads = torch.autograd.grad(want, whole, dout)
    out: dict = {}
    for n_name, group in ((2, pairs[rank % 2]), (4, dist.group.WORLD)):
        r, n = dist.get_rank(group), dist.get_world_size(group)
        for name in ("ulysses", "ring"):
            mine = [torch.chunk(t, n, 2)[r].clone().requires_grad_() for t in (q, k, v)]
            dist.barrier()
            t0 = tracing.clock()
            if name == "ulysses":
                o = ulysses_attention(mine[0], mine[1], mine[2], True, group, to_heads, to_seq)
            else:
                o = cp_ring_attention(
                    mine[0], mine[1], mine[2], causal=True, group=group, layout="contiguous"
                )
            t1 = tracing.clock()
            grads = torch.autograd.grad(o, mine, torch.chunk(dout, n, 2)[r])
            t2 = tracing.clock()
            compared = [(o, want), *zip(grads, want_grads)]
            errors = [(a.detach() - torch.chunk(b.detach(), n, 2)[r]).abs().max().item() for a, b in compared]
            out[name, n_name] = {"forward": (t0, t1), "backward": (t1, t2), "error": max(errors), "rank": r}
    return out


def sent_by(trace: dict, window: tuple, ops: tuple) -> list[dict]:
    """The tracer's events of `ops` in `window`, each with "sent": the bytes this rank put on the
    wire (the hand-written collectives' intra + inter bytes; p2p's nbytes)."""
    events = [e for e in trace["events"] if e["op"] in ops and window[0] <= e["start"] < window[1]]
    return [dict(e, sent=e.get("intra_bytes", 0) + e.get("inter_bytes", 0) or e["nbytes"]) for e in events]


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
