"""ZeRO by hand (labkit.strategies.zero): the flat partition and its buckets, ShardedOptimizer
against single-process training and torch's ZeroRedundancyOptimizer, the zero1 / zero2
strategies against loop.reference and torch-zero1, accumulation without communication, and the
measured memory and bytes communicated. No timing asserts (the machine is shared)."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import labkit
from labkit import loop
from labkit.checks import compare
from labkit.models import ToyModel, TinyGPT
from labkit.strategies.zero import (FlatLayout, FlatPartition, ShardedOptimizer,
                                    backward_grad_bytes, per_tensor_partition)
from labkit.strategies.zero_stages import BUCKET_CAP_MB, LAST_BUCKET_MB


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_flat_partition_covers_every_element_once(world_size):
    partition = FlatPartition(ToyModel().parameters(), world_size)
    assert partition.numel == 433   # frozen_in.weight is left out; 433 is prime
    assert partition.padded_numel % world_size == 0
    assert partition.padded_numel - partition.numel < world_size
    covered = []
    for rank in range(world_size):
        start, end = partition.rank_range(rank)
        assert end - start + partition.padding(rank) == partition.chunk
        pieces = [(lo, hi) for _, lo, hi in partition.segments(rank)]
        assert sum(hi - lo for lo, hi in pieces) == end - start
        covered += [i for lo, hi in pieces for i in range(lo, hi)]
    assert covered == list(range(partition.numel))


def test_flat_partition_views_round_trip_and_tied_weight_once():
    model = TinyGPT()
    partition = FlatPartition(model.parameters(), 3)
    assert sum(p is model.tok_emb.weight for p in partition.params) == 1
    flat = partition.flatten([p.detach() for p in partition.params])
    assert flat[partition.numel:].eq(0).all()
    for p, view in zip(partition.params, partition.views(flat)):
        assert torch.equal(p, view)


def test_per_tensor_partition_is_imbalanced_flat_is_not():
    numels = [p.numel() for p in TinyGPT().parameters()]
    load = per_tensor_partition(numels, 4)
    assert sum(load) == sum(numels)
    assert max(load) > 1.05 * sum(numels) / 4   # whole tensors cannot split evenly
    assert FlatPartition(TinyGPT().parameters(), 4).chunk * 4 - sum(numels) < 4


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_flat_layout_buckets_shard_every_real_element_once(world_size):
    model = loop.build_model(loop.PRESETS["zero"])
    params = [p for p in model.parameters() if p.requires_grad]
    one = FlatLayout(params, world_size)
    assert len(one.buckets) == 1 and one.numel == FlatPartition(params, world_size).padded_numel
    layout = FlatLayout(params, world_size, bucket_cap_mb=0.3, last_bucket_mb=0.1)
    assert len(layout.buckets) > 4
    # bucket 0 holds the last parameters (backward's order); every bucket is whole parameters
    assert layout.buckets[0].params[-1] is params[-1] and sorted(map(id, layout.params)) == sorted(map(id, params))
    assert all(b.numel * 4 <= 0.3 * 2**20 or len(b.params) == 1 for b in layout.buckets)
    assert layout.buckets[-1].params[0] is params[0] and layout.buckets[-1].numel * 4 <= 0.1 * 2**20
    owned = []
    for rank in range(world_size):
        segments = layout.segments(rank)
        assert sum(hi - lo for _, lo, hi, _ in segments) <= layout.shard_numel
        for i, lo, hi, shard_lo in segments:
            assert layout.offsets[i] <= lo < hi <= layout.offsets[i] + layout.params[i].numel()
            b = next(b for b in range(len(layout.buckets)) if layout.bucket_slice(b).start <= lo < layout.bucket_slice(b).stop)
            rank_chunk = layout.rank_slice(b, rank)
            assert rank_chunk.start <= lo and hi <= rank_chunk.stop   # only this rank's chunks
            assert shard_lo - layout.shard_offsets[b] == lo - rank_chunk.start
        owned += [e for _, lo, hi, _ in segments for e in range(lo, hi)]
    real = [o + e for i, o in enumerate(layout.offsets) for e in range(layout.params[i].numel())]
    assert sorted(owned) == sorted(real)   # every real element once, padding never


# ---------------------------------------------------------------- ShardedOptimizer
OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
}


# float64, the same elementwise arithmetic on the same gradients, but not always bit-equal: a
# segment is a view at another offset, so the vectorized kernels take other elements through
# their scalar head/tail code (measured: a few elements 1 ulp apart after 3 AdamW steps).
LAST_BITS = dict(rtol=1e-12, atol=1e-15)


def _groups(model):
    """Two param groups of different lr and weight decay (weights / everything else)."""
    weights = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    others = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    return [{"params": weights}, {"params": others, "lr": 0.05, "weight_decay": 0.0}]


def _train_three(kind, steps=4):
    """Rank function: the toy model (frozen, tied, odd sizes; extra unused on even steps) trained
    on the same full batch on every rank (ZeroRedundancyOptimizer's contract) by the plain
    optimizer, ShardedOptimizer (one bucket, and buckets + coalesced all-gathers) and torch's
    ZeroRedundancyOptimizer; returns their states and the layout ShardedOptimizer's state dict names."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    cls, kwargs = OPTIMIZERS[kind]
    models = {name: ToyModel(seed=0, tied=True).double()
              for name in ("single", "sharded", "bucketed", "torch")}
    opts = {"single": cls(_groups(models["single"]), **kwargs),
            "sharded": ShardedOptimizer(_groups(models["sharded"]), cls, **kwargs),
            "bucketed": ShardedOptimizer(_groups(models["bucketed"]), optimizer_class=cls,
                                         bucket_cap_mb=0.0005, gather_cap_mb=0.001, **kwargs),
            "torch": ZeroRedundancyOptimizer(_groups(models["torch"]), optimizer_class=cls, **kwargs)}
    saved = None
    for step in range(steps):
        x, y = (t.double() for t in loop.global_batch(loop.PRESETS["toy"], step))
        for name, model in models.items():
            opts[name].zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x, use_extra=step % 2 == 1), y).backward()
            opts[name].step()
        if step == 1:
            saved = opts["sharded"].state_dict()
            opts["sharded"].param_groups[1]["lr"] = 0.02   # a changed option must take effect...
            for name in ("single", "bucketed", "torch"):
                opts[name].param_groups[1]["lr"] = 0.02
    states = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in models.items()}
    return states, saved["layout"]


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_sharded_optimizer_matches_single_process_and_zero_redundancy_optimizer(kind):
    for world_size in (2, 3):
        results = labkit.run(_train_three, kind, world_size=world_size, timeout=180)
        for rank, (states, layout) in enumerate(results):
            assert layout["world_size"] == world_size and layout["rank"] == rank
            for name in ("sharded", "bucketed", "torch"):
                compare(states["single"], states[name], **LAST_BITS, rank=rank,
                        label=f"{kind}: {name} vs single process").raise_if_failed()


