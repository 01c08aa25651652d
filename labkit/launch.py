"""Launch real torch.distributed ranks from a notebook cell: `labkit.run(fn, world_size=4)`.

How: a forkserver with torch preloaded forks one process per rank (fast after the first launch,
and the kernel never touches CUDA); the ranks meet at a TCPStore that the kernel opens on a free
port; the function travels by value (cloudpickle), so functions defined in a notebook work.

Left out on purpose: multi-node launch (use torchrun: `labkit.run` called under torchrun joins
its process group) and restarting failed ranks.
"""
import contextlib
import linecache
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import uuid
from datetime import timedelta

import cloudpickle

from . import _report
from ._report import RankError, RankTimeout

BACKENDS = ("auto", "gloo", "nccl")
FAILURE_GRACE_S = 1.0     # after a first error, how long to wait for the other ranks' errors
_output_mode = None
_noted_oversubscription = set()


class RunResult(list):
    """The ranks' return values, indexed by rank, plus what labkit recorded on each rank."""
    traces: list
    memory: list
    logs: list
    wall_s: float
    backend: str
    world_size: int

    @classmethod
    def build(cls, values, extras, backend, logs=(), wall_s=float("nan")):
        """extras: per rank, what `_worker.end_hooks()` returned there."""
        result = cls(values)
        result.traces = [e.get("trace") for e in extras]
        result.memory = [e.get("memory") for e in extras]
        result.logs, result.wall_s = list(logs), wall_s
        result.backend, result.world_size = backend, len(values)
        return result


def set_output(mode: str) -> None:
    """'live': print rank output as it comes; 'ordered': rank by rank at the end (deterministic);
    'auto': ordered under CI/nbval/pytest, live otherwise."""
    global _output_mode
    if mode not in ("live", "ordered", "auto"):
        raise ValueError(f"output mode must be 'live', 'ordered' or 'auto', got {mode!r}")
    _output_mode = None if mode == "auto" else mode


def device():
    """This rank's device: cuda:<local rank> under NCCL, cpu under gloo (cpu outside a run)."""
    from ._worker import current_device
    return current_device()


def _gpu_count() -> int:
    import torch
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return 0
    # NVML counts GPUs without initialising CUDA in this process.
    n = getattr(torch.cuda, "_device_count_nvml", lambda: -1)()
    return n if n >= 0 else torch.cuda.device_count()


def _check_args(fn, world_size, backend, timeout):
    if not callable(fn):
        raise TypeError(f"labkit.run: fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"labkit.run: world_size must be an int ≥ 1, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"labkit.run: world_size must be ≥ 1, got {world_size}")
    if backend not in BACKENDS:
        raise ValueError(f"labkit.run: backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"labkit.run: timeout must be a positive number of seconds, "
                         f"got {timeout!r}")


def _resolve_backend(backend: str, world_size: int) -> str:
    if backend == "gloo":
        return "gloo"
    gpus = _gpu_count()
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"labkit.run: backend='nccl' needs one GPU per rank: world_size="
                         f"{world_size} but found {gpus} GPU(s). Use backend='gloo' (CPU) or "
                         f"a smaller world_size.")
    if backend == "nccl" or gpus >= world_size:
        return "nccl"
    return "gloo"


def _context():
    ctx = mp.get_context("forkserver")
    # Preloading makes every launch after the first a fork of a process that has torch imported.
    # torch._dynamo: torch.optim imports it on the first optimizer a rank builds, which costs
    # seconds per rank per launch unless the forkserver already holds it.
    ctx.set_forkserver_preload(["labkit._worker", "labkit.tracing", "labkit.memory",
                                "labkit.collectives", "torch.optim", "torch._dynamo"])
    return ctx


def warm_up(background: bool = True):
    """Start the forkserver (torch preloaded) now, so the first `labkit.run` does not wait for it.

    `import labkit` calls this in a Jupyter kernel: by the time a learner's first launch comes,
    the seconds of importing torch in the forkserver have passed. Scripts and torchrun don't."""
    import multiprocessing.forkserver as forkserver
    _context()
    if not background:
        forkserver.ensure_running()
        return
    import threading
    threading.Thread(target=forkserver.ensure_running, name="labkit-warm-up", daemon=True).start()


def _warm_up_in_a_kernel():
    if ("ipykernel" in sys.modules and os.environ.get("LABKIT_WORKER") != "1"
            and not _in_torchrun() and os.environ.get("LABKIT_WARM_UP", "1") != "0"):
        warm_up()


