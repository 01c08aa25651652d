"""Pipeline parallelism on real ranks: pipeline_by_hand on an nn.Sequential the course never
uses (odd widths, a bias-free Linear, float64) under every schedule on 2 and 4 ranks equals one
process's gradients of the summed micro-batch losses and torch.distributed.pipelining's
(scale_grads=False) within 1e-12; the recorded orders give the bubble formula, the live
activations GPipe m / 1F1B p-r, the bytes sent the activation-size formula (and the tracer's
count); loop.train("pp" | "pp-zero1" | "torch-pp") equals loop.reference; misuse raises on every
rank with a message naming the problem. One launch per world size, module-scoped."""

import pytest
import torch
import torch.nn as nn

import labkit
from labkit.comm import p2p
from labkit import loop, strategies
from labkit.strategies import pp as pipeline
from labkit.checks import compare

STEPS = 3
CFG = loop.PRESETS["dp"].replace(batch_size=8)  # TinyGPT: 4 children (embedding, 2 blocks, head)
WIDE = CFG.replace(dtype=torch.float64)
FP32 = dict(rtol=1e-5, atol=1e-7)
FP32_STATE = dict(rtol=1e-5, atol=5e-5)
FP64 = dict(rtol=0, atol=1e-12)
WIDTHS = [5, 7, 3, 6, 4, 2]  # Linear(5, 7) Tanh Linear(7, 3, bias=False) GELU Linear(3, 6) ...
ROWS, M = 8, 4
SCHEDULES = {
    2: [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)],
    4: [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)],
}
LOOP_RUNS = {
    2: {
        "pp": dict(strategy="pp"),
        "torch-pp": dict(strategy="torch-pp"),
        "pp float64 gpipe": dict(strategy="pp", cfg=WIDE, schedule="gpipe", n_microbatches=4),
        "pp float64 1f1b accum 2": dict(strategy="pp", cfg=WIDE, accum_steps=2),
        "pp float64 interleaved": dict(strategy="pp", cfg=WIDE, schedule="interleaved", virtual_stages=2, n_microbatches=4),
        "pp float64 comm torch": dict(strategy="pp", cfg=WIDE, comm="torch"),
        "torch-pp float64 interleaved": dict(strategy="torch-pp", cfg=WIDE, schedule="interleaved", virtual_stages=2, n_microbatches=4),
    },
    4: {
        "pp-zero1": dict(strategy="pp-zero1"),
        "pp-zero1 float64 gpipe": dict(strategy="pp-zero1", cfg=WIDE, schedule="gpipe"),
        "pp float64 1f1b": dict(strategy="pp", cfg=WIDE, n_microbatches=8),
        "torch-pp float64 1f1b": dict(strategy="torch-pp", cfg=WIDE, n_microbatches=8),
    },
}  # fmt: skip


def unseen():
    torch.manual_seed(0)
    w = WIDTHS
    return nn.Sequential(
        nn.Linear(w[0], w[1]), nn.Tanh(), nn.Linear(w[1], w[2], bias=False), nn.GELU(),
        nn.Linear(w[2], w[3]), nn.Tanh(), nn.Linear(w[3], w[4]), nn.Linear(w[4], w[5]),
    ).double()  # fmt: skip


def batch():
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(ROWS, WIDTHS[0], generator=g, dtype=torch.float64),
        torch.randn(ROWS, WIDTHS[-1], generator=g, dtype=torch.float64),
    )


def loss_fn(out, y):
    return ((out - y) ** 2).sum()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _ours(schedule, v):
    from labkit.observe import tracing

    model, (x, y) = unseen(), batch()
    pipe = pipeline.pipeline_by_hand(model, schedule=schedule, n_microbatches=M, virtual_stages=v)
    events = tracing._recorder.events
    before = len(events)
    loss = pipe.step(x, y, loss_fn)
    traced = sum(
        e.get("intra_bytes", 0) + e.get("inter_bytes", 0) for e in events[before:] if e["op"] == "p2p_send"
    )
    rec = pipe.record
    return dict(
        grads=_grads(model),
        loss=None if loss is None else loss.item(),
        actions=rec.actions,
        peak_live=rec.peak_live,
        peak_live_bytes=rec.peak_live_bytes,
        sent_bytes=rec.sent_bytes,
        traced_bytes=traced,
    )


