"""Run `make test`'s stages and print a table of their times at the end.

    python scripts/stages.py lint unit nbval grade browser
    python scripts/stages.py lint+unit+browser nbval grade-executed

Each stage is `make <stage>` (command-line variables such as LABKIT_STRESS reach it through
MAKEFLAGS). Stages joined by `+` run side by side, and the next argument starts when all of them
have ended: the first one's output streams as it comes, each other one's goes to
build/stages/<stage>.log and is printed, whole, when the group has ended (two streams line by
line would be unreadable). `make test` runs the browser test, the lint and nbval over the untimed
labs beside pytest: alone, the browser stage waits on JupyterLab, Chromium and kernel start-ups
for about 40% of its time, and pytest's two workers on waits of their own (fail-fast peers,
killed ranks) for 16%; side by side they keep both cores busy.

It stops at the first argument with a failed stage, like make, and still prints the table, with
the failed stage marked. The table gives each stage's wall time and the CPU time of its processes
that were reaped (children's user + system time, from wait4): on a busy machine the wall time
grows with the load while the CPU time barely does. It is a lower bound: ranks whose parent (a
multiprocessing forkserver) is never waited for are not counted.

The sub-makes get LABKIT_STAGE=1: `make test` has installed and registered the kernel once
before the stages, and stages side by side must not install or register it at the same moment.
"""

import os
import subprocess
import sys
import time

LOGS = os.path.join("build", "stages")


def cpu_seconds(usage) -> float:
    return usage.ru_utime + usage.ru_stime


def run_group(make: str, group: list[str]) -> list[tuple]:
    """Run `group`'s stages side by side; [(stage, wall s, CPU s, result)] in the group's order."""
    env = dict(os.environ, LABKIT_STAGE="1")
    procs, logs, start = {}, {}, {}
    for i, stage in enumerate(group):
        out = None
        if i:
            os.makedirs(LOGS, exist_ok=True)
            logs[stage] = os.path.join(LOGS, stage + ".log")
            out = open(logs[stage], "w")
            print(
                f"[{stage}: runs beside {group[0]}; its output follows when it ends ({logs[stage]})]",
                flush=True,
            )
        start[stage] = time.perf_counter()
        procs[stage] = subprocess.Popen(
            [make, "--no-print-directory", stage],
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env=env,
        )
        if out is not None:
            out.close()  # the child holds its own copy
    done: dict = {}
    while len(done) < len(group):
        for stage, proc in procs.items():
            if stage in done:
                continue
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == 0:
                continue
            proc.returncode = os.waitstatus_to_exitcode(status)
            rc = proc.returncode
            wall = time.perf_counter() - start[stage]
            done[stage] = (stage, wall, cpu_seconds(usage), "ok" if rc == 0 else f"FAILED ({rc})")
        time.sleep(0.2)
    for stage, path in logs.items():
        print(f"\n[{stage}: its output ({done[stage][1]:.0f} s, beside {group[0]}), from {path}]", flush=True)
        with open(path) as f:
            sys.stdout.write(f.read())
        print(f"[{stage}: end of its output]", flush=True)
    return [done[stage] for stage in group]


def main(args: list[str]) -> int:
    make = os.environ.get("MAKE", "make")
    groups = [[s for s in arg.split("+") if s] for arg in args]
    ran: list[list[tuple]] = []
    total_start = time.perf_counter()
    for group in groups:
        ran.append(run_group(make, group))
        if any(r[3] != "ok" for r in ran[-1]):
            break
    total = time.perf_counter() - total_start
    load = os.getloadavg()
    print("\nmake test, stage by stage:")
    print(f"  {'stage':<16}{'wall s':>8}{'CPU s':>8}  result   (CPU s: reaped processes only, a lower bound)")
    for rows in ran:
        for stage, wall, cpu, result in rows:
            beside = ", ".join(r[0] for r in rows if r[0] != stage)
            print(f"  {stage:<16}{wall:>8.0f}{cpu:>8.0f}  {result}{f'  (beside {beside})' if beside else ''}")
    skipped = args[len(ran) :]
    if skipped:
        print(f"  not run: {' '.join(skipped)}")
    cpu = sum(r[2] for rows in ran for r in rows)
    print(f"  {'total':<16}{total:>8.0f}{cpu:>8.0f}  load average at the end {load[0]:.1f}")
    return 1 if any(r[3] != "ok" for rows in ran for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
