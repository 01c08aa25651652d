"""Fully sharded data parallelism (ZeRO-3), the family's face: every rank holds 1/N of every unit's
parameters, gradients and optimizer state, and a unit is whole only while it computes.

- fully_shard.py: FSDP2's way by hand (the course's main FSDP, strategy "fsdp"): fully_shard_by_hand
  shards every parameter along dim 0 in place; FSDPModule is what a sharded module becomes; FSDP is
  the strategy. Its parts: param.py (one parameter's shard and unsharded copy), group.py (one unit:
  the batched all-gather, the reshard, the batched reduce-scatter), plan.py (which modules become
  units, shared by every FSDP here), reshard_to.py (reshard_after_forward=<int>), mesh.py (mesh=);
- flat.py + flat_unit.py: FSDP1's way (strategy "fsdp-flat"): one flat, padded buffer per unit,
  kept beside FSDP2's for the comparison the lab makes;
- hsdp.py: hybrid sharding on a 2-D mesh, shard within a node and replicate across (strategy "hsdp"),
  and TorchHSDP, torch's fully_shard on the same mesh ("torch-hsdp");
- torch_ref.py: TorchFSDP, torch's fully_shard on the same units, the oracle ("torch-fsdp").

- offload.py: CPU offload (CPUOffloadPolicy: shards, gradients and optimizer state on the host,
  the traced "h2d" / "d2h" moves), an option of fully_shard_by_hand and of FSDP (offload_policy=).

What it leaves out: see each module (meta-device init, size-based wrap policies).
Checkpoints of these models are labkit.strategies.checkpoint.
"""

from labkit.strategies.fsdp.flat import FSDPModel, wrap_flat_by_hand
from labkit.strategies.fsdp.fully_shard import (
    FSDP,
    CPUOffloadPolicy,
    FSDPModule,
    allow_orphaned_parameters,
    collective_counts,
    full_grad_dict,
    full_state_dict,
    fully_shard_by_hand,
)
from labkit.strategies.fsdp.hsdp import HSDP, TorchHSDP
from labkit.strategies.fsdp.plan import plan_units
from labkit.strategies.fsdp.torch_ref import TorchFSDP

__all__ = [
    "fully_shard_by_hand",
    "CPUOffloadPolicy",
    "FSDPModule",
    "FSDP",
    "allow_orphaned_parameters",
    "collective_counts",
    "full_state_dict",
    "full_grad_dict",
    "plan_units",
    "wrap_flat_by_hand",
    "FSDPModel",
    "HSDP",
    "TorchHSDP",
    "TorchFSDP",
]
