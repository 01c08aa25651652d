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


# ---------------------------------------------------------------- issue 58: every mistake named, every hint reachable
# Each planted mistake below is one a learner makes; the check must fail at its own exercise with
# the words that name it (and every hint in moe_checks.py fires for at least one of them).
def aux_no_minlength(probs, idx, e):
    f = torch.bincount(idx.reshape(-1)).to(probs.dtype) / idx.numel()
    return e * (f * probs.mean(0)).sum()


def aux_sum_not_mean(probs, idx, e):
    f = torch.bincount(idx.reshape(-1), minlength=e).to(probs.dtype) / idx.numel()
    return e * (f * probs.sum(0)).sum()


def aux_f_straight_through(probs, idx, e):
    count = torch.nn.functional.one_hot(idx, e).sum(1).to(probs.dtype)
    f = (count + probs - probs.detach()).mean(0) / idx.shape[1]  # the value of f, with P's gradient
    return e * (f * probs.mean(0)).sum()


def aux_per_expert(probs, idx, e):
    f = torch.bincount(idx.reshape(-1), minlength=e).to(probs.dtype) / idx.numel()
    return e * f * probs.mean(0)  # not summed


def aux_half_again(probs, idx, e):
    return 1.5 * M.load_balancing_loss(probs, idx, e)


def route_raises(logits, k):
    raise RuntimeError("something else went wrong")


def route_pair(logits, k):
    probs, idx, gates = M.route(logits, k)
    return idx, gates


def route_logits_as_probs(logits, k):
    top, idx = logits.topk(k, -1)
    return logits, idx, torch.softmax(top, -1)


def route_flat_idx(logits, k):
    probs, idx, gates = M.route(logits, k)
    return probs, idx.reshape(-1), gates


def route_first_experts(logits, k):
    probs = torch.softmax(logits, -1)
    idx = torch.arange(k).expand(len(logits), k)
    top = probs.gather(1, idx)
    return probs, idx, top / top.sum(-1, keepdim=True)


def route_gates_summed(logits, k):
    probs, idx, gates = M.route(logits, k)
    return probs, idx, gates.sum(-1)


def route_gates_over_all(logits, k):
    probs = torch.softmax(logits, -1)
    top, idx = probs.topk(k, -1)
    return probs, idx, top / top.sum()


ROUTER_MORE = [
    (M.route, aux_no_minlength, "bincount without minlength: no assignment went to expert 4"),
    (M.route, aux_sum_not_mean, "P_e is the MEAN probability"),
    (M.route, aux_f_straight_through, "only P_e carries the gradient"),
    (M.route, aux_per_expert, "return one number"),
    (M.route, aux_half_again, "expected 1.46651\nhint: E · Σ_e f_e · P_e$"),
    (route_raises, M.load_balancing_loss, "something else went wrong\nhint: see the error above"),
    (route_pair, M.load_balancing_loss, "return \\(probs, topk_idx, gates\\)"),
    (route_logits_as_probs, M.load_balancing_loss, "probs: softmax of the logits over the experts"),
    (route_flat_idx, M.load_balancing_loss, "topk_idx is \\(N, k\\)"),
    (route_first_experts, M.load_balancing_loss, "the k MOST probable experts"),
    (route_gates_summed, M.load_balancing_loss, "gates is \\(N, k\\)"),
    (route_gates_over_all, M.load_balancing_loss, "gates: the chosen probabilities divided by their sum"),
]


@pytest.mark.parametrize("route, aux, hint", ROUTER_MORE, ids=[h[:40] for *_, h in ROUTER_MORE])
def test_router_more_mistakes_are_named(route, aux, hint):
    with pytest.raises(AssertionError, match=hint):
        C.check_router(route, aux)


