"""Checkpoints of the hand-written FSDP, with nothing lost: weights, AdamW state, step, data
position, RNG state and fp16's loss scale; sharded (each rank writes its shards) or full (rank 0
writes everything).

    save_sharded(fsdp, opt, root, step)         # root/step_000003/rank0.pt ... + COMPLETE
    path = latest_complete(root)                 # the newest checkpoint that verifies, or None
    step = load(fsdp, opt, path)                 # any world size: shards are re-cut on load

It targets the per-parameter reference ("fsdp", FSDP2's model): each rank writes, per parameter,
its dim-0 shard with the global shape and its row offset, and the shard's AdamW state. The flat
FSDP ("fsdp-flat") goes through the same code, a unit's flat buffer being its one sharded tensor
(shards.py); neither loads the other's sharded files; the full format loads into
either. The full format (`save_full`) is one file of whole tensors under the model's state_dict
keys (buffers and both keys of a tied weight included), loadable by one process (`read_full`).

A save never shows half-done: every rank writes (and fsyncs) its file into a fresh hidden
directory; once all of them have reported their file's size and sha256, rank 0 writes the
COMPLETE manifest (those checksums, the save's id, the model/optimizer structure) and one rename
makes the directory `step_000003` (files.py). A rank killed anywhere in the save
leaves the previous checkpoint of that step, or the whole new one, never a mix.
Loading re-checks every file against the manifest, the manifest's structure against the live
model and optimizer (layout, unit labels, parameter names, shapes: nothing that depends on the
world size) and every shard's shape and offset against the saved world size, and refuses with a
CheckpointError that says what differs. It then joins each tensor's shards (padding dropped) and
cuts it for the current world size: that is what makes 4 -> 2, 2 -> 3 and 3 -> 2 possible.

What it leaves out: async saves, several hosts' local disks, re-planning units (the model and its
`units` must be the same), buffers and fsdp-flat's replicated frozen parameters in a sharded save
(the model's constructor rebuilds them),
fully_shard's DTensor format (torch.distributed.checkpoint does that: see `dcp_round_trip`).
"""

import os
import shutil
import uuid
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from labkit.strategies.checkpoint.files import (
    FORMAT,
    CheckpointError,
    commit,
    lock_root,
    read_verified,
    saving_dir,
    torch_bytes,
    write_durable,
    write_manifest,
)
from labkit.strategies.checkpoint.shards import (
    ADAM,
    check_strategy,
    cut,
    describe,
    entries,
    join,
    joined,
    named_from_whole,
    replicated,
    shard_shape,
    structure_differences,
)

# The points of save_sharded where a fault hook runs (see set_fault_hook); before_rename is rank 0's.
KILL_POINTS = ("before_write", "after_write", "before_marker", "before_rename")
_fault_hook = None


class AbandonSave(Exception):
    """Raised by a fault hook at "before_marker" on every rank: the save stops there, its rank
    files written and no manifest, as if the job had crashed (save_sharded returns the saving
    directory, which nothing ever loads)."""


def set_fault_hook(hook: Optional[Callable[[int, str], Any]]) -> Optional[Callable[[int, str], Any]]:
    """Install hook(rank, point), called on this rank at each of KILL_POINTS during
    save_sharded: what a fault campaign uses to kill a rank mid-save (SIGKILL, so none of the
    save's own cleanup runs) or abandon the save. None removes it; returns the previous hook.
    The save itself knows nothing of faults: this is its one instrumentation point."""
    global _fault_hook
    previous, _fault_hook = _fault_hook, hook
    return previous


def _step_dir(root, step):
    return os.path.join(root, f"step_{step:06d}")


def _padded(tensor, entry, world_size):
    """A shard or its optimizer state as this rank's padded rows (a DTensor's local rows padded;
    the per-parameter FSDP's parameters are DTensors, as fully_shard's)."""
    local = getattr(tensor, "_local_tensor", None)
    if local is None:
        return tensor
    want = shard_shape(entry.shape, world_size)
    if tuple(local.shape) == want:
        return local
    padded = local.new_zeros(want)
    padded[: local.shape[0]] = local.reshape(local.shape[0], *want[1:])
    return padded


