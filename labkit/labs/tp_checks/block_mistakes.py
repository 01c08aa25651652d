"""Exercise 3's mistakes, recognised by their numbers: what the TP attention computes with a
head layout or causal mask gone wrong, what the MLP computes with another activation or the GELU
after the sum, and why a layer's piece is not its TP piece (the other split, the world rank's
piece, the whole weight). check_blocks names the first one that matches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.labs import tp_lab
from labkit.labs.tp_checks.shared import TP, WORLD_RANK

SUBS = {"attention": ("attn", ("q", "k", "v", "o")), "MLP": ("mlp", ("fc1", "fc2"))}


def _attention_sim(attn, x, causal=True, split="view", merge="transpose"):
    """What TP attention on TP ranks computes (full weights, cut per rank), with a head layout
    (split: how q / k / v become (B, heads, T, head_dim); merge: how the heads go back to
    (B, T, d)) and the causal mask as given: the correct one, or a mistake's."""
    B, T, _ = x.shape
    hd, total = attn.head_dim, 0
    for r in range(TP):
        proj = [
            F.linear(
                x,
                *(
                    tp_lab.tp_piece(getattr(attn, n).get_parameter(a).detach(), f"attn.{n}.{a}", r, TP)
                    for a in ("weight", "bias")
                ),
            )
            for n in ("q", "k", "v")
        ]
        heads = proj[0].shape[-1] // hd
        if split == "view":
            qkv = [p.view(B, T, heads, hd).transpose(1, 2) for p in proj]
        elif split == "no transpose":
            qkv = [p.view(B, heads, T, hd) for p in proj]
        else:  # "head_dim first"
            qkv = [p.view(B, T, hd, heads).permute(0, 3, 1, 2) for p in proj]
        y = F.scaled_dot_product_attention(*qkv, is_causal=causal)
        y = y.transpose(1, 2).reshape(B, T, -1) if merge == "transpose" else y.reshape(B, T, -1)
        w = tp_lab.tp_piece(attn.o.weight.detach(), "attn.o.weight", r, TP)
        total = total + F.linear(y, w)
    return total + attn.o.bias.detach()


ATTENTION_MISTAKES = (
    (
        dict(causal=False),
        "attention: the causal mask is missing: F.scaled_dot_product_attention(q, k, v, is_causal=True), as the original",
    ),
    (
        dict(split="no transpose"),
        "attention: the heads are grouped wrong: q(x) is (B, T, heads x head_dim), each token's row "
        "holding its heads side by side; view(B, T, heads, head_dim).transpose(1, 2), not view(B, heads, T, head_dim)",
    ),
    (
        dict(split="head_dim first"),
        "attention: the heads are grouped wrong: the original's layout is head-major, "
        "view(B, T, heads, head_dim) (head h is columns [h*head_dim, (h+1)*head_dim)), not (B, T, head_dim, heads)",
    ),
    (
        dict(merge="reshape"),
        "attention: the heads are merged back wrong: y is (B, heads, T, head_dim); "
        "y.transpose(1, 2).reshape(B, T, heads * head_dim) before o, not y.reshape(B, T, -1)",
    ),
)


def _mlp_sim(mlp, x, act=F.gelu, after=False):
    h = act(F.linear(x, mlp.fc1.weight.detach(), mlp.fc1.bias.detach()))
    if after:
        return act(
            F.linear(
                F.linear(x, mlp.fc1.weight.detach(), mlp.fc1.bias.detach()),
                mlp.fc2.weight.detach(),
                mlp.fc2.bias.detach(),
            )
        )
    return F.linear(h, mlp.fc2.weight.detach(), mlp.fc2.bias.detach())


MLP_MISTAKES = (
    (
        dict(act=lambda t: F.gelu(t, approximate="tanh")),
        "MLP: the tanh approximation of GELU: the original's is the exact one, F.gelu(h) (nn.GELU()'s default)",
    ),
    (dict(act=F.relu), "MLP: ReLU: the original's activation is the exact GELU, F.gelu(h)"),
    (dict(act=lambda t: t), "MLP: the GELU is missing between fc1 and fc2"),
    (
        dict(after=True),
        "MLP: the GELU after fc2's all-reduce: fc1 column, GELU on this rank's hidden columns, fc2 row "
        "(the GELU is elementwise, so it runs before the sum)",
    ),
)

STYLES = {"column": 0, "row": 1}


def _piece_hint(sub, layer, got, full, tp_rank, res):
    """Why layer's piece is not tp_piece's: the other split (column for row or back), the world
    rank's piece, the whole weight."""
    want_style = "column" if tp_lab.PLAN[f"{SUBS[sub][0]}.{layer}"] == "colwise" else "row"
    other = "row" if want_style == "column" else "column"
    if got.shape == full.shape:
        return f"{sub}: {layer} holds the whole weight: it is {want_style}-parallel, this rank keeps its torch.chunk piece"
    if got.dim() == 2 and torch.equal(got, torch.chunk(full, TP, STYLES[other])[tp_rank]):
        swapped = {"fc1": "fc2", "fc2": "fc1"}.get(layer)
        return (
            f"{sub}: {layer} is {want_style}-parallel, yours is {other}-parallel"
            + (" (fc1 and fc2 swapped? fc1 column-parallel, GELU, fc2 row-parallel)" if swapped else "")
            + (
                ": o takes this rank's heads (its d/t input features) and its g sums the partial outputs"
                if layer == "o"
                else ""
            )
        )
    if res["rank"] != tp_rank and res["rank"] < TP:
        dim = STYLES[want_style] if got.dim() == 2 else 0
        if torch.equal(got, torch.chunk(full, TP, dim)[res["rank"]]):
            return WORLD_RANK.format(**res)
    return f"{sub}: {layer} as exercise 2 splits it: ColumnLinear / RowLinear (yours, or labkit's)"
