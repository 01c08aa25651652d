"""Launch cost: labkit.run vs torch.multiprocessing.spawn, side by side in one run.

Each launch starts `world_size` gloo ranks that do one all_reduce and return. Prints the first
(cold) launch and the median of the warm ones; `--json` prints the same figures as JSON.

The classroom case (`--class-kernels K`, 0 to skip): K fresh Python processes, each what one
learner's notebook kernel is (it imports labkit as a Jupyter kernel would, which starts the torch
forkserver, and launches once to warm it up), measure their idle memory, then all launch 2 ranks
`--class-launches` times at the same moment. Reported: median and max launch time over all of
them, failed launches, the idle kernel's memory (the process + its forkserver and resource
tracker; PSS splits the pages the K kernels share, RSS counts them in every kernel) and one
rank's PSS while it runs.

    python benchmarks/launch.py [--world-size 4] [--repeats 10] [--class-kernels 6] [--json]
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time


def _one_all_reduce():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _spawn_entry(rank, world_size, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    _one_all_reduce()
    dist.destroy_process_group()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_labkit(world_size):
    import labkit

    t0 = time.perf_counter()
    assert labkit.run(_one_all_reduce, world_size=world_size) == [float(world_size)] * world_size
    return time.perf_counter() - t0


def time_spawn(world_size):
    import torch.multiprocessing as tmp

    t0 = time.perf_counter()
    tmp.spawn(_spawn_entry, args=(world_size, _free_port()), nprocs=world_size, join=True)
    return time.perf_counter() - t0


def _first_launch_after_import(world_size, delay_s):
    """A fresh interpreter that imports labkit as a Jupyter kernel would, waits, then launches."""
    import subprocess
    import sys

    code = (
        f"import sys, time, types; sys.modules.setdefault('ipykernel', types.ModuleType('ipykernel'))\n"
        f"import labkit; time.sleep({delay_s})\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        f"from launch import time_labkit; print(time_labkit({world_size}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return float(out.stdout.strip().splitlines()[-1])


def _worker_pss_mb():
    """A rank's own PSS (MB) after one all_reduce: what each rank of a launch adds."""
    import psutil

    _one_all_reduce()
    return psutil.Process().memory_full_info().pss / 1e6


def _idle_memory_mb():
    """RSS, PSS, USS (MB) of this process and its helpers, once no rank is left."""
    import psutil

    me = psutil.Process()
    for _ in range(200):  # ranks exit right after they return: wait until they are gone
        procs = [me] + me.children(recursive=True)
        if len(procs) <= 3:  # the kernel, its forkserver, the resource tracker
            break
        time.sleep(0.05)
    infos = [p.memory_full_info() for p in procs]
    return {k: sum(getattr(i, k) for i in infos) / 1e6 for k in ("rss", "pss", "uss")}


def class_kernel(go_file, launches):
    """One learner's kernel (runs in its own process): warm up, report, wait for `go_file`,
    then `launches` timed 2-rank launches; prints one JSON line."""
    import labkit

    out = {"failures": 0, "times": []}
    t0 = time.perf_counter()
    out["worker_pss_mb"] = statistics.median(labkit.run(_worker_pss_mb, world_size=2))
    out["warmup_s"] = time.perf_counter() - t0
    out["idle"] = _idle_memory_mb()
    print("ready", flush=True)
    while not os.path.exists(go_file):
        time.sleep(0.005)
    for _ in range(launches):
        try:
            out["times"].append(time_labkit(2))
        except Exception:  # a failed launch is a data point, not the end of the benchmark
            out["failures"] += 1
    print(json.dumps(out), flush=True)


