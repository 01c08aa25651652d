"""The hand-written per-parameter FSDP (labkit.strategies.fsdp, FSDP2's model) on labkit.loop.train
against single-process training (loop.reference) and against PyTorch's fully_shard ("torch-fsdp",
the same units), on real gloo ranks: presets "fsdp" (TinyGPT, 8 blocks) and "toy" (frozen
weight, a weight tied across units, a parameter unused on even steps, odd sizes, 7 rows), 2 and 3
ranks; reshard_after_forward False, prefetch 0/1/2, units root/block/Linear, accum_steps=2,
float64; then shards, padding, grads and state of fully_shard_by_hand on any module, collective
counts, the observe hook. One launch per (preset, world size), module-scoped; TinyGPT on 3 ranks
runs only what the world size changes (GPT_AT_3).

Tolerances, each as tight as the arithmetic allows (measured values in the constants' comments):
- vs fully_shard on 2 ranks: EXACT. Same shards, same two-term sums (a + b is one rounding in
  either order), AVG of two is SUM / 2 exactly, the same AdamW: every state and gradient element
  measured bit-identical, for every configuration here, both presets.
  With accum_steps=2 fully_shard keeps unsharded gradients and reduce-scatters once, this one
  reduce-scatters per micro-batch: (a1 + b1) + (a2 + b2) vs (a1 + a2) + (b1 + b2), so as on 3 ranks.
- vs fully_shard on 3 ranks: step-0 gradients rtol 1e-5 / atol 1e-7 (labkit's ring and gloo sum
  three terms in different orders, and torch's AVG divides by 3: one rounding apart); state after
  5 steps as vs the reference below (AdamW amplifies those roundings).
- vs loop.reference, fp32: gradients rtol 1e-5 / atol 1e-7 (measured <= 6e-8); state on the toy
  rtol 1e-5 / atol 1e-7; on TinyGPT atol 5e-5 (the summation order moves a gradient by ~1e-10 and
  AdamW turns that into up to lr/eps = 1e4 times more on elements whose gradient is near its eps,
  see labkit.loop.EPS; measured <= 5e-6 on 2 ranks, <= 1.3e-5 with accum_steps=2), the same bound
  test_loop uses for TinyGPT.
- float64: atol 1e-12 (measured <= 1.5e-14).
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import labkit
from labkit import loop
from labkit.checks import compare
from labkit.strategies.precision import MixedPrecision
from labkit.strategies.fsdp import (
    FSDPModule,
    collective_counts,
    full_grad_dict,
    full_state_dict,
    fully_shard_by_hand,
)

STEPS = 5
EXACT = dict(rtol=0, atol=0)
FP32 = dict(rtol=1e-5, atol=1e-7)
FP32_GPT_STATE = dict(rtol=1e-5, atol=5e-5)
FP64 = dict(rtol=0, atol=1e-12)
GPT, TOY = loop.PRESETS["fsdp"], loop.PRESETS["toy"]
COUNTED = dict(hooks=loop.Hooks(report=collective_counts))


# On 3 ranks (uneven shards, three-term sums) TinyGPT runs what the world size changes: the
# shards and padding (block, float64), the per-micro-batch reduce-scatter (accum) and torch's;
# the unit plans, resharding and prefetch depths run on 2 ranks and on the toy at both sizes
# (each of TinyGPT's 9 runs on 3 ranks cost about 4 s of a 38 s launch).
GPT_AT_3 = ("torch", "block", "accum", "torch-accum", "float64")


def _runs(cfg, world_size=2):
    """label -> loop.train options; "torch*" are fully_shard on the same units."""
    runs = {
        "torch": dict(strategy="torch-fsdp"),
        "block": dict(strategy="fsdp", **COUNTED),  # prefetch 1
        "kept": dict(strategy="fsdp", reshard_after_forward=False, prefetch=0, **COUNTED),
        "prefetch2": dict(strategy="fsdp", prefetch=2, max_inflight=1, **COUNTED),
        "root": dict(strategy="fsdp", cfg=cfg.replace(units="root"), prefetch=0, **COUNTED),
        "linear": dict(strategy="fsdp", cfg=cfg.replace(units=nn.Linear), prefetch=2),
        "accum": dict(strategy="fsdp", accum_steps=2, **COUNTED),
        "torch-accum": dict(strategy="torch-fsdp", accum_steps=2),
        "float64": dict(strategy="fsdp", cfg=cfg.replace(dtype=torch.float64)),
    }
    if cfg.model == "toy":
        # The tie across units kept: head and extra stay units, the shared weight goes to the root
        # (fully_shard cannot do that, so this one is checked against the reference only).
        runs["tied-units"] = dict(strategy="fsdp", like_torch=False, **COUNTED)
    if cfg.model != "toy" and world_size == 3:
        runs = {k: v for k, v in runs.items() if k in GPT_AT_3}
    return runs


@functools.lru_cache(maxsize=None)
def _launch(preset, world_size):
    cfg = loop.PRESETS[preset]
    runs = _runs(cfg, world_size)
    results = labkit.run(
        loop.sweep, list(runs.values()), cfg=cfg, steps=STEPS, spans=False, world_size=world_size, timeout=600
    )
    return {label: [rank[i] for rank in results] for i, label in enumerate(runs)}


@functools.lru_cache(maxsize=None)
def _reference(preset, dtype=torch.float32):
    return loop.reference(loop.PRESETS[preset].replace(dtype=dtype), STEPS)


def _check(expected, results, state_tol, grad_tol, label):
    for rank, got in enumerate(results):
        where = f"{label} rank {rank}"
        compare(expected["grads"], got["grads"], label=where + " grads", **grad_tol).raise_if_failed()
        compare(expected["state"], got["state"], label=where + " state", **state_tol).raise_if_failed()
    first = results[0]["state"]
    assert all(torch.equal(first[k], r["state"][k]) for r in results for k in first), (
        f"{label}: ranks disagree on the full state"
    )


CASES = [
    (p, n, label)
    for p in ("fsdp", "toy")
    for n in (2, 3)
    for label in _runs(loop.PRESETS[p], n)
    if not label.startswith("torch")
]


@pytest.mark.parametrize("preset,world_size,label", CASES, ids=[f"{p}-{n}-{lab}" for p, n, lab in CASES])
def test_equals_single_process(preset, world_size, label):
    got = _launch(preset, world_size)[label]
    if label == "float64":
        _check(_reference(preset, torch.float64), got, FP64, FP64, label)
        return
    state_tol = FP32 if preset == "toy" else FP32_GPT_STATE
    _check(_reference(preset), got, state_tol, FP32, label)
    for result in got:
        assert result["losses"] == pytest.approx(_reference(preset)["losses"], rel=1e-5)


@pytest.mark.parametrize(
    "preset,world_size,label",
    [c for c in CASES if c[2] not in ("float64", "tied-units")],
    ids=[f"{p}-{n}-{lab}" for p, n, lab in CASES if lab not in ("float64", "tied-units")],
)
def test_equals_fully_shard(preset, world_size, label):
    runs = _launch(preset, world_size)
    torch_run = runs["torch-accum" if label == "accum" else "torch"][0]
    if world_size == 2 and label != "accum":
        state_tol = grad_tol = EXACT
    else:
        state_tol, grad_tol = (FP32 if preset == "toy" else FP32_GPT_STATE), FP32
    _check(torch_run, runs[label], state_tol, grad_tol, f"{label} vs fully_shard")


def test_collective_counts():
    # 8 blocks + the root, which stays gathered from forward to backward (as FSDP2's root does).
    runs = _launch("fsdp", 2)
    blocks = GPT.gpt["n_layers"]
    for label in ("block", "prefetch2"):  # prefetch moves gathers earlier, it adds none
        assert runs[label][0]["gathers"] == 1 + 2 * blocks, label  # forward AND backward
    assert runs["kept"][0]["gathers"] == 1 + blocks  # forward only
    assert runs["root"][0]["gathers"] == runs["root"][0]["reduce_scatters"] == 1
    for label in ("block", "kept", "prefetch2"):
        assert runs[label][0]["reduce_scatters"] == 1 + blocks, label
    # Every micro-batch reduce-scatters (gradients stay sharded) and re-gathers.
    assert runs["accum"][0]["reduce_scatters"] == 2 * (1 + blocks)
    assert runs["accum"][0]["gathers"] == 2 * (1 + 2 * blocks)


def test_tied_weight_keeps_both_keys_and_one_value():
    for preset, (a, b) in (
        ("fsdp", ("tok_emb.weight", "lm_head.weight")),
        ("toy", ("head.weight", "extra.weight")),
    ):
        for label in ("block", "tied-units") if preset == "toy" else ("block",):
            state = _launch(preset, 3)[label][0]["state"]
            assert set(state) == set(loop.build_model(loop.PRESETS[preset]).state_dict()), label
            assert torch.equal(state[a], state[b]), (preset, label)


def _sharded_toy():
    """Rank function: fully_shard_by_hand on every Linear of the toy, then the root; the shards,
    the padding, the class swap, the storage, a step's gradients and the full state, asserted."""
    cfg, n, rank = TOY, dist.get_world_size(), dist.get_rank()
    model = loop.build_model(cfg)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    for m in [m for m in model.modules() if isinstance(m, nn.Linear)]:
        fully_shard_by_hand(m)
    fully_shard_by_hand(model)
    assert isinstance(model, FSDPModule) and type(model).__mro__[2].__name__ == "ToyModel"
    assert isinstance(model.head, FSDPModule) and isinstance(model.head, nn.Linear)
    assert model.head.weight is model.extra.weight  # still one Parameter, now the shard
    groups = {m._fsdp_group.label: m._fsdp_group for m in model.modules() if isinstance(m, FSDPModule)}
    assert [p.names for p in groups["root"].params] == [["head.weight", "extra.weight"]]
    for group in groups.values():
        for p in group.params:
            rows = -(-p.shape[0] // n)
            # The padded shard the collectives use; the module holds a DTensor of the global
            # shape (fully_shard's) whose local rows are a view of it.
            assert p.padded.shape == (rows, *p.shape[1:]), p.names
            assert p.sharded.shape == p.shape and isinstance(p.sharded, DTensor), p.names
            assert model.get_parameter(p.names[0]) is p.sharded
            mine = full[p.names[0]][rank * rows : (rank + 1) * rows]
            assert torch.equal(p.sharded.to_local(), mine), p.names
            assert p.aliases_padded(), p.names
            assert torch.equal(p.padded[: len(mine)], mine), p.names
            assert not p.padded[len(mine) :].any(), f"{p.names}: padding is not zero"
            assert p.unsharded.untyped_storage().nbytes() == 0
    assert not model.frozen_in.weight.requires_grad
    model.encoder.unshard()  # the FSDPModule methods, by hand
    assert torch.equal(model.encoder.weight, full["encoder.weight"])
    model.encoder.reshard()
    assert model.encoder.weight.to_local().shape[0] == len(range(13)[rank * -(-13 // n) :][: -(-13 // n)])
    x, y = loop.global_batch(cfg, 1)
    loss = loop.summed_loss(model, cfg, x, y, 1) / y.numel()  # step 1 uses `extra`
    loss.backward()
    for group in groups.values():
        assert group.state == "sharded", group.label
        for p in group.params:
            assert p.unsharded.untyped_storage().nbytes() == 0 and p.unsharded.grad is None
            if p.requires_grad:
                assert p.sharded.grad.shape == p.sharded.shape, p.names
                assert p.sharded.grad.to_local().shape == p.sharded.to_local().shape, p.names
            else:
                assert p.sharded.grad is None
    state = full_state_dict(model)
    assert list(state) == list(full)
    assert all(torch.equal(state[k], full[k]) for k in full)
    return full_grad_dict(model)


def test_fully_shard_by_hand_shards_in_place_on_the_toy():
    model = loop.build_model(TOY)
    x, y = loop.global_batch(TOY, 1)
    (loop.summed_loss(model, TOY, x, y, 1) / y.numel()).backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for n in (2, 3):
        for rank, grads in enumerate(labkit.run(_sharded_toy, world_size=n, timeout=120)):
            # Every rank saw the whole batch and the reduce-scatter averages (fully_shard's
            # default): the single-process gradient.
            compare(expected, grads, rank=rank, **FP32).raise_if_failed()


class _Mixed(nn.Module):
    """A unit mixing dtypes (fp32 Linear, fp64 LayerNorm) and a 0-dim parameter: what one flat
    buffer per unit cannot hold and per-parameter sharding can."""

    def __init__(self):
        super().__init__()
        self.lin, self.ln = nn.Linear(5, 3), nn.LayerNorm(3).double()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return (self.ln(self.lin(x).double()) * self.scale).sum()


def _mixed_grads():
    torch.manual_seed(0)
    model = _Mixed()
    fully_shard_by_hand(model.lin)
    fully_shard_by_hand(model)
    assert model.scale.shape == (1,) and model.ln.weight.dtype == torch.float64
    model(torch.ones(4, 5)).backward()
    return full_grad_dict(model), full_state_dict(model)


def test_mixed_dtypes_and_a_scalar_in_one_unit():
    torch.manual_seed(0)
    model = _Mixed()
    model(torch.ones(4, 5)).backward()
    for rank, (grads, state) in enumerate(labkit.run(_mixed_grads, world_size=3, timeout=60)):
        expected = {n: p.grad for n, p in model.named_parameters()}  # AVG of 3 equal ones
        compare(expected, grads, rank=rank, **FP32).raise_if_failed()
        assert grads["ln.weight"].dtype == torch.float64 and grads["scale"].shape == ()
        compare(model.state_dict(), state, rank=rank, **EXACT).raise_if_failed()


def _precision_and_avg():
    """Rank function: bf16 mixed precision (Preset.mp, which loop.train hands every strategy as
    mp_policy) and reduce_op="avg", ours and fully_shard's; fsdp-flat (FSDP1's flat buffers) in bf16."""
    cfg = loop.PRESETS["dp"]
    mixed = cfg.replace(mp=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    runs = [
        dict(strategy="fsdp", cfg=mixed),
        dict(strategy="torch-fsdp", cfg=mixed),
        dict(strategy="fsdp", reduce_op="avg"),
        dict(strategy="torch-fsdp"),
        dict(strategy="fsdp-flat", cfg=mixed),
    ]
    return loop.sweep(runs, cfg=cfg, steps=3, spans=False)


def test_mixed_precision_and_avg_equal_fully_shard_bit_for_bit():
    # bf16 all-gather and compute, fp32 reduce-scatter and master shards, on both sides; AVG is
    # SUM / 2 exactly on 2 ranks. (Against the mixed-precision reference they differ by bf16's
    # rounding of a summed gradient, ~9e-3 after 3 steps, fully_shard alike: its tests' business.)
    # fsdp-flat's fp32 flat shards, bf16 gathers, fp32 reduce-scatter: the same numbers (a sum of 2
    # is a sum of 2, whatever the buffer's cut).
    mixed, torch_mixed, avg, torch_avg, flat = labkit.run(_precision_and_avg, world_size=2, timeout=240)[0]
    for ours, theirs in ((mixed, torch_mixed), (avg, torch_avg), (flat, torch_mixed)):
        assert ours["losses"] == theirs["losses"]
        compare(theirs["state"], ours["state"], **EXACT).raise_if_failed()
    assert all(v.dtype == torch.float32 for v in [*mixed["state"].values(), *flat["state"].values()])


def _observed():
    from labkit.strategies.fsdp.param import FSDPParam  # noqa: F401  (the shard arithmetic)

    n = dist.get_world_size()
    out = loop.train("fsdp", GPT, 1, track_memory=True, return_state=False)
    model = loop.build_model(GPT)
    out["shard_bytes"] = sum(
        -(-p.shape[0] // n) * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters()
    )
    return out


def test_unit_spans_memory_samples_and_categories_come_through_the_observe_hook():
    results = labkit.run(_observed, world_size=2, timeout=180)
    names = {s["name"] for s in results.traces[0]["spans"]}
    assert {"fwd blocks.0", "bwd blocks.0", "fwd blocks.7", "bwd blocks.7"} <= names, names
    samples = results[0]["memory"].samples
    assert {"unshard blocks.0", "reshard blocks.1", "after backward"} <= {s.label for s in samples}
    # A one-step run peaks at its first optimizer step (AdamW's state appears), all resharded.
    assert max(s.by_category["all_gather"] for s in samples) > 0
    # The tracker counts this rank's shards (padding included) as its parameters, nothing more.
    after = [s for s in samples if s.label == "after step"][-1]
    assert after.by_category["parameters"] == results[0]["shard_bytes"]
    assert after.by_category["all_gather"] == 0  # every unit resharded


def _meta_init_state():
    # fsdp-flat keeps FSDP1's sync_module_states: ranks but 0 build on the meta device.
    from labkit.strategies.fsdp.flat import wrap_flat_by_hand as flat_shard

    cfg = loop.PRESETS["dp"]
    if dist.get_rank() == 0:
        model = loop.build_model(cfg)
    else:
        with torch.device("meta"):
            model = loop.build_model(cfg)
    fsdp = flat_shard(model, units="block", sync_from_rank0=True)
    with torch.no_grad():
        logits = fsdp(torch.zeros(1, cfg.seq_len, dtype=torch.long))[0]
    fsdp.reshard_all()
    return fsdp.full_state_dict(), logits


def test_flat_meta_device_ranks_get_rank0_init():
    expected = loop.build_model(loop.PRESETS["dp"]).state_dict()
    for rank, (state, logits) in enumerate(labkit.run(_meta_init_state, world_size=2, timeout=180)):
        assert compare(expected, state, rank=rank, **EXACT).ok
        assert torch.isfinite(logits).all()
