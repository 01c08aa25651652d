"""pp_lab's choice section: the references of exercises 6-8 against the cost model, their checks
(the solution passes, each recognised mistake fails with its own hint), the selection table's
verdicts from costmodel.search and check_table's refusals. Pure arithmetic, fast."""

import pytest

from labkit.labs import pp_choice as C
from labkit.labs import pp_choice_checks as K


# ---------------------------------------------------------------- solutions (the notebook's)
def my_bubble(p, v, m):
    return (p - 1) / (v * m + p - 1)


def my_dp_bytes(zero, reshard, piece, k, m, grad_bytes=4, gathers_reshard=None):
    ring = (k - 1) / k
    grads = grad_bytes * piece
    if zero == 0:
        return {"all_reduce": 2 * ring * grads, "reduce_scatter": 0.0, "all_gather": 0.0}
    gathers = (gathers_reshard or 2 * m) if zero == 3 and reshard else 1
    return {"all_reduce": 0.0, "reduce_scatter": ring * grads, "all_gather": gathers * ring * 2 * piece}


def my_activations(model, layout, seq_len, micro_batch, m, split=True, cap=True, factor=True, recompute=True):
    t, p, v = layout["tp"], layout["pp"], layout["v"]
    s, b, d = seq_len, micro_batch, model.d
    full = 34 * s * b * d / (t if split else 1)
    layers = model.layers // p
    in_flight = (min(p, m) if cap else m) * ((1 + (p - 1) / (p * v)) if v > 1 and factor else 1)
    if layout["recompute"] == "full" and recompute:
        return layers * 2 * s * b * d / t * in_flight + full
    return layers * full * in_flight


def test_solutions_pass():
    K.check_bubble(my_bubble)
    K.check_dp_bytes(my_dp_bytes)
    K.check_activations(my_activations)


def test_unwritten_exercise_is_not_implemented():
    def todo(*a):
        raise NotImplementedError

    for check in (K.check_bubble, K.check_dp_bytes, K.check_activations):
        with pytest.raises(NotImplementedError):
            check(todo)


@pytest.mark.parametrize(
    "mistake, hint",
    [
        (lambda p, v, m: (p - 1) / (m + p - 1), "interleaving"),
        (lambda p, v, m: (p - 1) / (v * m), "idle over idle"),
    ],
)
def test_bubble_mistakes_get_their_hint(mistake, hint):
    with pytest.raises(AssertionError, match=hint):
        K.check_bubble(mistake)


@pytest.mark.parametrize(
    "mistake, hint",
    [
        (lambda *a: my_dp_bytes(*a, gathers_reshard=a[4]), "forward AND again in backward"),
        (lambda *a: my_dp_bytes(*a, grad_bytes=2), "fp32"),
        (
            lambda z, r, *a: (
                my_dp_bytes(z, r if z != 1 else True, *a) if z != 1 else my_dp_bytes(3, True, *a)
            ),
            "one all-gather per step, after the optimizer",
        ),  # fmt: skip
        (lambda z, r, *a: my_dp_bytes(z, True, *a), "without reshard"),
    ],
)
def test_dp_bytes_mistakes_get_their_hint(mistake, hint):
    with pytest.raises(AssertionError, match=hint):
        K.check_dp_bytes(mistake)


@pytest.mark.parametrize(
    "option, hint",
    [
        ("split", "sequence parallelism"),
        ("cap", "min\\(p, m\\)"),
        ("factor", "interleaving"),
        ("recompute", "recomputation"),
    ],
)
def test_activation_mistakes_get_their_hint(option, hint):
    with pytest.raises(AssertionError, match=hint):
        K.check_activations(lambda *a: my_activations(*a, **{option: False}))


@pytest.mark.parametrize("mistake", sorted(K.ACT_MISTAKES))
def test_every_activation_hint_fires_for_its_own_mistake(mistake):
    # the learner's formula with one mistake (K._activations): the check names that one, never another
    with pytest.raises(AssertionError) as err:
        K.check_activations(lambda model, layout, s, b, m: K._activations(model, layout, s, b, m, mistake))
    assert "hint: " + K.ACT_MISTAKES[mistake] in str(err.value)


