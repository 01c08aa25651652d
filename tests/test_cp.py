"""Context parallelism: ring_attention (labkit.strategies.cp) equal to one process's
scaled_dot_product_attention, forward and backward (dq, dk, dv), float64 within 1e-12, on 2 and 4
ranks, causal and not, both layouts, head_dim 5 (odd); its K/V on labkit.comm.p2p (traced bytes
equal to the formula); the attention work it counts equal to attention_flops; the loop strategy
"cp" (zigzag and contiguous) equal to loop.reference in float64. One launch per world size
(module-scoped); misuse in this process (a world of one) and in the 2-rank launch.
"""

import pytest
import torch
import torch.nn.functional as F

import labkit
from labkit import loop, strategies
from labkit.checks import compare
from labkit.strategies import cp as cpmod
from labkit.strategies.cp import attention_flops, imbalance, ring_attention

B, H, D = 2, 3, 5  # odd head_dim
T = {2: 24, 4: 24}  # whole sequence: zigzag on 4 ranks cuts it into 8 chunks of 3
CASES = [(layout, causal) for layout in cpmod.LAYOUTS for causal in (True, False)]
WIDE = loop.PRESETS["dp"].replace(dtype=torch.float64)
STEPS = 3
FP64 = dict(rtol=0, atol=1e-12)
STRATEGIES = {"cp": dict(strategy="cp"), "cp contiguous": dict(strategy="cp", layout="contiguous")}


def _one_case(layout, causal, n_total):
    """This rank's errors against SDPA (forward, dq, dk, dv), its counted FLOPs and traced window."""
    import torch.distributed as dist

    from labkit.observe import tracing

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(B, H, n_total, D, generator=g, dtype=torch.float64) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
    expected.backward(dout)
    mine = [cpmod.shard(t, 2, layout, rank, n).requires_grad_() for t in (q, k, v)]
    start = tracing.clock()
    with cpmod.count_attention_flops() as counted:
        out = ring_attention(*mine, causal=causal, layout=layout)
    middle = tracing.clock()
    out.backward(cpmod.shard(dout, 2, layout, rank, n))
    end = tracing.clock()
    errors = [(out - cpmod.shard(expected, 2, layout, rank, n)).abs().max().item()]
    errors += [
        (m.grad - cpmod.shard(w.grad, 2, layout, rank, n)).abs().max().item() for m, w in zip(mine, whole)
    ]
    return {"errors": errors, "flops": counted["flops"], "windows": (start, middle, end)}


