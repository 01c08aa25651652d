"""One contract for every strategy (issue 56): each promise a test over every name in
`labkit.strategies.NAMES`, read from the code, so a new name is covered (or fails) by construction.

Layouts, also read from the code: every name at 2 ranks and at 4 (at 2 the data-parallel axis of
pp-zero1, fsdp-tp and the 3-D names is 1, which hides what its reduction does), on the "dp"
preset (TinyGPT, a tied embedding / head) in float64, or on "moe" for a name that refuses a model
without MoE layers (ep); a name that refuses 2 ranks by their number runs at 4 only. A pipeline
composed with TP (three_d.layout.Composed) also runs dp 2 x pp 2 x tp 1 besides its default
(dp 1 x pp 2 x tp 2 at 4 ranks). One launch per layout; each (name, promise) recorded by name, so
one red cell does not hide the others.

The promises, each against one process on the same global batch (float64, 1e-10):
- accumulate: two forward_backward + after_backward without zero_grad leave 2 G (one process's two
  backwards), not (N+1) G or G;
- micro-batches: forward_backward over 2 micro-batches (the first inside no_sync) leaves the whole
  batch's gradient, or the strategy refuses naming accum_steps (ep);
- clip: s.clip_grad_norm_(max_norm) returns one process's total norm on every rank, and the
  gradients after step() are one process's clipped ones;
- pipeline clip: labkit's pp.clip_grad_norm_ over a pipeline's stages is one process's norm, or
  refuses naming s.clip_grad_norm_ (ZeRO-1's moved gradients, DTensor stages);
- state: full_state_dict() after a step loads strictly into a plain model; the model object's own
  state_dict() either equals it (DTensors whole) or refuses, never a silently different value;
- frozen: a parameter frozen before the strategy is built stays put, the rest trains as one
  process (AdamW, weight decay on);
- unused: a parameter the forward never reads trains as one process (left untouched: no gradient,
  AdamW skips it), or the strategy refuses naming it (DDP's: find_unused_parameters, which then
  gives one process's step; fsdp-flat's flat shard would decay it);
- fp16: two steps under MixedPrecision(float16) equal one process under the same casts
  (precision_checks.check_same_casts), or fp16 is refused saying so (2 ranks);
- unknown option: a misspelled option raises TypeError naming it, on every rank;
- ranks disagree: an option with another value on one rank raises on every rank, naming it.
"""

import pytest
import torch

import labkit
from labkit import loop, strategies
from labkit.data import micro_batches, shard_batch
from labkit.strategies.three_d.layout import Composed
from labkit.strategies.tp.gpt import original_order

NAMES = strategies.NAMES
TOL = dict(rtol=1e-10, atol=1e-12)
MAX_NORM = 1.0  # below every total norm here: the clip bites


def _cfg(preset):
    return loop.PRESETS[preset].replace(batch_size=8, dtype=torch.float64)


def _layouts(world_size):
    """(name, options) pairs this launch runs: every name, and the Composed ones' second layout."""
    out = [(name, {}) for name in NAMES]
    if world_size == 4:
        out += [(name, {"tp": 1}) for name in NAMES if issubclass(strategies.get(name), Composed)]
    return out


def _build(name, options, prepare=None):
    """(strategy, model, cfg) on the first preset the name accepts; a refusal's message if none."""
    last = None
    for preset in ("dp", "moe"):
        cfg = _cfg(preset)
        model = loop.build_model(cfg)
        if prepare is not None:
            prepare(model)
        try:
            return strategies.build(name, model, cfg, **options), model, cfg, preset
        except (ValueError, NotImplementedError) as exc:
            last = f"{type(exc).__name__}: {exc}"
            if "MoE" not in str(exc):
                break
    return last


def _loss_fn(s, cfg, count):
    def loss_fn(a, b):
        return loop.summed_loss(s, cfg, a, b, 0) / count

    return loss_fn