def test_aux_cases_are_unbalanced():
    """A balanced routing scores 1 whatever P (f_e = 1/E): no case may be one, or a wrong aux loss
    reads "expected 1"; the first case's message shows a value of its own."""
    for n, e, k, seed, starve in C.AUX_CASES:
        logits = C._logits(n, e, seed)
        if starve:
            logits[:, -1] -= 50
        _, idx, _ = M.route(logits, k)
        counts = torch.bincount(idx.reshape(-1), minlength=e)
        assert counts.max() > counts.min(), (n, e, k)
        assert (counts[-1] == 0) == starve
    with pytest.raises(
        AssertionError, match="aux loss, 4 tokens, 4 experts, top-2: 0.36662[0-9], expected 1.46651"
    ):
        C.check_router(M.route, aux_no_e)


def cap_round(n, e, k, cf):
    return round(cf * n * k / e)


def cap_no_factor(n, e, k, cf):
    return math.ceil(n * k / e)


def plan_raises(idx, e, cap, ep):
    raise ValueError("learner's own error")


def plan_pair(idx, e, cap, ep):
    d, s, k = M.dispatch_plan(idx, e, cap, ep)
    return d, s


def plan_floordiv_ep(idx, e, cap, ep):
    d, s, k = M.dispatch_plan(idx, e, cap, ep)
    return idx // ep, s, k


def plan_blocks_reversed(idx, e, cap, ep):
    d, s, k = M.dispatch_plan(idx, e, cap, ep)
    return ep - 1 - d, s, k


def plan_slot_global(idx, e, cap, ep):
    d, _, _ = M.dispatch_plan(idx, e, cap, ep)
    s = torch.arange(idx.numel()).reshape(idx.shape)
    return d, s, s < cap if cap is not None else torch.ones_like(s, dtype=torch.bool)


def plan_kept_int(idx, e, cap, ep):
    d, s, k = M.dispatch_plan(idx, e, cap, ep)
    return d, s, k.long()


def plan_kept_count(idx, e, cap, ep):
    d, s, k = M.dispatch_plan(idx, e, cap, ep)
    return d, s, int(k.sum())


def plan_none_as_zero(idx, e, cap, ep):
    d, s, k = M.dispatch_plan(idx, e, cap, ep)
    return d, s, s < (cap if cap is not None else 0)


def plan_kept_one_less(idx, e, cap, ep):
    d, s, k = M.dispatch_plan(idx, e, cap, ep)
    return d, s, (s < cap - 1) if cap is not None else k


DISPATCH_MORE = [
    (
        cap_round,
        M.dispatch_plan,
        "capacity rounded to nearest \\(round\\(\\)\\): it took 4.67 up to 5 but 6.25 down to 6",
    ),
    (cap_no_factor, M.dispatch_plan, "ceil\\(capacity_factor · n_tokens · top_k / n_experts\\)"),
    (M.capacity, plan_raises, "learner's own error\nhint: see the error above"),
    (M.capacity, plan_pair, "return \\(dest_rank, slot, kept\\)"),
    (M.capacity, plan_floordiv_ep, "not e // ep"),
    (M.capacity, plan_blocks_reversed, "dest = expert // \\(E/ep\\)"),
    (M.capacity, plan_slot_global, "slot = how many earlier assignments"),
    (
        M.capacity,
        plan_kept_int,
        "kept: dtype torch.int64, expected torch.bool.*\nhint: kept is a boolean mask",
    ),
    (M.capacity, plan_kept_count, "kept: shape \\(\\), expected \\(12, 2\\).*not the count of kept"),
    (M.capacity, plan_none_as_zero, "capacity None is the dropless mode"),
    (M.capacity, plan_kept_one_less, "kept = slot < capacity \\(a bool tensor\\)"),
]


@pytest.mark.parametrize("cap, plan, hint", DISPATCH_MORE, ids=[h[:40] for *_, h in DISPATCH_MORE])
def test_dispatch_more_mistakes_are_named(cap, plan, hint):
    with pytest.raises(AssertionError, match=f"(?s){hint}"):
        C.check_dispatch(cap, plan)


