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

Two pools. "device" is what `total` and the peak count; "host" holds CPU offload's storages
(`mark_host(tensor)`, or anything allocated inside `host_allocations()`: the offloaded shards,
their gradients, the optimizer's state and its step), sampled by category as `Sample.host`. The
pools stay apart on a CPU-only machine too, where both are CPU memory.

On CUDA (a tracker counting "cuda"), each sample also names what the caching allocator holds
beyond the tensors, so that `total` equals `torch.cuda.memory_allocated()`:
  allocator   the rounding of every tracked storage to the allocator's blocks (`block_bytes`:
              512-byte multiples, at least 512), the formula's part of the gap;
  workspace   the rest of memory_allocated: library workspaces (cuBLAS's, 32 MiB on Hopper by
              default, allocated through the caching allocator at the first matmul and given back
              by torch._C._cuda_clearCublasWorkspaces(); its size `cublas_workspace_bytes()`),
              a large block left unsplit (the allocator keeps up to 1 MiB of a large block with
              the tensor), and tensors this tracker cannot see (made before `with`, or on
              another thread).
The peak on CUDA is `torch.cuda.max_memory_allocated()` when it rose in the interval, else the
tracked high-water plus the sample's allocator and workspace bytes. `torch.cuda.memory_reserved()`
(allocated plus reserved-but-free, the fragmentation) is recorded next to each sample
(`device_samples`: (memory_allocated, memory_reserved)).

