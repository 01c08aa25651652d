"""Checkpoints of the hand-written FSDP, with nothing lost: weights, AdamW state, step, data
position and RNG state; sharded (each rank writes its shards) or full (rank 0 writes everything).

    save_sharded(fsdp, opt, root, step)         # root/step_000003/rank0.pt ... + COMPLETE
    path = latest_complete(root)                 # the newest checkpoint that verifies, or None
    step = load(fsdp, opt, path)                 # any world size: shards are re-cut on load

A save never shows half-done: every rank writes (and fsyncs) its file into a fresh hidden
directory; once all of them have reported their file's size and sha256, rank 0 writes the
COMPLETE manifest (those checksums, the save's id, the model/optimizer structure) and one rename
makes the directory `step_000003` (fsdp_checkpoint_files.py). A rank killed anywhere in the save
leaves the previous checkpoint of that step, or the whole new one, never a mix.
Loading re-checks every file against the manifest and the manifest's structure against the live
model and optimizer (unit labels, parameter names, shapes, element counts: nothing that depends
on the world size), and refuses with a CheckpointError that says what differs. It then joins each
unit's flat shards back into the unpadded buffer and cuts it for the current world size: that is
what makes 4 -> 2, 2 -> 3 and 3 -> 2 possible.

What it leaves out: async saves, saving to several hosts' local disks, re-planning units (the
model and its `units` must be the same), fully_shard's DTensor format (torch.distributed.checkpoint
does that: see `dcp_round_trip`).
"""
import os
import shutil
import signal
import uuid

import torch
import torch.distributed as dist

from labkit.comm.collectives import shard_range
from labkit.strategies.fsdp_flat import FSDPModel
from labkit.strategies.fsdp_checkpoint_files import (FORMAT, MARKER, CheckpointError,  # noqa: F401
                                                      commit, describe, read_verified, saving_dir,
                                                      structure_differences, torch_bytes,
                                                      write_durable, write_manifest)

# Where a fault campaign may kill a rank during save_sharded (kill_at=(rank, point)).
KILL_POINTS = ("before_write", "after_write", "before_marker", "before_rename")


def _step_dir(root, step):
    return os.path.join(root, f"step_{step:06d}")


def _unit_state(unit, opt):
    state = opt.state.get(unit.shard, {})
    return {"shard": unit.shard.detach().clone(),
            "exp_avg": state.get("exp_avg"), "exp_avg_sq": state.get("exp_avg_sq"),
            "adam_step": state.get("step"), "numel": unit.numel, "label": unit.label,
            "layout": unit.layout, "names": unit.names}


def _maybe_die(kill_at, rank, point):
    # SIGKILL, not an exception: nothing of the save's own cleanup may run, as in a real crash.
    if kill_at is not None and tuple(kill_at) == (rank, point):
        os.kill(os.getpid(), signal.SIGKILL)


def _start_save(root, step):
    """Rank 0 makes a fresh, empty saving directory; every rank learns its path and the save id."""
    final = _step_dir(root, step)
    info = [None, None]
    if dist.get_rank() == 0:
        tmp = saving_dir(final)
        shutil.rmtree(tmp, ignore_errors=True)   # a crashed earlier save of this step
        os.makedirs(tmp)
        info = [tmp, uuid.uuid4().hex]
    dist.broadcast_object_list(info, src=0)
    return final, info[0], info[1]


def _finish_save(tmp, final, entries, manifest, kill_at=None):
    """Rank 0: manifest last, then the one rename that makes the save visible."""
    _maybe_die(kill_at, 0, "before_marker")
    write_manifest(tmp, {**manifest, "format": FORMAT, "files": entries})
    _maybe_die(kill_at, 0, "before_rename")
    commit(tmp, final)