def test_capacity_cases_show_rounding():
    """round() equals ceil on some case (a share it takes up) and int() on a later one."""
    shares = [cf * n * k / e for n, e, k, cf in C.CAPACITY_CASES]
    ups = [i for i, s in enumerate(shares) if round(s) == math.ceil(s) > int(s)]
    downs = [i for i, s in enumerate(shares) if round(s) == int(s) < math.ceil(s)]
    assert ups and downs and ups[0] < downs[0]


def test_kept_message_names_no_equal_counts():
    """The bool / int slip reads as a dtype, never "15 kept, expected 15"."""
    with pytest.raises(AssertionError) as err:
        C.check_dispatch(M.capacity, plan_kept_int)
    assert "dtype torch.int64" in str(err.value) and "kept, expected" not in str(err.value)


# the all-to-all pair
def _a2a_class(forward=None, backward=None):
    """AllToAll with a planted forward or backward (each given ctx and the right one's pieces)."""

    class A2A(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, out_s, in_s, group):
            ctx.s = (out_s, in_s, group)
            if forward is not None:
                return forward(ctx, x, out_s, in_s, group)
            out = x.new_empty((sum(out_s), *x.shape[1:]))
            all_to_all_single(out, x.contiguous(), out_s, in_s, group=group)
            return out

        @staticmethod
        def backward(ctx, grad):
            out_s, in_s, group = ctx.s
            back = grad.new_empty((sum(in_s), *grad.shape[1:]))
            if backward is not None:
                return backward(grad, back, in_s, out_s, group)
            all_to_all_single(back, grad.contiguous(), in_s, out_s, group=group)
            return back, None, None, None

    return A2A.apply


def _fwd_returns_input(ctx, x, out_s, in_s, group):
    return x.clone()


def _fwd_forgets_the_call(ctx, x, out_s, in_s, group):
    return x.new_zeros((sum(out_s), *x.shape[1:]))


def _fwd_saves_lists(ctx, x, out_s, in_s, group):
    ctx.save_for_backward(out_s, in_s)


def _fwd_other_error(ctx, x, out_s, in_s, group):
    raise KeyError("learner's own error")


def _bwd_forgets_the_call(grad, back, in_s, out_s, group):
    return back.zero_(), None, None, None


def _bwd_one_gradient(grad, back, in_s, out_s, group):
    all_to_all_single(back, grad.contiguous(), in_s, out_s, group=group)
    return back


def _bwd_no_gradient(grad, back, in_s, out_s, group):
    all_to_all_single(back, grad.contiguous(), in_s, out_s, group=group)
    return None, None, None, None  # the gradient computed, not returned


def a2a_returns_pair(x, out_s, in_s, group):
    return AllToAll.apply(x, out_s, in_s, group), out_s


def dispatch_no_minlength(x, dest, group):
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest).tolist()  # no minlength
    recv = M.exchange_counts(send, group)
    return AllToAll.apply(x[order], recv, send, group), (order, send, recv)


def dispatch_own_exchange_no_minlength(x, dest, group):
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest)  # no minlength
    recv = torch.empty_like(send)
    all_to_all_single(recv, send, group=group)
    return AllToAll.apply(x[order], recv.tolist(), send.tolist(), group), (
        order,
        send.tolist(),
        recv.tolist(),
    )


def dispatch_counts_over_world(x, dest, group):
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=dist.get_world_size(group)).tolist()
    recv = M.exchange_counts(send, None)  # the world, not the group
    return AllToAll.apply(x[order], recv, send, group), (order, send, recv)


def dispatch_detached(x, dest, group):
    rows, plan = M.dispatch(x, dest, group)
    return rows.detach(), plan


def dispatch_rows_only(x, dest, group):
    return M.dispatch(x, dest, group)[0]


def dispatch_unstable(x, dest, group):
    n = dist.get_world_size(group)
    order = torch.argsort(dest * len(dest) - torch.arange(len(dest)))  # each rank's rows reversed
    send = torch.bincount(dest, minlength=n).tolist()
    recv = M.exchange_counts(send, group)
    return AllToAll.apply(x[order], recv, send, group), (order, send, recv)


