"""Execute labs headless with nbclient, as `jupyter nbconvert --execute`, papermill and nbgrader
do, with live widgets (a person's LABKIT_OUTPUT=live), and report any cell that waited for its
timeout (the stall of issue 28) or any error. Run it beside CPU hogs to see a busy classroom:

    python scripts/with_hogs.py 4 -- .venv/bin/python scripts/headless_labs.py notebooks/hsdp_lab.ipynb --repeat 3

Prints one line per run (slowest cell, errors, the lines a lab prints that --grep matches) and
exits 1 if any cell waited past half its timeout or raised.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time

import nbclient
import nbformat


def run_once(path: str, timeout: int, grep: str | None) -> tuple[bool, str]:
    nb = nbformat.read(path, as_version=4)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_CURRENT_TEST")}
    env.update(LABKIT_OUTPUT="live", MPLBACKEND="module://matplotlib_inline.backend_inline")
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="labkit", allow_errors=True)
    waits: list[tuple[float, int]] = []
    sent: list[str] = []

    async def go() -> None:
        async with client.async_setup_kernel(env=env):
            send = client.kc.shell_channel.send

            def counting(msg: dict) -> None:
                sent.append(msg["header"]["msg_type"])
                send(msg)

            client.kc.shell_channel.send = counting
            for index, cell in enumerate(client.nb.cells):
                start = time.monotonic()
                await client.async_execute_cell(cell, index, execution_count=index + 1)
                waits.append((time.monotonic() - start, index))

    start = time.monotonic()
    asyncio.run(go())
    errors = [
        (i, o.get("ename"), o.get("evalue", "")[:200])
        for i, c in enumerate(nb.cells)
        for o in c.get("outputs", [])
        if o.get("output_type") == "error" and "raises-exception" not in c.get("metadata", {}).get("tags", [])
    ]  # a cell tagged raises-exception shows an error on purpose (nbval's convention)
    slowest, at = max(waits)
    stalled = [i for w, i in waits if w > timeout / 2]
    others = sorted(set(sent) - {"execute_request", "kernel_info_request"})
    lines = []
    if grep:
        for c in nb.cells:
            for o in c.get("outputs", []):
                text = o.get("text", "") if o.get("output_type") == "stream" else ""
                lines += [ln for ln in text.splitlines() if re.search(grep, ln)]
    load = os.getloadavg()[0]
    ok = not errors and not stalled and not others
    report = (
        f"{os.path.basename(path)}: {'ok' if ok else 'FAILED'} in {time.monotonic() - start:.0f} s, "
        f"load {load:.1f}; slowest cell {at} ({slowest:.0f} s of timeout {timeout} s); "
        f"stalled {stalled}; shell sends besides execute_request {others}; errors {errors}"
    )
    return ok, "\n".join([report, *("    " + ln for ln in lines)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="+")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=600, help="nbclient's per-cell timeout, s")
    ap.add_argument("--grep", help="print the lab's output lines that match this regex")
    args = ap.parse_args(argv)
    good = True
    for path in args.notebooks:
        for _ in range(args.repeat):
            ok, report = run_once(path, args.timeout, args.grep)
            print(report, flush=True)
            good &= ok
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