def test_the_first_case_a_mistake_shows_in_tells_it_from_every_other():
    # no degenerate case: where a mistake first shows, no other mistake still possible there (one
    # that gave the right number in every earlier case) gives the same number
    model = C.MODELS["70B"]
    for mistake in K.ACT_MISTAKES:
        for i, (layout, m) in enumerate(K.ACT_CASES):
            got = K._activations(model, layout, 4096, 1, m, mistake)
            if not K._close(got, C.activations(model, layout, 4096, 1, m)):
                break
        else:
            raise AssertionError(f"{mistake} never shows in ACT_CASES")
        live = K.live_mistakes(model, K.ACT_CASES[:i])
        assert mistake in live
        same = [
            o for o in live if o != mistake and K._close(K._activations(model, layout, 4096, 1, m, o), got)
        ]
        assert not same, (mistake, layout, m, same)


def test_a_ring_all_reduce_short_of_its_factor_2_is_not_blamed_on_fp32():
    def half_ring(zero, reshard, piece, k, m):
        out = my_dp_bytes(zero, reshard, piece, k, m)
        return {**out, "all_reduce": out["all_reduce"] / 2}

    with pytest.raises(AssertionError, match="2\\(k-1\\)/k") as err:
        K.check_dp_bytes(half_ring)
    assert "fp32" not in str(err.value)
    with pytest.raises(AssertionError, match="fp32"):  # bf16 gradients: the reduce-scatter shows it first
        K.check_dp_bytes(lambda *a: my_dp_bytes(*a, grad_bytes=2))
    with pytest.raises(AssertionError, match="a number of bytes"):
        K.check_dp_bytes(lambda *a: {k: str(v) for k, v in my_dp_bytes(*a).items()})


# ---------------------------------------------------------------- the references are the cost model's
def test_references_call_the_cost_model():
    assert C.bubble(4, 2, 8) == pytest.approx(3 / 19)
    assert C.memory_per_rank("DDP", C.Config(7.5e9, 64, 3072, 64, 2**20)) == pytest.approx(120e9)
    assert not hasattr(C, "rank_layouts") and not hasattr(C, "USUAL")  # one cost model, no written table


def test_ties_and_verdicts_follow_from_the_rows_and_check_table_refuses_another():
    choices = C.choices()
    C.check_table(choices)
    band = C.published.error_band()
    for c in choices.values():
        assert c["fastest"] is c["rows"][0] and c["band"] == band
        assert c["verdict"]["step_s"] <= c["fastest"]["step_s"] * (1 + band)
        assert all(C.tie_key(c["verdict"]) <= C.tie_key(r) for r in c["tied"].values())
    seven = "only the optimizer state is short (7B, one node)"
    c = choices[seven]
    slower = {seven: {**c, "verdict": c["best"]["ZeRO-1 x TP x PP"]}}  # tied, but two axes more
    with pytest.raises(AssertionError, match="not the tie's first"):
        C.check_table(slower)
    forged = {seven: {**c, "verdict": {**c["verdict"], "step_s": c["verdict"]["step_s"] / 2}}}
    with pytest.raises(AssertionError, match="layout_step"):
        C.check_table(forged)
    narrow = {seven: {**c, "band": 0.0}}  # no error: only the fastest ties
    with pytest.raises(AssertionError, match="the table ties"):
        C.check_table(narrow)


def test_no_error_leaves_no_tie_and_a_wide_error_ties_every_family():
    rows = C.search("medium model, post-training (13B, 8 nodes)")
    exact = C.choose(rows, 0.0)
    assert exact["verdict"] is rows[0] and exact["broken_by"] in ("no tie", *C.TIE_BREAK)
    assert all(r["step_s"] == rows[0]["step_s"] for r in exact["tied"].values())
    wide = C.choose(rows, 10.0)
    assert set(wide["tied"]) == set(wide["best"])
    assert C.parallel_axes(wide["verdict"]["layout"]) == 0