def _torch(schedule, v):
    import torch.distributed as dist

    from labkit.strategies.pp import split_sequential, torch_schedule

    model, (x, y) = unseen(), batch()
    p = dist.get_world_size()
    chunks = split_sequential(model, p * v)
    sched, ids = torch_schedule(
        chunks, schedule=schedule, n_microbatches=M, loss_fn=loss_fn, virtual_stages=v
    )
    losses = []
    args = (x,) if 0 in ids else ()
    kwargs = dict(target=y, losses=losses) if len(chunks) - 1 in ids else {}
    sched.step(*args, **kwargs)
    return dict(grads=_grads(model), loss=sum(l.item() for l in losses) if losses else None)


def _error(fn):
    try:
        fn()
    except Exception as exc:  # what the test expects: the type and the message
        return type(exc).__name__, str(exc)
    return None


def _misuse():
    pp = pipeline
    seq = unseen()
    model = loop.build_model(CFG)
    x, y = batch()
    pipe = pp.pipeline_by_hand(unseen(), schedule="1f1b", n_microbatches=2)

    def deadlocks(rank, p, m, v):  # rank 1 runs a backward before its forward
        o = pp.order("1f1b", rank, p, m, v)
        return o[::-1] if rank == 1 else o

    return {
        "unknown schedule": _error(lambda: pp.pipeline_by_hand(seq, schedule="zb1p", n_microbatches=2)),
        "m < stages": _error(lambda: pp.pipeline_by_hand(seq, schedule="gpipe", n_microbatches=1)),
        "virtual without interleaved": _error(
            lambda: pp.pipeline_by_hand(seq, schedule="1f1b", n_microbatches=2, virtual_stages=2)
        ),
        "not sequential": _error(lambda: pp.pipeline_by_hand(nn.Linear(3, 3), schedule="1f1b", n_microbatches=2)),
        "too few children": _error(
            lambda: pp.pipeline_by_hand(nn.Sequential(nn.Linear(3, 3)), schedule="1f1b", n_microbatches=2)
        ),
        "uneven batch": _error(lambda: pipe.step(x[:7], y[:7], loss_fn)),
        "rows differ": _error(lambda: pipe.step(x, y[:6], loss_fn)),
        "deadlocking schedule": _error(lambda: pp.pipeline_by_hand(seq, schedule=deadlocks, n_microbatches=2)),
        "bad comm": _error(lambda: pp.pipeline_by_hand(seq, schedule="1f1b", n_microbatches=2, comm="mpi")),
        "forward outside": _error(lambda: strategies.build("pp", model, CFG)(x)),
        "misspelled option": _error(lambda: strategies.build("pp", loop.build_model(CFG), CFG, schedul="gpipe")),
        "strategy comm": _error(lambda: strategies.build("pp", loop.build_model(CFG), CFG, comm="nccl")),
        "torch-pp comm": _error(lambda: strategies.build("torch-pp", loop.build_model(CFG), CFG, comm="ring")),
        "toy model": _error(lambda: strategies.build("pp", loop.build_model(loop.PRESETS["toy"]), loop.PRESETS["toy"])),
        "loop rows": _error(lambda: loop.train("pp", loop.PRESETS["dp"], steps=1)),
        "send to self": _error(lambda: p2p.send(torch.ones(2), dst=torch.distributed.get_rank())),
    }  # fmt: skip


