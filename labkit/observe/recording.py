"""A rank's recording: `worker_begin` / `worker_end` (the hooks labkit.run calls around fn, also
usable in a plain process or under torchrun), `paused()`, and the patch that records
torch.distributed collectives called directly from Python, by wrapping the functions on the
`torch.distributed` and `torch.distributed.distributed_c10d` modules.

The patch is installed by `worker_begin` in the rank's own process (dedicated to the run, so
patching module attributes there is harmless) and removed by `worker_end`. FSDP2's fully_shard
looks its collectives up as `dist.all_gather_single` / `dist.reduce_scatter_single` at call time,
so it is seen.

Sizes follow nccl-tests: all-reduce, broadcast, reduce, send/recv count the tensor; reduce-scatter
and all-gather count the full (unsharded) tensor, i.e. world_size × the shard.

Left out: DDP's C++ reducer (use tracing.ddp_comm_hook_recording), functional collectives, scatter/
gather/all_to_all lists (only all_to_all_single is wrapped), and references taken before install.
"""

import contextlib
import functools
import inspect

import torch.distributed as dist
from torch.distributed import distributed_c10d

from labkit.observe import tracing

_MODULES = (dist, distributed_c10d)
_originals = {}  # name -> original function, while installed


def _nbytes(t):
    return t.numel() * t.element_size()


def _group_size(group):
    try:
        return dist.get_world_size(group)
    except Exception:  # not a member of that group, or no group: still record the call
        return 1


# name -> (op shown on the chart, argument holding the data, how to count its bytes)
# "tensor": that tensor; "list": sum over a list of tensors; "times_ws": one rank's tensor x world size.
_SPECS = {
    "all_reduce": ("all_reduce", "tensor", "tensor"),
    "broadcast": ("broadcast", "tensor", "tensor"),
    "reduce": ("reduce", "tensor", "tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input", "tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list", "list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor", "tensor"),
    "all_gather_single": ("all_gather", "output_tensor", "tensor"),
    "all_gather": ("all_gather", "tensor", "times_ws"),
    "all_reduce_coalesced": ("all_reduce", "tensors", "list"),
    "all_to_all_single": ("all_to_all", "input", "tensor"),
    "barrier": ("barrier", None, None),
    "send": ("send", "tensor", "tensor"),
    "recv": ("recv", "tensor", "tensor"),
    "isend": ("send", "tensor", "tensor"),
    "irecv": ("recv", "tensor", "tensor"),
}
_COUNT_BYTES = {
    "tensor": lambda data, ws: _nbytes(data),
    "list": lambda data, ws: sum(_nbytes(t) for t in data),
    "times_ws": lambda data, ws: _nbytes(data) * ws,
}
# These always return a Work (no async_op argument).
_ALWAYS_ASYNC = {"isend", "irecv"}


class _RecordedWork(dist.Work):
    """A Work that records how long wait() blocked. A Work subclass, because FSDP2 checks
    isinstance(work, dist.distributed_c10d.Work) before waiting."""

    def __init__(self, inner, token):
        super().__init__()
        self._inner = inner
        self._token = token

    def wait(self, timeout=None):
        with tracing.blocked(self._token):
            result = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._token.finish()  # the future callback usually came first; finish() keeps the earliest
        return result

    def get_future(self):
        return self._inner.get_future()

    def is_completed(self):
        return self._inner.is_completed()

    def is_success(self):
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def result(self):
        return self._inner.result()

    def source_rank(self):
        return self._inner.source_rank()

    def synchronize(self):
        return self._inner.synchronize()


def _finish_on_future(work, token):
    try:
        work.get_future().add_done_callback(lambda fut: token.finish())
    except Exception:  # some backends/ops have no future: the end is then taken at wait()
        pass


def _arg_getter(original, arg_name, default):
    """Read an argument by name whether it was passed by keyword or by position."""
    try:
        position = list(inspect.signature(original).parameters).index(arg_name)
    except (ValueError, TypeError):
        position = None

    def get(args, kwargs):
        if arg_name in kwargs:
            return kwargs[arg_name]
        if position is not None and position < len(args):
            return args[position]
        return default

    return get


