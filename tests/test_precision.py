"""Mixed precision (labkit.strategies.precision) in the hand-written DDP stages, against
single-process training with the same casts (loop.reference on a preset with `mp`).

Tolerances: MixedPrecision(float32, float32) runs the whole master-weight machinery with no
rounding, so it must match plain fp32 training as tightly as fp32 DDP does (rtol 1e-5, atol 1e-7).
bf16 / fp16 runs are checked by labkit.labs.precision_checks.check_same_casts, whose docstring
says which tolerance catches what; test_the_check_catches_... shows it fails when it should.
"""

import pytest
import torch

import labkit
from labkit import loop
from labkit.checks import compare
from labkit.labs.precision_checks import check_same_casts
from labkit.strategies.precision import MixedPrecision
from labkit.strategies.precision import LossScaler, MasterWeights

BF16 = MixedPrecision(torch.bfloat16, torch.float32)
BF16_REDUCE = MixedPrecision(torch.bfloat16, torch.bfloat16)
FP16 = MixedPrecision(torch.float16, torch.float32)
EXACT = MixedPrecision(torch.float32, torch.float32)
STRATEGIES = ("ddp-naive", "ddp-flat", "ddp-bucketed")


def _compute_dtypes(strategy):
    return {"compute_dtypes": sorted({str(p.dtype) for p in strategy.model.parameters()})}


def _runs(cfgs):
    return {
        name: {s: loop.train(s, cfg, hooks=loop.Hooks(report=_compute_dtypes)) for s in STRATEGIES}
        for name, cfg in cfgs.items()
    }


def _maxdiff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


@pytest.fixture(scope="module")
def runs():
    cfgs = {
        f"{p}/{tag}": loop.PRESETS[p].replace(mp=mp)
        for p in ("dp", "toy")
        for tag, mp in (("bf16", BF16), ("bf16r", BF16_REDUCE), ("fp16", FP16), ("exact", EXACT))
    }
    return cfgs, labkit.run(_runs, cfgs, world_size=2)[0]


@pytest.mark.parametrize("preset", ["dp", "toy"])
def test_fp32_policy_is_exact(runs, preset):
    cfgs, out = runs
    ref = loop.reference(loop.PRESETS[preset])
    for strategy, got in out[f"{preset}/exact"].items():
        compare(got["state"], ref["state"], rtol=1e-5, atol=1e-7, label=f"{strategy} state")
        compare(got["grads"], ref["grads"], rtol=1e-5, atol=1e-7, label=f"{strategy} grads")


@pytest.mark.parametrize("preset", ["dp", "toy"])
@pytest.mark.parametrize("tag", ["bf16", "bf16r", "fp16"])
def test_low_precision_matches_the_same_casts(runs, preset, tag):
    cfgs, out = runs
    cfg = cfgs[f"{preset}/{tag}"]
    ref, fp32 = loop.reference(cfg), loop.reference(loop.PRESETS[preset])
    for strategy, got in out[f"{preset}/{tag}"].items():
        assert got["compute_dtypes"] == [str(cfg.mp.param_dtype)], got["compute_dtypes"]
        check_same_casts(got, cfg, f"{strategy} {tag}", ref=ref, fp32_ref=fp32)


def test_the_check_catches_skipped_casts_and_sum_for_avg():
    """The same-cast check fails for fp32 training passed off as bf16, and for doubled gradients."""
    cfg = loop.PRESETS["dp"].replace(mp=BF16)
    fp32 = loop.reference(loop.PRESETS["dp"])
    with pytest.raises(AssertionError, match="does not compute in"):
        check_same_casts(fp32, cfg, "fp32 passed off as bf16")
    doubled = dict(loop.reference(cfg), grads={k: 2 * g for k, g in loop.reference(cfg)["grads"].items()})
    with pytest.raises(AssertionError, match="SUM vs AVG"):
        check_same_casts(doubled, cfg, "doubled")


def test_masters_are_fp32_and_compute_is_16_bit():
    model = loop.build_model(loop.PRESETS["toy"])
    frozen = model.frozen_in.weight.detach().clone()
    masters = MasterWeights.of_module(model, BF16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in masters.masters} == {torch.float32}
    state = masters.state_dict(model)
    assert torch.equal(state["frozen_in.weight"], frozen), "a frozen weight keeps its fp32 value"
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}


def test_loss_scaler_skips_and_backs_off():
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    assert scaler.update(found_inf=True) and scaler.scale == 4.0 and scaler.skipped == 1
    assert not scaler.update(False) and scaler.scale == 4.0
    assert not scaler.update(False) and scaler.scale == 8.0


def test_fp16_overflow_skips_the_step():
    """A gradient that overflows fp16 at the loss scale skips the step and halves the scale."""
    model = torch.nn.Linear(4, 1)
    masters = MasterWeights.of_module(model, FP16)
    opt = torch.optim.SGD(masters.masters, lr=0.1)
    before = [m.detach().clone() for m in masters.masters]
    x = torch.full((2, 4), 1e3, dtype=torch.float16)
    masters.scale_loss(model(x).float().sum() * 1e3).backward()
    masters.load_grads()
    scale = masters.scaler.scale
    assert masters.step(opt) is False
    assert masters.scaler.scale == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, masters.masters))


def test_policy_rejects_non_float():
    with pytest.raises(TypeError, match="param_dtype"):
        MixedPrecision(param_dtype=torch.int8)
    assert MixedPrecision(torch.bfloat16, None).reduce_dtype == torch.bfloat16


def test_describe_says_what_the_distance_measures():
    """The notebooks' bf16 line (issue 30): after how many steps, over how many weights, which
    norm; its fp32 figure is the L2 norm of the two references' difference, recomputed here."""
    from labkit.labs.precision_checks import describe

    cfg = loop.PRESETS["dp"].replace(mp=BF16)
    ref, fp32 = loop.reference(cfg, 3), loop.reference(loop.PRESETS["dp"], 3)
    figures = check_same_casts(ref, cfg, "the reference itself", ref=ref, fp32_ref=fp32)
    keys = [k for k, v in ref["state"].items() if v.is_floating_point()]
    assert figures["steps"] == 3 and figures["weights_diff"] == 0
    assert figures["weights"] == sum(ref["state"][k].numel() for k in keys)
    norm = sum(((fp32["state"][k].double() - ref["state"][k].double()) ** 2).sum() for k in keys) ** 0.5
    assert figures["fp32_diff"] == pytest.approx(norm.item(), rel=1e-12)
    text = describe(figures)
    assert text.startswith(
        f"after 3 steps, distance = sqrt(sum of (w - w_ref)^2) over all {figures['weights']:,} weights"
    )
    assert f"{figures['fp32_diff']:.1e} between that reference and fp32 training" in text
