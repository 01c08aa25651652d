"""What a MemoryTracker leaves behind: a small picklable record per rank.

It keeps the samples (time, label, bytes by category, total), the running high-water mark between
samples, the phases and marks for the plot, and on CUDA the allocator's own figures. It does not
keep any tensor or storage, so it travels from a rank back to the notebook as plain data.
"""

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from labkit.units import fmt_bytes

CATEGORIES = ("parameters", "gradients", "optimizer", "all_gather", "reduce_scatter", "activations", "other")
# On CUDA only (labkit.observe.memory): what memory_allocated() holds beyond the tracked tensors.
ALLOCATOR_CATEGORIES = ("allocator", "workspace")
ALL_CATEGORIES = CATEGORIES + ALLOCATOR_CATEGORIES


class Sample(NamedTuple):
    t: float  # seconds since the tracker started
    label: str
    by_category: dict  # category -> bytes (the device pool)
    total: int
    host: Optional[dict] = None  # category -> bytes in the host pool (CPU offload), {} if none


class Usage(NamedTuple):
    by_category: dict
    total: int
    label: str


@dataclass
class MemoryRecord:
    rank: object  # int, or None outside labkit.run
    world_size: object
    name: object
    samples: list  # of Sample(t, label, by_category, total)
    high_water: list  # per sample: highest running total since the previous sample
    phases: list = field(default_factory=list)  # (name, first index, last index)
    marks: list = field(default_factory=list)  # sample indices taken by mark()
    device_samples: list = field(default_factory=list)  # CUDA only: (memory_allocated, memory_reserved)
    peak_total: int = 0  # the true high-water mark
    peak_by_category: dict = field(default_factory=dict)  # at the sample with the highest total
    peak_label: str = ""
    t0: float = 0.0  # time.perf_counter() when the tracker started (as labkit.observe.tracing's t0)
    host_peak: int = 0  # the host pool's high-water mark (CPU offload)

    @classmethod
    def from_tracker(cls, tracker, rank, world_size):
        peak = tracker.peak()
        return cls(
            rank,
            world_size,
            tracker.name,
            list(tracker.samples),
            list(tracker.high_water),
            list(tracker.phases),
            list(tracker.marks),
            list(tracker.device_samples),
            peak.total,
            peak.by_category,
            peak.label,
            tracker._t0 or 0.0,
            tracker.host_peak,
        )

    @classmethod
    def merge(cls, records):
        """Several trackers on one rank, one after the other: one record, labels prefixed by name."""
        merged = cls(records[0].rank, records[0].world_size, None, [], [], t0=records[0].t0)
        for index, record in enumerate(records):
            offset = len(merged.samples)
            prefix = f"{record.name or f'tracker {index}'}: "
            shift = record.t0 - merged.t0  # one clock for all: seconds since the first tracker
            merged.samples += [s._replace(label=prefix + s.label, t=s.t + shift) for s in record.samples]
            merged.high_water += record.high_water
            merged.phases += [(prefix + n, a + offset, b + offset) for n, a, b in record.phases]
            merged.marks += [m + offset for m in record.marks]
            merged.device_samples += record.device_samples
        best = max(records, key=lambda r: max((s.total for s in r.samples), default=0))
        merged.peak_total = max(r.peak_total for r in records)
        merged.host_peak = max(r.host_peak for r in records)
        merged.peak_by_category, merged.peak_label = dict(best.peak_by_category), best.peak_label
        return merged

    def peak(self):
        return Usage(dict(self.peak_by_category), self.peak_total, self.peak_label)

    def used_categories(self):
        """Categories that hold bytes in at least one sample, in the course's fixed order."""
        return [c for c in ALL_CATEGORIES if any(s.by_category.get(c, 0) for s in self.samples)]

    def table(self):
        """A readable summary: bytes by category at the peak sample, and the high-water mark."""
        who = f"rank {self.rank}" if self.rank is not None else "this process"
        lines = [f"{who}: peak {fmt_bytes(self.peak_total)} (highest sample: {self.peak_label!r})"]
        for category in ALL_CATEGORIES:
            if self.peak_by_category.get(category):
                lines.append(f"  {category:<15}{fmt_bytes(self.peak_by_category[category]):>12}")
        if self.host_peak:
            lines.append(f"  host pool peak {fmt_bytes(self.host_peak):>12} (CPU offload)")
        return "\n".join(lines)

    def __repr__(self):
        return (
            f"MemoryRecord(rank={self.rank}, samples={len(self.samples)}, peak={fmt_bytes(self.peak_total)})"
        )


__all__ = ["ALL_CATEGORIES", "ALLOCATOR_CATEGORIES", "CATEGORIES", "MemoryRecord", "Sample", "Usage"]
