"""A two-level network on one machine: ranks grouped into nodes, a slower link between nodes.

    labkit.run(fn, world_size=4, nodes=2)                       # ranks 0,1 = node 0; 2,3 = node 1
    labkit.run(fn, world_size=4, nodes=2, inter_node=NodeLink(bandwidth_Bps=50e6, latency_s=1e-3))
    inside fn:  t = labkit.topology()   # Topology(nodes=2, ranks_per_node=2, node=1, local_rank=0, ...)

Nodes are consecutive ranks (torchrun's numbering: rank = node * ranks_per_node + local_rank).
Inside `labkit.run` the hand-written collectives (labkit.comm) pay `inter_node` for every message
between ranks of different nodes: the sending thread sleeps latency + bytes / bandwidth before the
message leaves (labkit.comm._link), so a cross-node byte costs measured time, and the tracer counts
the bytes each collective sent within and across nodes. Under torchrun the topology is torchrun's
own (LOCAL_WORLD_SIZE, GROUP_RANK) and nothing is throttled: the network is real there.

What it leaves out: torch.distributed's own collectives (dist.all_reduce, torch's FSDP) are not
throttled (gloo's C++ sends them); one NIC per rank, no contention between a node's ranks on the
inter-node link, no switch; latency is paid per message (a ring's pieces each pay it).
"""

import contextlib
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

# The default inter-node link: 1 Gb/s Ethernet-like. This host's loopback gloo moves about
# 1.4 GB/s at 16 MiB on 2 ranks (labkit.costmodel.links.GLOO_ALL_REDUCE_BUSBW_2RANKS), so the
# default is about 10x slower, the ratio of NVLink to a node's network share on a cluster.
DEFAULT_BANDWIDTH_BPS = 125e6
DEFAULT_LATENCY_S = 200e-6


@dataclass(frozen=True)
class NodeLink:
    """The link between two nodes: bandwidth in bytes per second, latency per message in seconds."""

    bandwidth_Bps: float = DEFAULT_BANDWIDTH_BPS
    latency_s: float = DEFAULT_LATENCY_S

    def __post_init__(self):
        for name in ("bandwidth_Bps", "latency_s"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, numbers.Real)
                or not math.isfinite(v)
                or v < 0
                or (name == "bandwidth_Bps" and v == 0)
            ):
                raise ValueError(
                    f"NodeLink: {name} must be a finite number > 0 (latency_s may be 0), got {v!r}"
                )

    def seconds(self, nbytes: float) -> float:
        """What one message of nbytes costs on this link."""
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class Topology:
    nodes: int
    ranks_per_node: int
    node: int  # this rank's node (torchrun's GROUP_RANK)
    local_rank: int  # this rank's place in its node
    inter_node: Optional[NodeLink] = None  # NodeLink throttling cross-node traffic, None: not throttled

    def node_of(self, rank: int) -> int:
        """The node of a global rank (nodes are consecutive ranks)."""
        return rank // self.ranks_per_node


def resolve(world_size: int, nodes: Optional[int], inter_node: Any) -> tuple[int, Optional[NodeLink]]:
    """labkit.run's check of nodes= / inter_node=: (nodes, NodeLink or None). Raises on bad input."""
    if nodes is None:
        if inter_node is not None:
            raise ValueError("labkit.run: inter_node= needs nodes= (how many nodes the ranks form)")
        return 1, None
    if isinstance(nodes, bool) or not isinstance(nodes, numbers.Integral) or nodes < 1:
        raise ValueError(f"labkit.run: nodes must be an int ≥ 1, got {nodes!r}")
    if world_size % nodes:
        raise ValueError(
            f"labkit.run: world_size={world_size} ranks do not split into nodes={nodes} equal nodes"
        )
    if inter_node is None:
        inter_node = NodeLink()
    elif isinstance(inter_node, tuple) and len(inter_node) == 2:
        inter_node = NodeLink(*inter_node)
    elif not isinstance(inter_node, NodeLink):
        # labkit.costmodel.links.Link has the same two numbers under its own names.
        if hasattr(inter_node, "busbw_Bps") and hasattr(inter_node, "alpha_s"):
            inter_node = NodeLink(inter_node.busbw_Bps, inter_node.alpha_s)
        else:
            raise TypeError(
                f"labkit.run: inter_node must be a NodeLink, a (bandwidth_Bps, "
                f"latency_s) pair or a labkit.costmodel.links.Link, got "
                f"{type(inter_node).__name__}"
            )
    return int(nodes), inter_node


def rank_env(rank: int, world_size: int, nodes: int, inter_node: Optional[NodeLink]) -> dict[str, str]:
    """The environment labkit.run gives rank `rank` (torchrun's names, plus the link)."""
    per = world_size // nodes
    env = {
        "LOCAL_RANK": str(rank % per),
        "LOCAL_WORLD_SIZE": str(per),
        "GROUP_RANK": str(rank // per),
        "LABKIT_NODES": str(nodes),
    }
    if nodes > 1 and inter_node is not None:
        env["LABKIT_INTER_NODE"] = f"{inter_node.bandwidth_Bps!r},{inter_node.latency_s!r}"
    return env


_cached = None


def current() -> Topology:
    """This rank's Topology (one node of one rank outside any run). Read once per process."""
    global _cached
    key = tuple(
        os.environ.get(k)
        for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK", "LABKIT_INTER_NODE")
    )
    if _cached is not None and _cached[0] == key:
        return _cached[1]
    world, per_text, node, local, link = key
    if world is None:
        topo = Topology(1, 1, 0, 0)
    else:
        per = int(per_text or world)
        topo = Topology(
            nodes=max(1, int(world) // per),
            ranks_per_node=per,
            node=int(node or 0),
            local_rank=int(local or 0),
            inter_node=NodeLink(*map(float, link.split(","))) if link else None,
        )
    _cached = (key, topo)
    return topo


@contextlib.contextmanager
def inter_node(link: Any) -> Iterator[NodeLink]:
    """Inside a rank of labkit.run(nodes=k): the hand-written collectives pay `link` (a NodeLink)
    across nodes for the block, e.g. a free link to measure the same code without the network.
    Every rank must enter it at the same point (the ranks' sends wait for each other)."""
    if current().nodes == 1 or os.environ.get("LABKIT_INTER_NODE") is None:
        raise RuntimeError("topology.inter_node: only inside labkit.run(..., nodes=k), k > 1")
    link = resolve(2, 2, link)[1]
    before = os.environ["LABKIT_INTER_NODE"]
    os.environ["LABKIT_INTER_NODE"] = f"{link.bandwidth_Bps!r},{link.latency_s!r}"
    try:
        yield link
    finally:
        os.environ["LABKIT_INTER_NODE"] = before
