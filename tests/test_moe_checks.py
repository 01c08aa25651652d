"""moe_lab's checks: the references pass, an unwritten exercise is a TODO, and each learner mistake
fails the check of its own exercise with the hint that names it (the router and the dispatch in
one process, the all-to-all pair and the EP layer on 4 ranks as a 2 x 2 ("dp", "ep") mesh)."""

import math

import pytest
import torch
import torch.distributed as dist

from labkit.comm import all_to_all_single
from labkit.comm.all_to_all import AllToAll
from labkit.labs import moe_checks as C, moe_lab as M


def not_written(*args, **kwargs):
    raise NotImplementedError


# ---------------------------------------------------------------- 1. the router
def route_unnormalised(logits, k):
    probs = torch.softmax(logits, -1)
    top, idx = probs.topk(k, -1)
    return probs, idx, top


def route_softmax_after_topk(logits, k):
    probs = torch.softmax(logits, -1)
    top, idx = probs.topk(k, -1)
    return probs, idx, torch.softmax(top, -1)


def route_tokens_axis(logits, k):
    probs = torch.softmax(logits, 0)
    top, idx = probs.topk(k, -1)
    return probs, idx, top / top.sum(-1, keepdim=True)


def route_smallest(logits, k):
    probs = torch.softmax(logits, -1)
    top, idx = probs.topk(k, -1, largest=False)
    return probs, idx, top / top.sum(-1, keepdim=True)


def route_detached(logits, k):
    probs, idx, gates = M.route(logits, k)
    return probs, idx, gates.detach()


def aux_wrong_axis(probs, idx, e):
    f = torch.bincount(idx.reshape(-1), minlength=e).to(probs.dtype) / idx.numel()
    return e * (f * probs.mean(1)).sum()


def aux_no_e(probs, idx, e):
    return M.load_balancing_loss(probs, idx, e) / e


def aux_per_token(probs, idx, e):
    f = torch.bincount(idx.reshape(-1), minlength=e).to(probs.dtype) / len(idx)
    return e * (f * probs.mean(0)).sum()


def aux_probs_as_f(probs, idx, e):
    return e * (probs.mean(0) ** 2).sum()


def aux_detached(probs, idx, e):
    return M.load_balancing_loss(probs.detach(), idx, e)


ROUTER_MISTAKES = [
    (route_unnormalised, M.load_balancing_loss, "gates not renormalised after top-k"),
    (route_softmax_after_topk, M.load_balancing_loss, "softmax after top-k"),
    (route_tokens_axis, M.load_balancing_loss, "softmax over the tokens"),
    (route_smallest, M.load_balancing_loss, "the k least probable"),
    (route_detached, M.load_balancing_loss, "the gates are detached"),
    (M.route, aux_wrong_axis, "the aux loss on the wrong axis"),
    (M.route, aux_no_e, "multiplied by the number of experts"),
    (M.route, aux_per_token, "fraction of the N·k assignments"),
    (M.route, aux_probs_as_f, "f_e counts the assignments"),
    (M.route, aux_detached, "P_e must come from probs, not detached"),
]


@pytest.mark.parametrize("route, aux, hint", ROUTER_MISTAKES, ids=[h for *_, h in ROUTER_MISTAKES])
def test_router_mistakes_are_named(route, aux, hint):
    with pytest.raises(AssertionError, match=hint):
        C.check_router(route, aux)


def test_router_reference_passes_and_todo():
    C.check_router(M.route, M.load_balancing_loss)
    with pytest.raises(NotImplementedError):
        C.check_router(not_written, M.load_balancing_loss)
    with pytest.raises(NotImplementedError):
        C.check_router(M.route, not_written)


# ---------------------------------------------------------------- 2. the dispatch
def cap_floor(n, e, k, cf):
    return int(cf * n * k / e)


def cap_plus_one(n, e, k, cf):
    return M.capacity(n, e, k, cf) + 1


def cap_no_k(n, e, k, cf):
    return math.ceil(cf * n / e)


