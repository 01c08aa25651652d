"""Ulysses sequence parallelism (labkit.strategies.ulysses): ulysses_attention equal to one
process's scaled_dot_product_attention, forward and backward (dq, dk, dv), float64 within 1e-12,
on 2 and 4 ranks, causal and not, head_dim 5 (odd); its all-to-alls traced with the bytes of the
formula (4 per layer forward, 4 backward, each (n-1)/n of the rank's B (T/n) C tensor plus
labkit's headers: layer_bytes), in the attention alone and in a training step; the loop strategy
"ulysses" equal to loop.reference: float64 within 1e-12 on 2 ranks (ulysses 2) and 4 (ulysses 4,
and dp 2 x ulysses 2), float32 within test_loop's tolerances on 2, with activation checkpointing
on 2 (its recompute: 4 more all-to-alls per layer). One launch per world size (module-scoped);
the refusals in the 2-rank launch and in this process.
"""

import pytest
import torch
import torch.nn.functional as F

import labkit
from labkit import loop, strategies
from labkit.checks import compare
from labkit.comm.all_to_all import wire_bytes
from labkit.strategies import ulysses as U

B, H, D = 2, 4, 5  # odd head_dim; 4 heads split over 2 and 4 ranks
T = 24
WIDE = loop.PRESETS["dp"].replace(dtype=torch.float64)
FP32_CFG = loop.PRESETS["dp"]
STEPS = 3
CKPT = WIDE.replace(activation_checkpointing=True)
FP64 = dict(rtol=0, atol=1e-12)
FP32_GRADS = dict(rtol=1e-5, atol=1e-7)  # tests/test_loop.py's FP32 and FP32_GPT_STATE
FP32_STATE = dict(rtol=1e-5, atol=5e-5)
A2A = "all_to_all_single"


def _piece(x, rank, n):
    """This rank's contiguous positions of (B, H, T, D)."""
    t = x.shape[2] // n
    return x[:, :, rank * t : (rank + 1) * t]


def _one_case(causal):
    """This rank's errors against SDPA (forward, dq, dk, dv) and its traced windows."""
    import torch.distributed as dist

    from labkit.observe import tracing

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
    expected.backward(dout)
    mine = [_piece(t, rank, n).clone().requires_grad_() for t in (q, k, v)]
    start = tracing.clock()
    out = U.ulysses_attention(*mine, causal=causal)
    middle = tracing.clock()
    out.backward(_piece(dout, rank, n))
    end = tracing.clock()
    errors = [(out - _piece(expected, rank, n)).abs().max().item()]
    errors += [(m.grad - _piece(w.grad, rank, n)).abs().max().item() for m, w in zip(mine, whole)]
    return {"errors": errors, "windows": (start, middle, end)}


def _train_window(cfg, **options):
    from labkit.observe import tracing

    start = tracing.clock()
    run = loop.train("ulysses", cfg, STEPS, spans=False, **options)
    return run, (start, tracing.clock())


def _refusals():
    """What building or calling "ulysses" refuses inside a group of 2, by its words."""
    odd = WIDE.replace(seq_len=31)
    three = WIDE.replace(gpt=dict(WIDE.gpt, n_heads=3, d_model=30))
    built = strategies.build("ulysses", loop.build_model(WIDE), WIDE)
    idx = torch.zeros(2, WIDE.seq_len, dtype=torch.long)
    out = {}
    cases = {
        "seq_len": lambda: strategies.build("ulysses", loop.build_model(odd), odd),
        "heads": lambda: strategies.build("ulysses", loop.build_model(three), three),
        "avg": lambda: strategies.build("ulysses", loop.build_model(WIDE), WIDE, reduce_op="avg"),
        "unknown": lambda: strategies.build("ulysses", loop.build_model(WIDE), WIDE, layout="zigzag"),
        "degree": lambda: strategies.build("ulysses", loop.build_model(WIDE), WIDE, ulysses=3),
        "mean loss": lambda: built(idx, idx),
        "generate": lambda: built.model.generate(idx[:, :8], 2),
        "attention heads": lambda: U.ulysses_attention(*(torch.zeros(1, 3, 4, 2),) * 3, causal=True),
    }
    for label, call in cases.items():
        try:
            call()
            out[label] = None
        except (ValueError, TypeError, NotImplementedError) as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    out["sum loss"] = built(idx, idx, reduction="sum")[1] is not None
    return out


