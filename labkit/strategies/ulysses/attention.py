"""Ulysses attention (DeepSpeed-Ulysses): every rank holds T/n positions of every head outside
attention; an all-to-all turns q, k and v into all T positions of H/n heads, ordinary attention
runs on whole sequences for those heads, and a second all-to-all turns its output back.

    q_h = seq_to_heads(q, group)        # (B, H, T/n, D) -> (B, H/n, T, D): heads j H/n.. to rank j
    out = heads_to_seq(o_h, group)      # (B, H/n, T, D) -> (B, H, T/n, D): positions back home
    out = ulysses_attention(q, k, v, causal=True, group=group)   # both around attention

The pieces are contiguous: rank r holds positions [r T/n, (r + 1) T/n) (cp.layout's "contiguous"),
heads [r H/n, (r + 1) H/n) inside attention. Both moves are labkit.comm.all_to_all_autograd
(the hand-written all-to-all; its backward is the all-to-all the other way), so gradients flow
back through them: a layer's forward runs 4 all-to-alls (q, k, v in; the output back) and its
backward 4 more (the output's gradient in; dq, dk, dv back), 4 more again when activation
checkpointing recomputes the forward. Each sends (n-1)/n of the rank's
B (T/n) C tensor (C = H D) plus labkit's per-message header: `layer_bytes`.

What it leaves out: GQA / MQA (TinyGPT has none: every head its own K and V; with fewer KV heads
than ranks, K and V would have to be replicated first), heads or positions the group does not
divide (refused, naming them), overlapping the all-to-alls with compute, dropout, masks other than
causal, and combining with ring attention (2-D sequence parallelism, as in USP / LoongTrain).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.comm.all_to_all import all_to_all_autograd, wire_bytes
from labkit.comm.collectives import group_info

__all__ = ["heads_to_seq", "layer_bytes", "seq_to_heads", "ulysses_attention"]

Group = dist.ProcessGroup | None


def _check(x: torch.Tensor, where: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{where}: expects (batch, heads, positions, head_dim), got shape {shape}")


def seq_to_heads(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """(B, H, T/n, D), this rank's positions of every head -> (B, H/n, T, D), every position of
    this rank's heads (one all-to-all over `group`, differentiable)."""
    _check(x, "seq_to_heads")
    rank, n = group_info(group)
    batch, heads, piece, head_dim = x.shape
    if heads % n:
        raise ValueError(
            f"seq_to_heads: {heads} heads do not split over {n} ranks (Ulysses gives each rank "
            f"heads / n whole heads: n must divide the head count)"
        )
    # dim 0 the destination: head group j goes to rank j
    send = x.reshape(batch, n, heads // n, piece, head_dim).transpose(0, 1).contiguous()
    got = all_to_all_autograd(send, group=group)  # dim 0 now the source: rank i's positions
    return got.permute(1, 2, 0, 3, 4).reshape(batch, heads // n, n * piece, head_dim)


def heads_to_seq(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """(B, H/n, T, D), every position of this rank's heads -> (B, H, T/n, D), this rank's
    positions of every head: seq_to_heads' inverse (one all-to-all, differentiable)."""
    _check(x, "heads_to_seq")
    rank, n = group_info(group)
    batch, mine, time, head_dim = x.shape
    if time % n:
        raise ValueError(f"heads_to_seq: {time} positions do not split over {n} ranks")
    # dim 0 the destination: rank j's positions go home to it
    send = x.reshape(batch, mine, n, time // n, head_dim).permute(2, 0, 1, 3, 4).contiguous()
    got = all_to_all_autograd(send, group=group)  # dim 0 now the source: rank i's heads
    return got.transpose(0, 1).reshape(batch, n * mine, time // n, head_dim)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """models.CausalSelfAttention's own matmuls, on whole sequences (the same roundings as one
    process's, head by head)."""
    time = q.shape[2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(time, time, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, group: Group = None
) -> torch.Tensor:
    """Attention of this rank's positions (q, k, v: (B, H, T/n, D), contiguous pieces) over the
    whole sequence: all-to-all in, attention on H/n whole heads, all-to-all out (B, H, T/n, D)."""
    if not q.shape == k.shape == v.shape:
        raise ValueError(
            f"ulysses_attention: q, k, v must have the same shape, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"ulysses_attention: causal must be True or False, got {causal!r}")
    q_h, k_h, v_h = (seq_to_heads(t, group) for t in (q, k, v))
    return heads_to_seq(_attention(q_h, k_h, v_h, causal), group)


def layer_bytes(
    batch: int, seq_len: int, d_model: int, n: int, element_size: int, rank: int = 0
) -> dict[str, int]:
    """What one attention layer's FORWARD sends from one rank (its backward the same again):
    "payload", the 4 all-to-alls' rows to other ranks, 4 (n-1)/n of the rank's B (T/n) C tensor;
    "wire", that plus labkit's first-message header and splits per peer (all_to_all.wire_bytes,
    what the tracer counts)."""
    local = batch * (seq_len // n) * d_model * element_size  # one of q, k, v, out on this rank
    row = local // n  # one all-to-all row: a head group's share of the rank's positions
    return {"payload": 4 * (n - 1) * row, "wire": 4 * wire_bytes([1] * n, rank, row)}