def test_the_error_band_is_the_largest_predicted_miss_and_refuses_no_prediction():
    rows = C.published.table()
    band = C.published.error_band(rows)
    assert band == max(abs(1 / r["ratio"] - 1) for r in rows if not r["calibrated"])
    assert 0.05 < band < 0.15  # every predicted row within 15% (test_costmodel_layout)
    with pytest.raises(ValueError, match="no predicted row"):
        C.published.error_band([r for r in rows if r["calibrated"]])


def test_the_summary_names_the_runs_verdicts_and_check_summary_refuses_another():
    choices = C.choices()
    C.check_summary(choices)
    rows = C.accumulation(C.ACCUMULATING, choices[C.ACCUMULATING]["fastest"])
    zero1, each, held = rows["ZeRO-1"], rows["ZeRO-2, reduce each"], rows["ZeRO-2, hold"]
    assert each["layout"]["zero"] == 2 and each["m"] == 2  # the fastest: ZeRO-2 x TP x PP, m = 2
    assert each["dp_bytes"]["reduce_scatter"] == pytest.approx(2 * zero1["dp_bytes"]["reduce_scatter"])
    assert held["step_s"] == zero1["step_s"] and held["memory_total"] == zero1["memory_total"]
    seven = "only the optimizer state is short (7B, one node)"
    c = choices[seven]
    other = {**choices, seven: {**c, "verdict": c["best"]["FSDP"]}}
    with pytest.raises(AssertionError, match="verdict ZeRO-1"):
        C.check_summary(other)


def test_check_pieces_runs_the_learners_functions_and_names_a_wrong_one():
    choices = C.choices()
    assert C.check_pieces(choices, C.bubble, C.dp_bytes, C.activations) >= 16
    with pytest.raises(AssertionError, match="your bubble"):
        C.check_pieces(choices, lambda p, v, m: (p - 1) / (m + p - 1), C.dp_bytes, C.activations)
    with pytest.raises(AssertionError, match="your dp_bytes"):
        C.check_pieces(
            choices, C.bubble, lambda *a: {k: 2 * x for k, x in C.dp_bytes(*a).items()}, C.activations
        )


def test_family_names_hsdp_and_a_layout_without_data_parallelism():
    assert C.family({"dp": 8, "zero": 3, "shard": 4}) == "HSDP"
    assert C.family({"dp": 8, "zero": 3, "shard": 8, "tp": 2}) == "FSDP x TP"
    assert C.family({"dp": 1, "zero": 0, "tp": 2, "pp": 4}) == "TP x PP"
    assert C.family({"dp": 1, "zero": 0}) == "DDP"


def test_exercise_7_reference_holds_the_gradients_under_a_pipeline():
    # one reduce-scatter per step for every layout, whatever m: torch.distributed.pipelining's FSDP
    for zero, reshard in ((1, True), (3, True), (3, False)):
        assert C.dp_bytes(zero, reshard, 1e9, 16, 8)["reduce_scatter"] == pytest.approx(4e9 * 15 / 16)


# ---------------------------------------------------------------- the 8-rank run's compute and bubble
TINY = C.Transformer("TinyGPT", layers=2, d=64, heads=4, ffn=256, vocab=61)  # pp_lab's CFG8


def test_rank_flops_are_what_the_counter_counted_on_8_ranks():
    # counted in pp_lab's 8-rank run (train_windows(count_flops=True), 8 rows of 8 tokens)
    assert C.rank_flops("DDP", TINY, 8, 8) == 5004288
    assert C.rank_flops("FSDP x TP", TINY, 8, 8) == 5566464  # the head whole on every tp rank
    assert C.rank_flops("ZeRO-1 x TP x PP", TINY, 8, 8, stage=0) == 4816896
    assert C.rank_flops("FSDP x TP x PP", TINY, 8, 8, stage=1) == 5566464  # the last stage: the head
    with pytest.raises(ValueError, match="stage 2 of 2"):
        C.rank_flops("FSDP x TP x PP", TINY, 8, 8, stage=2)


