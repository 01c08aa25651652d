import pytest

import labkit
from labkit import exercise


def _unfinished():
    raise NotImplementedError


def test_not_implemented_on_the_ranks_is_reported_not_raised(capsys):
    assert exercise.check("demo", lambda: labkit.run(_unfinished, world_size=2)) is None
    assert "demo: not implemented yet" in capsys.readouterr().out
    ref = object()
    assert exercise.pick("demo", _unfinished, ref) is ref
    assert "using labkit's reference for 'demo'" in capsys.readouterr().out


def test_a_passing_check_picks_the_learners_code(capsys):
    mine = lambda: 1  # noqa: E731
    assert exercise.check("ok", lambda: 5) == 5
    assert exercise.pick("ok", mine, None) is mine


def test_a_wrong_answer_still_raises():
    def wrong():
        raise AssertionError("rank 1, weight[3]: expected 2.0, got 4.0")
    with pytest.raises(AssertionError, match="expected 2.0"):
        exercise.check("bad", wrong)
    assert exercise.status["bad"] == "failed"
