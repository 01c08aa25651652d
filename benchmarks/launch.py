"""Launch cost: labkit.run vs torch.multiprocessing.spawn, side by side in one run.

Each launch starts `world_size` gloo ranks that do one all_reduce and return. Prints the first
(cold) launch and the median of the warm ones; `--json` prints the same figures as JSON.

    python benchmarks/launch.py [--world-size 4] [--repeats 10] [--json]
"""
import argparse
import json
import os
import statistics
import time


def _one_all_reduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _spawn_entry(rank, world_size, port):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
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
    code = (f"import sys, time, types; sys.modules.setdefault('ipykernel', types.ModuleType('ipykernel'))\n"
            f"import labkit; time.sleep({delay_s})\n"
            f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
            f"from launch import time_labkit; print(time_labkit({world_size}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--spawn-repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("LABKIT_OUTPUT", "ordered")
    first = time_labkit(a.world_size)
    # What a notebook sees: `import labkit` starts the forkserver in the background, and the
    # first launch comes a few seconds later (here: a fresh process, 8 s after the import).
    notebook_first = _first_launch_after_import(a.world_size, delay_s=8.0)
    warm = [time_labkit(a.world_size) for _ in range(a.repeats)]
    spawn = [time_spawn(a.world_size) for _ in range(a.spawn_repeats)]
    rows = {
        "world_size": a.world_size, "cpu_cores": os.cpu_count(),
        "labkit_first_s": first, "labkit_first_after_import_8s_s": notebook_first,
        "labkit_warm_median_s": statistics.median(warm),
        "spawn_median_s": statistics.median(spawn),
        "spawn_over_labkit_warm": statistics.median(spawn) / statistics.median(warm),
    }
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"launch of {a.world_size} gloo ranks doing one all_reduce ({os.cpu_count()} cores)")
    print(f"{'launcher':<34}{'time':>10}")
    print(f"{'labkit.run, first in process':<34}{first:>9.3f}s   (target ≤ 4 s)")
    print(f"{'labkit.run, first, 8 s after import':<34}{notebook_first:>9.3f}s   (a notebook: "
          f"import labkit warms the forkserver up)")
    print(f"{'labkit.run, warm median':<34}{rows['labkit_warm_median_s']:>9.3f}s   "
          f"(target ≤ 0.5 s; n={a.repeats})")
    print(f"{'torch.multiprocessing.spawn median':<34}{rows['spawn_median_s']:>9.3f}s   "
          f"(n={a.spawn_repeats})")
    print(f"spawn / labkit warm = {rows['spawn_over_labkit_warm']:.1f}×")


if __name__ == "__main__":
    main()
