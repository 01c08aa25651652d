"""HSDP by hand: shard within a node, replicate across nodes (FSDP2's fully_shard with a 2-D
mesh, FSDP1's HYBRID_SHARD, DeepSpeed's hpZ for the parameters).

    mesh = init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard_by_hand(block, mesh=mesh)
    fully_shard_by_hand(model, mesh=mesh)

What changes from FSDP (fully_shard.py, which does the work; this module reads the mesh):
every parameter is sharded on dim 0 over the mesh's "shard" dimension only (the ranks of one node),
so the all-gathers and the reduce-scatters stay inside the node; after a unit's reduce-scatter its
gradient shard is all-reduced over the "replicate" dimension (the same shard on every node), the
only traffic that crosses nodes. A rank holds 1/ranks_per_node of the model state (16P/per with
AdamW in fp32, against FSDP's 16P/N): the memory it gives up buys step time on a slow network.
Reduction: reduce_op "sum" sums at both levels; "avg" averages at both (the average over all N).

The meshes come from torch (init_device_mesh; labkit.comm.hierarchical.node_mesh() builds the
topology's): only the collectives and the sharding are hand-written. Strategies "hsdp" (this) and
"torch-hsdp" (torch's fully_shard on the same 2-D mesh, the oracle) train through loop.train.
What it leaves out: the replicate all-reduce overlapping the next unit's reduce-scatter on a
second stream (here both queue on labkit's one comm thread, in order), 3-D meshes (HSDP + TP),
checkpoints of an HSDP model (labkit.strategies.checkpoint assumes one shard group).
"""

from typing import Any

import torch

from labkit.strategies.comm_choice import choose
from labkit.strategies.fsdp.fully_shard import FSDP, _check_prefetch
from labkit.strategies.fsdp.mesh import mesh_groups  # noqa: F401  (fully_shard_by_hand's reading)
from labkit.strategies.fsdp.torch_ref import TorchFSDP
from labkit.strategies.precision import check_policy

__all__ = ["HSDP", "TorchHSDP", "mesh_groups", "default_mesh"]


def default_mesh(model: torch.nn.Module) -> Any:
    """The topology's (nodes, ranks_per_node) mesh on the model's device type."""
    from labkit.comm.hierarchical import node_mesh

    device = next(model.parameters()).device
    return node_mesh(device.type)


def _check_2d(mesh, name):
    if getattr(mesh, "ndim", None) != 2:
        raise ValueError(f"{name}: mesh must be a 2-D DeviceMesh (replicate, shard), got {mesh!r}")


class HSDP(FSDP):
    """The loop strategy "hsdp": FSDP's units and options on a 2-D mesh (default: the topology's,
    labkit.topology(): labkit.run's nodes= or torchrun's nodes)."""

    def __init__(self, model, cfg, mesh=None, **options):
        if "group" in options:
            raise TypeError("hsdp: takes mesh=, not group= (the groups come from the mesh)")
        choose(options.get("comm", "ring"), type(self).__name__)  # a bad comm= raises before the mesh
        check_policy(options.get("mp_policy"), type(self).__name__)  # and the other argument checks
        _check_prefetch(options.get("prefetch", 1), type(self).__name__)
        mesh = default_mesh(model) if mesh is None else mesh
        _check_2d(mesh, "hsdp")
        self.mesh = mesh
        super().__init__(model, cfg, mesh=mesh, **options)


class TorchHSDP(TorchFSDP):
    """The loop strategy "torch-hsdp": torch's fully_shard on the same units and 2-D mesh."""

    def __init__(self, model, cfg, mesh=None, **options):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not isinstance(options.get("mp_policy"), MixedPrecisionPolicy):  # checked before the mesh
            check_policy(options.get("mp_policy"), type(self).__name__)
        mesh = default_mesh(model) if mesh is None else mesh
        _check_2d(mesh, "torch-hsdp")
        self.mesh = mesh
        super().__init__(model, cfg, mesh=mesh, **options)
