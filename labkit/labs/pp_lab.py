"""Pipeline-parallel lab helpers: the lab's model (an nn.Sequential of Linear + Tanh layers with
odd widths, float64), the scaffolding a learner's schedule drives (`Stage`: one model chunk on
this rank, its traced point-to-point send / recv, its recorded forward / backward slots and the
activations it holds), the exercises' references (the stage split, one micro-batch forward and
backward, GPipe, 1F1B, interleaved 1F1B, the ZB-H1 order), the oracle (torch.distributed.pipelining's
ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B with scale_grads=False), one process's
gradients, and the measurements (the bubble replayed from the recorded slot order, live
activations, P2P bytes, the timeline figure).

    run_schedule(gpipe, p=2, m=4)          # rank function: the schedule on this rank's stage(s)
    replay(logs, p)                        # unit-time replay of the recorded order -> bubble

Send and recv: `stage.send(t, to_stage, mb)` posts the send and returns (it holds a copy, so the
activation it came from can be freed); the rank waits for all its sends at the end of the
schedule. `stage.recv(from_stage, mb)` blocks until the matching send arrives. Messages are
tagged with (micro-batch, from, to): a recv matches only its own send, so a wrong order or a
missing message cannot mix tensors up: it times out (P2P_TIMEOUT) and says what it waited for.
(gloo's own send blocks until the receiver posts its recv: two neighbours that both send first
deadlock; torch's schedules post isend / irecv and wait later, as here.)

Stage s lives on rank s % p of the pipeline group (interleaved: rank r holds stages r, r + p, ...).
Left out: tied weights across stages, running a zero-bubble schedule on the lab's Stage (its
order is exercise 9, replayed; labkit.strategies.pp runs it: "zb-h1", "zbv"), uneven
micro-batches, and compute-time-weighted stage splits (children are split by count).
The checks are pp_checks.py; the choice between layouts is pp_choice.py.
"""

from __future__ import annotations

import datetime
import re
import weakref
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.strategies.pp import schedule as pp_schedule

if TYPE_CHECKING:  # matplotlib is imported by the figure helper only
    from matplotlib.figure import Figure

WIDTHS = (6, 10, 9, 11, 8, 10, 7, 9, 5)  # 8 layers, odd widths: a shape bug shows
ROWS = 12  # the global batch's rows (12 = 4 micro-batches of 3, 2 of 6, 6 of 2)
P2P_TIMEOUT = 20.0  # seconds a recv (or the final wait for sends) waits before it calls a deadlock
DTYPE = torch.float64


# ---------------------------------------------------------------- the model and data
def make_model(seed: int = 0, widths: tuple[int, ...] = WIDTHS) -> nn.Sequential:
    """nn.Sequential of len(widths) - 1 children, each nn.Sequential(Linear, Tanh), float64;
    the fourth Linear has no bias (a bias-free layer in the middle)."""
    torch.manual_seed(seed)
    layers = [
        nn.Sequential(nn.Linear(a, b, bias=i != 3), nn.Tanh())
        for i, (a, b) in enumerate(zip(widths, widths[1:]))
    ]
    return nn.Sequential(*layers).to(DTYPE)


