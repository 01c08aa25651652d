"""Fault cases for labkit.run, shared by `benchmarks/faults.py` (the campaign, N trials a case)
and `tests/test_faults.py` (a few trials each). Every case returns one trial's outcome:
(held: bool, seconds: float, detail: str).

Faults are made the way they happen: a rank that segfaults, calls os._exit, or is SIGKILLed (the
OOM killer) mid-collective or outside one; SIGINT (JupyterLab's stop button) at a random moment
of a launch; torchrun runs that must exit cleanly.
"""

import contextlib
import ctypes
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import cloudpickle
import psutil

# The ranks cannot import this file (it is not on their path): ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

HOW_WORDS = {"segfault": "SIGSEGV", "exit3": "exit code 3", "sigkill": "SIGKILL"}


def die(how, where):
    """Rank function: rank 1 dies `how`; rank 0 is in a collective with it, or just busy."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(0.3)  # rank 0 is inside all_reduce (or sleeping) by now
        if how == "segfault":
            ctypes.string_at(0)
        elif how == "exit3":
            os._exit(3)
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    if where == "in_collective":
        dist.all_reduce(torch.ones(1 << 16))
    else:
        time.sleep(30)


def death_trial(how, where, timeout=20):
    """held: the error's first line names rank 1 and how it died, within 2 s."""
    import labkit

    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the dead rank's output: in the error
            labkit.run(die, how, where, world_size=2, timeout=timeout)
        return False, time.perf_counter() - t0, "no error raised"
    except labkit.RankError as exc:
        dt = time.perf_counter() - t0
        first = str(exc).splitlines()[0]
        ok = first.startswith("rank 1 ") and "died" in first and HOW_WORDS[how] in first
        return ok and dt <= 2.0, dt, f"{dt:.2f} s: {first[:160]}"


def forkserver_workers():
    """Live processes below multiprocessing's forkserver: the ranks (and what they started)."""
    out = []
    for child in psutil.Process().children():
        try:
            if "forkserver" in " ".join(child.cmdline()):
                out += [p for p in child.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
        except psutil.NoSuchProcess:
            pass
    return out


def _sleep(s):
    time.sleep(s)


def interrupt_trial(world_size, delay):
    """SIGINT `delay` s into a launch. held: KeyboardInterrupt reached the caller and no rank
    is alive 5 s later. Call from the main thread of a process that may take SIGINTs."""
    import labkit

    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.perf_counter()
    interrupted = False
    try:
        timer.start()
        labkit.run(_sleep, 30, world_size=world_size, timeout=60)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        timer.cancel()
    deadline = time.monotonic() + 5
    while forkserver_workers() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = forkserver_workers()
    return (
        interrupted and not left,
        time.perf_counter() - t0,
        f"delay {delay:.2f} s, {len(left)} left alive" + ("" if interrupted else ", no interrupt"),
    )


def interrupt_campaign(world_size, trials, seed=0):
    """Runs interrupt trials in a fresh process (SIGINT must not hit the caller)."""
    code = textwrap.dedent(f"""
        import json, random, sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import labkit, _launch_faults as f
        labkit.run(f._sleep, 0, world_size={world_size})     # warm forkserver, as in a kernel
        rng = random.Random({seed})
        out = [f.interrupt_trial({world_size}, rng.uniform(0.02, 0.6)) for _ in range({trials})]
        print("RESULT", json.dumps(out))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60 + trials * 15
    )
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not line:
        raise RuntimeError(f"interrupt campaign failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    import json

    return [tuple(x) for x in json.loads(line[0][7:])]


TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist, labkit
def f():
    t = torch.ones(1) * (dist.get_rank() + 1); dist.all_reduce(t)
    return t.item()
res = labkit.run(f, world_size=2)
if dist.get_rank() == 0:
    print("RESULT", list(res))
"""


def torchrun_trial(workdir):
    """One torchrun run of 2 ranks. held: exit 0 and the right result (no SIGABRT at exit)."""
    script = os.path.join(workdir, "torchrun_case.py")
    with open(script, "w") as f:
        f.write(TORCHRUN_SCRIPT)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    ok = proc.returncode == 0 and "RESULT [3.0, 3.0]" in out
    return ok, time.perf_counter() - t0, "" if ok else (err.strip().splitlines() or ["?"])[-1][:160]
