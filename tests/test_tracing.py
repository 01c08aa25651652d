"""labkit.observe.tracing, labkit.observe.trace_stats and labkit.observe.timeline.

Most tests record in-process on a one-rank gloo group; the last ones run 2 ranks through
labkit.run (torch DDP with the recording comm hook, FSDP2's fully_shard). No timing asserts:
only orderings and sizes.
"""

import threading

import matplotlib
import pytest
import torch
import torch.distributed as dist

matplotlib.use("Agg")

from labkit.observe import recording as hooks  # noqa: E402  (the fixture below is `recording`)
from labkit.observe import timeline, trace_stats, tracing  # noqa: E402
from labkit.units import fmt_bytes  # noqa: E402


@pytest.fixture(scope="module")
def group():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture
def recording(group):
    hooks.worker_begin(0, 1)
    yield
    hooks.worker_end()  # a no-op when the test already ended it


def _events(trace, op=None):
    return [ev for ev in trace["events"] if op is None or ev["op"] == op]


# the old names (torch 2.13 deprecates them; a learner's script on older torch calls them)
@pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning")
def test_sync_collectives_are_recorded_with_full_tensor_bytes(recording):
    dist.all_reduce(torch.ones(256))
    dist.all_gather_into_tensor(torch.empty(10), torch.ones(10))
    dist.reduce_scatter_tensor(torch.empty(8), torch.ones(8))
    dist.barrier()
    trace = hooks.worker_end()
    assert [ev["op"] for ev in trace["events"]] == ["all_reduce", "all_gather", "reduce_scatter", "barrier"]
    assert [ev["nbytes"] for ev in trace["events"]] == [1024, 40, 32, 0]
    for ev in trace["events"]:
        assert 0 <= ev["start"] <= ev["end"]
        assert ev["async"] is False
        assert ev["blocked"] == [(ev["start"], ev["end"])]  # a sync call blocks its thread throughout


def test_async_collective_returns_a_work_and_records_the_wait(recording):
    work = dist.all_reduce(torch.ones(64), async_op=True)
    assert isinstance(work, dist.distributed_c10d.Work)  # FSDP2 checks this before waiting
    work.wait()
    trace = hooks.worker_end()
    (ev,) = _events(trace, "all_reduce")
    assert ev["async"] is True and ev["nbytes"] == 256
    assert ev["start"] <= ev["end"]
    assert len(ev["blocked"]) == 1 and ev["blocked"][0][0] <= ev["blocked"][0][1]


def test_calls_inside_record_collective_are_not_recorded_separately(recording):
    with tracing.record_collective("ring_all_reduce", 4096, 1):
        dist.all_reduce(torch.ones(100))
        dist.broadcast(torch.ones(3), 0)
    trace = hooks.worker_end()
    assert [(ev["op"], ev["nbytes"]) for ev in trace["events"]] == [("ring_all_reduce", 4096)]


def test_async_token_finished_on_another_thread_with_blocked_wait(recording):
    token = tracing.start_collective("ring_all_gather", 1000, 2)
    finished = threading.Event()

    def comm_thread():
        with token.running():  # its own dist calls are the ring's steps: not recorded
            dist.broadcast(torch.ones(3), 0)
        finished.set()

    thread = threading.Thread(target=comm_thread)
    thread.start()
    with tracing.blocked(token):
        thread.join()
    trace = hooks.worker_end()
    (ev,) = trace["events"]
    assert ev["op"] == "ring_all_gather" and ev["async"] is True and finished.is_set()
    assert ev["start"] <= ev["end"] and len(ev["blocked"]) == 1
    assert ev["blocked"][0][1] >= ev["end"]  # the waiter wakes after the comm thread finished


def test_spans_nest_and_work_as_decorators(recording):
    @tracing.span("optimizer")
    def optimizer_step():
        return 7

    with tracing.span("step"):
        with tracing.span("forward"):
            with tracing.span("attention"):
                pass
        assert optimizer_step() == 7
    trace = hooks.worker_end()
    depth = {sp["name"]: sp["depth"] for sp in trace["spans"]}
    assert depth == {"step": 0, "forward": 1, "attention": 2, "optimizer": 1}
    assert all(sp["start"] <= sp["end"] for sp in trace["spans"])
    assert len(trace_stats.steps(trace)) == 1


def test_nothing_recorded_outside_a_run_and_patches_removed(group):
    original = dist.all_reduce
    assert hooks.worker_end() is None
    with tracing.span("forward"), tracing.record_collective("ring_all_reduce", 8, 1):
        pass
    with tracing.blocked(tracing.start_collective("x", 1, 1)):
        pass
    hooks.worker_begin(0, 1)
    assert dist.all_reduce is not original
    with hooks.paused():
        assert dist.all_reduce is original
        dist.all_reduce(torch.ones(2))
    trace = hooks.worker_end()
    assert dist.all_reduce is original and trace["events"] == []


