"""What a hand-written collective's message costs on the simulated two-level network.

Every point-to-point send labkit.comm makes (ring steps, direct-exchange messages, the cross-rank
check's headers) goes through `sending`: it counts the bytes for the tracer, split into within a
node and across nodes (labkit.launch.topology: nodes are consecutive ranks), and, inside a
`labkit.run(..., nodes=k)` with an inter-node link, sleeps latency + bytes / bandwidth for the
cross-node ones before they leave, on the sending thread (the GIL released: compute goes on).
Under torchrun or with one node nothing sleeps. `held_s()` is how long this process has slept on
the link so far (perf_counter around each sleep, every thread): what the link cost it, measured,
which another process's load barely changes (a sleep is not CPU time).
"""

import threading
import time
from typing import Any, Sequence

import torch.distributed as dist

from labkit.launch import topology
from labkit.observe import tracing


_held = [0.0]  # seconds this process slept on the inter-node link, under _held_lock (comm threads)
_held_lock = threading.Lock()


def held_s() -> float:
    """Seconds this process has slept on the simulated inter-node link so far (every thread)."""
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
        start = time.perf_counter()
        time.sleep(link.seconds(inter))
        with _held_lock:
            _held[0] += time.perf_counter() - start
