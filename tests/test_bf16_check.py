"""The bf16 same-cast check (labkit.labs.precision_checks.check_same_casts, what `python -m
labkit --precision bf16 --check` runs) fails planted reduction bugs: one bucket of DDPBucketed
left unreduced, one rank's gradient dropped before DDPNaive's all-reduce. Each is a small subclass
(as labkit.drills' are); trained in bf16 on 2 ranks (one launch, with the correct strategies
beside them, which must pass), each must fail on its step-0 gradients, by far more than the
bound (a part of the gradient, not rounding). And one rank's share of every gradient 10% off where
a tensor-parallel rank holds half of each tensor: under the 32-ulp bound of the strategies that
split a layer's sums, over the norm-wise one (GRAD_NORM_EPS; the same bug planted in real runs of
every hand-written strategy: tests/test_bf16_strategies.py)."""

import pytest
import torch

import labkit
from labkit import loop
from labkit.labs.precision_checks import GRAD_NORM_EPS, GRAD_ULPS, SPLIT_GRAD_ULPS, check_same_casts
from labkit.strategies.ddp import DDPBucketed, DDPNaive
from labkit.strategies.ddp.by_hand import flat_views
from labkit.strategies.precision import MixedPrecision

CFG = loop.PRESETS["dp"].replace(mp=MixedPrecision(torch.bfloat16, torch.float32), batch_size=8, steps=2)


class _Done:
    def wait(self) -> None:
        pass


class OneBucketNotReduced(DDPBucketed):
    """The last bucket (the first layers' gradients) is never all-reduced: each rank keeps its own."""

    def launch(self, index):
        if index != len(self.buckets) - 1:
            return super().launch(index)
        for p, view in flat_views(self.buffers[index], self.buckets[index]):
            view.copy_(p.grad)
        self.handles[index], self.launched = _Done(), index + 1


class OneRankGradientDropped(DDPNaive):
    """Rank 1 zeroes its gradients before the all-reduce: the sum is rank 0's share only."""

    def sync_gradients(self):
        if torch.distributed.get_rank() == 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()
        super().sync_gradients()


def _runs():
    small = dict(bucket_cap_mb=0.005)  # several buckets on this small model
    return {
        "ddp-bucketed": loop.train("ddp-bucketed", CFG, **small),
        "ddp-naive": loop.train("ddp-naive", CFG),
        "one bucket not reduced": loop.train(OneBucketNotReduced, CFG, **small),
        "one rank's gradient dropped": loop.train(OneRankGradientDropped, CFG),
        "buckets": len(OneBucketNotReduced(loop.build_model(CFG), bucket_cap_mb=0.005).buckets),
    }


def test_planted_reduction_bugs_fail_the_bf16_check():
    out = labkit.run(_runs, world_size=2, timeout=600)[0]
    assert out["buckets"] >= 3, out["buckets"]  # the planted bug leaves one bucket of several
    ref, fp32 = loop.reference(CFG), loop.reference(CFG.replace(mp=None))
    for name in ("ddp-bucketed", "ddp-naive"):
        figures = check_same_casts(out[name], CFG, name, ref=ref, fp32_ref=fp32)
        assert figures["grad_ulps"] <= GRAD_ULPS
    for name in ("one bucket not reduced", "one rank's gradient dropped"):
        try:
            check_same_casts(out[name], CFG, name, ref=ref, fp32_ref=fp32)
        except AssertionError as error:
            message = str(error)
        else:
            raise AssertionError(f"the bf16 check passed the planted bug {name!r}")
        assert "step-0 gradient of" in message and "every rank's gradient" in message, message
        ulps = float(message.split(" ulp of")[0].rsplit(", ", 1)[1])
        assert ulps >= 4 * GRAD_ULPS, message  # a part of the gradient, far beyond rounding


def test_half_of_every_gradient_10_percent_off_fails_the_norm_bound():
    """The reference's own step-0 gradients with the second half of every tensor (the elements a
    tensor-parallel rank 1 holds) x 0.9: 12.8 ulp at most, inside SPLIT_GRAD_ULPS, but about
    0.1 / sqrt(2) = 7% = 9 eps norm-wise, over GRAD_NORM_EPS. The reference itself measures 0."""
    ref, fp32 = loop.reference(CFG), loop.reference(CFG.replace(mp=None))
    figures = check_same_casts(ref, CFG, "the reference", ref, fp32, SPLIT_GRAD_ULPS)
    assert figures["grad_norm_eps"] == 0 and figures["grad_norm_bound"] == GRAD_NORM_EPS

    def half_off(g):
        flat = g.clone().reshape(-1)
        flat[flat.numel() // 2 :] *= 0.9
        return flat.reshape(g.shape)

    got = dict(ref, grads={k: half_off(g) for k, g in ref["grads"].items()})
    with pytest.raises(AssertionError, match="step-0 gradients, all .* as one vector") as error:
        check_same_casts(got, CFG, "half off", ref, fp32, SPLIT_GRAD_ULPS)
    assert "every rank's gradient" in str(error.value)
    measured = float(str(error.value).split(" eps of")[0].rsplit(", ", 1)[1])
    assert measured > 4 * GRAD_NORM_EPS, str(error.value)
