"""Hand-written ZeRO-1 vs torch's ZeroRedundancyOptimizer vs hand-written DDP, side by side.

    .venv/bin/python benchmarks/zero.py                       # 2 and 4 ranks, the lab's model
    .venv/bin/python benchmarks/zero.py --json                # the same figures as JSON
    .venv/bin/python benchmarks/zero.py --world-sizes 4 --steps 6 --rounds 3

Every run is labkit.loop.train on the "zero" preset (the lab's model; --batch-size overrides its
rows). One launch per world size; inside it the strategies run interleaved, round by round (DDP, ZeRO-1,
torch ZeRO, DDP, ...), each a fresh model trained `warmup` untimed + `steps` timed steps. Step
time: per step the slowest rank's, then the median over all timed steps of all rounds (the noise
between runs on a shared 2-core machine can be 2x). Peak memory: one extra run per strategy with
labkit.observe.memory.MemoryTracker (the true high-water of tensor bytes, the highest rank), not timed.
Targets (issue): ZeRO-1 peak <= 0.75x DDP's at N = 4; ZeRO-1 step <= 1.1x ZeroRedundancyOptimizer's.
Left out: CUDA (runs there too, but the peak then misses the caching allocator), larger models.
"""
import argparse
import json
import statistics
import sys

import labkit
from labkit import loop

STRATEGIES = ("ddp-bucketed", "zero1", "torch-zero1")   # names in labkit.strategies.NAMES
ZERO = loop.PRESETS["zero"]


def bench_rank(strategies, steps, warmup, rounds, batch_size):
    """Rank function: {strategy: {"step_s": [...], "peak_bytes": int}} for this rank."""
    cfg = ZERO.replace(batch_size=batch_size)
    out = {s: {"step_s": []} for s in strategies}
    for _ in range(rounds):
        for s in strategies:
            out[s]["step_s"] += loop.train(s, cfg, steps, warmup=warmup, spans=False,
                                           return_state=False)["step_s"]
    for s in strategies:
        tracked = loop.train(s, cfg, 2, spans=False, track_memory=True, return_state=False)
        out[s]["peak_bytes"] = tracked["peak"]
    return out


def measure(world_size, steps, warmup, rounds, batch_size):
    results = labkit.run(bench_rank, STRATEGIES, steps, warmup, rounds, batch_size,
                         world_size=world_size, timeout=900)
    rows = []
    for s in STRATEGIES:
        per_step = [max(r[s]["step_s"][i] for r in results) for i in range(len(results[0][s]["step_s"]))]
        rows.append({"world_size": world_size, "strategy": s,
                     "step_ms_median": 1e3 * statistics.median(per_step),
                     "peak_MiB": max(r[s]["peak_bytes"] for r in results) / 2**20})
    by = {row["strategy"]: row for row in rows}
    zero1, ddp, torch_zero = (by[s] for s in ("zero1", "ddp-bucketed", "torch-zero1"))
    ratios = {"world_size": world_size,
              "zero1_peak_over_ddp": zero1["peak_MiB"] / ddp["peak_MiB"],
              "zero1_step_over_torch_zero": zero1["step_ms_median"] / torch_zero["step_ms_median"],
              "zero1_step_over_ddp": zero1["step_ms_median"] / ddp["step_ms_median"]}
    return rows, ratios


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=ZERO.batch_size)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    all_rows, all_ratios = [], []
    for n in args.world_sizes:
        rows, ratios = measure(n, args.steps, args.warmup, args.rounds, args.batch_size)
        all_rows += rows
        all_ratios.append(ratios)
    if args.json:
        json.dump({"rows": all_rows, "ratios": all_ratios}, sys.stdout, indent=2)
        print()
        return
    print(f"{'N':>2}  {'strategy':<32} {'step ms (median)':>17} {'peak MiB':>9}")
    for row in all_rows:
        print(f"{row['world_size']:>2}  {row['strategy']:<32} {row['step_ms_median']:>17.1f} "
              f"{row['peak_MiB']:>9.2f}")
    for r in all_ratios:
        print(f"N={r['world_size']}: ZeRO-1 peak / DDP peak = {r['zero1_peak_over_ddp']:.3f} "
              f"(target <= 0.75 at N=4); ZeRO-1 step / ZeroRedundancyOptimizer step = "
              f"{r['zero1_step_over_torch_zero']:.3f} (target <= 1.1); vs DDP {r['zero1_step_over_ddp']:.3f}")


if __name__ == "__main__":
    main()
