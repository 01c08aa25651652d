"""The simulated two-level network: labkit.run(nodes=, inter_node=), labkit.topology() inside a
rank (and under torchrun's environment), the tracer's intra / inter-node bytes, the throttle."""

import time
import types

import pytest
import torch

import labkit
from labkit.comm import collectives as C
from labkit.comm._crosscheck import HEADER_BYTES
from labkit.launch import topology as T
from labkit.observe import trace_stats


def _where():
    t = labkit.topology()
    return t.nodes, t.ranks_per_node, t.node, t.local_rank, t.inter_node


def test_topology_inside_ranks():
    out = labkit.run(_where, world_size=4, nodes=2)
    assert [o[:4] for o in out] == [(2, 2, 0, 0), (2, 2, 0, 1), (2, 2, 1, 0), (2, 2, 1, 1)]
    assert all(o[4] == T.NodeLink() for o in out)
    link = T.NodeLink(bandwidth_Bps=1e7, latency_s=0.0)
    out = labkit.run(_where, world_size=2, nodes=2, inter_node=link)
    assert [o[:4] for o in out] == [(2, 1, 0, 0), (2, 1, 1, 0)] and out[0][4] == link
    assert [o[:4] for o in labkit.run(_where, world_size=2)] == [(1, 2, 0, 0), (1, 2, 0, 1)]


def test_topology_from_torchrun_env(monkeypatch):
    for k, v in dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_RANK="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LABKIT_INTER_NODE", raising=False)
    assert labkit.topology() == T.Topology(2, 2, 1, 0, None)  # torchrun's network: not throttled
    monkeypatch.delenv("WORLD_SIZE")
    assert labkit.topology() == T.Topology(1, 1, 0, 0, None)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(nodes=3), ValueError),
        (dict(nodes=0), ValueError),
        (dict(nodes=True), ValueError),
        (dict(nodes=2.0), ValueError),
        (dict(inter_node=T.NodeLink()), ValueError),
        (dict(nodes=2, inter_node="fast"), TypeError),
        (dict(nodes=2, inter_node=(0, 1e-3)), ValueError),
        (dict(nodes=2, inter_node=(1e9, -1)), ValueError),
    ],
)
def test_bad_topology_raises(kwargs, error):
    with pytest.raises(error):
        labkit.run(_where, world_size=4, **kwargs)


def test_costmodel_link_accepted():
    from labkit.costmodel.links import IB_200G

    assert T.resolve(4, 2, IB_200G) == (2, T.NodeLink(IB_200G.busbw_Bps, IB_200G.alpha_s))


def _traced_all_reduce(numel, reps):
    x = torch.ones(numel)
    start = time.perf_counter()
    for _ in range(reps):
        C.ring_all_reduce(x)
    return time.perf_counter() - start


def test_tracer_splits_intra_and_inter_node_bytes():
    numel = 2**20  # 4 MiB: the ring (above DIRECT_MAX_BYTES)
    out = labkit.run(_traced_all_reduce, numel, 1, world_size=4, nodes=2, inter_node=T.NodeLink(1e9, 0.0))
    data = 6 * numel  # 2(n-1) steps of a quarter of 4 bytes x numel
    header = HEADER_BYTES  # the cross-rank check: one header to each of the 3 peers
    for rank, trace in enumerate(out.traces):
        got = trace_stats.node_bytes(trace)
        # ring 0 -> 1 -> 2 -> 3 -> 0: ranks 1 and 3 send their data across nodes
        inter_data = data if rank in (1, 3) else 0
        # one message per ring step piece across (4 MiB pieces: one per step), 2 headers
        assert got == {
            "inter": inter_data + 2 * header,
            "intra": data - inter_data + header,
            "inter_messages": (6 if rank in (1, 3) else 0) + 2,
        }
    total = trace_stats.node_bytes(out.traces)
    assert total["inter"] == 2 * data + 8 * header


def test_inter_node_link_costs_its_time():
    # A lower bound only (sleeps never end early): 2 ranks on 2 nodes, 10 MB/s, 4 MiB all-reduce:
    # each rank sends 4 MiB across (2(n-1)/n = 1), so at least 0.42 s.
    link = T.NodeLink(bandwidth_Bps=1e7, latency_s=0.0)
    out = labkit.run(_traced_all_reduce, 2**20, 1, world_size=2, nodes=2, inter_node=link)
    assert min(out) >= 4 * 2**20 / 1e7


def _late_wake_ups():
    from labkit.comm import _link

    real, asked = time.sleep, []

    def late(seconds):  # a busy machine: the thread wakes long after its sleep ended
        asked.append(seconds)
        real(3 * seconds)

    # The link's clock only: patching time.sleep itself also caught the rank's other threads (its
    # parent watch sleeps 0.5 s a turn), whose sleeps fell inside the all-reduce once a busy
    # machine stretched it (asked 0.50756 s, held 0.00756 s beside 8 CPU hogs on 2 cores).
    clock = types.SimpleNamespace(sleep=late, perf_counter=time.perf_counter)
    _link.time = clock
    try:
        before, start = _link.held_s(), time.perf_counter()
        C.ring_all_reduce(torch.ones(2**14))
        held, wall = _link.held_s() - before, time.perf_counter() - start
        clock.sleep = lambda seconds: None  # a sleep that ends at once: a broken clock
        try:
            _link.sending([1 - torch.distributed.get_rank()], 1000)
            early = "no error"
        except RuntimeError as e:
            early = str(e)
    finally:
        _link.time = time
    return held, sum(asked), wall, early


def test_the_link_holds_a_rank_for_its_sleeps_lengths_not_their_late_wake_ups():
    # held_s is what the link charged (the lab's "CPU + held" is load-free): a thread that
    # wakes late on a busy machine adds wall time, not held time
    link = T.NodeLink(bandwidth_Bps=1e7, latency_s=0.001)
    for held, asked, wall, early in labkit.run(_late_wake_ups, world_size=2, nodes=2, inter_node=link):
        assert asked > 0.0065 and held == pytest.approx(asked, rel=1e-12)  # 64 KiB at 10 MB/s
        assert wall >= 3 * asked
        assert "sleep on the link ended after" in early, early


def _switch_link():
    slow = T.NodeLink(1e6, 0.0)
    with T.inter_node(slow) as link:
        inside = labkit.topology().inter_node
        start = time.perf_counter()
        C.ring_all_reduce(torch.ones(2**16))  # 256 KiB: at least 0.26 s across at 1 MB/s
        took = time.perf_counter() - start
    return inside == slow == link, took, labkit.topology().inter_node == T.NodeLink()


def test_a_rank_can_switch_the_link_for_a_block():
    for same, took, restored in labkit.run(_switch_link, world_size=2, nodes=2):
        assert same and restored and took >= 2**18 / 1e6
    with pytest.raises(RuntimeError, match="only inside labkit.run"):
        with T.inter_node(T.NodeLink()):
            pass


def test_timeline_marks_collectives_that_crossed_nodes():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.observe.timeline import plot_timeline

    out = labkit.run(_traced_all_reduce, 2**10, 1, world_size=2, nodes=2, inter_node=T.NodeLink(1e9, 0.0))
    fig = plot_timeline(out.traces)
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert "sent across nodes" in labels
