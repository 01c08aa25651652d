"""Context parallelism by hand: every rank holds a piece of each sequence, attention's K/V go round
a ring (ring attention), the rest of the model runs on the piece alone.

- layout.py: which positions each rank holds, "contiguous" or "zigzag" (chunk_ids, positions,
  shard, unshard);
- ring.py: ring_attention(q, k, v, *, causal, group=None, layout) on labkit.comm.p2p, its exact
  online-softmax merge (merge_partials), hand-written backward, and its steps (ring_schedule:
  which K/V piece each rank holds at each step and the blocks it computes, for a figure);
- work.py: attention FLOPs per rank, the formula (attention_flops, imbalance) and the count of what
  ring_attention computed (count_attention_flops);
- gpt.py: TinyGPT on this rank's piece (its attention through ring_attention);
- strategy.py: the loop strategy "cp" (cp ranks of one replica; loss and gradients summed over them).

What it leaves out: torch's context_parallel as an oracle (it does not run on CPU: its flash
attention has no sharding strategy there; the oracle is one process's attention), GQA, dropout,
overlap in ring attention's backward, CP combined with TP.
"""

from labkit.strategies.cp.gpt import cp_forward, parallelize_cp
from labkit.strategies.cp.layout import LAYOUTS, chunk_ids, n_chunks, positions, shard, unshard
from labkit.strategies.cp.ring import merge_partials, ring_attention, ring_schedule
from labkit.strategies.cp.strategy import CP
from labkit.strategies.cp.work import attention_flops, block_flops, count_attention_flops, imbalance

__all__ = [
    "CP",
    "LAYOUTS",
    "attention_flops",
    "block_flops",
    "chunk_ids",
    "count_attention_flops",
    "cp_forward",
    "imbalance",
    "merge_partials",
    "n_chunks",
    "parallelize_cp",
    "positions",
    "ring_attention",
    "ring_schedule",
    "shard",
    "unshard",
]
