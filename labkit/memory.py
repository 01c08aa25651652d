"""Per-rank memory, measured from the tensors that actually exist.

A `MemoryTracker` watches every tensor allocation through a TorchDispatchMode, follows each
storage with a weakref (so a freed or resized storage leaves the count at once), and at the
boundaries a lab marks it sorts the live storages into categories:

    parameters, gradients, optimizer, all_gather, reduce_scatter, activations, other

Each storage is counted once, however many tensors view it (tied weights, grads that are views of
a flat buffer). When one storage is claimed twice, the first rule that matches wins:
  1. `mt.tag(tensor, category)` - an explicit word from the lab beats everything;
  2. roots, in this order: parameters (model.parameters(), optimizer params, `register(..., "parameters")`),
     gradients (their `.grad`), optimizer (tensors in optimizer.state, 0-dim `step` counters included
     at their real 4 bytes), then anything else passed to `register`;
  3. activations: allocated while a forward phase was open (`mt.phase("forward")`; any phase whose
     name contains "forward" or "recompute", or `phase(name, activations=True)`) and still alive;
  4. other: everything else allocated while tracking (temporaries, buffers, the loss).

Left out, on purpose: tensors created before `with mt:` count only if a root or a tag reaches them;
memory that is not a torch storage (gloo's internal buffers, the CUDA caching allocator's slack -
on CUDA `torch.cuda.memory_allocated/reserved` are recorded next to each sample as the cross-check).
Use one `with mt:` around the whole run; the current total between samples is kept by a running
counter (every allocation, free and resize), so the reported peak is the true high-water mark.
"""
import threading
import time
import weakref
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CATEGORIES = ("parameters", "gradients", "optimizer", "all_gather", "reduce_scatter", "activations", "other")


class Sample(NamedTuple):
    t: float            # seconds since the tracker started
    label: str
    by_category: dict   # category -> bytes
    total: int


class Usage(NamedTuple):
    by_category: dict
    total: int
    label: str


# Per-process state for the worker hooks and for notify().
_ACTIVE = []            # trackers inside `with`
_USED = []              # trackers entered since worker_begin
_RANK = {"rank": None, "world_size": None}


def _check_category(category):
    if category not in CATEGORIES:
        raise ValueError(f"unknown memory category {category!r}; use one of {', '.join(CATEGORIES)}")


def _storage_of(tensor):
    """The tensor's storage, or None for tensors without one we can count (sparse, meta)."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


_FRESH_OUTPUTS = {}  # op -> True when its outputs may be new memory (no output aliases an input)


def _returns_fresh_memory(func):
    fresh = _FRESH_OUTPUTS.get(func)
    if fresh is None:
        fresh = not any(ret.alias_info is not None for ret in func._schema.returns)
        _FRESH_OUTPUTS[func] = fresh
    return fresh


class _AllocationWatcher(TorchDispatchMode):
    """Sees every op's outputs; new storages join the tracker, known ones get their size refreshed."""

    def __init__(self, tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = _returns_fresh_memory(func)
        if isinstance(out, torch.Tensor):
            self.tracker._see(out, fresh)
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, torch.Tensor):
                    self.tracker._see(item, fresh)
                elif isinstance(item, (tuple, list)):   # c10d ops return (list of tensors, work)
                    for inner in item:
                        if isinstance(inner, torch.Tensor):
                            self.tracker._see(inner, fresh)
        return out


class _Live:
    """One tracked storage: a weakref (never keeps it alive), its last known size, where it came from."""
    __slots__ = ("ref", "nbytes", "in_forward")

    def __init__(self, ref, nbytes, in_forward):
        self.ref, self.nbytes, self.in_forward = ref, nbytes, in_forward


