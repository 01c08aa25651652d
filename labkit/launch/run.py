"""Launch real torch.distributed ranks from a notebook cell: `labkit.run(fn, world_size=4)`.

How: a forkserver with torch preloaded forks one process per rank (fast after the first launch,
and the kernel never touches CUDA); the ranks meet at a FileStore in the call's own temp folder
(every rank is on this machine; torch's TCPStore made about one launch in 20-30 wait 5 s for a
client's connect here, a FileStore none in 60); the function travels by value (cloudpickle), so
functions defined in a notebook work.

Left out on purpose: multi-node launch (use torchrun: `labkit.run` called under torchrun joins
its process group) and restarting failed ranks.
"""

import contextlib
import linecache
import math
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.spawn
import numbers
import operator
import os
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional

import cloudpickle

from . import _report, _rundir
from ._supervise import _Interrupts, _collect, _kill
from ._report import RankError, RunResult

if TYPE_CHECKING:
    import torch

BACKENDS = ("auto", "gloo", "nccl")
_output_mode = None
_noted_oversubscription = False  # the note is shown once per kernel


def set_output(mode: str) -> None:
    """'live': print rank output as it comes; 'ordered': rank by rank at the end (deterministic);
    'auto': ordered under CI/nbval/pytest, live otherwise."""
    global _output_mode
    if mode not in ("live", "ordered", "auto"):
        raise ValueError(f"output mode must be 'live', 'ordered' or 'auto', got {mode!r}")
    _output_mode = None if mode == "auto" else mode


def device() -> "torch.device":
    """This rank's device: cuda:<local rank> under NCCL, cpu under gloo (cpu outside a run)."""
    from ._worker import current_device

    return current_device()


