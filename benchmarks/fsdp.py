"""Hand-written FSDP (per-parameter, "fsdp") and its flat-buffer predecessor ("fsdp-flat") vs
PyTorch's fully_shard (FSDP2, "torch-fsdp") on gloo, side by side in one run per world size:
median step time, measured peak memory per rank, the peak formula, the hand-written DDP's peak on
the same model, the share of that peak that is model state, and the root-only wrap's peak.

    .venv/bin/python benchmarks/fsdp.py                 # 2 and 4 ranks
    .venv/bin/python benchmarks/fsdp.py --json          # the same rows as JSON
    .venv/bin/python benchmarks/fsdp.py --world-sizes 4 --steps 4 --rounds 3

Every run is labkit.loop.train on the FSDP lab's preset (PRESETS["fsdp"], sized so model state
dominates; --batch-size overrides its rows). Step times: the three strategies are interleaved in
one launch (fsdp, fsdp-flat, torch-fsdp, fsdp, ... for --rounds rounds), medians over every timed
step of a strategy (each step's time is the slowest rank's), after a warm-up step of each run; no
memory tracker or spans (they slow every op). Peaks: then, in the same launch, each strategy once
with labkit.observe.memory's tracker with the preset's units (cfg.units, "block") and once with
units="root", and the hand-written DDP (ddp-bucketed, 1 MiB buckets): all by the same tool.

Keys per row (one row per hand-written strategy and world size):
  time_ratio          step time / fully_shard's
  peak_ratio          peak / fully_shard's peak
  peak_vs_formula     peak / labkit.labs.fsdp_lab.peak_formula (the per-parameter reference's)
  peak_vs_ddp         peak / DDP's peak
  root_vs_block_peak  peak with units="root" / peak with cfg.units
  state_share_of_ddp_peak  DDP's parameters + gradients + optimizer bytes at its peak sample /
                      DDP's peak (the same in both rows: a property of the model, not of FSDP)
labkit's cross-rank check of every collective (one extra latency each, ~5 ms at N = 4 on gloo:
it turns a collective out of turn into an error naming both calls) is OFF by default here, as
fully_shard has none: --verify measures with it on, as the labs run.
On a shared 2-core machine the noise between runs can be 2x: read the ratios, not the milliseconds.
Each row carries the load average read after its launch (labkit.checks.load_report); above
cores + ranks the time_ratio target is not called ("too noisy to call").

Left out: NCCL / GPUs, mixed precision, models large enough for communication to dominate.
"""

import argparse
import contextlib
import json
import statistics
import sys

import labkit
from labkit import loop
from labkit.checks import load_line, load_report
from labkit.labs.fsdp_lab import peak_formula

PRESET = loop.PRESETS["fsdp"]
HAND = ("fsdp", "fsdp-flat")
TORCH = "torch-fsdp"
TARGETS = {
    "time_ratio": ("<=", 0.6),
    "peak_ratio": ("<=", 1.05),
    "peak_vs_ddp": ("<=", 0.40),
    "state_share_of_ddp_peak": (">=", 0.7),
    "root_vs_block_peak": (">=", 1.5),
}


def timed_and_tracked(cfg, steps, rounds, verify):
    """Rank function: loop.train for each strategy, interleaved `rounds` times, timed without spans
    or tracker (the first step of each run a warm-up: trained, not timed); then peaks with the
    tracker: each FSDP with block and root units, DDP. verify: labkit's cross-rank check of every
    collective (labkit.comm.collectives.VERIFY_ACROSS_RANKS) on or off for all of it."""
    from labkit.comm import collectives

    before, collectives.VERIFY_ACROSS_RANKS = collectives.VERIFY_ACROSS_RANKS, verify
    try:
        return _runs(cfg, steps, rounds)
    finally:
        collectives.VERIFY_ACROSS_RANKS = before


def _runs(cfg, steps, rounds):
    common = dict(steps=steps, return_state=False, spans=False)
    order = HAND + (TORCH,)
    timed = loop.sweep(
        [dict(strategy=s) for s in order * rounds], cfg=cfg, hooks=loop.Hooks(warmup=1), **common
    )
    step_s = {s: [t for r in timed[i :: len(order)] for t in r["step_s"]] for i, s in enumerate(order)}
    root = cfg.replace(units="root")
    labels = [(s, u) for s in order for u in ("block", "root")]
    runs = [dict(strategy=s, cfg=cfg if u == "block" else root) for s, u in labels]
    runs.append(dict(strategy="ddp-bucketed", cfg=cfg, bucket_cap_mb=1))
    tracked = loop.sweep(runs, track_memory=True, **{**common, "steps": 3})
    by_category = {s: tracked[2 * i]["peak_by_category"] for i, s in enumerate(order)}
    ddp = tracked[-1]
    ddp_state = sum(ddp["peak_by_category"][c] for c in ("parameters", "gradients", "optimizer"))
    return {
        "step_s": step_s,
        "peaks": {f"{s}|{u}": t["peak"] for (s, u), t in zip(labels, tracked)},
        "activations": {s: by_category[s]["activations"] for s in order},
        "ddp_peak": ddp["peak"],
        "ddp_state": ddp_state,
    }