def _synthetic_trace(rank=0):
    # compute 0-10 ms; comm 5-15 ms; the thread waits 10-15 ms. Overlap = 5 of 10 ms.
    return {
        "rank": rank,
        "world_size": 2,
        "t0": 100.0,
        "host": "h",
        "spans": [
            {"name": "step", "kind": "compute", "start": 0.0, "end": 0.015, "depth": 0},
            {"name": "backward", "kind": "compute", "start": 0.0, "end": 0.010, "depth": 1},
        ],
        "events": [
            {
                "kind": "collective",
                "op": "all_reduce",
                "nbytes": 4 << 20,
                "world_size": 2,
                "start": 0.005,
                "end": 0.015,
                "blocked": [(0.010, 0.015)],
                "async": True,
                "label": "bucket",
            },
            {
                "kind": "collective",
                "op": "all_gather",
                "nbytes": 1 << 20,
                "world_size": 2,
                "start": 0.016,
                "end": 0.018,
                "blocked": [(0.016, 0.018)],
                "async": False,
                "label": "ag",
            },
        ],
    }


def test_overlap_stats_known_answer():
    stats = trace_stats.overlap_stats(_synthetic_trace())
    assert stats["comm_s"] == pytest.approx(0.012)
    assert stats["exposed_s"] == pytest.approx(0.007)  # 10-15 and 16-18 ms
    assert stats["overlap_pct"] == pytest.approx(100 * 5 / 12)
    assert stats["compute_s"] == pytest.approx(0.010)  # "step" marks, it is not compute
    assert stats["blocked_s"] == pytest.approx(0.007)
    window = trace_stats.overlap_stats(_synthetic_trace(), t_range=(0.0, 0.015))
    assert window["overlap_pct"] == pytest.approx(50.0)


def test_collective_counts_over_ranks():
    one = trace_stats.collective_counts(_synthetic_trace())
    assert one == {"all_gather": (1, 1 << 20), "all_reduce": (1, 4 << 20)}
    both = trace_stats.collective_counts([_synthetic_trace(0), None, _synthetic_trace(1)])
    assert both["all_reduce"] == (2, 8 << 20)


def test_busbw_follows_nccl_tests():
    gb = 1e9
    assert trace_stats.busbw("all_reduce", gb, 1.0, 4) == pytest.approx(2 * 3 / 4)
    assert trace_stats.busbw("ring_all_reduce", gb, 2.0, 2) == pytest.approx(0.5)
    assert trace_stats.busbw("reduce_scatter", gb, 1.0, 4) == pytest.approx(3 / 4)
    assert trace_stats.busbw("all_gather", gb, 1.0, 8) == pytest.approx(7 / 8)
    assert trace_stats.busbw("broadcast", gb, 1.0, 8) == pytest.approx(1.0)
    assert trace_stats.busbw("all_reduce", gb, 1.0, 1) == 0.0  # one rank moves nothing


def test_plot_timeline_renders_png(tmp_path):
    traces = [_synthetic_trace(0), _synthetic_trace(1)]
    traces[1]["t0"] = 100.002  # rank 1 started 2 ms later on the same clock
    fig = timeline.plot_timeline(traces, title="two ranks")
    fig.savefig(tmp_path / "timeline.png")
    zoom = timeline.plot_timeline(traces, t_range=(0, 12), show_inner=True)
    zoom.savefig(tmp_path / "zoom.png")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "zoom.png").stat().st_size > 10_000
    assert fmt_bytes(4 << 20) == "4.00 MiB"  # labkit.units: the one byte formatter
    import matplotlib.pyplot as plt

    plt.close("all")


# ---------------------------------------------------------------- 2 ranks through labkit.run


def _train_two_steps(kind):
    from labkit.observe import tracing as tr

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        model.register_comm_hook(state=None, hook=tr.ddp_comm_hook_recording)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    for _ in range(2):
        with tr.span("step"):
            with tr.span("forward"):
                loss = model(torch.randn(8, 32)).sum()
            with tr.span("backward"):
                loss.backward()
    return None


def _run_or_skip(fn, *args):
    labkit = pytest.importorskip("labkit")
    if not hasattr(labkit, "run"):
        pytest.skip("labkit.run not available yet")
    return labkit.run(fn, *args, world_size=2, timeout=60)


def test_torch_ddp_buckets_show_up_through_the_comm_hook(tmp_path):
    results = _run_or_skip(_train_two_steps, "ddp")
    assert len(results.traces) == 2
    params_bytes = (32 * 32 + 32 + 32 * 4 + 4) * 4
    for trace in results.traces:
        count, nbytes = trace_stats.collective_counts(trace)["all_reduce"]
        assert count >= 2 and nbytes == 2 * params_bytes
        assert len(trace_stats.steps(trace)) == 2
    timeline.plot_timeline(results.traces, title="torch DDP").savefig(tmp_path / "ddp.png")


def test_fsdp2_all_gathers_and_reduce_scatters_are_seen():
    results = _run_or_skip(_train_two_steps, "fsdp")
    for trace in results.traces:
        counts = trace_stats.collective_counts(trace)
        assert counts["all_gather"][0] >= 2 and counts["reduce_scatter"][0] >= 2
        assert all(ev["nbytes"] > 0 for ev in trace["events"])