def _batch(s, cfg):
    x, y = loop.global_batch(cfg, 0)
    rows = shard_batch(x, y, s.data_rank(), s.data_world_size())
    scale = s.data_world_size() if s.reduce_op == "avg" else 1
    return [rows], y.numel(), scale


def _backwards(s, cfg, times):
    """zero_grad, then `times` forward_backward + after_backward on step 0's rows (no zero_grad
    between them), as the loop's train_step runs one."""
    parts, count, scale = _batch(s, cfg)
    s.zero_grad()
    for _ in range(times):
        s.forward_backward(parts, _loss_fn(s, cfg, count), scale=scale)
        s.after_backward()


def _accumulate(name, options):
    built = _build(name, options)
    if isinstance(built, str):
        return built
    s, model, cfg, preset = built
    _backwards(s, cfg, 2)
    s.step()
    return preset, {k: v.cpu() for k, v in s.full_grad_dict().items()}


def _micro_batches(name, options):
    """One step's rows as 2 micro-batches through forward_backward (the first's backward inside
    no_sync: the strategy's own accumulation), then after_backward: the gradient of the whole
    batch, as one process's; or a refusal naming why."""
    built = _build(name, options)
    if isinstance(built, str):
        return built
    s, model, cfg, preset = built
    (rows,), count, scale = _batch(s, cfg)
    s.zero_grad()
    try:
        s.forward_backward(list(micro_batches(*rows, 2)), _loss_fn(s, cfg, count), scale=scale)
    except NotImplementedError as exc:
        return "refused", f"{type(exc).__name__}: {exc}"
    s.after_backward()
    s.step()
    return preset, {k: v.cpu() for k, v in s.full_grad_dict().items()}


def _clip(name, options):
    built = _build(name, options)
    if isinstance(built, str):
        return built
    s, model, cfg, preset = built
    _backwards(s, cfg, 1)
    norm = s.clip_grad_norm_(MAX_NORM)
    s.step()
    return preset, (float(norm), {k: v.cpu() for k, v in s.full_grad_dict().items()})


def _torch_clip(name, options):
    """torch.nn.utils.clip_grad_norm_ over model.parameters() (and, for a pipeline, labkit's
    pp.clip_grad_norm_ over its stages' parameters), as a user would call them after
    after_backward: each must give one process's total norm, or refuse by name."""
    from labkit.strategies.pp import clip_grad_norm_ as pp_clip

    built = _build(name, options)
    if isinstance(built, str):
        return built
    s, model, cfg, preset = built
    _backwards(s, cfg, 1)
    out = {}
    calls = {"torch": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)}
    if hasattr(s, "pipeline"):
        calls["pp"] = lambda: pp_clip(s.pipeline.parameters(), 1e9, group=getattr(s, "group", None))
    for key, fn in calls.items():
        try:
            norm = fn()
            out[key] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        except Exception as exc:  # a refusal: its words are checked
            out[key] = f"{type(exc).__name__}: {exc}"
    return preset, out


def _state(name, options):
    built = _build(name, options)
    if isinstance(built, str):
        return built
    s, model, cfg, preset = built
    parts, count, scale = _batch(s, cfg)
    loop.train_step(s, loop.Batch(parts, count, 0), cfg, scale=scale)
    full = {k: v.cpu() for k, v in s.full_state_dict().items()}
    out = {"full": full}
    plain = loop.build_model(cfg)
    try:
        plain.load_state_dict(full, strict=True)
        out["loads"] = None
    except RuntimeError as exc:
        out["loads"] = str(exc)
    try:
        own = model.state_dict()
        out["own"] = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in own.items()
        }
    except Exception as exc:  # a refusal, by name: recorded
        out["own"] = f"{type(exc).__name__}: {exc}"
    mesh = getattr(s, "mesh", None)
    if isinstance(out["own"], dict) and mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
        # A tensor-parallel TinyGPT keeps qkv's rows in its heads' order (tp/gpt.py's docstring,
        # torch's oracle alike): put back in [q; k; v] order, it must be what was trained.
        out["own in [q; k; v] order"] = original_order(out["own"], model, mesh["tp"].size())
    return preset, out


