"""seq_lab's checks against more learner mistakes (issue 44): the world used where SP's tp group
or the ring's group belongs, a rank that raises while its peers wait (the check ends at once and
shows that rank), a log-sum-exp merged with the wrong sign or without its shift, a learner's
function that returns the wrong kind of value, and a receive buffer of the wrong dtype (refused
before gloo aborts the process). Each asserts the check that fails first and its hint."""

import time

import pytest
import torch
import torch.distributed as dist

from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter
from labkit.labs import seq_checks as C, seq_lab as S

STOPPED_WITHIN_S = 45.0  # the ring's wait_s here is 60: a rank's error must end the check before


# ---------------------------------------------------------------- 1. SP's pair
def _pair(forward, backward):
    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.group), None

    return Pair.apply


def _gather(x, group, n=None, pass_group=True):
    n = n or dist.get_world_size(group)
    xt = x.transpose(0, 1).contiguous()
    out = xt.new_empty((n * xt.shape[0], *xt.shape[1:]))
    ring_all_gather(out, xt, group=group if pass_group else None)
    return out.transpose(0, 1).contiguous()


def _scatter(x, group, n=None, pass_group=True):
    n = n or dist.get_world_size(group)
    xt = x.transpose(0, 1).contiguous()
    out = xt.new_empty((xt.shape[0] // n, *xt.shape[1:]))
    ring_reduce_scatter(out, xt, op="sum", group=group if pass_group else None)
    return out.transpose(0, 1).contiguous()


def _world():
    return dist.get_world_size()


G, R = S.gather_seq, S.scatter_seq
SP_MISTAKES = [
    # the buffer sized with the world's size (4) while the collective runs over the tp group (2)
    (
        _pair(lambda x, g: _gather(x, g, _world()), _scatter),
        R,
        "gather, forward",
        r"dist.get_world_size\(group\) \(2 here\), not the world's \(4\)",
    ),
    (
        G,
        _pair(lambda x, g: _scatter(x, g, _world()), _gather),
        "scatter, forward",
        r"dist.get_world_size\(group\) \(2 here\)",
    ),
    (
        _pair(_gather, lambda d, g: _scatter(d, g, _world())),
        R,
        "gather, backward",
        r"dist.get_world_size\(group\) \(2 here\)",
    ),
    # sized for the group, but the collective without group=: it runs over the world
    (
        _pair(lambda x, g: _gather(x, g, pass_group=False), _scatter),
        R,
        "gather, forward",
        "the collective ran over the world",
    ),
    (
        G,
        _pair(_scatter, lambda d, g: _gather(d, g, pass_group=False)),
        "scatter, backward",
        "the collective ran over the world",
    ),
    (lambda x, g: None, R, "returned NoneType", "without `return` gives None"),
    (G, lambda x, g: (R(x, g), g), "returned tuple", "a single tensor"),
]


@pytest.mark.parametrize("gather, scatter, what, hint", SP_MISTAKES)
def test_sp_pair_mistakes_are_named(gather, scatter, what, hint):
    with pytest.raises(AssertionError, match=hint) as err:
        C.check_sp_pair(gather, scatter)
    assert what in str(err.value)


# ---------------------------------------------------------------- 2. the merge (one process)
def merge_lse_unshifted(o1, l1, o2, l2):
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1), torch.log(w1 + w2)


def merge_lse_minus(o1, l1, o2, l2):
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1), m - torch.log(w1 + w2)


def merge_weights_inverted(o1, l1, o2, l2):
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(lse - l1).unsqueeze(-1) + o2 * torch.exp(lse - l2).unsqueeze(-1), lse


def merge_shift_by_first(o1, l1, o2, l2):
    m = l1  # finite scores: right; an empty first partial (lse -inf): nan
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    return (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1), m + torch.log(w1 + w2)


def merge_returns_o(o1, l1, o2, l2):
    return S.merge(o1, l1, o2, l2)[0]


def merge_no_return(o1, l1, o2, l2):
    S.merge(o1, l1, o2, l2)


@pytest.mark.parametrize(
    "merge, what, hint",
    [
        (merge_lse_unshifted, "lse max", "the shift left out of the result"),
        (merge_lse_minus, "lse max", "the wrong sign: lse = m \\+ log"),
        (merge_weights_inverted, "o max", "the weights with the wrong sign"),
        (merge_shift_by_first, "inf or NaN", "shifted by lse1 alone"),
        (merge_returns_o, "returned Tensor", "return \\(o, lse\\)"),
        (merge_no_return, "returned NoneType", "return \\(o, lse\\)"),
    ],
)
def test_merge_mistakes_are_named(merge, what, hint):
    with pytest.raises(AssertionError, match=hint) as err:
        C.check_merge(merge)
    assert what in str(err.value)


