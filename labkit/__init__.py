"""labkit: the helper package of the distributed-training course.

    results = labkit.run(fn, *args, world_size=2, backend="auto", timeout=60.0, **kwargs)

The public API is `__all__` below: the launcher's names, and the subpackages a notebook imports
from (each name has one path: e.g. `from labkit.observe.timeline import plot_timeline`).

    launch/      labkit.run, device(), RunResult, RankError: start ranks, report their failures
    comm/        hand-written ring and naive collectives, the comm thread
    observe/     tracing (collectives + spans), timeline, memory tracker and plots, style
    strategies/  the hand-written DDP / ZeRO / FSDP (the labs' solutions) behind one interface
    labs/        per-lab drivers, checks with hints, widgets, formulas
    drills       the labs' debug drills (mistakes as subclasses), kept out of labs/
    loop         presets, the single-process reference, the one training loop
    costmodel/   alpha-beta + compute model for large scale, and its plots
    data, models, checks, exercise, units   corpus, TinyGPT + toy models, comparisons,
                 exercise check/pick, the byte formatter

Submodules are imported on first use (`labkit.costmodel`, `labkit.exercise`, ...), so
`import labkit` stays cheap: it loads only the launcher (no torch).
"""

import importlib
import os

from .launch import _kernel_exit, _rundir
from .launch._report import RankError, RankTimeout, RunResult
from .launch.run import _warm_up_in_a_kernel, device, run, set_output, warm_up
from .launch.topology import current as topology

if os.environ.get("LABKIT_WORKER") != "1":
    _rundir.sweep()  # run folders left by kernels that died mid-call
_warm_up_in_a_kernel()
_kernel_exit.install()  # a kernel's shutdown stops the forkserver first: no 2.5 s kill

_SUBMODULES = (
    "launch",
    "comm",
    "observe",
    "strategies",
    "labs",
    "loop",
    "costmodel",
    "data",
    "models",
    "checks",
    "exercise",
    "units",
)

__all__ = [
    "run",
    "device",
    "topology",
    "set_output",
    "warm_up",
    "RunResult",
    "RankError",
    "RankTimeout",
    *_SUBMODULES,
]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__():
    return __all__
