"""Every process a rank started, however it started it: the rank is a child subreaper, so an
orphan anywhere below it (a daemon that double-forked, a `setsid` grandchild) is re-parented to
the rank instead of to init, and stays in the rank's tree until the call ends and it is killed.
Killing the rank's process group alone misses whatever left the group (setsid,
start_new_session=True). Linux only (/proc, prctl); elsewhere a no-op.

What it leaves out: a rank that dies on its own (a crash) hands its orphans to init before the
kernel can walk its tree; its process group still dies with the call.
"""

import contextlib
import ctypes
import os
import signal

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make this process the reaper of its orphaned descendants (prctl; Linux >= 3.4)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _parents() -> dict:
    """{pid: parent pid} of every process in /proc."""
    out = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                out[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass  # it exited while we looked
    return out


def descendants(pid: int) -> list:
    """The pids below `pid` now (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def kill_descendants(pid: int, rounds: int = 5) -> None:
    """SIGKILL everything below `pid` (which stays alive): the orphans of what was killed come
    back under `pid` (a subreaper) and are caught in the next round; stops when none is left."""
    for _ in range(rounds):
        found = [p for p in descendants(pid) if p != os.getpid()]
        if not found:
            return
        for p in found:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
