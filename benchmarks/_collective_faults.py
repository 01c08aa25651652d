"""Fault cases for `benchmarks/faults.py`: ranks that call different hand-written collectives.

    mismatch_trial(case) -> (held, seconds, detail)

held: labkit.run raised a RankError naming both ranks' calls ("collective mismatch: rank 0
called ...; rank 1 called ..."), within 2 s of the launch, not a timeout and not a wrong answer.
"""

import sys
import time

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MISMATCH_CASES = (
    "sum-vs-avg",
    "all_reduce-vs-reduce_scatter",
    "all_reduce-vs-all_gather",
    "fp32-vs-fp64",
    "8-vs-10-elements",
    "direct-vs-ring",
)
# direct-vs-ring: rank 1's tensor (300000 float32, 1.2 MB) is past DIRECT_MAX_BYTES, so rank 0's
# call takes the direct exchange (header and data in one message) and rank 1's the ring.


def _mismatch(case):
    import torch
    import torch.distributed as dist
    from labkit.comm import collectives as C

    one = dist.get_rank() == 1
    numel = {"8-vs-10-elements": 10, "direct-vs-ring": 300_000}.get(case, 8) if one else 8
    x = torch.ones(numel, dtype=torch.float64 if (one and case == "fp32-vs-fp64") else torch.float32)
    if one and case == "sum-vs-avg":
        C.ring_all_reduce(x, "avg")
    elif one and case == "all_reduce-vs-reduce_scatter":
        C.ring_reduce_scatter(torch.empty(4), x)
    elif one and case == "all_reduce-vs-all_gather":
        C.ring_all_gather(torch.empty(16), x)
    else:
        C.ring_all_reduce(x)
    return x.tolist()


def mismatch_trial(case, timeout=20):
    import labkit

    t0 = time.perf_counter()
    try:
        out = labkit.run(_mismatch, case, world_size=2, timeout=timeout)
        return False, time.perf_counter() - t0, f"no error: returned {out[0][:4]}..."
    except labkit.RankError as exc:
        dt = time.perf_counter() - t0
        msg = str(exc)
        ok = (
            "collective mismatch" in msg
            and "rank 0 called" in msg
            and "rank 1 called" in msg
            and not isinstance(exc, labkit.RankTimeout)
        )
        return ok and dt <= 2.0, dt, f"{dt:.2f} s: {msg.splitlines()[0][:160]}"
