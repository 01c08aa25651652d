"""The kernel's side of a launch while the ranks run: wait for their results, notice a rank that
died (and how) or hangs, hold interrupts back while ranks start or stop, and kill them all.
"""

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time

from . import _report
from ._descendants import kill_descendants
from ._report import RankTimeout

FAILURE_GRACE_S = 1.0  # after a first error, how long to wait for the other ranks' errors


class _Interrupts:
    """SIGINT (JupyterLab's stop button, Ctrl-C) while ranks start or are torn down is held back
    until they are all tracked or reaped: an interrupt between a child's start() and its
    bookkeeping would leave it running for the rest of the kernel's life. While the kernel waits
    for the ranks (`_collect`), an interrupt acts at once. Python runs signal handlers in the main
    thread whichever thread the OS delivered to, so deciding by the interrupted frame is exact."""

    def __init__(self):
        self.pending, self.old = False, None

    def _handler(self, signum, frame):
        while frame is not None:
            if frame.f_code is _collect.__code__:
                raise KeyboardInterrupt
            frame = frame.f_back
        self.pending = True

    def deliver(self):
        """Raise the interrupt held back so far (the ranks are all tracked now)."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
        if self.pending and exc[0] is not KeyboardInterrupt:
            raise KeyboardInterrupt
        return False


def _kill(p) -> None:
    """Kill a rank and everything it started: first every descendant (the rank is a subreaper,
    so a setsid'd grandchild is still below it), then its process group and the rank."""
    if p.pid is None:
        return
    if p.is_alive():
        kill_descendants(p.pid)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if p.is_alive():  # not yet its own group leader
        p.kill()


def _how_it_died(p) -> str:
    p.join(timeout=1)  # its pipe closes a moment before the process is reaped
    code = p.exitcode
    if code is None:
        return "closed its result pipe and is still running"
    if code < 0:
        name = signal.Signals(-code).name
        hint = {
            signal.SIGKILL: " (killed from outside: the out-of-memory killer?)",
            signal.SIGSEGV: " (a crash in C/C++ code)",
            signal.SIGABRT: " (aborted: see its last output)",
        }.get(-code, "")
        return f"signal {name}{hint}"
    return f"exit code {code}"


def _receive(r, conn, proc, pump, locations):
    """One rank's message: ("ok", value, extras), or an error tuple (see _worker)."""
    try:
        msg = conn.recv_bytes()
    except (EOFError, OSError):
        # The worker never closes its pipe while alive (it waits to be killed): EOF means death.
        how = _how_it_died(proc)
        pump.pump()
        return (
            "error",
            "RankDied",
            f"rank {r} died with {how} before returning; its last "
            f"output:\n{_report.last_output(pump.lines[r], locations)}",
            [],
            "",
            time.time(),
        )
    obj = pickle.loads(msg)
    if obj[0] != "ok":
        return obj
    try:
        value, extras = pickle.loads(obj[2])
    except Exception as exc:
        return (
            "error",
            "UnpicklingError",
            f"rank {r} returned a value of type {obj[1]} that "
            f"the notebook cannot unpickle ({type(exc).__name__}: {exc}); return tensors, "
            f"numbers, lists or dicts instead",
            [],
            "",
            time.time(),
        )
    return ("ok", value, extras or {})


def _collect(procs, conns, pump, stacks, timeout, backend, locations):
    __tracebackhide__ = True
    n = len(procs)
    values: list = [None] * n
    extras: list[dict] = [{}] * n
    errors: dict[int, str] = {}
    pending = set(range(n))
    deadline = time.monotonic() + timeout
    first_error = None
    while pending:
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = set(mp.connection.wait(waitables, timeout=0.05))
        pump.pump()
        for r in sorted(pending):
            if conns[r] in ready or procs[r].sentinel in ready:
                obj = _receive(r, conns[r], procs[r], pump, locations)
                if obj[0] == "ok":
                    values[r], extras[r] = obj[1], obj[2]
                else:
                    errors[r] = obj
                pending.discard(r)
        if errors and first_error is None:
            first_error = time.monotonic()
        if first_error is not None and time.monotonic() - first_error > FAILURE_GRACE_S:
            break
        if pending and time.monotonic() > deadline and first_error is None:
            raise _hang_report(procs, pending, stacks, timeout, backend, n, locations)
    return values, extras, errors


def _hang_report(procs, pending, stacks, timeout, backend, n, locations):
    for r in pending:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.5)
    done = sorted(set(range(n)) - pending)
    parts = [
        f"labkit.run timed out after {timeout:g} s ({n} ranks, {backend}): "
        f"rank{'s' if len(pending) > 1 else ''} {', '.join(map(str, sorted(pending)))} did "
        f"not finish" + (f" (finished: {', '.join(map(str, done))})" if done else "") + ".",
        "A rank that never joins a collective, or ranks calling different collectives, "
        "wait for each other forever. Where each rank is stuck:",
    ]
    for r in sorted(pending):
        try:
            dump = open(stacks[r]).read()
        except OSError:
            dump = ""
        parts += [f"--- rank {r} ---", _report.format_stack_dump(dump, locations) or "  (no Python stack)"]
    return RankTimeout("\n".join(parts), {r: ("Timeout", "did not finish") for r in pending})
