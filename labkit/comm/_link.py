"""What a hand-written collective's message costs on the simulated two-level network.

Every point-to-point send labkit.comm makes (ring steps, direct-exchange messages, the cross-rank
check's headers) goes through `sending`: it counts the bytes for the tracer, split into within a
node and across nodes (labkit.launch.topology: nodes are consecutive ranks), and, inside a
`labkit.run(..., nodes=k)` with an inter-node link, sleeps latency + bytes / bandwidth for the
cross-node ones before they leave, on the sending thread (the GIL released: compute goes on).
Under torchrun or with one node nothing sleeps. `held_s()` is how long the link has held this
process so far (every thread): the sum of its sleeps' lengths, each checked to have lasted at
least that long. Not the wall time around them: on a busy machine a thread wakes late, waiting for
a core, and that wait is the machine's load, not the link's (measured: beside four CPU hogs, the
wall time around the sleeps of an FSDP step was 20% over their lengths); so `held_s()` is the same
in every run, as CPU time is.
"""

import threading
import time
from typing import Any, Sequence

import torch.distributed as dist

from labkit.launch import topology
from labkit.observe import tracing


_held = [0.0]  # seconds the inter-node link held this process, under _held_lock (comm threads)
_held_lock = threading.Lock()


def held_s() -> float:
    """Seconds the simulated inter-node link has held this process so far (every thread): the
    lengths of its sleeps, without the wait for a core after each."""
    return _held[0]


def global_rank(group: Any, rank: int) -> int:
    """The global rank of `rank` in `group` (None or WORLD: itself)."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def sending(dsts: Sequence[int], nbytes: int) -> None:
    """About to send nbytes to each global rank in dsts (one message each)."""
    topo = topology.current()
    if topo.nodes == 1:
        tracing.count_wire(nbytes * len(dsts), 0)
        return
    me = topo.node
    crossing = sum(1 for d in dsts if topo.node_of(d) != me)
    inter = nbytes * crossing
    tracing.count_wire(nbytes * len(dsts) - inter, inter, crossing)
    link = topo.inter_node
    if inter and link is not None:
        seconds = link.seconds(inter)
        start = time.perf_counter()
        time.sleep(seconds)
        slept = time.perf_counter() - start
        if slept < seconds * (1 - 1e-6):  # a sleep never ends early: then the clock is broken
            raise RuntimeError(f"labkit: a {seconds:.6f} s sleep on the link ended after {slept:.6f} s")
        with _held_lock:
            _held[0] += seconds
