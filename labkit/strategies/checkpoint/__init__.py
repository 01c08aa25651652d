"""Checkpoints of the hand-written FSDPs, the family's face: nothing lost (weights, AdamW state,
step, data position, RNG, fp16's loss scale), nothing ever loaded wrong.

- save_load.py: save_sharded (every rank its shards), save_full (rank 0, whole tensors), load (any
  world size: shards re-cut), dcp_round_trip (torch.distributed.checkpoint, the oracle), and the
  one fault-injection point a fault campaign uses (set_fault_hook, KILL_POINTS, AbandonSave);
- files.py: the disk: durable writes, the COMPLETE manifest, the atomic commit, one writer per
  root, and what a load checks before it trusts a byte (verify, is_complete, latest_complete,
  resolve, read_full; CheckpointError says what is wrong);
- shards.py: what a checkpoint holds, independent of files: the sharded tensors, how a world size
  cuts them and how they join back, the structure a load must match.

What it leaves out: see save_load.py (async saves, several hosts' disks, HSDP models).
"""

from labkit.strategies.checkpoint.files import (
    MARKER,
    CheckpointError,
    is_complete,
    latest_complete,
    read_full,
    resolve,
    verify,
)
from labkit.strategies.checkpoint.save_load import (
    KILL_POINTS,
    AbandonSave,
    dcp_round_trip,
    load,
    save_full,
    save_sharded,
    set_fault_hook,
)

__all__ = [
    "save_sharded",
    "save_full",
    "load",
    "dcp_round_trip",
    "set_fault_hook",
    "KILL_POINTS",
    "AbandonSave",
    "CheckpointError",
    "MARKER",
    "is_complete",
    "latest_complete",
    "resolve",
    "verify",
    "read_full",
]
