"""`labkit.run` inside a process that torchrun started: join its process group, run fn here.

The same rank function runs unchanged on a laptop (labkit.run launches the ranks) and on a
cluster (torchrun launches them, one process per GPU, possibly on many nodes).
"""

import atexit
import os
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ._report import RunResult


def run_under_torchrun(
    fn: Callable[..., Any], args: tuple, kwargs: dict, world_size: int, backend: str
) -> "RunResult":
    from . import _worker
    from ._report import RunResult

    env_world = int(os.environ["WORLD_SIZE"])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if world_size != env_world and rank == 0:
        print(
            f"labkit.run: under torchrun the world size is torchrun's ({env_world}); "
            f"world_size={world_size} is ignored"
        )
    if backend == "auto":  # NCCL when every local rank has a GPU of its own (labkit.run's rule)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env_world))
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        _worker.set_current_device(torch.device("cuda", local_rank))
    else:
        _worker.set_current_device(torch.device("cpu"))
    if not dist.is_initialized():
        dist.init_process_group(backend, **_worker.process_group_options(backend, _worker.current_device()))
        # What labkit creates, labkit tears down -- at exit, not on return, since the caller may
        # still use dist after labkit.run. A gloo group left to the interpreter's finalisation
        # can abort the process ("terminate called without an active exception", SIGABRT) after
        # a correct run: its worker thread drops the last collective's work while Python exits.
        atexit.register(_destroy_at_exit)
    _worker.begin_hooks(rank, env_world)
    value = fn(*args, **kwargs)
    extras = _worker.end_hooks()
    gathered: list = [None] * env_world
    dist.all_gather_object(gathered, (value, extras))
    return RunResult.build([v for v, _ in gathered], [e for _, e in gathered], backend)


def _destroy_at_exit():
    if dist.is_initialized():
        dist.destroy_process_group()