class MemoryTracker:
    """Bytes held by live tensors on this rank, by category, sampled at the boundaries a lab marks.

        mt = MemoryTracker(model=model, optimizer=opt)
        with mt:
            with mt.phase("forward"): loss = model(x)
            with mt.phase("backward"): loss.backward()
            opt.step(); mt.mark("after step")
        mt.peak()   # Usage(by_category at the highest sample, true high-water total, label)

    `device` limits counting to one device type ("cpu", "cuda"); by default the model's device
    type when a model is given, otherwise every device.
    """

    def __init__(self, model=None, optimizer=None, name=None, device=None):
        self.name = name
        self._models = [] if model is None else list(model) if isinstance(model, (list, tuple)) else [model]
        self._optimizers = [] if optimizer is None else (
            list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
        if device is None and self._models:
            first = next((p for m in self._models for p in m.parameters()), None)
            device = None if first is None else first.device.type
        self.device_type = None if device is None else torch.device(device).type
        self._registered = []       # (weakref to tensor, category)
        self._tags = {}             # storage key -> category
        self._live = {}             # storage key -> _Live
        self.samples = []           # list of Sample
        self.high_water = []        # per sample: highest running total since the previous sample
        self.phases = []            # (name, first sample index, last sample index)
        self.marks = []             # indices of samples taken by mark()
        self.device_samples = []    # per sample on CUDA: (memory_allocated, memory_reserved)
        self._current = 0
        self._high_since_sample = 0
        self._forward_depth = 0
        self._t0 = None
        self._watcher = None
        self._orig_resize = None
        self._thread = None

    # --- roots -----------------------------------------------------------------------------
    def register(self, tensors, category):
        """Count these tensors (a tensor, an iterable of tensors, or a module's parameters) as `category`
        at every sample; held weakly, so a freed shard simply leaves the timeline."""
        _check_category(category)
        if isinstance(tensors, torch.nn.Module):
            tensors = list(tensors.parameters())
        elif isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        for tensor in tensors:
            self._registered.append((weakref.ref(tensor), category))
            self._adopt(_storage_of(tensor))

    def tag(self, tensor, category):
        """Count the storage under `tensor` as `category` while it lives (e.g. an all-gather buffer).
        A tag beats every other rule, also for parameters that are views of that buffer."""
        _check_category(category)
        storage = _storage_of(tensor)
        if storage is not None:
            self._adopt(storage)
            self._tags[storage._cdata] = category
        return tensor

    def _roots(self):
        """storage key -> (category, storage), walked fresh at each sample (so swapped .data is seen)."""
        params = [p for m in self._models for p in m.parameters()]
        params += [p for opt in self._optimizers for group in opt.param_groups for p in group["params"]]
        registered = [(ref(), cat) for ref, cat in self._registered]
        params += [t for t, cat in registered if t is not None and cat == "parameters"]
        found = {}

        def claim(tensor, category):
            storage = _storage_of(tensor)
            if storage is not None:
                found.setdefault(storage._cdata, (category, storage))

        for p in params:
            claim(p, "parameters")
        for p in params:
            claim(p.grad, "gradients")
        for t, cat in registered:
            if t is not None and cat == "gradients":
                claim(t, cat)
        for opt in self._optimizers:
            for state in opt.state.values():
                for value in state.values():
                    for t in value if isinstance(value, (list, tuple)) else [value]:
                        claim(t, "optimizer")
        for category in CATEGORIES[2:]:
            for t, cat in registered:
                if t is not None and cat == category:
                    claim(t, cat)
        return found

    # --- allocation accounting ---------------------------------------------------------------
    def _adopt(self, storage, in_forward=False):
        if storage is None or (self.device_type and storage.device.type != self.device_type):
            return
        key = storage._cdata
        if key in self._live:
            return
        # The callback holds the tracker weakly so a forgotten tracker is not kept alive by its tensors.
        tracker_ref = weakref.ref(self)
        ref = weakref.ref(storage, lambda _, key=key: (tracker_ref() or _Gone)._forget(key))
        nbytes = storage.nbytes()
        self._live[key] = _Live(ref, nbytes, in_forward)
        self._grow(nbytes)

    def _grow(self, delta):
        self._current += delta
        if self._current > self._high_since_sample:
            self._high_since_sample = self._current

    def _forget(self, key):
        entry = self._live.pop(key, None)
        self._tags.pop(key, None)
        if entry is not None:
            self._current -= entry.nbytes

    def _see(self, tensor, fresh):
        storage = _storage_of(tensor)
        if storage is None:
            return
        entry = self._live.get(storage._cdata)
        if entry is None:
            if fresh:   # a view of untracked memory is not an allocation
                self._adopt(storage, in_forward=self._forward_depth > 0)
        elif storage.nbytes() != entry.nbytes:   # resize_ / set_ on a tracked storage
            nbytes = storage.nbytes()
            self._grow(nbytes - entry.nbytes)
            entry.nbytes = nbytes

    def _watch_storage_resize(self):
        # UntypedStorage.resize_ (how FSDP frees a gathered parameter) bypasses the dispatcher.
        original = self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            result = original(storage, size)
            entry = tracker._live.get(storage._cdata)
            if entry is not None and storage.nbytes() != entry.nbytes:
                tracker._grow(storage.nbytes() - entry.nbytes)
                entry.nbytes = storage.nbytes()
            return result

        torch.UntypedStorage.resize_ = resize_

    # --- tracking on / off -----------------------------------------------------------------
    def __enter__(self):
        if self._t0 is None:
            self._t0 = time.perf_counter()
        self._thread = threading.get_ident()
        for _, storage in self._roots().values():
            self._adopt(storage)
        self._watch_storage_resize()
        self._watcher = _AllocationWatcher(self)
        self._watcher.__enter__()
        _ACTIVE.append(self)
        if self not in _USED:
            _USED.append(self)
        self.mark("start")
        return self

    def __exit__(self, *exc):
        self.mark("end")
        _ACTIVE.remove(self)
        self._watcher.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._orig_resize
        self._watcher = None
        self._live.clear()   # dropping the weakrefs also drops their callbacks
        self._current = 0
        return False

    # --- sampling ----------------------------------------------------------------------------
    def _measure(self):
        """Walk every live storage once: (by_category, total); also corrects the running counter."""
        roots = self._roots()
        for key, (_, storage) in roots.items():
            if key not in self._live:
                self._adopt(storage)
        by_category = dict.fromkeys(CATEGORIES, 0)
        total = 0
        for key, entry in list(self._live.items()):   # a weakref callback may fire meanwhile
            storage = entry.ref()
            if storage is None:
                continue
            nbytes = storage.nbytes()
            category = self._tags.get(key) or (roots[key][0] if key in roots else None) or (
                "activations" if entry.in_forward else "other")
            by_category[category] += nbytes
            total += nbytes
        self._current = total
        return by_category, total

    def mark(self, label):
        """Take a sample now, labelled `label` (e.g. "after step")."""
        self._sample(label)
        self.marks.append(len(self.samples) - 1)

    def _sample(self, label):
        if self._watcher is None:
            raise RuntimeError("MemoryTracker samples only inside `with tracker:`")
        by_category, total = self._measure()
        self.high_water.append(max(self._high_since_sample, total))
        self._high_since_sample = total
        self.samples.append(Sample(time.perf_counter() - self._t0, label, by_category, total))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.device_samples.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))

    @contextmanager
    def phase(self, name, activations=None):
        """Sample at `name`'s start and end; tensors allocated inside a forward phase are activations."""
        if activations is None:
            activations = "forward" in name.lower() or "recompute" in name.lower()
        self._sample(f"{name} start")
        first = len(self.samples) - 1
        self._forward_depth += bool(activations)
        try:
            yield self
        finally:
            self._forward_depth -= bool(activations)
            self._sample(f"{name} end")
            self.phases.append((name, first, len(self.samples) - 1))

    def current(self):
        """Usage now, without adding a sample."""
        by_category, total = self._measure()
        return Usage(by_category, total, "current")

    def peak(self):
        """by_category at the sample with the highest total, and the true high-water total
        (which can be higher: a temporary freed between two samples still counts)."""
        if not self.samples:
            return Usage(dict.fromkeys(CATEGORIES, 0), 0, "")
        best = max(range(len(self.samples)), key=lambda i: self.samples[i].total)
        total = max(self.high_water + [self._high_since_sample if self._watcher else 0])
        return Usage(dict(self.samples[best].by_category), total, self.samples[best].label)

    def record(self):
        """A picklable summary: what labkit.run returns as results.memory[rank]."""
        from labkit.memory_record import MemoryRecord
        return MemoryRecord.from_tracker(self, _RANK["rank"], _RANK["world_size"])