def dispatch_descending(x, dest, group):
    n = dist.get_world_size(group)
    order = torch.argsort(dest, descending=True, stable=True)
    send = torch.bincount(dest, minlength=n).tolist()
    recv = M.exchange_counts(send, group)
    return AllToAll.apply(x[order], recv, send, group), (order, send, recv)


def combine_detached(y, plan, group):
    return M.combine(y.detach(), plan, group)


def combine_raw_collective(y, plan, group):
    order, send, recv = plan
    back = y.new_empty((sum(send), *y.shape[1:]))
    all_to_all_single(back, y.contiguous(), send, recv, group=group)  # not the autograd Function
    return back[torch.argsort(order)]


def combine_half_gradient(y, plan, group):
    out = M.combine(y, plan, group)
    return out.detach() + 0.5 * (out - out.detach())


def combine_rolled(y, plan, group):
    return M.combine(y, plan, group).roll(1, 0)


def combine_returns_pair(y, plan, group):
    return M.combine(y, plan, group), plan


A2A_MORE = [
    (AllToAll.apply, dispatch_no_minlength, M.combine, "bincount without minlength"),
    (AllToAll.apply, dispatch_own_exchange_no_minlength, M.combine, "bincount without minlength"),
    (AllToAll.apply, dispatch_counts_over_world, M.combine, "the wrong group: a group of 4 ranks"),
    (
        AllToAll.apply,
        M.dispatch,
        combine_detached,
        "combine's output: no gradient, detached.*hint: detached in combine",
    ),
    (AllToAll.apply, M.dispatch, combine_raw_collective, "detached.*all_to_all_single called directly"),
    (
        AllToAll.apply,
        dispatch_detached,
        M.combine,
        "dispatch's received rows: no gradient, detached.*hint: detached in dispatch",
    ),
    (AllToAll.apply, M.dispatch, combine_half_gradient, "the values are right but not their gradient"),
    (_a2a_class(forward=_fwd_returns_input), M.dispatch, M.combine, "the forward returned its input"),
    (_a2a_class(forward=_fwd_forgets_the_call), M.dispatch, M.combine, "row block i of the output"),
    (_a2a_class(forward=_fwd_saves_lists), M.dispatch, M.combine, "save_for_backward takes tensors only"),
    (
        _a2a_class(forward=_fwd_other_error),
        M.dispatch,
        M.combine,
        "learner's own error.*hint: see the error above",
    ),
    (
        _a2a_class(backward=_bwd_forgets_the_call),
        M.dispatch,
        M.combine,
        "splits swapped, its result returned",
    ),
    (_a2a_class(backward=_bwd_one_gradient), M.dispatch, M.combine, "backward returns \\(grad of x, None"),
    (_a2a_class(backward=_bwd_no_gradient), M.dispatch, M.combine, "no gradient reached the input rows"),
    (a2a_returns_pair, M.dispatch, M.combine, "returned tuple, not a tensor"),
    (AllToAll.apply, dispatch_rows_only, M.combine, "dispatch returns a pair"),
    (
        AllToAll.apply,
        dispatch_unstable,
        M.combine,
        "the right rows in another order: sort by destination with a STABLE sort",
    ),
    (AllToAll.apply, dispatch_descending, M.combine, "dispatch: sort the rows by destination rank"),
    (AllToAll.apply, M.dispatch, combine_rolled, "combine: the reverse all-to-all, then each row back"),
    (AllToAll.apply, M.dispatch, combine_returns_pair, "combine returned tuple, not a tensor"),
]


@pytest.mark.parametrize("a2a, dispatch, combine, hint", A2A_MORE, ids=[h[:40] for *_, h in A2A_MORE])
def test_all_to_all_more_mistakes_are_named(a2a, dispatch, combine, hint, monkeypatch):
    monkeypatch.setattr(C, "TIMEOUT", 60.0)
    with pytest.raises(AssertionError, match=f"(?s){hint}"):
        C.check_all_to_all(a2a, dispatch, combine)


