"""labkit.checks: every hint comes from the typical wrong answer it is meant to explain."""

import pytest
import torch

from labkit.checks import Report, assert_match, check_close, compare, expect_match, run_check
from labkit.models import ToyModel
from labkit.units import fmt_bytes


def _grads():
    model = ToyModel()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_correct_answer_is_ok():
    expected = _grads()
    report = compare(expected, {k: v.clone() for k, v in expected.items()})
    assert report.ok and all(e.exact for e in report.entries)
    assert "ok" in str(report) and "shared.weight" in str(report)
    assert compare(ToyModel(), ToyModel()).ok
    assert compare([torch.ones(3)], (torch.ones(3) + 1e-9,)).ok


def test_sum_instead_of_avg_names_rank_tensor_and_index():
    expected = _grads()
    got = {k: v * 2 for k, v in expected.items()}
    got["frozen_in.weight"] = expected["frozen_in.weight"].clone()  # first tensor right
    report = compare(expected, got, rank=1, world_size=2)
    text = str(report)
    assert not report.ok
    assert "rank 1" in text and "'frozen_in.bias'" in text and "flat index 0" in text
    assert "2× too large" in text and "SUM vs AVG" in text
    with pytest.raises(AssertionError, match="SUM vs AVG"):
        report.raise_if_failed()


def test_divided_twice_sign_and_first_index():
    expected = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert "divided twice" in str(compare(expected, expected / 4, world_size=4))
    assert "sign" in str(compare(expected, -expected))
    wrong = expected.clone()
    wrong[1, 0] = 7.0
    text = str(compare(expected, wrong, names=["w"]))
    assert "flat index 2" in text and "(1, 0)" in text and "expected 3" in text and "got 7" in text


def test_not_updated_hints():
    expected = torch.tensor([0.5, -1.0, 2.0])
    assert "not updated" in str(compare(expected, torch.zeros(3)))


def test_shape_nan_order_and_missing_names():
    text = str(compare(torch.ones(3, 4), torch.ones(13)))
    assert "(3, 4)" in text and "(13,)" in text and "padding not removed" in text
    assert "missing all-gather" in str(compare(torch.ones(8), torch.ones(4), world_size=2))
    assert "NaN" in str(compare(torch.ones(3), torch.tensor([1.0, float("nan"), 1.0])))
    swapped = torch.cat([torch.arange(3.0, 6.0), torch.arange(3.0)])
    assert "wrong rank order" in str(compare(torch.arange(6.0), swapped))
    one = torch.ones(1)
    text = str(compare({"a": one, "b": one}, {"a": one, "c": one}))
    assert "FAILED" in text and "missing in got: b" in text and "not in expected: c" in text


def test_check_close_prints_and_raises(capsys):
    assert isinstance(check_close(torch.ones(2), torch.ones(2), label="grads"), Report)
    assert "grads: ok" in capsys.readouterr().out
    with pytest.raises(AssertionError):
        check_close(torch.ones(2), torch.zeros(2))


def test_run_check_not_implemented(capsys, monkeypatch):
    monkeypatch.delenv("LABKIT_EXERCISE", raising=False)  # a learner's notebook
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)

    def todo():
        raise NotImplementedError("TODO: all-reduce the gradients")

    assert run_check("ring all-reduce", todo) is None
    assert "ring all-reduce: not implemented yet" in capsys.readouterr().err
    from labkit import RankError

    todo = ("NotImplementedError", "TODO")
    on_ranks = RankError("ranks 0, 1 failed", {0: todo, 1: todo})
    assert run_check("on every rank", lambda: (_ for _ in ()).throw(on_ranks)) is None
    assert "on every rank: not implemented yet" in capsys.readouterr().err
    assert run_check("fine", lambda: 42) is None and "PASS fine" in capsys.readouterr().out
    run_check("wrong", lambda: compare(torch.ones(1), torch.zeros(1)))
    assert "FAIL wrong: AssertionError" in capsys.readouterr().err
    monkeypatch.setenv("LABKIT_EXERCISE", "strict")  # grading: failures raise
    with pytest.raises(ValueError):
        run_check("broken", lambda: int("x"))
    with pytest.raises(AssertionError):
        run_check("wrong", lambda: compare(torch.ones(1), torch.zeros(1)))


def test_expect_match_and_fmt_bytes(capsys):
    assert fmt_bytes(512) == "512 B" and fmt_bytes(1536) == "1.50 KiB"
    assert fmt_bytes(3 * 2**20) == "3.00 MiB" and fmt_bytes(5 * 2**30) == "5.00 GiB"
    assert expect_match("params", 2**20, 2**20 + 100)
    assert "params: expected 1.00 MiB / measured 1.00 MiB / match" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="MISMATCH"):  # it raises, as assert_match does
        expect_match("grads", 1000, 2000)
    assert "MISMATCH" in capsys.readouterr().out
    assert expect_match("steps", 3, 3, unit="steps")
    with pytest.raises(AssertionError, match="MISMATCH"):
        assert_match("optimizer", 100, 50)


def test_mismatch_states_expected_and_got_with_shapes():
    text = str(compare(torch.arange(4.0), torch.tensor([0.0, 1.0, 9.0, 3.0]), names=["g"]))
    assert "'g' of shape (4,)" in text
    assert "expected (4,): [0, 1, 2, 3]" in text and "got      (4,): [0, 1, 9, 3]" in text
    big = compare(torch.zeros(17), torch.ones(17))
    assert "expected (17,)" not in str(big)  # large tensors: first mismatch only
    whole = compare(torch.ones(3), torch.ones(6), world_size=2)
    assert whole.first_problem().splitlines()[0].endswith("expected (3,), got (6,)")
    assert "hint: got 2× the elements: the whole tensor" in whole.first_problem()
    assert compare(torch.ones(2), torch.ones(2)).first_problem() == ""