def _misuse_in_rank():
    """Errors ring_attention and p2p raise inside a real group of 2."""
    from labkit.comm import p2p

    out = {}
    x = torch.zeros(1, 1, 3, 2, dtype=torch.float64)
    other = 1 - torch.distributed.get_rank()
    odd = WIDE.replace(seq_len=30)  # zigzag on 2 ranks: 4 chunks
    for label, call in {
        "zigzag odd piece": lambda: ring_attention(x, x, x, causal=True, layout="zigzag"),
        "sendrecv self": lambda: p2p.sendrecv(x, x.clone(), dst=torch.distributed.get_rank(), src=other),
        "sendrecv same buffer": lambda: p2p.sendrecv(x, x, dst=other, src=other),
        "send out of range": lambda: p2p.send(x, dst=5),
        "cp on rows that do not cut": lambda: strategies.build("cp", loop.build_model(odd), odd),
    }.items():
        try:
            call()
            out[label] = None
        except (ValueError, TypeError) as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def _bf16_errors(layout, causal):
    """Max error against float64 SDPA of ring_attention in bf16 and of SDPA in bf16 (forward and
    dq, dk, dv), on this rank's piece."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(2, 4, 64, 16, generator=g, dtype=torch.float64) * 2 for _ in range(4))
    runs = {}
    for label, dtype in (("exact", torch.float64), ("sdpa", torch.bfloat16)):
        whole = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*whole, is_causal=causal)
        out.backward(dout.to(dtype))
        runs[label] = [cpmod.shard(t.double(), 2, layout, rank, n) for t in (out, *(w.grad for w in whole))]
    mine = [cpmod.shard(t, 2, layout, rank, n).bfloat16().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, causal=causal, layout=layout)
    out.backward(cpmod.shard(dout, 2, layout, rank, n).bfloat16())
    runs["ring"] = [t.double() for t in (out, *(m.grad for m in mine))]
    assert out.dtype == torch.bfloat16 and all(m.grad.dtype == torch.bfloat16 for m in mine)
    return {
        label: [(a - e).abs().max().item() for a, e in zip(runs[label], runs["exact"])]
        for label in ("sdpa", "ring")
    }


def _disagreements():
    """ring_attention called with different arguments on the two ranks: every rank raises."""
    import torch.distributed as dist

    rank = dist.get_rank()
    x = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    y = torch.zeros(1, 1, 4 if rank == 0 else 8, 2, dtype=torch.float64)
    out = {}
    for label, call in {
        "causal": lambda: ring_attention(x, x, x, causal=rank == 0, layout="zigzag"),
        "layout": lambda: ring_attention(x, x, x, causal=True, layout=cpmod.LAYOUTS[rank]),
        "length": lambda: ring_attention(y, y, y, causal=True, layout="zigzag"),
        "dtype": lambda: ring_attention(*(x.float() if rank else x,) * 3, causal=True, layout="zigzag"),
    }.items():
        try:
            call()
            out[label] = None
        except ValueError as exc:
            out[label] = str(exc)
    model = loop.build_model(WIDE)
    s = strategies.build("cp", model, WIDE)
    idx = torch.zeros(2, WIDE.seq_len, dtype=torch.long)
    for label, call in {
        "mean loss": lambda: s(idx, idx),
        "generate": lambda: model.generate(idx[:, :8], 2),
    }.items():
        try:
            call()
            out[label] = None
        except (ValueError, NotImplementedError) as exc:
            out[label] = str(exc)
    out["sum loss"] = s(idx, idx, reduction="sum")[1] is not None
    return out


def _rank(with_strategies):
    import torch.distributed as dist

    n = dist.get_world_size()
    out = {"cases": {case: _one_case(*case, T[n]) for case in CASES}}
    out["bf16"] = {case: _bf16_errors(*case) for case in CASES}
    if n == 4:  # ("dp", "cp") = 2 x 2: the rows split over dp, each row's pieces over cp
        out["dp x cp"] = loop.train("cp", WIDE, STEPS, cp=2, spans=False)
    if with_strategies:
        out["misuse"] = _misuse_in_rank()
        out["disagree"] = _disagreements()
        out["train"] = dict(
            zip(STRATEGIES, loop.sweep(list(STRATEGIES.values()), cfg=WIDE, steps=STEPS, spans=False))
        )
    return out


@pytest.fixture(scope="module")
def two():
    return labkit.run(_rank, True, world_size=2, timeout=600)


@pytest.fixture(scope="module")
def four():
    return labkit.run(_rank, False, world_size=4, timeout=600)


def _sendrecv_bytes(trace, lo, hi):
    return sum(
        e["nbytes"]
        for e in trace["events"]
        if e["kind"] == "collective" and e["op"] == "p2p_sendrecv" and lo <= e["start"] <= hi
    )


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_one_process(world, request):
    results = request.getfixturevalue({2: "two", 4: "four"}[world])
    for rank, got in enumerate(results):
        for (layout, causal), case in got["cases"].items():
            assert max(case["errors"]) <= 1e-12, (world, rank, layout, causal, case["errors"])


@pytest.mark.parametrize("world", [2, 4])
def test_counted_work_and_ring_bytes(world, request):
    results = request.getfixturevalue({2: "two", 4: "four"}[world])
    piece = B * H * (T[world] // world) * D * 8  # one of K, V, dK, dV on one rank, float64
    for layout, causal in CASES:
        formula = attention_flops(T[world], world, layout=layout, causal=causal, batch=B, heads=H, head_dim=D)
        assert [r["cases"][(layout, causal)]["flops"] for r in results] == formula
        for rank, trace in enumerate(results.traces):
            start, middle, end = results[rank]["cases"][(layout, causal)]["windows"]
            # forward: (n-1) messages of K and V; backward: (n-1) of K, V, dK, dV, then dK, dV home
            assert _sendrecv_bytes(trace, start, middle) == (world - 1) * 2 * piece
            assert _sendrecv_bytes(trace, middle, end) == ((world - 1) * 4 + 2) * piece


def test_work_formula():
    for n in (2, 4, 8):
        contiguous = attention_flops(16 * n, n, layout="contiguous", causal=True)
        assert imbalance(contiguous) == pytest.approx(2 * n / (n + 1))
        assert imbalance(attention_flops(16 * n, n, layout="zigzag", causal=True)) == 1.0
        assert sum(contiguous) > sum(
            attention_flops(16 * n, n, layout="zigzag", causal=True)
        )  # bigger diagonals
    with pytest.raises(ValueError, match="does not split into 8 equal chunks"):
        attention_flops(12, 4, layout="zigzag", causal=True)


def test_cp_strategy_equals_one_process(two):
    expected = loop.reference(WIDE, STEPS)
    for label in STRATEGIES:
        for rank, got in enumerate(two):
            run = got["train"][label]
            where = f"{label} rank {rank}"
            compare(expected["grads"], run["grads"], label=where, rtol=0, atol=1e-12).raise_if_failed()
            compare(expected["state"], run["state"], label=where, rtol=0, atol=1e-12).raise_if_failed()
            assert run["losses"] == pytest.approx(expected["losses"], rel=1e-12, abs=0), where


def test_cp_with_data_parallelism_equals_one_process(four):
    expected = loop.reference(WIDE, STEPS)
    for rank, got in enumerate(four):
        run = got["dp x cp"]
        compare(expected["grads"], run["grads"], label=f"dp x cp rank {rank}", **FP64).raise_if_failed()
        compare(expected["state"], run["state"], label=f"dp x cp rank {rank}", **FP64).raise_if_failed()


def test_misuse_in_a_group(two):
    for got in two:
        m = got["misuse"]
        assert "3 positions, which do not split into the 2 equal chunks" in m["zigzag odd piece"]
        assert "cannot send to itself" in m["sendrecv self"]
        assert "would overwrite" in m["sendrecv same buffer"]
        assert "global rank 5 is not in the group" in m["send out of range"]
        assert (
            "cp: a sequence of 30 positions does not split into 4 equal chunks"
            in m["cp on rows that do not cut"]
        )


def test_double_backward_raises():
    q = torch.randn(1, 1, 4, 2, dtype=torch.float64, requires_grad=True)
    out = ring_attention(q, q, q, causal=True, layout="zigzag")
    (grad,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|does not require grad"):
        grad.sum().backward()


def test_one_rank_is_sdpa_and_misuse_raises():
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, 8, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    for layout in cpmod.LAYOUTS:
        got = ring_attention(q, k, v, causal=True, layout=layout)
        assert (got - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max() <= 1e-14
    bad = {
        "same shape": lambda: ring_attention(q, k[:, :, :4], v, causal=True, layout="zigzag"),
        "layout must be one of": lambda: ring_attention(q, k, v, causal=True, layout="zig-zag"),
        "causal must be True or False": lambda: ring_attention(q, k, v, causal="yes", layout="zigzag"),
        "head_dim\\), got shape": lambda: ring_attention(q[0], k[0], v[0], causal=True, layout="zigzag"),
        "floating point": lambda: ring_attention(
            *(t.long() for t in (q, k, v)), causal=True, layout="zigzag"
        ),
        "do not split": lambda: ring_attention(
            q[:, :, :7], k[:, :, :7], v[:, :, :7], causal=False, layout="zigzag"
        ),
    }
    for message, call in bad.items():
        with pytest.raises((ValueError, TypeError), match=message):
            call()
    with pytest.raises(TypeError, match="keyword"):
        ring_attention(q, k, v, True, layout="zigzag")  # causal is keyword-only


def test_ring_schedule_is_the_work_counted():
    for n in (2, 4):
        for layout, causal in CASES:
            steps = cpmod.ring_schedule(n, layout=layout, causal=causal)
            assert [row[r]["kv_from"] for row in steps for r in [0]] == [(0 - t) % n for t in range(n)]
            blocks = [sum(len(row[r]["blocks"]) for row in steps) for r in range(n)]
            per = cpmod.block_flops(1, 1, 16 // cpmod.n_chunks(layout, n), 1)
            assert [b * per for b in blocks] == attention_flops(16, n, layout=layout, causal=causal)
    assert cpmod.ring_schedule(2, layout="zigzag", causal=True)[1][0] == {
        "kv_from": 1,
        "blocks": [(3, 1, "full"), (3, 2, "full")],  # chunk 0 sees neither 1 nor 2
    }


def test_layout_round_trip():
    x = torch.arange(2 * 16).view(2, 16)
    for layout in cpmod.LAYOUTS:
        pieces = [cpmod.shard(x, 1, layout, r, 4) for r in range(4)]
        assert torch.equal(cpmod.unshard(pieces, 1, layout), x)
    assert cpmod.positions(16, "zigzag", 1, 4).tolist() == [2, 3, 12, 13]
    assert cpmod.chunk_ids("zigzag", 0, 4) == [0, 7]


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_ring_attention_within_twice_sdpa(world, request):
    """The statistics and merges in fp32: ring attention's bf16 error (forward, dq, dk, dv) at most
    twice SDPA's in bf16, on every rank, both layouts, causal or not (16-bit merges: 4-8x)."""
    results = request.getfixturevalue({2: "two", 4: "four"}[world])
    for rank, got in enumerate(results):
        for case, errors in got["bf16"].items():
            for what, ring, sdpa in zip(("out", "dq", "dk", "dv"), errors["ring"], errors["sdpa"]):
                assert ring <= 2 * sdpa, (world, rank, case, what, ring, sdpa)


DISAGREE = {
    "causal": "disagree on causal (rank 0: True, rank 1: False)",
    "layout": "disagree on layout (rank 0: contiguous, rank 1: zigzag)",
    "length": "disagree on the pieces' shape (batch, heads, T_local, head_dim) (rank 0: (1, 1, 4, 2), rank 1: (1, 1, 8, 2))",
    "dtype": "disagree on dtype (rank 0: torch.float64, rank 1: torch.float32)",
    "mean loss": "reduction='mean' loss would be the piece's, not one process's",
    "generate": "generate() on a context-parallel model",
}


@pytest.mark.parametrize("case", list(DISAGREE))
def test_ranks_that_disagree_all_raise_naming_it(two, case):
    for got in two:
        assert got["disagree"][case] is not None, f"{case}: nothing raised"
        assert DISAGREE[case] in got["disagree"][case], got["disagree"][case]
        assert got["disagree"]["sum loss"]
