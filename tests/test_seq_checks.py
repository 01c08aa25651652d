"""seq_lab's checks: the references pass, an unwritten exercise is a TODO, and each learner mistake
fails the check of its own exercise, first, with the hint that names it (SP's pair and the ring on
4 ranks, the merge and the zigzag in one process; Ulysses' all-to-all pair on 4 ranks, 14 mistakes
written as rewrites of the notebook's solution). A deadlocking ring fails within its wait_s."""

import time

import pytest
import torch
import torch.distributed as dist

from labkit.comm.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from labkit.labs import seq_checks as C, seq_lab as S


def not_written(*args, **kwargs):
    raise NotImplementedError


# ---------------------------------------------------------------- 1. SP's pair
def _seq_first(x):
    return x.transpose(0, 1).contiguous()


def _gather(x, group, dim=1):
    n = dist.get_world_size(group)
    xt = x.movedim(dim, 0).contiguous()
    out = xt.new_empty((n * xt.shape[0], *xt.shape[1:]))
    ring_all_gather(out, xt, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x, group, op="sum"):
    n = dist.get_world_size(group)
    xt = _seq_first(x)
    out = xt.new_empty((xt.shape[0] // n, *xt.shape[1:]))
    ring_reduce_scatter(out, xt, op=op, group=group)
    return out.transpose(0, 1).contiguous()


def _pair(forward, backward):
    """An autograd Function's apply from two functions of (tensor, group)."""

    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.group), None

    return Pair.apply


def _own_piece(grad, group):
    return torch.chunk(grad, dist.get_world_size(group), 1)[dist.get_rank(group)].contiguous()


def _all_reduce_piece(grad, group):
    out = grad.contiguous().clone()
    ring_all_reduce(out, op="sum", group=group)
    return torch.chunk(out, dist.get_world_size(group), 1)[dist.get_rank(group)].contiguous()


def _all_reduce_global_piece(grad, group):
    out = grad.contiguous().clone()
    ring_all_reduce(out, op="sum", group=group)
    return torch.chunk(out, dist.get_world_size(group), 1)[dist.get_rank()].contiguous()


def _all_reduce_whole(x, group):
    out = x.contiguous().clone()
    ring_all_reduce(out, op="sum", group=group)
    return out


G, R = S.gather_seq, S.scatter_seq
SP_MISTAKES = [
    (_pair(lambda x, g: _gather(x, g, dim=0), lambda d, g: d), R, "gathered along dim 0, the batch"),
    (_pair(lambda x, g: _gather(x, None), _reduce_scatter), R, "gathered over all 4 ranks"),
    (_pair(_gather, _own_piece), R, "must SUM the gradient over the group"),
    (_pair(_gather, lambda d, g: _reduce_scatter(d, g, "avg")), R, "an average: gather's backward"),
    (_pair(_gather, _all_reduce_piece), R, "reduce-scatter replaced by all-reduce"),
    (_pair(_gather, _all_reduce_global_piece), R, "dist.get_rank\\(group\\)"),
    (G, _pair(_own_piece, _gather), "must SUM the partial sums over the group"),
    (G, _pair(_all_reduce_whole, lambda d, g: d), "keeps this rank's piece of the sum"),
    (G, _pair(lambda x, g: _reduce_scatter(x, g, "avg"), _gather), "an average: the row-parallel outputs"),
    (G, _pair(_reduce_scatter, lambda d, g: d), "scatter's backward returns the whole"),
]


@pytest.mark.parametrize("gather, scatter, hint", SP_MISTAKES)
def test_sp_pair_mistakes_are_named(gather, scatter, hint):
    with pytest.raises(AssertionError, match=hint):
        C.check_sp_pair(gather, scatter)


# ---------------------------------------------------------------- 2. the merge
def merge_no_shift(o1, l1, o2, l2):
    w1, w2 = torch.exp(l1), torch.exp(l2)
    return (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1), torch.log(w1 + w2)


def merge_averaged(o1, l1, o2, l2):
    return (o1 + o2) / 2, torch.logaddexp(l1, l2)


def merge_lse_max(o1, l1, o2, l2):
    return S.merge(o1, l1, o2, l2)[0], torch.maximum(l1, l2)


def merge_lse_sum(o1, l1, o2, l2):
    return S.merge(o1, l1, o2, l2)[0], l1 + l2


def merge_swapped(o1, l1, o2, l2):
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l2 - lse).unsqueeze(-1) + o2 * torch.exp(l1 - lse).unsqueeze(-1), lse


def merge_one_weighted(o1, l1, o2, l2):
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2, lse


