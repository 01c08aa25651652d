"""Hand-written DDP stages vs torch's DistributedDataParallel, side by side in one run.

    .venv/bin/python benchmarks/ddp.py                  # 2 and 4 ranks, table
    .venv/bin/python benchmarks/ddp.py --json           # the same rows as JSON
    .venv/bin/python benchmarks/ddp.py --world-sizes 2 --bucket-mb 0.25 --reps 5

Every variant is labkit.loop.train on the "bench" preset (--batch-size overrides its rows) with the
same bucket size. Variants run
interleaved (naive, flat, bucketed, torch, naive, ...) inside one launch, and each quotes the
median step time of the slowest rank over all its steps but each run's first (a warm-up): on a
shared 2-core machine run-to-run noise can be 2x, so every row carries the load average read
right after its launch (labkit.checks.load_report: above cores + ranks, too noisy to call). Overlap % is the share of communication time
during which the rank was computing (labkit.observe.trace_stats.overlap_stats); torch DDP's all-reduces
are seen through labkit.observe.tracing.ddp_comm_hook_recording.

Left out: NCCL/GPU timing (CUDA events), bucket sizes tuned per world size, mixed precision.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch.distributed as dist

import labkit
from labkit import loop
from labkit.checks import load_line, load_report
from labkit.labs.ddp_lab import bucket_count
from labkit.observe import trace_stats

VARIANTS = ("ddp-naive", "ddp-flat", "ddp-bucketed", "torch-ddp")
BENCH = loop.PRESETS["bench"]


def bench_rank(bucket_mb, steps, reps, batch_size):
    """Rank function: every variant `reps` times, interleaved; returns per-variant step times and
    the raw perf_counter windows of each run (to cut the trace per variant)."""
    out = {v: {"step_s": [], "windows": []} for v in VARIANTS}
    cfg = BENCH.replace(batch_size=batch_size)
    for _ in range(reps):
        for variant in VARIANTS:
            options = {"bucket_cap_mb": bucket_mb} if variant in ("ddp-bucketed", "torch-ddp") else {}
            dist.barrier()
            start = time.perf_counter()
            result = loop.train(
                variant,
                cfg,
                steps - 1,
                return_state=False,
                hooks=loop.Hooks(warmup=1, report=bucket_count),
                **options,
            )
            out[variant]["windows"].append((start, time.perf_counter()))
            out[variant]["step_s"] += result["step_s"]
            out[variant]["buckets"] = result["buckets"]
    return out


def summarize(results, world_size, bucket_mb):
    rows = []
    for variant in VARIANTS:
        per_rank = [statistics.median(r[variant]["step_s"]) for r in results]
        overlaps, counts = [], 0
        for trace, r in zip(results.traces, results):
            for start, end in r[variant]["windows"]:
                window = (start - trace["t0"], end - trace["t0"])
                stats = trace_stats.overlap_stats(trace, t_range=window)
                if stats["overlap_pct"] is not None:
                    overlaps.append(stats["overlap_pct"])
        first = results.traces[0]
        start, end = results[0][variant]["windows"][0]
        counts = sum(
            1
            for ev in first["events"]
            if ev["op"] == "all_reduce" and start - first["t0"] <= ev["start"] <= end - first["t0"]
        )
        rows.append(
            {
                "world_size": world_size,
                "variant": variant,
                "bucket_mb": bucket_mb,
                "median_step_ms": 1e3 * max(per_rank),
                "overlap_pct": statistics.median(overlaps) if overlaps else None,
                "all_reduces_per_run": counts,
                "buckets": results[0][variant].get("buckets"),
            }
        )
    torch_ms = next(r["median_step_ms"] for r in rows if r["variant"] == "torch-ddp")
    for row in rows:
        row["vs_torch"] = row["median_step_ms"] / torch_ms
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--bucket-mb", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=6, help="per run, the first is a warm-up")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=BENCH.batch_size)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    # labkit.run's notes (e.g. "4 ranks on 2 CPU cores") go to stderr so --json stays parseable.
    with contextlib.redirect_stdout(sys.stderr):
        for n in args.world_sizes:
            results = labkit.run(
                bench_rank, args.bucket_mb, args.steps, args.reps, args.batch_size, world_size=n, timeout=600
            )
            load = load_report(n)
            rows += [{**row, **load} for row in summarize(results, n, args.bucket_mb)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"TinyGPT {BENCH.gpt_config()}, batch {args.batch_size}, bucket {args.bucket_mb} MiB, "
        f"median of {args.reps} x {args.steps - 1} steps (slowest rank)"
    )
    print(
        f"{'ranks':>5} {'variant':<12} {'step ms':>8} {'x torch':>8} {'overlap':>8} "
        f"{'all-reduces/run':>16} {'buckets':>8}"
    )
    for r in rows:
        overlap = "-" if r["overlap_pct"] is None else f"{r['overlap_pct']:.0f}%"
        print(
            f"{r['world_size']:>5} {r['variant']:<12} {r['median_step_ms']:>8.1f} "
            f"{r['vs_torch']:>8.2f} {overlap:>8} {r['all_reduces_per_run']:>16} "
            f"{r['buckets'] or '-':>8}"
        )
    for n in args.world_sizes:
        print(f"{n} ranks: {load_line(next(r for r in rows if r['world_size'] == n))}")


if __name__ == "__main__":
    main()
