"""Ulysses sequence parallelism by hand (DeepSpeed-Ulysses): every rank holds a contiguous piece of
each sequence; around attention two all-to-alls trade it for whole sequences of a share of the
heads, so attention itself is one process's, head by head.

- attention.py: seq_to_heads / heads_to_seq (the all-to-all pair, on labkit.comm.all_to_all,
  differentiable), ulysses_attention (both around causal attention), layer_bytes (what one layer
  sends per rank, the formula the tests and benchmarks/seq.py check the trace against);
- gpt.py: TinyGPT on this rank's piece (its attention through ulysses_attention);
- strategy.py: the loop strategy "ulysses" (ulysses ranks of one replica; loss and gradients
  summed over them, as cp's).

What it leaves out: GQA / MQA (TinyGPT has none), a degree that does not divide the heads or the
sequence (refused), overlapping the all-to-alls with compute, Ulysses combined with TP or with
ring attention (USP), DeepSpeed's ZeRO underneath, CUDA tensors (labkit's all-to-all moves CPU
memory, as for ep: on a GPU it raises saying so).
"""

from labkit.strategies.ulysses.attention import heads_to_seq, layer_bytes, seq_to_heads, ulysses_attention
from labkit.strategies.ulysses.gpt import UlyssesCausalSelfAttention, UlyssesTinyGPT, parallelize_ulysses
from labkit.strategies.ulysses.strategy import Ulysses

__all__ = [
    "Ulysses",
    "UlyssesCausalSelfAttention",
    "UlyssesTinyGPT",
    "heads_to_seq",
    "layer_bytes",
    "parallelize_ulysses",
    "seq_to_heads",
    "ulysses_attention",
]
