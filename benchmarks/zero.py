"""Hand-written ZeRO-1 / ZeRO-2 vs torch's ZeroRedundancyOptimizer vs hand-written DDP, side by side.

    .venv/bin/python benchmarks/zero.py                       # 2 and 4 ranks, the lab's model
    .venv/bin/python benchmarks/zero.py --json                # the same figures as JSON
    .venv/bin/python benchmarks/zero.py --world-sizes 4 --steps 6 --rounds 3

Every run is labkit.loop.train on the "zero" preset (the lab's model; --batch-size overrides its
rows). One launch per world size; inside it the strategies run interleaved, round by round (DDP, ZeRO-1,
ZeRO-2, torch ZeRO, DDP, ...), each a fresh model trained `warmup` untimed + `steps` timed steps. Step
time: per step the slowest rank's, then the median over all timed steps of all rounds (the noise
between runs on a shared 2-core machine can be 2x). Peak memory: one extra run per strategy with
labkit.observe.memory.MemoryTracker (the true high-water of tensor bytes, the highest rank), not timed;
from the same run, the gradient bytes alive at the end of backward (labkit.strategies.zero.
backward_grad_bytes: the "gradients" category then; the highest rank and step).
Targets (issue) at N = 4: zero1_peak_over_ddp <= 0.6, zero1_step_over_torch_zero <= 1.0,
zero2_backward_grad_over_ddp <= 0.4, zero2_step_over_zero1 <= 1.1.
zero2-one-bucket is ZeRO-2 with every parameter but the last bucket in one bucket: the fast end of
its bucket trade-off, which keeps as many gradient bytes through backward as ZeRO-1 does.
Left out: CUDA (runs there too, but the peak then misses the caching allocator), larger models.
"""

import argparse
import contextlib
import json
import statistics
import sys

import labkit
from labkit import loop
from labkit.checks import load_line, load_report
from labkit.strategies.zero import backward_grad_bytes

# row -> (name in labkit.strategies.NAMES, options). zero2-one-bucket: the other end of ZeRO-2's
# bucket trade-off (every parameter but the small last bucket in one bucket: two reduce-scatters).
VARIANTS = {
    "ddp-bucketed": ("ddp-bucketed", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "torch-zero1": ("torch-zero1", {}),
    "zero2-one-bucket": ("zero2", {"bucket_cap_mb": 1e3}),
}
STRATEGIES = tuple(VARIANTS)
TARGETS = {
    "zero1_peak_over_ddp": 0.6,
    "zero1_step_over_torch_zero": 1.0,
    "zero2_backward_grad_over_ddp": 0.4,
    "zero2_step_over_zero1": 1.1,
}  # at N = 4
ZERO = loop.PRESETS["zero"]


def bench_rank(strategies, steps, warmup, rounds, batch_size):
    """Rank function: {strategy: {"step_s": [...], "peak_bytes", "backward_grad_bytes"}} for this rank."""
    cfg = ZERO.replace(batch_size=batch_size)
    out = {s: {"step_s": []} for s in strategies}
    for _ in range(rounds):
        for s in strategies:
            name, options = VARIANTS[s]
            out[s]["step_s"] += loop.train(
                name, cfg, steps, spans=False, return_state=False, hooks=loop.Hooks(warmup=warmup), **options
            )["step_s"]
    for s in strategies:
        name, options = VARIANTS[s]
        tracked = loop.train(name, cfg, 2, spans=False, track_memory=True, return_state=False, **options)
        out[s]["peak_bytes"] = tracked["peak"]
        out[s]["backward_grad_bytes"] = max(backward_grad_bytes(tracked["memory"]))
    return out


def measure(world_size, steps, warmup, rounds, batch_size):
    results = labkit.run(
        bench_rank, STRATEGIES, steps, warmup, rounds, batch_size, world_size=world_size, timeout=900
    )
    rows = []
    for s in STRATEGIES:
        per_step = [max(r[s]["step_s"][i] for r in results) for i in range(len(results[0][s]["step_s"]))]
        rows.append(
            {
                "world_size": world_size,
                "strategy": s,
                "step_ms_median": 1e3 * statistics.median(per_step),
                "peak_MiB": max(r[s]["peak_bytes"] for r in results) / 2**20,
                "backward_grad_MiB": max(r[s]["backward_grad_bytes"] for r in results) / 2**20,
            }
        )
    by = {row["strategy"]: row for row in rows}
    zero1, zero2, ddp, torch_zero, big = (
        by[s] for s in ("zero1", "zero2", "ddp-bucketed", "torch-zero1", "zero2-one-bucket")
    )
    ratios = {
        "world_size": world_size,
        "zero1_peak_over_ddp": zero1["peak_MiB"] / ddp["peak_MiB"],
        "zero1_step_over_torch_zero": zero1["step_ms_median"] / torch_zero["step_ms_median"],
        "zero1_step_over_ddp": zero1["step_ms_median"] / ddp["step_ms_median"],
        "zero2_peak_over_ddp": zero2["peak_MiB"] / ddp["peak_MiB"],
        "zero2_backward_grad_over_ddp": zero2["backward_grad_MiB"] / ddp["backward_grad_MiB"],
        "zero2_step_over_zero1": zero2["step_ms_median"] / zero1["step_ms_median"],
        "zero2_one_bucket_step_over_zero1": big["step_ms_median"] / zero1["step_ms_median"],
        "zero2_one_bucket_peak_over_zero1": big["peak_MiB"] / zero1["peak_MiB"],
        "zero2_peak_over_zero1": zero2["peak_MiB"] / zero1["peak_MiB"],
    }
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
    # labkit's once-per-kernel note goes to stdout; with --json, stdout is the JSON alone.
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        for n in args.world_sizes:
            rows, ratios = measure(n, args.steps, args.warmup, args.rounds, args.batch_size)
            ratios["load"] = load_report(n)  # read right after the launch: its last minute
            all_rows += rows
            all_ratios.append(ratios)
    if args.json:
        json.dump({"rows": all_rows, "ratios": all_ratios}, sys.stdout, indent=2)
        print()
        return
    print(f"{'N':>2}  {'strategy':<16} {'step ms (median)':>17} {'peak MiB':>9} {'grad MiB end bw':>16}")
    for row in all_rows:
        print(
            f"{row['world_size']:>2}  {row['strategy']:<16} {row['step_ms_median']:>17.1f} "
            f"{row['peak_MiB']:>9.2f} {row['backward_grad_MiB']:>16.2f}"
        )
    for r in all_ratios:
        noisy = r["load"]["too_noisy_to_call"]
        print(
            f"N={r['world_size']}: "
            + "; ".join(
                f"{k} = {v:.3f}"
                + (f" (target <= {TARGETS[k]} at N=4)" if k in TARGETS else "")
                + (" (a wall time: too noisy to call)" if noisy and "_step_" in k else "")
                for k, v in r.items()
                if k not in ("world_size", "load")
            )
        )
        print(f"N={r['world_size']}: {load_line(r['load'])}")


if __name__ == "__main__":
    main()