def save_sharded(fsdp, opt, root, step, crash_before_marker=False, kill_at=None):
    """Every rank writes its shards and their AdamW state; rank 0 commits the save (see the module
    doc). `step` is the number of steps done (= the data position: batches are a function of
    step). crash_before_marker=True simulates a crash after the rank files, before the manifest
    (nothing becomes visible); kill_at=(rank, point), point in KILL_POINTS, SIGKILLs that rank
    there. Returns the step directory (the saving directory if it "crashed")."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    final, tmp, save_id = _start_save(root, step)
    _maybe_die(kill_at, rank, "before_write")
    payload = {"save_id": save_id, "world_size": world_size, "rank": rank, "step": step,
               "rng": torch.get_rng_state(), "units": [_unit_state(u, opt) for u in fsdp.units]}
    entry = write_durable(os.path.join(tmp, f"rank{rank}.pt"), torch_bytes(payload))
    _maybe_die(kill_at, rank, "after_write")
    entries = [None] * world_size
    dist.all_gather_object(entries, entry)   # returns only once every rank's file is on disk
    if crash_before_marker:
        return tmp
    if rank != 0:
        _maybe_die(kill_at, rank, "before_marker")
    else:
        _finish_save(tmp, final, {f"rank{r}.pt": e for r, e in enumerate(entries)},
                     {"step": step, "world_size": world_size, "save_id": save_id, "full": False,
                      "structure": describe(fsdp, opt)}, kill_at)
    dist.barrier()   # no rank goes on (or reads the checkpoint) before it is committed
    return final


def save_full(fsdp, opt, root, step):
    """Rank 0 writes one file with every unit's whole flat buffer (and AdamW state): the format to
    hand to a single process. A collective: call it on every rank."""
    world_size = dist.get_world_size()
    units = []
    for unit in fsdp.units:
        gathered = {}
        for key, tensor in _unit_state(unit, opt).items():
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 1:
                full = torch.empty(tensor.numel() * world_size)
                dist.all_gather_into_tensor(full, tensor.contiguous())
                gathered[key] = full[:unit.numel]
            else:
                gathered[key] = tensor
        units.append(gathered)
    final, tmp, save_id = _start_save(root, step)
    if dist.get_rank() == 0:
        payload = {"save_id": save_id, "world_size": 1, "step": step, "rng": torch.get_rng_state(),
                   "units": units, "full": True}
        entry = write_durable(os.path.join(tmp, "full.pt"), torch_bytes(payload))
        _finish_save(tmp, final, {"full.pt": entry},
                     {"step": step, "world_size": 1, "save_id": save_id, "full": True,
                      "structure": describe(fsdp, opt)})
    dist.barrier()
    return final


def verify(path):
    """The manifest of the checkpoint at `path` once every file it lists has the right size,
    sha256 and save id; raises CheckpointError naming the first file that does not."""
    return read_verified(path)[0]


def is_complete(path):
    """True if `path` is a committed checkpoint whose files all verify against its manifest."""
    try:
        verify(path)
        return True
    except CheckpointError:
        return False


def _latest(root):
    """(newest verified step directory or None, why each newer one was skipped)."""
    skipped = []
    if os.path.isdir(root):
        for name in sorted((d for d in os.listdir(root) if d.startswith("step_")), reverse=True):
            try:
                verify(os.path.join(root, name))
                return os.path.join(root, name), skipped
            except CheckpointError as exc:
                skipped.append(str(exc))
    return None, skipped


def latest_complete(root):
    """The newest step directory under `root` that verifies (is_complete), or None."""
    return _latest(root)[0]


def resolve(root, resume_from):
    """The checkpoint path `resume_from` names: a path, or "latest" (the newest complete one under
    root); "latest" with none raises CheckpointError saying so (and why the others were skipped)."""
    if resume_from != "latest":
        return resume_from
    path, skipped = _latest(root)
    if path is None:
        why = "".join(f"\n  skipped: {reason}" for reason in skipped)
        raise CheckpointError(f"no complete checkpoint in {root}: nothing to resume from{why}")
    return path


def _read_units(path, manifest, payloads):
    """Per unit: the unpadded flat buffers (shard, exp_avg, exp_avg_sq) and the metadata."""
    if manifest["full"]:
        saved = payloads["full.pt"]
        return saved, saved["units"]
    world_size = manifest["world_size"]
    files = [payloads[f"rank{r}.pt"] for r in range(world_size)]
    units = []
    for i, meta in enumerate(files[0]["units"]):
        chunk = shard_range(meta["numel"], 0, world_size)[2] // world_size
        joined = {k: v for k, v in meta.items() if not isinstance(v, torch.Tensor) or v.dim() == 0}
        for key in ("shard", "exp_avg", "exp_avg_sq"):
            if meta[key] is None:
                continue
            pieces = [f["units"][i][key] for f in files]
            for r, piece in enumerate(pieces):
                if piece is None or piece.numel() != chunk:
                    raise CheckpointError(f"{path}: file rank{r}.pt: unit {meta['label']!r} {key} has "
                                          f"{None if piece is None else piece.numel()} elements, a "
                                          f"{world_size}-rank shard has {chunk}")
            joined[key] = torch.cat(pieces)[:meta["numel"]]
        units.append(joined)
    return files[0], units


def load(fsdp, opt, path):
    """Restore weights, AdamW state and RNG into `fsdp` / `opt` at the CURRENT world size; returns
    the step to continue from. Every rank reads and verifies every file (a shared file system is
    assumed), so every rank refuses alike: a CheckpointError saying what differs."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    manifest, payloads = read_verified(path)
    differences = structure_differences(manifest["structure"], describe(fsdp, opt))
    if differences:
        raise CheckpointError(f"{path} was saved from another model or optimizer:\n  "
                              + "\n  ".join(differences))
    in_optimizer = {id(p) for group in opt.param_groups for p in group["params"]}
    if any(id(u.shard) not in in_optimizer for u in fsdp.units):
        raise CheckpointError("the optimizer does not hold this model's shards (was it built "
                              "before sharding?): nothing to restore the AdamW state into")
    saved, units = _read_units(path, manifest, payloads)
    for unit, state in zip(fsdp.units, units):
        start, end, padded = shard_range(unit.numel, rank, world_size)
        chunk = padded // world_size

        def cut(flat):
            piece = torch.zeros(chunk)
            piece[:end - start] = flat[start:end]
            return piece
        with torch.no_grad():
            unit.shard.copy_(cut(state["shard"]))
        if state.get("exp_avg") is not None:
            opt.state[unit.shard] = {"step": state["adam_step"].clone(), "exp_avg": cut(state["exp_avg"]),
                                     "exp_avg_sq": cut(state["exp_avg_sq"])}
    torch.set_rng_state(saved["rng"])
    return saved["step"]


