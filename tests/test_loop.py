"""labkit.loop: every strategy in labkit.strategies.NAMES, on the presets with the hard cases, on 2
and 3 ranks, equals single-process training (loop.reference) after 5 steps.

One launch per (strategy, preset, world size); hand-written strategies run fp32 and float64 in
that same launch. Tolerances:
- step-0 gradients, fp32: rtol 1e-5 / atol 1e-7 (a SUM-vs-AVG slip is off by N, far outside);
- state after 5 steps, fp32: rtol 1e-5 / atol 1e-7 on "toy"; on "dp" (TinyGPT) atol 5e-5: a
  different summation order changes a gradient by ~1e-10, and on elements whose gradient is
  near AdamW's eps that is amplified up to lr/eps = 1e4 times per step (measured: at most 4.4e-6
  on 2 ranks, 1.7e-5 on 3 for torch's, which rounds once more when it scales the loss by 3);
- float64, hand-written ones: state and gradients within 1e-12 absolute (measured <= 8e-15).
"""

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import labkit
from labkit import loop, strategies
from labkit.checks import compare
from labkit.data import micro_batches
from labkit.strategies.fsdp import plan_units

STEPS = 5
FP32 = dict(rtol=1e-5, atol=1e-7)
FP32_GPT_STATE = dict(rtol=1e-5, atol=5e-5)
FP64 = dict(rtol=0, atol=1e-12)
# The pipelines split TinyGPT into stages and its rows into equal micro-batches ("dp"'s 7 rows do
# not split): they are checked against loop.reference in tests/test_pp.py (the 3-D ones, on 8
# ranks, in tests/test_three_d.py).
PP_FAMILY = ("pp", "pp-zero1", "torch-pp", "zero1-tp-pp", "fsdp-tp-pp")
# The tensor-parallel family splits TinyGPT's heads (not the toy's Linears) and needs tp to divide
# the world size: here on "dp" at 2 ranks (tp=2; fsdp-tp's default tp=2 leaves dp=1), more of it
# in tests/test_tp_strategies.py. Sequence and context parallelism split TinyGPT's sequence (its
# LayerNorms / its attention by ring / by all-to-all): also on "dp" at 2 ranks only (more in
# test_sp.py, test_cp.py, test_ulysses.py).
TP_FAMILY = ("tp", "fsdp-tp", "torch-tp", "torch-fsdp-tp", "sp", "torch-sp", "cp", "ulysses")
CASES = [
    (name, preset, n)
    for preset in ("toy", "dp")
    for n in (2, 3)
    for name in strategies.NAMES
    if name not in PP_FAMILY
    if name != "ep"  # expert parallelism needs MoE blocks: on "moe" in tests/test_ep.py
    if name not in TP_FAMILY or (preset, n) == ("dp", 2)
]


def _embedding_or_linear(module):
    return isinstance(module, (nn.Linear, nn.Embedding))


def _configs(name, preset):
    cfg = loop.PRESETS[preset]
    if name not in strategies.HAND_WRITTEN:
        return [cfg]
    wide = cfg.replace(dtype=torch.float64)
    if name in ("fsdp", "fsdp-flat") and preset == "dp":
        # Units by predicate: the embedding and the LM head (one tied weight) are two units,
        # so the weight goes to the root; every other Linear is a unit of its own.
        wide = wide.replace(units=_embedding_or_linear)
    return [cfg, wide]


@functools.lru_cache(maxsize=None)
def _reference(cfg_key):
    name, preset, dtype = cfg_key
    return loop.reference(_configs(name, preset)[dtype == torch.float64], STEPS)


def _check(reference, results, state_tol, grad_tol, label, grads=True):
    for rank, got in enumerate(results):
        where = f"{label} rank {rank}"
        if grads:
            compare(reference["grads"], got["grads"], label=where + " grads", **grad_tol).raise_if_failed()
        else:  # memory-tracked runs keep no copy of the gradients (it would count as memory)
            assert got["grads"] is None, where
        compare(reference["state"], got["state"], label=where + " state", **state_tol).raise_if_failed()
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5), where
    first = results[0]["state"]
    assert all(torch.equal(first[k], r["state"][k]) for r in results for k in first), (
        f"{label}: ranks disagree on the full state"
    )


@pytest.mark.parametrize("name,preset,world_size", CASES, ids=[f"{n}-{p}-{w}" for n, p, w in CASES])
def test_strategy_equals_reference(name, preset, world_size):
    cfgs = _configs(name, preset)
    runs = labkit.run(loop.train_each, name, cfgs, STEPS, world_size=world_size, timeout=240, spans=False)
    for i, cfg in enumerate(cfgs):
        ref = _reference((name, preset, cfg.dtype))
        results = [rank_runs[i] for rank_runs in runs]
        if cfg.dtype == torch.float64:
            _check(ref, results, FP64, FP64, f"{name} {preset} float64")
        else:
            state_tol = FP32 if preset == "toy" else FP32_GPT_STATE
            _check(ref, results, state_tol, FP32, f"{name} {preset} fp32")