def plan_modulo(idx, e, cap, ep):
    d, s, k = M.dispatch_plan(idx, e, cap, ep)
    return idx % ep, s, k


def plan_per_rank(idx, e, cap, ep):
    d, _, _ = M.dispatch_plan(idx, e, cap, ep)
    oh = torch.nn.functional.one_hot(d.reshape(-1), ep)
    s = ((oh.cumsum(0) - 1) * oh).sum(-1).reshape(idx.shape)
    return d, s, s < cap if cap is not None else torch.ones_like(s, dtype=torch.bool)


def plan_from_one(idx, e, cap, ep):
    d, s, _ = M.dispatch_plan(idx, e, None, ep)
    return d, s + 1, s + 1 <= (cap if cap is not None else 10**9)


def plan_choice_major(idx, e, cap, ep):
    d, s, k = M.dispatch_plan(idx.T.contiguous(), e, cap, ep)
    return d.T, s.T, k.T


def plan_kept_le(idx, e, cap, ep):
    d, s, k = M.dispatch_plan(idx, e, cap, ep)
    return d, s, (s <= cap) if cap is not None else k


DISPATCH_MISTAKES = [
    (cap_floor, M.dispatch_plan, "capacity off by one: rounded down"),
    (cap_plus_one, M.dispatch_plan, "capacity off by one: one slot too many"),
    (cap_no_k, M.dispatch_plan, "capacity without top_k"),
    (M.capacity, plan_modulo, "not e % ep"),
    (M.capacity, plan_per_rank, "slot counted per destination rank"),
    (M.capacity, plan_from_one, "slots count from 0"),
    (M.capacity, plan_choice_major, "slots fill in token order"),
    (M.capacity, plan_kept_le, "kept is slot < capacity \\(off by one\\)"),
]


@pytest.mark.parametrize("cap, plan, hint", DISPATCH_MISTAKES, ids=[h for *_, h in DISPATCH_MISTAKES])
def test_dispatch_mistakes_are_named(cap, plan, hint):
    with pytest.raises(AssertionError, match=hint):
        C.check_dispatch(cap, plan)


def test_dispatch_reference_passes_and_todo():
    C.check_dispatch(M.capacity, M.dispatch_plan)
    with pytest.raises(NotImplementedError):
        C.check_dispatch(not_written, M.dispatch_plan)


# ---------------------------------------------------------------- 3. the all-to-all pair
def _a2a_fn(splits, bwd_splits=None, group_of=lambda g: g, backward_moves=True):
    """An all-to-all Function's apply(x, output_split_sizes, input_split_sizes, group): forward
    with the (output, input) splits that `splits` picks, backward with bwd_splits' (default: the
    two swapped, right); group_of chooses the group it runs on."""

    class A2A(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, out_s, in_s, group):
            ctx.s = (out_s, in_s, group, len(x))
            o, i = splits(out_s, in_s)
            out = x.new_empty((sum(out_s), *x.shape[1:]))
            all_to_all_single(out, x.contiguous(), o, i, group=group_of(group))
            return out

        @staticmethod
        def backward(ctx, grad):
            out_s, in_s, group, rows = ctx.s
            if not backward_moves:
                return grad, None, None, None
            o, i = (bwd_splits or (lambda o, i: (i, o)))(out_s, in_s)
            out = grad.new_empty((sum(o), *grad.shape[1:]))
            all_to_all_single(out, grad.contiguous(), o, i, group=group_of(group))
            return out, None, None, None

    return A2A.apply


RIGHT = _a2a_fn(lambda o, i: (o, i))


def _dispatch_with(a2a, sort=True, exchange=True):
    def dispatch(x, dest, group):
        n = dist.get_world_size(group)
        order = torch.argsort(dest, stable=True) if sort else torch.arange(len(dest))
        send = torch.bincount(dest, minlength=n).tolist()
        recv = M.exchange_counts(send, group) if exchange else list(send)
        return a2a(x[order], recv, send, group), (order, send, recv)

    return dispatch


