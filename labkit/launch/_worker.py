"""What runs inside each rank that `labkit.run` starts.

The entry point lives in labkit (an importable module), so multiprocessing never has to import the
notebook's or script's `__main__`: the user's function travels by value (cloudpickle).

Left out on purpose: restarting failed ranks (torchrun's elastic agent does that; a course cell
should fail loudly instead).
"""

import contextlib
import ctypes
import faulthandler
import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Optional, Union

import cloudpickle
import torch
import torch.distributed as dist

from labkit.launch._descendants import become_subreaper, kill_descendants
from labkit.observe import memory, recording

_DEVICE = None  # this rank's device, set before the user's function runs


def current_device() -> torch.device:
    return _DEVICE if _DEVICE is not None else torch.device("cpu")


def set_current_device(dev: Optional[Union[str, torch.device]]) -> None:
    global _DEVICE
    _DEVICE = torch.device(dev) if dev is not None else None


def process_group_options(backend: str, device: torch.device) -> dict[str, Any]:
    """Extra keywords for init_process_group: NCCL gets `device_id` (this rank's GPU) where torch
    accepts it, so it binds the rank to its GPU instead of warning "Guessing device ID based on
    global rank" (and creates its communicator eagerly); gloo gets none (it ignores a device)."""
    import inspect

    if backend != "nccl" or device.type != "cuda":
        return {}
    if "device_id" not in inspect.signature(dist.init_process_group).parameters:
        return {}  # torch < 2.3
    return {"device_id": device}


def _die_with_parent(kernel_pid: int, run_dir: str) -> None:
    # The forkserver exits when the kernel dies; PDEATHSIG turns that into SIGKILL for us. The
    # polling thread covers the case where the kernel dies but the forkserver lingers, and the
    # case where the call is over (its run folder is gone) but the kernel never learned our pid.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass

    forkserver = os.getppid()

    def kernel_gone():
        if not os.path.isdir(run_dir):  # the call that started us has ended
            return True
        if os.getppid() != forkserver:  # the forkserver exited: we were re-parented
            return True
        try:
            with open(f"/proc/{kernel_pid}/stat") as f:  # a killed kernel may linger as a zombie
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def watch():
        while True:
            time.sleep(0.5)
            if kernel_gone():
                kill_descendants(os.getpid())  # what left our group (setsid) too
                with contextlib.suppress(OSError):
                    os.killpg(0, signal.SIGKILL)  # our group: us and what we started
                os._exit(1)

    threading.Thread(target=watch, name="labkit-parent-watch", daemon=True).start()


def _redirect_output(log_path: str) -> None:
    # dup2 onto fds 1 and 2 so that output written by C/C++ code (gloo, NCCL) is captured too.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)


def _flush_all() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # C stdio buffers: os._exit would drop them
    except Exception:
        pass


def _frames(tb) -> list:
    """Traceback frames as plain tuples; the kernel fills in source lines of notebook cells."""
    out = []
    for fs in traceback.extract_tb(tb):
        if fs.filename == __file__:
            continue
        out.append((fs.filename, fs.lineno, fs.name, fs.line or ""))
    return out


def _safe_str(exc: BaseException) -> str:
    """str(exc), or a line saying that it raised: an exception whose __str__ fails must still be
    reported at once (with its type and stack), not lost as a rank that never finished."""
    try:
        return str(exc)
    except BaseException as inner:  # noqa: BLE001 - whatever __str__ raises
        return f"<str() of this {type(exc).__name__} raised {type(inner).__name__}: {_plain(inner)}>"


def _plain(exc: BaseException) -> str:
    try:
        return str(exc)
    except BaseException:
        return "?"


def _error_message(exc: BaseException) -> tuple:
    message = _safe_str(exc)
    try:
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    except BaseException:
        summary = f"{type(exc).__name__}: {message}"
    try:
        frames = _frames(exc.__traceback__)
    except BaseException:
        frames = []
    return ("error", type(exc).__name__, message, frames, summary, time.time())


def begin_hooks(rank: int, world_size: int) -> None:
    recording.worker_begin(rank, world_size)
    memory.worker_begin(rank, world_size)


def end_hooks() -> dict:
    # Memory first: the tracer's own bookkeeping should not show up in the memory record.
    return {"memory": memory.worker_end(), "trace": recording.worker_end()}


def main(spec: dict, conn: Any) -> None:
    rank, world_size = spec["rank"], spec["world_size"]
    # Lead a process group of our own: the kernel kills the group, so a subprocess or a
    # DataLoader worker this rank starts dies with the call too.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    # And reap our orphans: what a subprocess of ours started in a session of its own stays
    # below us, where the kernel's teardown finds and kills it (labkit.launch._descendants).
    become_subreaper()
    _die_with_parent(spec["kernel_pid"], spec["run_dir"])
    _redirect_output(spec["log_path"])
    stack_file = open(spec["stack_path"], "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    # A crash (SIGSEGV, SIGABRT, ...) writes the Python stack to the rank's log, which the
    # kernel shows as the dead rank's last output.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "LABKIT_WORKER": "1",
        }
    )
    os.environ.update(spec.get("env", {}))
    torch.set_num_threads(spec["threads"])
    try:
        fn, args, kwargs = cloudpickle.loads(spec["payload"])
        if spec["backend"] == "nccl":
            torch.cuda.set_device(rank)
            set_current_device(torch.device("cuda", rank))
        else:
            set_current_device(torch.device("cpu"))
        files = dist.FileStore(spec["store_path"], world_size)
        files.set_timeout(timedelta(seconds=spec["pg_timeout"]))
        store = dist.PrefixStore(spec["run_id"], files)
        dist.init_process_group(
            spec["backend"],
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=spec["pg_timeout"]),
            **process_group_options(spec["backend"], current_device()),
        )
        begin_hooks(rank, world_size)
        value = fn(*args, **kwargs)
        extras = end_hooks()
        kind = type(value)
        try:
            blob = cloudpickle.dumps((value, extras))
        except Exception as exc:
            raise TypeError(
                f"rank {rank} returned a value of type {kind.__name__} that "
                f"cannot be pickled back to the notebook ({exc}); return tensors, "
                f"numbers, lists or dicts instead"
            ) from None
        _flush_all()
        # The type's name travels beside the value: if the kernel cannot unpickle it, the
        # error can still say what it was.
        conn.send_bytes(pickle.dumps(("ok", f"{kind.__module__}.{kind.__qualname__}", blob)))
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are failures of this rank too
        _flush_all()
        try:
            conn.send_bytes(pickle.dumps(_error_message(exc)))
        except BaseException:
            # Whatever failed on the way, the kernel still hears of the failure now (a rank
            # silent here is reported only after the whole timeout, as "did not finish").
            with contextlib.suppress(BaseException):
                name = type(exc).__name__
                conn.send_bytes(
                    pickle.dumps(("error", name, "<the error could not be described>", [], name, time.time()))
                )
    finally:
        _flush_all()
        # Stay up until the kernel stops us: a rank that exits early would turn a peer's honest
        # "stuck in recv" into a misleading "connection reset by peer". Never tear down the
        # interpreter either: destroying a gloo group whose peers are gone can block.
        try:
            while True:
                time.sleep(3600)
        finally:
            os._exit(0)