def merge_not_unsqueezed(o1, l1, o2, l2):
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse) + o2 * torch.exp(l2 - lse), lse


def merge_mean_shift(o1, l1, o2, l2):
    m = (l1 + l2) / 2  # finite scores: right; an empty partial: -inf - (-inf)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1), m + torch.log(w1 + w2)


@pytest.mark.parametrize(
    "merge, hint",
    [
        (merge_no_shift, "exp\\(\\) of a score in the thousands overflows"),
        (merge_averaged, "the partials averaged"),
        (merge_lse_max, "not the max"),
        (merge_lse_sum, "adds the exponentials, not the logs"),
        (merge_swapped, "the weights swapped"),
        (merge_one_weighted, "weight BOTH partials"),
        (merge_not_unsqueezed, "unsqueeze\\(-1\\)"),
        (merge_mean_shift, "an empty partial has weight"),
    ],
)
def test_merge_mistakes_are_named(merge, hint):
    with pytest.raises(AssertionError, match=hint):
        C.check_merge(merge)


# ---------------------------------------------------------------- 3. the ring
def _ring(
    causal_kinds=None,
    steps=None,
    combine="merge",
    same_buffer=False,
    blocking_recv_first=False,
    group_ranks=False,
):
    """A contiguous ring with one mistake; causal_kinds(r, s, j, causal) -> 'skip' | 'diag' | 'full'."""

    def kind_right(r, s, j, causal):
        if not causal:
            return "full"
        return "diag" if j == r else "full" if j < r else "skip"

    kinds = causal_kinds or kind_right

    def ring(q, k, v, causal, group):
        r, n = dist.get_rank(group), dist.get_world_size(group)
        if group_ranks:
            nxt, prv = (r + 1) % n, (r - 1) % n  # group ranks where isend wants global ones
        else:
            nxt, prv = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
        kv = torch.stack([k, v]).contiguous()
        parts = []
        for s in range(steps or n):
            j = (r - s) % n
            kind = kinds(r, s, j, causal)
            if kind != "skip":
                parts.append(S.block_attention(q, kv[0], kv[1], causal=kind == "diag"))
            if s < n - 1:
                if blocking_recv_first:
                    incoming = torch.empty_like(kv)
                    dist.recv(incoming, src=prv, group=group)
                    dist.send(kv, dst=nxt, group=group)
                    kv = incoming
                elif same_buffer:
                    reqs = [dist.isend(kv, dst=nxt, group=group), dist.irecv(kv, src=prv, group=group)]
                    for req in reqs:
                        req.wait()
                else:
                    incoming = torch.empty_like(kv)
                    reqs = [dist.isend(kv, dst=nxt, group=group), dist.irecv(incoming, src=prv, group=group)]
                    for req in reqs:
                        req.wait()
                    kv = incoming
        if combine == "average":
            return sum(p[0] for p in parts) / len(parts)
        o, lse = parts[0]
        for p in parts[1:]:
            o, lse = S.merge(o, lse, *p)
        return o

    return ring


def _kinds(diag="diag", past="full", future="skip", noncausal_diag="full", label=None):
    def kinds(r, s, j, causal):
        j = label(r, s, j) if label else j
        if not causal:
            return noncausal_diag if j == r else "full"
        return diag if j == r else past if j < r else future

    return kinds


RING_MISTAKES = [
    (
        _ring(_kinds(diag="full")),
        "the diagonal block \\(this rank's own K/V, step 0\\) needs the causal mask",
    ),
    (_ring(_kinds(past="diag")), "the causal mask belongs to the diagonal block only"),
    (_ring(_kinds(future="full")), "all in the future: skip it"),
    (_ring(_kinds(future="diag")), "the causal mask applied to the wrong K/V block"),
    (_ring(_kinds(label=lambda r, s, j: (r + s) % 4)), "not \\(r \\+ s\\)'s"),
    (_ring(steps=3), "n steps: this rank's own block, then n - 1"),
    (_ring(combine="average"), "merge them with their log-sum-exp"),
    (_ring(_kinds(noncausal_diag="diag")), "causal=False: every block is seen whole"),
    (_ring(same_buffer=True), "a K/V buffer overwritten before it is sent on"),
    (_ring(group_ranks=True), "isend / irecv take GLOBAL ranks"),
]


@pytest.mark.parametrize("ring, hint", RING_MISTAKES)
def test_ring_mistakes_are_named(ring, hint):
    with pytest.raises(AssertionError, match=hint):
        C.check_ring(ring, wait_s=10)


