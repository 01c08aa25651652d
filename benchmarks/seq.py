"""Long sequences by hand: sequence parallelism ("sp"), context parallelism ("cp", ring
attention) and Ulysses ("ulysses", all-to-alls around attention) on 2 gloo ranks, against tensor
parallelism ("tp") and one process, in two launches (2 ranks; 1 rank for the one-process baselines).

    .venv/bin/python benchmarks/seq.py            # a table
    .venv/bin/python benchmarks/seq.py --json     # the same numbers as JSON (stdout: the JSON alone)

Keys (model: PRESETS["bench"], TinyGPT d_model C=128, 4 heads, L=4 layers, T=64-token rows, B=16
rows; n = 2 ranks; s = 4 bytes (fp32); S = B T C s, one residual-stream activation):
  activation_peak_bytes   {"tp", "sp", "cp", "ulysses", "one"}: the "activations" category at
                          labkit.observe.memory's peak (the busiest rank), 2 steps each: "tp" and
                          "sp" at tp=2 (every rank the whole batch), "cp" at cp=2 zigzag and
                          "ulysses" at ulysses=2 (every rank half of every row), "one": "cp" at
                          cp=1 in a 1-rank launch (ring attention of one rank = one process's
                          attention; the same model code, the whole rows)
  sp_over_tp_activations  sp / tp: below 1, the LayerNorms, residuals and the MLP's and attention's
                          inputs are 1/tp of the sequence (the gathered qkv / fc inputs are not)
  cp_over_one_activations cp / one: near 1/cp, every activation is of the rank's half of the rows
  wire_bytes_per_step     {"tp", "sp", "cp", "ulysses"}: the bytes this rank's hand-written collectives and
                          p2p messages sent (the tracer's intra + inter-node counts, labkit.comm.
                          _link) inside the "step" spans, per step (the busiest rank)
  wire_bytes_predicted    tp: 4 L all-reduces of S, each sending 2 (n-1)/n S;
                          sp: the same 4 L pairs as all-gather + reduce-scatter ((n-1)/n S each,
                          so the blocks' bytes equal tp's) + split_to_sp's backward and
                          unsplit_from_sp's forward all-gathers (2 (n-1)/n S) + the all-reduce of
                          every block's 6 replicated vectors used on a sequence piece (ln1, ln2
                          weight and bias, attn.proj and mlp.2 bias: 6 L, 2 (n-1)/n C s each);
                          cp: per layer the ring (below, forward + backward) + the gradients'
                          all-reduce, 2 (n-1)/n P s (P parameters);
                          ulysses: per layer 8 all-to-alls (below) + the same all-reduce.
                          (n = 2: labkit's direct exchange sends these same bytes, plus its
                          64-byte header per message, counted in: n - 1 per collective.)
  wire_bytes_match        measured == predicted, exactly, for each
  ring_bytes              one layer's ring attention alone (q, k, v of B x H x T/n x D, fp32,
                          zigzag, causal): measured sendrecv bytes per rank, forward and backward,
                          and predicted: forward (n-1) pieces of K and V = 2 (n-1)/n x (one
                          layer's K, B H T D s) = (n-1)/n of its K and V together; backward
                          (n-1) pieces of K, V, dK, dV + one of dK, dV = (4 (n-1) + 2)/n x (K)
  ring_bytes_match        measured == predicted, exactly
  a2a_bytes               one layer's Ulysses attention alone (the same q, k, v): measured
                          all-to-all bytes per rank, forward and backward, and predicted
                          (ulysses.layer_bytes): 4 all-to-alls each way (q, k, v in, the output
                          back; backward the reverse), each (n-1)/n of the rank's B (T/n) C s
                          piece: forward 4 (n-1)/n^2 x (one layer's K), against the ring's
                          2 (n-1)/n (+ headers). It falls like 1/n; the ring's stays near 2 K
  a2a_bytes_match         measured == predicted, exactly
  train_step_s            {"cp", "ulysses"}: median wall time of a training step (the traced
                          runs' steps after the first, the slowest rank)
  attention_flops         {"contiguous", "zigzag"}: per rank, causal, what ring_attention counted
                          (labkit.strategies.cp.count_attention_flops) and the formula
                          (attention_flops); "imbalance": slowest rank / mean (formula: 2n/(n+1)
                          contiguous, 1 zigzag)
  attention_cpu_s         {"contiguous", "zigzag"}: per rank, the main thread's CPU seconds of
                          --reps ring-attention forwards (time.thread_time: the compute, not the
                          comm thread's), the busiest rank over the idlest ("spread")
  ring_step_s, one_step_s, ring_over_one   median wall time (after a warm-up) of ring
                          attention's forward + backward on 2 ranks (zigzag, causal, the slowest
                          rank) and of one process's scaled_dot_product_attention on the whole
                          sequence (1-rank launch, 1 thread as each rank; torch's fused CPU
                          kernel, not the same matmuls)
  ring_one_rank_step_s, ring_over_ring_one_rank   the same code as a ring of one rank on the whole
                          sequence (plain matmuls, like the 2 ranks' blocks), and 2 ranks over it
  ulysses_step_s, ulysses_over_ring   Ulysses attention's forward + backward on 2 ranks (median,
                          slowest rank, after a warm-up; plain matmuls on whole sequences of
                          H/n heads), and over the ring's
  load                    the load average read after each launch (labkit.checks.load_report)
On the shared 2-core machine timings are noisy: read the byte and FLOP counts as exact, the CPU
time spread as a trend, the wall-time ratio as the least reliable.
Left out: NCCL / GPUs, n > 2, torch's context_parallel (it does not run on CPU), long sequences
(the model's 64 positions; the lab's cost model extrapolates), DeepSpeed's own Ulysses.
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
from labkit.comm._crosscheck import HEADER_BYTES

PRESET = loop.PRESETS["bench"]
N = 2
TRAINED = ("tp", "sp", "cp", "ulysses")


def _attention_shape(cfg, n):
    g = cfg.gpt_config()
    return cfg.batch_size, g.n_heads, cfg.seq_len // n, g.d_model // g.n_heads


def _ring_alone(cfg, reps):
    """One layer's ring attention: traced windows, counted FLOPs, CPU time, wall time."""
    import time

    import torch.distributed as dist

    from labkit.observe import tracing
    from labkit.strategies import cp

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    b, h, t, d = _attention_shape(cfg, 1)
    q, k, v, dout = (torch.randn(b, h, t, d, generator=g) for _ in range(4))
    out = {"flops": {}, "cpu_s": {}}

    def pieces(layout):
        return [cp.shard(x, 2, layout, rank, n).requires_grad_() for x in (q, k, v)]

    mine = pieces("zigzag")
    start = tracing.clock()
    y = cp.ring_attention(*mine, causal=True, layout="zigzag")
    middle = tracing.clock()
    y.backward(cp.shard(dout, 2, "zigzag", rank, n))
    out["windows"] = (start, middle, tracing.clock())
    for layout in cp.LAYOUTS:
        mine = pieces(layout)
        with torch.no_grad(), cp.count_attention_flops() as counted:
            dist.barrier()
            cpu = time.thread_time()
            for _ in range(reps):
                cp.ring_attention(*mine, causal=True, layout=layout)
            out["cpu_s"][layout] = time.thread_time() - cpu
        out["flops"][layout] = counted["flops"] // reps
    walls = []
    mine = pieces("zigzag")
    for _ in range(reps + 1):  # the first one a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        cp.ring_attention(*mine, causal=True, layout="zigzag").backward(cp.shard(dout, 2, "zigzag", rank, n))
        walls.append(time.perf_counter() - t0)
    out["step_s"] = walls[1:]
    return out


