"""Placeholder while the per-parameter FSDP (FSDP2's model) is written: the flat one's names."""
from labkit.strategies.fsdp_flat import (FSDPModel, FSDPUnit, collective_counts,  # noqa: F401
                                         fully_shard_by_hand, plan_units)

FSDP = FSDPModel
