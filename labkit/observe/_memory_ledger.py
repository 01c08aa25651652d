"""The bookkeeping under labkit.observe.memory: which storages are alive and how many bytes each holds.

A TorchDispatchMode sees every op's outputs on the thread that turned it on; a storage an op
allocated joins the ledger with a weakref whose callback removes it the moment it is freed.
`UntypedStorage.resize_` (how FSDP frees a gathered parameter) bypasses the dispatcher, so it is
wrapped while the ledger runs. A running total and its high-water mark follow every change.

Two pools: "device" (what the running total and its high-water mark follow) and "host" (storages
marked with `mark_host`, or allocated while `on_host` is set: CPU offload's shards, gradients and
optimizer state, kept apart even when the device IS the CPU). A ledger limited to one device type
still admits host storages of another (a CUDA tracker sees the offloaded CPU shards).

Left out: categories (labkit.observe.memory decides them at sample time), allocations made on other
threads (the dispatch mode is thread-local; such tensors count once a root or a tag reaches them),
and memory that is not a torch storage.
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Storages marked host (key -> weakref, dropped when the storage dies): a mark outlives trackers,
# so a shard offloaded before `with tracker:` joins the host pool when adopted.
HOST = {}


def mark_host(storage):
    key = storage._cdata
    if key not in HOST:
        HOST[key] = weakref.ref(storage, lambda _, key=key: HOST.pop(key, None))


def is_marked_host(storage):
    ref = HOST.get(storage._cdata)
    return ref is not None and ref() is storage


_OP_KINDS = {}  # op -> what its outputs can mean for memory (cached: schemas never change)
_VIEW, _FRESH, _MUTATES = 0, 1, 2


def _op_kind(func):
    """_FRESH: outputs may be new memory; _MUTATES: may resize an input (resize_, set_, out=);
    _VIEW: outputs alias inputs and change no sizes, nothing to do (most forward ops are views)."""
    kind = _OP_KINDS.get(func)
    if kind is None:
        schema = func._schema
        if not any(ret.alias_info is not None for ret in schema.returns):
            kind = _FRESH
        elif schema.is_mutable:
            kind = _MUTATES
        else:
            kind = _VIEW
        _OP_KINDS[func] = kind
    return kind


class _AllocationWatcher(TorchDispatchMode):
    def __init__(self, ledger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = _op_kind(func)
        if kind == _VIEW:
            return out
        fresh = kind == _FRESH
        if isinstance(out, torch.Tensor):
            self.ledger.see(out, fresh)
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, torch.Tensor):
                    self.ledger.see(item, fresh)
                elif isinstance(item, (tuple, list)):  # c10d ops return (list of tensors, work)
                    for inner in item:
                        if isinstance(inner, torch.Tensor):
                            self.ledger.see(inner, fresh)
        return out


class _Live:
    """One tracked storage: a weakref (never keeps it alive), its last known size, where it came from."""

    __slots__ = ("ref", "nbytes", "in_forward", "host")

    def __init__(self, ref, nbytes, in_forward, host=False):
        self.ref, self.nbytes, self.in_forward, self.host = ref, nbytes, in_forward, host


def _forget_later(ledger_ref, key):
    # The callback holds the ledger weakly so a forgotten tracker is not kept alive by its tensors.
    def callback(_):
        ledger = ledger_ref()
        if ledger is not None:
            ledger.forget(key)

    return callback


class StorageLedger:
    """Live storages by key (`storage._cdata`, unique while the storage lives) and their bytes."""

    def __init__(self, device_type=None):
        self.device_type = device_type
        self.live = {}  # key -> _Live
        self.notes = {}  # key -> category from tag(); dies with the storage
        self.current = 0  # running total of live bytes (device pool)
        self.high_since_reset = 0  # highest `current` since the last reset_high()
        self.host_current = self.host_high = 0  # the host pool's running total and high-water
        self.in_forward = False  # set by the tracker while a forward phase is open
        self.on_host = False  # set while allocations belong to the host pool (host_allocations)
        self._self_ref = weakref.ref(self)
        self._watcher = None
        self._orig_resize = None

    @property
    def running(self):
        return self._watcher is not None

    def adopt(self, storage, in_forward=False):
        if storage is None or storage._cdata in self.live or storage.device.type == "meta":
            return
        host = self.on_host or is_marked_host(storage)
        if self.device_type and storage.device.type != self.device_type and not host:
            return
        key = storage._cdata
        nbytes = storage.nbytes()
        ref = weakref.ref(storage, _forget_later(self._self_ref, key))
        self.live[key] = _Live(ref, nbytes, in_forward, host)
        self._grow(nbytes, host)

    def set_host(self, storage):
        """A storage marked host after it was adopted (or never adopted): into the host pool."""
        entry = self.live.get(storage._cdata)
        if entry is None:
            self.adopt(storage)
        elif not entry.host:
            self._grow(-entry.nbytes, False)
            entry.host = True
            self._grow(entry.nbytes, True)

    def forget(self, key):
        entry = self.live.pop(key, None)
        self.notes.pop(key, None)
        if entry is not None:
            self._grow(-entry.nbytes, entry.host)

    def _grow(self, delta, host=False):
        if host:
            self.host_current += delta
            self.host_high = max(self.host_high, self.host_current)
            return
        self.current += delta
        if self.current > self.high_since_reset:
            self.high_since_reset = self.current

    def _refresh(self, storage, entry):
        nbytes = storage.nbytes()
        if nbytes != entry.nbytes:
            self._grow(nbytes - entry.nbytes, entry.host)
            entry.nbytes = nbytes

    def see(self, tensor, fresh):
        """An op's output: adopt its storage if the op allocated it, else refresh its size. A
        DTensor's own storage is a memoryless wrapper of the global size: its local shard counts."""
        tensor = getattr(tensor, "_local_tensor", tensor)
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
            return
        entry = self.live.get(storage._cdata)
        if entry is None:
            if fresh:  # a view of untracked memory is not an allocation
                self.adopt(storage, self.in_forward)
        else:  # resize_ / set_ / out= on a tracked storage
            self._refresh(storage, entry)

    def storages(self):
        """(key, storage, in_forward, nbytes now, host) for every live storage; re-syncs the
        running totals."""
        found, totals = [], [0, 0]
        for key, entry in list(self.live.items()):  # a weakref callback may fire meanwhile
            storage = entry.ref()
            if storage is not None:
                nbytes = storage.nbytes()
                entry.nbytes = nbytes
                found.append((key, storage, entry.in_forward, nbytes, entry.host))
                totals[entry.host] += nbytes
        self.current, self.host_current = totals
        self.host_high = max(self.host_high, self.host_current)
        return found

    def reset_high(self):
        """Start a new interval for the high-water mark; returns the one that just ended."""
        high = max(self.high_since_reset, self.current)
        self.high_since_reset = self.current
        return high

    def start(self):
        original = self._orig_resize = torch.UntypedStorage.resize_
        ledger = self

        def resize_(storage, size):
            result = original(storage, size)
            entry = ledger.live.get(storage._cdata)
            if entry is not None:
                ledger._refresh(storage, entry)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._watcher = _AllocationWatcher(self)
        self._watcher.__enter__()

    def stop(self, *exc):
        self._watcher.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._orig_resize
        self._watcher = None
        self.live.clear()  # dropping the weakrefs also drops their callbacks
        self.notes.clear()
        self.current = self.high_since_reset = 0
        self.host_current = self.host_high = 0
        self.on_host = False