def combine_in_dispatch_order(y, plan, group):
    order, send, recv = plan
    return AllToAll.apply(y, send, recv, group)


def combine_unsorted_wrong_way(y, plan, group):
    order, send, recv = plan
    return AllToAll.apply(y, send, recv, group)[order]


def combine_same_splits(y, plan, group):
    order, send, recv = plan
    return AllToAll.apply(y, recv, send, group)[torch.argsort(order)]


A2A_MISTAKES = [
    (_a2a_fn(lambda o, i: (i, o)), M.dispatch, M.combine, "split sizes sent instead of received"),
    (_a2a_fn(lambda o, i: (o, i), lambda o, i: (o, i)), M.dispatch, M.combine, "splits swapped"),
    (
        _a2a_fn(lambda o, i: (o, i), backward_moves=False),
        M.dispatch,
        M.combine,
        "returned the gradient as it came",
    ),
    (_a2a_fn(lambda o, i: (o, i), group_of=lambda g: None), M.dispatch, M.combine, "the wrong group"),
    (RIGHT, _dispatch_with(RIGHT, sort=False), M.combine, "not sorted by destination"),
    (RIGHT, _dispatch_with(RIGHT, exchange=False), M.combine, "exchange the counts"),
    (RIGHT, M.dispatch, combine_in_dispatch_order, "combine in the dispatch's order"),
    (RIGHT, M.dispatch, combine_unsorted_wrong_way, "the sort undone the wrong way"),
    (RIGHT, M.dispatch, combine_same_splits, "combine is dispatch reversed"),
]


@pytest.mark.parametrize("a2a, dispatch, combine, hint", A2A_MISTAKES, ids=[h for *_, h in A2A_MISTAKES])
def test_all_to_all_mistakes_are_named(a2a, dispatch, combine, hint):
    with pytest.raises(AssertionError, match=hint):
        C.check_all_to_all(a2a, dispatch, combine)


def test_all_to_all_reference_passes():
    C.check_all_to_all(AllToAll.apply, M.dispatch, M.combine)


# ---------------------------------------------------------------- 4. the EP layer
def sync_world_average(layer, dp_group):
    for p in layer.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def sync_dp_average(layer, dp_group):
    dist.all_reduce(layer.router.grad)
    layer.router.grad /= dist.get_world_size()
    for p in (layer.w1, layer.w2):
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= dist.get_world_size(dp_group)


def sync_router_over_dp(layer, dp_group):
    for p in layer.parameters():
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= dist.get_world_size()


def sync_nothing(layer, dp_group):
    pass


def ep_ungated(layer, x):
    probs, idx, gates = M.route(x @ layer.router.T, layer.top_k)
    return M.ep_forward(layer, x)[0] * 0 + _ungated(layer, x, probs, idx), M.load_balancing_loss(
        probs, idx, layer.n_experts
    )


def _ungated(layer, x, probs, idx):
    cap = M.capacity(len(x), layer.n_experts, layer.top_k, layer.capacity_factor)
    dest, _, kept = M.dispatch_plan(idx, layer.n_experts, cap, layer.ep)
    tok, j = torch.nonzero(kept, as_tuple=True)
    rows, plan = M.dispatch(x[tok], dest[tok, j], layer.group)
    ex, _ = M.dispatch(idx[tok, j].to(M.DTYPE)[:, None], dest[tok, j], layer.group)
    out = M.combine(layer.experts(rows, ex[:, 0].long() - layer.first), plan, layer.group)
    return torch.zeros_like(x).index_add(0, tok, out)


def ep_dropless(layer, x):
    cf, layer.capacity_factor = layer.capacity_factor, None
    try:
        return M.ep_forward(layer, x)
    finally:
        layer.capacity_factor = cf


def ep_global_expert_index(layer, x):
    first, layer.first = layer.first, 0
    try:
        return M.ep_forward(layer, x)
    finally:
        layer.first = first


