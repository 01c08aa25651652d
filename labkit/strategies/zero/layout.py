"""The flat, padded layout ZeRO shards: FlatPartition (one buffer) and FlatLayout (buckets of them).

FlatPartition puts the trainable parameters end to end in one flat buffer, padded with zeros to
N * ceil(numel / N) (labkit.comm.collectives.shard_range's convention), and every parameter
becomes a view of it, so the all-gather writes straight into the model. FlatLayout lays several
such partitions ("buckets", ZeRO2's unit of communication) end to end; with one bucket it is
exactly FlatPartition. per_tensor_owners is torch's ZeroRedundancyOptimizer's partition (whole
tensors per rank), for comparison.

What it leaves out: several dtypes or devices in one flat buffer (refused, not converted).
"""

from typing import Iterable, Optional, Sequence

import torch

from labkit.comm.collectives import shard_range


class FlatPartition:
    """The trainable parameters (each once: tied weights are one Parameter) laid end to end.

    Parameter i occupies flat elements [offsets[i], offsets[i] + numels[i]). The buffer is padded
    to `padded_numel = world_size * chunk` with chunk = ceil(numel / world_size), so every rank's
    chunk has the same size (what reduce_scatter_tensor / all_gather_into_tensor require); rank k
    owns padded elements [k * chunk, (k + 1) * chunk), of which `rank_range(k)` are real.
    """

    def __init__(self, params, world_size):
        self.params = trainable_unique(params)
        if len({p.dtype for p in self.params}) > 1:
            raise TypeError("FlatPartition needs one dtype for all trainable parameters")
        self.world_size = world_size
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        _, _, self.padded_numel = shard_range(self.numel, 0, world_size)
        self.chunk = self.padded_numel // world_size

    def rank_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of the real (unpadded) flat elements rank `rank` owns."""
        start, end, _ = shard_range(self.numel, rank, self.world_size)
        return start, end

    def chunk_slice(self, rank: int) -> slice:
        """Rank `rank`'s chunk in the padded buffer (its tail may be padding)."""
        return slice(rank * self.chunk, (rank + 1) * self.chunk)

    def padding(self, rank: int) -> int:
        start, end = self.rank_range(rank)
        return self.chunk - (end - start)

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A new padded flat buffer holding `tensors` (shaped like the params) end to end;
        a None (a parameter without gradient) leaves zeros."""
        like = self.params[0]
        flat = torch.zeros(self.padded_numel, dtype=like.dtype, device=like.device)
        for view, t in zip(self.views(flat), tensors):
            if t is not None:
                view.copy_(t)
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like each parameter (no copy)."""
        return [flat[o : o + n].view_as(p) for p, o, n in zip(self.params, self.offsets, self.numels)]

    def segments(self, rank: int) -> list[tuple[int, int, int]]:
        """(param index, flat start, flat end) for every parameter piece inside rank's chunk."""
        start, end = self.rank_range(rank)
        out = []
        for i, (o, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(o, start), min(o + n, end)
            if lo < hi:
                out.append((i, lo, hi))
        return out


def per_tensor_owners(numels: Sequence[int], world_size: int) -> list[list[int]]:
    """Owner-rank partitioning (what torch's ZeroRedundancyOptimizer does): whole tensors, each
    given to the rank holding the fewest elements so far, largest tensors first.
    Returns, per rank, the indices (into numels) of the tensors it owns."""
    owners: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        rank = load.index(min(load))
        owners[rank].append(i)
        load[rank] += numels[i]
    return owners


def per_tensor_partition(numels: Sequence[int], world_size: int) -> list[int]:
    """Elements per rank under per_tensor_owners; max / mean is its load imbalance."""
    return [sum(numels[i] for i in owned) for owned in per_tensor_owners(numels, world_size)]


def trainable_unique(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters that get gradients, each once (a tied weight is one Parameter), in order."""
    unique: dict[int, torch.nn.Parameter] = {}
    for p in params:
        if p.requires_grad:  # frozen parameters stay replicated and untouched
            unique.setdefault(id(p), p)
    return list(unique.values())


def _bucket(params, cap_mb):
    """The longest prefix of params within cap_mb MiB (at least one parameter)."""
    out: list = []
    size = 0
    for p in params:
        if out and size + p.numel() * p.element_size() > cap_mb * 2**20:
            break
        out.append(p)
        size += p.numel() * p.element_size()
    return out


class FlatLayout:
    """Buckets, each a FlatPartition of whole parameters, laid end to end in one flat buffer.

    bucket_cap_mb=None: one bucket holding every parameter (ZeRO-1's layout, FlatPartition's
    geometry). Otherwise buckets of about bucket_cap_mb MiB are filled in REVERSE parameter order
    (the order backward produces gradients), so bucket 0 holds the last parameters and is the
    first one ready; bucket b occupies flat[bases[b] : bases[b] + buckets[b].padded_numel].
    Every bucket is padded and split N ways on its own: rank k owns chunk k of every bucket, and a
    rank's shard (of parameters, gradients) is its chunks of all buckets end to end,
    shard_numel = sum of the buckets' chunks (1/N of the model plus at most N-1 per bucket).
    last_bucket_mb: the cap (at most bucket_cap_mb) of the LAST bucket (the first parameters: the embeddings, whose
    gradients backward produces last). Nothing overlaps its reduce-scatter and it is what is
    still in flight when backward ends, so a small one shortens both the exposed communication
    and the gradient bytes alive at that moment. None: bucket_cap_mb.
    """

    def __init__(self, params, world_size, bucket_cap_mb=None, last_bucket_mb=None):
        trainable = trainable_unique(params)
        if not trainable:
            raise ValueError("no trainable parameters to partition")
        if len({(p.dtype, p.device) for p in trainable}) > 1:
            raise TypeError(
                "one flat buffer needs one dtype and one device for all trainable "
                "parameters (a copy would round or move them)"
            )
        groups = [trainable]
        if bucket_cap_mb is not None:
            last = _bucket(trainable, min(bucket_cap_mb, last_bucket_mb or bucket_cap_mb))
            groups, size = [[]], 0
            for p in reversed(trainable[len(last) :]):
                if groups[-1] and size + p.numel() * p.element_size() > bucket_cap_mb * 2**20:
                    groups.append([])
                    size = 0
                groups[-1].insert(0, p)  # keep forward order inside the bucket
                size += p.numel() * p.element_size()
            groups = [g for g in groups if g] + [last]
        self.world_size = world_size
        self.buckets = [FlatPartition(g, world_size) for g in groups]
        self.params = [p for bucket in self.buckets for p in bucket.params]
        self.dtype, self.device = trainable[0].dtype, trainable[0].device
        sizes = [b.padded_numel for b in self.buckets]
        self.bases = [sum(sizes[:i]) for i in range(len(sizes))]
        self.numel = sum(sizes)
        chunks = [b.chunk for b in self.buckets]
        self.shard_offsets = [sum(chunks[:i]) for i in range(len(chunks))]
        self.shard_numel = sum(chunks)
        firsts = [0]
        for bucket in self.buckets:
            firsts.append(firsts[-1] + len(bucket.params))
        self.first_param = firsts[:-1]  # index (into self.params) of each bucket's first param
        # Flat offset of every parameter in the whole buffer.
        self.offsets = [base + o for base, bucket in zip(self.bases, self.buckets) for o in bucket.offsets]

    def empty(self, numel: Optional[int] = None, zero: bool = True) -> torch.Tensor:
        """A flat buffer in the parameters' dtype and device (numel: default the whole layout)."""
        make = torch.zeros if zero else torch.empty
        return make(self.numel if numel is None else numel, dtype=self.dtype, device=self.device)

    def bucket_slice(self, b: int) -> slice:
        return slice(self.bases[b], self.bases[b] + self.buckets[b].padded_numel)

    def rank_slice(self, b: int, rank: int) -> slice:
        """Rank `rank`'s chunk of bucket b, as a slice of the whole flat buffer."""
        chunk = self.buckets[b].chunk
        return slice(self.bases[b] + rank * chunk, self.bases[b] + (rank + 1) * chunk)

    def shard_slice(self, b: int) -> slice:
        """Where bucket b's chunk sits in a rank's shard."""
        return slice(self.shard_offsets[b], self.shard_offsets[b] + self.buckets[b].chunk)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of the whole flat buffer shaped like each parameter (order of self.params)."""
        return [v for b, bucket in enumerate(self.buckets) for v in bucket.views(flat[self.bucket_slice(b)])]

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A new flat buffer holding `tensors` (shaped like self.params; None leaves zeros)."""
        flat = self.empty()
        for view, t in zip(self.views(flat), tensors):
            if t is not None:
                view.copy_(t)
        return flat

    def segments(self, rank: int) -> list[tuple[int, int, int, int]]:
        """(param index, flat lo, flat hi, shard lo) for every real (never padding) piece of a
        parameter inside rank's chunks: what that rank's optimizer steps."""
        out = []
        for b, bucket in enumerate(self.buckets):
            own = self.bases[b] + rank * bucket.chunk
            for i, lo, hi in bucket.segments(rank):
                lo, hi = self.bases[b] + lo, self.bases[b] + hi
                out.append((self.first_param[b] + i, lo, hi, self.shard_offsets[b] + lo - own))
        return out