def _usable_cores() -> int:
    """The cores this process may run on (a container's cpuset, taskset), not the node's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _gpu_count() -> int:
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return 0
    # NVML counts GPUs without initialising CUDA in this process.
    n = getattr(torch.cuda, "_device_count_nvml", lambda: -1)()
    return n if n >= 0 else torch.cuda.device_count()


def _max_world_size() -> int:
    """The most ranks one launch may start: 8 per usable core (oversubscribed runs still teach,
    400 forked torch processes are a typo), or LABKIT_MAX_WORLD_SIZE when set."""
    value = os.environ.get("LABKIT_MAX_WORLD_SIZE")
    if value is None:
        return 8 * _usable_cores()
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"labkit.run: LABKIT_MAX_WORLD_SIZE must be an integer, got {value!r}") from None


def _check_args(fn, world_size, backend, timeout):
    """Refuse bad input with what is allowed; returns (world_size, timeout) as int, float."""
    if not callable(fn):
        raise TypeError(f"labkit.run: fn must be callable, got {type(fn).__name__}")
    try:  # any integer type (numpy.int64 included), but not True/False
        n = operator.index(world_size) if not isinstance(world_size, bool) else None
    except TypeError:
        n = None
    if n is None:
        raise TypeError(f"labkit.run: world_size must be an int ≥ 1, got {world_size!r}")
    if n < 1:
        raise ValueError(f"labkit.run: world_size must be ≥ 1, got {n}")
    limit = _max_world_size()
    if n > limit:
        raise ValueError(
            f"labkit.run: world_size={n} is far beyond this machine ({_usable_cores()} "
            f"usable CPU cores; the limit is 8 per core, {limit}): each rank is a "
            f"torch process. A typo? To mean it, set LABKIT_MAX_WORLD_SIZE={n} in "
            f"the environment"
        )
    if backend not in BACKENDS:
        raise ValueError(f"labkit.run: backend must be one of {BACKENDS}, got {backend!r}")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(
            f"labkit.run: timeout must be a positive, finite number of seconds "
            f"(for a long run, say timeout=3600), got {timeout!r}"
        )
    return n, float(timeout)


def _resolve_backend(backend: str, world_size: int) -> str:
    if backend == "gloo":
        return "gloo"
    gpus = _gpu_count()
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"labkit.run: backend='nccl' needs one GPU per rank: world_size="
            f"{world_size} but found {gpus} GPU(s). Use backend='gloo' (CPU) or "
            f"a smaller world_size."
        )
    if backend == "nccl" or gpus >= world_size:
        return "nccl"
    return "gloo"


# What the forkserver imports once, before it forks any rank, so that every launch after the
# first is a fork of a process that already holds them; a module left out is imported again by
# every rank of every launch that needs it. torch._dynamo: torch.optim imports it on the first
# optimizer a rank builds (seconds per rank). labkit's strategies and the labs' checks: every
# course launch runs them, and importing them cost each rank of each launch about 0.3 s of CPU
# (a check's launch of 4 ranks on 2 cores: a second of wall); likewise the lab modules whose
# functions run inside ranks (hsdp_lab's timed windows, pp_choice, checkpoint_runs). Modules are
# named, not imported here: the launcher stays below the strategies and labs it starts
# (docs/dev/CONTRACTS.md).
# _worker imports labkit.observe's tracing, recording and memory itself.
PRELOAD: list[str] = [
    "labkit.launch._worker",
    "labkit.comm.collectives",
    "torch.optim",
    "torch._dynamo",
    "labkit.loop",
    # torch's own strategies, the oracles (the strategies import these when a rank builds one)
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch.distributed.optim",
    *(
        f"labkit.strategies.{name}"
        for name in ("ddp", "zero", "fsdp", "tp", "pp", "cp", "ulysses", "ep", "three_d", "checkpoint")
    ),
    *(
        f"labkit.labs.{name}"
        for name in (
            "collective_checks",
            "zero_checks",
            "fsdp_checks",
            "hsdp_checks",
            "hsdp_lab",
            "tp_checks",
            "pp_checks",
            "pp_choice",
            "seq_checks",
            "moe_checks",
            "precision_checks",
            "checkpoint_runs",
        )
    ),
]


def preload(*modules: str) -> None:
    """Add modules to what the forkserver imports before it forks ranks (PRELOAD): for modules
    every rank of a program imports (a test suite's ranks import pytest with its test module).
    Only before the forkserver starts (the first launch, or warm_up: `import labkit` in a Jupyter
    kernel starts it): a running forkserver would ignore the new name, so that is refused."""
    for name in modules:
        if not isinstance(name, str) or not name:
            raise TypeError(f"labkit.launch.run.preload: module names, got {name!r}")
    new = [name for name in dict.fromkeys(modules) if name not in PRELOAD]
    if new and (_warm_up_started or _forkserver_running()):
        raise RuntimeError(
            f"labkit.launch.run.preload: the forkserver is already running, so {new} would not "
            f"be preloaded; call preload() before the first launch (in a Jupyter kernel, before "
            f"`import labkit`, or with LABKIT_WARM_UP=0)"
        )
    PRELOAD.extend(new)


# Set when warm_up starts the forkserver: its background thread may not have started the process
# yet (so _forkserver_running() still says no), but the preload list it starts with is fixed.
_warm_up_started = False


def _forkserver_running() -> bool:
    import multiprocessing.forkserver as forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None) is not None


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def warm_up(background: bool = True) -> None:
    """Start the forkserver (torch preloaded) now, so the first `labkit.run` does not wait for it.

    `import labkit` calls this in a Jupyter kernel: by the time a learner's first launch comes,
    the seconds of importing torch in the forkserver have passed. Scripts and torchrun don't."""
    import multiprocessing.forkserver as forkserver

    global _warm_up_started
    _context()
    _warm_up_started = True
    if not background:
        forkserver.ensure_running()
        return
    import threading

    threading.Thread(target=forkserver.ensure_running, name="labkit-warm-up", daemon=True).start()


def _in_a_jupyter_kernel() -> bool:
    """A running IPython kernel, not just ipykernel imported: nbval's pytest plugin imports it
    into pytest, which is no kernel (there, warming up at `import labkit` started the forkserver
    before the test suite's preload("pytest"), and every rank imported pytest itself)."""
    app = sys.modules.get("ipykernel.kernelapp")
    return app is not None and app.IPKernelApp.initialized()


def _warm_up_in_a_kernel():
    if (
        _in_a_jupyter_kernel()
        and os.environ.get("LABKIT_WORKER") != "1"
        and not _in_torchrun()
        and os.environ.get("LABKIT_WARM_UP", "1") != "0"
    ):
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
    return (
        all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        and os.environ.get("LABKIT_WORKER") != "1"
    )


def run(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str = "auto",
    timeout: float = 60.0,
    nodes: Optional[int] = None,
    inter_node: Any = None,
    **kwargs: Any,
) -> RunResult:
    """Run fn(*args, **kwargs) on every rank of a fresh process group; return a RunResult
    (a list of the ranks' return values, indexed by rank). nodes=: group consecutive ranks into
    that many simulated nodes, whose hand-written collectives pay inter_node= (a
    labkit.launch.topology.NodeLink; default about 10x slower than loopback) across nodes."""
    __tracebackhide__ = True  # IPython and pytest: show the learner's cell, not labkit's frames
    world_size, timeout = _check_args(fn, world_size, backend, timeout)
    _check_keyword_clash(fn, args, kwargs)
    from . import topology

    nodes, inter_node = topology.resolve(world_size, nodes, inter_node)
    if os.environ.get("LABKIT_WORKER") == "1":
        raise RuntimeError("labkit.run cannot be called from inside a rank")
    if _in_torchrun():
        from ._torchrun import run_under_torchrun

        return run_under_torchrun(fn, args, kwargs, world_size, backend)
    backend = _resolve_backend(backend, world_size)
    cores = _usable_cores()
    _note_oversubscription(backend, world_size, cores)
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"labkit.run: cannot send fn and its arguments to the ranks: {exc}") from None
    locations = _report.code_locations(fn, list(args), list(kwargs.values()))
    try:
        return _launch(
            payload, world_size, backend, timeout, max(1, cores // world_size), locations, (nodes, inter_node)
        )
    except RankError as error:
        # Raised from a frame of its own, so the notebook's traceback is the learner's cell and
        # this one line, not labkit's internals (IPython always shows the innermost frame).
        exec(_RAISE, {"error": error})
        raise  # not reached: _RAISE raises


RUN_KEYWORDS = ("world_size", "backend", "timeout", "nodes", "inter_node")


def _check_keyword_clash(fn, args, kwargs):
    """A rank function with a parameter named like one of labkit.run's own keywords (timeout=,
    world_size=, ...): labkit.run takes that keyword, so fn would miss its argument. Refused
    here, naming the clash, instead of a bare "missing argument" on every rank."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError:
        return  # fn's own argument errors are reported by the ranks, as before
    for name in RUN_KEYWORDS:
        param = sig.parameters.get(name)
        if (
            param is not None
            and name not in bound.arguments
            and param.default is inspect.Parameter.empty
            and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
        ):
            raise TypeError(
                f"labkit.run: {getattr(fn, '__name__', fn)} has a parameter named {name!r}, "
                f"which is labkit.run's own keyword ({', '.join(RUN_KEYWORDS)}): a {name}= "
                f"given to labkit.run goes to the launcher, not to the ranks. Rename the "
                f"parameter, or pass its value positionally"
            )


def _topology_env(rank, world_size, nodes):
    from .topology import rank_env

    return rank_env(rank, world_size, *nodes)


def _note_oversubscription(backend, world_size, cores):
    # Once per kernel, on stdout: a note, not an error (nbgrader zeroes a graded cell that
    # writes to stderr, and a red box on every launch teaches learners to ignore red boxes).
    global _noted_oversubscription
    if backend == "gloo" and world_size > cores and not _noted_oversubscription:
        _noted_oversubscription = True
        print(
            f"labkit.run: note: {world_size} ranks on {cores} CPU cores (oversubscribed gloo: "
            f"correct, but slower and noisier timings). Shown once per kernel."
        )


_RAISE_SOURCE = "raise error.with_traceback(None) from None  # what the ranks did: see below\n"
_RAISE = compile(_RAISE_SOURCE, "<labkit.run>", "exec")
linecache.cache["<labkit.run>"] = (len(_RAISE_SOURCE), None, [_RAISE_SOURCE], "<labkit.run>")


def _launch(payload, world_size, backend, timeout, threads, locations=(), nodes=(1, None)):
    __tracebackhide__ = True
    start = time.perf_counter()
    ctx = _context()
    procs, conns, pump, tmp = [], [], None, None
    with _Interrupts() as interrupts:
        try:
            tmp = _rundir.create()
            logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
            stacks = [os.path.join(tmp, f"rank{r}.stack") for r in range(world_size)]
            live = (_output_mode or _report.default_output_mode()) == "live"
            pump = _report.OutputPump(logs, live=live)
            from . import _worker

            run_id = uuid.uuid4().hex
            for r in range(world_size):
                recv, send = ctx.Pipe(duplex=False)
                conns.append(recv)
                spec = dict(
                    rank=r,
                    world_size=world_size,
                    backend=backend,
                    store_path=os.path.join(tmp, "rendezvous"),
                    run_id=run_id,
                    payload=payload,
                    log_path=logs[r],
                    stack_path=stacks[r],
                    run_dir=tmp,
                    kernel_pid=os.getpid(),
                    pg_timeout=timeout + 30,
                    threads=threads,
                    env=_topology_env(r, world_size, nodes),
                )
                # Not daemonic: a daemonic process may not have children, and a rank's
                # DataLoader workers are children. The finally below reaps every rank.
                p = ctx.Process(target=_worker.main, args=(spec, send), daemon=False, name=f"labkit-rank{r}")
                procs.append(p)
                with _no_main_reimport():
                    p.start()
                send.close()
            interrupts.deliver()
            values, extras, errors = _collect(procs, conns, pump, stacks, timeout, backend, locations)
        finally:
            # Whatever happened (success, failure, hang, KeyboardInterrupt): no rank, and
            # nothing a rank started, outlives the call.
            for p in procs:
                _kill(p)
            for p in procs:
                if p.pid is not None:
                    p.join(timeout=5)
            for c in conns:
                c.close()
            if pump is not None:
                pump.finish()
            if tmp is not None:
                _rundir.remove(tmp)
    if errors:
        raise _report.failure_report(errors, world_size, backend, locations)
    return RunResult.build(
        values, extras, backend, [pump.text(r) for r in range(world_size)], time.perf_counter() - start
    )
