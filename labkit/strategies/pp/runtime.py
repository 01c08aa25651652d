"""pipeline_by_hand: run a schedule's actions on this rank, over labkit's traced point-to-point.

    pipe = pipeline_by_hand(nn.Sequential(...), schedule="1f1b", n_microbatches=8)
    loss = pipe.step(x, target, loss_fn)     # the last stage: sum of loss_fn over micro-batches
    pipe.record.actions, pipe.record.peak_live, pipe.record.peak_live_bytes

Every rank of `group` builds the same pipeline from the same model: the children are cut into
p * virtual_stages chunks (stage.py), this rank keeps its chunks (schedule.chunks_of: r, r+p, ...)
and runs its order (schedule.order). F(c, i): chunk c's forward on micro-batch i, its input the
micro-batch (c = 0) or chunk c-1's output received from that rank; the output is sent on at once
(asynchronously), or, on the last chunk, goes into loss_fn. B(c, i): backward from the loss (last
chunk) or from the output's gradient received from chunk c+1's rank; then the input's gradient
is sent back to chunk c-1, and everything (c, i) held is dropped: its saved activations go with
its autograd graph. Gradients accumulate in .grad over the micro-batches, so after step() every
parameter this rank trains holds one process's gradient of sum(loss_fn(micro-batch)); a weight
held by several ranks (TinyGPT's tied embedding / head) is summed over them at the end.

The shapes: the first forward of each chunk on a step is preceded by a header (dtype and shape,
untraced: metadata, as torch's pipelining infers shapes) and every micro-batch has the same rows,
so the later receives reuse that shape. Recorded per step (`record`): the order run, the peak
number of (chunk, micro-batch) activations held, the peak bytes saved for backward (tensors
autograd keeps, the parameters left out, each storage once) and the bytes sent.

What it leaves out: micro-batches of unequal rows, several inputs / outputs per stage, overlap of
receives with compute (each receive is posted when its action runs), activation checkpointing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm import p2p
from labkit.comm.collectives import group_info
from labkit.strategies.pp import schedule as sched
from labkit.strategies.pp.stage import check_sequential, split_sequential, unique_parameters

Schedule = str | Callable[..., list[sched.Action]]
_TAG = 1 << 20  # above the ring's tags (0 ... 2n-3) and the cross-rank check's
_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_HEADER = 10  # dtype, ndim, up to 8 dims


@dataclasses.dataclass
class StepRecord:
    """What one step did on this rank (reset by every step)."""

    actions: list[sched.Action] = dataclasses.field(default_factory=list)
    live: int = 0
    peak_live: int = 0  # most (chunk, micro-batch) activations held at once
    live_bytes: int = 0
    peak_live_bytes: int = 0  # most bytes autograd held for backward (parameters excluded)
    sent_bytes: int = 0  # activations and gradients sent (headers and the tied sum excluded)
    tied_bytes: int = 0  # what the tied weights' sum sent


class PipelineByHand:
    """One rank's side of a pipeline (see the module docstring); made by pipeline_by_hand."""

    def __init__(
        self,
        model: nn.Module,
        *,
        schedule: Schedule,
        n_microbatches: int,
        group: Any = None,
        virtual_stages: int = 1,
        comm: str = "ring",
    ) -> None:
        if comm not in ("ring", "torch"):
            raise ValueError(f"pipeline_by_hand: comm must be 'ring' or 'torch', got {comm!r}")
        self.rank, self.n_stages = group_info(group)
        self.group, self.comm = group, comm
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.n_stages))
        p, m, v = self.n_stages, n_microbatches, virtual_stages
        if callable(schedule):
            # A schedule function (rank, n_stages, n_microbatches, virtual_stages) -> [Action]:
            # every rank's order replayed here first, so a cycle raises instead of hanging.
            sched.check("interleaved" if v > 1 else "1f1b", p, m, v)
            every = [list(schedule(r, p, m, v)) for r in range(p)]
            sched.timeline(every)
            for r, actions in enumerate(every):
                wrong = [a for a in actions if sched.rank_of(a.chunk, p) != r]
                if wrong:
                    raise ValueError(f"the schedule gives rank {r} chunks it does not hold: {wrong[:3]}")
            self.order = every[self.rank]
            self.schedule_name = getattr(schedule, "__name__", "custom")
        else:
            self.order = sched.order(schedule, self.rank, p, m, v)
            self.schedule_name = schedule
        model = check_sequential(model, p * v)
        self.model, self.n_microbatches, self.virtual_stages = model, m, v
        self.chunks = split_sequential(model, p * v)
        self.n_chunks = p * v
        self.chunk_ids = sched.chunks_of(self.rank, p, v)
        self.stages = [self.chunks[c] for c in self.chunk_ids]
        self._params = unique_parameters(self.stages)
        self.tied = self._tied_parameters()
        self.record = StepRecord()

    # ---------------------------------------------------------------- what this rank holds

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's chunks, each once (what its optimizer steps)."""
        return list(self._params)

    def _tied_parameters(self) -> list[tuple[nn.Parameter, list[int]]]:
        """[(parameter, the pipeline ranks holding it)] for this rank's parameters held by more
        than one rank (the same on every rank: each builds the split of the same model)."""
        holders: dict[int, list[int]] = {}
        for c, chunk in enumerate(self.chunks):
            for p in unique_parameters([chunk]):
                r = sched.rank_of(c, self.n_stages)
                if r not in holders.setdefault(id(p), []):
                    holders[id(p)].append(r)
        return [(p, sorted(holders[id(p)])) for p in self._params if len(holders[id(p)]) > 1]

    # ---------------------------------------------------------------- one step

    def step(
        self,
        x: torch.Tensor | None,
        target: torch.Tensor | None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        backward_from: Callable[[torch.Tensor], torch.Tensor] | None = None,
        watch: Callable[[str], ContextManager[Any]] | None = None,
    ) -> torch.Tensor | None:
        """Run this rank's order once: x (first stage) and target (last stage) are cut into
        n_microbatches equal micro-batches along dim 0; loss_fn(output, target_micro_batch) on
        the last stage. Leaves .grad += one process's gradient of sum(loss_fn) on this rank's
        parameters (zero them first, as with loss.backward()). Returns that sum (detached) on the
        rank holding the last chunk, None on the others.
        backward_from(loss): what backward starts from (default the loss; the loop passes its
        scaled loss); watch(phase): a context around each "forward" / "backward" action."""
        watch = watch or (lambda phase: contextlib.nullcontext())
        start = backward_from or (lambda loss: loss)
        first, last = 0 in self.chunk_ids, self.n_chunks - 1 in self.chunk_ids
        xs = self._split(x, "x", needed=first)
        ys = self._split(target, "target", needed=last)
        # Checked wherever both are given (every rank under the loop), not only where both are
        # used: a rank that raised alone would leave its peers waiting for its messages.
        if isinstance(x, torch.Tensor) and isinstance(target, torch.Tensor) and x.shape[0] != target.shape[0]:
            raise ValueError(f"pipeline step: x has {x.shape[0]} rows but target {target.shape[0]}")
        self.record = rec = StepRecord()
        held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._shapes: dict[int, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._sends: list[Any] = []
        self._mail: dict[tuple[str, int, int], torch.Tensor] = {}
        self._saved = _SavedBytes(self._params, rec)
        losses: list[torch.Tensor] = []
        for a in self.order:
            rec.actions.append(a)
            if a.kind == "F":
                with watch("forward"):
                    self._forward(a, xs, ys, loss_fn, start, held, losses)
            else:
                with watch("backward"):
                    self._backward(a, held)
            self._reap()
        for h in self._sends:
            h.wait()
        self._sends = []
        if held:
            raise RuntimeError(f"pipeline step: activations never backpropagated: {sorted(held)}")
        self.sum_tied_grads()
        if not last:
            return None
        return torch.stack([loss.to(torch.float64) for loss in losses]).sum()

    def _split(self, t: torch.Tensor | None, what: str, needed: bool) -> list[torch.Tensor] | None:
        m = self.n_microbatches
        if t is None:
            if needed:
                stage = "first" if what == "x" else "last"
                raise ValueError(f"pipeline step: rank {self.rank} holds the {stage} stage and needs {what}")
            return None
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise TypeError(f"pipeline step: {what} must be a tensor with a batch dim, got {t!r}")
        if t.shape[0] % m:
            raise ValueError(
                f"pipeline step: a batch of {t.shape[0]} rows does not split into "
                f"n_microbatches={m} equal micro-batches ({what})"
            )
        return list(t.chunk(m)) if needed else None

    def _forward(self, a, xs, ys, loss_fn, start, held, losses) -> None:
        c, i = a.chunk, a.microbatch
        if c == 0:
            inp = xs[i]
        else:
            inp = self._receive_activation(c, i)
            if inp.is_floating_point():
                inp.requires_grad_(True)
        with self._saved.keeping((c, i)):
            out = self.chunks[c](inp)
            if c == self.n_chunks - 1:
                loss = loss_fn(out, ys[i])
                losses.append(loss.detach())
                out = start(loss)
        self.record.live += 1
        self.record.peak_live = max(self.record.peak_live, self.record.live)
        held[(c, i)] = (inp, out)
        if c < self.n_chunks - 1:
            self._send_activation(out.detach().contiguous(), c + 1, i)

    def _backward(self, a, held) -> None:
        c, i = a.chunk, a.microbatch
        if (c, i) not in held:
            raise RuntimeError(f"pipeline step: backward {a!r} before its forward on rank {self.rank}")
        inp, out = held.pop((c, i))
        if c == self.n_chunks - 1:
            out.backward()
        else:
            grad = self._receive(torch.empty_like(out, memory_format=torch.contiguous_format), "B", c, i)
            if out.requires_grad:
                out.backward(grad)
            del grad
        del out
        self._saved.release((c, i))
        self.record.live -= 1
        if c > 0 and inp.is_floating_point():
            g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            self._send(g.contiguous(), "B", c - 1, i, count=True)
        del inp

    # ---------------------------------------------------------------- transfers

    def _peer(self, chunk: int) -> int:
        return self.ranks[sched.rank_of(chunk, self.n_stages)]

    def _tag(self, kind: str, chunk: int, microbatch: int) -> int:
        code = {"F": 0, "B": 1, "H": 2}[kind]
        return _TAG + (code * self.n_chunks + chunk) * self.n_microbatches + microbatch

    def _send(self, t: torch.Tensor, kind: str, chunk: int, i: int, count: bool) -> None:
        """Send t to the rank holding `chunk` (F: its input, H: that input's header, B: the
        gradient of its output)."""
        dst = self._peer(chunk)
        if dst == self.ranks[self.rank]:
            self._mail[(kind, chunk, i)] = t
            return
        if count:
            self.record.sent_bytes += t.numel() * t.element_size()
        self._sends.append(self._isend(t, dst, self._tag(kind, chunk, i), traced=kind != "H"))

    def _receive(self, buf: torch.Tensor, kind: str, chunk: int, i: int) -> torch.Tensor:
        """Receive what was sent to this rank's `chunk` (F, H: by chunk-1's rank, B: by chunk+1's)."""
        src = self._peer(chunk - 1 if kind in "FH" else chunk + 1)
        if src == self.ranks[self.rank]:
            return self._mail.pop((kind, chunk, i))
        return self._irecv(buf, src, self._tag(kind, chunk, i), traced=kind != "H").wait()

    def _isend(self, t: torch.Tensor, dst: int, tag: int, traced: bool) -> Any:
        if traced and self.comm == "ring":
            return p2p.send(t, dst, group=self.group, tag=tag)
        with _untraced(not traced):
            return _Torch(dist.isend(t, dst=dst, group=self.group, tag=tag), t)

    def _irecv(self, buf: torch.Tensor, src: int, tag: int, traced: bool) -> Any:
        if traced and self.comm == "ring":
            return p2p.recv(buf, src, group=self.group, tag=tag)
        with _untraced(not traced):
            return _Torch(dist.irecv(buf, src=src, group=self.group, tag=tag), buf)

    def _send_activation(self, out: torch.Tensor, chunk: int, i: int) -> None:
        if chunk not in self._shapes:  # the first micro-batch this step: its shape first
            if out.dim() > _HEADER - 2:
                raise ValueError(f"pipeline: a stage output of {out.dim()} dims (at most {_HEADER - 2})")
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0], header[1] = _DTYPES.index(out.dtype), out.dim()
            header[2 : 2 + out.dim()] = torch.tensor(out.shape)
            self._shapes[chunk] = (out.dtype, tuple(out.shape))
            self._send(header, "H", chunk, i, count=False)
        self._send(out, "F", chunk, i, count=True)

    def _receive_activation(self, chunk: int, i: int) -> torch.Tensor:
        if chunk not in self._shapes:
            header = self._receive(torch.zeros(_HEADER, dtype=torch.int64), "H", chunk, i)
            ndim = int(header[1])
            self._shapes[chunk] = (_DTYPES[int(header[0])], tuple(int(d) for d in header[2 : 2 + ndim]))
        dtype, shape = self._shapes[chunk]
        device = self._params[0].device if self._params else torch.device("cpu")
        return self._receive(torch.empty(shape, dtype=dtype, device=device), "F", chunk, i)

    def _reap(self) -> None:
        """Drop the sends that have arrived (their buffers with them)."""
        pending = []
        for h in self._sends:
            if _done(h):
                h.wait()
            else:
                pending.append(h)
        self._sends = pending

    def sum_tied_grads(self) -> None:
        """A weight held by several ranks (tied): every holder ends with the sum of their
        gradients, added in rank order on the first holder and sent back (the same bits
        everywhere). step() calls it last; a strategy around another pipeline (torch's) too."""
        for index, (param, holders) in enumerate(self.tied):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            me, head = self.rank, holders[0]
            tag = _TAG - 1 - index
            g = param.grad
            if me == head:
                total = g.clone()
                for r in holders[1:]:
                    total += self._irecv(torch.empty_like(total), self.ranks[r], tag, True).wait()
                sends = [self._isend(total, self.ranks[r], tag, True) for r in holders[1:]]
                self.record.tied_bytes += total.numel() * total.element_size() * len(sends)
                for h in sends:
                    h.wait()
                g.copy_(total)
            else:
                self.record.tied_bytes += g.numel() * g.element_size()
                self._isend(g.contiguous(), self.ranks[head], tag, True).wait()
                g.copy_(self._irecv(torch.empty_like(g), self.ranks[head], tag, True).wait())


