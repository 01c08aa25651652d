"""pipeline_by_hand: run a schedule's actions on this rank, over labkit's traced point-to-point.

    pipe = pipeline_by_hand(nn.Sequential(...), schedule="1f1b", n_microbatches=8)
    loss = pipe.step(x, target, loss_fn)     # the last stage: sum of loss_fn over micro-batches
    pipe.record.actions, pipe.record.peak_live, pipe.record.peak_live_bytes

Every rank of `group` builds the same pipeline from the same model: the children are cut into
p * virtual_stages chunks (stage.py), this rank keeps its chunks (schedule.chunks_of: r, r+p, ...;
under "zbv" r and 2p-1-r) and runs its order (schedule.order). F(c, i): chunk c's forward on micro-batch i, its input the
micro-batch (c = 0) or chunk c-1's output received from that rank; the output is sent on at once
(asynchronously), or, on the last chunk, goes into loss_fn. B(c, i): backward from the loss (last
chunk) or from the output's gradient received from chunk c+1's rank; then the input's gradient
is sent back to chunk c-1, and everything (c, i) held is dropped: its saved activations go with
its autograd graph.

Under a zero-bubble schedule (an order with W actions: "zb-h1", "zbv", or a schedule function's)
the backward is split. B(c, i) computes the gradient of chunk c's input alone
(torch.autograd.backward(out, grad, inputs=[input], retain_graph=True): autograd walks only what
the input's gradient needs) and sends it back at once; the graph, the output's gradient and the
saved activations are kept. W(c, i) later computes the weight gradients
(torch.autograd.backward(out, grad, inputs=the chunk's trainable parameters), accumulated into
.grad as backward does, post-accumulate-grad hooks included), then drops what (c, i) held. The
cost: W walks the chunk's graph again from its output, so the gradients of the activations
inside the chunk are computed twice (once in B, once in W) -- about one more input-gradient pass
per chunk and micro-batch. torch (pipelining/_backward.py: stage_backward_input /
stage_backward_weight) avoids it by keeping the gradients B computed at the inputs of the
weight-holding nodes and starting W from them; left out here, for a W that is one autograd call.
A tensor hook on an activation inside a chunk runs in B and again in W (the 3-D strategy with
FSDP by hand counts backwards by such a hook: it refuses these schedules).
Gradients accumulate in .grad over the micro-batches, so after step() every
parameter this rank trains holds one process's gradient of sum(loss_fn(micro-batch)); a weight
held by several ranks (TinyGPT's tied embedding / head) is summed over them at the end.

The shapes: the first forward of each chunk on a step is preceded by a header (dtype and shape,
untraced: metadata, as torch's pipelining infers shapes) and every micro-batch has the same rows,
so the later receives reuse that shape. Recorded per step (`record`): the order run, the peak
number of (chunk, micro-batch) activations held (from F to B, or to W when the order has W's),
the peak bytes saved for backward (tensors autograd keeps, the parameters left out, each storage
once; kept to W under a zero-bubble schedule) and the bytes sent.

One process's semantics off the plain path: a tied weight's holders sum THIS step's gradients
(summing_tied), so steps without zero_grad accumulate as one process (2 G after two, not 3 G); the
tied weights are found by identity when the pipeline is built and kept by their (module, name), so
a strategy that shards the chunks in place afterwards (fully_shard) calls reread_parameters() and
the holders sum their shards' gradients (a DTensor's by its local tensor); a
frozen tied weight is not summed (its grad stays None, so AdamW does not decay it); an integer
stage output (token ids) is carried and no gradient goes back for it. Before any message, every
step gathers a small header from each rank (untraced): a rank whose arguments were refused,
n_microbatches, virtual_stages, the schedule, the rows of x and target; every rank raises naming
the disagreement (instead of a timeout or a gloo abort). A stage output that is not one tensor
(a tuple, a dict) is refused on its rank before it is sent; an nn.Sequential subclass with its own
forward is refused at construction (stage.check_sequential).

What it leaves out: micro-batches of unequal rows, several inputs / outputs per stage (torch's
pipelining passes tuples), overlap of receives with compute (each receive is posted when its
action runs), activation checkpointing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from labkit.comm import p2p
from labkit.comm.collectives import group_info
from labkit.observe import tracing
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
            # Its chunks are placed as chunks_of places them without a schedule (r, r+p, ...).
            every = [list(schedule(r, p, m, v)) for r in range(p)]
            sched.timeline(every)
            for r, actions in enumerate(every):
                wrong = [a for a in actions if sched.rank_of(a.chunk, p) != r]
                if wrong:
                    raise ValueError(f"the schedule gives rank {r} chunks it does not hold: {wrong[:3]}")
            self.order = every[self.rank]
            self.schedule_name = getattr(schedule, "__name__", "custom")
            self._schedule_key = zlib.crc32(repr(every).encode())  # every rank's order: the same everywhere
            self.split_backward = any(a.kind == "W" for actions in every for a in actions)
            placement = None
        else:
            self.order = sched.order(schedule, self.rank, p, m, v)
            self.schedule_name = schedule
            self._schedule_key = zlib.crc32(str(schedule).encode())
            self.split_backward = schedule in sched.ZERO_BUBBLE
            placement = schedule
        model = check_sequential(model, p * v)
        self.model, self.n_microbatches, self.virtual_stages = model, m, v
        self.chunks = split_sequential(model, p * v)
        self.n_chunks = p * v
        # holders[c]: the pipeline rank holding chunk c (every lookup of a peer or an owner uses it)
        self.holders = [sched.rank_of(c, p, placement) for c in range(p * v)]
        self.chunk_ids = sched.chunks_of(self.rank, p, v, placement)
        self.stages = [self.chunks[c] for c in self.chunk_ids]
        self._tied_slots = self._find_tied()
        self.reread_parameters()
        self.record = StepRecord()

    # ---------------------------------------------------------------- what this rank holds

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's chunks, each once (what its optimizer steps)."""
        return list(self._params)

    def reread_parameters(self) -> None:
        """Read this rank's parameters from its chunks again: after something replaced them in
        place (fully_shard / fully_shard_by_hand on a chunk: the shards), parameters() and the
        tied weights' sum are the new tensors'. The tied weights are found by identity when the
        pipeline is built (before such a wrapper breaks it) and kept by their (module, name)."""
        self._params = unique_parameters(self.stages)
        self.tied: list[tuple[nn.Parameter, list[int]]] = []
        for module, name, holders in self._tied_slots:
            param = module._parameters[name]
            if param is None:
                raise RuntimeError(f"pipeline: the tied weight {name!r} of a {type(module).__name__} is gone")
            self.tied.append((param, holders))
        for param, holders in self.tied:  # clip_grad_norm_ counts a tied weight once: on its first holder
            if holders[0] != self.rank:
                COUNTED_ELSEWHERE[param] = True

    def _find_tied(self) -> list[tuple[nn.Module, str, list[int]]]:
        """[(module, parameter name, the pipeline ranks holding it)], one slot in this rank's
        chunks per parameter held by more than one rank (the same on every rank: each builds the
        split of the same model)."""
        holders: dict[int, list[int]] = {}
        for c, chunk in enumerate(self.chunks):
            for p in unique_parameters([chunk]):
                r = self.holders[c]
                if r not in holders.setdefault(id(p), []):
                    holders[id(p)].append(r)
        slots: dict[int, tuple[nn.Module, str, list[int]]] = {}
        for stage in self.stages:
            for module in stage.modules():
                for name, q in module._parameters.items():
                    # A frozen weight is left out: one process gives it no gradient (None), so no sum.
                    if q is not None and q.requires_grad and len(holders.get(id(q), [])) > 1:
                        slots.setdefault(id(q), (module, name, sorted(holders[id(q)])))
        first = {key: i for i, key in enumerate(holders)}  # the model's order: each sum's tag agrees
        return [slots[key] for key in sorted(slots, key=first.__getitem__)]

    def holder(self, chunk: int) -> int:
        """The global rank holding model chunk `chunk` (the schedule's placement)."""
        return self.ranks[self.holders[chunk]]

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
        error: Exception | None = None
        try:
            xs = self._split(x, "x", needed=first)
            ys = self._split(target, "target", needed=last)
            # Checked wherever both are given (every rank under the loop), not only where both
            # are used.
            if (
                isinstance(x, torch.Tensor)
                and isinstance(target, torch.Tensor)
                and x.shape[0] != target.shape[0]
            ):
                raise ValueError(f"pipeline step: x has {x.shape[0]} rows but target {target.shape[0]}")
        except (TypeError, ValueError) as exc:
            error = exc
        # Every rank's arguments compared before any message: a rank that refused, or ranks that
        # disagree, stop every rank at once instead of a timeout or a gloo abort.
        self._agree(x, target, error)
        self.record = rec = StepRecord()
        held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # (chunk, micro-batch) -> (output, its gradient): B done, W to come (zero-bubble orders)
        self._waiting: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._shapes: dict[int, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._sends: list[Any] = []
        self._mail: dict[tuple[str, int, int], torch.Tensor] = {}
        self._saved = _SavedBytes(self._params, rec)
        losses: list[torch.Tensor] = []
        with self.summing_tied():
            for a in self.order:
                rec.actions.append(a)
                if a.kind == "F":
                    with watch("forward"):
                        self._forward(a, xs, ys, loss_fn, start, held, losses)
                elif a.kind == "W":
                    with watch("backward"):
                        self._weights(a)
                elif self.split_backward:
                    with watch("backward"):
                        self._input_backward(a, held)
                else:
                    with watch("backward"):
                        self._backward(a, held)
                self._reap()
            for h in self._sends:
                h.wait()
            self._sends = []
            if held or self._waiting:
                raise RuntimeError(
                    f"pipeline step: activations never backpropagated: {sorted(held)}, or without their "
                    f"weight gradients: {sorted(self._waiting)}"
                )
        if not last:
            return None
        return torch.stack([loss.to(torch.float64) for loss in losses]).sum()

    def _agree(self, x: Any, target: Any, error: Exception | None) -> None:
        """One small header per rank, gathered over the pipeline (untraced: metadata): whether its
        arguments were refused, n_microbatches, virtual_stages, the schedule, the rows of x and
        target (-1: not given). Raises on every rank, naming the disagreement."""

        def rows(t: Any) -> int:
            return int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() > 0 else -1

        if self.n_stages == 1:  # one rank (perhaps no process group): nothing to compare
            if error is not None:
                raise error
            return
        fields = [
            int(error is not None),
            self.n_microbatches,
            self.virtual_stages,
            self._schedule_key,
            rows(x),
            rows(target),
        ]
        mine = torch.tensor(fields, dtype=torch.int64, device=self._device())
        table = [torch.empty_like(mine) for _ in range(self.n_stages)]
        with tracing.untraced():
            dist.all_gather(table, mine, group=self.group)
        got = [t.tolist() for t in table]
        if error is not None:
            raise error
        failed = [self.ranks[r] for r, row in enumerate(got) if row[0]]
        if failed:
            raise RuntimeError(
                f"pipeline step: rank(s) {failed} refused their step's arguments (their own error says "
                f"why); rank {self.ranks[self.rank]} stops too instead of waiting for their messages"
            )
        for i, name in ((1, "n_microbatches"), (2, "virtual_stages")):
            if len({row[i] for row in got}) > 1:
                each = ", ".join(f"rank {self.ranks[r]}: {row[i]}" for r, row in enumerate(got))
                raise ValueError(
                    f"pipeline step: the ranks of the pipeline disagree on {name} ({each}); every rank "
                    f"must build the pipeline with the same arguments"
                )
        if len({row[3] for row in got}) > 1:
            raise ValueError(
                f"pipeline step: the ranks of the pipeline run different schedules (this rank, "
                f"{self.ranks[self.rank]}: {self.schedule_name!r}); every rank must pass the same schedule"
            )
        given = [
            (r, what, row[j])
            for r, row in enumerate(got)
            for j, what in ((4, "x"), (5, "target"))
            if row[j] >= 0
        ]
        if len({n for _, _, n in given}) > 1:
            each = ", ".join(f"rank {self.ranks[r]} {what} {n}" for r, what, n in given)
            raise ValueError(
                f"pipeline step: the ranks' batches have different rows ({each}); every stage must "
                f"see the same micro-batches"
            )

    def _device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

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
            if c < self.n_chunks - 1:
                self._check_output(out, c)
            if c == self.n_chunks - 1:
                loss = loss_fn(out, ys[i])
                losses.append(loss.detach())
                out = start(loss)
        self.record.live += 1
        self.record.peak_live = max(self.record.peak_live, self.record.live)
        held[(c, i)] = (inp, out)
        if c < self.n_chunks - 1:
            self._send_activation(out.detach().contiguous(), c + 1, i)

    def _check_output(self, out: Any, c: int) -> None:
        """Refuse (before anything is sent) a stage output the runtime cannot carry to the next
        stage: one tensor of a dtype it knows, at most _HEADER - 2 dims."""
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"pipeline: chunk {c}'s output (children {self._bounds(c)}) is a {type(out).__name__}, "
                f"not a tensor; pipeline_by_hand carries one tensor between stages (torch's "
                f"pipelining also passes tuples: left out here). Return one tensor from that child "
                f"(e.g. torch.cat the parts), or cut the model elsewhere"
            )
        if out.dtype not in _DTYPES:
            raise TypeError(
                f"pipeline: chunk {c}'s output has dtype {out.dtype}, which the pipeline does not carry"
            )
        if out.dim() > _HEADER - 2:
            raise ValueError(f"pipeline: a stage output of {out.dim()} dims (at most {_HEADER - 2})")

    def _bounds(self, c: int) -> str:
        from labkit.strategies.pp.stage import bounds

        a, b = bounds(len(self.model), self.n_chunks)[c]
        return f"{a}..{b - 1}"

    def _backward(self, a, held) -> None:
        c, i = a.chunk, a.microbatch
        if (c, i) not in held:
            raise RuntimeError(f"pipeline step: backward {a!r} before its forward on rank {self.rank}")
        inp, out = held.pop((c, i))
        if c == self.n_chunks - 1:
            out.backward()
        elif out.is_floating_point():  # an integer output (token ids) has no gradient: none comes back
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

    def _input_backward(self, a: sched.Action, held: dict) -> None:
        """B(c, i) of a zero-bubble order: the gradient of chunk c's input alone, sent back at once;
        the graph (retain_graph), the output and its gradient wait in self._waiting for W(c, i)."""
        c, i = a.chunk, a.microbatch
        if (c, i) not in held:
            raise RuntimeError(f"pipeline step: backward {a!r} before its forward on rank {self.rank}")
        inp, out = held.pop((c, i))
        grad: torch.Tensor | None = None
        if c < self.n_chunks - 1 and out.is_floating_point():  # integer outputs get no gradient back
            grad = self._receive(torch.empty_like(out, memory_format=torch.contiguous_format), "B", c, i)
        wants = c > 0 and inp.is_floating_point()
        if wants and inp.requires_grad and out.requires_grad:
            torch.autograd.backward(out, grad, inputs=[inp], retain_graph=True)
        self._waiting[(c, i)] = (out, grad)
        if wants:
            g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            self._send(g.contiguous(), "B", c - 1, i, count=True)
        del inp

    def _weights(self, a: sched.Action) -> None:
        """W(c, i): the weight gradients of chunk c on micro-batch i, from the output and the
        gradient its B kept (the graph walked again from the output: see the module docstring),
        accumulated into .grad; then everything (c, i) held is dropped."""
        c, i = a.chunk, a.microbatch
        if (c, i) not in self._waiting:
            raise RuntimeError(
                f"pipeline step: weight gradients {a!r} before their backward on rank {self.rank}"
            )
        out, grad = self._waiting.pop((c, i))
        params = [q for q in unique_parameters([self.chunks[c]]) if q.requires_grad]
        if params and out.requires_grad:
            torch.autograd.backward(out, grad, inputs=params)
        del out, grad
        self._saved.release((c, i))
        self.record.live -= 1

    # ---------------------------------------------------------------- transfers

    def _peer(self, chunk: int) -> int:
        return self.holder(chunk)

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
        return self._receive(torch.empty(shape, dtype=dtype, device=self._device()), "F", chunk, i)

    def _reap(self) -> None:
        """Drop the sends that have arrived (their buffers with them)."""
        pending = []
        for h in self._sends:
            if _done(h):
                h.wait()
            else:
                pending.append(h)
        self._sends = pending

    @contextlib.contextmanager
    def summing_tied(self) -> Iterator[None]:
        """Around one step's backward: the tied weights' gradients of THIS step summed over their
        holders (sum_tied_grads), then added to what .grad held before (accumulation over steps
        without zero_grad, as one process: 2 steps give 2 G, not the sum of sums). step() uses it;
        a strategy around another pipeline (torch's) too."""
        kept = [p.grad for p, _ in self.tied]
        for p, _ in self.tied:
            p.grad = None
        try:
            yield
        except BaseException:
            for (p, _), g in zip(self.tied, kept):
                p.grad = g
            raise
        self.sum_tied_grads()
        for (p, _), g in zip(self.tied, kept):
            if g is not None and p.grad is not None:
                local(g).add_(local(p.grad))
                p.grad = g  # the same .grad tensor as before (optimizers may hold it)

    def sum_tied_grads(self) -> None:
        """A weight held by several ranks (tied): every holder ends with the sum of their
        gradients, added in rank order on the first holder and sent back (the same bits
        everywhere); a DTensor gradient (a shard, FSDP's) by its local tensor, so the holders
        sum their shards. summing_tied() calls it on this step's gradients alone."""
        for index, (param, holders) in enumerate(self.tied):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            me, head = self.rank, holders[0]
            tag = _TAG - 1 - index
            g = local(param.grad)
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


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, the object itself (so .data rebinds it and an in-place op changes
    the DTensor; to_local() on a Parameter returns a view), else the tensor."""
    return getattr(tensor, "_local_tensor", tensor)


# Tied weights this process holds but counts on another rank (clip_grad_norm_ counts each once).
COUNTED_ELSEWHERE: Any = WeakIdKeyDictionary()
# Parameters whose reduced gradient a strategy keeps elsewhere after after_backward (ZeRO-1's flat
# shard in pp-zero1 and zero1-tp-pp): their .grad is not what the optimizer steps from, so
# clip_grad_norm_ over them refuses, naming the strategy's own (value: the strategy's name).
GRADS_ELSEWHERE: Any = WeakIdKeyDictionary()


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
        self.params = {local(p).untyped_storage().data_ptr() for p in params}
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
    rank) | "zb-h1" | "zbv" (virtual_stages=2) or a function (rank, n_stages, n_microbatches,
    virtual_stages) -> [Action] (with W actions: a zero-bubble order);
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