def _median_step(results, strategy):
    # A step takes as long as its slowest rank.
    return statistics.median(max(vals) for vals in zip(*(r["step_s"][strategy] for r in results)))


def bench(world_size, steps, batch_size, rounds, verify=False):
    cfg = PRESET.replace(batch_size=batch_size)
    results = labkit.run(timed_and_tracked, cfg, steps, rounds, verify, world_size=world_size, timeout=1800)
    load = load_report(world_size)  # read right after the launch: its last minute
    r0 = results[0]
    torch_s, torch_peak = _median_step(results, TORCH), r0["peaks"][f"{TORCH}|block"]
    rows = []
    for name in HAND:
        step_s, peak = _median_step(results, name), r0["peaks"][f"{name}|block"]
        formula, _ = peak_formula(loop.build_model(cfg), world_size, cfg.units, 1, r0["activations"][name])
        rows.append(
            {
                "strategy": name,
                "world_size": world_size,
                "cross_rank_check": verify,
                "ms": 1e3 * step_s,
                "fully_shard_ms": 1e3 * torch_s,
                "time_ratio": step_s / torch_s,
                "peak": peak,
                "fully_shard_peak": torch_peak,
                "peak_ratio": peak / torch_peak,
                "formula": formula,
                "peak_vs_formula": peak / formula,
                "ddp_peak": r0["ddp_peak"],
                "peak_vs_ddp": peak / r0["ddp_peak"],
                "state_share_of_ddp_peak": r0["ddp_state"] / r0["ddp_peak"],
                "root_peak": r0["peaks"][f"{name}|root"],
                "root_vs_block_peak": r0["peaks"][f"{name}|root"] / peak,
                "fully_shard_root_vs_block_peak": r0["peaks"][f"{TORCH}|root"] / torch_peak,
                **load,
            }
        )
    return rows


def _meets(row, key):
    op, bound = TARGETS[key]
    return row[key] <= bound if op == "<=" else row[key] >= bound


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (after 1 warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of each strategy")
    parser.add_argument("--batch-size", type=int, default=PRESET.batch_size)
    parser.add_argument(
        "--verify",
        action="store_true",
        help="keep labkit's cross-rank check of every collective on (the labs' default)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # With --json, stdout holds the JSON alone (labkit's once-per-kernel notes go to stderr).
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        rows = [
            row
            for n in args.world_sizes
            for row in bench(n, args.steps, args.batch_size, args.rounds, args.verify)
        ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"model {PRESET.gpt_config()}, batch {args.batch_size}, units {PRESET.units!r}, gloo, "
        f"cross-rank check {'on' if args.verify else 'off'}; "
        f"targets at N = 4: " + ", ".join(f"{k} {op} {v}" for k, (op, v) in TARGETS.items())
    )
    print(
        f"{'strategy':>9} {'N':>2} {'ms':>7} {'FSDP2 ms':>8} {'time':>5} {'peak':>8} {'FSDP2':>8} "
        f"{'peak':>5} {'/formula':>8} {'DDP peak':>8} {'/DDP':>5} {'state/DDP':>9} {'root/block':>10}"
    )
    for r in rows:
        noisy = ["time_ratio"] if r["too_noisy_to_call"] else []  # a wall time: not called
        flags = [k for k in TARGETS if r["world_size"] == 4 and k not in noisy and not _meets(r, k)]
        print(
            f"{r['strategy']:>9} {r['world_size']:>2} {r['ms']:>7.1f} {r['fully_shard_ms']:>8.1f} "
            f"{r['time_ratio']:>5.2f} {r['peak'] / 2**20:>7.2f}M {r['fully_shard_peak'] / 2**20:>7.2f}M "
            f"{r['peak_ratio']:>5.2f} {r['peak_vs_formula']:>8.2f} {r['ddp_peak'] / 2**20:>7.2f}M "
            f"{r['peak_vs_ddp']:>5.2f} {r['state_share_of_ddp_peak']:>9.2f} {r['root_vs_block_peak']:>10.2f}"
            + (f"   misses: {', '.join(flags)}" if flags else "")
            + ("   time_ratio: too noisy to call" if noisy else "")
        )
    for n in args.world_sizes:
        print(f"N = {n}: {load_line(next(r for r in rows if r['world_size'] == n))}")


if __name__ == "__main__":
    main()
