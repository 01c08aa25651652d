"""What a hand-written collective's message costs on the simulated two-level network.

Every point-to-point send labkit.comm makes (ring steps, direct-exchange messages, the cross-rank
check's headers) goes through `sending`: it counts the bytes for the tracer, split into within a
node and across nodes (labkit.launch.topology: nodes are consecutive ranks), and, inside a
`labkit.run(..., nodes=k)` with an inter-node link, sleeps latency + bytes / bandwidth for the
cross-node ones before they leave, on the sending thread (the GIL released: compute goes on).
Under torchrun or with one node nothing sleeps.
"""

import time
from typing import Any, Sequence

import torch.distributed as dist

from labkit.launch import topology
from labkit.observe import tracing


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
        time.sleep(link.seconds(inter))
