"""Run `make test`'s stages one after another and print a table of their times at the end.

    python scripts/stages.py lint unit nbval grade browser

Each stage is `make <stage>` (command-line variables such as LABKIT_STRESS reach it through
MAKEFLAGS). It stops at the first stage that fails, like make, and still prints the table, with
the failed stage marked. The table gives each stage's wall time and the CPU time of its processes
that were reaped (children's user + system time, from getrusage): on a busy machine the wall time
grows with the load while the CPU time barely does. It is a lower bound: ranks whose parent (a
multiprocessing forkserver) is never waited for are not counted.
"""

import os
import resource
import subprocess
import sys
import time


def cpu_seconds() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def main(stages: list[str]) -> int:
    make = os.environ.get("MAKE", "make")
    rows, rc = [], 0
    start = time.perf_counter()
    for stage in stages:
        t0, c0 = time.perf_counter(), cpu_seconds()
        rc = subprocess.call([make, "--no-print-directory", stage])
        rows.append(
            (stage, time.perf_counter() - t0, cpu_seconds() - c0, "ok" if rc == 0 else f"FAILED ({rc})")
        )
        if rc:
            break
    total = time.perf_counter() - start
    load = os.getloadavg()
    print("\nmake test, stage by stage:")
    print(f"  {'stage':<16}{'wall s':>8}{'CPU s':>8}  result   (CPU s: reaped processes only, a lower bound)")
    for stage, wall, cpu, result in rows:
        print(f"  {stage:<16}{wall:>8.0f}{cpu:>8.0f}  {result}")
    skipped = stages[len(rows) :]
    if skipped:
        print(f"  not run: {' '.join(skipped)}")
    print(
        f"  {'total':<16}{total:>8.0f}{sum(r[2] for r in rows):>8.0f}  load average at the end {load[0]:.1f}"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
