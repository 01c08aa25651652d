"""Run `make test`'s stages one after another and print a table of their times at the end.

    python scripts/stages.py lint unit nbval grade browser

Each stage is `make <stage>` (command-line variables such as LABKIT_STRESS reach it through
MAKEFLAGS). It stops at the first stage that fails, like make, and still prints the table, with
the failed stage marked. The table gives each stage's wall time and the CPU time its processes
used (children's user + system time, from getrusage): on a busy machine the wall time grows with
the load while the CPU time barely does, so the two together tell a slow stage from a slow machine.
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
    print(f"  {'stage':<10}{'wall s':>9}{'CPU s':>9}  result")
    for stage, wall, cpu, result in rows:
        print(f"  {stage:<10}{wall:>9.0f}{cpu:>9.0f}  {result}")
    skipped = stages[len(rows) :]
    if skipped:
        print(f"  not run: {' '.join(skipped)}")
    print(
        f"  {'total':<10}{total:>9.0f}{sum(r[2] for r in rows):>9.0f}  load average at the end {load[0]:.1f}"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
