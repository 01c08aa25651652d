"""python -m labkit (labkit.cli) under torchrun on CPU: a replicated (ddp, 2 ranks) and a sharded
(fsdp, 4 ranks) strategy each match single-process training (--check) and each other element-wise,
write a trace per rank, and the trace file draws with the labs' plotting functions."""

import os
import sys

import pytest
import torch

from conftest import ROOT, run_in_own_group

ARGS = ["--steps", "3", "--d-model", "32", "--layers", "2", "--seq-len", "32", "--batch-size", "8"]


def torchrun(nproc, strategy, out):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",
        "-m",
        "labkit",
        "--strategy",
        strategy,
        "--check",
        "--out",
        str(out),
        *ARGS,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_in_own_group(cmd, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vs single-process: ok" in proc.stdout, proc.stdout
    return torch.load(os.path.join(out, "run.pt"), weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    return {
        (s, n): torchrun(n, s, base / f"{s}{n}")
        # two torchrun launches (each starts fresh interpreters: seconds per rank): the
        # replicated and the sharded family, at two world sizes; every strategy's equality with
        # one process is tested on labkit.run's ranks (tests/test_loop.py, test_fsdp.py, ...)
        for s, n in [("ddp", 2), ("fsdp", 4)]
    }


def test_every_strategy_writes_a_trace_per_rank(runs):
    for (strategy, n), run in runs.items():
        assert len(run["traces"]) == n and all(t["events"] for t in run["traces"]), strategy
        assert len(run["step_s"]) == n and len(run["losses"]) == 3


def test_strategies_agree_with_each_other_elementwise(runs):
    from labkit.checks import compare

    ref = runs[("ddp", 2)]["state"]
    for key, run in runs.items():
        report = compare(ref, run["state"], rtol=1e-5, atol=1e-5, label=f"{key} vs ddp")
        assert report.ok, str(report)
        assert run["losses"] == pytest.approx(runs[("ddp", 2)]["losses"], rel=1e-5)


def test_trace_file_draws_with_the_labs_plotting_functions(runs, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from labkit.observe.timeline import plot_timeline

    fig = plot_timeline(runs[("fsdp", 4)]["traces"])
    fig.savefig(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
