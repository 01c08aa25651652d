"""seq_lab's helpers: the measurements' rank functions follow the lab's formulas at sizes the lab
does not use (2 ranks), the hand-written blocks and rings equal one process, the at-scale search
equals its closed form, bad inputs raise, and the figure draws what it is given."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import labkit  # noqa: E402
from labkit.costmodel import GPT_13B, GPT_175B  # noqa: E402
from labkit.labs import seq_checks, seq_lab  # noqa: E402
from labkit.strategies.cp import attention_flops, block_flops, n_chunks, ring_schedule  # noqa: E402

SMALL_SP = dict(batch=3, d=8, hidden=12)
SMALL_ATTN = dict(batch=2, heads=1, head_dim=5, seq=16)


@pytest.fixture(scope="module")
def sp_run():
    return labkit.run(
        seq_lab.measure_sp_cp, [8, 12], size=SMALL_SP, world_size=2, backend="gloo", timeout=300
    )


def test_sp_cp_memory_follows_the_formulas(sp_run):
    B, d, H = SMALL_SP["batch"], SMALL_SP["d"], SMALL_SP["hidden"]
    for res in sp_run:
        for T in (8, 12):
            assert res["norm_saved"]["TP", T] == 8 * B * T * (d + 2)
            assert res["norm_saved"]["SP", T] == 8 * B * T // 2 * (d + 2)
            assert res["block_saved"]["one process", T] == 8 * B * T * (2 * d + 2 + 2 * H)
            assert res["block_saved"]["CP", T] * 2 == res["block_saved"]["one process", T]


def test_sp_sends_what_tp_sends(sp_run):
    B, d = SMALL_SP["batch"], SMALL_SP["d"]
    for rank, res in enumerate(sp_run):
        for T in (8, 12):
            S = B * T * d * 8
            got = {}
            for mode in ("TP", "SP"):
                ops = seq_lab.sent_in(sp_run.traces[rank], res["windows"][mode, T])
                calls = sum(c for c, _, _ in ops.values())
                got[mode] = sum(s for _, _, s in ops.values()) - seq_checks.HEADER_BYTES * calls
                assert set(ops) == (
                    {"ring_all_reduce"} if mode == "TP" else {"ring_all_gather", "ring_reduce_scatter"}
                )
            assert got["TP"] == got["SP"] == 2 * S  # n = 2: 2 x 2(n-1)/n S = 4 x (n-1)/n S


def _blocks_rank(sp):
    group, rank = dist.group.WORLD, dist.get_rank()
    full = seq_lab.make_block(6, 10, seed=2)
    x = seq_lab.sp_input(2, 4, 6, seed=3)
    hand = seq_lab.HandBlock(full, group, sp)
    xin = (torch.chunk(x, 2, 1)[rank] if sp else x).clone().requires_grad_()
    out = hand(xin)
    out.square().sum().backward()
    hand.sync_replicated_grads()
    return {
        "out": out.detach(),
        "x_grad": xin.grad,
        "ln": hand.ln.weight.grad,
        "b2": hand.b2.grad,
        "w1": hand.w1.grad,
    }


@pytest.mark.parametrize("sp", [False, True])
def test_hand_blocks_equal_one_process(sp):
    res = labkit.run(_blocks_rank, sp, world_size=2, backend="gloo", timeout=300)
    full = seq_lab.make_block(6, 10, seed=2)
    x = seq_lab.sp_input(2, 4, 6, seed=3).requires_grad_()
    out = full(x)
    out.square().sum().backward()
    for rank, got in enumerate(res):
        piece = (lambda t: torch.chunk(t, 2, 1)[rank]) if sp else (lambda t: t)
        torch.testing.assert_close(got["out"], piece(out.detach()), rtol=0, atol=1e-12)
        torch.testing.assert_close(got["x_grad"], piece(x.grad), rtol=0, atol=1e-12)
        torch.testing.assert_close(got["ln"], full.ln.weight.grad, rtol=0, atol=1e-12)
        torch.testing.assert_close(got["b2"], full.fc2.bias.grad, rtol=0, atol=1e-12)
        torch.testing.assert_close(
            got["w1"], torch.chunk(full.fc1.weight.grad, 2, 0)[rank], rtol=0, atol=1e-12
        )


def test_ring_measurements_follow_the_formulas():
    n, (B, H, T, D) = 2, (SMALL_ATTN[k] for k in ("batch", "heads", "seq", "head_dim"))
    res = labkit.run(seq_lab.measure_ring, size=SMALL_ATTN, world_size=n, backend="gloo", timeout=300)
    q, k, v = seq_lab.attn_inputs(0, SMALL_ATTN)
    want = seq_lab.one_process(q, k, v, causal=True)
    for rank, got in enumerate(res):
        torch.testing.assert_close(got["ring"], torch.chunk(want, n, 2)[rank], rtol=0, atol=1e-12)
        sends = seq_lab.sends_in(res.traces[rank], got["ring_window"])
        assert sum(e["nbytes"] for e in sends) == 2 * (n - 1) * B * H * T * D * 8 // n
        for layout in ("contiguous", "zigzag"):
            r = got[layout]
            torch.testing.assert_close(r["out"], want[..., r["positions"], :], rtol=0, atol=1e-12)
            schedule = ring_schedule(n, layout=layout, causal=True)
            assert [s["src"] for s in r["steps"]] == [schedule[t][rank]["kv_from"] for t in range(n)]
            block = block_flops(B, H, T // n_chunks(layout, n), D)
            assert [s["flops"] for s in r["steps"]] == [
                block * len(schedule[t][rank]["blocks"]) for t in range(n)
            ], (layout, rank)
            flops = sum(s["flops"] for s in r["steps"])
            want_flops = attention_flops(T, n, layout=layout, causal=True, batch=B, heads=H, head_dim=D)
            assert flops == want_flops[rank] == got["strategy", layout]["flops"], (layout, rank)
            torch.testing.assert_close(got["strategy", layout]["out"], r["out"], rtol=0, atol=1e-12)
    fig = seq_lab.plot_ring_steps(res)
    assert [ax.get_title() for ax in fig.axes[:2]] == [
        "causal ring, contiguous: FLOPs per step",
        "causal ring, zigzag: FLOPs per step",
    ]
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "skip" in texts and "K/V 0" in texts  # rank 0 skips rank 1's block in the contiguous layout


@pytest.mark.parametrize("model", [GPT_13B, GPT_175B])
@pytest.mark.parametrize("tp, cp, sp", [(1, 1, False), (8, 1, False), (8, 1, True), (4, 8, True)])
def test_longest_sequence_is_the_closed_form(model, tp, cp, sp):
    states, budget = 5e9, 80e9
    share = ((10 + 24 / tp) / 34 if not sp else 1 / tp) / cp
    closed = int((budget - states) / (34 * model.layers * model.d_model * share) // 1024) * 1024
    assert seq_lab.longest_sequence(model, budget, states, tp, cp, sp) == closed
    assert seq_lab.activation_share(tp, cp, sp) == pytest.approx(share)


def test_longest_sequence_is_zero_when_nothing_fits():
    assert seq_lab.longest_sequence(GPT_175B, 80e9, 90e9, 8, 1, True) == 0
    assert seq_lab.longest_sequence(GPT_175B, 80e9, 79.99e9, 1, 1, False) == 0


def test_bad_inputs_raise():
    q = torch.zeros(1, 1, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="diagonal block"):
        seq_lab.block_attention(q, q[..., :3, :], q[..., :3, :], causal=True)
    with pytest.raises(ValueError, match="not both"):
        seq_lab.block_attention(q, q, q, causal=True, mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="8 equal chunks"):
        seq_lab.zigzag_positions(0, 4, 12)
    with pytest.raises(ValueError, match="does not split"):
        seq_lab.contiguous_positions(0, 4, 10)


def test_merge_and_positions_references():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=torch.float64, generator=g) for _ in range(3))
    a, b = (
        seq_lab.block_attention(q, k[..., :2, :], v[..., :2, :]),
        seq_lab.block_attention(q, k[..., 2:, :], v[..., 2:, :]),
    )
    o, lse = seq_lab.merge(*a, *b)
    want_o, want_lse = seq_lab.block_attention(q, k, v)
    torch.testing.assert_close(o, want_o, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-14)
    assert seq_lab.zigzag_positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    assert seq_lab.zigzag_positions(0, 2, 8).tolist() == [0, 1, 6, 7]
    assert seq_lab.causal_pairs([2, 3], [0, 3]) == 3


# ---------------------------------------------------------------- Ulysses
SMALL_ULYSSES = dict(batch=2, heads=4, head_dim=3, seq=8)


def test_ulysses_and_ring_bytes_follow_the_lab_formulas():
    """measure_ulysses at a size the lab does not use: both equal one process, and what each rank
    sent is the notebook's formulas (Ulysses 4(n-1)/n L each way, layer_bytes' payload; the ring
    2(n-1) L forward, (4(n-1)+2) L backward)."""
    from labkit.comm.all_to_all import wire_bytes
    from labkit.strategies.ulysses import layer_bytes

    res = labkit.run(seq_lab.measure_ulysses, size=SMALL_ULYSSES, world_size=4, backend="gloo", timeout=300)
    B, H, T, D = (SMALL_ULYSSES[k] for k in ("batch", "heads", "seq", "head_dim"))
    for rank, got in enumerate(res):
        assert set(got) == {(name, n) for name in ("ulysses", "ring") for n in (2, 4)}
        for (name, n), m in got.items():
            assert m["error"] <= 1e-12, (rank, name, n)
            assert m["rank"] == (rank // 2 if n == 2 else rank)
            L = B * H * (T // n) * D * 8
            for direction in ("forward", "backward"):
                if name == "ulysses":
                    events = seq_lab.sent_by(res.traces[rank], m[direction], ("all_to_all_single",))
                    assert len(events) == 4
                    sent = sum(e["sent"] - wire_bytes([1] * n, m["rank"], 0) for e in events)
                    assert sent == 4 * (n - 1) * L // n == layer_bytes(B, T, H * D, n, 8)["payload"]
                else:
                    events = seq_lab.sent_by(res.traces[rank], m[direction], ("p2p_sendrecv",))
                    sent = sum(e["sent"] for e in events)
                    assert sent == (2 * (n - 1) * L if direction == "forward" else (4 * (n - 1) + 2) * L)


def test_ulysses_layout_names_what_each_rank_holds():
    res = labkit.run(seq_lab.ulysses_layout, heads=6, seq=9, world_size=3, backend="gloo", timeout=300)
    for rank, got in enumerate(res):
        assert got["before"] == {
            "shape": (1, 6, 3, 1),
            "heads": list(range(6)),
            "positions": [3 * rank + i for i in range(3)],
        }
        assert got["after"] == {
            "shape": (1, 2, 9, 1),
            "heads": [2 * rank, 2 * rank + 1],
            "positions": list(range(9)),
        }


def test_ulysses_references_are_the_strategys():
    from labkit.strategies import ulysses

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 3, generator=g, dtype=torch.float64) for _ in range(3))
    # one process (no group): the pair is the identity and the attention one process's
    assert torch.equal(seq_lab.heads_to_seq(seq_lab.seq_to_heads(q, None), None), q)
    got = seq_lab.ulysses_attention(q, k, v, True, None)
    assert torch.allclose(got, seq_lab.one_process(q, k, v, True), rtol=0, atol=1e-14)
    assert seq_lab.seq_to_heads.__doc__ and "labkit.strategies.ulysses" in seq_lab.seq_to_heads.__doc__
    assert ulysses.seq_to_heads is seq_lab.ulysses_seq_to_heads
