"""Zero-bubble pipeline schedules (Qi et al., ICLR 2024): "zb-h1" and "zbv", the backward split
into B (input gradients) and W (weight gradients).

Without ranks: every order is a valid, deadlock-free schedule for several (p, m) and equals
torch.distributed.pipelining's order action by action (ScheduleInterleavedZeroBubble over one
stage per rank for zb-h1, ScheduleZBVZeroBubble for zbv); at p = 4, m = 8, F = B = W = 1 (1F1B's B
priced as 2 slots) zb-h1's replayed bubble is at most half of 1F1B's and zbv's at most a quarter;
zb-h1's peak of live activations is 1F1B's; the V placement; misuse; one process equals plain
backward. On 2 and 4 gloo ranks (one launch each): pipeline_by_hand on the unseen float64
nn.Sequential of test_pp equals one process and torch's zero-bubble classes within 1e-12, its
recorded order is schedule.order's, the saved bytes are held to W; loop.train("pp", ...) with
zb-h1 / zbv, "torch-pp" with them, "pp-zero1" and "zero1-tp-pp" with zb-h1 equal loop.reference;
fsdp-tp-pp and torch's composition refuse them by name."""

import types

import pytest
import torch

import labkit
from labkit import loop, strategies
from labkit.checks import compare
from labkit.strategies import pp
from labkit.strategies.pp import B, F, W

from test_pp import FP64, M, _grads, _merged, _ours, _torch, batch, loss_fn, unseen

CASES = [(p, m) for p in (2, 3, 4) for m in (p, p + 1, 2 * p, 3 * p)]
ZB = [("zb-h1", 1), ("zbv", 2)]
CFG = loop.PRESETS["dp"].replace(batch_size=8)  # TinyGPT: 4 children (embedding, 2 blocks, head)
WIDE = CFG.replace(dtype=torch.float64)
FP32 = dict(rtol=1e-5, atol=1e-7)
FP32_STATE = dict(rtol=1e-5, atol=5e-5)
STEPS = 2
# what the loop's pipeline ran (its last step's order): the split backward, not 1F1B's
RECORDED = loop.Hooks(report=lambda s: {"actions": s.pipeline.record.actions})
LOOP_RUNS = {
    2: {
        "pp zb-h1": dict(strategy="pp", schedule="zb-h1", n_microbatches=4, hooks=RECORDED),
        "pp zbv": dict(strategy="pp", schedule="zbv", virtual_stages=2, n_microbatches=4, hooks=RECORDED),
        "torch-pp zb-h1": dict(strategy="torch-pp", schedule="zb-h1", n_microbatches=4),
        "torch-pp zbv": dict(strategy="torch-pp", schedule="zbv", virtual_stages=2, n_microbatches=4),
    },
    4: {
        "pp zb-h1": dict(strategy="pp", schedule="zb-h1", n_microbatches=4),
        "pp-zero1 zb-h1": dict(strategy="pp-zero1", schedule="zb-h1", n_microbatches=4),
        "zero1-tp-pp zb-h1": dict(strategy="zero1-tp-pp", dp=1, schedule="zb-h1", n_microbatches=4),
    },
}