def test_detached_combine_is_not_blamed_on_the_backward():
    with pytest.raises(AssertionError) as err:
        C.check_all_to_all(AllToAll.apply, M.dispatch, combine_detached)
    assert "combine" in str(err.value) and "backward" not in str(err.value).split("hint:")[0]


# the EP layer
def _ep_variant(layer, x, cap_tokens=1, send_dest=False, minus_first=True, experts_arg=None):
    """M.ep_forward with one learner mistake planted: the capacity counted on cap_tokens ranks'
    tokens, the destination rank sent in place of the expert, the local index left global,
    layer.experts given experts_arg."""
    probs, idx, gates = M.route(x @ layer.router.T, layer.top_k)
    cap = M.capacity(len(x) * cap_tokens, layer.n_experts, layer.top_k, layer.capacity_factor)
    dest, _, kept = M.dispatch_plan(idx, layer.n_experts, cap, layer.ep)
    tok, j = torch.nonzero(kept, as_tuple=True)
    rows, plan = M.dispatch(x[tok], dest[tok, j], layer.group)
    sent = (dest if send_dest else idx)[tok, j].to(M.DTYPE)[:, None]
    which, _ = M.dispatch(sent, dest[tok, j], layer.group)
    local = which[:, 0].long() - (layer.first if minus_first else 0)
    out = M.combine(layer.experts(rows, local if experts_arg is None else experts_arg), plan, layer.group)
    y = torch.zeros_like(x).index_add(0, tok, gates[tok, j, None] * out)
    return y, M.load_balancing_loss(probs, idx, layer.n_experts)


def ep_cap_global(layer, x):
    return _ep_variant(layer, x, cap_tokens=dist.get_world_size())


def ep_cap_ep_group(layer, x):
    return _ep_variant(layer, x, cap_tokens=layer.ep)


def ep_dest_as_expert(layer, x):
    return _ep_variant(layer, x, send_dest=True)


def ep_dest_as_local(layer, x):
    return _ep_variant(layer, x, send_dest=True, minus_first=False)


def ep_experts_int(layer, x):
    return _ep_variant(layer, x, experts_arg=0)


def ep_aux_group_mean(layer, x):
    y, aux = M.ep_forward(layer, x)
    total = aux.detach().clone()
    dist.all_reduce(total, group=layer.group)
    return y, aux + (total / layer.ep - aux).detach()  # the ep group's mean


def ep_aux_pair(layer, x):
    y, aux = M.ep_forward(layer, x)
    return y, torch.stack([aux, aux])


def ep_y_detached(layer, x):
    y, aux = M.ep_forward(layer, x)
    return y.detach(), aux


def ep_experts_no_grad(layer, x):
    experts = layer.experts

    def no_grad_experts(rows, local):
        with torch.no_grad():
            return experts(rows, local)

    layer.experts = no_grad_experts
    try:
        return M.ep_forward(layer, x)
    finally:
        del layer.experts


def ep_probs_as_gates(layer, x):
    probs, idx, gates = M.route(x @ layer.router.T, layer.top_k)
    y, aux = M.ep_forward(layer, x)
    return y * 0.5, aux


def sync_sum_only(layer, dp_group):
    dist.all_reduce(layer.router.grad)
    for p in (layer.w1, layer.w2):
        dist.all_reduce(p.grad, group=dp_group)


def sync_experts_sum_only(layer, dp_group):
    dist.all_reduce(layer.router.grad)
    layer.router.grad /= dist.get_world_size()
    for p in (layer.w1, layer.w2):
        dist.all_reduce(p.grad, group=dp_group)


def sync_experts_over_ep(layer, dp_group):
    dist.all_reduce(layer.router.grad)
    layer.router.grad /= dist.get_world_size()
    for p in (layer.w1, layer.w2):
        dist.all_reduce(p.grad, group=layer.group)
        p.grad /= dist.get_world_size()


def sync_router_over_ep(layer, dp_group):
    dist.all_reduce(layer.router.grad, group=layer.group)
    layer.router.grad /= dist.get_world_size()
    for p in (layer.w1, layer.w2):
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= dist.get_world_size()


