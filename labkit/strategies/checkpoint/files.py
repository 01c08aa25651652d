"""The on-disk side of checkpoints (save_load.py): durable writes, the COMPLETE manifest, the atomic commit,
and the checks a load makes before it trusts a byte.

A checkpoint directory is visible under its real name only once it is whole: every file is
written (and fsynced) into a fresh hidden directory `.step_000003.saving`, rank 0 writes the
manifest `COMPLETE` last (every file's size and sha256, the save's id, the model/optimizer
structure of shards.describe), and one rename makes the directory `step_000003`.
Re-saving over an existing step swaps the two directories in one renameat2(RENAME_EXCHANGE) where
Linux and the file system allow; elsewhere it falls back to two renames, and a crash between them
leaves no `step_000003` (the older steps stay; never a mix).

Finding what to resume from lives here too (verify, is_complete, latest_complete, resolve), and
read_full: a full checkpoint for one process.

One writer per root: the first save of a process takes `root/.writer.lock` (lock_root: an
flock held until that process exits, the holder's pid, host and start time written inside), so
a second run saving into the same root at the same time is refused with a CheckpointError naming
the holder, instead of both returning OK while one's checkpoints replace the other's. The kernel
drops an flock with its process, so a lock left by a dead run is simply taken over.

What it leaves out: object stores (no rename), locks across hosts (flock on a network file system
is not reliable everywhere), keeping N newest.
"""

import ctypes
import errno
import fcntl
import hashlib
import io
import json
import os
import shutil
import socket
import sys
import time
from typing import Any, Optional

import torch

MARKER = "COMPLETE"
FORMAT = 3  # 3: sharded tensors by key with global shape and row offset (per-parameter FSDP)


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded: incomplete, corrupted, or made for another model."""


def saving_dir(final: str) -> str:
    """Where a save of `final` is written before the commit (hidden: latest_complete skips it)."""
    parent, name = os.path.split(final)
    return os.path.join(parent, f".{name}.saving")


def torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_durable(path: str, data: bytes) -> dict[str, Any]:
    """Write bytes and fsync them; return the manifest entry (size, sha256) of what was written."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def fsync_dir(path: str) -> None:
    # A rename or a new file is durable only once its directory's entry is on disk too.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    write_durable(os.path.join(directory, MARKER), json.dumps(manifest, indent=1).encode())
    fsync_dir(directory)


def _exchange(a, b):
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), a)


def commit(tmp: str, final: str) -> None:
    """Make the finished directory `tmp` visible as `final` in one rename (see the module doc)."""
    fsync_dir(tmp)
    if not os.path.exists(final):
        os.rename(tmp, final)
    else:
        if not _exchange(tmp, final):
            os.rename(final, tmp + ".replaced")  # the window: no `final` until the next line
            os.rename(tmp, final)
            tmp += ".replaced"
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the replaced checkpoint
    fsync_dir(os.path.dirname(final) or ".")


def read_manifest(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory {path}")
    try:
        with open(os.path.join(path, MARKER)) as f:
            text = f.read()
    except OSError:
        raise CheckpointError(
            f"{path} has no {MARKER} manifest: its save did not finish; never "
            f"load it (use latest_complete(root))"
        ) from None
    try:
        manifest = json.loads(text)
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: {MARKER} is not a format-{FORMAT} manifest (an older or "
            f"damaged checkpoint): it lists no checksums, so it cannot be verified"
        )
    _check_file_list(path, manifest)
    return manifest


def _check_file_list(path: str, manifest: dict[str, Any]) -> None:
    """The manifest's own fields agree: a full checkpoint lists full.pt alone (world_size 1), a
    sharded one rank0.pt ... rank{N-1}.pt for its world_size N. The checksums cover the files,
    not the manifest: an edited world_size or file list is caught here, by name."""
    world_size, files, full = manifest.get("world_size"), manifest.get("files"), manifest.get("full")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"{path}: {MARKER} says world_size {world_size!r}, not a positive int")
    if not isinstance(files, dict) or not isinstance(full, bool):
        raise CheckpointError(f"{path}: {MARKER} has no file list or no 'full' flag: damaged")
    want = {"full.pt"} if full else {f"rank{r}.pt" for r in range(world_size)}
    if full and world_size != 1:
        raise CheckpointError(
            f"{path}: {MARKER} is a full checkpoint but says world_size {world_size} (not 1)"
        )
    if set(files) != want:
        missing, extra = sorted(want - set(files)), sorted(set(files) - want)
        raise CheckpointError(
            f"{path}: {MARKER} says world_size {world_size}, so it should list "
            f"{'full.pt' if full else f'rank0.pt ... rank{world_size - 1}.pt'}, but"
            + (f" lacks {', '.join(missing)}" if missing else "")
            + (" and" if missing and extra else "")
            + (f" also lists {', '.join(extra)}" if extra else "")
            + ": the manifest was edited or damaged; never load it"
        )