class _Torch:
    """torch's Work with the tensor it moves: wait() once, returns the tensor."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work, self.tensor, self.done = work, tensor, False

    def wait(self) -> torch.Tensor:
        if not self.done:
            self.work.wait()
            self.done = True
        return self.tensor


def _done(h: Any) -> bool:
    work = getattr(h, "work", None)
    return work is None or bool(work.is_completed())


@contextlib.contextmanager
def _untraced(on: bool) -> Iterator[None]:
    from labkit.observe import tracing

    with tracing.untraced() if on else contextlib.nullcontext():
        yield


class _SavedBytes:
    """Counts the bytes autograd keeps for backward per (chunk, micro-batch), each storage once
    across everything held (a micro-batch is a view of the batch: one storage), parameters left
    out; into the step's record (live_bytes, peak_live_bytes)."""

    def __init__(self, params: list[nn.Parameter], record: StepRecord) -> None:
        # a DTensor parameter (tensor parallelism, FSDP) by its local tensor's storage
        self.params = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in params}
        self.record = record
        self.keys: dict[tuple[int, int], set[int]] = {}
        self.refs: dict[int, list[int]] = {}  # storage -> [nbytes, holders]

    @contextlib.contextmanager
    def keeping(self, key: tuple[int, int]) -> Iterator[None]:
        mine = self.keys.setdefault(key, set())

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.params and ptr not in mine and storage.nbytes():
                mine.add(ptr)
                ref = self.refs.setdefault(ptr, [storage.nbytes(), 0])
                ref[1] += 1
                if ref[1] == 1:
                    self.record.live_bytes += ref[0]
                    self.record.peak_live_bytes = max(self.record.peak_live_bytes, self.record.live_bytes)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def release(self, key: tuple[int, int]) -> None:
        for ptr in self.keys.pop(key, set()):
            ref = self.refs[ptr]
            ref[1] -= 1
            if ref[1] == 0:
                self.record.live_bytes -= ref[0]
                del self.refs[ptr]


def pipeline_by_hand(
    model: nn.Module,
    *,
    schedule: Schedule,
    n_microbatches: int,
    group: Any = None,
    virtual_stages: int = 1,
    comm: str = "ring",
) -> PipelineByHand:
    """This rank's side of a pipeline over `group`'s ranks (None: the world) on the children of
    nn.Sequential `model`: schedule "gpipe" | "1f1b" | "interleaved" (virtual_stages chunks per
    rank) or a function (rank, n_stages, n_microbatches, virtual_stages) -> [Action];
    comm="ring": labkit's traced point-to-point (labkit.comm.p2p), "torch": dist.isend / irecv.
    Every rank of the group calls it with the same model and arguments."""
    return PipelineByHand(
        model,
        schedule=schedule,
        n_microbatches=n_microbatches,
        group=group,
        virtual_stages=virtual_stages,
        comm=comm,
    )