def _ulysses_alone(cfg, reps):
    """One layer's Ulysses attention on the same q, k, v as _ring_alone: traced windows, wall time."""
    import time

    import torch.distributed as dist

    from labkit.observe import tracing
    from labkit.strategies import cp, ulysses

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    b, h, t, d = _attention_shape(cfg, 1)
    q, k, v, dout = (torch.randn(b, h, t, d, generator=g) for _ in range(4))
    mine = [cp.shard(x, 2, "contiguous", rank, n).requires_grad_() for x in (q, k, v)]
    piece = cp.shard(dout, 2, "contiguous", rank, n)
    start = tracing.clock()
    y = ulysses.ulysses_attention(*mine, causal=True)
    middle = tracing.clock()
    y.backward(piece)
    out: dict = {"windows": (start, middle, tracing.clock())}
    walls = []
    for _ in range(reps + 1):  # the first one a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        ulysses.ulysses_attention(*mine, causal=True).backward(piece)
        walls.append(time.perf_counter() - t0)
    out["step_s"] = walls[1:]
    return out


def _train_windows(cfg, name, steps):
    """(start, end) of a traced run, and its median step time."""
    from labkit.observe import tracing

    lo = tracing.clock()
    run = loop.train(name, cfg, steps, spans=True, return_state=False)
    return (lo, tracing.clock()), run["median_step_s"]


