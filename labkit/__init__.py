"""labkit: the helper package of the distributed-training course.

    results = labkit.run(fn, *args, world_size=2, backend="auto", timeout=60.0, **kwargs)

Architecture, one module per concern:
    launch / _worker / _report / _torchrun   start ranks, show their output, explain failures
    collectives                              hand-written ring and naive collectives
    tracing / timeline                       collective + compute recorder, Gantt chart
    memory / memory_plot                     per-rank memory by category, memory timeline
    data / models / checks / exercise        corpus, TinyGPT + toy models, comparisons, exercises
    strategies.ddp / .zero / .fsdp           the hand-written strategies (the labs' solutions)
    loop                                     presets, the single-process reference, the one loop
    costmodel / costmodel_plot               alpha-beta + compute model for large scale

Submodules and the names below are imported on first use, so `import labkit` stays cheap.
"""
import importlib
import os

from .launch import _rundir
from .launch.run import RankError, RankTimeout, RunResult, device, run, set_output, warm_up
from .launch.run import _warm_up_in_a_kernel

if os.environ.get("LABKIT_WORKER") != "1":
    _rundir.sweep()          # run folders left by kernels that died mid-call
_warm_up_in_a_kernel()

_LAZY = {
    # name: module that defines it
    "ring_all_reduce": "collectives", "ring_reduce_scatter": "collectives",
    "ring_all_gather": "collectives", "naive_all_reduce": "collectives",
    "reduce_scatter_padded": "collectives", "all_gather_padded": "collectives",
    "shard_range": "collectives",
    "span": "tracing", "plot_timeline": "timeline",
    "MemoryTracker": "memory", "plot_memory_timeline": "memory_plot",
    "plot_memory_bars": "memory_plot",
    "Tokenizer": "data", "load_corpus": "data", "get_batch": "data", "shard_batch": "data",
    "rank_slice": "data", "micro_batches": "data",
    "GPTConfig": "models", "TinyGPT": "models", "ToyModel": "models", "toy_batch": "models",
    "toy_loss": "models", "num_params": "models", "make_optimizer": "models",
    "train_single_process": "models",
    "compare": "checks", "check_close": "checks", "expect_match": "checks",
    "assert_match": "checks", "fmt_bytes": "checks",
    "widgets_enabled": "exercise",
}
_SUBMODULES = {"collectives", "tracing", "timeline", "memory", "memory_plot", "data", "models",
               "checks", "exercise", "strategies", "costmodel", "costmodel_plot", "style", "loop"}

__all__ = ["run", "device", "set_output", "warm_up", "RunResult", "RankError", "RankTimeout",
           *sorted(_LAZY), *sorted(_SUBMODULES)]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__():
    return __all__