def dcp_round_trip(model, path):
    """fully_shard's model through torch.distributed.checkpoint: save, then load into the same
    model after zeroing it; returns the full state dict read back (call on every rank)."""
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


class Resumable(FSDPModel):
    """The hand-written FSDP that starts from the checkpoint at `resume_from` (a path; None: from
    scratch), for loop.train: the optimizer is the preset's, built over the shards."""

    @classmethod
    def from_preset(cls, model, cfg, resume_from=None, **options):
        fsdp = super().from_preset(model, cfg, **options)
        fsdp.start = load(fsdp, fsdp.optimizer, resume_from) if resume_from is not None else 0
        return fsdp


def _saver(root, save_every, fmt, crash_save_at, kill_at):
    """loop.train's after_step: a checkpoint after every `save_every` steps."""
    def after_step(fsdp, done):
        if not save_every or done % save_every:
            return
        if fmt == "full":
            save_full(fsdp, fsdp.optimizer, root, done)
        else:
            save_sharded(fsdp, fsdp.optimizer, root, done, crash_before_marker=done == crash_save_at,
                         kill_at=kill_at)
    return after_step


def train_resumable(total_steps, root, *, save_every=None, fmt="sharded", resume_from=None,
                    crash_save_at=None, batch_size=8, gpt_config=None, kill_at=None):
    """Rank function: loop.train, hand-written FSDP on the "fsdp" preset (block units, `gpt_config`
    overriding its TinyGPT fields) for steps [start, total_steps), where start is 0 or the step of
    the checkpoint `resume_from` (a path, or "latest" = the newest complete one under root;
    CheckpointError if there is none, or if it does not verify). Saves after every `save_every`
    steps in `fmt` ("sharded" / "full"), the save at step `crash_save_at` crashing before its
    marker, or, with kill_at=(rank, point), that rank SIGKILLed at that point of the first save
    (see save_sharded). Returns {"start", "losses" (one per step run), "state"}."""
    from labkit import loop
    from labkit.strategies.fsdp_checkpoint_files import read_manifest
    base = loop.PRESETS["fsdp"]
    cfg = base.replace(batch_size=batch_size, gpt={**base.gpt, **(gpt_config or {})})
    path = resolve(root, resume_from) if resume_from is not None else None
    # The data position must be known before the loop starts; load() re-reads it, verified.
    start = read_manifest(path)["step"] if path is not None else 0
    out = loop.train(Resumable, cfg, total_steps - start, first_step=start, spans=False,
                     resume_from=path, after_step=_saver(root, save_every, fmt, crash_save_at, kill_at))
    return {"start": start, "losses": out["losses"], "state": out["state"]}


def train_fully_shard_and_round_trip(steps, path):
    """Rank function: loop.train with fully_shard ("torch-fsdp"), then its model round-trips
    through DCP. Returns (full state before, full state read back)."""
    from labkit import loop
    out = loop.train("torch-fsdp", loop.PRESETS["fsdp"], steps, spans=False,
                     report=lambda s: {"model": s.model})
    return out["state"], dcp_round_trip(out["model"], path)