@contextlib.contextmanager
def _no_main_reimport():
    # multiprocessing would re-import the parent's __main__ in each child (re-running a script,
    # or failing for `python - < file`). The rank needs nothing from it: fn travels by value.
    original = mp.spawn.get_preparation_data

    def without_main(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    mp.spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        mp.spawn.get_preparation_data = original


def _in_torchrun() -> bool:
    return (all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
            and os.environ.get("LABKIT_WORKER") != "1")


def run(fn, *args, world_size=2, backend="auto", timeout=60.0, **kwargs):
    """Run fn(*args, **kwargs) on every rank of a fresh process group; return a RunResult
    (a list of the ranks' return values, indexed by rank)."""
    __tracebackhide__ = True   # IPython and pytest: show the learner's cell, not labkit's frames
    _check_args(fn, world_size, backend, timeout)
    if os.environ.get("LABKIT_WORKER") == "1":
        raise RuntimeError("labkit.run cannot be called from inside a rank")
    if _in_torchrun():
        from ._torchrun import run_under_torchrun
        return run_under_torchrun(fn, args, kwargs, world_size, backend)
    backend = _resolve_backend(backend, world_size)
    cores = os.cpu_count() or 1
    if backend == "gloo" and world_size > cores and world_size not in _noted_oversubscription:
        _noted_oversubscription.add(world_size)
        print(f"labkit.run: note: {world_size} ranks on {cores} CPU cores (oversubscribed gloo: "
              f"correct, but slower and noisier timings)", file=sys.stderr)
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"labkit.run: cannot send fn and its arguments to the ranks: {exc}") from None
    locations = _report.code_locations(fn, list(args), list(kwargs.values()))
    try:
        return _launch(payload, world_size, backend, float(timeout), max(1, cores // world_size),
                       locations)
    except RankError as error:
        # Raised from a frame of its own, so the notebook's traceback is the learner's cell and
        # this one line, not labkit's internals (IPython always shows the innermost frame).
        exec(_RAISE, {"error": error})


_RAISE_SOURCE = "raise error.with_traceback(None) from None  # what the ranks did: see below\n"
_RAISE = compile(_RAISE_SOURCE, "<labkit.run>", "exec")
linecache.cache["<labkit.run>"] = (len(_RAISE_SOURCE), None, [_RAISE_SOURCE], "<labkit.run>")


def _launch(payload, world_size, backend, timeout, threads, locations=()):
    __tracebackhide__ = True
    import torch.distributed as dist
    start = time.perf_counter()
    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="labkit-")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout + 30))
    logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
    stacks = [os.path.join(tmp, f"rank{r}.stack") for r in range(world_size)]
    pump = _report.OutputPump(logs, live=(_output_mode or _report.default_output_mode()) == "live")
    from . import _worker
    run_id = uuid.uuid4().hex
    procs, conns = [], []
    try:
        for r in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            spec = dict(rank=r, world_size=world_size, backend=backend, port=store.port,
                        run_id=run_id, payload=payload, log_path=logs[r], stack_path=stacks[r],
                        kernel_pid=os.getpid(), pg_timeout=timeout + 30, threads=threads)
            p = ctx.Process(target=_worker.main, args=(spec, send), daemon=True,
                            name=f"labkit-rank{r}")
            with _no_main_reimport():
                p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        values, extras, errors = _collect(procs, conns, pump, stacks, timeout, backend, locations)
    finally:
        # Whatever happened (success, failure, hang, KeyboardInterrupt): no rank outlives the call.
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        for c in conns:
            c.close()
        pump.finish()
        del store
        shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        raise _report.failure_report(errors, world_size, backend, locations)
    return RunResult.build(values, extras, backend, [pump.text(r) for r in range(world_size)],
                           time.perf_counter() - start)


def _collect(procs, conns, pump, stacks, timeout, backend, locations):
    __tracebackhide__ = True
    n = len(procs)
    values, extras, errors = [None] * n, [{}] * n, {}
    pending = set(range(n))
    deadline = time.monotonic() + timeout
    first_error = None
    while pending:
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = mp.connection.wait(waitables, timeout=0.05)
        pump.pump()
        for r in sorted(pending):
            if conns[r] in ready or (procs[r].sentinel in ready and conns[r].poll()):
                try:
                    msg = conns[r].recv_bytes()
                except (EOFError, OSError):
                    msg = None
                if msg is not None:
                    obj = pickle.loads(msg)
                    if obj[0] == "ok":
                        values[r], extras[r] = obj[1], obj[2] or {}
                    else:
                        errors[r] = obj
                    pending.discard(r)
                    continue
            if procs[r].sentinel in ready and not conns[r].poll():
                procs[r].join(timeout=1)
                code = procs[r].exitcode
                how = (f"signal {signal.Signals(-code).name}" if code is not None and code < 0
                       else f"exit code {code}")
                hint = " (killed: out of memory?)" if code == -signal.SIGKILL else ""
                pump.pump()
                errors[r] = ("error", "RankDied", f"rank {r} died with {how}{hint} before "
                             f"returning; its last output:\n{pump.tail(r)}", [], "", time.time())
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
    parts = [f"labkit.run timed out after {timeout:g} s ({n} ranks, {backend}): "
             f"rank{'s' if len(pending) > 1 else ''} {', '.join(map(str, sorted(pending)))} did "
             f"not finish" + (f" (finished: {', '.join(map(str, done))})" if done else "") + ".",
             "A rank that never joins a collective, or ranks calling different collectives, "
             "wait for each other forever. Where each rank is stuck:"]
    for r in sorted(pending):
        try:
            dump = open(stacks[r]).read()
        except OSError:
            dump = ""
        parts += [f"--- rank {r} ---", _report.format_stack_dump(dump, locations) or "  (no Python stack)"]
    return RankTimeout("\n".join(parts), {r: ("Timeout", "did not finish") for r in pending})