def _compute(label, flops_of_rank=None):
    dp, tp, pp = C.SMALL_DEGREES[label]
    stages = [(r // tp) % pp for r in range(8)]
    flops = [C.rank_flops(label, TINY, 8, 8, s) for s in stages]
    for rank, value in (flops_of_rank or {}).items():
        flops[rank] = value
    return {"flops": flops, "stage": stages, "cpu_s": [0.05] * 8}


def test_check_flops_passes_the_model_and_names_a_wrong_rank():
    measured = {k: _compute(k) for k in C.SMALL_DEGREES}
    ratio = C.check_flops(measured, TINY, 8, 8)
    assert ratio["DDP"] == 1 and ratio["FSDP"] == 1
    assert ratio["ZeRO-1 x TP x PP"] == pytest.approx(5566464 / 5004288)
    wrong = {
        "FSDP x TP x PP": _compute("FSDP x TP x PP", {3: 4816896.0})
    }  # rank 3 (stage 1) without the head
    with pytest.raises(
        AssertionError, match=r"FSDP x TP x PP, rank 3 \(pipeline stage 1\): counted 4\.8169e\+06"
    ):
        C.check_flops(wrong, TINY, 8, 8)


def test_check_overhead_refuses_cpu_times_that_flops_explain():
    measured = {"DDP": _compute("DDP")}
    assert C.check_overhead(measured, rate=1e10)["DDP"] == pytest.approx(5004288 / 1e10 / 0.05)
    with pytest.raises(AssertionError, match="DDP: its FLOPs explain 100%"):
        C.check_overhead(measured, rate=5004288 / 0.05)


def _results(orders_by_stage, label="ZeRO-1 x TP x PP"):
    """Fake train_windows results: 8 ranks as dp 2 x pp 2 x tp 2, each rank's recorded order."""
    out = []
    for rank in range(8):
        tp_, stage, d = rank % 2, (rank // 2) % 2, rank // 4
        ranks = [(d * 2 + s) * 2 + tp_ for s in range(2)]
        actions = [(a.kind, a.chunk, a.microbatch) for a in orders_by_stage[stage]]
        out.append({label: {"pipeline": {"actions": actions, "stage": stage, "ranks": ranks}}})
    return out


def test_recorded_1f1b_replays_to_the_models_bubble_and_a_wrong_order_raises():
    from labkit.strategies.pp import schedule as sched

    label = "ZeRO-1 x TP x PP"
    logs = C.pipeline_logs(_results(sched.orders("1f1b", 2, 4)), label)
    assert sorted(logs) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    predicted = {label: C.bubble(2, 1, 4)}
    for backward in (1.0, 2.0):
        C.check_bubbles({label: {r: C.replayed_bubble(lg, backward) for r, lg in logs.items()}}, predicted)
    # stage 0 waits for each micro-batch's backward before the next forward: no pipelining
    serial = [[a for i in range(4) for a in (sched.F(0, i), sched.B(0, i))], sched.order("1f1b", 1, 2, 4)]
    logs = C.pipeline_logs(_results(serial), label)
    replayed = {label: {r: C.replayed_bubble(lg) for r, lg in logs.items()}}
    with pytest.raises(AssertionError, match=r"ZeRO-1 x TP x PP: pipeline \(0, 2\)'s recorded order replays to a bubble of 0\.5000, the cost model's .* is 0\.2000"):  # fmt: skip
        C.check_bubbles(replayed, predicted)


def test_pipeline_logs_refuses_a_missing_stage():
    from labkit.strategies.pp import schedule as sched

    results = _results(sched.orders("1f1b", 2, 4))
    for r in results:
        r["ZeRO-1 x TP x PP"]["pipeline"]["stage"] = 0
        r["ZeRO-1 x TP x PP"]["pipeline"]["ranks"] = [results.index(r), 99]
    with pytest.raises(AssertionError, match=r"recorded stages \[0\] only"):
        C.pipeline_logs(results, "ZeRO-1 x TP x PP")


def test_transformer_of_reads_tinygpt():
    from labkit import loop

    cfg = loop.PRESETS["fsdp"].replace(gpt=dict(d_model=64, n_heads=4, n_layers=2), batch_size=8, seq_len=8)
    assert C.transformer_of(loop.build_model(cfg)) == TINY
