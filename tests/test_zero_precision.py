"""Mixed precision (labkit.strategies.precision.MixedPrecision) in the hand-written ZeRO-1 / ZeRO-2, against
single-process training with the same casts (loop.reference on a preset with `mp`).

Tolerances: MixedPrecision(float32, float32) runs the master-shard machinery with no rounding, so
it must be bit-equal to the same strategy in plain fp32 and match the fp32 reference as tightly as
fp32 ZeRO does (toy: rtol 1e-5, atol 1e-7; "zero": atol 1e-5, as every distributed run on that
preset differs from the single process by 7e-6 after one step). bf16 / fp16 runs are checked by
labkit.labs.precision_checks.check_same_casts (its docstring says which tolerance catches what),
and at 2 ranks bit-equal to the hand-written DDP with the same policy (the oracle: torch's
ZeroRedundancyOptimizer has no mixed-precision policy; tests/test_precision.py checks that DDP).
The bytes per rank are the ZeRO paper's formulas with 16-bit gradients, category by category.
"""

import math

import pytest
import torch

import labkit
from labkit import loop
from labkit.checks import compare
from labkit.labs.precision_checks import check_same_casts
from labkit.labs.zero_lab import layout_elements
from labkit.models import num_params
from labkit.strategies.precision import MixedPrecision
from labkit.strategies.zero import ZeRO1, ZeRO2

BF16 = MixedPrecision(torch.bfloat16, torch.float32)
BF16_REDUCE = MixedPrecision(torch.bfloat16, torch.bfloat16)
FP16 = MixedPrecision(torch.float16, torch.float32)
EXACT = MixedPrecision(torch.float32, torch.float32)
POLICIES = {"bf16": BF16, "bf16r": BF16_REDUCE, "fp16": FP16, "exact": EXACT, "fp32": None}
STRATEGIES = ("zero1", "zero2")


def _dtypes(strategy):
    """What the model computes in and what the optimizer steps (the fp32 master shard)."""
    opt = strategy.optimizer
    stepped = {str(p.dtype) for g in opt.optim.param_groups for p in g["params"]}
    return {
        "compute_dtypes": sorted({str(p.dtype) for p in strategy.model.parameters()}),
        "stepped_dtypes": sorted(stepped),
    }


def _runs(cfgs, oracle=False):
    out = {
        name: {s: loop.train(s, cfg, hooks=loop.Hooks(report=_dtypes)) for s in STRATEGIES}
        for name, cfg in cfgs.items()
    }
    if oracle:  # the hand-written DDP with the same policy (tests/test_precision.py checks it)
        for name, cfg in cfgs.items():
            if cfg.mp is not None and cfg.mp.param_dtype != torch.float32:
                out[name]["ddp"] = loop.train("ddp-bucketed", cfg)
    return out


def _cfgs(presets, tags):
    return {f"{p}/{t}": loop.PRESETS[p].replace(mp=POLICIES[t]) for p in presets for t in tags}


@pytest.fixture(scope="module")
def runs():
    cfgs = _cfgs(("zero", "toy"), POLICIES)
    return cfgs, labkit.run(_runs, cfgs, True, world_size=2)[0]


@pytest.fixture(scope="module")
def runs3():
    cfgs = _cfgs(("toy",), ("bf16", "fp16"))
    return cfgs, labkit.run(_runs, cfgs, world_size=3)[0]


@pytest.mark.parametrize("preset", ["zero", "toy"])
def test_fp32_policy_is_exact(runs, preset):
    _, out = runs
    ref = loop.reference(loop.PRESETS[preset])
    atol = 1e-5 if preset == "zero" else 1e-7
    for strategy in STRATEGIES:
        got = out[f"{preset}/exact"][strategy]
        plain = out[f"{preset}/fp32"][strategy]
        for k, v in plain["state"].items():
            assert torch.equal(got["state"][k], v), f"{strategy}: {k} differs from fp32 {strategy}"
        compare(got["state"], ref["state"], rtol=1e-5, atol=atol, label=f"{strategy} state")
        compare(got["grads"], ref["grads"], rtol=1e-5, atol=atol, label=f"{strategy} grads")


