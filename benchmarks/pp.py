"""Pipeline parallelism by hand ("pp") on 4 gloo ranks, in one launch: each schedule's bubble
from the order the ranks recorded against (p-1)/(m+p-1) and (p-1)/(v m+p-1), 1F1B's activation
peak against GPipe's at m = 2p, the step time against torch.distributed.pipelining ("torch-pp"),
and the zero-bubble schedules zb-h1 / zbv against 1F1B (replayed bubble, step time).

    .venv/bin/python benchmarks/pp.py            # a table
    .venv/bin/python benchmarks/pp.py --json     # the same numbers as JSON (stdout: the JSON alone)

Keys:
  bubble_measured        per schedule ("gpipe", "1f1b", "interleaved" with v=2): the idle share of
                         the ranks' slots when the orders each rank RECORDED while training
                         (PipelineByHand.record.actions of the last step) are replayed with one
                         slot per action (schedule.bubble_fraction): clock-free, so a busy
                         machine cannot change it
  bubble_predicted       (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1)
  bubble_match           measured == predicted within 1e-12, per schedule
  activation_peak_bytes  per schedule, the most bytes any rank's autograd held for backward at
                         once (record.peak_live_bytes: saved tensors, each storage once, the
                         parameters left out), and the memory tracker's "activations" peak
                         (labkit.observe.memory, track_memory=True) under activation_tracker_bytes
  activation_peak_ratio  1F1B over GPipe at m = 2p, counted bytes, the peak rank of each (the one
                         memory must fit): under 1/2, as 1F1B's fullest rank (rank 0, p of m
                         micro-batches) is not GPipe's (the last stage: its logits are the largest)
  activation_tracker_ratio   the same from the memory tracker
  activation_ratio_per_rank  1F1B over GPipe on each rank, counted bytes; predicted (p-r)/m
                         (activation_ratio_per_rank_predicted): the live micro-batches' share;
                         the first and last ranks a little above it, as the batch's token ids /
                         targets are one storage that every micro-batch's embedding / loss saves
                         (a view of it), counted once however many micro-batches are live
  live_peak              per schedule, the most (chunk, micro-batch) activations held per rank
  step_s_ours, step_s_torch, step_ratio   median step (the slowest rank's) of "pp" and "torch-pp",
                         both 1F1B, interleaved --rounds times, a warm-up step each
  zero_bubble            per schedule ("1f1b", "zb-h1", "zbv" with v=2), the replayed bubble of the
                         orders the ranks recorded on the same footing: F = B = W = 1 slot, 1F1B's
                         B (input and weight gradients at once) 2 slots (bubble_fraction(...,
                         backward_slots=2)); zero_bubble_ratio: each over 1F1B's
  zero_bubble_live_peak, zero_bubble_peak_bytes   per schedule, live (chunk, micro-batch)
                         activations per rank (to W: zb-h1 holds p on every rank, zbv's chunks are
                         half a stage each) and the fullest rank's bytes saved for backward
  zero_bubble_step_s, zero_bubble_step_ratio   median step of "pp" under each schedule (the
                         slowest rank's), in the same launch, interleaved --rounds times; the ratio
                         over 1F1B's. On CPU, W walks the chunk's graph again (runtime.py), so the
                         split backward costs more compute than 1F1B's; the bubble it removes is
                         what the ratio weighs against that
  load                   the 1-minute load average after the launch (labkit.checks.load_report)
Model: PRESETS["bench"] with 6 blocks (8 children: embedding, 6 blocks, head; 2 per rank, one per
chunk interleaved), 16 rows of 64 tokens, m = 8 micro-batches of 2 rows, p = 4.
On the shared 2-core machine timings are noisy: read the ratio, and the load line.
Left out: NCCL / GPUs, transfer time in the bubble (the replay gives transfers no time), torch's
zero-bubble classes' step time (torch-pp runs them; timed here is ours).
"""

import argparse
import contextlib
import json
import statistics
import sys

import labkit
from labkit import loop
from labkit.checks import load_line, load_report
from labkit.strategies.pp import bubble_fraction, live_peak, predicted_bubble

P, M = 4, 8
PRESET = loop.PRESETS["bench"].replace(gpt=dict(d_model=128, n_heads=4, n_layers=6))
SCHEDULES = {
    "gpipe": dict(schedule="gpipe"),
    "1f1b": dict(schedule="1f1b"),
    "interleaved": dict(schedule="interleaved", virtual_stages=2),
}
ZERO_BUBBLE = {  # against 1F1B, on the same footing
    "1f1b": dict(schedule="1f1b"),
    "zb-h1": dict(schedule="zb-h1"),
    "zbv": dict(schedule="zbv", virtual_stages=2),
}


def _record(s):
    return {"record": s.pipeline.record}


def _rank(cfg, steps, rounds):
    report = loop.Hooks(report=_record)
    common = dict(steps=1, return_state=False, spans=False, n_microbatches=M)
    out = {"records": {}, "tracker": {}}
    for name, options in SCHEDULES.items():
        out["records"][name] = loop.train("pp", cfg, hooks=report, **common, **options)["record"]
        tracked = loop.train("pp", cfg, track_memory=True, **common, **options)
        out["tracker"][name] = tracked["peak_by_category"].get("activations", 0)
    order = ("pp", "torch-pp")
    timed = loop.sweep(
        [dict(strategy=s) for s in order * rounds],
        cfg=cfg,
        steps=steps,
        hooks=loop.Hooks(warmup=1),
        return_state=False,
        spans=False,
        n_microbatches=M,
        schedule="1f1b",
    )
    out["step_s"] = {s: [t for r in timed[i :: len(order)] for t in r["step_s"]] for i, s in enumerate(order)}
    out["zb_records"] = {
        name: loop.train("pp", cfg, hooks=report, **common, **options)["record"]
        for name, options in ZERO_BUBBLE.items()
    }
    runs = [dict(strategy="pp", **options) for options in ZERO_BUBBLE.values()] * rounds
    timed = loop.sweep(
        runs,
        cfg=cfg,
        steps=steps,
        hooks=loop.Hooks(warmup=1),
        return_state=False,
        spans=False,
        n_microbatches=M,
    )
    out["zb_step_s"] = {
        name: [t for r in timed[i :: len(ZERO_BUBBLE)] for t in r["step_s"]]
        for i, name in enumerate(ZERO_BUBBLE)
    }
    return out


