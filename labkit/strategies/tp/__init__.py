"""Tensor parallelism by hand (Megatron-LM's, as torch.distributed.tensor.parallel names it):
one Linear's weight split across the ranks of a 1-D "tp" mesh, every rank seeing the same batch.

- conjugate.py: the two conjugate operations written on labkit's hand-written collectives,
  copy_to_tp (Megatron's f: identity forward, all-reduce of the gradient in backward) and
  reduce_from_tp (g: all-reduce forward, identity backward), and gather_from_tp (an all-gather
  of a column-parallel output along its last dim, the gradient's slice back in backward);
- parallelize.py: parallelize_by_hand(module, mesh, plan), a plan of "colwise" / "rowwise" with
  the semantics of torch's ColwiseParallel() / RowwiseParallel() defaults.

What this stage leaves out: the strategy classes ("tp", "fsdp-tp") and loop.train, attention
heads and embeddings (only nn.Linear is parallelized), sequence parallelism, non-default input /
output layouts, and the composition with fully_shard_by_hand (what blocks it: parallelize.py).
"""

from labkit.strategies.tp.conjugate import copy_to_tp, gather_from_tp, reduce_from_tp
from labkit.strategies.tp.parallelize import STYLES, parallelize_by_hand, tp_group

__all__ = ["STYLES", "copy_to_tp", "gather_from_tp", "parallelize_by_hand", "reduce_from_tp", "tp_group"]
