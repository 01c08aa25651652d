"""The `comm=` option every hand-written strategy takes: which collectives it runs on.

    comm="ring"    labkit's hand-written ones (labkit.comm.collectives / .flat: the ring and the
                   direct exchange, traced, cross-rank checked when verify is on)
    comm="torch"   torch.distributed's (the backend's: gloo's or NCCL's)

Each strategy keeps its own default (what it always ran: DDP torch's all-reduce, ZeRO and FSDP
labkit's), so a run without comm= gives the same numbers as before. Both choices have one
signature, `Collectives`: all_reduce, reduce_scatter, all_gather and all_gather_coalesced with
dist.*'s arguments (op "sum" / "avg"), a handle with wait() when async_op=True, else None.

torch's on gloo, which has no AVG: "avg" divides the input by the group's size first and sums (one
rounding more than dividing the sum, exact for powers of two); NCCL gets ReduceOp.AVG.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from labkit.comm import collectives, flat

COMMS = ("ring", "torch")
Handle = Any  # labkit's CollectiveHandle or torch's Work: both wait()
Group = Optional[Any]


def torch_all_gather() -> Callable[..., Any]:
    """torch's all-gather into one tensor: dist.all_gather_single from torch 2.13 on (its old name,
    all_gather_into_tensor, warns FutureWarning there), all_gather_into_tensor before. Looked up at
    each call: labkit's recorder (observe.recording) patches dist's functions."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def torch_reduce_scatter() -> Callable[..., Any]:
    """torch's reduce-scatter of one tensor: dist.reduce_scatter_single from torch 2.13 on,
    reduce_scatter_tensor (its old name) before; looked up at each call, as torch_all_gather."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Collectives:
    """One choice of collectives (see the module docstring); `name` is the comm= value."""

    name = ""
    # Async ops run in the order issued (labkit's one comm thread), also across groups; torch's
    # run on each group's own threads, so an op reading another's output waits for it first.
    ordered = True

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", group: Group = None, async_op: bool = False
    ) -> Optional[Handle]:
        raise NotImplementedError

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = "sum",
        group: Group = None,
        async_op: bool = False,
    ) -> Optional[Handle]:
        raise NotImplementedError

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False
    ) -> Optional[Handle]:
        raise NotImplementedError

    def all_gather_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        group: Group = None,
        async_op: bool = False,
    ) -> Optional[Handle]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Ring(Collectives):
    """labkit's hand-written collectives; verify: their cross-rank check (None: the global
    labkit.comm.collectives.VERIFY_ACROSS_RANKS)."""

    name = "ring"

    def __init__(self, verify: Optional[bool] = None) -> None:
        self.verify = check_verify(verify, "Ring")

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", group: Group = None, async_op: bool = False
    ) -> Optional[Handle]:
        return collectives.ring_all_reduce(tensor, op=op, group=group, async_op=async_op, verify=self.verify)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = "sum",
        group: Group = None,
        async_op: bool = False,
    ) -> Optional[Handle]:
        return collectives.ring_reduce_scatter(
            output, input, op=op, group=group, async_op=async_op, verify=self.verify
        )

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False
    ) -> Optional[Handle]:
        return collectives.ring_all_gather(output, input, group=group, async_op=async_op, verify=self.verify)

    def all_gather_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        group: Group = None,
        async_op: bool = False,
    ) -> Optional[Handle]:
        return flat.all_gather_coalesced(outputs, inputs, group=group, async_op=async_op, verify=self.verify)

    def __repr__(self) -> str:
        return f"Ring(verify={self.verify!r})"


class Torch(Collectives):
    """torch.distributed's collectives (the module docstring says how "avg" runs on gloo).

    async_op=True overlaps on the default group only; on a subgroup (HSDP's DeviceMesh groups) the
    op runs to completion before it returns (the handle is already done): with several of gloo's
    async ops in flight on the mesh's subgroups, HSDP's gradients came out wrong here (not
    understood; every op run synchronously gave them exactly: tests/test_comm_choice.py)."""

    name = "torch"
    ordered = False

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", group: Group = None, async_op: bool = False
    ) -> Optional[Handle]:
        work = dist.all_reduce(
            tensor, op=_op(tensor, op, group), group=group, async_op=_overlap(group, async_op)
        )
        return _handle(work, async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: str = "sum",
        group: Group = None,
        async_op: bool = False,
    ) -> Optional[Handle]:
        work = torch_reduce_scatter()(
            output, input, op=_op(input, op, group), group=group, async_op=_overlap(group, async_op)
        )
        return _handle(work, async_op)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False
    ) -> Optional[Handle]:
        work = torch_all_gather()(output, input, group=group, async_op=_overlap(group, async_op))
        return _handle(work, async_op)

    def all_gather_coalesced(
        self,
        outputs: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        group: Group = None,
        async_op: bool = False,
    ) -> Optional[Handle]:
        # One all-gather per pair (gloo has no coalesced form); the outputs need not be
        # contiguous with each other, so each lands in place.
        overlap, gather = _overlap(group, async_op), torch_all_gather()
        works = [gather(o, i, group=group, async_op=overlap) for o, i in zip(outputs, inputs)]
        return _All([w for w in works if w is not None]) if async_op else None


def _overlap(group: Group, async_op: bool) -> bool:
    """Whether an async op of torch's may stay in flight (see Torch's docstring)."""
    return async_op and (group is None or group is dist.group.WORLD)


def _handle(work: Any, async_op: bool) -> Optional[Handle]:
    """What the caller asked for: a handle (torch's Work, or a done one) or None."""
    if not async_op:
        return None
    return work if work is not None else _All([])


class _All:
    """Several torch handles as one: wait() waits for every one."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self.handles)

    def wait(self) -> bool:
        for h in self.handles:
            h.wait()
        return True


def _op(tensor: torch.Tensor, op: str, group: Group) -> Any:
    """torch's ReduceOp for op; on a backend without AVG, "avg" divides `tensor` in place first."""
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if op == "sum":
        return dist.ReduceOp.SUM
    if dist.get_backend(group) == "nccl":
        return dist.ReduceOp.AVG
    tensor.div_(dist.get_world_size(group))
    return dist.ReduceOp.SUM


def check_verify(verify: Any, who: str) -> Optional[bool]:
    """verify must be True, False or None (the global default): a string such as 'yes' or 'no'
    would otherwise be read by its truth value ('no' turning the check on)."""
    if verify is not None and not isinstance(verify, bool):
        raise TypeError(
            f"{who}: verify must be True, False or None (labkit's cross-rank check of its "
            f"hand-written collectives; None: labkit.comm.collectives.VERIFY_ACROSS_RANKS), got "
            f"{type(verify).__name__} {verify!r}"
        )
    return verify


def choose(comm: str, who: str, verify: Optional[bool] = None) -> Collectives:
    """The Collectives for comm= of strategy `who`; an unknown value raises naming the choices."""
    check_verify(verify, who)
    if comm == "ring":
        return Ring(verify)
    if comm == "torch":
        if verify:
            raise ValueError(f"{who}: verify= is labkit's cross-rank check; comm='torch' has none")
        return Torch()
    raise ValueError(f"{who}: comm must be one of {', '.join(map(repr, COMMS))}, got {comm!r}")