def _rank(world_size):
    import torch.distributed as dist

    out = {
        "ours": {s: _ours(*s) for s in SCHEDULES[world_size]},
        "torch": {s: _torch(*s) for s in SCHEDULES[world_size]},
        "loop": dict(
            zip(
                LOOP_RUNS[world_size],
                loop.sweep(list(LOOP_RUNS[world_size].values()), cfg=CFG, steps=STEPS, spans=False),
            )
        ),
    }
    if world_size == 2:
        out["misuse"] = _misuse()
    s = strategies.build("pp-zero1" if world_size == 4 else "pp", loop.build_model(CFG), CFG)
    out["coordinates"] = (
        dist.get_rank(),
        s.data_rank(),
        s.data_world_size(),
    )
    return out


@pytest.fixture(scope="module")
def runs():
    return {n: labkit.run(_rank, n, world_size=n, timeout=900) for n in (2, 4)}


@pytest.fixture(scope="module")
def one_process():
    model, (x, y) = unseen(), batch()
    total = sum(loss_fn(model(a), b) for a, b in zip(x.chunk(M), y.chunk(M)))
    total.backward()
    return _grads(model), total.item()


def _merged(ranks, key, schedule):
    grads = {}
    for r in ranks:
        for name, g in r[key][schedule]["grads"].items():
            assert name not in grads, f"{name} has a gradient on two ranks"
            grads[name] = g
    return grads


@pytest.mark.parametrize("world_size, schedule", [(n, s) for n in SCHEDULES for s in SCHEDULES[n]])
def test_unseen_sequential_equals_one_process_and_torch(runs, one_process, world_size, schedule):
    ranks = runs[world_size]
    expected, loss = one_process
    ours, theirs = _merged(ranks, "ours", schedule), _merged(ranks, "torch", schedule)
    assert ours.keys() == expected.keys() == theirs.keys()
    compare(expected, ours, label=f"ours {schedule} vs one process", **FP64).raise_if_failed()
    compare(theirs, ours, label=f"ours {schedule} vs torch's", **FP64).raise_if_failed()
    losses = [r["ours"][schedule]["loss"] for r in ranks]
    assert losses[:-1] == [None] * (world_size - 1), "only the last stage returns the loss"
    assert losses[-1] == pytest.approx(loss, abs=1e-12)


@pytest.mark.parametrize("world_size, schedule", [(n, s) for n in SCHEDULES for s in SCHEDULES[n]])
def test_recorded_orders_bubble_and_activations(runs, world_size, schedule):
    pp = pipeline
    name, v = schedule
    ranks = [r["ours"][schedule] for r in runs[world_size]]
    recorded = [r["actions"] for r in ranks]
    assert recorded == pp.orders(name, world_size, M, v)
    assert pp.bubble_fraction(recorded) == pytest.approx(pp.predicted_bubble(world_size, M, v), abs=1e-12)
    peaks = [r["peak_live"] for r in ranks]
    assert peaks == [pp.live_peak(o) for o in recorded]
    if name == "gpipe":
        assert peaks == [M] * world_size
    if name == "1f1b":
        assert peaks == [world_size - r for r in range(world_size)]
        # fewer micro-batches held, fewer bytes saved for backward (the same where 1F1B holds m)
        gpipe = [r["ours"][("gpipe", 1)]["peak_live_bytes"] for r in runs[world_size]]
        for r, g in zip(ranks, gpipe):
            assert r["peak_live_bytes"] < g if r["peak_live"] < M else r["peak_live_bytes"] == g


