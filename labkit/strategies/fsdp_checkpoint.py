"""Checkpoints of the hand-written FSDP, with nothing lost: weights, AdamW state, step, data
position and RNG state; sharded (each rank writes its shards) or full (rank 0 writes everything).

    save_sharded(fsdp, opt, root, step)         # root/step_000003/rank0.pt ... + COMPLETE
    path = latest_complete(root)                 # ignores a checkpoint whose save never finished
    step = load(fsdp, opt, path)                 # any world size: shards are re-cut on load

A save is complete only when rank 0 has written the COMPLETE marker, after a barrier that every
rank reaches once its own file is on disk (written to a temporary name, then renamed, so a crash
never leaves a half-written file under the real name). Loading reads every saved rank's file,
joins each unit's flat shards back into the unpadded buffer, and cuts it for the current world
size: that is what makes 4 -> 2 and 2 -> 4 possible.

What it leaves out: async saves, saving to several hosts' local disks, re-planning units (the
model and its `units` must be the same), fully_shard's DTensor format (torch.distributed.checkpoint
does that: see `dcp_round_trip`).
"""
import os

import torch
import torch.distributed as dist

from labkit.collectives import shard_range

MARKER = "COMPLETE"


def _step_dir(root, step):
    return os.path.join(root, f"step_{step:06d}")


def _unit_state(unit, opt):
    state = opt.state.get(unit.shard, {})
    return {"shard": unit.shard.detach().clone(),
            "exp_avg": state.get("exp_avg"), "exp_avg_sq": state.get("exp_avg_sq"),
            "adam_step": state.get("step"), "numel": unit.numel, "label": unit.label,
            "layout": unit.layout, "names": unit.names}


def save_sharded(fsdp, opt, root, step, crash_before_marker=False):
    """Every rank writes its shards and their AdamW state; rank 0 marks the save complete.
    `step` is the number of steps done (= the data position: batches are a function of step).
    crash_before_marker=True simulates a crash after the rank files, before the marker."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path = _step_dir(root, step)
    os.makedirs(path, exist_ok=True)
    payload = {"world_size": world_size, "rank": rank, "step": step,
               "rng": torch.get_rng_state(), "units": [_unit_state(u, opt) for u in fsdp.units]}
    tmp = os.path.join(path, f"rank{rank}.pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, os.path.join(path, f"rank{rank}.pt"))
    dist.barrier()   # every rank's file is on disk before the marker says so
    if crash_before_marker:
        return path
    if rank == 0:
        with open(os.path.join(path, MARKER), "w") as marker:
            marker.write(f"world_size={world_size} step={step}\n")
    dist.barrier()
    return path


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
    path = _step_dir(root, step)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        torch.save({"world_size": 1, "step": step, "rng": torch.get_rng_state(), "units": units,
                    "full": True}, os.path.join(path, "full.pt.tmp"))
        os.replace(os.path.join(path, "full.pt.tmp"), os.path.join(path, "full.pt"))
        with open(os.path.join(path, MARKER), "w") as marker:
            marker.write(f"full step={step}\n")
    dist.barrier()
    return path


def is_complete(path):
    return os.path.exists(os.path.join(path, MARKER))


def latest_complete(root):
    """The newest step directory that has its COMPLETE marker, or None."""
    if not os.path.isdir(root):
        return None
    steps = sorted((d for d in os.listdir(root) if d.startswith("step_")), reverse=True)
    return next((os.path.join(root, d) for d in steps if is_complete(os.path.join(root, d))), None)


def _read_units(path):
    """Per unit: the unpadded flat buffers (shard, exp_avg, exp_avg_sq) and the metadata."""
    if not is_complete(path):
        raise RuntimeError(f"{path} has no {MARKER} marker: its save did not finish; never load it "
                           f"(use latest_complete(root))")
    if os.path.exists(os.path.join(path, "full.pt")):
        saved = torch.load(os.path.join(path, "full.pt"), weights_only=False)
        return saved, saved["units"]
    first = torch.load(os.path.join(path, "rank0.pt"), weights_only=False)
    files = [first] + [torch.load(os.path.join(path, f"rank{r}.pt"), weights_only=False)
                       for r in range(1, first["world_size"])]
    units = []
    for i, meta in enumerate(first["units"]):
        joined = {k: v for k, v in meta.items() if not isinstance(v, torch.Tensor) or v.dim() == 0}
        for key in ("shard", "exp_avg", "exp_avg_sq"):
            if meta[key] is not None:
                joined[key] = torch.cat([f["units"][i][key] for f in files])[:meta["numel"]]
        units.append(joined)
    return first, units


def load(fsdp, opt, path):
    """Restore weights, AdamW state and RNG into `fsdp` / `opt` at the CURRENT world size; returns
    the step to continue from. Every rank reads the files (a shared file system is assumed)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    saved, units = _read_units(path)
    for unit, state in zip(fsdp.units, units):
        if state["numel"] != unit.numel or state["layout"] != unit.layout:
            raise ValueError(f"checkpoint unit {state['label']!r} ({state['numel']} elements) does not "
                             f"match this model's unit {unit.label!r} ({unit.numel}): same model and units?")
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


def train_resumable(total_steps, root, *, save_every=None, fmt="sharded", resume_from=None,
                    crash_save_at=None, batch_size=8, gpt_config=None):
    """Rank function: hand-written FSDP on TinyGPT (block units) for steps [start, total_steps),
    where start is 0 or the step of the checkpoint `resume_from` (a path, or "latest" = the newest
    complete one under root). Saves after every `save_every` steps in `fmt` ("sharded" / "full"),
    the save at step `crash_save_at` crashing before its marker. Returns {"start", "losses" (one
    per step run), "state"}."""
    from labkit.models import make_optimizer
    from labkit.strategies.ddp_run import LAB_EPS, build_model
    from labkit.strategies.fsdp import fully_shard_by_hand
    from labkit.strategies.fsdp_run import _one_step
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fsdp = fully_shard_by_hand(build_model("gpt", 0, gpt_config), units="block")
    opt = make_optimizer(list(fsdp.flat_shards), eps=LAB_EPS)
    start = 0
    if resume_from is not None:
        path = latest_complete(root) if resume_from == "latest" else resume_from
        start = load(fsdp, opt, path)
    losses = []
    for step in range(start, total_steps):
        _one_step("hand", fsdp, opt, step, rank, world_size, batch_size, 0, gpt_config, 1, True, None, losses)
        done = step + 1
        if save_every and done % save_every == 0:
            if fmt == "full":
                save_full(fsdp, opt, root, done)
            else:
                save_sharded(fsdp, opt, root, done, crash_before_marker=done == crash_save_at)
    return {"start": start, "losses": losses, "state": fsdp.full_state_dict()}


def train_fully_shard_and_round_trip(steps, path):
    """Rank function: fully_shard trains a few steps, then round-trips through DCP.
    Returns (full state before, full state read back)."""
    from labkit.strategies.fsdp_run import _full_state, _one_step, shard_with_torch
    from labkit.models import make_optimizer
    from labkit.strategies.ddp_run import LAB_EPS, build_model
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = shard_with_torch(build_model("gpt"))
    opt = make_optimizer(model.parameters(), eps=LAB_EPS)
    losses = []
    for step in range(steps):
        _one_step("torch", model, opt, step, rank, world_size, 8, 0, None, 1, True, None, losses)
    before = _full_state("torch", model)
    return before, dcp_round_trip(model, path)
