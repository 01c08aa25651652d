"""The ZeRO strategies (labkit.strategies.zero.stages): zero1 / zero2 against loop.reference and
torch-zero1 with gradient accumulation (nothing on the wire before the last micro-batch, zero2's
reduce-scatters during backward), and on the lab's preset the measured memory (gradient bytes at
the end of backward) and the bytes communicated. No timing asserts (the machine is shared)."""

import pytest
import torch

import labkit
from labkit import loop
from labkit.checks import compare
from labkit.strategies.zero import FlatLayout, backward_grad_bytes
from labkit.strategies.zero.stages import BUCKET_CAP_MB, LAST_BUCKET_MB

F64 = dict(rtol=1e-9, atol=1e-12)  # float64: only the summation order differs (ranks, micro-batches)


def _collectives_in(trace, window):
    lo, hi = window
    return [e for e in trace["events"] if e["kind"] == "collective" and lo <= e["start"] <= hi]


def _backward_windows(trace, accum_steps):
    """Per step: the windows of its micro-batches' backward spans."""
    steps = [(s["start"], s["end"]) for s in trace["spans"] if s["name"] == "step"]
    backward = [(s["start"], s["end"]) for s in trace["spans"] if s["name"] == "backward"]
    out = [[w for w in backward if lo <= w[0] <= hi] for lo, hi in steps]
    assert all(len(ws) == accum_steps for ws in out)
    return out


# toy: tiny buckets (one per parameter or so) and all-gather runs, so every path runs
RUNS = {
    "toy": [("zero1", {}), ("zero2", dict(bucket_cap_mb=0.0005)), ("torch-zero1", {})],
    "zero": [("zero1", {}), ("zero2", {}), ("torch-zero1", {})],
}  # zero2: its defaults


def _sweep_one_by_one(name, cfg, steps, accum_steps, options):
    return loop.train(name, cfg, steps, accum_steps=accum_steps, **options)


