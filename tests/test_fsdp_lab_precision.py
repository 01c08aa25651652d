"""The FSDP lab's mixed-precision bookkeeping (labkit.labs.fsdp_lab.state_formula, sample_at)
against the memory tracker on real ranks: the same per-category state in fp32 and in bf16, since
the fp32 shard is the master and the reduced gradient lands in the shard's dtype."""

import pytest
import torch

import labkit
from labkit import loop
from labkit.labs.fsdp_lab import sample_at, state_formula
from labkit.strategies.precision import MixedPrecision

CFG = loop.PRESETS["fsdp"].replace(gpt={"d_model": 32, "n_heads": 2, "n_layers": 2})
STATE = ("parameters", "gradients", "optimizer")


def _state(cfgs):
    runs = loop.sweep(
        [dict(cfg=c) for c in cfgs],
        strategy="fsdp",
        steps=2,
        track_memory=True,
        return_state=False,
        spans=False,
    )
    return [{c: sample_at(r["memory"], "backward end")[c] for c in STATE} for r in runs]


@pytest.mark.parametrize("world_size", [2, 3])
def test_state_formula_matches_the_tracker_in_fp32_and_bf16(world_size):
    cfgs = [
        CFG,
        CFG.replace(mp=MixedPrecision(torch.bfloat16, torch.bfloat16)),
        CFG.replace(mp=MixedPrecision(torch.bfloat16, torch.float32)),
    ]
    model = loop.build_model(CFG)
    for rank, measured in enumerate(labkit.run(_state, cfgs, world_size=world_size, timeout=300)):
        expected = state_formula(model, world_size, CFG.units, rank)
        for cfg, got in zip(cfgs, measured):
            assert got == pytest.approx(expected, rel=0, abs=0), (rank, cfg.mp, got, expected)


def test_sample_at_picks_the_labelled_sample():
    class S:
        def __init__(self, label, n):
            self.label, self.by_category = label, {"parameters": n}

    class R:
        samples = [S("backward end", 1), S("x", 2), S("backward end", 3)]

    assert sample_at(R, "backward end") == {"parameters": 3}
    assert sample_at(R, "backward end", 0) == {"parameters": 1}
