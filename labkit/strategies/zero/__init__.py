"""ZeRO by hand, in the order the lab builds it: FlatPartition -> ShardedOptimizer -> ZeRO1 -> ZeRO2.

Every rank keeps the whole model for forward and backward. What it stops keeping whole:
- ShardedOptimizer (optimizer.py): any torch optimizer's state (Adam's m, v,
  step; SGD's momentum) exists only for this rank's 1/N chunk of the flat parameters; a step runs
  the optimizer on that chunk and all-gathers the updated chunks (torch's ZeroRedundancyOptimizer's
  contract: the gradients it reads are already the same on every rank);
- ZeRO1 (the ZeRO paper's P_os, stages.py): ShardedOptimizer plus a reduce-
  scatter of the gradients instead of DDP's all-reduce: each rank reduces only the chunk it steps;
- ZeRO2 (P_os+g): the reduce-scatter runs in buckets while backward still runs, and each bucket's
  full gradient is freed as soon as it is sent: at the end of backward a rank holds its 1/N
  gradient shard plus at most two buckets, not the whole gradient.
Communication per step is a reduce-scatter plus an all-gather, which moves exactly what DDP's
all-reduce moves (a ring all-reduce IS a reduce-scatter followed by an all-gather).

Layout (layout.py): FlatPartition puts the trainable parameters end to end
in one flat buffer, padded to N * ceil(numel / N), every parameter a view of it, so the all-gather
writes straight into the model; FlatLayout lays several of them ("buckets") end to end.

This package's face: the names above, imported from the modules that define them; torch_ref.py holds
TorchZeRO1 ("torch-zero1": DDP + ZeroRedundancyOptimizer), the oracle.

Mixed precision (mp_policy=MixedPrecision) is in stages.py: ShardedOptimizer keeps the fp32
master shard, so with bf16 a rank holds the paper's 2 + 2 + 12/N bytes per parameter (ZeRO-1);
without a policy the parameters are their own master (this lab's fp32 4P + 4P + 8P/N).

What it leaves out: ZeRO-3 (parameters stay whole: see the FSDP lab); several
dtypes or devices in one flat buffer; data-dependent unused parameters (every rank must leave the
same parameters without a gradient - DDP's find_unused_parameters flag exchange is not repeated).
"""

from labkit.strategies.zero.layout import FlatLayout, FlatPartition, per_tensor_owners, per_tensor_partition
from labkit.strategies.zero.optimizer import ShardedOptimizer
from labkit.strategies.zero.stages import ZeRO1, ZeRO2, backward_grad_bytes
from labkit.strategies.zero.torch_ref import TorchZeRO1

__all__ = [
    "FlatPartition",
    "FlatLayout",
    "per_tensor_owners",
    "per_tensor_partition",
    "ShardedOptimizer",
    "ZeRO1",
    "ZeRO2",
    "backward_grad_bytes",
    "TorchZeRO1",
]