def _state_dict_round_trip(kind):
    cls, kwargs = OPTIMIZERS[kind]
    data = [tuple(t.double() for t in loop.global_batch(loop.PRESETS["toy"], s)) for s in range(4)]

    def run(model, opt, steps):
        for x, y in steps:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    model = ToyModel(seed=0, tied=True).double()
    opt = ShardedOptimizer(_groups(model), cls, **kwargs)
    run(model, opt, data[:2])
    # a state dict holds the live state tensors (as torch's do): copy it before training on
    saved, weights = copy.deepcopy(opt.state_dict()), {k: v.clone() for k, v in model.state_dict().items()}
    run(model, opt, data[2:])
    fresh = ToyModel(seed=0, tied=True).double()
    fresh.load_state_dict(weights)
    opt2 = ShardedOptimizer(_groups(fresh), cls, **kwargs)
    opt2.load_state_dict(saved)
    run(fresh, opt2, data[2:])
    wrong = ShardedOptimizer(_groups(ToyModel(seed=0, tied=False).double()), cls, **kwargs)
    try:
        wrong.load_state_dict(saved)
        mismatch = None
    except ValueError as err:
        mismatch = str(err)
    return model.state_dict(), fresh.state_dict(), mismatch


@pytest.mark.parametrize("kind", ["sgd-momentum", "adamw"])
def test_sharded_optimizer_state_dict_round_trip(kind):
    for rank, (kept, resumed, mismatch) in enumerate(labkit.run(_state_dict_round_trip, kind, world_size=2)):
        compare(kept, resumed, rtol=0, atol=0, rank=rank, label="resumed from state_dict").raise_if_failed()
        assert mismatch is not None and "resharding" in mismatch