class _Gone:
    """Stands in for a tracker that no longer exists when a storage it followed is freed."""
    @staticmethod
    def _forget(key):
        pass


def notify(label):
    """Sample every active tracker on this rank (called by labkit.tracing at collective/span edges)."""
    if not _ACTIVE:
        return
    for tracker in _ACTIVE:
        if tracker._thread == threading.get_ident():   # gloo/autograd threads must not sample
            tracker._sample(label)


def worker_begin(rank, world_size):
    _RANK["rank"], _RANK["world_size"] = rank, world_size
    _USED.clear()


def worker_end():
    """The record of the trackers used on this rank (several are merged in order), or None."""
    from labkit.memory_record import MemoryRecord
    records = [tracker.record() for tracker in _USED]
    _USED.clear()
    if not records:
        return None
    return records[0] if len(records) == 1 else MemoryRecord.merge(records)


def plot_memory_timeline(records, theory=None, title=None, ax=None, x="index"):
    from labkit.memory_plot import plot_memory_timeline as plot
    return plot(records, theory=theory, title=title, ax=ax, x=x)


def plot_memory_bars(named_records, theory=None, title=None, ax=None):
    from labkit.memory_plot import plot_memory_bars as plot
    return plot(named_records, theory=theory, title=title, ax=ax)
