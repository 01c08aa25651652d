"""Per-rank recorder of collectives and compute spans, for the timeline chart.

Inside `labkit.run`, every rank records:
- collectives: the course's hand-written ones (through `record_collective` / `start_collective`)
  and torch.distributed calls made directly from Python (see `labkit.observe.recording`), sync and async,
  each with op, bytes, start, end and the intervals the calling thread was blocked waiting for it;
- for the hand-written collectives, the bytes this rank sent within its node and across nodes
  ("intra_bytes" / "inter_bytes", labkit.launch.topology; absent on torch.distributed's own);
- compute spans that labs open with `with span("forward"): ...` (nesting allowed).
`labkit.observe.recording.worker_end()` returns a plain picklable dict that `labkit.run` hands back as `results.traces[rank]`:

    {"rank", "world_size", "t0", "host", "events": [{"kind": "collective", "op", "nbytes",
     "start", "end", "blocked": [(s, e), ...], "async", "label",
     "intra_bytes", "inter_bytes", "inter_messages"}, ...],
     "spans": [{"name", "kind", "start", "end", "depth"}, ...]}

Times are seconds since the rank's `t0`, taken from `time.perf_counter()` right after a barrier.
What aligns what: on one machine perf_counter is CLOCK_MONOTONIC, shared by all processes, so the
timeline shifts each rank by its raw `t0` and ranks line up exactly. Across machines (torchrun on
several nodes) monotonic clocks are unrelated; the timeline then lines ranks up at their barrier
exits, which is only as good as the barrier's skew (tens of microseconds to a millisecond).

Left out: torch's DistributedDataParallel communicates from C++ and is invisible unless its comm
hook is `ddp_comm_hook_recording`; code that did `from torch.distributed import all_reduce`
before the run keeps the unpatched function; functional collectives (torch.distributed._functional_
collectives, used by compiled code) and NCCL's device-side timing are not recorded. Event ends on
NCCL are host-side completion times, not kernel times.
"""

import contextlib
import functools
import socket
import threading
import time

from labkit.observe.memory import notify as _memory_notify

now = time.perf_counter


class _Recorder:
    """Everything one rank has recorded so far. Times are raw perf_counter values until worker_end."""

    def __init__(self, rank, world_size):
        self.rank = rank
        self.world_size = world_size
        self.t0 = now()
        self.events = []  # list.append is atomic under the GIL: comm threads may append too
        self.spans = []


_recorder = None
_thread_state = threading.local()  # .suppress (int): >0 while inside a recorded collective


def _suppressed():
    return getattr(_thread_state, "suppress", 0) > 0


@contextlib.contextmanager
def untraced():
    """Direct torch.distributed calls made by this thread inside are not recorded.

    For a collective's own point-to-point steps when they run on a thread of their own."""
    _thread_state.suppress = getattr(_thread_state, "suppress", 0) + 1
    try:
        yield
    finally:
        _thread_state.suppress -= 1


def _notify(label):
    """Tell labkit.observe.memory what just happened on this rank (a no-op unless a tracker runs)."""
    _memory_notify(label)


# ---------------------------------------------------------------- collectives


class CollectiveToken:
    """One collective in flight. `finish()` may be called from any thread (the comm thread)."""

    def __init__(self, event):
        self.event = event  # None when nothing is recording: every method is then a no-op

    def finish(self):
        if self.event is not None and self.event["end"] is None:
            self.event["end"] = now()
            _notify(f"{self.event['op']} end")

    @contextlib.contextmanager
    def running(self):
        """Wrap the comm thread's work: its direct torch.distributed calls are not recorded
        separately, and the collective is finished when the block exits."""
        with untraced():
            try:
                yield self
            finally:
                self.finish()


def start_collective(op, nbytes, world_size, label=None, async_=True):
    """Record the start of a collective; call `.finish()` on the returned token when it completes."""
    if _recorder is None:
        return CollectiveToken(None)
    event = {
        "kind": "collective",
        "op": op,
        "nbytes": int(nbytes),
        "world_size": int(world_size),
        "start": now(),
        "end": None,
        "blocked": [],
        "async": bool(async_),
        "label": label or op,
    }
    _recorder.events.append(event)
    _notify(f"{op} start")
    return CollectiveToken(event)


@contextlib.contextmanager
def blocked(token):
    """Around a wait: records how long the calling thread was blocked on `token`'s collective."""
    if token is None or token.event is None:
        yield
        return
    start = now()
    try:
        yield
    finally:
        token.event["blocked"].append((start, now()))


class record_collective:
    """`with record_collective(op, nbytes, world_size): ...` records one synchronous collective.

    The calling thread counts as blocked for all of it, and its direct torch.distributed calls
    inside (the ring's own steps) are not recorded separately. A class rather than a generator:
    it is entered once per collective, so it should cost little."""

    __slots__ = ("op", "nbytes", "world_size", "label", "_token", "_outer")

    def __init__(self, op, nbytes, world_size, label=None):
        self.op, self.nbytes, self.world_size, self.label = op, nbytes, world_size, label
        self._token = None

    def __enter__(self):
        if _recorder is None or _suppressed():
            return None
        self._token = start_collective(self.op, self.nbytes, self.world_size, label=self.label, async_=False)
        _thread_state.suppress = getattr(_thread_state, "suppress", 0) + 1
        self._outer = getattr(_thread_state, "wire_event", None)
        _thread_state.wire_event = self._token.event
        return self._token

    def __exit__(self, *exc):
        token, self._token = self._token, None
        if token is not None:
            _thread_state.suppress -= 1
            _thread_state.wire_event = self._outer
            token.finish()
            token.event["blocked"].append((token.event["start"], token.event["end"]))
        return False


