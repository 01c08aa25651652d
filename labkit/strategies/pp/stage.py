"""The stage split: an nn.Sequential's children cut into consecutive model chunks.

    chunks = split_sequential(model, 4)     # [model[0:2], model[2:4], model[4:5], model[5:6]]

Each chunk is `model[a:b]`, an nn.Sequential holding the model's OWN child modules (no copies), so
`model.named_parameters()` still names every parameter a stage trains, and an optimizer over a
chunk's parameters updates the model. Children are dealt out as evenly as their count allows,
the first chunks taking one more (torch.tensor_split's rule); a child is never cut in two.

What it leaves out: balancing by parameter count or compute (Megatron splits transformer layers
evenly too, and the embedding/head stages are usually the odd ones), cutting inside a child.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn as nn


def check_sequential(model: object, n_chunks: int, where: str = "pipeline_by_hand") -> nn.Sequential:
    """`model` if it is an nn.Sequential with at least `n_chunks` children, else an error naming why."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"{where}: the model must be an nn.Sequential (its children are cut into stages), got "
            f"{type(model).__name__}; wrap the layers in nn.Sequential (TinyGPT: "
            f"labkit.strategies.pp.gpt_sequential)"
        )
    if type(model).forward is not nn.Sequential.forward:
        # The split runs the children one after another: a forward of the subclass's own (a
        # residual around them, say) would silently be skipped, giving another model's loss.
        raise TypeError(
            f"{where}: {type(model).__name__} subclasses nn.Sequential with a forward of its own; the "
            f"pipeline runs only its children, one after another, so that forward would be skipped "
            f"(a wrong loss and gradients). Make what it adds a child module (e.g. a residual "
            f"block as one child), or pass a plain nn.Sequential"
        )
    if len(model) < n_chunks:
        raise ValueError(
            f"{where}: the nn.Sequential has {len(model)} children but the pipeline needs "
            f"{n_chunks} chunks (stages x virtual_stages), each at least one child"
        )
    return model


def bounds(n_children: int, n_chunks: int) -> list[tuple[int, int]]:
    """[(start, stop), ...] of each chunk's children: consecutive, sizes differing by at most one."""
    base, extra = divmod(n_children, n_chunks)
    out, start = [], 0
    for c in range(n_chunks):
        stop = start + base + (1 if c < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def split_sequential(model: nn.Sequential, n_chunks: int) -> list[nn.Sequential]:
    """The model's children in `n_chunks` consecutive chunks (model[a:b]: the same modules)."""
    check_sequential(model, n_chunks)
    return [cast(nn.Sequential, model[a:b]) for a, b in bounds(len(model), n_chunks)]


def unique_parameters(modules: Sequence[nn.Module]) -> list[torch.nn.Parameter]:
    """The parameters of `modules`, each once (a weight tied inside them counted once), in order."""
    seen: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())