def _assign(shard, padded):
    """Write this rank's padded rows into `shard` (a DTensor: its local rows)."""
    local = getattr(shard, "_local_tensor", None)
    if local is None:
        shard.copy_(padded)
    else:
        local.copy_(padded[: local.shape[0]].reshape(local.shape))


def _like(shard, padded):
    """`padded` (this rank's rows) as the optimizer state of `shard`: a DTensor if it is one."""
    local = getattr(shard, "_local_tensor", None)
    if local is None:
        return padded
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        padded[: local.shape[0]].reshape(local.shape).clone(),
        shard.device_mesh,
        shard.placements,
        run_check=False,
        shape=shard.shape,
        stride=shard.stride(),
    )


def _shard_state(entry, opt, rank, world_size):
    state = opt.state.get(entry.shard, {})
    out = {
        "shard": _padded(entry.shard, entry, world_size).detach().cpu().clone(),
        "shape": list(entry.shape),
        "offset": rank * shard_shape(entry.shape, world_size)[0],
        "adam_step": state.get("step"),
    }
    out.update(
        {k: _padded(state[k], entry, world_size).detach().cpu().clone() if k in state else None for k in ADAM}
    )
    return out


def _scaler_state(fsdp):
    # fp16's dynamic loss scale (scale, steps since the last overflow, skips) is training state too:
    # without it a resumed run scales its first losses differently. The same on every rank.
    scaler = getattr(fsdp, "scaler", None)
    return dict(vars(scaler)) if scaler is not None else None


def _at(rank, point):
    if _fault_hook is not None:
        _fault_hook(rank, point)


def _start_save(root, step):
    """Rank 0 makes a fresh, empty saving directory; every rank learns its path and the save id."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a whole number of steps done, >= 0, got {step!r}")
    final = _step_dir(root, step)
    info: list[Any] = [None, None, None]  # the temp folder, the save id, rank 0's error
    if dist.get_rank() == 0:
        try:
            lock_root(root)  # one writer per root (files.py)
        except CheckpointError as exc:
            info[2] = str(exc)
        else:
            tmp = saving_dir(final)
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier save of this step
            os.makedirs(tmp)
            info[:2] = [tmp, uuid.uuid4().hex]
    dist.broadcast_object_list(info, src=0)
    if info[2] is not None:  # every rank raises, none waits for a save that will not come
        raise CheckpointError(info[2])
    return final, info[0], info[1]


def _finish_save(tmp, final, entries_, manifest, faults=False):
    """Rank 0: manifest last, then the one rename that makes the save visible."""
    write_manifest(tmp, {**manifest, "format": FORMAT, "files": entries_})
    if faults:
        _at(0, "before_rename")
    commit(tmp, final)


def save_sharded(fsdp: Any, opt: torch.optim.Optimizer, root: str, step: int) -> str:
    """Every rank writes its shards and their AdamW state; rank 0 commits the save (see the module
    doc). `step` is the number of steps done (= the data position: batches are a function of
    step). Returns the step directory (the saving directory if a fault hook abandoned the save)."""
    check_strategy(fsdp)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    final, tmp, save_id = _start_save(root, step)
    _at(rank, "before_write")
    payload = {
        "save_id": save_id,
        "world_size": world_size,
        "rank": rank,
        "step": step,
        "rng": torch.get_rng_state(),
        "scaler": _scaler_state(fsdp),
        "tensors": {e.key: _shard_state(e, opt, rank, world_size) for e in entries(fsdp)},
    }
    entry = write_durable(os.path.join(tmp, f"rank{rank}.pt"), torch_bytes(payload))
    _at(rank, "after_write")
    files = [None] * world_size
    dist.all_gather_object(files, entry)  # returns only once every rank's file is on disk
    try:
        _at(rank, "before_marker")
    except AbandonSave:
        return tmp
    if rank == 0:
        _finish_save(
            tmp,
            final,
            {f"rank{r}.pt": e for r, e in enumerate(files)},
            {
                "step": step,
                "world_size": world_size,
                "save_id": save_id,
                "full": False,
                "structure": describe(fsdp, opt),
            },
            faults=True,
        )
    dist.barrier()  # no rank goes on (or reads the checkpoint) before it is committed
    return final


def _gather(tensor, entry):
    """The whole tensor from every rank's shard of it (a collective), padding dropped, on CPU."""
    tensor = _padded(tensor, entry, dist.get_world_size())
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor.detach().contiguous())
    return join(pieces, entry.shape).cpu()