def _check_low_precision(cfgs, out, preset, tag):
    cfg = cfgs[f"{preset}/{tag}"]
    ref, fp32 = loop.reference(cfg), loop.reference(loop.PRESETS[preset])
    for strategy in STRATEGIES:
        got = out[f"{preset}/{tag}"][strategy]
        assert got["compute_dtypes"] == [str(cfg.mp.param_dtype)], got["compute_dtypes"]
        assert got["stepped_dtypes"] == ["torch.float32"], got["stepped_dtypes"]
        check_same_casts(got, cfg, f"{strategy} {tag}", ref=ref, fp32_ref=fp32)


@pytest.mark.parametrize("preset", ["zero", "toy"])
@pytest.mark.parametrize("tag", ["bf16", "bf16r", "fp16"])
def test_low_precision_matches_the_same_casts(runs, preset, tag):
    _check_low_precision(*runs, preset, tag)


@pytest.mark.parametrize("preset", ["zero", "toy"])
@pytest.mark.parametrize("tag", ["bf16", "bf16r", "fp16"])
def test_low_precision_bit_equal_to_ddp(runs, preset, tag):
    """At 2 ranks a sum of two partial gradients rounds the same in a ring reduce-scatter as in
    an all-reduce, and AdamW is elementwise: ZeRO's master shards must give exactly the hand-
    written DDP's masters (same policy), step-0 gradients and losses."""
    run = runs[1][f"{preset}/{tag}"]
    ddp = run["ddp"]
    for strategy in STRATEGIES:
        for what in ("state", "grads"):
            for k, v in ddp[what].items():
                assert torch.equal(run[strategy][what][k], v), f"{strategy} {tag}: {what} {k} != ddp's"
        assert run[strategy]["losses"] == ddp["losses"], strategy


def _accumulated(cfg):
    return {s: loop.train(s, cfg, accum_steps=2) for s in STRATEGIES + ("ddp-bucketed",)}


def test_accumulation_bit_equal_to_ddp():
    """Two micro-batches (ZeRO-2's no_sync keeps the 16-bit .grad locally until the last one)."""
    run = labkit.run(_accumulated, loop.PRESETS["toy"].replace(mp=BF16), world_size=2)[0]
    ddp = run.pop("ddp-bucketed")
    for strategy, got in run.items():
        for k, v in ddp["state"].items():
            assert torch.equal(got["state"][k], v), f"{strategy}: {k} != ddp's"
        assert got["losses"] == ddp["losses"], strategy


@pytest.mark.parametrize("tag", ["bf16", "fp16"])
def test_low_precision_three_ranks(runs3, tag):
    """Odd sizes: 3 ranks pad every bucket, the toy's 7 rows split 3/2/2."""
    _check_low_precision(*runs3, "toy", tag)