def _wrap(name, original):
    op, data_arg, rule = _SPECS[name]
    get_data = _arg_getter(original, data_arg, None) if data_arg else (lambda args, kwargs: None)
    count_bytes = _COUNT_BYTES[rule] if rule else (lambda data, ws: 0)
    get_group = _arg_getter(original, "group", None)
    get_async = _arg_getter(original, "async_op", False)

    @functools.wraps(original)
    def recorded(*args, **kwargs):
        if not tracing.is_recording() or tracing._suppressed():
            return original(*args, **kwargs)
        world_size = _group_size(get_group(args, kwargs))
        try:
            nbytes = count_bytes(get_data(args, kwargs), world_size)
        except Exception:  # unusual call form: record the call, without a size
            nbytes = 0
        is_async = name in _ALWAYS_ASYNC or bool(get_async(args, kwargs))
        label = f"dist.{name}"
        if not is_async:
            with tracing.record_collective(op, nbytes, world_size, label=label):
                return original(*args, **kwargs)
        token = tracing.start_collective(op, nbytes, world_size, label=label)
        with tracing.untraced():
            work = original(*args, **kwargs)
        if work is None:  # this rank is not in the group
            token.finish()
            return work
        _finish_on_future(work, token)
        return _RecordedWork(work, token)

    recorded._labkit_original = original
    return recorded


def _wrap_batch(original):
    @functools.wraps(original)
    def recorded(p2p_op_list):
        if not tracing.is_recording() or tracing._suppressed():
            return original(p2p_op_list)
        # One event per point-to-point op: the chart shows sends and receives separately.
        tokens = []
        for p2p in p2p_op_list:
            op = "send" if getattr(p2p.op, "__name__", "") == "isend" else "recv"
            tokens.append(
                tracing.start_collective(op, _nbytes(p2p.tensor), 2, label="dist.batch_isend_irecv")
            )
        with tracing.untraced():
            works = original(p2p_op_list)
        wrapped = []
        for work, token in zip(works, tokens):
            _finish_on_future(work, token)
            wrapped.append(_RecordedWork(work, token))
        return wrapped

    recorded._labkit_original = original
    return recorded


def install():
    """Wrap torch.distributed's collectives (idempotent)."""
    if _originals:
        return
    for name in list(_SPECS) + ["batch_isend_irecv"]:
        original = getattr(distributed_c10d, name, None) or getattr(dist, name, None)
        if original is None:  # older torch without the *_single forms
            continue
        original = getattr(original, "_labkit_original", original)
        _originals[name] = original
        wrapped = _wrap_batch(original) if name == "batch_isend_irecv" else _wrap(name, original)
        for module in _MODULES:
            if getattr(module, name, None) is original:
                setattr(module, name, wrapped)


def uninstall():
    """Put the original functions back. Returns whether anything was installed."""
    if not _originals:
        return False
    for name, original in _originals.items():
        for module in _MODULES:
            if getattr(getattr(module, name, None), "_labkit_original", None) is original:
                setattr(module, name, original)
    _originals.clear()
    return True


# ---------------------------------------------------------------- worker hooks


def worker_begin(rank, world_size):
    """Start recording on this rank (called by labkit.run after init_process_group; also usable
    in a plain process or under torchrun). Patches torch.distributed's Python collectives."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # t0 right after it: ranks share a zero to within the barrier's skew
    tracing._begin(rank, world_size)
    install()


def worker_end():
    """Stop recording and return this rank's record (plain dicts), or None if nothing recorded.
    The record's shape is in labkit.observe.tracing's docstring."""
    uninstall()
    return tracing._end()


@contextlib.contextmanager
def paused():
    """Record nothing inside (e.g. a warm-up), with torch.distributed unpatched meanwhile."""
    saved = tracing._swap(None)
    was_installed = uninstall()
    try:
        yield
    finally:
        tracing._swap(saved)
        if was_installed:
            install()
