"""The course's training data: a character-level view of data/corpus.txt, and how to split it.

Every lab draws its batches from `get_batch(step, ...)`, which is a pure function of
(seed, step): the single-process reference and every rank of every strategy see the same global
batch at the same step, so their results can be compared tensor by tensor.

`shard_batch` gives each rank a contiguous block of sequences. When batch_size is not divisible by
world_size the first `batch_size % world_size` ranks hold one sequence more than the others. Then
"average the gradients over ranks" is no longer the global mean: sum the loss per rank
(reduction="sum"), all-reduce with SUM, and divide by the global number of tokens instead.

What it leaves out: no train/validation split, no shuffling epochs (batches are random windows,
drawn with replacement), no byte-pair encoding, no data loader processes.
"""

from functools import lru_cache
from pathlib import Path

import torch

CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"


@lru_cache(maxsize=None)
def _read_corpus(path: str) -> str:
    return Path(path).read_text(encoding="ascii")


class Tokenizer:
    """Characters to ids and back; the vocabulary is the sorted set of characters in the corpus.

    The corpus is ASCII only, so ids follow ASCII order: '\\n' is 0 and ' ' is 1.
    """

    def __init__(self, text: str | None = None):
        text = _read_corpus(str(CORPUS_PATH)) if text is None else text
        self.chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the corpus vocabulary") from None

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


@lru_cache(maxsize=None)
def _encoded_corpus(path: str) -> torch.Tensor:
    text = _read_corpus(path)
    tokenizer = Tokenizer(text)
    # A byte -> id lookup table encodes the whole megabyte at once instead of char by char.
    lookup = torch.full((256,), -1, dtype=torch.long)
    for ch, i in tokenizer.stoi.items():
        lookup[ord(ch)] = i
    raw = torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8)
    return lookup[raw.long()]


def load_corpus(path: str | Path | None = None) -> torch.Tensor:
    """The corpus as a 1-D LongTensor of token ids, read once per process and cached.

    The same tensor object is returned every time: treat it as read-only.
    """
    return _encoded_corpus(str(CORPUS_PATH if path is None else Path(path).resolve()))


def _step_seed(seed: int, step: int) -> int:
    # Mix (seed, step) so that nearby seeds do not produce shifted copies of each other's batches.
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    x = ((x ^ (x >> 31)) * 0xD6E8FEB86659FD93) % (1 << 64)
    return x & ((1 << 63) - 1)


def get_batch(step: int, batch_size: int, seq_len: int, seed: int = 0):
    """The GLOBAL batch for `step`: x, y LongTensors [batch_size, seq_len]; y is x shifted by one.

    Deterministic from (seed, step) alone: it uses its own torch.Generator, never the global RNG.
    """
    data = load_corpus()
    generator = torch.Generator().manual_seed(_step_seed(seed, step))
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    positions = starts[:, None] + torch.arange(seq_len)
    return data[positions], data[positions + 1]


def rank_slice(n: int, rank: int, world_size: int) -> slice:
    """Rank `rank`'s contiguous share of n items: sizes differ by at most one, larger shares first.

    Example: n=10, world_size=4 -> sizes 3, 3, 2, 2 -> slices [0:3], [3:6], [6:8], [8:10].
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def shard_batch(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int):
    """This rank's rows of the global batch (dim 0), per `rank_slice`: no overlap, nothing missed.

    With batch_size % world_size != 0 ranks hold different numbers of sequences (see module doc);
    with batch_size < world_size some ranks hold none.
    """
    rows = rank_slice(x.shape[0], rank, world_size)
    return x[rows], y[rows]


def micro_batches(x: torch.Tensor, y: torch.Tensor, k: int):
    """Split a batch into k micro-batches along dim 0 (sizes differ by at most one, as rank_slice).

    Uneven sizes mean that averaging k per-micro-batch mean losses is NOT the batch mean; sum the
    token losses and divide by the total token count instead.
    """
    if not 1 <= k <= x.shape[0]:
        raise ValueError(f"cannot split a batch of {x.shape[0]} into {k} non-empty micro-batches")
    return [(x[rows], y[rows]) for rows in (rank_slice(x.shape[0], i, k) for i in range(k))]
