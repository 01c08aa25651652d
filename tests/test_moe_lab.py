"""moe_lab's helpers: the measurement's all-to-all bytes follow wire_bytes at a size the lab does
not use, the expert memory is 1/ep, the aux loss evens the skewed router out, the dropped-token
formula equals the plan's count, the at-scale arithmetic agrees with itself and the published
active counts, bad input raises, the figure draws once and the notebook stores it once."""

import json
import os

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

import labkit  # noqa: E402
from conftest import ROOT  # noqa: E402
from labkit.comm.all_to_all import wire_bytes  # noqa: E402
from labkit.costmodel.links import DGX_H100_IB400, NVLINK_H100  # noqa: E402
from labkit.labs import moe_lab as M  # noqa: E402

SMALL = dict(d=6, hidden=8, experts=4, top_k=1, tokens=10)


def test_measured_all_to_all_bytes_follow_wire_bytes():
    run = labkit.run(M.measure_ep, size=SMALL, world_size=4, backend="gloo", timeout=300)
    d = SMALL["d"]
    for rank, res in enumerate(run):
        r, send = res["ep_rank"], res["send"]
        back = run[rank ^ 1]["send"][r]
        combine = [send[0], back] if r == 0 else [back, send[1]]
        want = [
            wire_bytes([1, 1], r, 8),
            wire_bytes(send, r, 8 * d),
            wire_bytes([1, 1], r, 8),
            wire_bytes(send, r, 8),
            wire_bytes(combine, r, 8 * d),
        ]
        assert M.a2a_sent(run.traces[rank], res["window"]) == want
        assert sum(send) == SMALL["tokens"] * SMALL["top_k"]
        for name in ("w1", "w2"):
            assert res["param_bytes"][name] * 2 == res["full_bytes"][name]
        assert res["param_bytes"]["router"] == res["full_bytes"]["router"]


def test_aux_loss_evens_the_skewed_router():
    moe, x = M.skewed_moe(), M.skewed_tokens(128, seed=5)
    before = M.tokens_per_expert(moe, x)
    losses = M.train_aux(moe, x, steps=30)
    after = M.tokens_per_expert(moe, x)
    share = 128 * 2 / 4
    assert sum(before) == sum(after) == 256
    assert max(before) / share > 1.5 and max(after) / share < max(before) / share
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("cf", [1.0, 1.25, 2.0, None])
def test_dropped_formula_equals_the_plan(cf):
    moe, x = M.skewed_moe(), M.skewed_tokens(64)
    _, idx, _ = M.route(x @ moe.router.detach().T, 2)
    counts = torch.bincount(idx.reshape(-1), minlength=4).tolist()
    cap = None if cf is None else M.capacity(64, 4, 2, cf)
    _, _, kept = M.dispatch_plan(idx, 4, cap, 2)
    assert int((~kept).sum()) == M.dropped(counts, cap)


def test_one_process_groups_drop_per_group():
    full = M.MoE(4, 6, 4, 2, 1.0, seed=1)
    x = torch.randn(16, 4, dtype=M.DTYPE, generator=torch.Generator().manual_seed(2))
    full(x, groups=1)
    whole = full.last["dropped"]
    full(x, groups=4)
    assert full.last["assignments"] == 32 and len(full.last["aux"]) == 4
    assert whole <= 32 and full.last["dropped"] <= 32


def test_a2a_time():
    S = 64e6
    assert M.a2a_time(1, S, DGX_H100_IB400) == 0.0
    flat = M.a2a_time(8, S, NVLINK_H100)
    assert flat == pytest.approx(7 * NVLINK_H100.alpha_s + 7 / 8 * S / NVLINK_H100.busbw_Bps)
    assert M.a2a_time(8, S, DGX_H100_IB400) == pytest.approx(flat)  # one node: NVLink alone
    assert M.a2a_time(16, S, DGX_H100_IB400) > 3 * flat


@pytest.mark.parametrize("name, n, ep", [("Mixtral-8x7B", 64, 8), ("DeepSeek-V3", 2048, 64)])
def test_at_scale_arithmetic(name, n, ep):
    m = M.MOE_MODELS[name]
    assert abs(M.active_params(m) - m["active"]) / m["active"] < 0.03
    t = M.crossover_tokens(m, n, ep)
    assert M.step_bytes(m, n, 1, t)["total"] == pytest.approx(M.step_bytes(m, n, ep, t)["total"])
    assert M.step_bytes(m, n, ep, t / 2)["total"] < M.step_bytes(m, n, 1, t / 2)["total"]
    assert M.states_per_rank(m, n, 1) == pytest.approx(M.STATE_BYTES * m["total"] / n)


def test_bad_input_raises():
    with pytest.raises(ValueError):
        M.capacity(8, 4, 2, 0)
    with pytest.raises(ValueError):
        M.route(torch.zeros(3, 4), 5)


def test_plot_tokens_per_expert_draws_what_it_is_given():
    fig = M.plot_tokens_per_expert([5, 1, 1, 1], [2, 2, 2, 2], cap=2)
    (ax,) = fig.axes
    heights = [p.get_height() for p in ax.patches]
    assert heights == [5, 1, 1, 1, 2, 2, 2, 2]


def test_moe_lab_stores_its_figure_once():
    with open(os.path.join(ROOT, "notebooks", "moe_lab.ipynb")) as f:
        nb = json.load(f)
    cells = [
        c
        for c in nb["cells"]
        if c["cell_type"] == "code" and any("image/png" in o.get("data", {}) for o in c.get("outputs", []))
    ]
    assert len(cells) == 1 and "plot_tokens_per_expert" in "".join(cells[0]["source"])
    assert sum("image/png" in o.get("data", {}) for o in cells[0]["outputs"]) == 1
