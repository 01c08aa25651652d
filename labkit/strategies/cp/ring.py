"""ring_attention(q, k, v, *, causal, group=None, layout): one process's attention on a sequence
held in pieces by the ranks of `group` (context parallelism), K/V passed around a ring.

q, k, v are this rank's pieces (B, H, T_local, D) of the whole sequence (layout.py: "contiguous" or
"zigzag"). Each of the n ring steps attends this rank's queries to one rank's K/V piece while the
next piece travels (labkit.comm.p2p.sendrecv, async on the comm thread: traced, its bytes counted),
and merges the partial results exactly with their log-sum-exp (online softmax):
    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.
Blocks are (query chunk, key chunk) pairs: causal, a key chunk after the query chunk is skipped and
the diagonal one masked (work.py counts them). The scale is 1/sqrt(D), as scaled_dot_product_attention's.

Backward is written by hand (flash attention's): with the saved out and lse, the K/V pieces go round
again together with their gradient accumulators dK, dV; at each step this rank adds its queries'
part (p = exp(s - lse), dV += p^T dO, dS = p (dO V^T - rowsum(dO out)), dQ += dS K / sqrt(D),
dK += dS^T Q / sqrt(D)), and after the n-th step one more shift brings every dK, dV home. Autograd
through it gives this rank's pieces of dq, dk, dv.

Per rank and call, the forward sends (n - 1) K/V pieces, (n - 1)/n of the layer's K and V
(2 (n - 1)/n of one of them); the backward (n - 1) K, V, dK, dV pieces plus one dK, dV piece.
Before the ring, every call compares a small header across the group (untraced: metadata):
causal, layout, the pieces' shape and dtype; ranks that disagree all raise, naming it (unchecked,
a different `causal` or `layout` gives a silently wrong answer, a different length a gloo abort).
16-bit inputs: the scores, the log-sum-exp statistics and the merges are fp32 (flash attention
keeps them so; in bf16 the merges' error would grow with the ranks), the K/V messages stay in the
input's dtype, the backward's travelling dK, dV accumulate in fp32 (so its messages are fp32).

What it leaves out: overlap in backward (its exchanges wait), dropout, other masks (only causal or
none), a scale other than 1/sqrt(D), K/V heads fewer than Q's (GQA).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from labkit.comm import p2p
from labkit.comm.collectives import group_info
from labkit.observe import tracing
from labkit.strategies.cp import work
from labkit.strategies.cp.layout import check_layout, chunk_ids

__all__ = ["merge_partials", "ring_attention", "ring_schedule"]

NAME = "ring_attention"


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys as one: (out, lse). lse_a may
    be -inf (nothing seen yet); lse_b must be finite."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse


def _check(q: Any, k: Any, v: Any, causal: Any, layout: Any) -> None:
    for what, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{NAME}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{NAME}: {what} must be (batch, heads, T_local, head_dim), got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{NAME}: {what} must be floating point, got {t.dtype}")
    if not q.shape == k.shape == v.shape:
        raise ValueError(
            f"{NAME}: q, k and v must have the same shape (batch, heads, T_local, head_dim), got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ValueError(
            f"{NAME}: q, k, v differ in dtype or device ({q.dtype}/{k.dtype}/{v.dtype}, {q.device}/{k.device}/{v.device})"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"{NAME}: causal must be True or False, got {causal!r}")
    check_layout(layout, NAME)


def _agree(q: torch.Tensor, causal: bool, layout: str, group: Any) -> None:
    """Every rank's (causal, layout, piece shape, dtype) gathered over `group`; raises on every
    rank, naming what differs, unless all agree."""
    rank, n = group_info(group)
    if n == 1:
        return
    from labkit.strategies.cp.layout import LAYOUTS

    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    fields = [
        int(causal),
        LAYOUTS.index(layout),
        *q.shape,
        dtypes.index(q.dtype) if q.dtype in dtypes else -1,
    ]
    mine = torch.tensor(fields, dtype=torch.int64, device=q.device)
    table = [torch.empty_like(mine) for _ in range(n)]
    with tracing.untraced():
        dist.all_gather(table, mine, group=group)
    rows = [t.tolist() for t in table]
    named: dict[str, list[Any]] = {
        "causal": [bool(r[0]) for r in rows],
        "layout": [LAYOUTS[r[1]] for r in rows],
        "the pieces' shape (batch, heads, T_local, head_dim)": [tuple(r[2:6]) for r in rows],
        "dtype": [dtypes[r[6]] if r[6] >= 0 else "another dtype" for r in rows],
    }
    for what, values in named.items():
        if len(set(values)) > 1:
            each = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(
                f"{NAME}: the ranks of the group disagree on {what} ({each}); every rank must call it "
                f"with the same arguments on its piece of the same sequence"
            )


def _kinds(layout: str, rank: int, src: int, n: int, causal: bool) -> list[tuple[int, int, bool]]:
    """(query chunk a, key chunk b, diagonal) of every block to compute: this rank's queries
    against rank src's keys (a, b: positions in the pieces)."""
    mine, theirs = chunk_ids(layout, rank, n), chunk_ids(layout, src, n)
    return [
        (a, b, causal and j == i)
        for a, i in enumerate(mine)
        for b, j in enumerate(theirs)
        if not causal or j <= i
    ]


