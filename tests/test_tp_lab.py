"""tp_lab's helpers: FSDP x TP by hand (FSDPxTP) trains like one process in both mesh layouts, the
bytes the tracer sees cross nodes follow the lab's formulas in both, measure_step's memory and
all-reduce counts follow theirs at a size the lab does not use, and the figures draw what they
are given."""

import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

import labkit  # noqa: E402
from labkit.labs import tp_lab  # noqa: E402
from labkit.launch.topology import NodeLink  # noqa: E402

FREE = NodeLink(bandwidth_Bps=1e10, latency_s=0.0)
SMALL = dict(d=32, heads=2, hidden=96, batch=6, seq=4)


@pytest.fixture(scope="module")
def layouts():
    return labkit.run(tp_lab.two_layouts, world_size=4, nodes=2, inter_node=FREE, backend="gloo", timeout=300)


@pytest.mark.parametrize("label", ["TP in node", "TP across nodes"])
def test_both_layouts_train_like_one_process(layouts, label):
    one = tp_lab.train_one_process()
    for rank, res in enumerate(layouts):
        got = res[label]["state"]
        assert got.keys() == one["state"].keys()
        worst = max((one["state"][k] - got[k]).abs().max().item() for k in got)
        print(f"{label}, rank {rank}: max diff vs one process {worst:.3g}")
        assert worst <= 1e-6, (label, rank, worst)
    for step, want in enumerate(one["loss"]):
        mean = sum(r[label]["loss"][step] for r in layouts) / 4  # both dp replicas, twice each
        assert mean == pytest.approx(want, abs=1e-6)


def test_the_notebooks_layout_check_passes_and_can_fail(layouts):
    """check_layouts_train_as_one_process (tp_lab section 7's check) passes on the right run and
    raises on one parameter moved by 1e-3."""
    size = dict(d=tp_lab.D, heads=tp_lab.HEADS, hidden=tp_lab.HIDDEN, batch=4, seq=5)
    assert tp_lab.check_layouts_train_as_one_process(layouts, steps=3, size=size) <= 1e-5
    import copy

    tampered = copy.deepcopy(list(layouts))
    tampered[2]["TP across nodes"]["state"]["mlp.fc1.weight"][0, 0] += 1e-3
    with pytest.raises(AssertionError, match="TP across nodes, rank 2: mlp.fc1.weight"):
        tp_lab.check_layouts_train_as_one_process(tampered, steps=3, size=size)


def test_cross_node_bytes_follow_the_formulas(layouts):
    block = tp_lab.make_block(0)
    p_local = sum(tp_lab.tp_piece(p, n, 0, 2).numel() for n, p in block.named_parameters())
    fsdp = 4 * 2 * math.ceil(p_local / 2) * 4  # 4 ranks x (all-gather + reduce-scatter) x shard
    tp = 4 * 4 * tp_lab.ring_sent(2 * 5 * tp_lab.D * 4, 2)  # 4 ranks x 4 all-reduces x S
    for label, across, within in (("TP in node", fsdp, tp), ("TP across nodes", tp, fsdp)):
        headers = 64 * 16  # the ring's 64-byte headers: a bound on what is not payload
        assert across <= tp_lab.fsdp_tp_node_bytes(layouts, label) <= across + headers, label
        assert within <= tp_lab.fsdp_tp_node_bytes(layouts, label, "intra") <= within + headers, label


def test_link_seconds_is_bytes_over_bandwidth_plus_latency(layouts):
    link = NodeLink(bandwidth_Bps=1e6, latency_s=1e-3)
    for label in ("TP in node", "TP across nodes"):
        by_rank = [
            tp_lab.fsdp_tp_node_bytes(layouts, label, rank=r) / 1e6
            + tp_lab.fsdp_tp_node_bytes(layouts, label, "inter_messages", rank=r) * 1e-3
            for r in range(4)
        ]
        assert tp_lab.link_seconds(layouts, label, link) == pytest.approx(max(by_rank))
        assert max(by_rank) > 0


def test_measure_step_follows_the_formulas():
    out = labkit.run(tp_lab.measure_step, SMALL, world_size=2, backend="gloo", timeout=300)
    d, H, tokens = SMALL["d"], SMALL["hidden"], SMALL["batch"] * SMALL["seq"]
    for rank, res in enumerate(out):
        assert res["weights"] == (4 * d * d + 2 * d * H) * 4 // 2
        assert res["mlp_saved"] == 4 * tokens * (d + H)  # input whole, the two hidden halved
        counts = {k: tp_lab.all_reduces(out.traces[rank], w) for k, w in res["windows"].items()}
        assert [len(counts[k]) for k in ("attention forward", "MLP forward", "backward")] == [1, 1, 2]
        assert all(e["nbytes"] == tokens * d * 4 for v in counts.values() for e in v)
    fig = tp_lab.plot_tp_step(out)
    assert fig.axes and fig.axes[0].get_title().startswith("one TP step")


def test_saved_bytes_leaves_the_parameters_out():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    assert tp_lab.saved_bytes(lin, x, exclude=lin.parameters()) == 3 * 8 * 4
    assert tp_lab.saved_bytes(lin, x) == 3 * 8 * 4 + 4 * 8 * 4


def test_tp_dim_follows_the_plan():
    assert [tp_lab.tp_dim(n) for n in ("attn.q.weight", "attn.q.bias", "attn.o.weight", "attn.o.bias")] == [
        0,
        0,
        1,
        None,
    ]
    assert tp_lab.tp_dim("ln1.weight") is None and tp_lab.tp_dim("mlp.fc2.weight") == 1


def test_layout_bytes_bars_draw_what_they_are_given():
    fig = tp_lab.plot_layout_bytes({"a": 2048.0, "b": 1024.0}, {"a": 512.0, "b": 4096.0})
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == [2.0, 1.0, 0.5, 4.0]