def _refusals(name, options):
    import torch.distributed as dist

    out = {}
    built = _build(name, options)
    if isinstance(built, str):
        return built
    _, _, cfg, preset = built
    for key, opts in (
        ("unknown", {**options, "find_unused_paramters": True}),
        ("disagree", {**options, "comm": "ring" if dist.get_rank() == 0 else "torch"}),
    ):
        try:
            strategies.build(name, loop.build_model(cfg), cfg, **opts)
            out[key] = None
        except (TypeError, ValueError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    return preset, out


FROZEN = "blocks.0.ln1.weight"  # a parameter every layout holds whole or splits alike


def _frozen(name, options):
    """One optimizer step (AdamW, weight decay on) with FROZEN frozen before the strategy is built:
    the trained state, which must be one process's (the frozen weight unmoved, not decayed)."""
    built = _build_frozen(name, options)
    if isinstance(built, str):
        return built
    s, model, cfg, preset = built
    parts, count, scale = _batch(s, cfg)
    loop.train_step(s, loop.Batch(parts, count, 0), cfg, scale=scale)
    return preset, {k: v.cpu() for k, v in s.full_state_dict().items()}


def _build_frozen(name, options):
    return _build(
        name, options, prepare=lambda model: dict(model.named_parameters())[FROZEN].requires_grad_(False)
    )


UNUSED = "blocks.0.extra"  # a parameter added to the model that its forward never reads


def _add_unused(model):
    model.blocks[0].extra = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))


def _unused(name, options):
    """One optimizer step (AdamW, weight decay on) with UNUSED in the model: the trained state, which
    must be one process's (UNUSED untouched: its grad stays None, AdamW skips it), or a refusal
    naming it. A refusal that names find_unused_parameters is taken at its word: the step again
    with it, which must then be one process's."""
    out = {}
    for extra in ({}, {"find_unused_parameters": True}):
        built = _build(name, {**options, **extra}, prepare=_add_unused)
        if isinstance(built, str):
            return built
        s, model, cfg, preset = built
        parts, count, scale = _batch(s, cfg)
        try:
            loop.train_step(s, loop.Batch(parts, count, 0), cfg, scale=scale)
            out[str(extra)] = {k: v.cpu() for k, v in s.full_state_dict().items()}
        except RuntimeError as exc:
            out[str(extra)] = f"{type(exc).__name__}: {exc}"
        if not isinstance(out[str(extra)], str) or "find_unused_parameters" not in out[str(extra)]:
            break
    return preset, out


def _fp16(name, options):
    """Two steps under MixedPrecision(float16) (fp16 compute, dynamic loss scaling), at 2 ranks:
    what loop.train returns, for the same-cast check; or the refusal's words."""
    import torch.distributed as dist

    from labkit.strategies.precision import MixedPrecision

    if dist.get_world_size() != 2:
        return "world size: fp16 is checked at 2 ranks"
    last = None
    for preset in ("dp", "moe"):
        cfg = loop.PRESETS[preset].replace(
            batch_size=8, mp=MixedPrecision(torch.float16, torch.float32), steps=2
        )
        try:
            return preset, loop.train(name, cfg, spans=False, **options)
        except (ValueError, NotImplementedError) as exc:
            last = f"{type(exc).__name__}: {exc}"
            if "MoE" not in str(exc):
                break
    return "refused", last


PROMISES = {
    "accumulate": _accumulate,
    "micro-batches": _micro_batches,
    "clip": _clip,
    "torch clip": _torch_clip,
    "state": _state,
    "frozen": _frozen,
    "fp16": _fp16,
    "refusals": _refusals,
    "unused": _unused,
}


def _rank(world_size):
    out = {}
    for name, options in _layouts(world_size):
        for promise, fn in PROMISES.items():
            try:
                out[name, str(options), promise] = fn(name, options)
            except Exception as exc:  # every cell recorded: one red cell hides no other
                out[name, str(options), promise] = ("raised", f"{type(exc).__name__}: {exc}")
    return out


