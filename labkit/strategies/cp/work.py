"""Attention work per context-parallel rank, in FLOPs: the formula (attention_flops) and what
ring_attention actually computed (count_attention_flops), so a lab or a benchmark can check one
against the other.

What is counted: the two matmuls of every (query chunk, key chunk) block ring_attention computes in
its FORWARD, 2 c^2 D for q k^T and 2 c^2 D for p v per batch row and head (c: the chunk length,
D: head_dim), 4 B H c^2 D a block. Under a causal mask a block whose keys all lie after its
queries is skipped; a diagonal block (queries and keys the same chunk) is computed whole, its upper
triangle masked. So with chunks i (queries) and j (keys), causal: blocks j < i and j == i.
    contiguous (n chunks, rank r holds chunk r): rank r computes r + 1 blocks, the last rank n, the
                first 1: the slowest rank has 2n / (n + 1) times the mean's work;
    zigzag (2n chunks, rank r holds r and 2n-1-r): (r + 1) + (2n - r) = 2n + 1 blocks on every rank.
Not causal: every rank computes all of its blocks (n contiguous, 4n zigzag, of a quarter the size).
What it leaves out: the softmax's exp / sum / merge (O(c^2) and O(c D), not matmuls) and backward
(about 2.5x the forward's matmuls: recomputed scores, dV, dP, dQ, dK).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from labkit.strategies.cp.layout import chunk_ids, chunk_len, n_chunks

__all__ = ["attention_flops", "block_flops", "count_attention_flops", "imbalance"]

_counters: list[dict[str, int]] = []


def block_flops(batch: int, heads: int, chunk: int, head_dim: int) -> int:
    """The forward matmul FLOPs of one (query chunk, key chunk) block: 4 B H c^2 D."""
    return 4 * batch * heads * chunk * chunk * head_dim


def _blocks(layout: str, rank: int, world_size: int, causal: bool) -> int:
    mine = chunk_ids(layout, rank, world_size)
    every = range(n_chunks(layout, world_size))
    return sum(1 for i in mine for j in every if not causal or j <= i)


def attention_flops(
    seq_len: int,
    world_size: int,
    *,
    layout: str,
    causal: bool,
    batch: int = 1,
    heads: int = 1,
    head_dim: int = 1,
) -> list[int]:
    """The forward attention FLOPs each rank computes (index: rank) for one attention of a
    sequence of seq_len positions over world_size ranks (the module docstring's count)."""
    c = chunk_len(seq_len, layout, world_size, "attention_flops")
    per = block_flops(batch, heads, c, head_dim)
    return [per * _blocks(layout, r, world_size, causal) for r in range(world_size)]


def imbalance(flops: list[int]) -> float:
    """The slowest rank's work over the mean: 1.0 is balanced."""
    return max(flops) * len(flops) / sum(flops)


@contextlib.contextmanager
def count_attention_flops() -> Iterator[dict[str, int]]:
    """with count_attention_flops() as c: ...: c["flops"] / c["blocks"], what ring_attention's
    forwards computed on this rank inside the block (counted as it runs)."""
    counter = {"flops": 0, "blocks": 0}
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def record(flops: int) -> None:
    """ring_attention computed one block of `flops`."""
    for counter in _counters:
        counter["flops"] += flops
        counter["blocks"] += 1
