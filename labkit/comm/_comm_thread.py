"""One communication thread per process, fed by a FIFO queue: the CPU analogue of NCCL's
communication stream, used by labkit.comm.collectives.

Async collectives go through this queue; a sync call first waits until the queue has drained,
then runs on the calling thread (the same order as queueing it, minus two thread hand-offs, which
cost milliseconds on a loaded 2-core machine). So on every rank labkit collectives run one at a
time in the order they were issued: as long as all ranks issue the same sequence, their
point-to-point messages can never interleave or reorder. Issue them from one thread per rank,
as with torch.distributed.

Left out on purpose:
- Ordering with torch.distributed calls the user makes directly (dist.all_reduce, dist.send, ...)
  while labkit async ops are in flight: those run on the calling thread and are NOT ordered with
  this queue. Wait on the labkit handles first.
- Several streams / priorities: one queue, strictly FIFO.
- CUDA stream semantics: on CUDA, wait() blocks the host until the op is done (NCCL's Work.wait
  only makes the current stream wait).
"""

import atexit
import os
import queue
import threading
from typing import Any, Callable, Optional

from labkit.observe import tracing

COMM_THREAD_NAME = "labkit-comm"
_SHUTDOWN = object()


class CollectiveHandle:
    """Returned by async labkit collectives. `wait()` blocks until the op is done and re-raises
    an error from the communication thread, naming the rank and the op."""

    def __init__(self, op_name, rank, token=None):
        self.op_name = op_name
        self.rank = rank
        self._token = token
        self._done = threading.Event()
        self._error = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        with tracing.blocked(self._token):
            finished = self._done.wait(timeout)
        if not finished:
            raise TimeoutError(f"rank {self.rank}: {self.op_name} not done after {timeout} s")
        if self._error is not None:
            err = self._error
            # Our own checks already say what went wrong: keep their type so callers can catch it.
            kind = type(err) if isinstance(err, (ValueError, TypeError)) else RuntimeError
            raise kind(f"rank {self.rank}: {self.op_name} failed: {err}") from err
        return True

    def _finish(self, error):
        self._error = error
        self._done.set()


class _CommWorker:
    def __init__(self):
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # jobs queued or running on the comm thread
        self.drained = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name=COMM_THREAD_NAME, daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            item = self.jobs.get()
            if item is _SHUTDOWN:
                return
            job, handle = item
            item, error = None, None
            try:
                # The ring's own isend/irecv are steps of one collective, not events of their own.
                with tracing.untraced(), tracing.attributed(handle._token):
                    job()
            except BaseException as exc:  # surfaces in handle.wait() on the caller's thread
                error = exc
            finally:
                # Drop the job BEFORE the waiter wakes, not when the next one arrives: its closure
                # holds the collective's tensors (an all-gather's output, a reduce-scatter's
                # input), which would otherwise stay alive -- and be measured -- after the caller
                # freed its own references (until the next collective, or until this thread runs
                # again on a busy machine). ZeRO-2 frees its send buffers right after wait().
                item = job = None
                if handle._token is not None:
                    handle._token.finish()
                handle._finish(error)
                handle = error = None
                with self.drained:
                    self.pending -= 1
                    self.drained.notify_all()

    def put(self, job, handle):
        with self.drained:
            self.pending += 1
        self.jobs.put((job, handle))

    def wait_drained(self):
        with self.drained:
            while self.pending:
                self.drained.wait()


_worker = None
_worker_lock = threading.Lock()


def _get_worker():
    global _worker
    with _worker_lock:
        # After a fork the child inherits the object but not the thread: start a fresh one.
        if _worker is None or _worker.pid != os.getpid() or not _worker.thread.is_alive():
            _worker = _CommWorker()
        return _worker


def submit(
    job: Callable[[], Any], *, op_name: str, rank: int, nbytes: int, world_size: int, async_op: bool
) -> Optional[CollectiveHandle]:
    """Run `job()` after every labkit collective issued before it on this process.

    Sync: waits for the queue to drain, runs job on the calling thread, records one collective,
    returns None (errors raise). Async: queues job for the comm thread, returns a CollectiveHandle."""
    if not async_op:
        worker = _worker
        if worker is not None and worker.pid == os.getpid():
            worker.wait_drained()  # everything issued before runs first
        error = None
        with tracing.record_collective(op_name, nbytes, world_size):
            try:
                job()
            except Exception as exc:  # same message as from an async handle
                error = exc
        if error is not None:  # (a handle only then: its Event costs µs per call)
            handle = CollectiveHandle(op_name, rank)
            handle._finish(error)
            handle.wait()
        return None
    token = tracing.start_collective(op_name, nbytes, world_size)
    handle = CollectiveHandle(op_name, rank, token)
    _get_worker().put(job, handle)
    return handle


def shutdown(timeout: float = 5.0) -> None:
    """Stop this process's communication thread after the jobs already queued (no-op if none).
    Daemon threads never keep a process alive; this just lets queued work finish first."""
    global _worker
    with _worker_lock:
        worker, _worker = _worker, None
    if worker is not None and worker.pid == os.getpid() and worker.thread.is_alive():
        worker.jobs.put(_SHUTDOWN)
        worker.thread.join(timeout)


atexit.register(shutdown)