@pytest.fixture(scope="module")
def launches():
    return {n: labkit.run(_rank, n, world_size=n, timeout=900) for n in (2, 4)}


def _one_process(cfg, backwards):
    model = loop.build_model(cfg)
    x, y = loop.global_batch(cfg, 0)
    for _ in range(backwards):
        (loop.summed_loss(model, cfg, x, y, 0) / y.numel()).backward()
    return model


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


CELLS = [(n, lay) for n in NAMES for lay in ("2", "4")] + [
    (n, "4 tp=1") for n in NAMES if issubclass(strategies.get(n), Composed)
]


def _results(launches, name, layout, promise):
    """Every rank's result of one cell, or None where the name refuses that world size."""
    world = int(layout.split()[0])
    options = "{'tp': 1}" if layout.endswith("tp=1") else "{}"
    results = [r[name, options, promise] for r in launches[world]]
    first = results[0]
    if isinstance(first, str) and ("world size" in first or "world_size" in first):
        return None  # a refusal of this world size, by its number (another layout runs it)
    for r in results:
        assert r[0] != "raised", f"{name} ({layout}) {promise}: {r[1]}"
        assert not isinstance(r, str), f"{name} ({layout}) {promise}: refused to build: {r}"
    preset = results[0][0]
    return (_cfg(preset) if preset in loop.PRESETS else None), [r[1] for r in results]


def _skip(name, layout):
    pytest.skip(f"{name} refuses {layout} ranks by their number (another layout runs it)")


def _every_name_runs_somewhere(launches, promise):
    ran = {n for n, lay in CELLS if _results(launches, n, lay, promise) is not None}
    assert ran == set(NAMES), f"{promise}: never ran: {sorted(set(NAMES) - ran)}"


def _equal(a, b):
    return set(a) <= set(b) and all(
        v.shape == b[k].shape and torch.equal(v.to(b[k].dtype), b[k]) for k, v in a.items()
    )


def _assert_close(expected, got, label):
    assert set(got) == set(expected), f"{label}: keys {sorted(set(got) ^ set(expected))}"
    for k in expected:
        g = got[k].to(expected[k].dtype)
        if not torch.allclose(g, expected[k], **TOL):
            ratio = float((g * expected[k]).sum() / (expected[k] * expected[k]).sum())
            err = float((g - expected[k]).abs().max())
            raise AssertionError(f"{label}: {k} is {ratio:.3f} x one process's (max error {err:.2e})")


@pytest.mark.parametrize("name,layout", CELLS, ids=[f"{n}-{lay}" for n, lay in CELLS])
def test_two_backwards_without_zero_grad_accumulate_as_one_process(launches, name, layout):
    cfg, results = _results(launches, name, layout, "accumulate") or _skip(name, layout)
    expected = _grads(_one_process(cfg, backwards=2))
    for rank, got in enumerate(results):
        _assert_close(expected, got, f"{name} ({layout}) rank {rank}: 2 backwards")


@pytest.mark.parametrize("name,layout", CELLS, ids=[f"{n}-{lay}" for n, lay in CELLS])
def test_micro_batches_accumulate_the_strategys_own_way_as_one_process(launches, name, layout):
    cfg, results = _results(launches, name, layout, "micro-batches") or _skip(name, layout)
    if cfg is None:  # refused: it must say what it leaves out
        assert all("micro-batch" in r and "accum_steps" in r for r in results), results[0]
        return
    expected = _grads(_one_process(cfg, backwards=1))
    for rank, got in enumerate(results):
        _assert_close(expected, got, f"{name} ({layout}) rank {rank}: 2 micro-batches")


@pytest.mark.parametrize("name,layout", CELLS, ids=[f"{n}-{lay}" for n, lay in CELLS])
def test_clip_grad_norm_is_one_process(launches, name, layout):
    cfg, results = _results(launches, name, layout, "clip") or _skip(name, layout)
    model = _one_process(cfg, backwards=1)
    total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    assert total > MAX_NORM  # the clip bites
    for rank, (norm, grads) in enumerate(results):
        assert norm == pytest.approx(total, rel=1e-10), (
            f"{name} ({layout}) rank {rank}: norm {norm} vs {total}"
        )
        _assert_close(_grads(model), grads, f"{name} ({layout}) rank {rank}: clipped")


