"""Mixed precision and activation checkpointing, measured: the ZeRO paper's bytes per parameter
for every hand-written strategy, FSDP's all-gather bytes in bf16 vs fp32, and what checkpointing
each block does to the activation peak and the step time.

    .venv/bin/python benchmarks/precision.py              # 4 ranks, the FSDP lab's preset
    .venv/bin/python benchmarks/precision.py --json       # one JSON object (keys below)

All on labkit.loop.train with the "fsdp" preset (the FSDP lab's model, whose state dominates
memory) at N = --world-size, with MixedPrecision(param_dtype=bf16, reduce_dtype=bf16): 16-bit
gradients, as the paper counts them. Keys:
  bytes_per_param       {strategy: (parameters + gradients + optimizer bytes) / P}, on the rank with
                        the most, at the end of the second step's backward (the steady state; the fp32
                        master counts as optimizer state, as the paper does). Paper: ddp 16,
                        zero1 4 + 12/N, zero2 2 + 14/N, fsdp 16/N (+ padding).
  expected_bytes_per_param, bytes_per_param_ratio (measured / paper)
  fsdp_allgather_bytes_bf16_over_fp32   all-gather bytes per step from the tracer (paper: 0.5)
  ckpt_activation_peak_ratio  activation bytes at the peak, each block checkpointed / not (fsdp)
  ckpt_step_time_ratio        median step time, checkpointed / not (fsdp, no tracker, interleaved)
  ckpt_allgathers             all-gathers per step with / without checkpointing, for
                              reshard_after_forward True and False
  bf16_step_over_fp32   {strategy: median step time bf16 / fp32} (reported, no target: CPU bf16
                        speed depends on the processor's bf16 support)
ZeRO-2's buckets are sized to the model as its defaults are to the zero lab's (a bucket about a
fifth of the fp32 model, the last one a thirtieth: `zero2_buckets`, reported as zero2_options),
so the one bucket still in flight at the end of backward stays a few percent of P on any preset
(the fixed defaults' 0.1 MiB last bucket is most of a 28k-parameter model).
Left out: fp16 (same bytes as bf16), NCCL / GPUs, torch's own strategies (their memory is not the
paper's split: torch's DDP has no master weights).
"""

import argparse
import contextlib
import json
import statistics
import sys

import torch

import labkit
from labkit import loop
from labkit.checks import load_line, load_report
from labkit.models import num_params
from labkit.observe.trace_stats import collective_counts
from labkit.strategies.precision import MixedPrecision

STRATEGIES = ("ddp-bucketed", "zero1", "zero2", "fsdp")
KEY = {"ddp-bucketed": "ddp", "zero1": "zero1", "zero2": "zero2", "fsdp": "fsdp"}
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
STATE = ("parameters", "gradients", "optimizer")


def paper_bytes(key, n):
    return {"ddp": 16, "zero1": 4 + 12 / n, "zero2": 2 + 14 / n, "fsdp": 16 / n}[key]


def zero2_buckets(P):
    """ZeRO-2's bucket caps for a P-parameter model: its defaults (0.6 / 0.1 MiB) scaled from the
    zero lab's 805k parameters (3.07 MiB in fp32) to this model."""
    model_mib = 4 * P / 2**20
    return {"bucket_cap_mb": model_mib / 5, "last_bucket_mb": model_mib / 30}


def state_bytes(cfg, strategies, options=None):
    """Rank function: {strategy: state bytes at the end of step 2's backward} in cfg's precision;
    options: {strategy: its options}."""
    out = {}
    for name in strategies:
        result = loop.train(
            name, cfg, 2, track_memory=True, return_state=False, spans=False, **(options or {}).get(name, {})
        )
        end = [s for s in result["memory"].samples if s.label == "backward end"][-1]
        out[name] = sum(end.by_category[c] for c in STATE)
    return out


def activation_peaks(cfg):
    """Rank function: activation bytes at the peak, fsdp, without / with checkpointed blocks."""
    runs = [dict(cfg=cfg), dict(cfg=cfg.replace(activation_checkpointing=True))]
    results = loop.sweep(runs, strategy="fsdp", steps=2, track_memory=True, return_state=False, spans=False)
    return [r["peak_by_category"]["activations"] for r in results]


def step_times(cfgs, rounds, steps):
    """Rank function: {label: [step seconds]} for (label, strategy, cfg), interleaved by round."""
    times = {}
    for _ in range(rounds):
        for label, strategy, cfg, *options in cfgs:  # options: an optional dict for the strategy
            r = loop.train(
                strategy,
                cfg,
                steps,
                return_state=False,
                spans=False,
                hooks=loop.Hooks(warmup=1),
                **(options[0] if options else {}),
            )
            times.setdefault(label, []).extend(r["step_s"])
    return times