@contextlib.contextmanager
def attributed(token):
    """The bytes this thread sends inside (count_wire) belong to `token`'s collective (the comm
    thread wraps each job in it; record_collective does it for a synchronous one)."""
    outer = getattr(_thread_state, "wire_event", None)
    _thread_state.wire_event = token.event if token is not None else None
    try:
        yield
    finally:
        _thread_state.wire_event = outer


def count_wire(intra_bytes, inter_bytes, inter_messages=0):
    """A hand-written collective's message(s) about to leave this rank (labkit.comm._link): the
    event being recorded gains "intra_bytes" / "inter_bytes", what this rank sent within its node
    and across nodes (labkit.launch.topology), and "inter_messages" when some crossed."""
    event = getattr(_thread_state, "wire_event", None)
    if event is not None:
        event["intra_bytes"] = event.get("intra_bytes", 0) + int(intra_bytes)
        event["inter_bytes"] = event.get("inter_bytes", 0) + int(inter_bytes)
        if inter_messages:
            event["inter_messages"] = event.get("inter_messages", 0) + int(inter_messages)


# ---------------------------------------------------------------- compute spans


class span:
    """`with span("forward"): ...` or `@span("step")`: a named compute interval on this rank.

    Spans nest; `depth` 0 is the outermost on its thread. The chart draws depth 0 in the compute
    lane (inner ones optionally). A no-op when nothing is recording."""

    def __init__(self, name, kind="compute"):
        self.name = name
        self.kind = kind
        self._start = None
        self._depth = 0

    def __enter__(self):
        if _recorder is not None:
            self._depth = getattr(_thread_state, "span_depth", 0)
            _thread_state.span_depth = self._depth + 1
            _notify(f"{self.name} begin")
            self._start = now()
        return self

    def __exit__(self, *exc):
        if _recorder is not None and self._start is not None:
            end = now()
            _thread_state.span_depth = self._depth
            _recorder.spans.append(
                {"name": self.name, "kind": self.kind, "start": self._start, "end": end, "depth": self._depth}
            )
            _notify(f"{self.name} end")
        self._start = None
        return False

    def __call__(self, fn):
        # A fresh span per call, so recursion and threads don't share one start time.
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with span(self.name, self.kind):
                return fn(*args, **kwargs)

        return wrapper


# ---------------------------------------------------------------- torch DDP


def ddp_comm_hook_recording(state, bucket):
    """A DDP comm hook doing the default all-reduce (average) and recording each bucket's.

        model.register_comm_hook(state=None, hook=ddp_comm_hook_recording)

    Left out: the time DDP's reducer waits for the buckets happens in C++ and is not recorded as
    blocked; the event ends when gloo/NCCL reports the future done on the host."""
    import torch.distributed as dist

    group = state if state is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    tensor = bucket.buffer()
    tensor.div_(world_size)
    token = start_collective(
        "all_reduce", tensor.numel() * tensor.element_size(), world_size, label="ddp bucket", async_=True
    )
    with untraced():
        future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

    def finished(fut):
        token.finish()
        return fut.value()[0]

    return future.then(finished)


# ---------------------------------------------------------------- the recording's state
# (labkit.observe.recording starts and stops a rank's recording and patches torch.distributed)


def is_recording():
    return _recorder is not None


def clock():
    """Now on this rank's trace clock (seconds since its t0, as the record's times), or None when
    nothing records: a rank function returns clock() before and after a phase, and
    trace_stats.node_bytes(trace, t_range=...) / steps read that phase alone."""
    return None if _recorder is None else now() - _recorder.t0


def _begin(rank, world_size):
    global _recorder
    _recorder = _Recorder(rank, world_size)


def _swap(recorder):
    """Set the current recorder (None: record nothing); returns the previous one."""
    global _recorder
    previous, _recorder = _recorder, recorder
    return previous


def _end():
    """Stop recording and return this rank's record (plain dicts), or None if nothing recorded."""
    rec = _swap(None)
    if rec is None:
        return None
    t_end = now()
    events = []
    for ev in rec.events:
        ev = dict(ev)
        if ev["end"] is None:  # never finished (error or forgotten wait): cut at the end of the run
            ev["end"], ev["unfinished"] = t_end, True
        ev["start"] -= rec.t0
        ev["end"] -= rec.t0
        ev["blocked"] = [(s - rec.t0, e - rec.t0) for s, e in ev["blocked"]]
        events.append(ev)
    spans = [dict(sp, start=sp["start"] - rec.t0, end=sp["end"] - rec.t0) for sp in rec.spans]
    return {
        "rank": rec.rank,
        "world_size": rec.world_size,
        "t0": rec.t0,
        "host": socket.gethostname(),
        "events": events,
        "spans": spans,
    }
