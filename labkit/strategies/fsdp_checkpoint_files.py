"""The on-disk side of fsdp_checkpoint: durable writes, the COMPLETE manifest, the atomic commit,
and the checks a load makes before it trusts a byte.

A checkpoint directory is visible under its real name only once it is whole: every file is
written (and fsynced) into a fresh hidden directory `.step_000003.saving`, rank 0 writes the
manifest `COMPLETE` last (every file's size and sha256, the save's id, the model/optimizer
structure), and one rename makes the directory `step_000003`. Re-saving over an existing step
swaps the two directories in one renameat2(RENAME_EXCHANGE) where Linux and the file system allow;
elsewhere it falls back to two renames, and a crash between them leaves no `step_000003` (the older
steps stay; never a mix).

What it leaves out: object stores (no rename), concurrent writers to one root, keeping N newest.
"""
import ctypes
import errno
import hashlib
import io
import json
import os
import shutil
import sys

import torch

MARKER = "COMPLETE"
FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded: incomplete, corrupted, or made for another model."""


def saving_dir(final):
    """Where a save of `final` is written before the commit (hidden: latest_complete skips it)."""
    parent, name = os.path.split(final)
    return os.path.join(parent, f".{name}.saving")


def torch_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_durable(path, data):
    """Write bytes and fsync them; return the manifest entry (size, sha256) of what was written."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def fsync_dir(path):
    # A rename or a new file is durable only once its directory's entry is on disk too.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory, manifest):
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


def commit(tmp, final):
    """Make the finished directory `tmp` visible as `final` in one rename (see the module doc)."""
    fsync_dir(tmp)
    if not os.path.exists(final):
        os.rename(tmp, final)
    else:
        if not _exchange(tmp, final):
            os.rename(final, tmp + ".replaced")   # the window: no `final` until the next line
            os.rename(tmp, final)
            tmp += ".replaced"
        shutil.rmtree(tmp, ignore_errors=True)    # tmp now holds the replaced checkpoint
    fsync_dir(os.path.dirname(final) or ".")


def read_manifest(path):
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory {path}")
    try:
        with open(os.path.join(path, MARKER)) as f:
            text = f.read()
    except OSError:
        raise CheckpointError(f"{path} has no {MARKER} manifest: its save did not finish; never "
                              f"load it (use latest_complete(root))") from None
    try:
        manifest = json.loads(text)
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: {MARKER} is not a format-{FORMAT} manifest (an older or "
                              f"damaged checkpoint): it lists no checksums, so it cannot be verified")
    return manifest


def read_verified(path):
    """(manifest, {file name: payload}): every file the manifest lists, checked for size and
    sha256 and parsed, each from the same save (its save_id). Raises CheckpointError."""
    manifest = read_manifest(path)
    payloads = {}
    for name, entry in manifest["files"].items():
        try:
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
        except OSError as exc:
            raise CheckpointError(f"{path}: file {name}: listed in {MARKER} but unreadable "
                                  f"({exc.strerror})") from None
        if len(data) != entry["size"]:
            raise CheckpointError(f"{path}: file {name}: size mismatch ({len(data)} bytes on disk, "
                                  f"{entry['size']} in {MARKER})")
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"]:
            raise CheckpointError(f"{path}: file {name}: sha256 mismatch (on disk {digest[:12]}..., "
                                  f"{MARKER} says {entry['sha256'][:12]}...): the file is corrupted")
        payload = torch.load(io.BytesIO(data), weights_only=True)
        if payload.get("save_id") != manifest["save_id"] or payload.get("step") != manifest["step"]:
            raise CheckpointError(f"{path}: file {name} belongs to another save (step "
                                  f"{payload.get('step')}, id {payload.get('save_id')}) than {MARKER} "
                                  f"(step {manifest['step']}, id {manifest['save_id']})")
        payloads[name] = payload
    return manifest, payloads


def describe(fsdp, opt):
    """The world-size-independent structure a checkpoint must match: per unit its label, element
    count and parameters (every name of each, shape) in flat-buffer order; the optimizer's class
    and hyperparameters. JSON-normalised, so a saved copy compares equal to a fresh one."""
    units = [{"label": u.label, "numel": u.numel,
              "params": [[list(names), list(shape)] for names, (_, _, shape) in zip(u.names, u.layout)]}
             for u in fsdp.units]
    hyper = [{k: v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay", "amsgrad",
                                                  "maximize")} for g in opt.param_groups]
    return json.loads(json.dumps({"units": units, "optimizer": {"class": type(opt).__name__,
                                                                "param_groups": hyper}}))


def _names(names, limit=6):
    names = sorted(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def structure_differences(saved, live):
    """What differs between a checkpoint's structure and the live one, as readable lines."""
    out = []
    s_labels = [u["label"] for u in saved["units"]]
    l_labels = [u["label"] for u in live["units"]]
    if s_labels != l_labels:
        out.append(f"model has {len(l_labels)} units {l_labels}, checkpoint has {len(s_labels)} {s_labels}")

    def params(structure):
        return {name: (unit["label"], shape) for unit in structure["units"]
                for names, shape in unit["params"] for name in names}
    s_params, l_params = params(saved), params(live)
    if l_params.keys() - s_params.keys():
        out.append(f"missing keys (in the model, not in the checkpoint): {_names(l_params.keys() - s_params.keys())}")
    if s_params.keys() - l_params.keys():
        out.append(f"unexpected keys (in the checkpoint, not in the model): {_names(s_params.keys() - l_params.keys())}")
    for name in sorted(s_params.keys() & l_params.keys()):
        (s_unit, s_shape), (l_unit, l_shape) = s_params[name], l_params[name]
        if s_shape != l_shape:
            out.append(f"{name}: shape {tuple(l_shape)} in the model, {tuple(s_shape)} in the checkpoint")
        elif s_unit != l_unit:
            out.append(f"{name}: in unit {l_unit!r} in the model, {s_unit!r} in the checkpoint")
    if not out:   # same names and shapes: the flat layout (order, sizes) must still agree
        for s_unit, l_unit in zip(saved["units"], live["units"]):
            if s_unit != l_unit:
                out.append(f"unit {l_unit['label']!r}: {l_unit['numel']} elements in the model, "
                           f"{s_unit['numel']} in the checkpoint, or its parameters in another order")
    if saved["optimizer"] != live["optimizer"]:
        out.append(f"optimizer: {live['optimizer']} here, {saved['optimizer']} in the checkpoint")
    return out