# torch's own clip_grad_norm_ over model.parameters() cannot know where a strategy keeps its
# gradients. Where torch's own strategy (the same layout) gives a per-rank number too, so does
# ours: a pipeline's stage norm (torch-pp), a mixed Tensor / DTensor refusal (torch-tp, torch-sp,
# torch-fsdp-tp). Where the gradients are not in .grad at all after after_backward (ZeRO's
# reduce-scatter, FSDP1's flat shards) torch's clip sees nothing or one rank's part, as it does on
# torch's FSDP1 (whose docs point to FullyShardedDataParallel.clip_grad_norm_): s.clip_grad_norm_
# is the one that works. labkit's pp.clip_grad_norm_ must be one process's or refuse, naming it.
@pytest.mark.parametrize("name,layout", CELLS, ids=[f"{n}-{lay}" for n, lay in CELLS])
def test_pipeline_clip_is_one_process_or_names_the_strategys_own(launches, name, layout):
    cfg, results = _results(launches, name, layout, "torch clip") or _skip(name, layout)
    if "pp" not in results[0]:
        pytest.skip(f"{name} has no pipeline")
    model = _one_process(cfg, backwards=1)
    total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    for rank, out in enumerate(results):
        got = out["pp"]
        if isinstance(got, str):
            assert "s.clip_grad_norm_" in got, f"{name} ({layout}) rank {rank}: {got}"
        else:
            assert got == pytest.approx(total, rel=1e-10), f"{name} ({layout}) rank {rank}: {got} vs {total}"


@pytest.mark.parametrize("name,layout", CELLS, ids=[f"{n}-{lay}" for n, lay in CELLS])
def test_state_dict_loads_into_a_plain_model_and_the_model_object_agrees_or_refuses(launches, name, layout):
    _, results = _results(launches, name, layout, "state") or _skip(name, layout)
    for rank, out in enumerate(results):
        assert out["loads"] is None, f"{name} ({layout}) rank {rank}: full_state_dict: {out['loads']}"
        if isinstance(out["own"], str):
            continue  # the model object refuses, saying why
        own = out["own"]
        if "own in [q; k; v] order" in out and not _equal(own, out["full"]):
            own = out["own in [q; k; v] order"]  # tp's qkv rows in its heads' order, stated
        for k, v in own.items():
            assert k in out["full"], f"{name} ({layout}): model.state_dict() has {k}, the strategy does not"
            assert v.shape == out["full"][k].shape and torch.equal(
                v.to(out["full"][k].dtype), out["full"][k]
            ), f"{name} ({layout}) rank {rank}: model.state_dict()[{k!r}] is not what the strategy trained"


@pytest.mark.parametrize("name,layout", CELLS, ids=[f"{n}-{lay}" for n, lay in CELLS])
def test_unknown_and_disagreeing_options_raise_on_every_rank(launches, name, layout):
    _, results = _results(launches, name, layout, "refusals") or _skip(name, layout)
    for rank, out in enumerate(results):
        assert out["unknown"] is not None and "find_unused_paramters" in out["unknown"], (name, rank, out)
        assert out["disagree"] is not None and "disagree on option(s) 'comm'" in out["disagree"], (
            name,
            rank,
            out,
        )


