"""The per-run folder under the temp dir: rank logs and stack dumps of one `labkit.run` call.

The kernel removes it when the call ends. A kernel that died mid-call cannot, so each folder
names its owner (pid and start time, so a reused pid is not mistaken for it) and the next
`import labkit` sweeps the folders whose owner is gone. Ranks watch their folder too: once it is
gone the call is over, so a rank the kernel never learned about (an interrupt between start()
and bookkeeping) exits by itself instead of sleeping for the rest of the kernel's life.
"""

import glob
import os
import shutil
import tempfile
import time

PREFIX = "labkit-run-"
OWNER = "owner"
UNOWNED_MAX_AGE_S = 3600  # a folder with no owner file yet is being created, unless it is old


def _start_time(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time in ticks
    except (OSError, IndexError):
        return None


def create() -> str:
    path = tempfile.mkdtemp(prefix=PREFIX)
    me = os.getpid()
    # Written whole or not at all (a sweep in another kernel must never read half an owner).
    with open(os.path.join(path, OWNER + ".tmp"), "w") as f:
        f.write(f"{me} {_start_time(me)}")
    os.replace(os.path.join(path, OWNER + ".tmp"), os.path.join(path, OWNER))
    return path


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _owner_alive(path: str) -> bool:
    try:
        pid, start = open(os.path.join(path, OWNER)).read().split()
    except (OSError, ValueError):  # no owner yet (being created), or not ours to judge
        try:
            return time.time() - os.path.getmtime(path) < UNOWNED_MAX_AGE_S
        except OSError:
            return True
    if not os.path.exists(f"/proc/{pid}"):
        return not os.path.isdir("/proc/self")  # no /proc (not Linux): keep, we cannot tell
    return _start_time(int(pid)) == start


def sweep() -> list:
    """Remove the run folders of kernels that died; returns the removed paths."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")):
        if os.path.isdir(path) and not _owner_alive(path):
            remove(path)
            removed.append(path)
    return removed
