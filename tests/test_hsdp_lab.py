"""hsdp_lab's interleaved measurement and its figures: train_windows in rounds keeps the tracer's
bytes per step exact (every round's window counted), step_time is the fastest all-rank step over
the rounds, and the two figures draw what they are given."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

import labkit  # noqa: E402
from labkit import loop  # noqa: E402
from labkit.labs import hsdp_lab  # noqa: E402
from labkit.launch.topology import NodeLink  # noqa: E402
from labkit.models import num_params  # noqa: E402

FAST = NodeLink(bandwidth_Bps=1e10, latency_s=0.0)


class _Results(list):
    def __init__(self, items, traces):
        super().__init__(items)
        self.traces = traces


def test_step_time_is_the_fastest_all_rank_step_over_rounds():
    r0 = {"x": {"round_step_s": [[0.5, 0.3], [0.2, 0.9]]}}
    r1 = {"x": {"round_step_s": [[0.4, 0.6], [0.35, 0.1]]}}
    # all-rank steps: max(0.5,0.4)=0.5, 0.6, 0.35, 0.9 -> 0.35
    assert hsdp_lab.step_time([r0, r1], "x") == 0.35


def test_rounds_keep_bytes_per_step_exact():
    cfg = hsdp_lab.CFG
    runs = hsdp_lab.runs("ddp")
    runs = {"ddp": (runs["ddp"][0], {**runs["ddp"][1], "inter_node": FAST})}
    out = labkit.run(
        hsdp_lab.train_windows, runs, cfg, 1, rounds=2, warmup=0, world_size=4, nodes=2, timeout=300
    )
    assert [len(r["ddp"]["windows"]) for r in out] == [2] * 4
    assert [len(r["ddp"]["round_step_s"]) for r in out] == [2] * 4
    assert out[0]["ddp"]["steps_run"] == 2
    # per timed step: the process's CPU time (> 0) and the link's hold (the fast link: ~0)
    assert [[len(x) for x in r["ddp"]["round_cpu_s"]] for r in out] == [[1, 1]] * 4
    assert all(t > 0 for r in out for x in r["ddp"]["round_cpu_s"] for t in x)
    assert all(0 <= t < 0.05 for r in out for x in r["ddp"]["round_held_s"] for t in x)
    P = num_params(loop.build_model(cfg))
    assert hsdp_lab.node_bytes_per_step(out, "ddp") == pytest.approx(12 * P, rel=0.01)
    fig = hsdp_lab.plot_node_bytes(
        {"ddp": 12 * P}, {"ddp": hsdp_lab.node_bytes_per_step(out, "ddp", "intra")}
    )
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights[0] == pytest.approx(12 * P / 2**20)


def _flat_vs_hier():
    import torch

    from labkit.comm.collectives import ring_all_reduce
    from labkit.observe import tracing

    x, out = torch.ones(1024), {}
    for name in ("a", "b"):
        start = tracing.clock()
        ring_all_reduce(x)
        out[name] = (tracing.clock() - start, (start, tracing.clock()))
    return out


def test_plot_flat_vs_hier_labels_each_window_and_hatches_crossings():
    out = labkit.run(_flat_vs_hier, world_size=4, nodes=2)
    fig = hsdp_lab.plot_flat_vs_hier(out)
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert any(t.startswith("a: ") for t in texts) and any(t.startswith("b: ") for t in texts)
    assert any(p.get_hatch() == "xx" for c in ax.collections for p in [c] if hasattr(p, "get_hatch"))


def _rounds():
    import torch

    from labkit.comm import collectives

    collectives.DIRECT_MAX_BYTES = 0  # a ring: 2 messages of half the tensor per rank
    x = torch.ones(1024)
    return hsdp_lab.time_rounds({"a": lambda: collectives.ring_all_reduce(x)}, rounds=3)


def test_time_rounds_interleaves_free_link_and_prices_traced_bytes():
    out = labkit.run(_rounds, world_size=2, nodes=2, inter_node=NodeLink(1e7, 0.0))
    for r in out:
        assert sorted(r) == ["a", "a free"]
        assert [len(r[k]["s"]) for k in r] == [3, 3] and [len(r[k]["windows"]) for k in r] == [3, 3]
        a, free = r["a"]["windows"], r["a free"]["windows"]
        # round 0: a, a free; round 1 reversed: a free, a; round 2: a, a free
        assert a[0][1] <= free[0][0] and free[1][1] <= a[1][0] and a[2][1] <= free[2][0]
    assert hsdp_lab.fastest(out, "a") == min(max(v) for v in zip(*(r["a"]["s"] for r in out)))
    # 4 KiB crosses per call (2 x 2 KiB ring messages) plus the cross-rank check's small headers
    slow = hsdp_lab.link_seconds(out, "a", NodeLink(1e6, 0.0))
    assert slow == pytest.approx(4096 / 1e6, abs=256 / 1e6)
    with_latency = hsdp_lab.link_seconds(out, "a", NodeLink(1e6, 0.01))
    assert with_latency - slow >= 0.02  # at least the 2 ring messages pay a latency each
    # the link held each rank at least its bytes' price (4 KiB at 10 MB/s: a sleep is never shorter), and
    # the model (CPU on the free link + the price) is what measured_seconds adds up, load-free
    link = NodeLink(1e7, 0.0)
    assert all(h >= 0.9 * 4096 / 1e7 for r in out for h in r["a"]["held"])
    assert hsdp_lab.link_cost(out, "a", link) == hsdp_lab.link_seconds(out, "a", link)
    cpu_free = max(min(r["a free"]["cpu"]) for r in out)
    assert hsdp_lab.compute_seconds(out, "a free") == cpu_free
    assert hsdp_lab.model_seconds(out, "a", "a free", link) == cpu_free + hsdp_lab.link_cost(out, "a", link)
    measured = max(min(c + h for c, h in zip(r["a"]["cpu"], r["a"]["held"])) for r in out)
    assert hsdp_lab.measured_seconds(out, "a") == measured


def test_plot_flat_vs_hier_draws_time_rounds_last_round_of_the_labels_given():
    out = labkit.run(_rounds, world_size=2, nodes=2)
    fig = hsdp_lab.plot_flat_vs_hier(out, labels=("a",))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any(t.startswith("a: ") for t in texts) and not any(t.startswith("a free") for t in texts)
    fig = hsdp_lab.plot_flat_vs_hier(out, labels=("a",), captions={"a": "a: the link held 1 ms"})
    assert "a: the link held 1 ms" in [t.get_text() for t in fig.axes[0].texts]


def test_model_and_measured_seconds_of_train_windows_results():
    """compute_seconds: per rank the least step's CPU time, the busiest rank's; measured_seconds
    the same of CPU + link hold; model_seconds the free label's compute + link_cost."""
    r0 = {
        "x": {"round_cpu_s": [[0.10, 0.12]], "round_held_s": [[0.05, 0.02]], "windows": [], "steps_run": 2},
        "x free": {
            "round_cpu_s": [[0.09, 0.11]],
            "round_held_s": [[0.0, 0.0]],
            "windows": [],
            "steps_run": 2,
        },
    }
    r1 = {
        "x": {"round_cpu_s": [[0.20, 0.30]], "round_held_s": [[0.01, 0.01]], "windows": [], "steps_run": 2},
        "x free": {
            "round_cpu_s": [[0.25, 0.19]],
            "round_held_s": [[0.0, 0.0]],
            "windows": [],
            "steps_run": 2,
        },
    }
    out = _Results([r0, r1], [{"events": []}, {"events": []}])
    assert hsdp_lab.compute_seconds(out, "x") == pytest.approx(0.20)
    assert hsdp_lab.measured_seconds(out, "x") == pytest.approx(0.21)  # rank 1: 0.20 + 0.01
    assert hsdp_lab.model_seconds(out, "x", "x free", FAST) == pytest.approx(0.19)  # no bytes traced


def test_payload_only_drops_header_only_crossings():
    traces = [
        {
            "rank": 0,
            "events": [
                {"inter_bytes": 128, "inter_messages": 1},
                {"inter_bytes": 2**20, "inter_messages": 2},
                {"op": "barrier"},
            ],
        }
    ]
    got = hsdp_lab.payload_only(traces)
    assert [ev.get("inter_bytes") for ev in got[0]["events"]] == [0, 2**20, None]
    assert traces[0]["events"][0]["inter_bytes"] == 128  # copies: the run's traces untouched
