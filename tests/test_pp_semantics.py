"""The pipeline keeps one process's semantics off the course's path (issue 44, class 1-3), on 2
real ranks, one launch: a weight tied across stages accumulates over two steps without zero_grad
(2 G, not 3 G: pipeline_by_hand, "pp", "torch-pp", and "fsdp-tp-pp" and torch's composition of it,
three_d's TorchFSDPTPPP, on one pipeline of 2 stages, dp 1 x tp 1: the sum over FSDP's shards); a
frozen tied weight keeps grad None and AdamW's weight decay leaves it alone; an integer activation
between stages (token ids) is carried; pp.clip_grad_norm_ returns one process's total norm and
clips by it (tied weight counted once); an nn.Sequential subclass with its own forward is refused
at construction; forward_backward([]) and model.state_dict() on "pp" refuse naming why; ranks that
disagree on n_microbatches or rows all raise naming it; "torch-pp" and TorchFSDPTPPP refuse a batch
that does not split into their micro-batches (torch's split would leave the stages waiting),
naming both numbers. A second, small launch: a tuple stage output is refused before any send."""

import math

import pytest
import torch
import torch.nn as nn

import labkit
from labkit import loop, strategies
from labkit.checks import compare
from labkit.strategies import pp

CFG = loop.PRESETS["dp"].replace(batch_size=8, dtype=torch.float64)
FP64 = dict(rtol=0, atol=1e-12)


def tied_model():
    """Linear(4, 4) at both ends, one weight (held by the first and the last stage)."""
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(4, 4), nn.GELU(), last).double()


def data(rows=8, width=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=g, dtype=torch.float64), torch.randn(
        rows, width, generator=g, dtype=torch.float64
    )


def sq(out, y):
    return ((out - y) ** 2).sum()


def one_process(model, steps, m=2):
    x, y = data()
    for _ in range(steps):
        sum(sq(model(a), b) for a, b in zip(x.chunk(m), y.chunk(m))).backward()
    return model


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _error(fn):
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _accumulate_by_hand():
    model, (x, y) = tied_model(), data()
    pipe = pp.pipeline_by_hand(model, schedule="1f1b", n_microbatches=2)
    for _ in range(2):
        pipe.step(x, y, sq)
    return grads(model)


def _frozen_tied():
    model, (x, y) = tied_model(), data()
    model[0].weight.requires_grad_(False)
    before = model[0].weight.detach().clone()
    pipe = pp.pipeline_by_hand(model, schedule="gpipe", n_microbatches=2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.1, weight_decay=0.5)
    pipe.step(x, y, sq)
    opt.step()
    return dict(grad=model[0].weight.grad, moved=not torch.equal(before, model[0].weight.detach()))


class ArgMax(nn.Module):
    def forward(self, h):
        return h.argmax(-1)


def int_model():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(4, 6), ArgMax(), nn.Embedding(6, 3), nn.Linear(3, 4)).double()


def _integer_activation():
    model, (x, y) = int_model(), data()
    pipe = pp.pipeline_by_hand(model, schedule="1f1b", n_microbatches=2)
    loss = pipe.step(x, y, sq)
    return dict(grads=grads(model), loss=None if loss is None else loss.item())


def _clip(norm_type):
    model, (x, y) = tied_model(), data()
    pipe = pp.pipeline_by_hand(model, schedule="1f1b", n_microbatches=2)
    pipe.step(x, y, sq)
    total = pp.clip_grad_norm_(pipe.parameters(), max_norm=0.5, norm_type=norm_type)
    return dict(total=total.item(), grads=grads(model))


class Residual(nn.Sequential):
    def forward(self, h):
        return h + super().forward(h)


# The 3-D strategies on these 2 ranks: one pipeline of 2 stages, dp and tp of 1 (the tied weight's
# sum is the pipeline's; FSDP's shards and TP's DTensors are still in its way).
ONE_PIPELINE = dict(dp=1, pp=2, tp=1)


def _build(name, model):
    if name == "torch-fsdp-tp-pp":  # the oracle, not in NAMES
        from labkit.strategies.three_d import TorchFSDPTPPP

        return TorchFSDPTPPP(model, CFG, **ONE_PIPELINE)
    return strategies.build(name, model, CFG, **(ONE_PIPELINE if name == "fsdp-tp-pp" else {}))


