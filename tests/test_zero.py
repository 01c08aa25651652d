"""ZeRO-1 / ZeRO-2 by hand (labkit.strategies.zero): partition arithmetic, equivalence with
single-process training, with torch's ZeroRedundancyOptimizer and with hand-written DDP, the
measured memory and the bytes communicated. No timing asserts (the machine is shared)."""
import pytest
import torch

import labkit
from labkit import loop
from labkit.checks import compare
from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter, shard_range
from labkit.models import ToyModel, TinyGPT
from labkit.strategies.zero import FlatPartition, per_tensor_partition
from labkit.labs.zero_checks import check_shard_range, check_zero_step
from labkit.labs.zero_lab import wire_bytes


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


def test_shard_range_check_gives_padding_hint():
    assert check_shard_range(shard_range)
    with pytest.raises(AssertionError, match="padding not removed"):
        check_shard_range(lambda n, r, w: (r * -(-n // w), (r + 1) * -(-n // w), -(-n // w) * w))


def _states_equal(results, exact=True):
    for rank in range(1, len(results)):
        assert compare(results[0]["state"], results[rank]["state"], rtol=0, atol=0).ok


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_zero_matches_single_process_on_the_hard_cases(stage):
    # The toy preset: a frozen weight, a layer without gradient every other step, a weight tied
    # across two layers, odd sizes (uneven padding over 3 ranks), 6 rows.
    cfg = loop.PRESETS["toy"].replace(batch_size=6)
    reference = loop.reference(cfg, 5)
    results = labkit.run(loop.train, stage, cfg, 5, spans=False, world_size=3)
    _states_equal(results)   # every rank holds the same parameters (the all-gather happened)
    compare(reference["state"], results[0]["state"], rtol=1e-5, atol=1e-7).raise_if_failed()


def _after_step(result):
    return result["memory"].samples[-1].by_category   # the tracker's last sample: after the step


def test_tiny_gpt_equivalence_memory_and_communication():
    """The ZeRO lab's TinyGPT (tied embedding / LM head) on 2 ranks: DDP, ZeRO-1, ZeRO-2 and
    torch's ZeroRedundancyOptimizer on loop.train, all with the memory tracker on."""
    world_size, steps, cfg = 2, 3, loop.PRESETS["zero"]
    names = ("ddp-bucketed", "zero1", "zero2", "torch-zero1")
    runs = {name: labkit.run(loop.train, name, cfg, steps, track_memory=True, world_size=world_size)
            for name in names}
    reference = loop.reference(cfg, steps)
    for name, results in runs.items():
        _states_equal(results)
        # atol 1e-6: the attention key bias's gradient is rounding noise (zero in exact arithmetic,
        # see loop.EPS) that AdamW amplifies; measured 1.1e-7 after 3 steps, every other weight
        # within 1e-7.
        compare(reference["state"], results[0]["state"], rtol=1e-5, atol=1e-6).raise_if_failed()
        # Two ranks: a + b is the same in any order, and torch's AVG of the N-times-scaled loss
        # divides by 2 exactly, so every strategy agrees to the bit.
        compare(runs["torch-zero1"][0]["state"], results[0]["state"], rtol=0, atol=0).raise_if_failed()

    model = loop.build_model(cfg)
    P = sum(p.numel() for p in model.parameters())
    chunk_bytes = 4 * -(-P // world_size)
    steps_bytes = 4 * len(list(model.parameters()))   # one 4-byte step counter per AdamW tensor
    for rank in range(world_size):
        ddp, z1, z2 = (_after_step(runs[name][rank]) for name in names[:3])
        assert abs(ddp["optimizer"] - (8 * P + steps_bytes)) <= steps_bytes
        # optimizer state: 1/N of DDP's, within 1% plus the padding
        assert abs(z1["optimizer"] - ddp["optimizer"] / world_size) <= (
            0.01 * ddp["optimizer"] / world_size + 8 * world_size)
        assert z1["gradients"] == chunk_bytes * world_size   # the padded flat buffer
        assert z2["gradients"] == chunk_bytes               # only this rank's chunk survives
    for stage in (1, 2):   # reduce-scatter + all-gather sends what the all-reduce sends (+ padding)
        for rank in range(world_size):
            ddp_sent = wire_bytes(runs["ddp-bucketed"].traces[rank])
            assert ddp_sent > 0
            assert abs(wire_bytes(runs[names[stage]].traces[rank]) - ddp_sent) <= (
                8 * world_size * steps)


def test_check_zero_step_catches_sum_and_missing_all_gather():
    def with_sum(zero):
        zero.grad_shard = zero.flat_grad[zero.partition.chunk_slice(zero.rank)]
        ring_reduce_scatter(zero.grad_shard, zero.flat_grad, op="sum")
        zero.local_step()
        ring_all_gather(zero.flat_param, zero.param_shard)

    def without_all_gather(zero):
        zero.reduce_scatter_grads()
        zero.local_step()

    with pytest.raises(AssertionError, match="SUM vs AVG"):
        check_zero_step(with_sum)
    with pytest.raises(AssertionError, match="forgot the all-gather"):
        check_zero_step(without_all_gather)


def test_memory_calculator_reproduces_the_zero_paper_and_draws_statically(monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from labkit.labs import memory_widget
    from labkit import costmodel
    assert costmodel.paper_table(7.5e9, 64) == costmodel.ZERO_TABLE_GB
    fp32 = costmodel.memory_per_rank(1000, 4, 1, precision="fp32")
    assert (fp32["parameters"], fp32["gradients"], fp32["optimizer"]) == (4000, 4000, 2000)
    monkeypatch.setattr(memory_widget, "widgets_enabled", lambda: False)
    fig = memory_widget.memory_calculator(1e6, 4, stage=2, precision="fp32",
                                          measured={"measured": {"parameters": 4e6}})
    assert len(fig.axes[0].get_xticklabels()) == 5
    calls = []
    memory_widget.experiment_control(lambda n, s: calls.append((n, s)), default=(4, 2))
    assert calls == [(4, 2)]   # under CI: run once with the defaults