def ring_schedule(world_size: int, *, layout: str, causal: bool) -> list[list[dict[str, Any]]]:
    """What ring_attention does, step by step: schedule[t][r] = {"kv_from": the rank whose K/V
    piece rank r holds at step t, "blocks": [(query chunk, key chunk, "full" | "diagonal"), ...]
    (global chunk numbers, layout.chunk_ids) it computes}; the same _kinds the forward runs."""
    check_layout(layout, "ring_schedule")
    out = []
    for t in range(world_size):
        row = []
        for r in range(world_size):
            src = (r - t) % world_size
            mine, theirs = chunk_ids(layout, r, world_size), chunk_ids(layout, src, world_size)
            blocks = [
                (mine[a], theirs[b], "diagonal" if diagonal else "full")
                for a, b, diagonal in _kinds(layout, r, src, world_size, causal)
            ]
            row.append({"kv_from": src, "blocks": blocks})
        out.append(row)
    return out


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        c = s.shape[-1]
        upper = torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(upper, float("-inf"))
    return s


def _neighbours(group: Any, rank: int, n: int) -> dict[str, Any]:
    """sendrecv's keywords for one ring step: to rank + 1, from rank - 1 (global ranks)."""

    def whole(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    return {"dst": whole((rank + 1) % n), "src": whole((rank - 1) % n), "group": group}


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The statistics' dtype: fp32 for 16-bit inputs, else the input's."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _chunks(t: torch.Tensor, m: int) -> list[torch.Tensor]:
    return list(t.chunk(m, dim=-2))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, group: Any, layout: str
    ) -> torch.Tensor:
        rank, n = group_info(group)
        m = len(chunk_ids(layout, rank, n))
        batch, heads, length, dim = q.shape
        c, scale = length // m, 1.0 / math.sqrt(dim)
        wide = _wide(q.dtype)
        qs = _chunks(q.to(wide), m)
        out = torch.zeros(q.shape, dtype=wide, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=wide, device=q.device)
        outs, lses = _chunks(out, m), list(lse.chunk(m, dim=-1))
        cur = torch.stack([k, v]).contiguous()  # the piece held now: K and V, one message
        nxt = torch.empty_like(cur)
        for t in range(n):
            src = (rank - t) % n
            handle = None
            if t < n - 1:  # the next piece travels while this one is used (cur is only read)
                handle = p2p.sendrecv(cur, nxt, **_neighbours(group, rank, n), async_op=True)
            ks, vs = _chunks(cur[0].to(wide), m), _chunks(cur[1].to(wide), m)
            for a, b, diagonal in _kinds(layout, rank, src, n, causal):
                s = _scores(qs[a], ks[b], scale, diagonal)
                lse_b = torch.logsumexp(s, dim=-1)
                out_b = torch.exp(s - lse_b.unsqueeze(-1)) @ vs[b]
                merged, lses[a] = merge_partials(outs[a], lses[a], out_b, lse_b)
                outs[a].copy_(merged)
                work.record(work.block_flops(batch, heads, c, dim))
            if handle is not None:
                handle.wait()
                cur, nxt = nxt, cur  # cur was sent (the wait): its buffer may now be received into
        lse = torch.cat(lses, dim=-1)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.causal, ctx.group, ctx.layout = causal, group, layout
        return result

    @staticmethod
    @once_differentiable  # its ring steps are not differentiable: a double backward raises
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        causal, group, layout = ctx.causal, ctx.group, ctx.layout
        rank, n = group_info(group)
        m = len(chunk_ids(layout, rank, n))
        scale = 1.0 / math.sqrt(q.shape[-1])
        wide = _wide(q.dtype)
        q, k, v, out, dout = (t.to(wide) for t in (q, k, v, out, dout.contiguous()))
        delta = (dout * out).sum(-1)  # rowsum(dO * out): softmax's backward term
        dq = torch.zeros_like(q)
        qs, dos, dqs = _chunks(q, m), _chunks(dout, m), _chunks(dq, m)
        lses, deltas = lse.chunk(m, dim=-1), delta.chunk(m, dim=-1)
        # K, V and their gradient accumulators travel together: [k, v, dk, dv]
        cur = torch.cat(
            [torch.stack([k, v]), torch.zeros((2, *k.shape), dtype=k.dtype, device=k.device)]
        ).contiguous()
        nxt = torch.empty_like(cur)
        for t in range(n):
            src = (rank - t) % n
            ks, vs, dks, dvs = (_chunks(cur[i], m) for i in range(4))
            for a, b, diagonal in _kinds(layout, rank, src, n, causal):
                s = _scores(qs[a], ks[b], scale, diagonal)
                p = torch.exp(s - lses[a].unsqueeze(-1))
                dvs[b].add_(p.transpose(-2, -1) @ dos[a])
                ds = p * (dos[a] @ vs[b].transpose(-2, -1) - deltas[a].unsqueeze(-1))
                dqs[a].add_((ds @ ks[b]) * scale)
                dks[b].add_((ds.transpose(-2, -1) @ qs[a]) * scale)
            if t < n - 1:
                p2p.sendrecv(cur, nxt, **_neighbours(group, rank, n))
                cur, nxt = nxt, cur
        # After n steps this rank holds rank+1's dK, dV, complete: one more shift brings them home.
        grads = cur[2:].contiguous()
        if n > 1:
            home = torch.empty_like(grads)
            p2p.sendrecv(grads, home, **_neighbours(group, rank, n))
            grads = home
        dtype = ctx.saved_tensors[0].dtype
        return dq.to(dtype), grads[0].to(dtype), grads[1].to(dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    group: Any = None,
    layout: str,
) -> torch.Tensor:
    """This rank's piece of scaled_dot_product_attention(Q, K, V, is_causal=causal) of the whole
    sequence, every rank of `group` (None: the default group) holding its piece of q, k, v
    (B, H, T_local, D) in `layout` ("contiguous" or "zigzag", labkit.strategies.cp.layout).
    Differentiable: backward gives this rank's pieces of dq, dk, dv (see the module docstring)."""
    _check(q, k, v, causal, layout)
    _agree(q, causal, layout, group)
    rank, n = group_info(group)
    m = len(chunk_ids(layout, rank, n))
    if q.shape[2] % m:
        raise ValueError(
            f"{NAME}: this rank's piece has {q.shape[2]} positions, which do not split into the "
            f"{m} equal chunks of layout {layout!r} (the whole sequence must be a multiple of {m * n})"
        )
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), causal, group, layout)