EP_MISTAKES = [
    (M.ep_forward, sync_world_average, "expert gradients averaged over the whole world"),
    (M.ep_forward, sync_dp_average, "averaged over the dp group \\(divided by dp\\)"),
    (M.ep_forward, sync_router_over_dp, "the router is replicated on EVERY rank"),
    (M.ep_forward, sync_nothing, "not synchronised"),
    (ep_ungated, M.sync_grads, "not weighted by the gates"),
    (ep_dropless, M.sync_grads, "dropped tokens included"),
    (ep_global_expert_index, M.sync_grads, "the local index is expert - layer.first"),
]


@pytest.mark.parametrize("forward, sync, hint", EP_MISTAKES, ids=[h for *_, h in EP_MISTAKES])
def test_ep_mistakes_are_named(forward, sync, hint):
    with pytest.raises(AssertionError, match=hint):
        C.check_ep(forward, sync)


def test_ep_reference_passes():
    C.check_ep(M.ep_forward, M.sync_grads)


# ---------------------------------------------------------------- fail fast, bad returns
def a2a_raises_on_rank_1(x, out_s, in_s, group):
    if dist.get_rank() == 1:  # rank 0, its ep peer, waits for it in the all-to-all
        raise RuntimeError("split sizes do not add up")
    return AllToAll.apply(x, out_s, in_s, group)


def a2a_float32(x, out_s, in_s, group):
    out = torch.empty(sum(out_s), x.shape[1])  # torch's default dtype, not x's
    all_to_all_single(out, x.float().contiguous(), out_s, in_s, group=group)
    return out


def combine_no_return(y, plan, group):
    M.combine(y, plan, group)  # the value computed, the `return` forgotten


def ep_raises_on_rank_2(layer, x):
    if dist.get_rank() == 2:  # rank 3 waits for it in the dispatch's all-to-all
        raise IndexError("index 5 is out of bounds for dimension 0 with size 2")
    return M.ep_forward(layer, x)


def ep_returns_none(layer, x):
    M.ep_forward(layer, x)


def ep_flat(layer, x):
    y, aux = M.ep_forward(layer, x)
    return y.reshape(-1), aux


FAST = [
    ("a2a", (a2a_raises_on_rank_1, M.dispatch, M.combine), "rank 1 .*do not add up.*hint: split sizes sent"),
    ("a2a", (a2a_float32, M.dispatch, M.combine), "rank 0 .*dtype torch.float32.*hint: keep the rows' dtype"),
    (
        "a2a",
        (AllToAll.apply, M.dispatch, combine_no_return),
        "rank 0 .*combine returned None.*forgotten `return`",
    ),
    ("ep", (ep_raises_on_rank_2, M.sync_grads), "rank 2 .*out of bounds.*hint: .*expert - layer.first"),
    ("ep", (ep_flat, M.sync_grads), "rank 0 .*shape \\(72,\\), expected \\(12, 6\\).*hint: rows stay rows"),
    (
        "ep",
        (ep_returns_none, M.sync_grads),
        "rank 0 .*ep_forward returned None.*returns a pair: \\(y, aux\\)",
    ),
]


@pytest.mark.parametrize(
    "check, fns, hint", FAST, ids=[f"{c}-{f[0].__name__}-{f[-1].__name__}" for c, f, _ in FAST]
)
def test_errors_end_the_check_at_once(check, fns, hint, monkeypatch):
    """An error on some ranks only (their peers waiting for them in an all-to-all) or a bad return
    ends the check within seconds with the erring rank's error and its hint: a launch timeout of
    60 s would show a hang (the bound 30 s is far above a launch, far below the timeout)."""
    import time

    monkeypatch.setattr(C, "TIMEOUT", 60.0)
    start = time.monotonic()
    with pytest.raises(AssertionError, match=f"(?s){hint}"):
        (C.check_all_to_all if check == "a2a" else C.check_ep)(*fns)
    assert time.monotonic() - start < 30


def test_multi_rank_not_written_says_so():
    with pytest.raises(NotImplementedError):
        C.check_all_to_all(AllToAll.apply, not_written, not_written)
    with pytest.raises(NotImplementedError):
        C.check_ep(M.ep_forward, not_written)
