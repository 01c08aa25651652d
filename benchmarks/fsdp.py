"""Hand-written FSDP vs PyTorch's fully_shard (FSDP2) on gloo, side by side in one run, on 2 and 4
ranks: median step time, measured peak memory per rank, the peak formula, and the hand-written
DDP's peak on the same model.

    .venv/bin/python benchmarks/fsdp.py                 # 2 and 4 ranks
    .venv/bin/python benchmarks/fsdp.py --json          # the same rows as JSON
    .venv/bin/python benchmarks/fsdp.py --world-sizes 2 --steps 4

Every run is labkit.loop.train on the "bench" preset (--batch-size overrides its rows). Step times:
the two variants are interleaved in one launch (hand, torch, hand, torch), medians of the steps
after a warm-up step of each run; no memory tracker or spans (they slow every op). Peaks: then,
in the same launch, with labkit.observe.memory's tracker (all measured by the same tool). On a shared 2-core machine
the noise between runs can be 2x: read the ratios, not the milliseconds.

Left out: NCCL / GPUs, mixed precision, models large enough for communication to dominate.
"""
import argparse
import json
import statistics

import labkit
from labkit import loop
from labkit.labs.fsdp_lab import peak_formula

BENCH = loop.PRESETS["bench"]


def timed_and_tracked(cfg, steps):
    """Rank function: loop.train for each variant; timings without spans or tracker, the first step
    of each run a warm-up (trained, not timed); then peaks, DDP's included, with the tracker."""
    common = dict(cfg=cfg, steps=steps, return_state=False, spans=False)
    timed = loop.sweep([dict(strategy=s) for s in ("fsdp", "torch-fsdp") * 2], warmup=1, **common)
    tracked = loop.sweep([dict(strategy="fsdp"), dict(strategy="torch-fsdp"),
                          dict(strategy="ddp-bucketed", bucket_cap_mb=1, steps=3)], track_memory=True,
                         **common)
    return {"hand_step_s": [s for r in timed[0::2] for s in r["step_s"]],
            "torch_step_s": [s for r in timed[1::2] for s in r["step_s"]],
            "hand_peak": tracked[0]["peak"], "torch_peak": tracked[1]["peak"],
            "activations": tracked[0]["peak_by_category"]["activations"], "ddp_peak": tracked[2]["peak"]}


def bench(world_size, steps, batch_size):
    cfg = BENCH.replace(batch_size=batch_size)
    results = labkit.run(timed_and_tracked, cfg, steps, world_size=world_size, timeout=900)
    hand_s = statistics.median(max(vals) for vals in zip(*(r["hand_step_s"] for r in results)))
    torch_s = statistics.median(max(vals) for vals in zip(*(r["torch_step_s"] for r in results)))
    r0 = results[0]
    formula, _ = peak_formula(loop.build_model(cfg), world_size, cfg.units, 1, r0["activations"])
    return {"world_size": world_size, "hand_ms": 1e3 * hand_s, "fully_shard_ms": 1e3 * torch_s,
            "time_ratio": hand_s / torch_s, "hand_peak": r0["hand_peak"], "fully_shard_peak": r0["torch_peak"],
            "peak_ratio": r0["hand_peak"] / r0["torch_peak"], "formula": formula,
            "peak_vs_formula": r0["hand_peak"] / formula, "ddp_peak": r0["ddp_peak"],
            "peak_vs_ddp": r0["hand_peak"] / r0["ddp_peak"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=BENCH.batch_size)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [bench(n, args.steps, args.batch_size) for n in args.world_sizes]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"model {BENCH.gpt_config()}, batch {args.batch_size}, gloo; targets: time <= 1.0x, peak <= 1.05x "
          f"fully_shard's and <= 1.3x the formula, <= 0.5x DDP's at N = 4")
    print(f"{'N':>2} {'hand ms':>8} {'FSDP2 ms':>9} {'ratio':>6} {'hand peak':>10} {'FSDP2 peak':>11} "
          f"{'ratio':>6} {'formula':>9} {'/formula':>9} {'DDP peak':>9} {'/DDP':>6}")
    for r in rows:
        print(f"{r['world_size']:>2} {r['hand_ms']:>8.1f} {r['fully_shard_ms']:>9.1f} {r['time_ratio']:>6.2f} "
              f"{r['hand_peak'] / 2**20:>9.2f}M {r['fully_shard_peak'] / 2**20:>10.2f}M {r['peak_ratio']:>6.2f} "
              f"{r['formula'] / 2**20:>8.2f}M {r['peak_vs_formula']:>9.2f} {r['ddp_peak'] / 2**20:>8.2f}M "
              f"{r['peak_vs_ddp']:>6.2f}")


if __name__ == "__main__":
    main()
