"""TinyGPT (labkit.models) on this rank's piece of every sequence: context parallelism.

    parallelize_cp(model, group, layout="zigzag")     # in place: attention through ring_attention
    logits, loss = model(x, y, reduction="sum")       # x, y: WHOLE rows; this rank's piece's

Everything but attention works token by token, so it runs on the piece as it is: the embeddings
(the positions those of the piece, layout.positions), LayerNorms, MLPs, the LM head and the loss of
the piece's tokens. Attention needs every earlier key: CPCausalSelfAttention computes q, k, v of its
piece and calls ring_attention (causal). The parameters stay whole on every rank; each rank's
gradient is its piece's part (the strategy sums them). What it leaves out: a piece cut by the
caller (the forward cuts whole rows itself), generation (generate() refuses). The model's class becomes CPTinyGPT,
whose forward is cp_forward: the same signature and meaning as TinyGPT's, on the piece.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.comm.collectives import group_info
from labkit.models import CausalSelfAttention, TinyGPT
from labkit.strategies.cp.layout import check_layout, positions
from labkit.strategies.cp.ring import ring_attention

__all__ = [
    "CPCausalSelfAttention",
    "CPTinyGPT",
    "PieceAttention",
    "cp_forward",
    "parallelize_cp",
    "piece_forward",
]


class PieceAttention:
    """CausalSelfAttention's forward on this rank's piece of the sequence: its q, k, v as
    (batch, heads, piece, head_dim), then `attend` (the one thing a sequence-parallel attention
    changes: ring_attention here, Ulysses' all-to-all pair in labkit.strategies.ulysses)."""

    n_heads: int
    qkv: nn.Linear
    proj: nn.Linear

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, time, channels = h.shape
        head_dim = channels // self.n_heads
        q, k, v = self.qkv(h).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_heads, head_dim).transpose(1, 2) for t in (q, k, v))
        out = self.attend(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, time, channels))


class _CPAttention(PieceAttention):
    """Attention by ring over the cp group, in its layout."""

    _cp_group: Any
    _cp_layout: str

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, causal=True, group=self._cp_group, layout=self._cp_layout)


class CPCausalSelfAttention(_CPAttention, CausalSelfAttention):
    pass


def parallelize_cp(
    model: nn.Module, group: dist.ProcessGroup | None = None, layout: str = "zigzag"
) -> nn.Module:
    """In place: every block's attention runs ring_attention over `group` in `layout`; returns model."""
    if isinstance(model, CPTinyGPT):
        raise ValueError("parallelize_cp: the model is already parallelized")
    if not isinstance(model, TinyGPT):
        raise TypeError(
            f"parallelize_cp: context parallelism here runs TinyGPT (labkit.models), got a {type(model).__name__}"
        )
    check_layout(layout, "parallelize_cp")
    for block in model.blocks:
        attn = block.attn
        if isinstance(attn, CPCausalSelfAttention):
            raise ValueError("parallelize_cp: the model is already parallelized")
        if type(attn) is not CausalSelfAttention:
            raise TypeError(
                f"parallelize_cp: a block's attention is a {type(attn).__name__} (already split?)"
            )
    for block in model.blocks:
        attn = block.attn
        setattr(attn, "_cp_group", group)
        setattr(attn, "_cp_layout", layout)
        attn.__class__ = CPCausalSelfAttention
    setattr(model, "_cp_group", group)
    setattr(model, "_cp_layout", layout)
    model.__class__ = CPTinyGPT
    return model


def cp_forward(
    model: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TinyGPT.forward on this rank's piece of the whole rows idx (B, T) (and targets): (logits of
    the piece (B, T_local, vocab), the loss of the piece's tokens (reduction "sum" or "mean" over
    them) or None)."""
    group, layout = getattr(model, "_cp_group", None), getattr(model, "_cp_layout", None)
    if layout is None or not isinstance(model, TinyGPT):
        raise ValueError("cp_forward: the model was not parallelized by parallelize_cp")
    return piece_forward(model, idx, targets, reduction, (group, layout))


def piece_forward(
    model: TinyGPT,
    idx: torch.Tensor,
    targets: torch.Tensor | None,
    reduction: str,
    where: tuple[dist.ProcessGroup | None, str],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TinyGPT's forward on the piece of the whole rows idx that `where` = (group, layout) gives
    this rank (its blocks as they are: cp's ring attention, or Ulysses' all-to-alls)."""
    group, layout = where
    rank, n = group_info(group)
    time = idx.shape[1]
    if time > model.config.seq_len:
        raise ValueError(f"{time} tokens is longer than seq_len={model.config.seq_len}")
    pos = positions(time, layout, rank, n).to(idx.device)
    h = model.tok_emb(idx[:, pos]) + model.pos_emb(pos)
    for block in model.blocks:
        h = block(h)
    logits = model.lm_head(model.ln_f(h))
    if targets is None:
        return logits, None
    wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    mine = targets[:, pos]
    loss = F.cross_entropy(wide.reshape(-1, wide.shape[-1]), mine.reshape(-1), reduction=reduction)
    return logits, loss


class CPTinyGPT(TinyGPT):
    """A TinyGPT after parallelize_cp: forward(idx, targets, reduction) is cp_forward's."""

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return cp_forward(self, idx, targets, reduction)

    def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Refused: each rank's forward sees only its piece of the sequence, so its "last
        position" is not the sequence's and the ranks would append different tokens."""
        raise NotImplementedError(
            "generate() on a context-parallel model (parallelize_cp): each rank's forward runs on its "
            "piece of the sequence, so the next token would differ from rank to rank; load the "
            "trained weights into a plain TinyGPT (labkit.models) and generate there"
        )