@pytest.mark.parametrize("preset", ["toy", "zero"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_strategies_match_reference_and_torch_with_accumulation(preset, world_size):
    cfg = loop.PRESETS[preset].replace(dtype=torch.float64, batch_size=12 if preset == "toy" else 6)
    steps, accum = 3, 2
    reference = loop.reference(cfg, steps)
    runs = {}
    for name, options in RUNS[preset]:
        runs[name] = labkit.run(
            _sweep_one_by_one, name, cfg, steps, accum, options, world_size=world_size, timeout=300
        )
    for name, results in runs.items():
        for rank, out in enumerate(results):
            for what in ("state", "grads"):
                assert set(out[what]) == set(reference[what]), (name, what)
                compare(
                    reference[what], out[what], **F64, rank=rank, label=f"{name} {what} vs loop.reference"
                ).raise_if_failed()
            compare(
                runs["torch-zero1"][rank]["state"],
                out["state"],
                **F64,
                rank=rank,
                label=f"{name} vs torch-zero1",
            ).raise_if_failed()
            assert max(abs(a - b) for a, b in zip(reference["losses"], out["losses"])) < 1e-12
        for rank, trace in enumerate(results.traces):
            for step, (first, last) in enumerate(_backward_windows(trace, accum)):
                # no_sync: nothing on the wire during the first micro-batch's backward
                assert _collectives_in(trace, first) == [], (name, rank, step)
                launched = [e["op"] for e in _collectives_in(trace, last)]
                if name == "zero2" and preset == "zero":  # every parameter used: all in backward
                    assert launched and set(launched) == {"ring_reduce_scatter"}, (rank, step, launched)
                if name == "zero1":  # one reduce-scatter, after backward
                    assert launched == []


def _memory_runs(names, cfg, steps):
    return {
        name: loop.train(name, cfg, steps, track_memory=True, return_state=False, spans=True)
        for name in names
    }


def _wire_bytes(trace):
    """Bytes this rank sent inside the steps: a ring all-reduce of S bytes sends 2(n-1)/n S, a
    reduce-scatter or all-gather of S (the whole tensor) (n-1)/n S."""
    steps = [(s["start"], s["end"]) for s in trace["spans"] if s["name"] == "step"]
    total = 0.0
    for e in trace["events"]:
        if e["kind"] != "collective" or not any(lo <= e["start"] <= hi for lo, hi in steps):
            continue
        n = e.get("world_size", trace["world_size"])
        total += e["nbytes"] * (n - 1) / n * (2 if "all_reduce" in e["op"] else 1)
    return total


def test_zero_memory_and_bytes_on_the_lab_preset():
    """The lab's TinyGPT (fp32, tied embedding) on 2 ranks, with the memory tracker: optimizer
    state 1/N of DDP's, gradient bytes at the end of backward (ZeRO-2: the shard plus at most two
    buckets), the steady state after the step, and RS + AG = AR on the wire."""
    world_size, steps, cfg = 2, 3, loop.PRESETS["zero"]
    names = ("ddp-bucketed", "zero1", "zero2")
    results = labkit.run(_memory_runs, names, cfg, steps, world_size=world_size, timeout=300)
    model = loop.build_model(cfg)
    P = sum(p.numel() for p in model.parameters())
    counters = 4 * len(list(model.parameters()))  # one 4-byte step counter per AdamW tensor
    layout = FlatLayout(model.parameters(), world_size, BUCKET_CAP_MB, LAST_BUCKET_MB)  # zero2's
    two_buckets = 4 * sum(sorted(b.padded_numel for b in layout.buckets)[-2:])
    for rank, runs in enumerate(results):
        after = {n: runs[n]["memory"].samples[-1].by_category for n in names}  # after the step
        assert abs(after["ddp-bucketed"]["optimizer"] - (8 * P + counters)) <= counters
        assert abs(after["zero1"]["optimizer"] - 8 * P / world_size) <= counters + 8 * world_size
        assert after["zero1"]["gradients"] == 4 * FlatLayout(model.parameters(), world_size).numel
        assert after["zero2"]["gradients"] == 4 * layout.shard_numel  # only the shard survives
        ddp_grads = backward_grad_bytes(runs["ddp-bucketed"]["memory"])
        zero2_grads = backward_grad_bytes(runs["zero2"]["memory"])
        assert len(ddp_grads) == len(zero2_grads) == steps and min(ddp_grads) == 4 * P
        for got in zero2_grads:
            assert 4 * layout.shard_numel <= got <= 4 * P / world_size + two_buckets, (rank, got)
        # Through all of backward, never more than the shard and two buckets (the one on the wire,
        # the one filling): the gradients accumulate in their send buffer, none is held twice.
        most = max(s.by_category["gradients"] for s in runs["zero2"]["memory"].samples)
        assert most <= 4 * layout.shard_numel + two_buckets, (rank, most)
        assert runs["zero2"]["peak"] < runs["zero1"]["peak"] < runs["ddp-bucketed"]["peak"]
    # one launch ran the three strategies one after the other: split the trace by their steps
    for trace in results.traces:
        step_spans = [s for s in trace["spans"] if s["name"] == "step"]
        sent = [
            _wire_bytes(dict(trace, spans=step_spans[i * steps : (i + 1) * steps])) for i in range(len(names))
        ]
        assert sent[0] > 0
        for stage_sent in sent[1:]:  # padding: at most N-1 elements per bucket per collective
            assert abs(stage_sent - sent[0]) <= 8 * world_size * steps * len(layout.buckets)


def test_zero_options_torch_reduce_scatter_and_avg():
    """comm="torch" (the backend's reduce_scatter_tensor) and reduce_op="avg" (the
    loop then scales the loss by N) train the toy exactly like the ring with SUM; one launch."""
    cfg = loop.PRESETS["toy"].replace(dtype=torch.float64)
    options = [
        dict(comm="torch"),
        dict(reduce_op="avg"),
        dict(comm="torch", reduce_op="avg"),
    ]
    runs = [dict(strategy=name, **o) for name in ("zero1", "zero2") for o in options]
    reference = loop.reference(cfg, 3)
    results = labkit.run(
        loop.sweep, runs, cfg=cfg, steps=3, accum_steps=2, spans=False, world_size=3, timeout=300
    )
    for rank, outs in enumerate(results):
        for run, out in zip(runs, outs):
            for what in ("state", "grads"):
                compare(reference[what], out[what], **F64, rank=rank, label=f"{run} {what}").raise_if_failed()