Left out, on purpose: tensors created before `with mt:` count only if a root or a tag reaches them
(on CUDA they land in "workspace"); memory that is not a torch storage (gloo's internal buffers);
the allocator's rounding of a storage on another device than the current CUDA one.
Allocations on other threads (a comm thread's buffers) are not watched - the dispatch mode is
thread-local - and count only once a root or a tag reaches them; `notify()` from other threads is
ignored. Use one `with mt:` around the whole run; the current total between samples is kept by a
running counter (every allocation, free and resize), so the reported peak is the true high-water
mark. Cost: the dispatch mode sends every op through Python (about 1.5-2x on a TinyGPT step).
"""

import contextlib
import threading
import time
import weakref
from contextlib import contextmanager

import torch

from labkit.observe._memory_ledger import StorageLedger, mark_host as _mark_storage_host
from labkit.observe.memory_record import ALLOCATOR_CATEGORIES, CATEGORIES, MemoryRecord, Sample, Usage


# Per-process state for the worker hooks and for notify().
_ACTIVE = []  # trackers inside `with`
_USED = []  # trackers entered since worker_begin
_RANK = {"rank": None, "world_size": None}


BLOCK = 512  # bytes: the CUDA caching allocator's smallest block and its rounding unit
SMALL_POOL_MAX = 1 << 20  # bytes: requests up to 1 MiB come from the small pool (2 MiB segments)


def block_bytes(nbytes):
    """What the CUDA caching allocator counts in memory_allocated() for a request of `nbytes`:
    rounded up to a multiple of 512, at least 512 (0 for an empty storage, which takes no block).
    Both pools round so (small: <= 1 MiB, carved from 2 MiB segments; large: above). Left out: a
    large block it does not split (up to 1 MiB more than this; it lands in "workspace") and
    PYTORCH_CUDA_ALLOC_CONF's roundup_power2_divisions."""
    if nbytes <= 0:
        return 0
    return max(BLOCK, -(-nbytes // BLOCK) * BLOCK)


def cublas_workspace_bytes(config=None, capability=None):
    """cuBLAS's workspace as torch sizes it (aten/src/ATen/cuda/CublasHandlePool.cpp): the sum of
    SIZE_KiB * COUNT over CUBLAS_WORKSPACE_CONFIG's ":SIZE:COUNT" pairs; unset, ":4096:8" (32 MiB) on
    compute capability 9.0 and above (Hopper), else ":4096:2:16:8" (8 MiB + 128 KiB). One per
    (handle, stream); torch._C._cuda_clearCublasWorkspaces() frees them."""
    import os

    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    if not config:
        if capability is None:
            capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
        config = ":4096:8" if tuple(capability) >= (9, 0) else ":4096:2:16:8"
    fields = [f for f in config.split(":") if f]
    if len(fields) % 2 or not all(f.isdigit() for f in fields):
        raise ValueError(f"CUBLAS_WORKSPACE_CONFIG must be ':SIZE_KiB:COUNT' pairs, got {config!r}")
    return sum(int(size) * 1024 * int(count) for size, count in zip(fields[::2], fields[1::2]))


def _cuda_reading():
    """(memory_allocated, max_memory_allocated, memory_reserved) of the current CUDA device, or
    None when CUDA is not in use (the tests replace this to simulate an allocator)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved()


def mark_host(tensor):
    """Put the storage under `tensor` in the host pool (CPU offload's copies), in every tracker
    now and in any that adopts it later. Returns `tensor`."""
    storage = _storage_of(tensor)
    if storage is not None:
        _mark_storage_host(storage)
        for tracker in _ACTIVE:
            tracker._ledger.set_host(storage)
    return tensor


@contextmanager
def host_allocations():
    """Storages allocated inside (on the trackers' thread) belong to the host pool: CPU offload's
    host copies and its optimizer step on the host."""
    ledgers = [t._ledger for t in _ACTIVE if t._thread == threading.get_ident()]
    before = [ledger.on_host for ledger in ledgers]
    for ledger in ledgers:
        ledger.on_host = True
    try:
        yield
    finally:
        for ledger, old in zip(ledgers, before):
            ledger.on_host = old


def _check_category(category):
    if category not in CATEGORIES:
        raise ValueError(f"unknown memory category {category!r}; use one of {', '.join(CATEGORIES)}")


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types without a local tensor inside


def _storage_of(tensor):
    """The tensor's storage, or None for tensors without one we can count (sparse, meta).
    A DTensor (FSDP2's sharded parameters, their gradients and optimizer state) is a wrapper
    whose own storage reports the GLOBAL size: the bytes this rank holds are its local tensor's."""
    if type(tensor) not in _PLAIN:  # plain tensors skip the lookup (an AttributeError each time)
        local = getattr(tensor, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            tensor = local
    if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _parameters_of(module, out):
    """Append module.parameters() to `out` (each parameter once; the order within the list does
    not matter to _roots, whose whole list is one category). The tree is walked over `_modules`
    and `_parameters`, as nn.Module.parameters does, without building every parameter's dotted
    name; where a class overrides a method that parameters() goes through (its own
    parameters / named_parameters / _named_members at the top, named_modules anywhere in the
    tree), module.parameters() itself is called instead."""
    Module = torch.nn.Module
    top = type(module)
    if (
        top.parameters is not Module.parameters
        or top.named_parameters is not Module.named_parameters
        or top._named_members is not Module._named_members
    ):
        out.extend(module.parameters())
        return
    found, seen_modules, seen_params, stack = [], set(), set(), [module]
    while stack:
        m = stack.pop()
        if id(m) in seen_modules:
            continue
        if type(m).named_modules is not Module.named_modules:
            out.extend(module.parameters())
            return
        seen_modules.add(id(m))
        for p in m._parameters.values():
            if p is not None and id(p) not in seen_params:
                seen_params.add(id(p))
                found.append(p)
        stack.extend(child for child in m._modules.values() if child is not None)
    out.extend(found)


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
        self._optimizers = (
            []
            if optimizer is None
            else (list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
        )
        if device is None and self._models:
            first = next((p for m in self._models for p in m.parameters()), None)
            device = None if first is None else first.device.type
        self.device_type = None if device is None else torch.device(device).type
        self._registered = []  # (weakref to tensor, category)
        self._ledger = StorageLedger(self.device_type)  # live storages, running total, high-water
        self.samples = []  # list of Sample
        self.high_water = []  # per sample: highest running total since the previous sample
        self.phases = []  # (name, first sample index, last sample index)
        self.marks = []  # indices of samples taken by mark()
        self.device_samples = []  # per sample on CUDA: (memory_allocated, memory_reserved)
        self.host_peak = 0  # the host pool's high-water mark
        self._extra = 0  # on CUDA: the last sample's allocator + workspace bytes
        self._max_seen = None  # on CUDA: max_memory_allocated() at the previous sample
        self._forward_depth = 0
        self._t0 = None
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
            self._ledger.adopt(_storage_of(tensor))

    def tag(self, tensor, category):
        """Count the storage under `tensor` as `category` while it lives (e.g. an all-gather buffer).
        A tag beats every other rule, also for parameters that are views of that buffer."""
        _check_category(category)
        storage = _storage_of(tensor)
        if storage is not None:
            self._ledger.adopt(storage)
            if storage._cdata in self._ledger.live:  # not filtered out by `device`
                self._ledger.notes[storage._cdata] = category
        return tensor

    def _roots(self):
        """storage key -> (category, storage), walked fresh at each sample (so swapped .data is seen).
        Walked in precedence order; the first category to reach a storage keeps it. Every sample
        pays for this walk (a hundred per TinyGPT step under FSDP), so it is written flat: the
        same result as model.parameters() and _storage_of on each tensor, without their
        generators, names and per-call lookups."""
        alive, registered = [], {}  # the live registrations; category -> tensors, in order
        for ref, cat in self._registered:
            tensor = ref()
            if tensor is not None:
                alive.append((ref, cat))
                registered.setdefault(cat, []).append(tensor)
        self._registered = alive
        params = []
        for m in self._models:
            _parameters_of(m, params)
        params += [p for opt in self._optimizers for group in opt.param_groups for p in group["params"]]
        params += registered.get("parameters", [])
        state = [v for opt in self._optimizers for st in opt.state.values() for v in st.values()]
        walk = [("parameters", params), ("gradients", [p.grad for p in params if p is not None])]
        walk += [("gradients", registered.get("gradients", []))]
        walk += [("optimizer", [t for v in state for t in (v if isinstance(v, (list, tuple)) else [v])])]
        walk += [("optimizer", registered.get("optimizer", []))]
        walk += [(c, registered.get(c, [])) for c in CATEGORIES[3:]]
        found, seen = {}, set()
        mark_seen, plain, storage_of = seen.add, _PLAIN, _storage_of
        for category, tensors in walk:
            for tensor in tensors:
                if tensor is None:
                    continue
                key = id(tensor)
                if key in seen:
                    continue
                mark_seen(key)
                if type(tensor) in plain and not tensor.is_meta:  # _storage_of's common case, inline
                    try:
                        storage = tensor.untyped_storage()
                    except (RuntimeError, NotImplementedError):
                        continue
                else:
                    storage = storage_of(tensor)
                    if storage is None:
                        continue
                key = storage._cdata
                if key not in found:
                    found[key] = (category, storage)
        return found

    # --- tracking on / off -----------------------------------------------------------------
    def __enter__(self):
        if self._t0 is None:
            self._t0 = time.perf_counter()
        self._thread = threading.get_ident()
        for _, storage in self._roots().values():
            self._ledger.adopt(storage)
        self._ledger.start()
        reading = self._cuda()
        if reading is not None and self._max_seen is None:
            self._max_seen = reading[1]  # a peak before the tracker started is not its peak
        _ACTIVE.append(self)
        if self not in _USED:
            _USED.append(self)
        self.mark("start")
        return self

    def __exit__(self, *exc):
        self.mark("end")
        _ACTIVE.remove(self)
        self._ledger.stop(*exc)
        return False

    # --- sampling ----------------------------------------------------------------------------
    def _cuda(self):
        """The allocator's reading when this tracker counts CUDA memory, else None."""
        return _cuda_reading() if self.device_type == "cuda" else None

    def _measure(self, reading=None):
        """Walk every live storage once: (by_category, total, host by_category). With a CUDA
        `reading`, the allocator's rounding and the rest of memory_allocated join by_category."""
        roots = self._roots()
        ledger = self._ledger
        live, adopt = ledger.live, ledger.adopt
        for key, (_, storage) in roots.items():
            if key not in live:  # adopt's own first test, without the call
                adopt(storage)
        by_category = dict.fromkeys(CATEGORIES, 0)
        host = {}
        notes = ledger.notes
        rounding = 0
        for key, storage, in_forward, nbytes, on_host in ledger.storages():
            category = notes.get(key)
            if not category:
                root = roots.get(key)
                category = root[0] if root is not None else ("activations" if in_forward else "other")
            if on_host:
                host[category] = host.get(category, 0) + nbytes
            else:
                by_category[category] += nbytes
                if reading is not None:  # the device pool: this tracker's device type only
                    rounding += block_bytes(nbytes) - nbytes
        if reading is not None:
            tracked = sum(by_category.values())
            by_category["allocator"] = rounding
            by_category["workspace"] = max(0, reading[0] - tracked - rounding)
        return by_category, sum(by_category.values()), host

    def mark(self, label):
        """Take a sample now, labelled `label` (e.g. "after step")."""
        self._sample(label)
        self.marks.append(len(self.samples) - 1)

    def _sample(self, label):
        if not self._ledger.running:
            raise RuntimeError("MemoryTracker samples only inside `with tracker:`")
        reading = self._cuda()
        by_category, total, host = self._measure(reading)
        high = self._ledger.reset_high()
        if reading is not None:
            extra = sum(by_category[c] for c in ALLOCATOR_CATEGORIES)
            # The allocator's own high-water is exact when it rose in this interval; otherwise
            # the tracked high-water plus what the allocator held beyond the tensors.
            rose = self._max_seen is None or reading[1] > self._max_seen
            high = reading[1] if rose else max(high + extra, total)
            self._max_seen, self._extra = reading[1], extra
            self.device_samples.append((reading[0], reading[2]))
        elif torch.cuda.is_available() and torch.cuda.is_initialized():
            self.device_samples.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
        self.high_water.append(high)
        self.host_peak = max(self.host_peak, self._ledger.host_high, sum(host.values()))
        self.samples.append(Sample(time.perf_counter() - self._t0, label, by_category, total, host))

    @contextmanager
    def phase(self, name, activations=None):
        """Sample at `name`'s start and end; tensors allocated inside a forward phase are activations."""
        if activations is None:
            activations = "forward" in name.lower() or "recompute" in name.lower()
        self._sample(f"{name} start")
        first = len(self.samples) - 1
        self._forward_depth += bool(activations)
        self._ledger.in_forward = self._forward_depth > 0
        try:
            yield self
        finally:
            self._forward_depth -= bool(activations)
            self._ledger.in_forward = self._forward_depth > 0
            self._sample(f"{name} end")
            self.phases.append((name, first, len(self.samples) - 1))

    def current(self):
        """Usage now, without adding a sample."""
        by_category, total, _ = self._measure(self._cuda())
        return Usage(by_category, total, "current")

    def current_host(self):
        """The host pool now, by category (CPU offload's storages), without adding a sample."""
        host = self._measure()[2]
        return Usage(host, sum(host.values()), "current host")

    def peak(self):
        """by_category at the sample with the highest total, and the true high-water total
        (which can be higher: a temporary freed between two samples still counts)."""
        if not self.samples:
            return Usage(dict.fromkeys(CATEGORIES, 0), 0, "")
        best = max(range(len(self.samples)), key=lambda i: self.samples[i].total)
        total = max(self.high_water + [self._ledger.high_since_reset + self._extra])
        return Usage(dict(self.samples[best].by_category), total, self.samples[best].label)

    def record(self):
        """A picklable summary: what labkit.run returns as results.memory[rank]."""
        rank, world_size = _RANK["rank"], _RANK["world_size"]
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()  # torchrun
        return MemoryRecord.from_tracker(self, rank, world_size)


def notify(label):
    """Sample every active tracker on this rank (called by labkit.observe.tracing at collective/span edges)."""
    if not _ACTIVE:
        return
    for tracker in _ACTIVE:
        if tracker._thread == threading.get_ident():  # gloo/autograd threads must not sample
            tracker._sample(label)


def worker_begin(rank, world_size):
    """Called by labkit.run on each rank before fn: records made from now on carry this rank."""
    _RANK["rank"], _RANK["world_size"] = rank, world_size
    _USED.clear()


def worker_end():
    """The record of the trackers used on this rank (several are merged in order), or None."""
    records = [tracker.record() for tracker in _USED]
    _USED.clear()
    if not records:
        return None
    return records[0] if len(records) == 1 else MemoryRecord.merge(records)


@contextmanager
def phase_everywhere(name, activations=None):
    """`phase(name)` on every tracker active on this thread (for code that does not hold the
    tracker, e.g. a checkpointed block's recompute inside backward); nothing when none is."""
    trackers = [t for t in _ACTIVE if t._thread == threading.get_ident()]
    with contextlib.ExitStack() as stack:
        for tracker in trackers:
            stack.enter_context(tracker.phase(name, activations))
        yield