def time_class(kernels, launches):
    """K concurrent kernels (`class_kernel`), released together once all have warmed up."""
    import subprocess
    import sys
    import tempfile

    go = os.path.join(tempfile.mkdtemp(prefix="labkit-bench-"), "go")
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys, types; sys.modules.setdefault('ipykernel', types.ModuleType('ipykernel'))\n"
        f"sys.path.insert(0, {here!r})\n"
        f"from launch import class_kernel; class_kernel({go!r}, {launches})"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(kernels)
    ]
    for proc in procs:
        proc.stdout.readline()  # "ready" (or EOF if it died: it counts as failures below)
    open(go, "w").close()
    results, failures = [], 0
    for proc in procs:
        try:
            results.append(json.loads(proc.communicate(timeout=600)[0].strip().splitlines()[-1]))
        except (ValueError, IndexError, subprocess.TimeoutExpired):
            proc.kill()
            failures += launches
    times = [t for r in results for t in r["times"]]
    failures += sum(r["failures"] for r in results)
    pick = lambda key: statistics.median(r["idle"][key] for r in results)  # noqa: E731
    k = f"class_k{kernels}_"
    return {
        k + "launches": kernels * launches,
        k + "median_s": statistics.median(times),
        k + "max_s": max(times),
        k + "failures": failures,
        k + "warmup_max_s": max(r["warmup_s"] for r in results),
        "idle_kernel_mb": pick("pss"),
        "idle_kernel_rss_mb": pick("rss"),
        "idle_kernel_uss_mb": pick("uss"),
        "worker_pss_mb": statistics.median(r["worker_pss_mb"] for r in results),
    }


def _launcher_rows(a):
    first = time_labkit(a.world_size)
    # What a notebook sees: `import labkit` starts the forkserver in the background, and the
    # first launch comes a few seconds later (here: a fresh process, 8 s after the import).
    notebook_first = _first_launch_after_import(a.world_size, delay_s=8.0)
    warm, spawn = [], []
    for i in range(max(a.repeats, a.spawn_repeats)):  # interleaved: both meet the same load
        if i < a.repeats:
            warm.append(time_labkit(a.world_size))
        if i < a.spawn_repeats:
            spawn.append(time_spawn(a.world_size))
    return first, notebook_first, warm, spawn


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--spawn-repeats", type=int, default=3)
    ap.add_argument("--class-kernels", type=int, default=6)
    ap.add_argument("--class-launches", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("LABKIT_OUTPUT", "ordered")
    # First, on a quiet machine: the classroom case starts K kernels, each with its forkserver.
    classroom = time_class(a.class_kernels, a.class_launches) if a.class_kernels else {}
    # labkit's once-per-kernel note goes to stdout; with --json, stdout is the JSON alone.
    with contextlib.redirect_stdout(sys.stderr if a.json else sys.stdout):
        first, notebook_first, warm, spawn = _launcher_rows(a)
    from labkit.checks import load_line, load_report  # after the timings: import labkit warms up

    rows = {
        "world_size": a.world_size,
        "cpu_cores": os.cpu_count(),
        "labkit_first_s": first,
        "labkit_first_after_import_8s_s": notebook_first,
        "labkit_warm_median_s": statistics.median(warm),
        "spawn_median_s": statistics.median(spawn),
        "spawn_over_labkit_warm": statistics.median(spawn) / statistics.median(warm),
        **classroom,
        "load": load_report(a.world_size),  # read right after the launches: their last minute
    }
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"launch of {a.world_size} gloo ranks doing one all_reduce ({os.cpu_count()} cores)")
    print(f"{'launcher':<34}{'time':>10}")
    print(f"{'labkit.run, first in process':<34}{first:>9.3f}s   (target ≤ 4 s)")
    print(
        f"{'labkit.run, first, 8 s after import':<34}{notebook_first:>9.3f}s   (a notebook: "
        f"import labkit warms the forkserver up)"
    )
    print(
        f"{'labkit.run, warm median':<34}{rows['labkit_warm_median_s']:>9.3f}s   "
        f"(target ≤ 0.5 s; n={a.repeats})"
    )
    print(
        f"{'torch.multiprocessing.spawn median':<34}{rows['spawn_median_s']:>9.3f}s   (n={a.spawn_repeats})"
    )
    print(f"spawn / labkit warm = {rows['spawn_over_labkit_warm']:.1f}× (interleaved, medians)")
    print(load_line(rows["load"]))
    if classroom:
        k = f"class_k{a.class_kernels}_"
        print(
            f"classroom: {a.class_kernels} kernels × {a.class_launches} concurrent 2-rank "
            f"launches: median {rows[k + 'median_s']:.3f} s, max {rows[k + 'max_s']:.3f} s, "
            f"{rows[k + 'failures']} failed (target: median ≤ 0.4 s, 0 failed)"
        )
        print(
            f"idle kernel + forkserver: PSS {rows['idle_kernel_mb']:.0f} MB, RSS "
            f"{rows['idle_kernel_rss_mb']:.0f} MB, USS {rows['idle_kernel_uss_mb']:.0f} MB; "
            f"one running rank: PSS {rows['worker_pss_mb']:.0f} MB"
        )


if __name__ == "__main__":
    main()
