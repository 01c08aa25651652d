"""Megatron-LM's tensor parallelism on the course's TinyGPT (labkit.models): every block's attention
heads and MLP split over the "tp" ranks, the rest replicated.

    parallelize_gpt(model, mesh["tp"])      # in place; or with torch's: parallelize_gpt(..., torch)

Per block: attn.qkv "qkv" (each of q, k, v split by heads: rank t holds heads
[t * H / tp, (t + 1) * H / tp) whole), attn.proj "rowwise", mlp.0 (fc) "colwise", mlp.2 (proj)
"rowwise". So each block runs two all-reduces forward (after attn.proj and mlp.2: reduce_from_tp)
and two backward (the gradients of the attention's and the MLP's input: copy_to_tp), each of
batch x seq x d_model elements. The attention computes its H / tp local heads (the class becomes
TPCausalSelfAttention, whose forward reads the local head count). Embeddings, LayerNorms and the
LM head (tied to the token embedding) stay whole on every rank: every tp rank sees the same batch,
so their gradients are the same on every tp rank without any communication.

With torch (torch_ref.py): the same plan through torch's parallelize_module, ColwiseParallel on a
qkv whose rows are first permuted into [q_0; k_0; v_0; q_1; ...] (torch's Shard(0) then hands rank
t its heads), un-permuted when the state is read back (unpermute_qkv).
What it leaves out: sequence parallelism (the LayerNorms' activations stay whole), a vocabulary-
parallel embedding / LM head, grouped-query attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.models import CausalSelfAttention, TinyGPT

__all__ = ["TPCausalSelfAttention", "check_gpt", "gpt_plan", "localize_heads", "qkv_order", "unpermute_qkv"]


class _TPAttention:
    """CausalSelfAttention's forward on this rank's heads: qkv gives [q_t, k_t, v_t] (H / tp heads
    each), proj (rowwise) takes their concatenation and sums over the ranks."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, time, channels = h.shape
        head_dim = channels // self.n_heads
        heads = self._tp_heads
        q, k, v = self.qkv(h).split(heads * head_dim, dim=2)
        q, k, v = (t.view(batch, time, heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~self.causal_mask[:time, :time], float("-inf"))
        out = F.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, time, heads * head_dim))


class TPCausalSelfAttention(_TPAttention, CausalSelfAttention):
    pass


def check_gpt(model: nn.Module, tp: int, where: str) -> None:
    """Raise unless `model` is a TinyGPT whose heads split evenly over `tp` ranks."""
    if not isinstance(model, TinyGPT):
        raise TypeError(
            f"{where}: tensor parallelism here splits TinyGPT's heads and MLP (labkit.models); "
            f"got a {type(model).__name__} (Preset(model='gpt'))"
        )
    heads = model.config.n_heads
    if heads % tp:
        raise ValueError(
            f"{where}: n_heads={heads} is not divisible by tp={tp}: each rank must hold whole heads"
        )


def gpt_plan(model: nn.Module) -> dict[str, str]:
    """{module name: style} of the Megatron split of every block (the module docstring)."""
    plan = {}
    for i in range(len(model.blocks)):
        plan |= {
            f"blocks.{i}.attn.qkv": "qkv",
            f"blocks.{i}.attn.proj": "rowwise",
            f"blocks.{i}.mlp.0": "colwise",
            f"blocks.{i}.mlp.2": "rowwise",
        }
    return plan


def localize_heads(model: nn.Module, tp: int) -> None:
    """Every block's attention computes its n_heads / tp local heads (its class swapped)."""
    for block in model.blocks:
        block.attn._tp_heads = block.attn.n_heads // tp
        block.attn.__class__ = TPCausalSelfAttention


def qkv_order(rows: int, tp: int) -> torch.Tensor:
    """The row permutation that makes torch.chunk's k-th piece of a [q; k; v] weight [q_k; k_k; v_k]."""
    third = rows // 3
    width = third // tp
    return torch.cat(
        [
            torch.arange(c * third + t * width, c * third + (t + 1) * width)
            for t in range(tp)
            for c in range(3)
        ]
    )


def unpermute_qkv(tensor: torch.Tensor, tp: int) -> torch.Tensor:
    """A whole qkv weight or bias held in qkv_order back in [q; k; v] order."""
    inverse = torch.argsort(qkv_order(tensor.shape[0], tp))
    return tensor[inverse.to(tensor.device)]