def batch(
    step: int = 0, rows: int = ROWS, widths: tuple[int, ...] = WIDTHS
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return (
        torch.randn(rows, widths[0], generator=g, dtype=DTYPE),
        torch.randn(rows, widths[-1], generator=g, dtype=DTYPE),
    )


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The micro-batch's loss: the mean squared error over its rows (the step's loss is the sum
    over micro-batches, as torch's schedules with scale_grads=False)."""
    return F.mse_loss(out, target)


def one_process_grads(
    model: nn.Sequential, x: torch.Tensor, target: torch.Tensor, m: int
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """{name: gradient} of sum over the m micro-batches of loss_fn, in one process; the losses."""
    model.zero_grad(set_to_none=True)
    losses = []
    for xb, yb in zip(x.chunk(m), target.chunk(m)):
        loss = loss_fn(model(xb), yb)
        loss.backward()
        losses.append(loss.item())
    return {n: p.grad.clone() for n, p in model.named_parameters()}, losses


# ---------------------------------------------------------------- exercise 1's split
def stage_range(n_children: int, n_stages: int, index: int) -> tuple[int, int]:
    """[start, end) of the children on stage `index`: as even as can be, the first
    n_children % n_stages stages one more (torch.tensor_split's rule)."""
    base, extra = divmod(n_children, n_stages)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def stage_module(model: nn.Sequential, group: Any = None) -> nn.Sequential:
    """Exercise 1's reference: this rank's stage, an nn.Sequential of the model's OWN children
    (not copies) for stage dist.get_rank(group) of dist.get_world_size(group)."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    start, end = stage_range(len(model), p, rank)
    return nn.Sequential(*[model[i] for i in range(start, end)])


def chunk_indices(p: int, v: int, rank: int) -> list[int]:
    """Exercise 4's reference: the stages (model chunks) rank `rank` holds when the model is cut
    into v * p chunks, round-robin: rank, rank + p, ..., rank + (v - 1) * p (labkit's strategy's
    `chunks_of`, the same assignment)."""
    return pp_schedule.chunks_of(rank, p, v)


# ---------------------------------------------------------------- the scaffolding
class PipeTimeout(RuntimeError):
    """A recv (or the wait for a send) timed out: the schedule's order has a deadlock."""


class Record:
    """One rank's record of a schedule: the F / B slots in the order they ran, the live
    activations at the start of each slot, and the point-to-point messages."""

    def __init__(self) -> None:
        self.slots: list[tuple[str, int, int]] = []  # (kind "F" / "B", micro-batch, stage)
        self.live: list[tuple[int, int]] = []  # (micro-batches held, bytes) at each slot's start
        self.sent: list[tuple[int, int, int, int]] = []  # (micro-batch, from, to, bytes)
        self._acts: list[tuple[int, int, list]] = []  # (stage, micro-batch, weakrefs to tensors)
        self._pending: list[tuple[Any, torch.Tensor, str]] = []

    def held(self) -> tuple[int, int]:
        """(micro-batches whose activations this rank still holds, their bytes: distinct storages)."""
        mbs, storages = set(), {}
        for stage, mb, refs in self._acts:
            for ref in refs:
                t = ref()
                if t is not None:
                    mbs.add((stage, mb))
                    s = t.untyped_storage()
                    storages[s.data_ptr()] = s.nbytes()
        return len(mbs), sum(storages.values())


class Stage:
    """One stage (model chunk) of a pipeline on this rank: what a learner's schedule drives.

    index, n: this stage's place among the n stages; is_first, is_last; module; in_shape,
    out_shape: a micro-batch's input and output. forward(mb, inp) and backward(mb, out, grad) run the chunk and record the
    slot; send / recv talk to the neighbouring stages (see the module's docstring)."""

    def __init__(
        self,
        module: nn.Module,
        index: int,
        n: int,
        group: Any,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        record: Record,
        timeout: float = P2P_TIMEOUT,
    ):
        self.module, self.index, self.n, self.group = module, index, n, group
        self.record, self.timeout = record, timeout
        self.dtype = next((p.dtype for p in module.parameters()), DTYPE)  # what the stage computes in
        self.is_first, self.is_last = index == 0, index == n - 1
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self._p = dist.get_world_size(group)

    def __repr__(self) -> str:
        return f"Stage(index={self.index}, n={self.n}, module={self.module})"

    # -------- compute
    def forward(self, mb: int, inp: torch.Tensor) -> torch.Tensor:
        """Run this stage on micro-batch mb's input; records an F slot and the activations kept."""
        from labkit.observe import tracing

        self._slot("F", mb)
        params = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        refs: list = []

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                refs.append(weakref.ref(t))
            return t

        with tracing.span(f"F{mb}"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.module(inp)
        if not self.is_first or inp.requires_grad:
            refs.append(weakref.ref(inp))
        refs.append(weakref.ref(out))
        if self.is_first:  # the data is not an activation: it lives for the whole step anyway
            data = inp.untyped_storage().data_ptr()
            refs = [r for r in refs if r() is not None and r().untyped_storage().data_ptr() != data]
        self.record._acts.append((self.index, mb, refs))
        return out

    def backward(self, mb: int, out: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Backward of micro-batch mb from `out` (the loss on the last stage: grad None; else this
        stage's output, with the gradient received from the next stage); records a B slot."""
        from labkit.observe import tracing

        self._slot("B", mb)
        with tracing.span(f"B{mb}"):
            torch.autograd.backward(out, grad)

    def _slot(self, kind: str, mb: int) -> None:
        self.record.live.append(self.record.held())
        self.record.slots.append((kind, mb, self.index))

    # -------- point to point
    def _peer(self, stage: int, what: str) -> int:
        if stage not in (self.index - 1, self.index + 1) or not 0 <= stage < self.n:
            raise ValueError(
                f"stage {self.index} {what} stage {stage}: a stage talks to its neighbours only, "
                f"stages {[s for s in (self.index - 1, self.index + 1) if 0 <= s < self.n]}"
            )
        return (
            dist.get_global_rank(self.group, stage % self._p) if self.group is not None else stage % self._p
        )

    def _tag(self, mb: int, src: int, dst: int) -> int:
        return (mb * self.n + src) * self.n + dst

    def send(self, tensor: torch.Tensor, to_stage: int, mb: int) -> None:
        """Send micro-batch mb's activation (to_stage = index + 1) or its input's gradient
        (to_stage = index - 1). Returns at once; the rank waits for its sends at the end."""
        from labkit.comm import _link
        from labkit.observe import tracing

        dst = self._peer(to_stage, "sends to")
        want = self.out_shape if to_stage == self.index + 1 else self.in_shape
        what = "activation" if to_stage == self.index + 1 else "input gradient"
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != want:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(
                f"stage {self.index} sends stage {to_stage} a tensor of shape {got}; "
                f"the {what} of a micro-batch is {want}"
            )
        buf = tensor.detach().to(self.dtype).clone().contiguous()  # the send's own copy
        nbytes = buf.numel() * buf.element_size()
        with tracing.record_collective("p2p_send", nbytes, 2, label=f"send {what} {mb}"):
            _link.sending([dst], nbytes)
            work = dist.isend(buf, dst, tag=self._tag(mb, self.index, to_stage))
        self.record.sent.append((mb, self.index, to_stage, nbytes))
        self.record._pending.append(
            (work, buf, f"stage {self.index}'s {what} of micro-batch {mb} to stage {to_stage}")
        )

    def recv(self, from_stage: int, mb: int) -> torch.Tensor:
        """Receive micro-batch mb's activation (from_stage = index - 1) or its output's gradient
        (from_stage = index + 1): a new tensor. Blocks; raises PipeTimeout after `timeout` s."""
        from labkit.observe import tracing

        src = self._peer(from_stage, "receives from")
        shape = self.in_shape if from_stage == self.index - 1 else self.out_shape
        what = "activation" if from_stage == self.index - 1 else "output gradient"
        buf = torch.empty(shape, dtype=self.dtype)
        with tracing.record_collective(
            "p2p_recv", buf.numel() * buf.element_size(), 2, label=f"recv {what} {mb}"
        ):
            work = dist.irecv(buf, src, tag=self._tag(mb, from_stage, self.index))
            _wait(
                work,
                self.timeout,
                f"stage {self.index} waited {self.timeout:g} s for the {what} "
                f"of micro-batch {mb} from stage {from_stage}, which never came",
            )
        return buf


def _wait(work, timeout: float, message: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        if "Timed out" in str(exc) or "timed out" in str(exc):
            raise PipeTimeout(
                message + " (a deadlock: a recv without its matching send, or a send without its recv)"
            ) from None
        if "Connection closed" in str(exc) or "pair closure" in str(exc):
            # gloo closes a rank's connections when one of its waits times out: the cause is there
            where = re.sub(r" waited \S+ s for", " waiting for", message)
            where = where.replace(", which never came", "").replace(" was never received", "")
            raise PipeTimeout(f"{where}: cut off while waiting, another rank gave up first") from None
        raise


def finish(record: Record, timeout: float = P2P_TIMEOUT) -> None:
    """Wait for this rank's sends (each must have met its recv)."""
    for work, _buf, what in record._pending:
        _wait(work, timeout, f"{what} was never received")
    record._pending.clear()


# ---------------------------------------------------------------- exercise references
def forward_step(stage: Stage, mb: int, x: torch.Tensor, target: torch.Tensor, loss_fn=loss_fn):
    """Exercise 1's reference, one micro-batch's forward on this stage: returns (input, output);
    on the last stage the output is the micro-batch's loss."""
    if stage.is_first:
        inp = x
    else:
        inp = stage.recv(stage.index - 1, mb).requires_grad_()
    out = stage.forward(mb, inp)
    if stage.is_last:
        out = loss_fn(out, target)
    else:
        stage.send(out, stage.index + 1, mb)
    return inp, out


def backward_step(stage: Stage, mb: int, inp: torch.Tensor, out: torch.Tensor) -> None:
    """Exercise 1's reference, one micro-batch's backward on this stage."""
    grad = None if stage.is_last else stage.recv(stage.index + 1, mb)
    stage.backward(mb, out, grad)
    if not stage.is_first:
        stage.send(inp.grad, stage.index - 1, mb)


def gpipe(stage: Stage, xs, targets, loss_fn=loss_fn, fwd=forward_step, bwd=backward_step) -> list:
    """Exercise 2's reference: every micro-batch's forward, then every backward (same order)."""
    held, losses = {}, []
    for i in range(len(xs)):
        held[i] = fwd(stage, i, xs[i], targets[i], loss_fn)
    for i in range(len(xs)):
        inp, out = held.pop(i)  # popped: freed once its backward is done
        if stage.is_last:
            losses.append(out.detach())
        bwd(stage, i, inp, out)
    return losses


def one_f_one_b(stage: Stage, xs, targets, loss_fn=loss_fn, fwd=forward_step, bwd=backward_step) -> list:
    """Exercise 3's reference: p - index - 1 warm-up forwards, then one forward and one backward
    at a time, then the remaining backwards (cool-down)."""
    m = len(xs)
    warmup = min(stage.n - stage.index - 1, m)
    held, losses = {}, []

    def backward(i):
        inp, out = held.pop(i)
        if stage.is_last:
            losses.append(out.detach())
        bwd(stage, i, inp, out)

    for i in range(warmup):
        held[i] = fwd(stage, i, xs[i], targets[i], loss_fn)
    for i in range(m - warmup):
        held[i + warmup] = fwd(stage, i + warmup, xs[i + warmup], targets[i + warmup], loss_fn)
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    return losses


def interleaved_order(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """Exercise 4's reference, Megatron's interleaved 1F1B order on `rank`: [(kind, micro-batch,
    chunk k)] where chunk k is stage rank + k * p. Forwards go in groups of p micro-batches, chunk
    by chunk; backwards the same with the chunks reversed; warm-up (p - rank - 1) * 2 + (v - 1) * p
    forwards, or every forward when m == p. The order is labkit's strategy's
    (labkit.strategies.pp.schedule.order), in the exercise's (kind, micro-batch, k) form."""
    return [
        (a.kind, a.microbatch, (a.chunk - rank) // p) for a in pp_schedule.order("interleaved", rank, p, m, v)
    ]


def zb_h1_order(p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """Exercise 9's reference, ZB-H1 on `rank` (one stage per rank): [(kind, micro-batch)], kind
    "F", "B" (the input's gradient) or "W" (the weights' gradient). 1F1B's warm-up (p - rank - 1
    forwards, capped at m), then forward, B per step, each B followed by a W from the (rank + 1)-th
    B on: rank r runs W(k) after B(k + r), and its r deferred W's after its last B. The order is
    labkit's strategy's (labkit.strategies.pp.schedule.order("zb-h1", ...))."""
    return [(a.kind, a.microbatch) for a in pp_schedule.order("zb-h1", rank, p, m)]


def interleaved(
    stages: list[Stage],
    xs,
    targets,
    loss_fn=loss_fn,
    fwd=forward_step,
    bwd=backward_step,
    order=interleaved_order,
) -> list:
    """Exercise 4's reference: interleaved 1F1B over this rank's v stages (chunks)."""
    p = stages[0]._p
    rank = stages[0].index % p
    held, losses = {}, []
    for kind, mb, k in order(p, len(stages), len(xs), rank):
        stage = stages[k]
        if kind == "F":
            held[mb, k] = fwd(stage, mb, xs[mb], targets[mb], loss_fn)
        else:
            inp, out = held.pop((mb, k))
            if stage.is_last:
                losses.append(out.detach())
            bwd(stage, mb, inp, out)
    return losses


# ---------------------------------------------------------------- running a schedule
def make_stages(
    model: nn.Sequential,
    indices: list[int],
    n: int,
    group: Any,
    rows: int,
    record: Record,
    timeout: float = P2P_TIMEOUT,
) -> list[Stage]:
    """Stage objects for the stages `indices` of n of the lab's model (its Linear + Tanh
    children split by stage_range), micro-batches of `rows` rows."""
    widths = [model[0][0].in_features] + [child[0].out_features for child in model]
    out = []
    for s in indices:
        start, end = stage_range(len(model), n, s)
        module = nn.Sequential(*[model[i] for i in range(start, end)])
        out.append(Stage(module, s, n, group, (rows, widths[start]), (rows, widths[end]), record, timeout))
    return out


def run_schedule(
    schedule: Callable,
    m: int = 4,
    v: int = 1,
    *,
    mesh_dims: tuple[str, ...] | None = None,
    rows: int = ROWS,
    seed: int = 0,
    timeout: float = P2P_TIMEOUT,
    **kwargs,
) -> dict:
    """Rank function: one step of `schedule` on this rank's stage(s) of make_model(seed), the
    whole world one pipeline (or, with mesh_dims such as ("dp", "pp"), a 2 x 2 mesh: each dp
    replica its half of the batch, the step's loss the sum over both). Returns {"grads": this
    rank's stages' {name in the whole model: gradient}, "losses", "slots", "live", "sent",
    "held_after", "window": (start, end) on the trace clock}. v > 1: interleaved (schedule takes
    the list of stages)."""
    from labkit.observe import tracing

    model = make_model(seed)
    group, data_rank, dp = None, 0, 1
    if mesh_dims is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=mesh_dims)
        group, data_rank, dp = mesh.get_group("pp"), mesh.get_local_rank("dp"), 2
    p = dist.get_world_size(group)
    rank = dist.get_rank(group)
    x, y = batch(0, rows)
    x, y = x.chunk(dp)[data_rank], y.chunk(dp)[data_rank]
    record = Record()
    indices = pp_schedule.chunks_of(rank, p, v)
    stages = make_stages(model, indices, p * v, group, x.shape[0] // m, record, timeout=timeout)
    dist.barrier()
    start = tracing.clock()
    xs, ys = list(x.chunk(m)), list(y.chunk(m))
    losses = schedule(stages if v > 1 else stages[0], xs, ys, loss_fn, **kwargs)
    finish(record, timeout)
    losses = _losses(losses, any(s.is_last for s in stages))
    window = (start, tracing.clock())
    names = {id(p_): n for n, p_ in model.named_parameters()}
    grads = {
        names[id(p_)]: p_.grad.clone() for s in stages for p_ in s.module.parameters() if p_.grad is not None
    }
    return {
        "grads": grads,
        "losses": losses,
        "slots": record.slots,
        "live": record.live,
        "sent": record.sent,
        "held_after": record.held(),
        "window": window,
        "stages": indices,
    }


def _losses(losses: Any, last: bool) -> list[float]:
    """The schedule's return as floats: a list (or tuple) of one loss per micro-batch on the
    stage that holds the last stage, anything empty elsewhere; else a TypeError that says what
    came back."""
    if losses is None and not last:
        return []
    if not isinstance(losses, (list, tuple)):
        raise TypeError(f"the schedule returned {type(losses).__name__}, not a list of losses")
    if not all(
        isinstance(t, (int, float)) or (isinstance(t, torch.Tensor) and t.numel() == 1) for t in losses
    ):
        kinds = sorted({type(t).__name__ for t in losses})
        raise TypeError(
            f"the schedule returned a list of {', '.join(kinds)}, not of losses (one number each)"
        )
    return [float(t) for t in losses]


# ---------------------------------------------------------------- the oracle
def torch_schedule(kind: str, m: int = 4, v: int = 1, rows: int = ROWS, seed: int = 0) -> dict:
    """Rank function, the oracle: torch.distributed.pipelining's ScheduleGPipe ("gpipe"),
    Schedule1F1B ("1f1b") or ScheduleInterleaved1F1B ("interleaved", v chunks per rank) on the
    same stages, scale_grads=False. Returns {"grads": {name: gradient}, "losses"}."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    if kind not in ("gpipe", "1f1b", "interleaved"):
        raise ValueError(f"torch_schedule: kind is 'gpipe', '1f1b' or 'interleaved', got {kind!r}")
    model = make_model(seed)
    p, rank = dist.get_world_size(), dist.get_rank()
    n = p * v
    x, y = batch(0, rows)
    stages = []
    for s in pp_schedule.chunks_of(rank, p, v):
        start, end = stage_range(len(model), n, s)
        stages.append(
            PipelineStage(nn.Sequential(*[model[i] for i in range(start, end)]), s, n, torch.device("cpu"))
        )
    if kind == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    else:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
        sched = cls(stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False)
    losses: list = []
    args = (x,) if rank == 0 else ()
    last = (n - 1) % p == rank
    sched.step(*args, target=y if last else None, losses=losses if last else None)
    return {
        "grads": {n_: p_.grad.clone() for n_, p_ in model.named_parameters() if p_.grad is not None},
        "losses": [float(t.detach()) for t in losses],
    }


# ---------------------------------------------------------------- measurements
def replay(logs: list[list[tuple[str, int, int]]], p: int, backward_slots: int = 1) -> dict:
    """Replay each rank's recorded slot order in unit time with labkit's strategy's replay
    (labkit.strategies.pp.schedule.timeline): a slot of a stage that holds 1/v of the layers
    (n = v * p stages) takes 1/v, forward and backward alike (a backward backward_slots times
    that: 2 prices a whole backward beside a zero-bubble order's B and W of one slot each); it
    starts when its rank is free and its input is ready (F(mb, s) after F(mb, s - 1); B(mb, s)
    after B(mb, s + 1) and F(mb, s); W(mb, s), in a zero-bubble order, after B(mb, s)).
    Returns {"slots": per rank [(kind, mb, stage, start, end)] (Fractions), "makespan",
    "bubble": per rank 1 - busy / makespan}. Raises when the order cannot finish (a deadlock, or
    a slot missing or repeated)."""
    n = 1 + max(s for log in logs for _, _, s in log)
    v = n // p
    orders = [[pp_schedule.Action(kind, s, mb) for kind, mb, s in log] for log in logs]
    try:
        placed = pp_schedule.timeline(orders, backward_slots)
    except ValueError as exc:
        raise RuntimeError(f"the recorded orders cannot all finish: {exc}") from None
    # the replay's slots last 1 (whole numbers, exact in floats): a chunk's slot is 1/v of a stage's
    out = [
        [(a.kind, a.microbatch, a.chunk, Fraction(int(start), v), Fraction(int(end), v)) for a, start, end in
         ((slot.action, slot.start, slot.end) for slot in rank)]
        for rank in placed
    ]  # fmt: skip
    makespan = max(slots[-1][4] for slots in out if slots)
    busy = [sum((e - s_) for *_, s_, e in slots) for slots in out]
    return {"slots": out, "makespan": makespan, "bubble": [1 - b / makespan for b in busy]}


def activation_bytes(stage_index: int, n: int, rows: int, widths: tuple[int, ...] = WIDTHS) -> int:
    """Bytes one micro-batch's activations take on a stage, float64: every layer's input (what
    Linear saves; the first stage's data left out) and every Tanh's output (what it saves; the
    last one is the stage's output), rows x width x 8 each."""
    start, end = stage_range(len(widths) - 1, n, stage_index)
    inputs = sum(widths[i] for i in range(start, end) if i > 0)
    return 8 * rows * (inputs + widths[end])


def p2p_bytes(m: int, rows_per_mb: int, n: int, widths: tuple[int, ...] = WIDTHS) -> int:
    """Bytes one step sends point to point, every rank together: each of the n - 1 stage
    boundaries carries each micro-batch's activation forward and its gradient back."""
    cuts = [stage_range(len(widths) - 1, n, s)[1] for s in range(n - 1)]
    return 2 * m * rows_per_mb * 8 * sum(widths[c] for c in cuts)


def stage_p2p_bytes(stage: int, m: int, rows_per_mb: int, n: int, widths: tuple[int, ...] = WIDTHS) -> int:
    """Bytes stage `stage` of n (one chunk per rank) sends per step: each micro-batch's output
    activation forward (not the last stage) and its input's gradient back (not the first), float64.
    A middle stage sends both; with n = 1 there is no boundary and nothing is sent."""
    start, end = stage_range(len(widths) - 1, n, stage)
    forward = widths[end] if stage < n - 1 else 0
    backward = widths[start] if stage > 0 else 0
    return m * rows_per_mb * 8 * (forward + backward)


def plot_schedules(replays: dict[str, dict], p: int) -> Figure:
    """One panel per schedule: each rank's slots on the replayed unit-time axis, forward (blue),
    backward (orange) and, in a zero-bubble order, the weights' gradient W (green), labelled with
    the micro-batch, idle slots grey. Shows the figure once; returns it."""
    import matplotlib.pyplot as plt

    from labkit.observe.style import show_own, use_course_style

    use_course_style()
    fig, axes = plt.subplots(len(replays), 1, figsize=(10, 1.3 + 1.1 * p * len(replays)), squeeze=False)
    colors = {"F": "#1f77b4", "B": "#ff7f0e", "W": "#2ca02c"}
    split = any(kind == "W" for rep in replays.values() for slots in rep["slots"] for kind, *_ in slots)
    width = max(float(r["makespan"]) for r in replays.values())
    for ax, (name, rep) in zip(axes[:, 0], replays.items()):
        v = (1 + max(s for slots in rep["slots"] for _, _, s, _, _ in slots)) // p
        for r, slots in enumerate(rep["slots"]):
            y = p - 1 - r
            ax.barh(y, float(rep["makespan"]), left=0, height=0.8, color="#dddddd")
            for kind, mb, s, start, end in slots:
                ax.barh(
                    y,
                    float(end - start),
                    left=float(start),
                    height=0.8,
                    color=colors[kind],
                    edgecolor="white",
                )
                if v == 1:  # interleaved slots are too narrow for a label
                    ax.text(
                        float(start + end) / 2,
                        y,
                        f"{kind}{mb}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
        ax.set_yticks(range(p), [f"rank {p - 1 - i}" for i in range(p)])
        ax.set_xlim(0, width)
        ax.set_title(
            f"{name}: bubble {float(rep['bubble'][0]):.0%} of each rank's time (grey: idle)", fontsize=11
        )
    from matplotlib.patches import Patch

    axes[0, 0].legend(
        handles=[
            Patch(color=colors["F"], label="forward"),
            Patch(
                color=colors["B"],
                label="backward (zero-bubble B: the input's gradient)" if split else "backward",
            ),
            *([Patch(color=colors["W"], label="W: the weights' gradient")] if split else []),
            Patch(color="#dddddd", label="idle"),
        ],
        loc="upper right",
        fontsize=8,
        ncol=4 if split else 3,
    )
    axes[-1, 0].set_xlabel(
        "time, in forward-slots (F = B = W; a whole backward B + W: 2 slots)"
        if split
        else "time, in forward-slots of a whole stage (forward = backward); interleaved: 2 chunks of half a stage"
    )
    fig.tight_layout()
    return show_own(fig)


# ---------------------------------------------------------------- PP across the slow link
CROSS = dict(
    d=32, heads=2, hidden=128, batch=8, seq=16
)  # tp_lab's block, small: both layouts of tp_lab run too


def pp_across_nodes(
    schedule: Callable = None, size: dict = CROSS, m: int = 2, steps: int = 2, timeout: float = P2P_TIMEOUT
) -> dict:
    """Rank function (4 ranks as 2 nodes x 2): PP x DP on init_device_mesh("cpu", (2, 2),
    mesh_dim_names=("pp", "dp")): pp groups {0, 2} and {1, 3} cross the nodes, dp groups {0, 1},
    {2, 3} stay in them. The model: two of tp_lab's blocks (float32), one per stage; each dp
    replica its half of the batch in m micro-batches through `schedule` (1F1B by default), then
    the stage's gradients averaged over dp with labkit's ring all-reduce. Returns {"windows": each
    step's (start, end) on the trace clock, "grads": this rank's stage's averaged gradients}."""
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.comm import collectives
    from labkit.labs import tp_lab
    from labkit.observe import tracing

    collectives.DIRECT_MAX_BYTES = 0
    schedule = schedule or one_f_one_b
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    rank, dp_rank = dist.get_rank(pp), mesh.get_local_rank("dp")
    d, T = size["d"], size["seq"]
    model = nn.Sequential(*[tp_lab.make_block(s, d, size["heads"], size["hidden"]) for s in range(2)])
    rows = size["batch"] // 2 // m
    windows = []
    for step in range(steps):
        x, y = tp_lab.batch(step, size["batch"], T, d)
        x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        record = Record()
        stage = Stage(model[rank], rank, 2, pp, (rows, T, d), (rows, T, d), record, timeout)
        dist.barrier()
        start = tracing.clock()
        schedule(stage, list(x.chunk(m)), list(y.chunk(m)), F.mse_loss)
        finish(record, timeout)
        for prm in stage.module.parameters():
            collectives.ring_all_reduce(prm.grad, op="avg", group=dp)
        windows.append((start, tracing.clock()))
        grads = {n: prm.grad.clone() for n, prm in stage.module.named_parameters()}
        stage.module.zero_grad(set_to_none=True)
    return {"windows": windows, "grads": grads}


def node_bytes_per_step(
    results, kind: str = "inter", key: str | None = None, rank: int | None = None
) -> float:
    """Bytes per step sent across nodes ("inter") or within ("intra") (or "inter_messages"), every
    rank together (or `rank`'s), from the tracer over the step windows of results[r] (or
    results[r][key])."""
    from labkit.observe import trace_stats

    total, steps = 0.0, 0
    for r, (trace, out) in enumerate(zip(results.traces, results)):
        res = out if key is None else out[key]
        steps = len(res["windows"])
        if rank is None or r == rank:
            total += sum(trace_stats.node_bytes(trace, t_range=w)[kind] for w in res["windows"])
    return total / steps


def measure_schedules(schedules: dict, m: int = 8, rows: int = 16, timeout: float = P2P_TIMEOUT) -> dict:
    """Rank function: run_schedule for each {name: (schedule, v)} on this world, in turn."""
    return {name: run_schedule(fn, m, v, rows=rows, timeout=timeout) for name, (fn, v) in schedules.items()}


def p2p_traced(results, name: str, rank: int | None = None) -> dict:
    """{"bytes": payload bytes of the point-to-point sends every rank (or `rank`) traced in schedule
    `name`'s window, "intra": what the wire counter saw leave within the node, "messages"}."""
    out = {"bytes": 0, "intra": 0, "messages": 0}
    for r, (trace, res) in enumerate(zip(results.traces, results)):
        if rank is not None and r != rank:
            continue
        lo, hi = res[name]["window"]
        for e in trace["events"]:
            if e["op"] == "p2p_send" and lo <= e["start"] < hi:
                out["bytes"] += e["nbytes"]
                out["intra"] += e.get("intra_bytes", 0)
                out["messages"] += 1
    return out