def test_grads_catch_a_missing_loss_scale():
    """The tolerances have teeth: torch's DDP averages, and without the loop's loss scale its
    gradients are half the reference's while its state after 5 steps still looks close."""

    class Unscaled(strategies.get("torch-ddp")):
        reduce_op = "sum"  # a lie: the loop then does not multiply the loss by N

    cfg = loop.PRESETS["toy"]
    runs = labkit.run(loop.train, Unscaled, cfg, STEPS, world_size=2, timeout=120, spans=False)
    ref = loop.reference(cfg, STEPS)
    assert not compare(ref["grads"], runs[0]["grads"], **FP32).ok


class LearnerDDP(strategies.Strategy):
    """What a notebook exercise asks for: a class with the interface, nothing else."""

    def __init__(self, model, cfg):
        self.model = model
        self.optimizer = cfg.make_optimizer([p for p in model.parameters() if p.requires_grad])

    def after_backward(self):
        for p in self.model.parameters():
            if p.requires_grad:
                if p.grad is None:  # the toy's extra.bias: unused on every rank in this step
                    continue
                dist.all_reduce(p.grad)

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)


def test_a_learners_class_runs_in_the_loop():
    cfg = loop.PRESETS["toy"]
    results = labkit.run(loop.train, LearnerDDP, cfg, STEPS, world_size=2, timeout=120)
    _check(loop.reference(cfg, STEPS), list(results), FP32, FP32, "LearnerDDP")


def test_a_class_without_the_interface_is_refused():
    class NoStep:
        def __init__(self, model, cfg):
            self.model = model

        def __call__(self, *args):
            return self.model(*args)

        def zero_grad(self):
            pass

    with pytest.raises(TypeError, match="must subclass labkit.strategies.Strategy"):
        strategies.build(NoStep, nn.Linear(1, 1), loop.PRESETS["toy"])

    class StillNoStep(strategies.Strategy):  # the interface's base, without its step
        def __init__(self, model, cfg):
            self.model = model

        def zero_grad(self):
            pass

    with pytest.raises(TypeError, match="lacks step"):
        strategies.build(StillNoStep, nn.Linear(1, 1), loop.PRESETS["toy"])


def _accumulate_and_observe(names, cfg):
    """Rank function: two micro-batches per step (no_sync on the first) for each name, then
    fsdp and zero1 with memory tracking and spans."""
    out = {n: loop.train(n, cfg, STEPS, accum_steps=2, spans=False) for n in names}
    for n in ("fsdp", "zero1"):
        out[n + "+memory"] = loop.train(n, cfg, STEPS, track_memory=True, spans=True)
    # One warm-up step (trained, not timed) + STEPS - 1 timed ones: still the reference's 5 steps.
    out["ddp-flat+warmup"] = loop.train("ddp-flat", cfg, STEPS - 1, spans=False, hooks=loop.Hooks(warmup=1))
    return out


def test_accumulation_and_observation():
    cfg = loop.PRESETS["toy"]
    names = ["ddp-bucketed", "zero2", "fsdp", "torch-ddp", "torch-fsdp"]
    results = labkit.run(_accumulate_and_observe, names, cfg, world_size=2, timeout=240)
    ref = loop.reference(cfg, STEPS)
    for key in results[0]:
        # A third summation order (micro-batches of 2, 2 / 2, 1 rows); the toy stays within 1e-7.
        _check(ref, [r[key] for r in results], FP32, FP32, key, grads="+memory" not in key)
    for key in ("fsdp+memory", "zero1+memory"):
        assert results[0][key]["peak"] > 0 and results[0][key]["memory"], key
    assert len(results[0]["ddp-flat+warmup"]["step_s"]) == STEPS - 1
    spans = {s["name"] for s in results.traces[0]["spans"]}
    assert {"step", "forward", "backward", "sync", "optimizer"} <= spans


def _unit_of_everything(cfg, name="fsdp-flat"):
    return loop.train(name, cfg.replace(units="root"), STEPS, spans=False)


def test_fsdp_flat_refuses_an_unused_parameter_inside_a_used_unit():
    """fsdp-flat's flat shard would step a parameter unused in a step while the rest of its unit
    is used (a zero segment: AdamW decays it, FSDP1's behaviour) where the reference skips it (grad
    None): it refuses, naming it, on every rank (was a silent 1e-3 gap, a strict xfail)."""
    cfg = loop.PRESETS["toy"]
    with pytest.raises(Exception, match="extra.bias got no gradient on any rank since zero_grad") as err:
        labkit.run(_unit_of_everything, cfg, world_size=2, timeout=120)
    assert "'fsdp'" in str(err.value)


def _double_linear(name):
    """Rank function: Linear(1,1).double() whose every gradient is 1 + 1e-12 on each rank."""
    model = nn.Linear(1, 1).double()
    s = strategies.get(name)(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1 + 1e-12)
    s.sync_gradients()
    buffers = s.buffers if hasattr(s, "buffers") else [s.flat]
    return [p.grad.item() for p in model.parameters()], [b.dtype for b in buffers]


