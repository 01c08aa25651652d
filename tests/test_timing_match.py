"""checks.timing_match: a wall-time check that calls a mismatch on a machine quiet enough to
trust it and says "too noisy to call" (never raising) on one that is not; the load is mocked."""

import pytest

from labkit import checks


def _load(monkeypatch, loadavg, cores=2):
    monkeypatch.setattr(checks.os, "getloadavg", lambda: (loadavg, loadavg, loadavg))
    monkeypatch.setattr(checks.os, "cpu_count", lambda: cores)


def test_machine_load_is_load_average_per_core(monkeypatch):
    _load(monkeypatch, 3.0, cores=2)
    assert checks.machine_load() == 1.5


def test_quiet_machine_raises_on_mismatch(monkeypatch, capsys):
    _load(monkeypatch, 4.0)  # 4 ranks on 2 cores: cores + ranks = 6, not above it
    with pytest.raises(AssertionError, match=r"MISMATCH \(\+60\.0%\)"):
        checks.timing_match("step", 1.0, 1.6, rel_tol=0.4, ranks=4)
    assert "too noisy" not in capsys.readouterr().out


def test_quiet_machine_match_prints_match(monkeypatch, capsys):
    _load(monkeypatch, 1.0)
    assert checks.timing_match("step", 1.0, 1.2, rel_tol=0.4, ranks=4) is True
    assert capsys.readouterr().out.strip() == "step: expected 1 s / measured 1.2 s / match"


def test_loaded_machine_says_too_noisy_and_does_not_raise(monkeypatch, capsys):
    _load(monkeypatch, 9.5)  # above cores + ranks = 6
    assert checks.timing_match("step", 1.0, 0.4, rel_tol=0.4, ranks=4) is False
    out = capsys.readouterr().out.strip()
    assert (
        out == "step: expected 1 s / measured 0.4 s / too noisy to call on this machine: load 9.5 on 2 cores"
    )


def test_the_threshold_counts_the_ranks(monkeypatch):
    _load(monkeypatch, 5.0)  # noisy for 2 ranks (above 4), callable for 4 (not above 6)
    assert checks.too_loaded(2) and not checks.too_loaded(4)


def test_load_report_says_too_noisy_above_cores_plus_ranks(monkeypatch):
    _load(monkeypatch, 6.5)
    report = checks.load_report(ranks=4)
    assert report == {"load_avg_1min": 6.5, "cpu_cores": 2, "too_noisy_to_call": True}
    assert checks.load_line(report) == (
        "load average 6.5 (1 min) on 2 cores; timings too noisy to call on this machine"
    )
    _load(monkeypatch, 5.0)
    assert checks.load_line(checks.load_report(ranks=4)) == "load average 5.0 (1 min) on 2 cores"
