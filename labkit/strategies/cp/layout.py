"""Which positions of a sequence each context-parallel rank holds (the `layout`):

    "contiguous"  rank r holds positions [r T / n, (r + 1) T / n): one chunk, chunk r of n;
    "zigzag"      the sequence cut into 2n chunks, rank r holds chunks r and 2n - 1 - r, in that
                  order (each rank gets one early and one late chunk: causal work evens out).

A rank's piece is its chunks concatenated along the sequence dim. chunk_ids gives the global chunk
numbers (of n_chunks(layout, n) equal chunks), positions the token positions, shard / unshard cut a
whole sequence into this rank's piece and put every rank's pieces back. What it leaves out: uneven
chunks (a sequence whose length the chunks do not divide raises), other load-balancing schemes
(striped / round-robin tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["LAYOUTS", "chunk_ids", "n_chunks", "positions", "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object, where: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout must be one of {LAYOUTS}, got {layout!r}")
    return str(layout)


def n_chunks(layout: str, world_size: int) -> int:
    """How many equal chunks the whole sequence is cut into: n (contiguous) or 2n (zigzag)."""
    return world_size * (2 if check_layout(layout, "n_chunks") == "zigzag" else 1)


def chunk_ids(layout: str, rank: int, world_size: int) -> list[int]:
    """The global chunk numbers rank `rank` holds, in the order of its piece."""
    check_layout(layout, "chunk_ids")
    if not 0 <= rank < world_size:
        raise ValueError(f"chunk_ids: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]


def chunk_len(seq_len: int, layout: str, world_size: int, where: str = "cp") -> int:
    """The length of one chunk; raises naming the problem when the chunks do not divide seq_len."""
    chunks = n_chunks(layout, world_size)
    if seq_len % chunks:
        raise ValueError(
            f"{where}: a sequence of {seq_len} positions does not split into {chunks} equal chunks "
            f"(layout {layout!r} on {world_size} ranks needs a multiple of {chunks})"
        )
    return seq_len // chunks


def positions(seq_len: int, layout: str, rank: int, world_size: int) -> torch.Tensor:
    """The token positions (int64) of rank's piece of a sequence of seq_len positions."""
    c = chunk_len(seq_len, layout, world_size, "positions")
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(layout, rank, world_size)])


def shard(x: torch.Tensor, dim: int, layout: str, rank: int, world_size: int) -> torch.Tensor:
    """Rank's piece of the whole sequence `x` (the sequence along `dim`), a copy."""
    pos = positions(x.shape[dim], layout, rank, world_size).to(x.device)
    return x.index_select(dim, pos)


def unshard(pieces: Sequence[torch.Tensor], dim: int, layout: str) -> torch.Tensor:
    """The whole sequence from every rank's piece (pieces[r]: rank r's), the inverse of shard."""
    n = len(pieces)
    seq_len = sum(p.shape[dim] for p in pieces)
    out = torch.empty_like(torch.cat(list(pieces), dim))
    for r, piece in enumerate(pieces):
        out.index_copy_(dim, positions(seq_len, layout, r, n).to(piece.device), piece)
    return out