def sync_mesh_as_group(layer, dp_group):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    dist.all_reduce(layer.router.grad, group=mesh)


def sync_list(layer, dp_group):
    dist.all_reduce([p.grad for p in layer.parameters()])


def sync_over_eight(layer, dp_group):
    M.sync_grads(layer, dp_group)
    for p in layer.parameters():
        p.grad /= 2


def sync_drops_grads(layer, dp_group):
    M.sync_grads(layer, dp_group)
    layer.w1.grad = None


EP_MORE = [
    (ep_cap_global, M.sync_grads, "the capacity counted on the global batch"),
    (ep_cap_ep_group, M.sync_grads, "the capacity counted on the ep group's tokens"),
    (ep_dest_as_expert, M.sync_grads, "the destination rank sent as the expert index"),
    (ep_dest_as_local, M.sync_grads, "the destination rank sent as the expert index"),
    (
        ep_experts_int,
        M.sync_grads,
        "layer.experts\\(rows, local_index\\) takes a tensor of local expert indices",
    ),
    (ep_aux_group_mean, M.sync_grads, "the aux loss of this rank's tokens"),
    (ep_aux_pair, M.sync_grads, "ep_forward's aux is \\(2,\\), expected one number"),
    (ep_y_detached, M.sync_grads, "ep_forward's y carries no gradient"),
    (ep_experts_no_grad, M.sync_grads, "after backward, no gradient on w1, w2"),
    (ep_probs_as_gates, M.sync_grads, "route, plan, dispatch the kept rows"),
    (
        M.ep_forward,
        sync_sum_only,
        "router's gradient summed over the world but not divided.*world size \\(4\\)",
    ),
    (
        M.ep_forward,
        sync_experts_sum_only,
        "w1's gradient summed over the dp group \\(dp_group\\) but not divided",
    ),
    (M.ep_forward, sync_experts_over_ep, "the wrong group, the ep group \\(layer.group\\)"),
    (M.ep_forward, sync_router_over_ep, "reduced over the ep group.*the router is replicated on EVERY rank"),
    (M.ep_forward, sync_mesh_as_group, "group= takes a ProcessGroup"),
    (M.ep_forward, sync_list, "router: all-reduce over the world; experts: over dp_group"),
    (M.ep_forward, sync_over_eight, "router: world sum / world size"),
    (M.ep_forward, sync_drops_grads, "after the sync, no gradient on w1"),
]


@pytest.mark.parametrize("forward, sync, hint", EP_MORE, ids=[h[:40] for *_, h in EP_MORE])
def test_ep_more_mistakes_are_named(forward, sync, hint, monkeypatch):
    monkeypatch.setattr(C, "TIMEOUT", 60.0)
    with pytest.raises(AssertionError, match=f"(?s){hint}"):
        C.check_ep(forward, sync)


def test_capacity_on_the_global_batch_is_not_blamed_on_the_kept_filter():
    with pytest.raises(AssertionError) as err:
        C.check_ep(ep_cap_global, M.sync_grads)
    assert "dropped tokens included" not in str(err.value)


def test_experts_refuses_what_it_does_not_take():
    """layer.experts names what it takes (an int for all the rows is the learner's reading)."""
    full = M.MoE(4, 6, 4, 2, None, seed=1)
    layer = M.EPLayer.__new__(M.EPLayer)
    torch.nn.Module.__init__(layer)
    layer.local, layer.w1, layer.w2 = 2, full.w1[:2], full.w2[:2]
    layer.out_of_range, layer.seen = [], []
    rows = torch.randn(3, 4, dtype=M.DTYPE)
    with pytest.raises(TypeError, match="a tensor of local expert indices, one per row"):
        layer.experts(rows, 0)
    with pytest.raises(ValueError, match="one local expert index per row, 3 here"):
        layer.experts(rows, torch.tensor(0))
    assert layer.experts(rows, torch.tensor([0, 1, 0])).shape == rows.shape
