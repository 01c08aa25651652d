"""Activation checkpointing (labkit.strategies.activation_checkpointing): recomputing each block
inside backward is the same arithmetic, so training is bit-equal with and without it (fp32, same
ops in the same order), in one process and under DDP; the activations alive at the peak shrink."""

import torch

import labkit
from labkit import loop
from labkit.strategies.activation_checkpointing import checkpoint_blocks

CFG = loop.PRESETS["dp"].replace(batch_size=8)
CKPT = CFG.replace(activation_checkpointing=True)


def test_reference_is_bit_equal_with_checkpointing():
    a, b = loop.reference(CFG), loop.reference(CKPT)
    assert a["losses"] == b["losses"]
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), key


def _both():
    runs = loop.sweep(
        [dict(cfg=CFG), dict(cfg=CKPT)],
        strategy="ddp-bucketed",
        steps=2,
        track_memory=True,
        return_state=False,
    )
    exact = loop.sweep([dict(cfg=CFG), dict(cfg=CKPT)], strategy="ddp-bucketed", steps=3)
    return [r["peak_by_category"]["activations"] for r in runs], exact


def test_ddp_with_checkpointing_is_bit_equal_and_keeps_fewer_activations():
    (plain, ckpt), (a, b) = labkit.run(_both, world_size=2)[0]
    assert a["losses"] == b["losses"]
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), key
    assert ckpt < 0.6 * plain, f"activations at the peak: {ckpt} checkpointed vs {plain} plain"


def test_keys_and_no_grad_forward_unchanged():
    model = loop.build_model(CFG)
    keys = list(model.state_dict())
    checkpoint_blocks(model)
    assert list(model.state_dict()) == keys
    x, y = loop.global_batch(CFG, 0)
    with torch.no_grad():
        assert model(x, y)[1] is not None  # no checkpoint machinery without grad