def save_full(fsdp: Any, opt: torch.optim.Optimizer, root: str, step: int) -> str:
    """Rank 0 writes one file: every state_dict entry whole ("model", as fsdp.full_state_dict()
    gives it) and each parameter's whole AdamW state under its first name ("optimizer"). A
    collective: call it on every rank."""
    check_strategy(fsdp)
    model = {k: v.cpu() for k, v in fsdp.full_state_dict().items()}
    optimizer = {}
    for e in entries(fsdp):
        state = opt.state.get(e.shard)
        if not state:
            continue
        wholes = {k: named_from_whole(e, _gather(state[k], e)) for k in ADAM}
        for name in wholes["exp_avg"]:
            optimizer[name] = {"step": state["step"].clone(), **{k: wholes[k][name] for k in ADAM}}
    final, tmp, save_id = _start_save(root, step)
    if dist.get_rank() == 0:
        payload = {
            "save_id": save_id,
            "world_size": 1,
            "step": step,
            "rng": torch.get_rng_state(),
            "scaler": _scaler_state(fsdp),
            "model": model,
            "optimizer": optimizer,
            "full": True,
        }
        entry = write_durable(os.path.join(tmp, "full.pt"), torch_bytes(payload))
        _finish_save(
            tmp,
            final,
            {"full.pt": entry},
            {
                "step": step,
                "world_size": 1,
                "save_id": save_id,
                "full": True,
                "structure": describe(fsdp, opt),
            },
        )
    dist.barrier()
    return final


def load(fsdp: Any, opt: torch.optim.Optimizer, path: str) -> int:
    """Restore weights, AdamW state and RNG into `fsdp` / `opt` at the CURRENT world size; returns
    the step to continue from. Every rank reads and verifies every file (a shared file system is
    assumed), so every rank refuses alike: a CheckpointError saying what differs."""
    check_strategy(fsdp)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    manifest, payloads = read_verified(path)
    differences = structure_differences(manifest["structure"], describe(fsdp, opt), manifest["full"])
    if differences:
        raise CheckpointError(
            f"{path} was saved from another model or optimizer:\n  " + "\n  ".join(differences)
        )
    live = entries(fsdp)
    in_optimizer = {id(p) for group in opt.param_groups for p in group["params"]}
    if any(e.shard.requires_grad and id(e.shard) not in in_optimizer for e in live):
        raise CheckpointError(
            "the optimizer does not hold this model's shards (was it built "
            "before sharding?): nothing to restore the AdamW state into"
        )
    saved = joined(path, manifest, payloads, live)
    for e in live:
        state = saved[e.key]

        def mine(whole):
            return cut(whole, rank, world_size).to(device=e.shard.device, dtype=e.shard.dtype)

        with torch.no_grad():
            _assign(e.shard, mine(state["shard"]))
        if state["exp_avg"] is not None and e.shard.requires_grad:
            opt.state[e.shard] = {
                "step": state["adam_step"].clone(),
                **{k: _like(e.shard, mine(state[k])) for k in ADAM},
            }
    saved_file = payloads["full.pt" if manifest["full"] else "rank0.pt"]
    if manifest["full"]:  # fsdp-flat's replicated frozen parameters (a sharded save skips them)
        with torch.no_grad():
            for name, param in replicated(fsdp).items():
                param.copy_(saved_file["model"][name])
    scaler, saved_scaler = getattr(fsdp, "scaler", None), saved_file.get("scaler")
    if (scaler is None) != (saved_scaler is None):
        raise CheckpointError(
            f"{path}: fp16 loss scaling in the {'run' if scaler else 'checkpoint'}, "
            f"not in the {'checkpoint' if scaler else 'run'}: another mixed precision"
        )
    if scaler is not None:
        vars(scaler).update(saved_scaler)
    torch.set_rng_state(saved_file["rng"])
    return saved_file["step"]


def dcp_round_trip(model: torch.nn.Module, path: str) -> dict[str, torch.Tensor]:
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
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }
