"""labkit.strategies.pp's pure parts, without ranks: the schedule tables (each rank's order of
F / B actions), their replay (bubble fraction against (p-1)/(m+p-1) and (p-1)/(v m+p-1), live
activations: GPipe m, 1F1B p-r), deadlock detection, the stage split, and a one-rank pipeline."""

import pytest
import torch
import torch.nn as nn

from labkit.strategies.pp import (
    B,
    F,
    bubble_fraction,
    live_peak,
    order,
    orders,
    pipeline_by_hand,
    predicted_bubble,
    split_sequential,
    timeline,
)
from labkit.strategies.pp.stage import bounds

CASES = [(p, m) for p in (2, 3, 4) for m in (p, p + 1, 2 * p, 3 * p)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", CASES)
def test_bubble_and_live_activations(schedule, p, m):
    o = orders(schedule, p, m)
    for backward_slots in (1.0, 2.0):  # the formula holds for any backward / forward ratio
        assert bubble_fraction(o, backward_slots) == pytest.approx(predicted_bubble(p, m), abs=1e-12)
    peaks = [live_peak(r) for r in o]
    assert peaks == ([m] * p if schedule == "gpipe" else [min(p - r, m) for r in range(p)])


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p, m", [(p, m) for p, m in CASES if m % p == 0])
def test_interleaved_bubble(p, m, v):
    o = orders("interleaved", p, m, v)
    assert bubble_fraction(o) == pytest.approx(predicted_bubble(p, m, v), abs=1e-12)
    assert bubble_fraction(o) < bubble_fraction(orders("1f1b", p, m))
    for r, rank_order in enumerate(o):  # rank r runs its own chunks r, r + p, ... only
        assert {a.chunk for a in rank_order} == {r + k * p for k in range(v)}


def test_known_orders():
    assert order("1f1b", 0, 2, 4) == [F(0, 0), F(0, 1), B(0, 0), F(0, 2), B(0, 1), F(0, 3), B(0, 2), B(0, 3)]
    assert order("gpipe", 1, 2, 2) == [F(1, 0), F(1, 1), B(1, 0), B(1, 1)]
    # Megatron-LM's interleaved 1F1B, p=2, v=2, m=4, rank 0: warm-up 2(p-1-r) + (v-1)p = 4
    # forwards (chunk 0 on micro-batches 0, 1, then chunk 2 on them), then 1F1B, backwards
    # walking the chunks in reverse.
    assert order("interleaved", 0, 2, 4, 2) == [
        F(0, 0), F(0, 1), F(2, 0), F(2, 1), F(0, 2), B(2, 0), F(0, 3), B(2, 1),
        F(2, 2), B(0, 0), F(2, 3), B(0, 1), B(2, 2), B(2, 3), B(0, 2), B(0, 3),
    ]  # fmt: skip


def test_timeline_slots():
    slots = timeline(orders("gpipe", 2, 2))
    assert [(s.action, s.start) for s in slots[1]] == [(F(1, 0), 1), (F(1, 1), 2), (B(1, 0), 3), (B(1, 1), 4)]


def test_replay_refuses_deadlock_and_missing_actions():
    good = orders("1f1b", 2, 2)
    bad = [good[0], [B(1, 0), F(1, 0), F(1, 1), B(1, 1)]]  # backward before its forward
    with pytest.raises(ValueError, match="deadlock"):
        timeline(bad)
    with pytest.raises(ValueError, match="missing"):
        timeline([good[0], good[1][:-1]])


@pytest.mark.parametrize(
    "args, match",
    [
        (("zero-bubble", 0, 2, 2), "unknown pipeline schedule"),
        (("1f1b", 0, 4, 3), "n_microbatches=3 < 4 pipeline stages"),
        (("1f1b", 0, 2, 4, 2), "virtual_stages=2 needs schedule='interleaved'"),
        (("interleaved", 0, 2, 3, 2), "multiple of the 2"),
        (("gpipe", 0, 2, 0), "n_microbatches must be an int >= 1"),
        (("gpipe", 2, 2, 2), "rank 2 is not one of the 2 stages"),
    ],
)
def test_schedule_misuse(args, match):
    with pytest.raises(ValueError, match=match):
        order(*args)


def test_split_keeps_the_models_own_modules():
    model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(7)))
    chunks = split_sequential(model, 3)
    assert bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert [len(c) for c in chunks] == [3, 2, 2]
    assert all(a is b for a, b in zip([m for c in chunks for m in c], model))
    with pytest.raises(TypeError, match="must be an nn.Sequential"):
        split_sequential(nn.Linear(3, 3), 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has 7 children but the pipeline needs 8 chunks"):
        split_sequential(model, 8)


def test_one_rank_pipeline_equals_plain_backward():
    """Outside any process group the pipeline is one rank holding every chunk (transfers kept
    in memory): the same gradients as plain backward, over the micro-batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3, bias=False)).double()
    twin = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3, bias=False)).double()
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)

    def loss_fn(out, target):
        return ((out - target) ** 2).sum()

    pipe = pipeline_by_hand(model, schedule="gpipe", n_microbatches=3)
    loss = pipe.step(x, y, loss_fn)
    expected = sum(loss_fn(twin(a), b) for a, b in zip(x.chunk(3), y.chunk(3)))
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    assert pipe.record.peak_live == 3 and pipe.record.live == 0 and pipe.record.live_bytes == 0
    with pytest.raises(ValueError, match="a batch of 7 rows does not split into n_microbatches=3"):
        pipe.step(torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64), loss_fn)