@pytest.mark.parametrize("world_size, schedule", [(n, s) for n in SCHEDULES for s in SCHEDULES[n]])
def test_bytes_sent_exact(runs, world_size, schedule):
    """Per rank: m micro-batches x (the activation each chunk sends on + the gradient each chunk
    sends back), rows/m x width x 8 bytes; the tracer counted the same."""
    for rank, r in enumerate(runs[world_size]):
        got = r["ours"][schedule]
        n_chunks = world_size * schedule[1]
        expected = 0
        # widths at the chunk boundaries: the output width of each chunk's last Linear
        bounds = pipeline.stage.bounds(8, n_chunks)
        out_width = [_width_after(b[1]) for b in bounds]
        for c in range(rank, n_chunks, world_size):
            if c < n_chunks - 1:
                expected += M * (ROWS // M) * out_width[c] * 8
            if c > 0:
                expected += M * (ROWS // M) * out_width[c - 1] * 8
        assert got["sent_bytes"] == expected, (rank, schedule)
        assert got["traced_bytes"] == expected, (rank, schedule)


def _width_after(n_children):
    """The width of the unseen model's output after its first n children."""
    linears = [0, 2, 4, 6, 7]  # children that are Linear layers, in order
    return WIDTHS[sum(1 for i in linears if i < n_children)]


@pytest.fixture(scope="module")
def references():
    return {torch.float32: loop.reference(CFG, STEPS), torch.float64: loop.reference(WIDE, STEPS)}


@pytest.mark.parametrize("world_size, label", [(n, label) for n in LOOP_RUNS for label in LOOP_RUNS[n]])
def test_loop_train_equals_reference(runs, references, world_size, label):
    wide = "float64" in label
    expected = references[torch.float64 if wide else torch.float32]
    state_tol, grad_tol = (FP64, FP64) if wide else (FP32_STATE, FP32)
    results = [r["loop"][label] for r in runs[world_size]]
    for rank, got in enumerate(results):
        where = f"{label} rank {rank}"
        assert got["grads"].keys() == expected["grads"].keys(), where
        compare(expected["grads"], got["grads"], label=where + " grads", **grad_tol).raise_if_failed()
        compare(expected["state"], got["state"], label=where + " state", **state_tol).raise_if_failed()
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5 if not wide else 1e-12), where
    first = results[0]["state"]
    assert all(torch.equal(first[k], r["state"][k]) for r in results for k in first), label


def test_coordinates(runs):
    assert [r["coordinates"] for r in runs[2]] == [(0, 0, 1), (1, 0, 1)]
    # ("dp", "pp") = 2 x 2: ranks 0, 1 are one pipeline (dp 0), ranks 2, 3 the other
    assert [r["coordinates"] for r in runs[4]] == [(0, 0, 2), (1, 0, 2), (2, 1, 2), (3, 1, 2)]


MISUSE = {
    "unknown schedule": ("ValueError", "unknown pipeline schedule 'zb1p'"),
    "m < stages": ("ValueError", "n_microbatches=1 < 2 pipeline stages"),
    "virtual without interleaved": ("ValueError", "virtual_stages=2 needs schedule='interleaved'"),
    "not sequential": ("TypeError", "must be an nn.Sequential"),
    "too few children": ("ValueError", "has 1 children but the pipeline needs 2 chunks"),
    "uneven batch": ("ValueError", "a batch of 7 rows does not split into n_microbatches=2"),
    "rows differ": ("ValueError", "x has 8 rows but target 6"),
    "deadlocking schedule": ("ValueError", "deadlock"),
    "bad comm": ("ValueError", "comm must be 'ring' or 'torch'"),
    "forward outside": ("RuntimeError", "runs inside forward_backward"),
    "misspelled option": ("TypeError", "schedul"),
    "strategy comm": ("ValueError", "comm must be one of"),
    "torch-pp comm": ("TypeError", "comm"),
    "toy model": ("ValueError", "cfg.model='gpt'"),
    "loop rows": ("ValueError", "a batch of 7 rows does not split into n_microbatches=2"),
    "send to self": ("ValueError", "cannot send to itself"),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_raises_naming_the_problem(runs, case):
    kind, words = MISUSE[case]
    for rank in runs[2]:
        got = rank["misuse"][case]
        assert got is not None, f"{case}: nothing raised"
        assert got[0] == kind and words in got[1], (case, got)