@pytest.mark.parametrize("name", ["ddp-flat", "ddp-bucketed"])
def test_ddp_buffers_follow_the_parameters_dtype(name):
    grads, dtypes = labkit.run(_double_linear, name, world_size=2, timeout=60)[0]
    assert grads == [2 * (1 + 1e-12)] * 2 and set(dtypes) == {torch.float64}


def test_units_by_class_or_predicate():
    cfg = loop.PRESETS["dp"]
    model = loop.build_model(cfg)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert plan_units(model, nn.Linear) == linears == plan_units(model, "linear")
    by_predicate = plan_units(model, _embedding_or_linear)
    assert by_predicate == [m for m in model.modules() if _embedding_or_linear(m)]
    assert model.tok_emb in by_predicate and model.lm_head in by_predicate
    assert plan_units(model, (nn.LayerNorm,)) == [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    toy = loop.build_model(loop.PRESETS["toy"])
    assert toy.extra.weight is toy.head.weight and not toy.frozen_in.weight.requires_grad


def _rank_dependent_extra(names, steps=1):
    """Rank function outside the loop (whose use_extra is per step, the same on every rank): only
    rank 0 uses the toy's `extra` layer, so extra.bias has a gradient on rank 0 alone."""
    cfg = loop.PRESETS["toy"]
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in names:
        s = strategies.build(name, loop.build_model(cfg), cfg)
        for step in range(steps):
            x, y = loop.global_batch(cfg, step)
            rows = labkit.data.rank_slice(len(x), rank, n)
            s.zero_grad()
            pred = s(x[rows], use_extra=rank == 0)
            (nn.functional.mse_loss(pred, y[rows], reduction="sum") / y.numel()).backward()
            s.after_backward()
            s.step()
        out[name] = s.full_state_dict()
    return out


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="documented gap (labkit.strategies.zero): ZeRO decides on its "
    "own rank whether a parameter got a gradient, so when only another rank used it "
    "the owner of its chunk skips the update (DDP's find_unused_parameters agrees)",
)
def test_zero_parameter_used_on_one_rank_only():
    results = labkit.run(_rank_dependent_extra, ["ddp-naive", "zero1"], world_size=2, timeout=120)
    report = compare(results[0]["ddp-naive"], results[0]["zero1"], **FP32)
    # After one step only the parameter in question may differ: anything else is another bug,
    # reported as a failure (pytest.fail), not as the expected AssertionError.
    if not {e.name for e in report.failures()} <= {"extra.bias"}:
        pytest.fail(str(report))
    report.raise_if_failed()


def test_fsdp_unused_parameter_inside_a_used_unit_gets_no_gradient():
    """The per-parameter FSDP has no such gap (fsdp-flat refuses it, above): a unit reduce-scatters only the
    gradients that exist, so extra.bias's .grad stays None on the steps that skip it."""
    cfg = loop.PRESETS["toy"]
    results = labkit.run(_unit_of_everything, cfg, "fsdp", world_size=2, timeout=120)
    compare(loop.reference(cfg, STEPS)["state"], results[0]["state"], **FP32).raise_if_failed()


class _Recording(strategies.Strategy):
    """A whole replica that records which interface call came when (and sums nothing: 1 rank)."""

    def __init__(self, model, cfg, **options):
        self.model, self.calls = model, []
        self.optimizer = cfg.make_optimizer([p for p in model.parameters() if p.requires_grad])

    @contextlib.contextmanager
    def no_sync(self):
        self.calls.append("no_sync")
        yield

    def after_backward(self):
        self.calls.append("after_backward")

    def step(self):
        self.calls.append("step")
        self.optimizer.step()

    def zero_grad(self):
        self.calls.append("zero_grad")
        self.optimizer.zero_grad(set_to_none=True)


def _train_through_train_step(cfg, steps):
    seen = []
    inner = loop.train_step

    def counting(s, batch, cfg, **kwargs):
        seen.append((batch.step, len(batch.parts)))
        return inner(s, batch, cfg, **kwargs)

    loop.train_step = counting  # this rank process only
    try:
        out = loop.train(_Recording, cfg, steps, accum_steps=3, spans=False)
    finally:
        loop.train_step = inner
    return seen, out["losses"]


def test_train_is_train_step_in_a_loop():
    """loop.train runs every step through loop.train_step (the function a learner reads), and
    train_step calls the interface in the documented order: zero_grad, no_sync around every
    micro-batch's backward but the last, after_backward, step."""
    cfg = loop.PRESETS["toy"]
    seen, losses = labkit.run(_train_through_train_step, cfg, 2, world_size=1, timeout=120)[0]
    assert seen == [(0, 3), (1, 3)] and len(losses) == 2
    model = loop.build_model(cfg)
    s = _Recording(model, cfg)
    x, y = loop.global_batch(cfg, 0)
    batch = loop.Batch(list(micro_batches(x, y, 3)), count=y.numel(), step=0)
    total = loop.train_step(s, batch, cfg)
    assert s.calls == ["zero_grad", "no_sync", "no_sync", "after_backward", "step"], s.calls
    assert abs(total.item() - losses[0]) < 1e-6, (total.item(), losses[0])
