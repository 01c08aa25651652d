"""Argument checks shared by labkit.comm.collectives' public functions (torch.distributed's rules,
plus AVG on gloo and clear messages). Left out: checks of the process group itself."""

import torch
import torch.distributed as dist


def resolve_op(op, dtype, name):
    if isinstance(op, str):
        key = op.lower()
    elif op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        key = "sum" if op == dist.ReduceOp.SUM else "avg"
    else:
        key = None
    if key not in ("sum", "avg"):
        raise ValueError(f"{name}: op must be 'sum', 'avg', ReduceOp.SUM or ReduceOp.AVG, got {op!r}")
    if key == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{name}: op='avg' needs a floating-point tensor, got {dtype}")
    return key


def check_tensor(t, what, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.bool:
        raise TypeError(f"{name}: {what} has dtype torch.bool, which cannot be summed")


def check_pair(output, input, name):
    """Shared checks for output/input buffer pairs (reduce-scatter, all-gather)."""
    check_tensor(output, "output", name)
    check_tensor(input, "input", name)
    if output.dtype != input.dtype:
        raise TypeError(f"{name}: output dtype {output.dtype} differs from input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{name}: output is on {output.device} but input is on {input.device}")
    for what, t in (("output", output), ("input", input)):
        if not t.is_contiguous():
            raise ValueError(
                f"{name}: {what} must be contiguous (got shape {tuple(t.shape)}, "
                f"stride {t.stride()}); pass .contiguous() or a fresh buffer"
            )
