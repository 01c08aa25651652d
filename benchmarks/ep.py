"""Expert parallelism by hand ("ep") on gloo ranks, in one launch: labkit's all-to-all against
gloo's, the all-to-alls' traced bytes per step against the formula, and a step of "ep" against
data parallelism on the same MoE model.

    .venv/bin/python benchmarks/ep.py            # a table
    .venv/bin/python benchmarks/ep.py --json     # the same numbers as JSON (stdout: the JSON alone)

Keys:
  a2a_ms_ours, a2a_ms_gloo   median time (the slowest rank's, between barriers) of
                         labkit.comm.all_to_all_single and dist.all_to_all_single on an input of
                         64 KiB and of 16 MiB per rank (float32, equal splits), interleaved reps
  a2a_ratio              ours / gloo at each size (at 64 KiB every rank's rows ride in the
                         first message, the check's: one round; at 16 MiB they follow it)
  a2a_bytes_measured     bytes every all_to_all_single event of --steps steps of "ep" sent (the
                         tracer's intra + inter bytes), per step, per rank
  a2a_bytes_formula      labkit.strategies.ep.a2a_bytes summed over the MoE layers, from each
                         step's kept-assignment table (dispatch, combine and both backwards)
  a2a_bytes_vs_formula   measured / formula per rank: exactly 1
  step_s_ep, step_s_ddp, step_ratio   median step (the slowest rank's) of "ep" (experts split over
                         every rank) and "ddp-flat" (every rank holds every expert and routes its
                         own tokens; find_unused_parameters=True), interleaved --rounds times, a
                         warm-up step each, no spans
  load                   the load line (labkit.checks.load_report), read right after the launch
Model: PRESETS["bench"] with MoE blocks (4 experts, top-2, dropless): TinyGPT d_model 128, 4 heads,
4 layers, 64-token rows, 16 rows.
On the shared 2-core machine timings are noisy: read the ratios, and the load line.
Left out: NCCL / GPUs, the simulated inter-node link (nodes=), capacity drops, ep < world size.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import labkit
from labkit import loop
from labkit.checks import load_line, load_report

BENCH = loop.PRESETS["bench"]
PRESET = BENCH.replace(gpt={**BENCH.gpt, "n_experts": 4, "top_k": 2})
SIZES = {"64KiB": 64 << 10, "16MiB": 16 << 20}


def _timed(fn):
    """Slowest rank's time for one call, between barriers."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _a2a_times(reps):
    n = dist.get_world_size()
    out = {}
    for label, nbytes in SIZES.items():
        x = torch.ones(nbytes // 4 // n * n)
        y = torch.empty_like(x)
        fns = {
            "ours": lambda: labkit.comm.all_to_all_single(y, x),
            "gloo": lambda: dist.all_to_all_single(y, x),
        }
        times = {k: [] for k in fns}
        for fn in fns.values():  # warm-up: connections, the mailbox's buffers
            _timed(fn)
        for _ in range(reps):
            for k, fn in fns.items():  # interleaved: drift hits both alike
                times[k].append(_timed(fn))
        out[label] = {k: statistics.median(v) for k, v in times.items()}
    return out


def _rank(cfg, steps, rounds, reps):
    from labkit.observe import tracing
    from labkit.strategies import ep

    a2a = _a2a_times(reps)
    formula = []

    def count(s, _):  # after each step: the formula from that step's routing
        itemsize = cfg.dtype.itemsize
        formula.append(sum(ep.a2a_bytes(m, itemsize) for m in ep.moe_layers(s.model).values()))

    before = len(tracing._recorder.events)
    loop.train("ep", cfg, steps, spans=False, return_state=False, hooks=loop.Hooks(after_step=count))
    events = [e for e in tracing._recorder.events[before:] if e["op"] == "all_to_all_single"]
    measured = sum(e.get("intra_bytes", 0) + e.get("inter_bytes", 0) for e in events)
    common = dict(cfg=cfg, steps=steps, return_state=False, spans=False, hooks=loop.Hooks(warmup=1))
    order = ("ep", "ddp-flat")
    runs = [dict(strategy="ep"), dict(strategy="ddp-flat", find_unused_parameters=True)]
    timed = loop.sweep(runs * rounds, **common)
    return {
        "a2a": a2a,
        "measured": measured / steps,
        "formula": sum(formula) / steps,
        "step_s": {s: [t for r in timed[i :: len(order)] for t in r["step_s"]] for i, s in enumerate(order)},
    }


def bench(world_size, steps, rounds, reps):
    results = labkit.run(_rank, PRESET, steps, rounds, reps, world_size=world_size, timeout=900)
    load = load_report(world_size)

    def median_step(name):  # a step takes as long as its slowest rank
        return statistics.median(max(v) for v in zip(*(r["step_s"][name] for r in results)))

    a2a = results[0]["a2a"]  # the same on every rank (all-reduced MAX)
    ep_s, ddp_s = median_step("ep"), median_step("ddp-flat")
    return {
        "world_size": world_size,
        "a2a_ms_ours": {k: 1e3 * v["ours"] for k, v in a2a.items()},
        "a2a_ms_gloo": {k: 1e3 * v["gloo"] for k, v in a2a.items()},
        "a2a_ratio": {k: v["ours"] / v["gloo"] for k, v in a2a.items()},
        "a2a_bytes_measured": [r["measured"] for r in results],
        "a2a_bytes_formula": [r["formula"] for r in results],
        "a2a_bytes_vs_formula": [r["measured"] / r["formula"] for r in results],
        "step_s_ep": ep_s,
        "step_s_ddp": ddp_s,
        "step_ratio": ep_s / ddp_s,
        "load": load,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per run (timed ones after 1 warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of ep and ddp-flat")
    parser.add_argument("--reps", type=int, default=10, help="all-to-all reps per size and variant")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # With --json, stdout holds the JSON alone (labkit's once-per-kernel notes go to stderr).
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        row = bench(args.world_size, args.steps, args.rounds, args.reps)
    if args.json:
        print(json.dumps(row, indent=2))
        return
    print(f"model {PRESET.gpt_config()}, batch {PRESET.batch_size}, {args.world_size} ranks, gloo")
    for size in SIZES:
        print(
            f"all_to_all_single {size}: ours {row['a2a_ms_ours'][size]:.2f} ms, gloo "
            f"{row['a2a_ms_gloo'][size]:.2f} ms (ratio {row['a2a_ratio'][size]:.2f})"
        )
    print(
        f"all-to-all bytes per step per rank: measured {row['a2a_bytes_measured']}, formula "
        f"{row['a2a_bytes_formula']} (ratio {row['a2a_bytes_vs_formula']})"
    )
    print(
        f"step: ep {1e3 * row['step_s_ep']:.1f} ms, ddp-flat {1e3 * row['step_s_ddp']:.1f} ms "
        f"(ratio {row['step_ratio']:.2f})"
    )
    print(load_line(row["load"]))


if __name__ == "__main__":
    main()
