"""Fault case for a campaign (benchmarks/faults.py imports it): kill one rank of a sharded
checkpoint save that overwrites a complete checkpoint, then check what a resume would load.

    from _checkpoint_faults import fault_case_kill_mid_save
    fault_case_kill_mid_save(trials=10, world_size=2, resume=True, seed=0, strategy="fsdp") -> dict(
        trials=10,            # trials run
        held=10,              # trials after which the checkpoint held (below)
        median_s=0.9,         # median wall seconds of one trial (killed save + checks + resume)
        outcomes={"old": 8, "new": 2},          # which whole checkpoint survived
        by_point={"rank1:after_write": [2, 2], ...},   # point -> [held, trials]
        failures=["rank1:after_write: a mix of old and new files", ...])

    .venv/bin/python benchmarks/_checkpoint_faults.py --trials 10     # the dict as JSON
    .venv/bin/python benchmarks/_checkpoint_faults.py --strategy fsdp-flat

`strategy`: the hand-written FSDP that trains and saves: "fsdp" (the per-parameter reference,
whose files hold each parameter's dim-0 shard) or "fsdp-flat" (a flat buffer per unit).

One trial: a fresh root holding a complete step-3 checkpoint (2 ranks, batch 8) is re-saved at
step 3 by a different run (batch 4, so every new file differs), with rank r SIGKILLed at a point
of save_sharded (labkit.strategies.checkpoint.KILL_POINTS), points and ranks taken in turn
(shuffled with `seed`). It held if: the killed run failed, latest_complete(root) is step 3, every
file verifies against its manifest, the files are all old or all new, the old ones when the kill
came before every rank had reported its file, and (resume=True) resuming from "latest" gives
exactly the losses of resuming from that whole checkpoint. The resume is run for the first trial
that leaves each checkpoint; a later one whose verified manifest (every file's SHA-256, the save
id) is that of a checkpoint already resumed is that checkpoint, and is not trained again.
"""

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import labkit
from labkit.labs.checkpoint_runs import train_resumable
from labkit.strategies.checkpoint import KILL_POINTS, CheckpointError, latest_complete, verify

TOTAL, STEP = 6, 3


def _kill_cases(world_size):
    # A rank other than 0 never reaches a rename; it reaches the other points.
    return [(r, p) for r in range(world_size) for p in KILL_POINTS if r == 0 or p != "before_rename"]


def _old_must_survive(rank, point):
    # Before all files are reported nothing may commit; rank 0 dying stops the commit too. Another
    # rank dying after it reported its file leaves rank 0 free to commit the whole new save.
    return point in ("before_write", "after_write") or rank == 0


def _resumed_losses(root, strategy, world_size):
    """The losses of a run resumed from root's newest complete checkpoint, to step TOTAL."""
    run = labkit.run(
        train_resumable,
        TOTAL,
        root,
        resume_from="latest",
        strategy=strategy,
        world_size=world_size,
        timeout=120,
    )
    return run[0]["losses"]


def _reference(workdir, world_size, batch_size, strategy):
    """A clean step-3 checkpoint of one run and the losses of resuming from it."""
    root = tempfile.mkdtemp(dir=workdir)
    labkit.run(
        train_resumable,
        STEP,
        root,
        save_every=STEP,
        batch_size=batch_size,
        strategy=strategy,
        world_size=world_size,
        timeout=120,
    )
    resumed = _resumed_losses(root, strategy, world_size)
    return root, verify(os.path.join(root, f"step_{STEP:06d}")), resumed


def _trial(base, old, refs, kill, world_size, resume, workdir, strategy, resumed):
    """The outcome ("old" or "new") if the checkpoint held after this kill, else why not.
    `resumed`: {manifest: outcome} of checkpoints whose resume was checked."""
    root = tempfile.mkdtemp(dir=workdir)
    path = os.path.join(root, f"step_{STEP:06d}")
    shutil.copytree(os.path.join(base, f"step_{STEP:06d}"), path)
    try:
        labkit.run(
            train_resumable,
            STEP,
            root,
            save_every=STEP,
            batch_size=4,
            kill_at=kill,
            strategy=strategy,
            world_size=world_size,
            timeout=60,
        )
        return "the killed save finished (the kill point was never reached)"
    except labkit.RankError:
        pass
    if latest_complete(root) != path:
        return f"latest_complete is {latest_complete(root)}, not {path}"
    try:
        now = verify(path)
    except CheckpointError as exc:
        return f"latest_complete returned a checkpoint that does not verify: {exc}"
    kept = [now["files"][n]["sha256"] == e["sha256"] for n, e in old["files"].items()]
    if any(kept) and not all(kept):
        return f"a mix of old and new files: {kept}"
    outcome = "old" if all(kept) else "new"
    if outcome == "new" and _old_must_survive(*kill):
        return "the save committed although it was killed before every file was reported"
    manifest = json.dumps(now, sort_keys=True, default=str)  # every file's sha256, the save id
    if resume and resumed.get(manifest) != outcome:
        losses = _resumed_losses(root, strategy, world_size)
        if losses != refs[outcome]:
            return f"resumed losses {losses} differ from the {outcome} checkpoint's {refs[outcome]}"
        resumed[manifest] = outcome
    shutil.rmtree(root, ignore_errors=True)
    return outcome


def fault_case_kill_mid_save(trials, world_size=2, resume=True, seed=0, strategy="fsdp"):
    """Run `trials` kill-mid-save trials; returns dict(trials, held, median_s, outcomes,
    by_point, failures) as described in the module docstring."""
    workdir = tempfile.mkdtemp(prefix="ckpt_faults_")
    try:
        base, old, old_losses = _reference(workdir, world_size, 8, strategy)
        _, _, new_losses = _reference(workdir, world_size, 4, strategy)
        refs = {"old": old_losses, "new": new_losses}
        cases = _kill_cases(world_size)
        random.Random(seed).shuffle(cases)
        held, times, outcomes, by_point, failures, resumed = 0, [], {"old": 0, "new": 0}, {}, [], {}
        for i in range(trials):
            kill = cases[i % len(cases)]
            name = f"rank{kill[0]}:{kill[1]}"
            start = time.perf_counter()
            result = _trial(base, old, refs, kill, world_size, resume, workdir, strategy, resumed)
            times.append(time.perf_counter() - start)
            ok = result in outcomes
            held += ok
            counts = by_point.setdefault(name, [0, 0])
            counts[0], counts[1] = counts[0] + ok, counts[1] + 1
            if ok:
                outcomes[result] += 1
            else:
                failures.append(f"{name}: {result}")
        return dict(
            trials=trials,
            held=held,
            median_s=statistics.median(times) if times else 0.0,
            outcomes=outcomes,
            by_point=by_point,
            failures=failures,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", default="fsdp", choices=("fsdp", "fsdp-flat"))
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds the JSON alone (labkit's notes)
        result = fault_case_kill_mid_save(
            args.trials, args.world_size, not args.no_resume, args.seed, args.strategy
        )
    print(json.dumps(result, indent=1))