def tokens(model, rows=8):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, model.config.vocab_size, (rows, CFG.seq_len), generator=g)
    y = torch.randint(0, model.config.vocab_size, (rows, CFG.seq_len), generator=g)
    return x, y


def _strategy_accumulation(name):
    """Two forward_backward calls without zero_grad on TinyGPT (tied embedding / head)."""
    model = loop.build_model(CFG)
    s = _build(name, model)
    x, y = tokens(model)
    count = y.numel()

    def loss_fn(a, b):
        return s(a, b, reduction="sum")[1] / count

    s.zero_grad()
    for _ in range(2):
        s.forward_backward([(x, y)], loss_fn)
    return s.full_grad_dict(), (x, y)


def _pp_refusals():
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = loop.build_model(CFG)
    s = strategies.build("pp", model, CFG)
    out = {
        "empty batch": _error(lambda: s.forward_backward([], lambda a, b: a)),
        "state_dict": _error(lambda: model.state_dict()),
        "get_model_state_dict": _error(lambda: get_model_state_dict(model)),
        "subclass forward": _error(
            lambda: pp.pipeline_by_hand(
                Residual(nn.Linear(4, 4), nn.Tanh()), schedule="1f1b", n_microbatches=2
            )
        ),
    }
    for name in ("zero1", "pp-zero1"):
        cfg = CFG if name == "pp-zero1" else loop.PRESETS["zero"]
        other = loop.build_model(cfg)
        z = strategies.build(name, other, cfg)
        out[f"get_optimizer_state_dict {name}"] = _error(lambda: get_optimizer_state_dict(other, z.optimizer))
    for name in ("torch-pp", "torch-fsdp-tp-pp"):  # torch's split would leave the ranks waiting
        other = loop.build_model(CFG)
        t = _build(name, other)
        out[f"{name} rows"] = _error(
            lambda: t.forward_backward([tokens(other, rows=7)], lambda a, b: a.sum())
        )
    full = s.full_state_dict()  # still works: each tensor from its stage
    out["full keys"] = sorted(full) == sorted(loop.build_model(CFG).state_dict())
    rank = dist.get_rank()
    x, y = data()
    m = 2 if rank == 0 else 4
    pipe = pp.pipeline_by_hand(tied_model(), schedule="gpipe", n_microbatches=m)
    out["n_microbatches differ"] = _error(lambda: pipe.step(x, y, sq))
    pipe = pp.pipeline_by_hand(tied_model(), schedule="gpipe", n_microbatches=2)
    rows = 8 if rank == 0 else 4
    out["rows differ"] = _error(lambda: pipe.step(x[:rows], y[:rows], sq))
    pipe = pp.pipeline_by_hand(tied_model(), schedule="gpipe" if rank == 0 else "1f1b", n_microbatches=2)
    out["schedules differ"] = _error(lambda: pipe.step(x, y, sq))
    return out


def _rank():
    return {
        "accumulate": _accumulate_by_hand(),
        "frozen": _frozen_tied(),
        "integer": _integer_activation(),
        "clip 2": _clip(2.0),
        "clip inf": _clip(math.inf),
        "pp accumulation": _strategy_accumulation("pp"),
        "torch-pp accumulation": _strategy_accumulation("torch-pp"),
        "fsdp-tp-pp accumulation": _strategy_accumulation("fsdp-tp-pp"),
        "torch-fsdp-tp-pp accumulation": _strategy_accumulation("torch-fsdp-tp-pp"),
        "refusals": _pp_refusals(),
    }


@pytest.fixture(scope="module")
def ranks():
    return labkit.run(_rank, world_size=2, timeout=300)


def merged(ranks, key):
    out = {}
    for r in ranks:
        for name, g in r[key].items():
            if name in out:  # a tied weight: the same sum on both holders
                assert torch.equal(out[name], g), name
            out[name] = g
    return out


def test_tied_weight_accumulates_like_one_process(ranks):
    expected = grads(one_process(tied_model(), steps=2))
    got = merged(ranks, "accumulate")
    assert got.keys() == expected.keys()
    compare(expected, got, label="two steps without zero_grad", **FP64).raise_if_failed()


