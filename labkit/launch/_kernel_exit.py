"""A Jupyter kernel that imported labkit shuts down (and restarts) cleanly and at once.

At a shutdown or restart, ipykernel SIGTERMs every child in its process group and waits until
they are gone, going over to SIGKILL only after about 14 s; jupyter_client kills the kernel itself
after 2.5 s. Two of the kernel's children are multiprocessing's: the forkserver labkit launches
ranks from, and its resource tracker, which ignores SIGTERM by design. So a kernel that had
imported labkit was killed: every restart waited 2.5 s, and the kernel's atexit handlers (the comm
thread's shutdown, a lab's scratch folder) never ran. `install` makes the kernel's `do_shutdown`
stop both first, as multiprocessing's own `_stop` does (the forkserver told to go, the tracker's
pipe closed, so it exits once the last process holding it has); ipykernel's sweep then finds
nothing left.

Left out: other kernels (only ipykernel's sweep needs this), and Windows (no forkserver there).
"""

import os
import signal
import sys
import time
from typing import Any

from .run import _in_a_jupyter_kernel

_INSTALLED = "_labkit_stops_helpers"


def stop_helpers(wait_s: float = 1.0) -> None:
    """Stop this process's multiprocessing forkserver and resource tracker, if running. Ranks
    still running (a shutdown in the middle of a launch) keep the tracker alive until they die;
    it is waited for at most `wait_s`."""
    from multiprocessing import forkserver, resource_tracker

    server: Any = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)  # at once, even in the middle of its preload
        except ProcessLookupError:
            pass
        try:
            server._stop()  # closes its pipe, reaps it, removes its socket file
        except (AttributeError, OSError):
            pass
    tracker: Any = getattr(resource_tracker, "_resource_tracker", None)
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if fd is None:
        return
    tracker._fd = tracker._pid = None
    os.close(fd)  # its last writer gone, the tracker cleans up after the ranks and exits
    if pid is None:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.01)


def install() -> None:
    """In a running ipykernel: stop labkit's helpers before the kernel's shutdown (or restart)
    sweeps its children. Anywhere else, nothing."""
    if not _in_a_jupyter_kernel():
        return
    kernel = sys.modules["ipykernel.kernelapp"].IPKernelApp.instance().kernel
    if kernel is None or getattr(kernel, _INSTALLED, False):
        return
    original = kernel.do_shutdown

    def do_shutdown(restart: bool) -> Any:
        # returns what the kernel's own returns (a reply, or a coroutine if it is async): any
        # ipykernel version gets what it got before
        stop_helpers()
        return original(restart)

    kernel.do_shutdown = do_shutdown
    setattr(kernel, _INSTALLED, True)