def _two_ranks(cfg, steps, reps):
    peaks = {
        name: loop.train(name, cfg, 2, spans=False, return_state=False, track_memory=True)[
            "peak_by_category"
        ]["activations"]
        for name in TRAINED
    }
    runs = {name: _train_windows(cfg, name, steps) for name in TRAINED}
    return {
        "activations": peaks,
        "windows": {name: window for name, (window, _) in runs.items()},
        "step_s": {name: step for name, (_, step) in runs.items()},
        "ring": _ring_alone(cfg, reps),
        "ulysses": _ulysses_alone(cfg, reps),
    }


def _one_rank(cfg, reps):
    import time

    import torch.nn.functional as F

    peak = loop.train("cp", cfg, 2, spans=False, return_state=False, track_memory=True, cp=1)
    g = torch.Generator().manual_seed(0)
    b, h, t, d = _attention_shape(cfg, 1)
    q, k, v = (torch.randn(b, h, t, d, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, t, d, generator=g)
    from labkit.strategies.cp import ring_attention

    # One thread, as each of the 2 ranks gets on 2 cores (labkit.run: cores // world_size): a
    # 1-rank launch would get 2, whose op-level threads stall behind other processes on a busy machine.
    torch.set_num_threads(1)
    walls: dict = {"sdpa": [], "ring": []}
    for _ in range(reps + 1):  # the first round a warm-up
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
        walls["sdpa"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ring_attention(q, k, v, causal=True, layout="zigzag").backward(dout)  # a ring of one
        walls["ring"].append(time.perf_counter() - t0)
    return {
        "activations": peak["peak_by_category"]["activations"],
        "step_s": {k: v[1:] for k, v in walls.items()},
    }


def _wire(trace, lo, hi):
    """Wire bytes of the collectives starting inside "step" spans within [lo, hi]."""
    steps = [(s["start"], s["end"]) for s in trace["spans"] if s["name"] == "step" and lo <= s["start"] <= hi]
    total = sum(
        e.get("intra_bytes", 0) + e.get("inter_bytes", 0)
        for e in trace["events"]
        if e["kind"] == "collective" and any(a <= e["start"] <= b for a, b in steps)
    )
    return total, len(steps)


def predicted_wire(cfg, n):
    """The docstring's formulas, plus the HEADER_BYTES (64) every direct-exchange message carries
    (all of these collectives are at most DIRECT_MAX_BYTES: one message to each of n - 1 peers)."""
    g = cfg.gpt_config()
    s = torch.empty((), dtype=cfg.dtype).element_size()
    layers, c = g.n_layers, g.d_model
    big = cfg.batch_size * cfg.seq_len * c * s  # S
    all_reduce = 2 * (n - 1) / n
    header = HEADER_BYTES * (n - 1)  # per collective
    tp = 4 * layers * (all_reduce * big + header)
    gather = (n - 1) / n * big + header  # one all-gather or reduce-scatter of S
    sp = 4 * layers * 2 * gather + 2 * gather + 6 * layers * (all_reduce * c * s + header)
    params = list(loop.build_model(cfg).parameters())
    fwd, bwd = ring_predicted(cfg, n)
    grads = sum(all_reduce * p.numel() * s + header for p in params)
    cp_bytes = layers * (fwd + bwd) + grads
    ulysses_bytes = layers * 2 * a2a_predicted(cfg, n) + grads
    return {"tp": tp, "sp": sp, "cp": cp_bytes, "ulysses": ulysses_bytes}


def ring_predicted(cfg, n):
    """(forward, backward) sendrecv bytes per rank of one layer's ring attention."""
    b, h, t, d = _attention_shape(cfg, 1)
    one = b * h * t * d * torch.empty((), dtype=cfg.dtype).element_size()  # one layer's K
    return 2 * (n - 1) / n * one, (4 * (n - 1) + 2) / n * one


def a2a_predicted(cfg, n):
    """All-to-all wire bytes per rank of one layer's Ulysses attention forward (its backward the
    same): ulysses.layer_bytes, headers included."""
    from labkit.strategies.ulysses import layer_bytes

    s = torch.empty((), dtype=cfg.dtype).element_size()
    return layer_bytes(cfg.batch_size, cfg.seq_len, cfg.gpt_config().d_model, n, s)["wire"]


def _sent(trace, op, lo, hi):
    return sum(
        e["intra_bytes"] + e.get("inter_bytes", 0)
        for e in trace["events"]
        if e["op"] == op and lo <= e["start"] <= hi
    )


def bench(steps, reps):
    from labkit.strategies.cp import attention_flops, imbalance

    cfg = PRESET
    two = labkit.run(_two_ranks, cfg, steps, reps, world_size=N, timeout=900)
    load = [load_report(N)]
    one = labkit.run(_one_rank, cfg, reps, world_size=1, timeout=600)
    load.append(load_report(1))

    act = {k: max(r["activations"][k] for r in two) for k in TRAINED}
    act["one"] = one[0]["activations"]
    wire, predicted = {}, predicted_wire(cfg, N)
    for name in TRAINED:
        per_rank = []
        for rank, trace in enumerate(two.traces):
            total, count = _wire(trace, *two[rank]["windows"][name])
            if count != steps:
                raise RuntimeError(f"{name}: expected {steps} step spans, found {count}")
            per_rank.append(total / steps)
        wire[name] = max(per_rank)
    fwd_pred, bwd_pred = ring_predicted(cfg, N)
    ring_measured, a2a_measured = [], []
    for rank, trace in enumerate(two.traces):
        lo, mid, hi = two[rank]["ring"]["windows"]
        ring_measured.append([_sent(trace, "p2p_sendrecv", a, z) for a, z in ((lo, mid), (mid, hi))])
        lo, mid, hi = two[rank]["ulysses"]["windows"]
        a2a_measured.append([_sent(trace, "all_to_all_single", a, z) for a, z in ((lo, mid), (mid, hi))])
    a2a_pred = a2a_predicted(cfg, N)
    b, h, t, d = _attention_shape(cfg, 1)
    flops = {}
    for layout in ("contiguous", "zigzag"):
        counted = [r["ring"]["flops"][layout] for r in two]
        formula = attention_flops(t, N, layout=layout, causal=True, batch=b, heads=h, head_dim=d)
        flops[layout] = {
            "counted": counted,
            "formula": formula,
            "match": counted == formula,
            "imbalance": imbalance(counted),
        }
    cpu = {}
    for layout in ("contiguous", "zigzag"):
        per = [r["ring"]["cpu_s"][layout] for r in two]
        cpu[layout] = {"per_rank": per, "spread": max(per) / min(per)}
    ring_step = statistics.median(max(w) for w in zip(*(r["ring"]["step_s"] for r in two)))
    one_step = statistics.median(one[0]["step_s"]["sdpa"])
    one_ring_step = statistics.median(one[0]["step_s"]["ring"])
    ulysses_step = statistics.median(max(w) for w in zip(*(r["ulysses"]["step_s"] for r in two)))
    return {
        "activation_peak_bytes": act,
        "sp_over_tp_activations": act["sp"] / act["tp"],
        "cp_over_one_activations": act["cp"] / act["one"],
        "wire_bytes_per_step": wire,
        "wire_bytes_predicted": predicted,
        "wire_bytes_match": {k: wire[k] == predicted[k] for k in wire},
        "ring_bytes": {"measured": ring_measured, "predicted": [fwd_pred, bwd_pred]},
        "ring_bytes_match": all(m == [fwd_pred, bwd_pred] for m in ring_measured),
        "a2a_bytes": {"measured": a2a_measured, "predicted": [a2a_pred, a2a_pred]},
        "a2a_bytes_match": all(m == [a2a_pred, a2a_pred] for m in a2a_measured),
        "train_step_s": {k: max(r["step_s"][k] for r in two) for k in ("cp", "ulysses")},
        "attention_flops": flops,
        "attention_cpu_s": cpu,
        "ring_step_s": ring_step,
        "one_step_s": one_step,
        "ring_over_one": ring_step / one_step,
        "ring_one_rank_step_s": one_ring_step,
        "ring_over_ring_one_rank": ring_step / one_ring_step,
        "ulysses_step_s": ulysses_step,
        "ulysses_over_ring": ulysses_step / ring_step,
        "load": load,
        "steps": steps,
        "reps": reps,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="traced training steps per strategy")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the timed attention calls")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        row = bench(args.steps, args.reps)
    if args.json:
        print(json.dumps(row, indent=2))
        return
    mib = 2**20
    act = row["activation_peak_bytes"]
    print(f"model {PRESET.gpt_config()}, batch {PRESET.batch_size}, n={N}, gloo")
    print(
        f"activation peak per rank: tp {act['tp'] / mib:.2f} MiB, sp {act['sp'] / mib:.2f} MiB "
        f"(sp/tp {row['sp_over_tp_activations']:.2f}); cp {act['cp'] / mib:.2f} MiB, one rank "
        f"{act['one'] / mib:.2f} MiB (cp/one {row['cp_over_one_activations']:.2f}); ulysses "
        f"{act['ulysses'] / mib:.2f} MiB"
    )
    for k, v in row["wire_bytes_per_step"].items():
        ok = "match" if row["wire_bytes_match"][k] else "MISMATCH"
        print(
            f"{k} wire bytes per step: measured {v:.0f}, predicted {row['wire_bytes_predicted'][k]:.0f} ({ok})"
        )
    ring = row["ring_bytes"]
    print(
        f"ring bytes of one layer (fwd, bwd) per rank: measured {ring['measured']}, predicted "
        f"{ring['predicted']} ({'match' if row['ring_bytes_match'] else 'MISMATCH'})"
    )
    a2a = row["a2a_bytes"]
    print(
        f"ulysses all-to-all bytes of one layer (fwd, bwd) per rank: measured {a2a['measured']}, "
        f"predicted {a2a['predicted']} ({'match' if row['a2a_bytes_match'] else 'MISMATCH'})"
    )
    for layout, f in row["attention_flops"].items():
        cpu = row["attention_cpu_s"][layout]
        print(
            f"causal {layout}: FLOPs per rank {f['counted']} (formula {'match' if f['match'] else 'MISMATCH'}), "
            f"imbalance {f['imbalance']:.2f}; CPU s per rank {[round(c, 3) for c in cpu['per_rank']]} "
            f"(spread {cpu['spread']:.2f})"
        )
    print(
        f"attention fwd+bwd: ring on {N} ranks {1e3 * row['ring_step_s']:.1f} ms, one process's SDPA "
        f"{1e3 * row['one_step_s']:.1f} ms (ratio {row['ring_over_one']:.2f}), a ring of one rank "
        f"{1e3 * row['ring_one_rank_step_s']:.1f} ms (ratio {row['ring_over_ring_one_rank']:.2f}); "
        f"ulysses on {N} ranks {1e3 * row['ulysses_step_s']:.1f} ms (ulysses/ring {row['ulysses_over_ring']:.2f})"
    )
    steps = row["train_step_s"]
    print(
        f"training step (median, slowest rank): cp {1e3 * steps['cp']:.1f} ms, "
        f"ulysses {1e3 * steps['ulysses']:.1f} ms"
    )
    for what, load in zip(("2 ranks", "1 rank"), row["load"]):
        print(f"{what}: {load_line(load)}")


if __name__ == "__main__":
    main()
