"""A bounded fault campaign: each case N trials, made the way faults happen, and whether
labkit's promise held in each.

    python benchmarks/faults.py [--trials 20] [--torchrun-trials 50] [--interrupt-trials 50]
                                [--only death,interrupt,torchrun,checkpoint,mismatch,misuse] [--json]

Cases (held = the promise in brackets was kept in that trial):
- death/<how>/<where>: rank 1 segfaults, calls os._exit(3), or is SIGKILLed, while rank 0 is in a
  collective with it or busy outside one [the error's first line names rank 1 and how it died
  (SIGSEGV / exit code 3 / SIGKILL), within 2 s]
- interrupt/<N> ranks: SIGINT 0.02-0.6 s into a launch [KeyboardInterrupt reaches the caller,
  no rank alive 5 s later]
- torchrun/2 ranks: a correct 2-rank run under torchrun [exit 0, right result: no SIGABRT at exit]
- checkpoint/kill mid-save: a rank SIGKILLed at a point of a save over a complete checkpoint
  [what loads is one whole verified checkpoint, never a mix]
- mismatch/<case>: ranks calling different hand-written collectives [an error naming each rank's
  call, within 2 s]
- misuse/<case>: a new user's mistakes off the course's paths (benchmarks/_misuse_faults.py lists
  them) [PyTorch's behaviour, or an error naming the mistake; never a silent wrong answer]

Prints `case | trials | held | median s`; `--json` prints {case: {trials, held, median_s}}.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch_faults as launch_faults  # noqa: E402


def _row(outcomes):
    return {
        "trials": len(outcomes),
        "held": sum(1 for o in outcomes if o[0]),
        "median_s": round(statistics.median(o[1] for o in outcomes), 3) if outcomes else None,
        "failures": sorted({o[2] for o in outcomes if not o[0]})[:3],
    }


def _warm_forkserver():
    import labkit

    labkit.run(launch_faults._sleep, 0, world_size=2)  # a warm forkserver, as in a kernel


def _campaign(label, module, *names):
    """`yield from` it: the names from benchmarks/<module>.py with the forkserver warm, or None
    after one "not available" row (faults.py runs on older checkouts too, for before/after rows)."""
    import importlib

    try:
        found = importlib.import_module(module)
        picked = [getattr(found, name) for name in names]
    except (ImportError, AttributeError) as exc:
        yield label, [(False, 0.0, f"not available: {exc}")]
        return None
    _warm_forkserver()
    return picked


def death_cases(trials, timeout=20):
    _warm_forkserver()
    for how in ("segfault", "exit3", "sigkill"):
        for where in ("in_collective", "outside"):
            yield (
                f"death/{how}/{where}",
                [launch_faults.death_trial(how, where, timeout) for _ in range(trials)],
            )


def interrupt_cases(trials):
    for n in (2, 8, 16):
        yield f"interrupt/{n} ranks", launch_faults.interrupt_campaign(n, trials, seed=n)


def torchrun_cases(trials):
    with tempfile.TemporaryDirectory() as d:
        yield "torchrun/2 ranks", [launch_faults.torchrun_trial(d) for _ in range(trials)]


def checkpoint_cases(trials):
    got = yield from _campaign("checkpoint/kill mid-save", "_checkpoint_faults", "fault_case_kill_mid_save")
    if got is None:
        return
    r = got[0](trials=trials, world_size=2, resume=True)
    yield (
        "checkpoint/kill mid-save",
        (
            [(True, r["median_s"], "")] * r["held"]
            + [(False, r["median_s"], f) for f in r["failures"]]
            + [(False, r["median_s"], "?")] * max(0, r["trials"] - r["held"] - len(r["failures"]))
        ),
    )


def mismatch_cases(trials):
    got = yield from _campaign("mismatch", "_collective_faults", "mismatch_trial", "MISMATCH_CASES")
    if got is None:
        return
    trial, cases = got
    for case in cases:
        yield f"mismatch/{case}", [trial(case) for _ in range(trials)]


def misuse_cases(trials):
    got = yield from _campaign("misuse", "_misuse_faults", "misuse_trial")
    if got is None:
        return
    runs = [got[0]() for _ in range(trials)]
    for case in runs[0]:
        yield f"misuse/{case}", [run[case] for run in runs]


CASES = {
    "death": death_cases,
    "interrupt": interrupt_cases,
    "torchrun": torchrun_cases,
    "checkpoint": checkpoint_cases,
    "mismatch": mismatch_cases,
    "misuse": misuse_cases,
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20, help="per death/checkpoint/mismatch/misuse case")
    ap.add_argument("--torchrun-trials", type=int, default=50)
    ap.add_argument("--interrupt-trials", type=int, default=50, help="per world size")
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument(
        "--death-timeout",
        type=float,
        default=20,
        help="labkit.run's timeout in the death cases (a report must come in 2 s)",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    counts = {"torchrun": a.torchrun_trials, "interrupt": a.interrupt_trials}
    rows = {}
    if not a.json:
        print(f"{'case':32s} | trials | held | median s")
    for kind in a.only.split(","):
        args = (a.death_timeout,) if kind == "death" else ()
        for case, outcomes in CASES[kind](counts.get(kind, a.trials), *args):
            rows[case] = _row(outcomes)
            if not a.json:
                r = rows[case]
                print(
                    f"{case:32s} | {r['trials']:6d} | {r['held']:4d} | {r['median_s']}"
                    + (f"   e.g. {r['failures'][0]}" if r["failures"] else ""),
                    flush=True,
                )
    if a.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
