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


# ---------------------------------------------------------------- the references are the cost model's
def test_references_call_the_cost_model():
    assert C.bubble(4, 2, 8) == pytest.approx(3 / 19)
    assert C.memory_per_rank("DDP", C.Config(7.5e9, 64, 3072, 64, 2**20)) == pytest.approx(120e9)
    assert not hasattr(C, "rank_layouts") and not hasattr(C, "USUAL")  # one cost model, no written table


def test_verdicts_come_from_search_and_check_table_refuses_a_slower_one():
    situation = "only the optimizer state is short (7B, one node)"
    verdict = {situation: C.search(situation, top=1)[0]}
    best = {situation: C.family_best(situation)}
    C.check_table(verdict, best)
    slower = {situation: C.search(situation, C.FAMILIES["ZeRO-1 x TP x PP"], top=1)[0]}
    with pytest.raises(AssertionError, match="faster"):
        C.check_table(slower, best)
    forged = {situation: {**verdict[situation], "step_s": verdict[situation]["step_s"] / 2}}
    with pytest.raises(AssertionError, match="layout_step"):
        C.check_table(forged, best)
