"""Run `make test`'s stages and print a table of their times at the end.

    python scripts/stages.py lint 'unit&' nbval grade-executed browser

Each stage is `make <stage>` (command-line variables such as LABKIT_STRESS reach it through
MAKEFLAGS), run one after another. A stage written with a trailing `&` starts in the background
and runs beside the stages after it (its output goes to build/logs/<stage>.log and is printed
when it ends): `make test` runs pytest beside the notebooks, because each leaves about a fifth of
a 2-core machine idle (ranks waiting on each other, kernels starting, the browser rendering), and
every stage is built to pass on a busy machine (`make test-busy`).

`make install` runs first, once: the stages then skip re-registering the course kernel
(LABKIT_KERNEL_REGISTERED=1), which would take it away for a moment from a kernel starting in a
stage beside. It stops at the first stage that fails, like make (a background stage still
running is stopped, and its log printed), and still prints the table, with the failed stage
marked. The table gives each stage's wall time and its CPU time (its processes' and the
descendants' they waited for, from wait4): on a busy machine the wall time grows with the load
while the CPU time barely does. A lower bound: ranks whose parent (a multiprocessing
forkserver) is never waited for are not counted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Optional

LOGS = os.path.join("build", "logs")


@dataclass
class Stage:
    name: str
    background: bool
    proc: Optional[subprocess.Popen] = None
    log: Optional[IO[str]] = None
    start: float = 0.0
    wall: float = 0.0
    cpu: float = 0.0
    rc: Optional[int] = None
    beside: list[str] = field(default_factory=list)

    @property
    def log_path(self) -> str:
        return os.path.join(LOGS, self.name + ".log")


def parse(args: list[str]) -> list[Stage]:
    stages = []
    for arg in args:
        name = arg[:-1] if arg.endswith("&") else arg
        if not name or name.startswith("-") or "&" in name:
            raise SystemExit(
                f"stages.py: not a stage name: {arg!r} (a name, or a name& to run it beside the rest)"
            )
        stages.append(Stage(name, arg.endswith("&")))
    return stages


def start(stage: Stage, env: dict) -> None:
    make = os.environ.get("MAKE", "make")
    stage.start = time.perf_counter()
    if stage.background:
        os.makedirs(LOGS, exist_ok=True)
        stage.log = open(stage.log_path, "w")
        print(f"stages: {stage.name} runs beside the next stages; its output: {stage.log_path}", flush=True)
    stage.proc = subprocess.Popen(
        [make, "--no-print-directory", stage.name],
        env=env,
        stdout=stage.log,
        stderr=subprocess.STDOUT if stage.log else None,
        start_new_session=stage.background,  # its own process group: stopped as a whole
    )


def reap(stage: Stage, block: bool) -> bool:
    """Collect the stage's exit status and CPU time; False if it is still running (block=False)."""
    assert stage.proc is not None
    if stage.rc is not None:
        return True
    pid, status, usage = os.wait4(stage.proc.pid, 0 if block else os.WNOHANG)
    if pid == 0:
        return False
    stage.proc.returncode = stage.rc = os.waitstatus_to_exitcode(status)
    stage.wall = time.perf_counter() - stage.start
    stage.cpu = usage.ru_utime + usage.ru_stime
    if stage.log is not None:
        stage.log.close()
        with open(stage.log_path) as f:
            print(
                f"\n---- {stage.name} (ran beside {', '.join(stage.beside) or 'nothing'}): {stage.log_path} ----"
            )
            sys.stdout.write(f.read())
            print(f"---- end of {stage.name}'s output ----\n", flush=True)
    return True


def stop(stage: Stage) -> None:
    """A background stage still running when the run ends early: its whole process group."""
    assert stage.proc is not None
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(stage.proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.time() + wait
        while time.time() < deadline and not reap(stage, block=False):
            time.sleep(0.2)
        if stage.rc is not None:
            break
    reap(stage, block=True)


def result(stage: Stage) -> str:
    if stage.rc is None:
        return "not finished"
    return "ok" if stage.rc == 0 else f"FAILED ({stage.rc})"


def main(args: list[str]) -> int:
    stages = parse(args)
    env = dict(os.environ)
    started = time.perf_counter()
    rc = subprocess.call([os.environ.get("MAKE", "make"), "--no-print-directory", "install"])
    env["LABKIT_KERNEL_REGISTERED"] = "1"
    ran: list[Stage] = []
    background: list[Stage] = []
    try:
        for stage in stages if rc == 0 else []:
            start(stage, env)
            ran.append(stage)
            if stage.background:
                background.append(stage)
                continue
            for other in background:
                if other.rc is None:
                    other.beside.append(stage.name)
            reap(stage, block=True)
            done = [b for b in background if reap(b, block=False)]
            if stage.rc or any(b.rc for b in done):
                break
        for stage in background:
            if stage.rc is None and all(s.rc == 0 for s in ran if s.rc is not None):
                reap(stage, block=True)  # every stage so far passed: wait for it
    finally:
        for stage in background:
            if stage.rc is None:
                stop(stage)
    total = time.perf_counter() - started
    load = os.getloadavg()
    print("\nmake test, stage by stage:")
    print(
        f"  {'stage':<16}{'wall s':>8}{'CPU s':>8}  result   (CPU s: waited-for processes only, a lower bound)"
    )
    for stage in ran:
        beside = f" (beside {', '.join(stage.beside)})" if stage.background else ""
        print(f"  {stage.name:<16}{stage.wall:>8.0f}{stage.cpu:>8.0f}  {result(stage)}{beside}")
    if rc:
        print(f"  make install FAILED ({rc})")
    skipped = [s.name for s in stages[len(ran) :]]
    if skipped:
        print(f"  not run: {' '.join(skipped)}")
    print(
        f"  {'total':<16}{total:>8.0f}{sum(s.cpu for s in ran):>8.0f}  load average at the end {load[0]:.1f}"
    )
    return rc or next((s.rc for s in ran if s.rc), 0) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