def read_verified(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, {file name: payload}): every file the manifest lists, checked for size and
    sha256 and parsed, each from the same save (its save_id). Raises CheckpointError."""
    manifest = read_manifest(path)
    payloads = {}
    for name, entry in manifest["files"].items():
        try:
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
        except OSError as exc:
            raise CheckpointError(
                f"{path}: file {name}: listed in {MARKER} but unreadable ({exc.strerror})"
            ) from None
        if len(data) != entry["size"]:
            raise CheckpointError(
                f"{path}: file {name}: size mismatch ({len(data)} bytes on disk, {entry['size']} in {MARKER})"
            )
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"]:
            raise CheckpointError(
                f"{path}: file {name}: sha256 mismatch (on disk {digest[:12]}..., "
                f"{MARKER} says {entry['sha256'][:12]}...): the file is corrupted"
            )
        payload = torch.load(io.BytesIO(data), weights_only=True)
        if payload.get("save_id") != manifest["save_id"] or payload.get("step") != manifest["step"]:
            raise CheckpointError(
                f"{path}: file {name} belongs to another save (step "
                f"{payload.get('step')}, id {payload.get('save_id')}) than {MARKER} "
                f"(step {manifest['step']}, id {manifest['save_id']})"
            )
        payloads[name] = payload
    return manifest, payloads


def read_full(path: str) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """A single process's view of a full checkpoint, verified: (step, {state_dict key: tensor},
    {parameter name: {"step", "exp_avg", "exp_avg_sq"}}); model.load_state_dict(the second)."""
    manifest, payloads = read_verified(path)
    if not manifest["full"]:
        raise CheckpointError(
            f"{path} is a sharded checkpoint (rank files), not a full one: load it "
            f"on ranks with load(), or save it again with save_full"
        )
    saved = payloads["full.pt"]
    return saved["step"], saved["model"], saved["optimizer"]


def verify(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint at `path` once every file it lists has the right size,
    sha256 and save id; raises CheckpointError naming the first file that does not."""
    return read_verified(path)[0]


def is_complete(path: str) -> bool:
    """True if `path` is a committed checkpoint whose files all verify against its manifest."""
    try:
        verify(path)
        return True
    except CheckpointError:
        return False


def _latest(root):
    """(newest verified step directory or None, why each newer one was skipped)."""
    skipped: list[str] = []
    if os.path.isdir(root):
        # By step number, not as strings: step_1000000 is newer than step_999999.
        steps = [d for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit()]
        for name in sorted(steps, key=lambda d: int(d[5:]), reverse=True):
            try:
                verify(os.path.join(root, name))
                return os.path.join(root, name), skipped
            except CheckpointError as exc:
                skipped.append(str(exc))
    return None, skipped


def latest_complete(root: str) -> Optional[str]:
    """The newest step directory under `root` that verifies (is_complete), or None."""
    return _latest(root)[0]


def resolve(root: str, resume_from: Optional[str]) -> Optional[str]:
    """The checkpoint path `resume_from` names: a path, or "latest" (the newest complete one under
    root); "latest" with none raises CheckpointError saying so (and why the others were skipped)."""
    if resume_from != "latest":
        return resume_from
    path, skipped = _latest(root)
    if path is None:
        why = "".join(f"\n  skipped: {reason}" for reason in skipped)
        raise CheckpointError(f"no complete checkpoint in {root}: nothing to resume from{why}")
    return path


LOCK_NAME = ".writer.lock"
_held: dict[str, Any] = {}  # realpath(root) -> the open lock file this process holds (released at its exit)


def lock_root(root: str) -> None:
    """Make this process the one writer of checkpoint root `root` (created if needed), or raise
    CheckpointError naming the process that is. Re-entrant within a process."""
    os.makedirs(root, exist_ok=True)
    key = os.path.realpath(root)
    if key in _held:
        return
    f = open(os.path.join(key, LOCK_NAME), "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "an unknown process"
        f.close()
        raise CheckpointError(
            f"checkpoint root {root} is being written by another run ({holder}); "
            f"two runs saving into one folder would replace each other's "
            f"checkpoints. Give this run its own root, or wait for that one "
            f"to end"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(
        f"pid {os.getpid()} on {socket.gethostname()}, started "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}\n"
    )
    f.flush()
    _held[key] = f
