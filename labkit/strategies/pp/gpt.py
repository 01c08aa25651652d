"""The course's TinyGPT as an nn.Sequential for the pipeline: [embedding, block 0, ..., head].

    seq = gpt_sequential(model)      # seq(idx) == model(idx)[0]: the logits, same bits

The embedding (token + position, what TinyGPT's forward adds) is the first child and the head
(ln_f then lm_head) the last, so a pipeline split puts them on the first and the last stage; the
loss (gpt_loss) runs on the last stage after the head. Every child holds TinyGPT's own modules,
so the head's weight is still the embedding's (one Parameter: the pipeline sums its two stages'
gradients). What it leaves out: other models (a pipeline takes any nn.Sequential directly).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class GPTEmbedding(nn.Module):
    """TinyGPT's tok_emb(idx) + pos_emb(positions), on the model's own embeddings."""

    tok_emb: nn.Embedding
    pos_emb: nn.Embedding

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.seq_len: int = model.config.seq_len

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        time = idx.shape[1]
        if time > self.seq_len:
            raise ValueError(f"{time} tokens is longer than seq_len={self.seq_len}")
        return self.tok_emb(idx) + self.pos_emb(torch.arange(time, device=idx.device))


class GPTHead(nn.Module):
    """TinyGPT's lm_head(ln_f(h)): the logits."""

    ln_f: nn.LayerNorm
    lm_head: nn.Linear

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(h))


def gpt_sequential(model: Any) -> nn.Sequential:
    """[GPTEmbedding, *model.blocks, GPTHead] on TinyGPT `model`'s own modules."""
    if not all(hasattr(model, a) for a in ("tok_emb", "pos_emb", "blocks", "ln_f", "lm_head")):
        raise TypeError(f"gpt_sequential takes the course's TinyGPT, got {type(model).__name__}")
    return nn.Sequential(GPTEmbedding(model), *model.blocks, GPTHead(model))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """TinyGPT's loss on its logits (the same expression as its forward: fp32 at least)."""
    wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    return F.cross_entropy(wide.reshape(-1, wide.shape[-1]), targets.reshape(-1), reduction=reduction)
