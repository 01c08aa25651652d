"""Mixed precision in the hand-written FSDP against single-process training with the same casts
(loop.reference on a preset with `mp`; labkit.labs.precision_checks.check_same_casts says which
tolerance catches what), bf16 with fp32 and bf16 reductions and fp16 with dynamic loss scaling; the
bit-for-bit comparison with fully_shard(mp_policy=...) is in test_fsdp.py. Plus what the policy
does to the bytes: the all-gathers move half as much in bf16 (from the tracer)."""

import pytest
import torch

import labkit
from labkit import loop
from labkit.labs.precision_checks import check_same_casts
from labkit.observe.trace_stats import collective_counts
from labkit.strategies.precision import MixedPrecision

POLICIES = {
    "bf16": MixedPrecision(torch.bfloat16, torch.float32),
    "bf16r": MixedPrecision(torch.bfloat16, torch.bfloat16),
    "fp16": MixedPrecision(torch.float16, torch.float32),
}


def _runs(cfgs):
    scaler = lambda s: {"skipped": s.scaler.skipped if s.scaler else None}  # noqa: E731
    return {name: loop.train("fsdp", cfg, hooks=loop.Hooks(report=scaler)) for name, cfg in cfgs.items()}


@pytest.fixture(scope="module")
def runs():
    cfgs = {
        f"{p}/{tag}": loop.PRESETS[p].replace(mp=mp) for p in ("dp", "toy") for tag, mp in POLICIES.items()
    }
    return cfgs, labkit.run(_runs, cfgs, world_size=2, timeout=600)[0]


@pytest.mark.parametrize("preset", ["dp", "toy"])
@pytest.mark.parametrize("tag", list(POLICIES))
def test_fsdp_matches_the_same_casts(runs, preset, tag):
    cfgs, out = runs
    got = out[f"{preset}/{tag}"]
    check_same_casts(got, cfgs[f"{preset}/{tag}"], f"fsdp {preset} {tag}")
    assert (got["skipped"] is None) == (tag != "fp16")


def _fp16_overflow():
    cfg = loop.PRESETS["dp"].replace(
        mp=MixedPrecision(torch.float16, torch.float32, init_scale=2.0**24, growth_interval=10)
    )
    return loop.train(
        "fsdp",
        cfg,
        12,
        hooks=loop.Hooks(report=lambda s: {"skipped": s.scaler.skipped, "taken": s.steps_taken}),
    )


def test_fp16_overflow_skips_the_step_on_every_rank():
    results = labkit.run(_fp16_overflow, world_size=2, timeout=300)
    skipped = {r["skipped"] for r in results}
    assert len(skipped) == 1 and skipped.pop() > 0, [r["skipped"] for r in results]
    assert {r["taken"] + r["skipped"] for r in results} == {12}
    assert results[0]["state"].keys() == results[1]["state"].keys()


def _gather_bytes(cfg):
    loop.train("fsdp", cfg, 2, return_state=False)


def test_bf16_halves_the_allgather_bytes():
    cfg = loop.PRESETS["fsdp"]
    per = []
    for c in (cfg, cfg.replace(mp=POLICIES["bf16"])):
        run = labkit.run(_gather_bytes, c, world_size=2, timeout=300)
        per.append(collective_counts(run.traces[0])["ring_all_gather"])
    (n32, b32), (n16, b16) = per
    assert n32 == n16, "the same all-gathers, in another dtype"
    assert b16 / b32 == pytest.approx(0.5, abs=0.01), (b16, b32)