@pytest.mark.parametrize("name", ["pp", "torch-pp", "fsdp-tp-pp", "torch-fsdp-tp-pp"])
def test_strategy_accumulates_like_one_process(ranks, name):
    got, (x, y) = ranks[0][f"{name} accumulation"]
    model = loop.build_model(CFG)
    for _ in range(2):
        model(x, y)[1].backward()
    compare(
        grads(model), got, label=f"{name}: forward_backward twice", rtol=1e-10, atol=1e-12
    ).raise_if_failed()
    assert torch.equal(got["tok_emb.weight"], ranks[1][f"{name} accumulation"][0]["tok_emb.weight"])


def test_frozen_tied_weight_has_no_grad_and_no_decay(ranks):
    for r in ranks:
        assert r["frozen"] == dict(grad=None, moved=False)


def test_integer_activation_is_carried(ranks):
    expected = grads(one_process(int_model(), steps=1))
    got = merged([{"g": r["integer"]["grads"]} for r in ranks], "g")
    assert got.keys() == expected.keys() == {"2.weight", "3.weight", "3.bias"}
    compare(expected, got, label="integer activation", **FP64).raise_if_failed()
    x, y = data()
    total = sum(sq(int_model()(a), b) for a, b in zip(x.chunk(2), y.chunk(2))).item()
    assert ranks[1]["integer"]["loss"] == pytest.approx(total, abs=1e-12)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_is_one_process(ranks, norm_type):
    model = one_process(tied_model(), steps=1)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5, norm_type=norm_type)
    key = "clip 2" if norm_type == 2.0 else "clip inf"
    for r in ranks:
        assert r[key]["total"] == pytest.approx(total.item(), rel=1e-12)
    compare(
        grads(model), merged([{"g": r[key]["grads"]} for r in ranks], "g"), label="clipped", **FP64
    ).raise_if_failed()


REFUSALS = {
    "empty batch": ("ValueError", "non-empty list of (x, y) micro-batches"),
    "state_dict": ("RuntimeError", "untrained copies of the stages other ranks train"),
    "get_model_state_dict": ("RuntimeError", "untrained copies"),
    "subclass forward": ("TypeError", "Residual subclasses nn.Sequential with a forward of its own"),
    "get_optimizer_state_dict zero1": ("RuntimeError", "not supported on labkit's ShardedOptimizer"),
    "get_optimizer_state_dict pp-zero1": ("RuntimeError", "not supported on labkit's ShardedOptimizer"),
    "n_microbatches differ": ("ValueError", "disagree on n_microbatches (rank 0: 2, rank 1: 4)"),
    "rows differ": (
        "ValueError",
        "different rows (rank 0 x 8, rank 0 target 8, rank 1 x 4, rank 1 target 4)",
    ),
    "schedules differ": ("ValueError", "run different schedules"),
    "torch-pp rows": (
        "ValueError",
        "torch-pp: a batch of 7 rows does not split into n_microbatches=2 equal micro-batches",
    ),
    "torch-fsdp-tp-pp rows": (
        "ValueError",
        "torch-fsdp-tp-pp: a batch of 7 rows does not split into n_microbatches=2 equal micro-batches",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_problem(ranks, case):
    kind, words = REFUSALS[case]
    for r in ranks:
        got = r["refusals"][case]
        assert got is not None, f"{case}: nothing raised"
        assert got[0] == kind and words in got[1], (case, got)
    assert all(r["refusals"]["full keys"] for r in ranks)


class Pair(nn.Module):
    def forward(self, h):
        return h, h


def _tuple_output():
    model = nn.Sequential(nn.Linear(4, 4), Pair(), nn.Identity(), nn.Identity()).double()
    x, y = data()
    pp.pipeline_by_hand(model, schedule="1f1b", n_microbatches=2).step(x, y, sq)


def test_tuple_stage_output_refused_before_any_send():
    with pytest.raises(Exception, match=r"chunk 0's output \(children 0..1\) is a tuple, not a tensor"):
        labkit.run(_tuple_output, world_size=2, timeout=60)