# ---------------------------------------------------------------- the strategies
F64 = dict(rtol=1e-9, atol=1e-12)   # float64: only the summation order differs (ranks, micro-batches)


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
RUNS = {"toy": [("zero1", {}), ("zero2", dict(bucket_cap_mb=0.0005, gather_cap_mb=0.001)),
                ("torch-zero1", {})],
        "zero": [("zero1", {}), ("zero2", {}), ("torch-zero1", {})]}   # zero2: its defaults


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
        runs[name] = labkit.run(_sweep_one_by_one, name, cfg, steps, accum, options,
                                world_size=world_size, timeout=300)
    for name, results in runs.items():
        for rank, out in enumerate(results):
            for what in ("state", "grads"):
                assert set(out[what]) == set(reference[what]), (name, what)
                compare(reference[what], out[what], **F64, rank=rank,
                        label=f"{name} {what} vs loop.reference").raise_if_failed()
            compare(runs["torch-zero1"][rank]["state"], out["state"], **F64, rank=rank,
                    label=f"{name} vs torch-zero1").raise_if_failed()
            assert max(abs(a - b) for a, b in zip(reference["losses"], out["losses"])) < 1e-12
        for rank, trace in enumerate(results.traces):
            for step, (first, last) in enumerate(_backward_windows(trace, accum)):
                # no_sync: nothing on the wire during the first micro-batch's backward
                assert _collectives_in(trace, first) == [], (name, rank, step)
                launched = [e["op"] for e in _collectives_in(trace, last)]
                if name == "zero2" and preset == "zero":   # every parameter used: all in backward
                    assert launched and set(launched) == {"ring_reduce_scatter"}, (rank, step, launched)
                if name == "zero1":   # one reduce-scatter, after backward
                    assert launched == []


def _memory_runs(names, cfg, steps):
    return {name: loop.train(name, cfg, steps, track_memory=True, return_state=False, spans=True)
            for name in names}


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
    counters = 4 * len(list(model.parameters()))   # one 4-byte step counter per AdamW tensor
    layout = FlatLayout(model.parameters(), world_size, BUCKET_CAP_MB, LAST_BUCKET_MB)   # zero2's
    two_buckets = 4 * sum(sorted(b.padded_numel for b in layout.buckets)[-2:])
    for rank, runs in enumerate(results):
        after = {n: runs[n]["memory"].samples[-1].by_category for n in names}   # after the step
        assert abs(after["ddp-bucketed"]["optimizer"] - (8 * P + counters)) <= counters
        assert abs(after["zero1"]["optimizer"] - 8 * P / world_size) <= counters + 8 * world_size
        assert after["zero1"]["gradients"] == 4 * FlatLayout(model.parameters(), world_size).numel
        assert after["zero2"]["gradients"] == 4 * layout.shard_numel   # only the shard survives
        ddp_grads = backward_grad_bytes(runs["ddp-bucketed"]["memory"])
        zero2_grads = backward_grad_bytes(runs["zero2"]["memory"])
        assert len(ddp_grads) == len(zero2_grads) == steps and min(ddp_grads) == 4 * P
        for got in zero2_grads:
            assert 4 * layout.shard_numel <= got <= 4 * P / world_size + two_buckets, (rank, got)
        assert runs["zero2"]["peak"] < runs["zero1"]["peak"] < runs["ddp-bucketed"]["peak"]
    # one launch ran the three strategies one after the other: split the trace by their steps
    for trace in results.traces:
        step_spans = [s for s in trace["spans"] if s["name"] == "step"]
        sent = [_wire_bytes(dict(trace, spans=step_spans[i * steps:(i + 1) * steps]))
                for i in range(len(names))]
        assert sent[0] > 0
        for stage_sent in sent[1:]:   # padding: at most N-1 elements per bucket per collective
            assert abs(stage_sent - sent[0]) <= 8 * world_size * steps * len(layout.buckets)