# ---------------------------------------------------------------------------- bytes per rank
def _state_bytes(cfg):
    out = {}
    for name in STRATEGIES:
        r = loop.train(
            name,
            cfg,
            2,
            track_memory=True,
            return_state=False,
            spans=False,
            hooks=loop.Hooks(report=layout_elements),
        )
        end = [s for s in r["memory"].samples if s.label == "backward end"][-1]
        out[name] = {
            **{c: end.by_category[c] for c in ("parameters", "gradients", "optimizer")},
            **{k: r[k] for k in ("flat", "shard", "last_bucket", "pieces")},
        }
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_are_the_papers(n):
    """At the end of step 2's backward with 16-bit gradients, per rank: parameters 2P (the bf16
    flat buffer), optimizer 12P/N (fp32 master 4 + AdamW 8, this rank's chunk), gradients 2P
    (ZeRO-1's bf16 flat gradient) or 2P/N (ZeRO-2's shard) plus the last bucket's bf16 send
    buffer still in flight; P counted with the padding (each step counter: 4 bytes per segment)."""
    cfg = loop.PRESETS["zero"].replace(mp=BF16_REDUCE)
    P = num_params(loop.build_model(cfg))
    for rank in labkit.run(_state_bytes, cfg, world_size=n):
        for name, got in rank.items():
            padded, shard = got["flat"], got["shard"]
            assert got["parameters"] == 2 * padded, (name, got)
            assert 12 * shard <= got["optimizer"] <= 12 * shard + 4 * got["pieces"], (name, got)
            if name == "zero1":
                assert got["gradients"] == 2 * padded, got
                paper = 4 + 12 / n
            else:
                in_flight = got["gradients"] - 2 * shard
                assert 0 <= in_flight <= 2 * got["last_bucket"], got
                paper = 2 + 14 / n
            total = got["parameters"] + got["gradients"] + got["optimizer"]
            assert math.isclose(total / P, paper, rel_tol=0.03), (name, n, total / P, paper)


# ---------------------------------------------------------------------------- fp16 overflow
class _Overflow:
    """Rank 0 finds an inf in its own shard on step 0: only it could see the overflow."""

    def reduce_gradients(self):
        fresh = not self.reduced
        super().reduce_gradients()
        if fresh and self.rank == 0 and self.optimizer.scaler.skipped == 0:
            self.grad_shard[0] = float("inf")


class ZeRO1Overflow(_Overflow, ZeRO1):
    pass


class ZeRO2Overflow(_Overflow, ZeRO2):
    pass


def _skips(strategy):
    return {"skipped": strategy.optimizer.scaler.skipped, "scale": strategy.optimizer.scaler.scale}


def _overflow_runs(cfg):
    return {
        cls.__name__: loop.train(cls, cfg, 1, hooks=loop.Hooks(report=_skips))
        for cls in (ZeRO1Overflow, ZeRO2Overflow)
    }


def test_fp16_skip_is_agreed_across_ranks():
    """Every rank skips the step (and halves the scale), so no rank's shard moves."""
    cfg = loop.PRESETS["toy"].replace(mp=FP16)
    init = loop.build_model(cfg).state_dict()
    for rank in labkit.run(_overflow_runs, cfg, world_size=2):
        for name, got in rank.items():
            assert got["skipped"] == 1 and got["scale"] == FP16.init_scale / 2, (name, got)
            for k, v in init.items():
                assert torch.equal(got["state"][k], v), f"{name}: {k} moved in a skipped step"


def _standalone(policy):
    """ShardedOptimizer alone (gradients identical on every rank: same seed, same batch) vs
    MasterWeights + AdamW in one process: the fp32 master shard steps, bit-equal elementwise."""
    from labkit.strategies.precision import MasterWeights
    from labkit.strategies.zero import ShardedOptimizer

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Linear(5, 3))
    model, single = models
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, mp_policy=policy)
    masters = MasterWeights.of_module(single, policy)
    ref_opt = torch.optim.AdamW(masters.masters, lr=1e-2)
    for step in range(2):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step)).to(policy.param_dtype)
        for m in models:
            m.zero_grad(set_to_none=True)
            m(x).float().square().sum().backward()
        opt.step()
        masters.load_grads()
        masters.step(ref_opt)
        ref_opt.zero_grad(set_to_none=True)
        opt.drop_master_grad()
    return {
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "master": opt.master.dtype,
        "shard": opt.state_dict()["master"].numel(),
        "equal": all(torch.equal(a, b) for a, b in zip(model.parameters(), single.parameters())),
    }


def test_sharded_optimizer_alone():
    for rank in labkit.run(_standalone, BF16, world_size=2):
        assert rank["dtypes"] == ["torch.bfloat16"] and rank["master"] == torch.float32, rank
        assert rank["shard"] == 9, rank  # 18 elements over 2 ranks
        assert rank["equal"], "the 16-bit weights differ from single-process MasterWeights"
