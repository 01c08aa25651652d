"""Run a command with N CPU hogs beside it, the way a shared JupyterHub server or a CI runner
with neighbours loads the machine; the hogs stop when the command ends, however it ends.

    python scripts/with_hogs.py 2 -- make nbval        # what `make test-busy` does per stage
    LABKIT_STRESS=2 make test                           # every stage of make test under 2 hogs

Each hog is a busy Python loop that also exits by itself once this script is gone (it watches
its parent), so a killed run never leaves a hog behind. The exit status is the command's.
"""

from __future__ import annotations

import signal
import subprocess
import sys

HOG = (
    "import os\n"
    "parent = os.getppid()\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(200000):\n"
    "        pass\n"
)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: with_hogs.py N -- command [args...]", file=sys.stderr)
        return 2
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(int(argv[0]))]
    print(f"with_hogs: {len(hogs)} CPU hogs beside: {' '.join(argv[2:])}", file=sys.stderr, flush=True)

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        return subprocess.call(argv[2:])
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
