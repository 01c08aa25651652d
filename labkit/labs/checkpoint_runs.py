"""Training runs that save and resume FSDP checkpoints: the fsdp_lab's, the tests' and the fault
campaign's rank functions, on top of labkit.loop and labkit.strategies.checkpoint.

    labkit.run(train_resumable, 6, root, save_every=3, world_size=2)          # saves at 3 and 6
    labkit.run(train_resumable, 6, root, resume_from="latest", world_size=4)  # continues at 3

Faults are injected from here, through the checkpoint module's one hook (set_fault_hook):
`crash_save_at` abandons one save before its manifest, `kill_at=(rank, point)` SIGKILLs a rank at
a point of save_sharded. The checkpoint code itself has no fault switches.
"""

import atexit
import os
import shutil
import signal
import tempfile

from labkit import loop, strategies
from labkit.strategies.checkpoint import (
    AbandonSave,
    dcp_round_trip,
    load,
    resolve,
    save_full,
    save_sharded,
    set_fault_hook,
)
from labkit.strategies.checkpoint.files import read_manifest


def scratch_dir(name: str) -> str:
    """An empty folder for this kernel's checkpoints, `<temp dir>/labkit_<name>_<pid>`: emptied
    on each call (a cell run twice starts clean), removed when the kernel exits, one per kernel (a
    learner's two notebooks, or nbval beside the browser test, never share one)."""
    path = os.path.join(tempfile.gettempdir(), f"labkit_{name}_{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    atexit.register(shutil.rmtree, path, True)
    return path


class Resumed(strategies.Strategy):
    """loop.train's strategy: `base` ("fsdp" or "fsdp-flat") built as the loop builds it (the
    preset's optimizer over the shards), then restored from the checkpoint at `resume_from` (a
    path; None: from scratch). A factory: from_preset returns the base's instance."""

    @classmethod
    def from_preset(cls, model, cfg, base="fsdp", resume_from=None, **options):
        fsdp = strategies.build(base, model, cfg, **options)
        if resume_from is not None:
            load(fsdp, fsdp.optimizer, resume_from)
        return fsdp


def _faults(crash, kill_at):
    """The fault hook of one save: abandon it before the manifest (`crash`), and/or SIGKILL the
    rank kill_at[0] at point kill_at[1] (not an exception: nothing of the save's cleanup runs)."""

    def hook(rank, point):
        if kill_at is not None and tuple(kill_at) == (rank, point):
            os.kill(os.getpid(), signal.SIGKILL)
        if crash and point == "before_marker":
            raise AbandonSave

    return hook


def _saver(root, save_every, fmt, crash_save_at, kill_at):
    """loop.train's after_step: a checkpoint after every `save_every` steps."""

    def after_step(fsdp, done):
        if not save_every or done % save_every:
            return
        if fmt == "full":
            save_full(fsdp, fsdp.optimizer, root, done)
            return
        previous = set_fault_hook(_faults(done == crash_save_at, kill_at))
        try:
            save_sharded(fsdp, fsdp.optimizer, root, done)
        finally:
            set_fault_hook(previous)

    return after_step


def train_resumable(
    total_steps,
    root,
    *,
    save_every=None,
    fmt="sharded",
    resume_from=None,
    crash_save_at=None,
    kill_at=None,
    **run,
):
    """Rank function: loop.train of the run `run` describes (see run_config: strategy "fsdp" or
    "fsdp-flat", preset, batch_size, gpt_config, mp) for steps [start, total_steps), where start
    is 0 or the step of the checkpoint `resume_from` (a path, or "latest" = the newest complete one
    under root; CheckpointError if there is none, or if it does not verify). Saves after every
    `save_every` steps in `fmt` ("sharded" / "full"), the save at step `crash_save_at` crashing
    before its marker, or, with kill_at=(rank, point), that rank SIGKILLed at that point of the
    first save (see save_sharded). Returns {"start", "losses" (one per step run), "state"}."""
    strategy, cfg = run_config(**run)
    path = resolve(root, resume_from) if resume_from is not None else None
    # The data position must be known before the loop starts; load() re-reads it, verified.
    start = read_manifest(path)["step"] if path is not None else 0
    hooks = loop.Hooks(first_step=start, after_step=_saver(root, save_every, fmt, crash_save_at, kill_at))
    out = loop.train(
        Resumed, cfg, total_steps - start, spans=False, hooks=hooks, base=strategy, resume_from=path
    )
    return {"start": start, "losses": out["losses"], "state": out["state"]}


def run_config(strategy="fsdp", preset="fsdp", batch_size=8, gpt_config=None, mp=None):
    """(strategy, preset) of a resumable run: PRESETS[preset] with `batch_size`, `gpt_config`
    overriding its TinyGPT fields and `mp` (a MixedPrecision) replacing its policy. Any other
    keyword is a TypeError, as for any function."""
    base = loop.PRESETS[preset]
    return strategy, base.replace(
        batch_size=batch_size, gpt={**base.gpt, **(gpt_config or {})}, mp=mp or base.mp
    )


def train_fully_shard_and_round_trip(steps, path):
    """Rank function: loop.train with fully_shard ("torch-fsdp"), then its model round-trips
    through DCP. Returns (full state before, full state read back)."""
    out = loop.train(
        "torch-fsdp",
        loop.PRESETS["fsdp"],
        steps,
        spans=False,
        hooks=loop.Hooks(report=lambda s: {"model": s.model}),
    )
    return out["state"], dcp_round_trip(out["model"], path)