def _rank():
    import torch.distributed as dist

    n = dist.get_world_size()
    out = {"cases": {causal: _one_case(causal) for causal in (True, False)}}
    out["train"], out["train window"] = _train_window(WIDE)
    if n == 2:
        out["fp32"], _ = _train_window(FP32_CFG)
        out["checkpointed"], out["checkpointed window"] = _train_window(CKPT)
        out["refusals"] = _refusals()
    if n == 4:  # ("dp", "ulysses") = 2 x 2: the rows split over dp, each row's positions over ulysses
        out["dp x ulysses"], _ = _train_window(WIDE, ulysses=2)
    return out


@pytest.fixture(scope="module")
def two():
    return labkit.run(_rank, world_size=2, timeout=600)


@pytest.fixture(scope="module")
def four():
    return labkit.run(_rank, world_size=4, timeout=600)


@pytest.fixture(scope="module")
def reference():
    return loop.reference(WIDE, STEPS)


def _launch(world, request):
    return request.getfixturevalue({2: "two", 4: "four"}[world])


def _a2a(trace, lo, hi):
    return [
        e for e in trace["events"] if e["kind"] == "collective" and e["op"] == A2A and lo <= e["start"] <= hi
    ]


def _sent(event):
    return event.get("intra_bytes", 0) + event.get("inter_bytes", 0)


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_attention_equals_one_process(world, request):
    for rank, got in enumerate(_launch(world, request)):
        for causal, case in got["cases"].items():
            assert max(case["errors"]) <= 1e-12, (world, rank, causal, case["errors"])


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_bytes_are_the_formula(world, request):
    """Forward: 4 all-to-alls (q, k, v in; the output back), backward 4 (the output's gradient
    in; dq, dk, dv back); each traces the rank's whole B (T/n) C tensor and sends (n-1)/n of it
    to the other ranks, plus one header per peer (all_to_all.wire_bytes)."""
    results = _launch(world, request)
    local = B * (T // world) * H * D * 8  # one of q, k, v, out on this rank, float64
    for rank, trace in enumerate(results.traces):
        formula = U.layer_bytes(B, T, H * D, world, 8, rank)
        assert formula["payload"] == 4 * (world - 1) * local // world
        per_call = wire_bytes([1] * world, rank, local // world)
        for causal in (True, False):
            start, middle, end = results[rank]["cases"][causal]["windows"]
            for lo, hi in ((start, middle), (middle, end)):
                calls = _a2a(trace, lo, hi)
                assert [e["nbytes"] for e in calls] == [local] * 4, (world, rank, causal)
                assert [_sent(e) for e in calls] == [per_call] * 4, (world, rank, causal)
                assert sum(_sent(e) for e in calls) == formula["wire"]


@pytest.mark.parametrize("world", [2, 4])
def test_a_training_step_sends_8_all_to_alls_per_layer(world, request):
    """Every step: n_layers x (4 forward + 4 backward) all-to-alls of the formula's bytes."""
    cfg = WIDE.gpt_config()
    wire = U.layer_bytes(WIDE.batch_size, WIDE.seq_len, cfg.d_model, world, 8)["wire"]
    results = _launch(world, request)
    for rank, trace in enumerate(results.traces):
        calls = _a2a(trace, *results[rank]["train window"])
        assert len(calls) == STEPS * cfg.n_layers * 8, (world, rank, len(calls))
        assert sum(_sent(e) for e in calls) == STEPS * cfg.n_layers * 2 * wire


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_strategy_equals_one_process(world, request, reference):
    for rank, got in enumerate(_launch(world, request)):
        run, where = got["train"], f"ulysses={world} rank {rank}"
        compare(reference["grads"], run["grads"], label=where, **FP64).raise_if_failed()
        compare(reference["state"], run["state"], label=where, **FP64).raise_if_failed()
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-12, abs=0), where


def test_ulysses_with_data_parallelism_equals_one_process(four, reference):
    for rank, got in enumerate(four):
        run, where = got["dp x ulysses"], f"dp 2 x ulysses 2 rank {rank}"
        compare(reference["grads"], run["grads"], label=where, **FP64).raise_if_failed()
        compare(reference["state"], run["state"], label=where, **FP64).raise_if_failed()
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-12, abs=0), where


