"""clip_grad_norm_ over a pipeline: torch.nn.utils.clip_grad_norm_ with the norm of the WHOLE
model's gradient, every stage's part of it added over the pipeline's ranks.

    total = clip_grad_norm_(pipe.parameters(), max_norm=1.0)     # every rank of the pipeline

Each rank holds only its stages' gradients, so torch's clip_grad_norm_ on them clips by that stage's
norm: a different factor on every stage, not one process's. Here each rank adds the norm_type-th
powers of its gradients' norms, they are summed over `group` (max / min for inf / -inf), and every
rank clips by the same total, the one process's (torchtitan's clip_grad_norm_ for pipelines does
the same). A weight tied across stages (held by several ranks, its gradient already summed by the
pipeline) counts once: on its first holder (pipeline_by_hand marks the others).

Returns the total norm (a tensor, the same on every rank), as torch's. Every rank of the group
calls it, at the same point (a collective, untraced: a scalar). What it leaves out: DTensor
gradients (torch's own handles those), a pipeline whose parameters are also sharded over dp
(pp-zero1's gradients are reduce-scattered inside its step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from labkit.observe import tracing
from labkit.strategies.pp.runtime import COUNTED_ELSEWHERE, GRADS_ELSEWHERE

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    group: Any = None,
) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ with the norm taken over every rank of `group` (None: the
    world): this rank's `parameters` are its stages'; returns the global total norm."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    if math.isnan(norm_type) or (norm_type < 0 and norm_type != -math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type must be >= 0, inf or -inf, got {norm_type}")
    for p in params:
        if p in GRADS_ELSEWHERE:
            raise TypeError(
                f"clip_grad_norm_: under {GRADS_ELSEWHERE[p]!r} the reduced gradients live in ZeRO-1's "
                f"flat shard after after_backward, not in the parameters' .grad (a norm over them "
                f"would be 0 or one rank's part): call the strategy's own s.clip_grad_norm_(max_norm)"
            )
        if hasattr(p.grad, "placements"):
            raise TypeError(
                "clip_grad_norm_: this pipeline's stages hold DTensor gradients (tensor- or "
                "FSDP-sharded, e.g. fsdp-tp-pp), which this clip leaves out: call the strategy's own "
                "s.clip_grad_norm_(max_norm), which takes the whole model's norm on any layout"
            )
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and p not in COUNTED_ELSEWHERE]
    device = grads[0].device if grads else torch.device("cpu")
    dtype = grads[0].dtype if grads else torch.float32
    norms = [torch.linalg.vector_norm(g.detach(), norm_type).to(torch.float64) for g in counted]
    if norm_type == math.inf:
        local, op = (
            (torch.stack(norms).max() if norms else torch.tensor(0.0, dtype=torch.float64)),
            dist.ReduceOp.MAX,
        )
    elif norm_type == -math.inf:
        local = torch.stack(norms).min() if norms else torch.tensor(math.inf, dtype=torch.float64)
        op = dist.ReduceOp.MIN
    elif norm_type == 0:
        local, op = (
            torch.stack(norms).sum() if norms else torch.tensor(0.0, dtype=torch.float64),
            dist.ReduceOp.SUM,
        )
    else:
        powers = [n**norm_type for n in norms]
        local = torch.stack(powers).sum() if powers else torch.tensor(0.0, dtype=torch.float64)
        op = dist.ReduceOp.SUM
    total = local.to(device).clone()
    with tracing.untraced():
        dist.all_reduce(total, op=op, group=group)
    if norm_type not in (0, math.inf, -math.inf):
        total = total ** (1.0 / norm_type)
    total = total.to(dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
            f"cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
            f"anyway, set `error_if_nonfinite=False`"
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total
