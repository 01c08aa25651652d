"""What every hand-written collective does around its algorithm, shared by labkit.comm.collectives,
.flat and .hierarchical as equals: argument checks (torch.distributed's rules, plus AVG on gloo and
clear messages), this rank's place in the group, the choice between the direct exchange and the
ring, the cross-rank check before a ring, and the hand-off to the comm thread (where the tracer
records the call). The knobs (DIRECT_MAX_BYTES, VERIFY_ACROSS_RANKS) stay public in
labkit.comm.collectives; a caller passes their values in. Left out: checks of the process group itself.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from . import _comm_thread, _crosscheck
from ._comm_thread import CollectiveHandle
from ._crosscheck import Mailbox, check_same_call
from ._ring import Ring

Op = Any  # "sum" / "avg" (any case), dist.ReduceOp.SUM / AVG
Group = Optional[Any]  # a torch.distributed ProcessGroup; None: the default group


# ---------------------------------------------------------------- argument checks


def resolve_op(op: Op, dtype: torch.dtype, name: str) -> str:
    """ "sum" or "avg" for op; raises naming the choices (and AVG of an integer tensor, as NCCL)."""
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


def check_tensor(t: Any, what: str, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.bool:
        raise TypeError(f"{name}: {what} has dtype torch.bool, which cannot be summed")


def check_pair(output: torch.Tensor, input: torch.Tensor, name: str) -> None:
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


# ---------------------------------------------------------------- this rank's place

_seen_default_group = False  # this process has had a default process group


def group_info(group: Group) -> tuple[int, int]:
    """(rank, world_size) in `group`; outside torch.distributed (a plain process, a test), a world
    of one. Not after dist.destroy_process_group(), nor in a labkit.run rank or under torchrun:
    there "no default group" is a mistake, and dist.all_reduce raises for it, so do we (running as
    a world of one would return the input as if it were the sum)."""
    global _seen_default_group
    if group is None and not dist.is_initialized():
        if _seen_default_group or _in_a_launched_rank():
            raise RuntimeError(
                "Default process group has not been initialized (or was destroyed "
                "by dist.destroy_process_group()), please make sure to call "
                "init_process_group."
            )
        return 0, 1
    _seen_default_group = _seen_default_group or dist.is_initialized()
    rank = dist.get_rank(group)
    if rank < 0:  # torch's collectives warn and do nothing here; a hand-written ring would fail
        raise ValueError(
            f"this rank (global rank {dist.get_rank()}) is not a member of the group "
            f"passed (ranks {dist.get_process_group_ranks(group)}): call a group's "
            f"collective only on its members"
        )
    return rank, dist.get_world_size(group)


def _in_a_launched_rank() -> bool:
    """A process labkit.run or torchrun started as a rank (what each sets in the environment)."""
    env = os.environ
    return env.get("LABKIT_WORKER") == "1" or all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def ring_for(group: Group, rank: int, world_size: int, device: torch.device) -> Ring:
    """The ring of `group` as seen from `rank` (torch's p2p calls take global ranks)."""

    def global_rank(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    return Ring(
        rank=rank,
        world_size=world_size,
        group=group,
        device=device,
        next=global_rank((rank + 1) % world_size),
        prev=global_rank((rank - 1) % world_size),
        to_global=global_rank,
    )


# ---------------------------------------------------------------- which algorithm, and the check


def direct_limit(direct_max_bytes: int) -> int:
    """The direct exchange's largest message: DIRECT_MAX_BYTES capped by the receive every rank
    posts (_crosscheck.INLINE_CAP_BYTES)."""
    return max(0, min(direct_max_bytes, _crosscheck.INLINE_CAP_BYTES))


def plan(
    kind: str,
    op: Optional[str],
    t: torch.Tensor,
    numel_in: int,
    numel_out: int,
    message_bytes: int,
    where: tuple[Group, int, int],
    direct_max_bytes: int,
) -> tuple[Optional[tuple], Optional[Mailbox]]:
    """(header, mailbox) when this call takes the direct exchange, else (None, None); where:
    (group, rank, n), the call's group and this rank's place in it."""
    group, rank, n = where
    limit = direct_limit(direct_max_bytes)
    if n == 1 or t.device.type != "cpu" or message_bytes > limit:
        return None, None
    header = (
        _crosscheck.MAGIC,
        *_crosscheck.call_fields(kind, op, t.dtype, numel_in, numel_out),
        limit,
        message_bytes,
    )
    return header, _crosscheck.mailbox(group, rank, n)


def verify_on(verify: Optional[bool], default: bool) -> bool:
    """A call's verify= (None: the global VERIFY_ACROSS_RANKS, passed in as `default`)."""
    return default if verify is None else verify


def check(
    ring: Ring,
    kind: str,
    op: Optional[str],
    dtype: torch.dtype,
    numel_in: int,
    numel_out: int,
    direct_max_bytes: int,
) -> None:
    """The cross-rank check before a ring (every rank called the same collective, or all raise)."""
    check_same_call(ring, kind, op, dtype, numel_in, numel_out, direct_limit(direct_max_bytes))


# ---------------------------------------------------------------- the hand-off


def submit(
    job: Callable[[], Any],
    name: str,
    rank: int,
    nbytes: int,
    world_size: int,
    async_op: bool,
    device: torch.device,
) -> Optional[CollectiveHandle]:
    """Run `job` on the comm thread, traced as collective `name` of `nbytes`: a handle with
    async_op=True, else None once it is done."""

    def run(inner: Callable[[], Any] = job) -> None:
        # Like dist.*: work on parameters that require grad without autograd seeing it (grad
        # mode is per thread, so this also covers the comm thread).
        with torch.no_grad():
            inner()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # wait() means "done", on CUDA too

    return _comm_thread.submit(
        run, op_name=name, rank=rank, nbytes=nbytes, world_size=world_size, async_op=async_op
    )