# ---------------------------------------------------------------- 3. the ring
def _ring(recv_dtype=None, n_world=False, no_wrap=False, returns="o", recv_shape=None):
    def ring(q, k, v, causal, group):
        r = dist.get_rank(group)
        n = dist.get_world_size() if n_world else dist.get_world_size(group)
        if no_wrap:
            nxt, prv = dist.get_global_rank(group, r + 1), dist.get_global_rank(group, r - 1)
        else:
            nxt, prv = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
        kv = torch.stack([k, v]).contiguous()
        o = lse = None
        for s in range(n):
            j = (r - s) % n
            if s < n - 1:
                incoming = torch.empty(recv_shape or kv.shape, dtype=recv_dtype or kv.dtype)
                reqs = [dist.isend(kv, dst=nxt, group=group), dist.irecv(incoming, src=prv, group=group)]
            if not causal or j <= r:
                part = S.block_attention(q, kv[0], kv[1], causal=causal and j == r)
                o, lse = part if o is None else S.merge(o, lse, *part)
            if s < n - 1:
                for req in reqs:
                    req.wait()
                kv = incoming
        return {"o": o, "tuple": (o, lse), "none": None}[returns]

    return ring


RING_MISTAKES = [
    (_ring(recv_dtype=torch.float32), "irecv into a float32 buffer", r"torch.empty_like\(kv\)"),
    (_ring(recv_shape=(3, 1)), "irecv into a buffer of shape (3, 1)", r"torch.empty_like\(kv\)"),
    (_ring(returns="none"), "returned NoneType", "without `return` gives None"),
    (_ring(returns="tuple"), "returned tuple of 2", "not a tuple"),
    (_ring(n_world=True), "pairs group", r"dist.get_world_size\(group\) \(2 here\)"),
]


@pytest.mark.parametrize("ring, what, hint", RING_MISTAKES)
def test_ring_mistakes_are_named(ring, what, hint):
    with pytest.raises(AssertionError, match=hint) as err:
        C.check_ring(ring, wait_s=10)
    assert what in str(err.value)


def test_a_ring_rank_that_raises_ends_the_check_at_once():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="wrap round the ring") as err:
        C.check_ring(_ring(no_wrap=True), wait_s=60)
    assert time.monotonic() - start < STOPPED_WITHIN_S
    assert "Connection closed" not in str(err.value), str(err.value)


# ---------------------------------------------------------------- 4. zigzag (one process)
@pytest.mark.parametrize(
    "positions, pairs, what, hint",
    [
        (lambda r, n, T: None, S.causal_pairs, "returned NoneType", "without `return` gives None"),
        (
            S.zigzag_positions,
            lambda q, k: k[None, :] <= q[:, None],
            "returned a tensor of shape",
            "not the mask",
        ),
        (S.zigzag_positions, lambda q, k: None, "returned NoneType", "without `return` gives None"),
    ],
)
def test_zigzag_mistakes_are_named(positions, pairs, what, hint):
    with pytest.raises(AssertionError, match=hint) as err:
        C.check_zigzag(positions, pairs)
    assert what in str(err.value)


def test_issue_44_names_at_least_forty_new_learner_mistakes():
    import test_pp_learner_mistakes as pp

    pp_count = sum(
        len(x)
        for x in (pp.STAGE_MISTAKES, pp.SCHEDULE_MISTAKES, pp.INTERLEAVED_MISTAKES, pp.FORMULA_MISTAKES)
    )
    pp_count += 3  # the three "a rank that raises" cases
    seq_count = len(SP_MISTAKES) + 6 + len(RING_MISTAKES) + 1 + 3  # merge, ring, the raising rank, zigzag
    fsdp_count = 2  # tests/test_fsdp_hints.py: the list of handles, the gather trimmed by its flat size
    assert pp_count + seq_count + fsdp_count >= 40, (pp_count, seq_count, fsdp_count)


# ---------------------------------------------------------------- 5. Ulysses' pair
def _to_heads_global_rank(x, group):
    """seq_to_heads that checks its piece with the GLOBAL rank (dist.get_rank()) where the group's
    index belongs: ranks 2 and 3 raise before the all-to-all their group peers 0 and 1 wait in."""
    from labkit.comm.all_to_all import all_to_all_autograd

    n = dist.get_world_size(group)
    first = [0, 6][dist.get_rank()]  # where this rank's positions start, read by the global rank
    assert x.shape[2] * n > first
    send = torch.stack(torch.chunk(x, n, dim=1))
    return torch.cat(all_to_all_autograd(send, group=group).unbind(0), dim=2)


def test_a_ulysses_rank_that_raises_ends_the_check_at_once():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="IndexError") as err:
        C.check_ulysses(_to_heads_global_rank, S.heads_to_seq)
    assert time.monotonic() - start < STOPPED_WITHIN_S
    assert "rank 2" in str(err.value) or "rank 3" in str(err.value), str(err.value)
    assert "seq_to_heads" in str(err.value)
    assert "dist.get_rank(group), not dist.get_rank()" in str(err.value)
