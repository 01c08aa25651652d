"""Tensor parallelism by hand ("tp") on 2 gloo ranks, in one launch: its communication per step
measured by labkit's tracer against the Megatron formula, its activation peak per rank against
DDP's, and its step time against PyTorch's parallelize_module ("torch-tp").

    .venv/bin/python benchmarks/tp.py            # a table
    .venv/bin/python benchmarks/tp.py --json     # the same numbers as JSON (stdout: the JSON alone)

Keys:
  tp_bytes_measured      bytes of every collective labkit's tracer recorded inside the "step" spans
                         of --steps steps of "tp" (tp=2), per step (the loop's loss report and
                         gathered gradients are untraced: only the strategy's traffic counts)
  tp_bytes_predicted     2 all-reduces per block forward (after attn.proj and mlp.2) and 2 backward
                         (the gradients of the attention's and the MLP's input), each of
                         batch x seq x d_model elements: 4 * n_layers * B * T * d * itemsize
  tp_bytes_match         measured == predicted, exactly
  activation_peak_tp2_bytes   the "activations" category at labkit.observe.memory's peak, "tp" at
                         tp=2, B rows per rank (every tp rank reads the whole batch)
  activation_peak_ddp_bytes   the same for "ddp-bucketed" (1 MiB buckets) on 2 ranks with a global
                         batch of 2B: the same B rows per rank, each rank the whole model
  activation_ratio       tp2 / ddp: below 1 because the heads' and the MLP's activations are split,
                         above 1/2 because the residual stream, the LayerNorms and the logits
                         stay whole on every tp rank (no sequence parallelism)
  step_s_ours, step_s_torch, step_ratio   median step (the slowest rank's) of "tp" and "torch-tp",
                         interleaved --rounds times, a warm-up step each, no spans or tracker
Model: PRESETS["bench"] (TinyGPT d_model 128, 4 heads, 4 layers, 64-token rows, 16 rows).
On the shared 2-core machine timings are noisy: read the ratio.
Left out: NCCL / GPUs, tp > 2, sequence parallelism, fsdp-tp's traffic (all-gathers and
reduce-scatters over dp on top of this).
"""

import argparse
import contextlib
import json
import statistics
import sys

import torch

import labkit
from labkit import loop

PRESET = loop.PRESETS["bench"]


def predicted_bytes(cfg):
    """Megatron's per-step traffic of TinyGPT at any tp: 4 all-reduces per block of B x T x d."""
    g = cfg.gpt_config()
    itemsize = torch.empty((), dtype=cfg.compute_dtype).element_size()
    return 4 * g.n_layers * cfg.batch_size * cfg.seq_len * g.d_model * itemsize


def _rank(cfg, steps, rounds):
    # The only run with spans: its "step" spans are the windows whose traffic is counted (building
    # the strategy's process groups happens outside them).
    loop.train("tp", cfg, steps, spans=True, return_state=False)
    common = dict(steps=steps, return_state=False, spans=False)
    peaks = {
        "tp": loop.train("tp", cfg, 2, spans=False, return_state=False, track_memory=True),
        "ddp": loop.train(
            "ddp-bucketed",
            cfg.replace(batch_size=2 * cfg.batch_size),
            2,
            spans=False,
            return_state=False,
            track_memory=True,
            bucket_cap_mb=1,
        ),
    }
    order = ("tp", "torch-tp")
    timed = loop.sweep(
        [dict(strategy=s) for s in order * rounds], cfg=cfg, hooks=loop.Hooks(warmup=1), **common
    )
    return {
        "activations": {k: v["peak_by_category"]["activations"] for k, v in peaks.items()},
        "step_s": {s: [t for r in timed[i :: len(order)] for t in r["step_s"]] for i, s in enumerate(order)},
    }


def bench(steps, rounds):
    cfg = PRESET
    results = labkit.run(_rank, cfg, steps, rounds, world_size=2, timeout=600)
    measured = []
    for trace in results.traces:
        windows = [(s["start"], s["end"]) for s in trace["spans"] if s["name"] == "step"]
        if len(windows) != steps:
            raise RuntimeError(f"expected {steps} step spans in the trace, found {len(windows)}")
        measured.append(
            sum(
                e["nbytes"]
                for e in trace["events"]
                if e["kind"] == "collective" and any(lo <= e["start"] <= hi for lo, hi in windows)
            )
        )
    if len(set(measured)) != 1:
        raise RuntimeError(f"the ranks' traced bytes differ: {measured}")
    per_step = measured[0] / steps
    predicted = predicted_bytes(cfg)

    def median_step(name):  # a step takes as long as its slowest rank
        return statistics.median(max(v) for v in zip(*(r["step_s"][name] for r in results)))

    ours, theirs = median_step("tp"), median_step("torch-tp")
    act_tp = max(r["activations"]["tp"] for r in results)
    act_ddp = max(r["activations"]["ddp"] for r in results)
    return {
        "tp_bytes_measured": per_step,
        "tp_bytes_predicted": predicted,
        "tp_bytes_match": per_step == predicted,
        "activation_peak_tp2_bytes": act_tp,
        "activation_peak_ddp_bytes": act_ddp,
        "activation_ratio": act_tp / act_ddp,
        "step_s_ours": ours,
        "step_s_torch": theirs,
        "step_ratio": ours / theirs,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per run (timed ones after 1 warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of tp and torch-tp")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # With --json, stdout holds the JSON alone (labkit's once-per-kernel notes go to stderr).
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        row = bench(args.steps, args.rounds)
    if args.json:
        print(json.dumps(row, indent=2))
        return
    print(f"model {PRESET.gpt_config()}, batch {PRESET.batch_size}, tp=2, gloo")
    print(
        f"TP bytes per step: measured {row['tp_bytes_measured']:.0f}, predicted "
        f"{row['tp_bytes_predicted']} ({'match' if row['tp_bytes_match'] else 'MISMATCH'})"
    )
    print(
        f"activation peak per rank: tp=2 {row['activation_peak_tp2_bytes'] / 2**20:.2f} MiB, DDP "
        f"{row['activation_peak_ddp_bytes'] / 2**20:.2f} MiB (ratio {row['activation_ratio']:.2f})"
    )
    print(
        f"step: ours {1e3 * row['step_s_ours']:.1f} ms, torch {1e3 * row['step_s_torch']:.1f} ms "
        f"(ratio {row['step_ratio']:.2f})"
    )


if __name__ == "__main__":
    main()
