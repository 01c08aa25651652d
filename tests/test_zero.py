"""ZeRO by hand (labkit.strategies.zero): the flat partition and its buckets, ShardedOptimizer
against single-process training, torch's ZeroRedundancyOptimizer and behind torch's DDP, its
state dict. The strategies: tests/test_zero_stages.py. No timing asserts (the machine is shared)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import labkit
from labkit import loop
from labkit.checks import compare
from labkit.models import ToyModel, TinyGPT
from labkit.strategies.zero import FlatLayout, FlatPartition, ShardedOptimizer, per_tensor_partition


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_flat_partition_covers_every_element_once(world_size):
    partition = FlatPartition(ToyModel().parameters(), world_size)
    assert partition.numel == 433  # frozen_in.weight is left out; 433 is prime
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
    assert flat[partition.numel :].eq(0).all()
    for p, view in zip(partition.params, partition.views(flat)):
        assert torch.equal(p, view)


def test_per_tensor_partition_is_imbalanced_flat_is_not():
    numels = [p.numel() for p in TinyGPT().parameters()]
    load = per_tensor_partition(numels, 4)
    assert sum(load) == sum(numels)
    assert max(load) > 1.05 * sum(numels) / 4  # whole tensors cannot split evenly
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
    assert layout.buckets[0].params[-1] is params[-1] and sorted(map(id, layout.params)) == sorted(
        map(id, params)
    )
    assert all(b.numel * 4 <= 0.3 * 2**20 or len(b.params) == 1 for b in layout.buckets)
    assert layout.buckets[-1].params[0] is params[0] and layout.buckets[-1].numel * 4 <= 0.1 * 2**20
    owned = []
    for rank in range(world_size):
        segments = layout.segments(rank)
        assert sum(hi - lo for _, lo, hi, _ in segments) <= layout.shard_numel
        for i, lo, hi, shard_lo in segments:
            assert layout.offsets[i] <= lo < hi <= layout.offsets[i] + layout.params[i].numel()
            b = next(
                b
                for b in range(len(layout.buckets))
                if layout.bucket_slice(b).start <= lo < layout.bucket_slice(b).stop
            )
            rank_chunk = layout.rank_slice(b, rank)
            assert rank_chunk.start <= lo and hi <= rank_chunk.stop  # only this rank's chunks
            assert shard_lo - layout.shard_offsets[b] == lo - rank_chunk.start
        owned += [e for _, lo, hi, _ in segments for e in range(lo, hi)]
    real = [o + e for i, o in enumerate(layout.offsets) for e in range(layout.params[i].numel())]
    assert sorted(owned) == sorted(real)  # every real element once, padding never


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
    models = {
        name: ToyModel(seed=0, tied=True).double() for name in ("single", "sharded", "bucketed", "torch")
    }
    opts = {
        "single": cls(_groups(models["single"]), **kwargs),
        "sharded": ShardedOptimizer(_groups(models["sharded"]), cls, **kwargs),
        "bucketed": ShardedOptimizer(
            _groups(models["bucketed"]), optimizer_class=cls, bucket_cap_mb=0.0005, **kwargs
        ),
        "torch": ZeroRedundancyOptimizer(_groups(models["torch"]), optimizer_class=cls, **kwargs),
    }
    saved = None
    for step in range(steps):
        x, y = (t.double() for t in loop.global_batch(loop.PRESETS["toy"], step))
        for name, model in models.items():
            opts[name].zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x, use_extra=step % 2 == 1), y).backward()
            opts[name].step()
        if step == 1:
            saved = opts["sharded"].state_dict()
            opts["sharded"].param_groups[1]["lr"] = 0.02  # a changed option must take effect...
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
                compare(
                    states["single"],
                    states[name],
                    **LAST_BITS,
                    rank=rank,
                    label=f"{kind}: {name} vs single process",
                ).raise_if_failed()


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
    assert calls == [(4, 2)]  # under CI: run once with the defaults


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
        # float64; DDP's averaged sum of the ranks' shares differs from one sum in the last bits
        compare(
            single, sharded, rtol=1e-9, atol=1e-12, rank=rank, label="DDP + ShardedOptimizer"
        ).raise_if_failed()