@pytest.mark.parametrize("name,layout", CELLS, ids=[f"{n}-{lay}" for n, lay in CELLS])
def test_a_frozen_parameter_trains_as_one_process(launches, name, layout):
    cfg, results = _results(launches, name, layout, "frozen") or _skip(name, layout)
    model = loop.build_model(cfg)
    params = dict(model.named_parameters())
    params[FROZEN].requires_grad_(False)
    before = params[FROZEN].detach().clone()
    optimizer = cfg.make_optimizer([p for p in model.parameters() if p.requires_grad])
    x, y = loop.global_batch(cfg, 0)
    (loop.summed_loss(model, cfg, x, y, 0) / y.numel()).backward()
    optimizer.step()
    expected = {k: v.detach() for k, v in model.state_dict().items()}
    for rank, got in enumerate(results):
        assert torch.equal(got[FROZEN], before), f"{name} ({layout}) rank {rank}: the frozen {FROZEN} moved"
        for k in expected:
            assert torch.allclose(got[k], expected[k], rtol=0, atol=1e-10), (
                f"{name} ({layout}) rank {rank}: {k} after one step is not one process's "
                f"(max error {float((got[k] - expected[k]).abs().max()):.2e})"
            )


@pytest.mark.parametrize("name,layout", CELLS, ids=[f"{n}-{lay}" for n, lay in CELLS])
def test_an_unused_parameter_trains_as_one_process_or_is_refused_by_name(launches, name, layout):
    cfg, results = _results(launches, name, layout, "unused") or _skip(name, layout)
    model = loop.build_model(cfg)
    _add_unused(model)
    optimizer = cfg.make_optimizer(model.parameters())
    x, y = loop.global_batch(cfg, 0)
    (loop.summed_loss(model, cfg, x, y, 0) / y.numel()).backward()
    optimizer.step()
    expected = {k: v.detach() for k, v in model.state_dict().items()}
    assert torch.equal(expected[UNUSED], torch.ones(4, dtype=torch.float64))
    for rank, out in enumerate(results):
        got = out[list(out)[-1]]  # with find_unused_parameters, where the first refusal named it
        if isinstance(got, str):
            assert UNUSED in got and ("'fsdp'" in got or "find_unused_parameters" in got), (name, rank, got)
            assert len(out) == 1, (
                f"{name} ({layout}) rank {rank}: refused even with find_unused_parameters: {got}"
            )
            continue
        for k in expected:
            assert k in got, f"{name} ({layout}) rank {rank}: {k} missing from full_state_dict"
            assert torch.allclose(got[k], expected[k], rtol=0, atol=1e-10), (
                f"{name} ({layout}) rank {rank}: {k} after one step is not one process's "
                f"(max error {float((got[k] - expected[k]).abs().max()):.2e})"
            )


@pytest.mark.parametrize("name,layout", CELLS, ids=[f"{n}-{lay}" for n, lay in CELLS])
def test_fp16_equals_one_process_under_the_same_casts_or_is_refused(launches, name, layout):
    """Every name under fp16 (its loss scale in every backward, torch's schedules' included) is
    one process under the same casts, or refuses fp16 saying so (torch-pp once reported gradients
    1 / 65,536 of the reference's: its schedule's backward started from the unscaled loss)."""
    from labkit.labs.precision_checks import check_same_casts, grad_ulps_for
    from labkit.strategies.precision import MixedPrecision

    world = int(layout.split()[0])
    results = [r[name, "{}" if not layout.endswith("tp=1") else "{'tp': 1}", "fp16"] for r in launches[world]]
    first = results[0]
    if isinstance(first, str):
        _skip(name, layout)
    if first[0] == "refused":
        assert "fp16" in first[1] or "needs CUDA" in first[1] or "float16" in first[1], first[1]
        return
    if first[0] == "raised":
        raise AssertionError(f"{name} ({layout}) fp16: {first[1]}")
    cfg = loop.PRESETS[first[0]].replace(
        batch_size=8, mp=MixedPrecision(torch.float16, torch.float32), steps=2
    )
    ref, fp32 = loop.reference(cfg), loop.reference(cfg.replace(mp=None))
    check_same_casts(first[1], cfg, f"{name} fp16 ({layout})", ref, fp32, grad_ulps_for(name, world))


@pytest.mark.parametrize("promise", list(PROMISES))
def test_every_name_is_checked_on_some_layout(launches, promise):
    _every_name_runs_somewhere(launches, promise)