def test_a_deadlocked_ring_fails_fast_with_a_hint():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="the ring deadlocked"):
        C.check_ring(_ring(blocking_recv_first=True), wait_s=3)
    assert time.monotonic() - start < 120  # the wait's deadline, not labkit.run's 180 s


def test_the_simulated_mistakes_differ_from_the_right_ring():
    """Every mistake the ring check names changes some rank's output (else its hint is dead)."""
    q, k, v = S.attn_inputs(3)
    for causal in (True, False):
        right = C._simulate(q, k, v, 4, causal)
        assert all(
            torch.allclose(a, b) for a, b in zip(right, torch.chunk(S.one_process(q, k, v, causal), 4, 2))
        )
    for mistake in C.RING_HINTS:
        causal = mistake != "diag masked, not causal"
        right, wrong = C._simulate(q, k, v, 4, causal), C._simulate(q, k, v, 4, causal, mistake)
        assert any(w is None or not torch.allclose(a, w) for a, w in zip(right, wrong)), mistake


# ---------------------------------------------------------------- 4. zigzag
def _chunks_of(rank, n, T, ids, c=None):
    c = c or T // (2 * n)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in ids])


ZIGZAG_MISTAKES = [
    (lambda r, n, T: _chunks_of(r, n, T, (2 * n - 1 - r, r)), S.causal_pairs, "the zigzag order reversed"),
    (S.contiguous_positions, S.causal_pairs, "that is the contiguous layout"),
    (lambda r, n, T: _chunks_of(r, n, T, (r, 2 * n - r)), S.causal_pairs, "the partner chunk is 2n-1-r"),
    (lambda r, n, T: _chunks_of(r, n, T, (r, n - 1 - r), T // n), S.causal_pairs, "2n = 8 chunks"),
    (
        lambda r, n, T: torch.cat(
            [torch.arange(i * (T // (2 * n)), (i + 1) * (T // (2 * n)) + 1) for i in (r, 2 * n - 1 - r)]
        ),
        S.causal_pairs,
        "no off-by-one",
    ),
    (S.zigzag_positions, lambda q, k: int((k[None, :] < q[:, None]).sum()), "the diagonal counts"),
    (S.zigzag_positions, lambda q, k: int((k[None, :] >= q[:, None]).sum()), "at or BEFORE it"),
]


@pytest.mark.parametrize("positions, pairs, hint", ZIGZAG_MISTAKES)
def test_zigzag_mistakes_are_named(positions, pairs, hint):
    with pytest.raises(AssertionError, match=hint):
        C.check_zigzag(positions, pairs)


# ---------------------------------------------------------------- the references, the TODOs
def test_references_pass():
    C.check_sp_pair(S.gather_seq, S.scatter_seq)
    C.check_merge(S.merge)
    C.check_ring(S.ring_attention)
    C.check_zigzag(S.zigzag_positions, S.causal_pairs)
    C.check_ulysses(S.seq_to_heads, S.heads_to_seq)


def test_not_written_says_so():
    for check, args in (
        (C.check_sp_pair, (not_written, not_written)),
        (C.check_merge, (not_written,)),
        (C.check_ring, (not_written,)),
        (C.check_zigzag, (not_written, not_written)),
        (C.check_ulysses, (not_written, not_written)),
        (C.check_ulysses, (S.seq_to_heads, not_written)),
    ):
        with pytest.raises(NotImplementedError):
            check(*args)


# ---------------------------------------------------------------- 5. Ulysses' all-to-all pair
def _to_heads(
    x,
    group,
    dim=1,
    interleave=False,
    order=1,
    world_n=False,
    world_group=False,
    td_swap=False,
    detach=False,
    refuse=True,
    gather=False,
):
    """The notebook's solution of my_seq_to_heads, with one mistake switched on."""
    from labkit.comm.all_to_all import all_to_all_autograd, all_to_all_single

    n = dist.get_world_size() if world_n else dist.get_world_size(group)
    B, H, Tl, D = x.shape
    if refuse and H % n:
        raise ValueError(f"{H} heads do not split over {n} ranks")
    if gather:  # every rank's whole piece, then keep this rank's heads: right values, n x the bytes
        r = dist.get_rank(group)
        whole = S.gather_seq(x.transpose(1, 2), group).transpose(1, 2)  # (B, H, T, D)
        return torch.chunk(whole, n, 1)[r]
    if interleave:
        send = x.reshape(B, H // n, n, Tl, D).movedim(2, 0).contiguous()
    else:
        send = torch.stack(torch.chunk(x, n, dim=dim))
    if detach:
        got = torch.empty_like(send)
        all_to_all_single(got, send, group=group)
    else:
        got = all_to_all_autograd(send, group=None if world_group else group)
    pieces = got.unbind(0)[::order]
    if td_swap:
        return torch.cat([p.transpose(2, 3).reshape(p.shape) for p in pieces], 2)
    return torch.cat(pieces, dim=2)


def _to_seq(x, group, dim=2, back=True, local=False, view=False):
    """The notebook's solution of my_heads_to_seq, with one mistake switched on."""
    from labkit.comm.all_to_all import all_to_all_autograd

    n = dist.get_world_size(group)
    if not back:
        return x  # one all-to-all only: the output stays (B, H/n, T, D)
    if local:
        return torch.chunk(x, n, 2)[dist.get_rank(group)]
    if view:
        send = x.reshape(x.shape[0], x.shape[1], n, -1, x.shape[3]).permute(2, 0, 1, 3, 4)
        got = all_to_all_autograd(send.view(n, -1), group=group)  # a permuted tensor viewed
        return got.view(n, *send.shape[1:]).transpose(0, 1).reshape(x.shape[0], -1, *send.shape[3:])
    send = torch.stack(torch.chunk(x, n, dim=dim))
    return torch.cat(all_to_all_autograd(send, group=group).unbind(0), dim=1)


def _heads(**mistake):
    return lambda x, group: _to_heads(x, group, **mistake)


def _seq(**mistake):
    return lambda x, group: _to_seq(x, group, **mistake)


ULYSSES_MISTAKES = [
    (_heads(dim=2), _to_seq, "seq_to_heads", "seq_to_heads splits the HEADS"),
    (_heads(interleave=True), _to_seq, "seq_to_heads", "heads interleaved"),
    (_heads(order=-1), _to_seq, "seq_to_heads", "the sequence pieces in the wrong rank order"),
    (_heads(world_group=True), _to_seq, "seq_to_heads", "the all-to-all ran over the world"),
    (_heads(world_n=True), _to_seq, "seq_to_heads", r"dist.get_world_size\(group\) \(2 here\)"),
    (_heads(td_swap=True), _to_seq, "seq_to_heads", "positions and head_dim swapped"),
    (_heads(detach=True), _to_seq, "attention: detached", "no gradient reaches q, k, v"),
    (_heads(refuse=False), _to_seq, "3 heads over 2 ranks", "raise ValueError naming both"),
    (_heads(gather=True), _to_seq, "the tracer saw", "an all-gather sends every rank's whole piece"),
    (_to_heads, _seq(back=False), "heads_to_seq(seq_to_heads(x)) is not x", "the output is not turned back"),
    (_to_heads, _seq(local=True), "heads_to_seq(seq_to_heads(x)) is not x", "kept this rank's positions"),
    (_to_heads, _seq(dim=1), "heads_to_seq(seq_to_heads(x)) is not x", "split the POSITIONS"),
    (_to_heads, _seq(view=True), "heads_to_seq", r"\.contiguous\(\) before the all-to-all"),
    (lambda x, group: None, _to_seq, "returned NoneType", "without `return` gives None"),
]


@pytest.mark.parametrize(
    "to_heads, to_seq, what, hint", ULYSSES_MISTAKES, ids=[m[3][:40] for m in ULYSSES_MISTAKES]
)
def test_ulysses_mistakes_are_named(to_heads, to_seq, what, hint):
    with pytest.raises(AssertionError, match=hint) as err:
        C.check_ulysses(to_heads, to_seq)
    assert what in str(err.value)


def test_ulysses_solution_passes():
    C.check_ulysses(_to_heads, _to_seq)


def test_ulysses_first_case_is_not_degenerate():
    """Every seq_to_heads mistake the check names gives another result than the right one on the
    first case's every rank (n = 2): the labelled values tell every head, position and d apart."""
    B, H, T, D = C.ULYSSES_SHAPE
    n = 2
    assert len({B, H, T // n, D, T}) == 5 and H // n > 1
    whole = C._labelled()
    assert whole.unique().numel() == whole.numel()
    for r in range(n):
        right = whole[:, r * H // n : (r + 1) * H // n]
        pieces = torch.chunk(whole, n, 2)
        wrong = {
            "interleaved": whole[:, r::n],
            "reversed": torch.cat(pieces[::-1], 2)[:, r * H // n : (r + 1) * H // n],
            "T and D": right.transpose(2, 3).reshape(right.shape),
        }
        for name, w in wrong.items():
            assert not torch.equal(right, w), (r, name)
            assert C._ulysses_hint(w, whole, r, n, "seq_to_heads") == C.ULYSSES_HINTS[name]