def bench(steps, rounds):
    results = labkit.run(_rank, PRESET, steps, rounds, world_size=P, timeout=900)
    load = load_report(P)
    measured, predicted, live, counted, tracker, per_rank = {}, {}, {}, {}, {}, {}
    for name, options in SCHEDULES.items():
        records = [r["records"][name] for r in results]
        measured[name] = bubble_fraction([rec.actions for rec in records])
        predicted[name] = predicted_bubble(P, M, options.get("virtual_stages", 1))
        live[name] = [rec.peak_live for rec in records]
        counted[name] = max(rec.peak_live_bytes for rec in records)
        per_rank[name] = [rec.peak_live_bytes for rec in records]
        tracker[name] = max(r["tracker"][name] for r in results)

    def median_step(name):  # a step takes as long as its slowest rank
        return statistics.median(max(v) for v in zip(*(r["step_s"][name] for r in results)))

    ours, theirs = median_step("pp"), median_step("torch-pp")
    zb_bubble, zb_live, zb_bytes, zb_step = {}, {}, {}, {}
    for name in ZERO_BUBBLE:
        records = [r["zb_records"][name] for r in results]
        # a classic B does the input and the weight gradients: two slots beside F = B = W = 1
        zb_bubble[name] = bubble_fraction(
            [rec.actions for rec in records], backward_slots=1 if name != "1f1b" else 2
        )
        zb_live[name] = [live_peak(rec.actions) for rec in records]
        zb_bytes[name] = max(rec.peak_live_bytes for rec in records)
        zb_step[name] = statistics.median(max(v) for v in zip(*(r["zb_step_s"][name] for r in results)))
    return {
        "bubble_measured": measured,
        "bubble_predicted": predicted,
        "bubble_match": {k: abs(measured[k] - predicted[k]) < 1e-12 for k in measured},
        "live_peak": live,
        "activation_peak_bytes": counted,
        "activation_tracker_bytes": tracker,
        "activation_peak_ratio": counted["1f1b"] / counted["gpipe"],
        "activation_ratio_per_rank": [a / b for a, b in zip(per_rank["1f1b"], per_rank["gpipe"])],
        "activation_ratio_per_rank_predicted": [(P - r) / M for r in range(P)],
        "activation_tracker_ratio": tracker["1f1b"] / tracker["gpipe"] if tracker["gpipe"] else None,
        "step_s_ours": ours,
        "step_s_torch": theirs,
        "step_ratio": ours / theirs,
        "zero_bubble": zb_bubble,
        "zero_bubble_ratio": {k: zb_bubble[k] / zb_bubble["1f1b"] for k in ZERO_BUBBLE},
        "zero_bubble_live_peak": zb_live,
        "zero_bubble_peak_bytes": zb_bytes,
        "zero_bubble_step_s": zb_step,
        "zero_bubble_step_ratio": {k: zb_step[k] / zb_step["1f1b"] for k in ZERO_BUBBLE},
        "p": P,
        "m": M,
        "load": load,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (after 1 warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of pp and torch-pp")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # With --json, stdout holds the JSON alone (labkit's once-per-kernel notes go to stderr).
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        row = bench(args.steps, args.rounds)
    if args.json:
        print(json.dumps(row, indent=2))
        return
    print(f"model {PRESET.gpt_config()}, batch {PRESET.batch_size}, p={P}, m={M}, gloo")
    for name in SCHEDULES:
        print(
            f"{name:12s} bubble measured {row['bubble_measured'][name]:.4f} predicted "
            f"{row['bubble_predicted'][name]:.4f} ({'match' if row['bubble_match'][name] else 'MISMATCH'}); "
            f"live activations per rank {row['live_peak'][name]}, peak "
            f"{row['activation_peak_bytes'][name] / 2**20:.2f} MiB saved for backward"
        )
    print(
        f"activation peak 1F1B / GPipe: {row['activation_peak_ratio']:.3f} (counted), "
        f"{row['activation_tracker_ratio']} (memory tracker); per rank "
        f"{[round(r, 3) for r in row['activation_ratio_per_rank']]}, predicted (p-r)/m "
        f"{row['activation_ratio_per_rank_predicted']}"
    )
    print(
        f"step (1F1B): ours {1e3 * row['step_s_ours']:.1f} ms, torch {1e3 * row['step_s_torch']:.1f} ms "
        f"(ratio {row['step_ratio']:.2f})"
    )
    for name in ZERO_BUBBLE:
        print(
            f"{name:12s} bubble (F = B = W = 1, 1F1B's B = 2) {row['zero_bubble'][name]:.4f} "
            f"({row['zero_bubble_ratio'][name]:.2f} x 1F1B's); live per rank "
            f"{row['zero_bubble_live_peak'][name]}, peak {row['zero_bubble_peak_bytes'][name] / 2**20:.2f} MiB; "
            f"step {1e3 * row['zero_bubble_step_s'][name]:.1f} ms ({row['zero_bubble_step_ratio'][name]:.2f} x 1F1B's)"
        )
    print(load_line(row["load"]))


if __name__ == "__main__":
    main()