def test_activation_checkpointing_recomputes_the_all_to_alls(two):
    """Each block's recompute in backward runs its 4 forward all-to-alls again (12 per layer per
    step), the same calls on every rank: the run is one process's (with checkpointing) exactly."""
    expected = loop.reference(CKPT, STEPS)
    layers = CKPT.gpt_config().n_layers
    for rank, got in enumerate(two):
        run, where = got["checkpointed"], f"ulysses checkpointed rank {rank}"
        compare(expected["grads"], run["grads"], label=where, **FP64).raise_if_failed()
        compare(expected["state"], run["state"], label=where, **FP64).raise_if_failed()
        calls = _a2a(two.traces[rank], *got["checkpointed window"])
        assert len(calls) == STEPS * layers * 12, (rank, len(calls))


def test_ulysses_float32_equals_one_process(two):
    expected = loop.reference(FP32_CFG, STEPS)
    for rank, got in enumerate(two):
        run, where = got["fp32"], f"ulysses fp32 rank {rank}"
        compare(expected["grads"], run["grads"], label=where, **FP32_GRADS).raise_if_failed()
        compare(expected["state"], run["state"], label=where, **FP32_STATE).raise_if_failed()
        assert run["losses"] == pytest.approx(expected["losses"], rel=1e-5), where


REFUSALS = {
    "seq_len": "ulysses: seq_len=31 does not split over ulysses=2 ranks",
    "heads": "ulysses: n_heads=3 does not split over ulysses=2 ranks",
    "avg": "ulysses: reduce_op must be 'sum'",
    "unknown": "unexpected keyword argument 'layout'",
    "degree": "ulysses: ulysses must be an int >= 1 dividing the world size 2",
    "mean loss": "ulysses: the strategy's forward sees only this rank's piece",
    "generate": "generate() on a Ulysses model",
    "attention heads": "3 heads do not split over 2 ranks",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_what_does_not_split(two, case):
    for got in two:
        message = got["refusals"][case]
        assert message is not None, f"{case}: nothing raised"
        assert REFUSALS[case] in message, message
        assert got["refusals"]["sum loss"]


def test_one_process_is_attention_and_misuse_raises():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 3, generator=g, dtype=torch.float64) for _ in range(3))
    for causal in (True, False):
        got = U.ulysses_attention(q, k, v, causal=causal)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert (got - want).abs().max() <= 1e-14
    assert torch.equal(U.heads_to_seq(U.seq_to_heads(q)), q)
    bad = {
        "same shape": lambda: U.ulysses_attention(q, k[:, :, :4], v, causal=True),
        "causal must be True or False": lambda: U.ulysses_attention(q, k, v, causal="yes"),
        r"\(batch, heads, positions, head_dim\), got shape": lambda: U.seq_to_heads(q[0]),
    }
    for message, call in bad.items():
        with pytest.raises((ValueError, TypeError), match=message):
            call()
    with pytest.raises(TypeError, match="positional arguments"):
        U.ulysses_attention(q, k, v, True)  # causal is keyword-only
    with pytest.raises(TypeError, match="runs TinyGPT"):
        U.parallelize_ulysses(torch.nn.Linear(2, 2))
    assert "ulysses" in strategies.NAMES and "ulysses" in strategies.HAND_WRITTEN
    assert strategies.NAMES.index("ulysses") == strategies.NAMES.index("cp") + 1
