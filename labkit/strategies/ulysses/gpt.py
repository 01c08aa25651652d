"""TinyGPT (labkit.models) on this rank's contiguous piece of every sequence, attention by Ulysses.

    parallelize_ulysses(model, group)                 # in place: attention through ulysses_attention
    logits, loss = model(x, y, reduction="sum")       # x, y: WHOLE rows; this rank's piece's

Everything but attention works token by token, so it runs on the piece as it is (cp.gpt's
piece_forward, in cp's "contiguous" layout: rank r holds positions [r T/n, (r + 1) T/n)).
UlyssesCausalSelfAttention computes q, k, v of its piece and calls ulysses_attention (causal).
The parameters stay whole on every rank; each rank's gradient is its piece's part (the strategy
sums them). What it leaves out: generation (generate() refuses), a piece cut by the caller. The
model's class becomes UlyssesTinyGPT: the same forward signature and meaning as TinyGPT's, on the
piece.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm.collectives import group_info
from labkit.models import CausalSelfAttention, TinyGPT
from labkit.strategies.cp.gpt import PieceAttention, piece_forward
from labkit.strategies.ulysses.attention import ulysses_attention

__all__ = ["UlyssesCausalSelfAttention", "UlyssesTinyGPT", "parallelize_ulysses"]

LAYOUT = "contiguous"  # Ulysses' attention sees whole sequences: no causal imbalance to even out


class _UlyssesAttention(PieceAttention):
    """Attention by Ulysses' all-to-all pair over the ulysses group."""

    _ulysses_group: Any

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ulysses_attention(q, k, v, causal=True, group=self._ulysses_group)


class UlyssesCausalSelfAttention(_UlyssesAttention, CausalSelfAttention):
    pass


def parallelize_ulysses(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """In place: every block's attention runs ulysses_attention over `group`; returns model.
    Refuses a head count the group does not divide (each rank attends with heads / n heads)."""
    if isinstance(model, UlyssesTinyGPT):
        raise ValueError("parallelize_ulysses: the model is already parallelized")
    if not isinstance(model, TinyGPT):
        raise TypeError(
            f"parallelize_ulysses: Ulysses here runs TinyGPT (labkit.models), got a {type(model).__name__}"
        )
    _, n = group_info(group)
    heads = model.config.n_heads
    if heads % n:
        raise ValueError(
            f"ulysses: n_heads={heads} does not split over ulysses={n} ranks (each rank attends "
            f"with n_heads / ulysses whole heads): pick a degree that divides {heads}"
        )
    for block in model.blocks:
        if type(block.attn) is not CausalSelfAttention:
            raise TypeError(
                f"parallelize_ulysses: a block's attention is a {type(block.attn).__name__} (already split?)"
            )
    for block in model.blocks:
        setattr(block.attn, "_ulysses_group", group)
        block.attn.__class__ = UlyssesCausalSelfAttention
    setattr(model, "_ulysses_group", group)
    model.__class__ = UlyssesTinyGPT
    return model


class UlyssesTinyGPT(TinyGPT):
    """A TinyGPT after parallelize_ulysses: forward(idx, targets, reduction) on this rank's piece
    of the whole rows idx (B, T): (logits of the piece (B, T/n, vocab), the loss of the piece's
    tokens (reduction "sum" or "mean" over them) or None)."""

    _ulysses_group: Any

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return piece_forward(self, idx, targets, reduction, (self._ulysses_group, LAYOUT))

    def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Refused: each rank's forward sees only its piece of the sequence."""
        raise NotImplementedError(
            "generate() on a Ulysses model (parallelize_ulysses): each rank's forward runs on its "
            "piece of the sequence, so the next token would differ from rank to rank; load the "
            "trained weights into a plain TinyGPT (labkit.models) and generate there"
        )
