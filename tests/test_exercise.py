"""labkit.exercise: a learner's notebook always carries on; grading fails unanswered or wrong work."""

import sys

import pytest

import labkit
from labkit import exercise


@pytest.fixture
def learner(monkeypatch):
    monkeypatch.delenv("LABKIT_EXERCISE", raising=False)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)


@pytest.fixture
def nbgrader(monkeypatch):
    monkeypatch.delenv("LABKIT_EXERCISE", raising=False)
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")  # what nbgrader's autograde sets


def _unfinished():
    raise NotImplementedError


def _wrong():
    raise AssertionError("rank 1, weight[3]: expected 2.0, got 4.0")


def test_not_implemented_on_the_ranks_is_reported_not_raised(learner, capsys):
    assert exercise.check("demo", lambda: labkit.run(_unfinished, world_size=2)) is None
    assert "TODO demo: not implemented yet" in capsys.readouterr().err
    ref = object()
    assert exercise.pick("demo", _unfinished, ref) is ref
    assert "using labkit's reference for 'demo' (yours: not implemented)" in capsys.readouterr().out


def test_a_passing_check_picks_the_learners_code_and_keeps_its_value(learner, capsys):
    mine = lambda: 1  # noqa: E731
    exercise.check("ok", lambda: 5)
    assert "PASS ok" in capsys.readouterr().out
    assert exercise.result("ok") == 5 and exercise.pick("ok", mine, None) is mine


def test_a_wrong_answer_is_shown_and_falls_back(learner, capsys):
    exercise.check("bad", _wrong)
    out = capsys.readouterr().err
    assert "FAIL bad: AssertionError: rank 1, weight[3]: expected 2.0, got 4.0" in out
    assert exercise.status["bad"] == "failed" and exercise.result("bad") is None
    ref = object()
    assert exercise.pick("bad", _wrong, ref) is ref
    assert "(yours: failed)" in capsys.readouterr().out


def test_a_crash_in_the_learners_code_shows_where(learner, capsys):
    def learners_step():
        return [1, 2][5]

    exercise.check("crash", lambda: learners_step())
    out = capsys.readouterr().err
    assert "FAIL crash: IndexError" in out and "in learners_step" in out and "_run" not in out


def test_a_check_that_passed_before_and_fails_now_forgets_its_value(learner):
    exercise.check("again", lambda: 1)
    exercise.check("again", _wrong)
    assert exercise.result("again") is None and exercise.status["again"] == "failed"


@pytest.mark.parametrize("thunk, error", [(_unfinished, NotImplementedError), (_wrong, AssertionError)])
def test_grading_raises_on_unanswered_or_wrong(nbgrader, thunk, error):
    with pytest.raises(error):
        exercise.check("graded", thunk)
    assert exercise.pick("graded", thunk, "reference") == "reference"


def test_grading_moves_stderr_to_stdout(nbgrader, capsys):
    def noisy():
        print("a warning from the ranks", file=sys.stderr)

    exercise.check("noisy", noisy)
    captured = capsys.readouterr()
    assert captured.err == "" and "a warning from the ranks" in captured.out


def test_strict_mode_is_grading(monkeypatch):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    monkeypatch.setenv("LABKIT_EXERCISE", "strict")
    assert exercise.grading()
    monkeypatch.delenv("LABKIT_EXERCISE")
    assert not exercise.grading()


def test_a_check_that_builds_on_a_failing_exercise_says_so_first(learner, capsys):
    exercise.check("earlier", _wrong)
    capsys.readouterr()
    exercise.check(
        "later",
        lambda: _raise(AssertionError("hint: the optimizer must be built AFTER sharding")),
        needs=["earlier", "never checked"],
    )
    out = capsys.readouterr().err
    assert out.startswith(
        "FAIL later: BuildsOnAFailure: this exercise builds on your 'earlier', "
        "whose check fails above: fix that first"
    ), out
    assert "optimizer must be built AFTER" in out  # what it saw, after
    exercise.check("earlier", lambda: 1)  # fixed: the later check speaks for itself
    exercise.check("later", lambda: _raise(AssertionError("its own problem")), needs=["earlier"])
    assert "FAIL later: AssertionError: its own problem" in capsys.readouterr().err


def _raise(exc):
    raise exc


def test_a_learner_sees_todo_and_fail_on_stderr_which_nbgrader_scores_zero(learner, capsys):
    """A learner copy run in JupyterLab and graded as it stands (make test grades the copies its
    browser test ran) must score what nbgrader's own run scores: nbgrader gives 0 to a graded cell
    with stderr in it, so TODO and FAIL go there; PASS stays on stdout (full points)."""
    import nbformat
    from nbgrader.utils import determine_grade

    def graded_cell(outputs):
        cell = nbformat.v4.new_code_cell("check()")
        cell.metadata["nbgrader"] = {"grade": True, "solution": False, "points": 1, "grade_id": "c"}
        cell.outputs = [nbformat.v4.new_output("stream", name=n, text=t) for n, t in outputs]
        return cell

    for name, thunk in (("todo", _unfinished_here), ("bad", _wrong), ("good", lambda: 1)):
        exercise.check(name, thunk)
        got = capsys.readouterr()
        score, _ = determine_grade(
            graded_cell([(n, t) for n, t in (("stdout", got.out), ("stderr", got.err)) if t])
        )
        assert score == (1 if name == "good" else 0), (name, got)
        assert ("PASS" in got.out) == (name == "good") and ("PASS" not in got.err)


def _unfinished_here():
    raise NotImplementedError
