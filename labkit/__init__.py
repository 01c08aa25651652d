"""labkit: the helper package of the distributed-training course.

    results = labkit.run(fn, *args, world_size=2, backend="auto", timeout=60.0, **kwargs)
"""
from .launch import RankError, RankTimeout, RunResult, device, run, set_output

__all__ = ["run", "device", "set_output", "RunResult", "RankError", "RankTimeout"]