def torch_order(name, rank, p, m):
    """torch's own order for rank `rank` (its schedule class's order builder, run on a stand-in
    object: no process group needed), as our Actions, the empty slots dropped."""
    from torch.distributed.pipelining import schedules as S

    kind = {
        S._ComputationType.FORWARD: "F",
        S._ComputationType.BACKWARD_INPUT: "B",
        S._ComputationType.BACKWARD_WEIGHT: "W",
    }
    if name == "zbv":
        me = types.SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
        ops = S.ScheduleZBVZeroBubble._calculate_single_rank_operations(me, rank)
    else:
        rounds = max(1, m // p)
        me = types.SimpleNamespace(
            n_local_stages=1, microbatches_per_round=m // rounds, pp_group_size=p, _n_microbatches=m
        )
        ops = S.ScheduleInterleavedZeroBubble._calculate_single_rank_operations(me, rank)
    return [
        pp.Action(kind[a.computation_type], a.stage_index, a.microbatch_index) for a in ops if a is not None
    ]


# ---------------------------------------------------------------- the orders, without ranks


@pytest.mark.parametrize("schedule, v", ZB)
@pytest.mark.parametrize("p, m", CASES)
def test_orders_are_valid_and_torchs(schedule, v, p, m):
    o = pp.orders(schedule, p, m, v)
    pp.timeline(o)  # every F, B, W once per chunk and micro-batch, no deadlock
    for r, rank_order in enumerate(o):
        assert {a.chunk for a in rank_order} == set(pp.chunks_of(r, p, v, schedule))
        done = set()
        for a in rank_order:  # a W after its B, a B after its F, on this rank
            before = {"F": None, "B": F(a.chunk, a.microbatch), "W": B(a.chunk, a.microbatch)}[a.kind]
            assert before is None or before in done, (r, a)
            done.add(a)
        assert rank_order == torch_order(schedule, r, p, m), (schedule, p, m, r)


def test_bubble_against_1f1b_on_the_same_footing():
    p, m = 4, 8
    classic = pp.bubble_fraction(pp.orders("1f1b", p, m), backward_slots=2)  # B = input + weights
    assert pp.bubble_fraction(pp.orders("1f1b", p, m)) == pytest.approx(3 / 11, abs=1e-12)  # the default
    assert classic == pytest.approx(3 / 11, abs=1e-12)
    zb_h1 = pp.bubble_fraction(pp.orders("zb-h1", p, m))
    zbv = pp.bubble_fraction(pp.orders("zbv", p, m, 2))
    assert zb_h1 <= classic / 2
    assert zbv <= classic / 4
    assert zb_h1 == pytest.approx(1 / 9, abs=1e-12)  # each rank idles p-1 = 3 of 3m + p-1 = 27 slots
    for q, n in CASES:  # never worse than 1F1B on the same footing
        assert pp.bubble_fraction(pp.orders("zb-h1", q, n)) < pp.bubble_fraction(pp.orders("1f1b", q, n), 2)


@pytest.mark.parametrize("p, m", CASES)
def test_zb_h1_peak_is_1f1bs(p, m):
    """An activation lives from its F to its W: rank r defers r W's, so holds min(p, m), 1F1B's
    rank 0 (the peak memory must fit), where 1F1B's rank r holds p - r."""
    zb = [pp.live_peak(o) for o in pp.orders("zb-h1", p, m)]
    one = [pp.live_peak(o) for o in pp.orders("1f1b", p, m)]
    assert max(zb) == max(one) == p and zb[0] == one[0]
    assert zb == [min(p, m)] * p


def test_live_peak_counts_to_w():
    assert pp.live_peak([F(0, 0), B(0, 0), F(0, 1), B(0, 1)]) == 1
    assert pp.live_peak([F(0, 0), B(0, 0), F(0, 1), B(0, 1), W(0, 0), W(0, 1)]) == 2


def test_known_orders_and_the_v():
    assert pp.order("zb-h1", 0, 2, 4) == [
        F(0, 0), F(0, 1), B(0, 0), W(0, 0), F(0, 2), B(0, 1), W(0, 1), F(0, 3), B(0, 2), W(0, 2), B(0, 3), W(0, 3),
    ]  # fmt: skip
    # rank 1 (the last of 2) runs its W one backward late: W(1, 0) after B(1, 1), W(1, 3) at the end
    assert pp.order("zb-h1", 1, 2, 4) == [
        F(1, 0), B(1, 0), F(1, 1), B(1, 1), W(1, 0), F(1, 2), B(1, 2), W(1, 1), F(1, 3), B(1, 3), W(1, 2), W(1, 3),
    ]  # fmt: skip
    assert [pp.chunks_of(r, 4, 2, "zbv") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [pp.rank_of(c, 4, "zbv") for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [pp.rank_of(c, 4) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]  # interleaved's
    with pytest.raises(ValueError, match="chunks 0..7, not 8"):
        pp.rank_of(8, 4, "zbv")


def test_replay_of_w():
    good = pp.orders("zb-h1", 2, 2)
    with pytest.raises(ValueError, match="deadlock"):  # a W before its B
        pp.timeline([good[0], [F(1, 0), W(1, 0), B(1, 0), F(1, 1), B(1, 1), W(1, 1)]])
    with pytest.raises(ValueError, match="forward, backward and weight gradients once"):
        pp.timeline([good[0], good[1][:-1]])  # a W missing
    slots = pp.timeline(good, backward_slots=1, weight_slots=2)
    assert [s.end - s.start for s in slots[0] if s.action.kind == "W"] == [2, 2]


@pytest.mark.parametrize(
    "args, match",
    [
        (("zbv", 0, 2, 4, 1), "schedule='zbv' runs exactly two chunks per rank"),
        (("zbv", 0, 2, 4, 3), "virtual_stages=2, got virtual_stages=3"),
        (("zb-h1", 0, 2, 4, 2), "virtual_stages=2 needs schedule='interleaved' (or 'zbv', with 2)"),
        (("zb-h1", 0, 4, 3), "n_microbatches=3 < 4 pipeline stages"),
    ],
)
def test_zero_bubble_misuse(args, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        pp.order(*args)


@pytest.mark.parametrize("schedule, v", ZB)
def test_one_rank_pipeline_equals_plain_backward(schedule, v):
    """Outside a process group one rank holds every chunk: the same gradients as plain backward;
    nothing held after the step."""
    model, twin, (x, y) = unseen(), unseen(), batch()
    pipe = pp.pipeline_by_hand(model, schedule=schedule, n_microbatches=M, virtual_stages=v)
    loss = pipe.step(x, y, loss_fn)
    expected = sum(loss_fn(twin(a), b) for a, b in zip(x.chunk(M), y.chunk(M)))
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    compare(_grads(twin), _grads(model), label=schedule, **FP64).raise_if_failed()
    assert pipe.record.live == 0 and pipe.record.live_bytes == 0
    assert pipe.record.peak_live == pp.live_peak(pipe.order)


def test_a_schedule_function_with_w():
    """A schedule function's orders with W actions run split (B: input gradients, W: weights)."""

    def deferred(rank, p, m, v):  # GPipe with every W at the end
        return (
            [F(rank, i) for i in range(m)] + [B(rank, i) for i in range(m)] + [W(rank, i) for i in range(m)]
        )

    model, twin, (x, y) = unseen(), unseen(), batch()
    pipe = pp.pipeline_by_hand(model, schedule=deferred, n_microbatches=M)
    assert pipe.split_backward
    pipe.step(x, y, loss_fn)
    sum(loss_fn(twin(a), b) for a, b in zip(x.chunk(M), y.chunk(M))).backward()
    compare(_grads(twin), _grads(model), label="deferred W", **FP64).raise_if_failed()


# ---------------------------------------------------------------- on ranks


def _error(fn):
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _rank(world_size):
    cases = ZB + [("1f1b", 1)]
    out = {
        "ours": {s: _ours(*s) for s in cases},
        "torch": {s: _torch(*s) for s in ZB},
        "loop": dict(
            zip(
                LOOP_RUNS[world_size],
                loop.sweep(list(LOOP_RUNS[world_size].values()), cfg=WIDE, steps=STEPS, spans=False),
            )
        ),
    }
    if world_size == 4:
        fp32 = [dict(strategy="pp", schedule="zb-h1")]
        out["loop fp32"] = loop.sweep(fp32, cfg=CFG, steps=STEPS, spans=False)[0]
        build = lambda name, **kw: lambda: strategies.build(name, loop.build_model(CFG), CFG, dp=1, **kw)  # noqa: E731
        out["refusals"] = {
            "fsdp-tp-pp": _error(build("fsdp-tp-pp", schedule="zbv", virtual_stages=2)),
            "fsdp-tp-pp zb-h1": _error(build("fsdp-tp-pp", schedule="zb-h1")),
        }
        from labkit.strategies.three_d.torch_ref import TorchFSDPTPPP

        model = loop.build_model(CFG)
        out["refusals"]["torch-fsdp-tp-pp"] = _error(
            lambda: TorchFSDPTPPP(model, CFG, dp=1, schedule="zb-h1")
        )
    return out


@pytest.fixture(scope="module")
def runs():
    return {n: labkit.run(_rank, n, world_size=n, timeout=900) for n in (2, 4)}


@pytest.fixture(scope="module")
def one_process():
    model, (x, y) = unseen(), batch()
    total = sum(loss_fn(model(a), b) for a, b in zip(x.chunk(M), y.chunk(M)))
    total.backward()
    return _grads(model), total.item()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("schedule", ZB)
def test_unseen_sequential_equals_one_process_and_torch(runs, one_process, world_size, schedule):
    ranks = runs[world_size]
    expected, loss = one_process
    ours, theirs = _merged(ranks, "ours", schedule), _merged(ranks, "torch", schedule)
    assert ours.keys() == expected.keys() == theirs.keys()
    compare(expected, ours, label=f"ours {schedule} vs one process", **FP64).raise_if_failed()
    compare(theirs, ours, label=f"ours {schedule} vs torch's", **FP64).raise_if_failed()
    losses = [r["ours"][schedule]["loss"] for r in ranks]
    last = pp.rank_of(world_size * schedule[1] - 1, world_size, schedule[0])  # zbv: rank 0
    assert [i for i, x in enumerate(losses) if x is not None] == [last]
    assert losses[last] == pytest.approx(loss, abs=1e-12)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("schedule", ZB)
def test_recorded_orders_and_what_w_holds(runs, world_size, schedule):
    name, v = schedule
    ranks = [r["ours"][schedule] for r in runs[world_size]]
    assert [r["actions"] for r in ranks] == pp.orders(name, world_size, M, v)
    assert [r["peak_live"] for r in ranks] == [pp.live_peak(r["actions"]) for r in ranks]
    if name == "zb-h1":
        # the same micro-batches held as 1F1B on rank 0, more on the others (kept to their W):
        # the saved bytes follow
        classic = [r["ours"][("1f1b", 1)]["peak_live_bytes"] for r in runs[world_size]]
        got = [r["peak_live_bytes"] for r in ranks]
        assert got[0] == classic[0]
        assert all(g > c for g, c in zip(got[1:], classic[1:])), (got, classic)


@pytest.fixture(scope="module")
def references():
    return {torch.float32: loop.reference(CFG, STEPS), torch.float64: loop.reference(WIDE, STEPS)}


@pytest.mark.parametrize(
    "world_size, label", [(n, label) for n in LOOP_RUNS for label in LOOP_RUNS[n]] + [(4, "fp32")]
)
def test_loop_train_equals_reference(runs, references, world_size, label):
    wide = label != "fp32"
    expected = references[torch.float64 if wide else torch.float32]
    state_tol, grad_tol = (FP64, FP64) if wide else (FP32_STATE, FP32)
    results = [r["loop"][label] if wide else r["loop fp32"] for r in runs[world_size]]
    for rank, got in enumerate(results):
        where = f"{label} rank {rank}"
        assert got["grads"].keys() == expected["grads"].keys(), where
        compare(expected["grads"], got["grads"], label=where + " grads", **grad_tol).raise_if_failed()
        compare(expected["state"], got["state"], label=where + " state", **state_tol).raise_if_failed()
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-12 if wide else 1e-5), where
    if "hooks" in LOOP_RUNS[world_size].get(label, {}):
        run = LOOP_RUNS[world_size][label]
        expected_orders = pp.orders(run["schedule"], world_size, 4, run.get("virtual_stages", 1))
        assert [got["actions"] for got in results] == expected_orders, label


@pytest.mark.parametrize("case", ["fsdp-tp-pp", "fsdp-tp-pp zb-h1", "torch-fsdp-tp-pp"])
def test_3d_fsdp_refuses_naming_the_schedule(runs, case):
    schedule = "'zbv'" if case == "fsdp-tp-pp" else "'zb-h1'"
    for rank in runs[4]:
        got = rank["refusals"][case]
        assert got is not None and got[0] == "NotImplementedError", got
        assert f"schedule={schedule} is left out" in got[1], got


# ---------------------------------------------------------------- pp_lab's exercise 9 (no ranks)


def _lab_1f1b(p, m, r, warmup=None):
    w = min(p - r - 1, m) if warmup is None else warmup
    out = [("F", i) for i in range(w)]
    for k in range(m):
        out += ([("F", w + k)] if w + k < m else []) + [("B", k)]
    return out


def _split(order, w_first=False):
    out = []
    for kind, mb in order:
        out += (
            ([("W", mb), ("B", mb)] if w_first else [("B", mb), ("W", mb)]) if kind == "B" else [(kind, mb)]
        )
    return out


def _warmup_off(p, m, r):
    order = [(k, mb) for k, mb in _lab_1f1b(p, m, r, min(p - r, m))]
    shifted, weights = [], 0
    for kind, mb in order:
        shifted.append((kind, mb))
        if kind == "B" and mb >= r:
            shifted.append(("W", weights))
            weights += 1
    return shifted + [("W", i) for i in range(weights, m)]


ZB_H1_MISTAKES = {
    "no W": (lambda p, m, r: _lab_1f1b(p, m, r), 'split every backward: a "B"'),
    "W before its B": (lambda p, m, r: _split(_lab_1f1b(p, m, r), w_first=True), "W(0) before its B(0)"),
    "W not deferred": (lambda p, m, r: _split(_lab_1f1b(p, m, r)), "W not deferred"),
    "every W at the end": (
        lambda p, m, r: _lab_1f1b(p, m, r) + [("W", i) for i in range(m)],
        "every W at the end",
    ),
    "warm-up off by one": (_warmup_off, "the warm-up is 1F1B's: p - rank - 1 = 3 forwards on rank 0"),
    "returns None": (lambda p, m, r: None, "a function without `return` gives None"),
}


def test_zb_h1_exercise_check_passes_the_reference():
    from labkit.labs import pp_checks, pp_lab

    pp_checks.check_zb_h1(pp_lab.zb_h1_order)
    assert pp_lab.zb_h1_order(4, 8, 2) == [(a.kind, a.microbatch) for a in pp.order("zb-h1", 2, 4, 8)]


@pytest.mark.parametrize("case", list(ZB_H1_MISTAKES))
def test_zb_h1_exercise_check_names_the_mistake(case):
    from labkit.labs import pp_checks

    wrong, hint = ZB_H1_MISTAKES[case]
    with pytest.raises(AssertionError) as info:
        pp_checks.check_zb_h1(wrong)
    assert "hint: " in str(info.value) and hint in str(info.value), str(info.value)


def test_lab_replay_prices_a_whole_backward_as_two_slots():
    from labkit.labs import pp_lab

    p, m = 4, 8
    logs = lambda name: [[(a.kind, a.microbatch, a.chunk) for a in o] for o in pp.orders(name, p, m)]  # noqa: E731
    classic = pp_lab.replay(logs("1f1b"), p, backward_slots=2)
    split = pp_lab.replay(logs("zb-h1"), p)
    assert [float(b) for b in classic["bubble"]] == pytest.approx([3 / 11] * p, abs=1e-12)
    assert [float(b) for b in split["bubble"]] == pytest.approx([1 / 9] * p, abs=1e-12)
    import matplotlib

    matplotlib.use("Agg")
    fig = pp_lab.plot_schedules({"1F1B": classic, "ZB-H1": split}, p)
    assert len(fig.axes[1].patches) == p * (1 + 3 * m)  # per rank: the idle bar, then F, B, W per micro-batch


# ---------------------------------------------------------------- exercise 9: the backward in two halves
from labkit.labs import pp_checks  # noqa: E402  (the labs import the launcher: only here)


def _b(out, grad, inp):
    (g,) = torch.autograd.grad(out, inp, grad, retain_graph=True)
    return g


def _b_backward(out, grad, inp):  # the runtime's way: backward restricted to the input
    torch.autograd.backward(out, grad, inputs=[inp], retain_graph=True)
    return inp.grad


def _w(out, grad, params):
    torch.autograd.backward(out, grad, inputs=list(params))


def _w_overwrite(out, grad, params):
    for p, g in zip(params, torch.autograd.grad(out, list(params), grad)):
        p.grad = g


@pytest.mark.parametrize("b", [_b, _b_backward])
def test_backward_split_check_passes_both_ways_of_b(b):
    pp_checks.check_backward_split(b, _w)


@pytest.mark.parametrize(
    "b, w, named",
    [
        (lambda o, g, i: torch.autograd.grad(o, i, g)[0], _w, "retain_graph=True"),
        (lambda o, g, i: (o.backward(g, retain_graph=True), i.grad)[1], _w, "input's gradient only"),
        (_b, lambda o, g, ps: o.backward(g), "weights' gradients only"),
        (
            _b,
            lambda o, g, ps: torch.autograd.grad(o, list(ps), g),
            "torch.autograd.grad would only return them",
        ),
        (_b, _w_overwrite, "does not overwrite"),
        (lambda o, g, i: None, _w, "return the input's gradient"),
        (
            lambda o, g, i: torch.autograd.grad(o, i, -g, retain_graph=True)[0],
            _w,
            "d\\(out . grad\\)/d\\(inp\\)",
        ),
        (
            _b,
            lambda o, g, ps: torch.autograd.backward(o, 2 * g, inputs=list(ps)),
            "d\\(out . grad\\)/d\\(weights\\)",
        ),
    ],
)
def test_backward_split_mistakes_are_named(b, w, named):
    with pytest.raises(AssertionError, match=named):
        pp_checks.check_backward_split(b, w)


def test_backward_split_unwritten_is_not_implemented():
    def todo(*a):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        pp_checks.check_backward_split(todo, _w)
    with pytest.raises(NotImplementedError):
        pp_checks.check_backward_split(_b, todo)