def test_sharded_optimizer_single_process_is_the_wrapped_optimizer():
    """Outside torch.distributed a world of one: ShardedOptimizer is the optimizer itself."""
    a, b = ToyModel(seed=1).double(), ToyModel(seed=1).double()
    plain = torch.optim.AdamW(_groups(a), lr=1e-2)
    sharded = ShardedOptimizer(_groups(b), torch.optim.AdamW, lr=1e-2)
    assert sharded.world_size == 1 and isinstance(sharded, torch.optim.Optimizer)
    for step in range(3):
        x, y = (t.double() for t in loop.global_batch(loop.PRESETS["toy"], step))
        for model, opt in ((a, plain), (b, sharded)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    compare(a.state_dict(), b.state_dict(), **LAST_BITS).raise_if_failed()
    assert sum(len(s) for s in sharded.state.values()) == sum(len(s) for s in plain.state.values())


def test_fp32_formula_and_experiment_control_without_widgets(monkeypatch):
    """The lab's fp32 model-state formula (ZeRO-1: 4P + 4P + 8P/N) and the experiment control's
    fallback under CI (the calculator itself: tests/test_costmodel.py)."""
    from labkit import costmodel
    from labkit.labs import memory_widget
    fp32 = costmodel.memory_per_rank(1000, 4, 1, precision="fp32")
    assert (fp32["parameters"], fp32["gradients"], fp32["optimizer"]) == (4000, 4000, 2000)
    monkeypatch.setattr(memory_widget, "widgets_enabled", lambda: False)
    calls = []
    memory_widget.experiment_control(lambda n, s: calls.append((n, s)), default=(4, 2))
    assert calls == [(4, 2)]   # under CI: run once with the defaults


def _behind_torch_ddp(steps=4):
    """ZeroRedundancyOptimizer's contract: DDP makes the gradients the same on every rank, the
    sharded optimizer steps its chunk (the ranks see different rows: 7 over 3 is uneven)."""
    from labkit.data import rank_slice
    rank, n = dist.get_rank(), dist.get_world_size()
    single, model = ToyModel(seed=0, tied=True).double(), ToyModel(seed=0, tied=True).double()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    sharded = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.AdamW([p for p in single.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        x, y = (t.double() for t in loop.global_batch(loop.PRESETS["toy"], step))
        rows, extra = rank_slice(len(x), rank, n), step % 2 == 1
        sharded.zero_grad()
        plain.zero_grad()
        # DDP averages: scale the rank's share of the global sum so the average is the global mean
        loss = nn.functional.mse_loss(ddp(x[rows], use_extra=extra), y[rows], reduction="sum")
        (loss * n / y.numel()).backward()
        sharded.step()
        nn.functional.mse_loss(single(x, use_extra=extra), y).backward()
        plain.step()
    return single.state_dict(), model.state_dict()


def test_sharded_optimizer_behind_torch_ddp():
    for rank, (single, sharded) in enumerate(labkit.run(_behind_torch_ddp, world_size=3, timeout=180)):
        compare(single, sharded, **F64, rank=rank, label="DDP + ShardedOptimizer").raise_if_failed()
