import os
import time

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


def tree_cpu_seconds(proc: psutil.Process) -> float:
    """CPU seconds (user + system) that proc and its descendants have used so far: the live ones'
    own, and those of the children each of them has reaped."""
    try:
        tree = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in tree:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def wait_while_it_works(done, proc, what, cpu_budget_s=300.0, stall_s=120.0):
    """Wait until done() is true, while proc (a subprocess.Popen) works towards it.

    No wall-clock deadline: on a loaded machine a cold start (Python, torch, a forkserver, a rank:
    about 7 CPU seconds) takes as long as the machine's other work lets it, past any fixed budget
    of seconds (a 60 s one was missed beside 6 CPU hogs on 2 cores). A hang still fails, by the
    process tree's CPU clock, which load does not stretch: proc exits first, or its tree spends
    cpu_budget_s of CPU without getting there (a spin), or its CPU time stands still for stall_s
    (all of it blocked: a runnable process, however starved, is scheduled many times a second)."""
    tree = psutil.Process(proc.pid)
    used, moved_at = -1.0, time.monotonic()
    while not done():
        if proc.poll() is not None:
            if done():
                return
            raise AssertionError(f"{what}: the process ended (exit status {proc.returncode}) first")
        now = tree_cpu_seconds(tree)
        if now > used:
            used, moved_at = now, time.monotonic()
        assert used < cpu_budget_s, f"{what}: not after {used:.0f} CPU seconds (spinning?)"
        assert time.monotonic() - moved_at < stall_s, f"{what}: no CPU used for {stall_s:g} s (blocked?)"
        time.sleep(0.1)