def per_step_allgather_bytes(cfg, world_size, steps=2, **options):
    run = labkit.run(
        loop.train, "fsdp", cfg, steps, return_state=False, world_size=world_size, timeout=900, **options
    )
    counts = collective_counts(run.traces[0])
    count, nbytes = counts.get("ring_all_gather", (0, 0))  # labkit's ring, as the tracer names it
    return count / steps, nbytes / steps


def slowest_median(results, label):
    return statistics.median(max(v) for v in zip(*(r[label] for r in results)))


def measure(args):
    """Every figure of the report (module docstring), run on args.world_size ranks."""
    n, fsdp = args.world_size, "fsdp" in args.strategies
    base = loop.PRESETS["fsdp"]
    bf16 = base.replace(mp=BF16)
    P = num_params(loop.build_model(base))
    options = {"zero2": zero2_buckets(P)}
    states = labkit.run(state_bytes, bf16, args.strategies, options, world_size=n, timeout=900)
    measured = {KEY[s]: max(r[s] for r in states) / P for s in args.strategies}
    expected = {k: paper_bytes(k, n) for k in measured}
    report = {
        "world_size": n,
        "P": P,
        "bytes_per_param": measured,
        "expected_bytes_per_param": expected,
        "bytes_per_param_ratio": {k: measured[k] / expected[k] for k in measured},
    }
    if "zero2" in args.strategies:
        report["zero2_options"] = options["zero2"]
    if fsdp:
        ag16, ag32 = per_step_allgather_bytes(bf16, n)[1], per_step_allgather_bytes(base, n)[1]
        report["fsdp_allgather_bytes_bf16_over_fp32"] = ag16 / ag32
        peaks = labkit.run(activation_peaks, base, world_size=n, timeout=900)
        report["ckpt_activation_peak_ratio"] = max(p[1] for p in peaks) / max(p[0] for p in peaks)
        report["ckpt_allgathers"] = {
            f"reshard_after_forward={raf}": {
                "plain": per_step_allgather_bytes(base, n, reshard_after_forward=raf)[0],
                "checkpointed": per_step_allgather_bytes(
                    base.replace(activation_checkpointing=True), n, reshard_after_forward=raf
                )[0],
            }
            for raf in (True, False)
        }
    cfgs = [
        (f"{s}/{tag}", s, c, options.get(s, {}))
        for tag, c in (("fp32", base), ("bf16", bf16))
        for s in args.strategies
    ]
    if fsdp:
        cfgs.append(("fsdp/ckpt", "fsdp", base.replace(activation_checkpointing=True)))
    times = labkit.run(step_times, cfgs, args.rounds, args.steps, world_size=n, timeout=900)
    report["load"] = load_report(n)  # read right after the timed launch: its last minute
    report["bf16_step_over_fp32"] = {
        KEY[s]: slowest_median(times, f"{s}/bf16") / slowest_median(times, f"{s}/fp32")
        for s in args.strategies
    }
    if fsdp:
        report["ckpt_step_time_ratio"] = slowest_median(times, "fsdp/ckpt") / slowest_median(
            times, "fsdp/fp32"
        )
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # labkit's once-per-kernel note goes to stdout; with --json, stdout is the JSON alone.
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        report = measure(args)
    n, measured, expected = args.world_size, report["bytes_per_param"], report["expected_bytes_per_param"]
    P = report["P"]
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"N = {n}, P = {P:,}, MixedPrecision(bf16, bf16); bytes per parameter at the end of step 2's backward"
    )
    print("strategy | measured | paper | ratio | bf16 step / fp32")
    for k in measured:
        print(
            f"{k:8} | {measured[k]:8.3f} | {expected[k]:5.2f} | {measured[k] / expected[k]:5.3f} | "
            f"{report['bf16_step_over_fp32'][k]:.2f}"
        )
    for key in ("fsdp_allgather_bytes_bf16_over_fp32", "ckpt_activation_peak_ratio", "ckpt_step_time_ratio"):
        if key in report:
            print(f"{key}: {report[key]:.3f}")
    if "ckpt_allgathers" in report:
        print(f"all-gathers per step (plain / checkpointed): {report['ckpt_allgathers']}")
    if "zero2_options" in report:
        print("zero2 buckets (MiB): " + ", ".join(f"{k}={v:.4f}" for k, v in report["zero2_options"].items()))
    print(f"step times: {load_line(report['load'])}")


if __name__ == "__main__":
    main()
