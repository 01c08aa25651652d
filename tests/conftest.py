import os

import psutil
import pytest

from labkit.launch.run import preload

os.environ.setdefault("LABKIT_OUTPUT", "ordered")
# The ranks import each test module they run a function of, and with it pytest: once in the
# forkserver instead of once per rank per launch (about 0.25 s of CPU each).
preload("pytest")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def notebook_namespace(source: str) -> dict:
    """Execute source as a notebook cell would: its functions live in a module called __main__,
    which the ranks cannot import, so labkit must ship them by value."""
    ns = {"__name__": "__main__"}
    exec(compile(source, "<notebook-cell>", "exec"), ns)
    return ns


def forkservers():
    """{process: its command line} of multiprocessing's forkservers started by this process."""
    found = {}
    for child in psutil.Process().children():
        try:
            line = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "forkserver" in line:
            found[child] = line
    return found


def worker_processes():
    """Live rank processes: children of multiprocessing's forkserver (the forkserver itself and
    the resource tracker are the kernel's helpers, not workers)."""
    out = []
    for server in forkservers():
        try:
            out += [p for p in server.children(recursive=True) if p.status() != "zombie"]
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def no_leftover_workers():
    yield
    import time

    deadline = time.time() + 5
    while worker_processes() and time.time() < deadline:
        time.sleep(0.1)
    assert worker_processes() == [], "labkit.run left worker processes behind"


def run_in_own_group(cmd, timeout, **kw):
    """subprocess.run, but on timeout the whole process group dies (torchrun's workers too).

    The child's TMPDIR is a folder removed afterwards: torchrun's agent makes a torchelastic_*
    folder in the temp dir on every launch and never removes it."""
    import shutil
    import signal
    import subprocess
    import tempfile

    tmp = tempfile.mkdtemp(prefix="labkit_child_")
    env = dict(kw.pop("env", None) or os.environ, TMPDIR=tmp)
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
            **kw,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout} s: {cmd}\n{out[-2000:]}\n{err[-2000:]}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
