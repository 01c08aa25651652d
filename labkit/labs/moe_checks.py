"""Checks for moe_lab's exercises. Each runs the learner's code where its bug would show and
raises one AssertionError naming the case, with a "hint:" for the mistake it recognises.

    check_router(route, aux_loss)      in one process: softmax, top-k, renormalised gates with
                                       their gradient; Switch's aux loss (value and gradient) on
                                       unbalanced routings (balanced ones score 1 whatever P): first
                                       N = E tokens (an axis mix-up gives a value there), last one
                                       that leaves the last expert unchosen (bincount's minlength)
    check_dispatch(capacity, plan)     in one process: capacities (whole shares, a share round()
                                       takes up, shares it takes down), each assignment's rank, slot
                                       and kept mask (its dtype) for E = 6 experts on 3 ranks (so
                                       e // ep and e % ep differ from e // (E/ep))
    check_all_to_all(a2a, dispatch, combine)
                                       4 ranks, ep groups {0, 1} and {2, 3} of a 2 x 2 ("dp", "ep")
                                       mesh: the Function on uneven splits (an empty one included),
                                       forward and backward; dispatch then combine of rows whose
                                       "expert" scales them by its rank (one rank sends the last
                                       rank none), values, gradients and where a gradient stops
    check_ep(ep_forward, sync_grads)   4 ranks, the same mesh: the layer's output, aux loss and,
                                       after the sync, every gradient against one process's MoE on
                                       the whole batch (capacity factor 1.0: some tokens dropped);
                                       the local indices layer.experts was given; a second forward
                                       at factor PROBE_CF tells a capacity counted on more tokens
                                       than the rank's from none at all

The multi-rank checks run each piece of the learner's code inside tp_checks.shared's agreement
(every rank learns whether some rank raised before any goes on): an error on some ranks only,
while their peers wait for them in an all-to-all, ends the launch within seconds with the erring
rank's error, its line and its hint. What a piece returns is validated on its rank before use
(None, not a tensor, the wrong shape or dtype), each with its own hint. Left out: learner code
that hangs without raising is stopped by the launch's TIMEOUT, as "timed out".

The hints come from computing the classic mistakes' results here (the gates left unnormalised,
the aux loss on the wrong axis, the splits swapped, the combine left in the dispatch's order,
the expert gradients averaged over the world ...) and naming the one the learner's equals.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.distributed as dist

from labkit.checks import NOT_IMPLEMENTED
from labkit.checks import attempt as _attempt
from labkit.checks import fail as _fail
from labkit.labs import moe_lab as M
from labkit.labs.tp_checks import shared

ATOL = 1e-10
TIMEOUT = 120.0  # the launch's limit: only learner code that never returns (nor raises) meets it
PROBE_CF = 0.25  # check_ep's second forward: a capacity counted on more tokens than the rank's drops less


def _is_str(value) -> bool:
    return isinstance(value, str)


def _close(a, b, atol=ATOL) -> bool:
    return (
        isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and torch.allclose(a.to(M.DTYPE), b.to(M.DTYPE), rtol=0, atol=atol)
    )


def _diff(a, b) -> str:
    if not isinstance(b, torch.Tensor):
        return f"got {type(b).__name__}"
    if a.shape != b.shape:
        return f"shape {tuple(b.shape)}, expected {tuple(a.shape)}"
    return f"max |diff| {(a.to(M.DTYPE) - b.to(M.DTYPE)).abs().max().item():.3g}"


def _todo(*values) -> None:
    if any(_is_str(v) and v == NOT_IMPLEMENTED for v in values):
        raise NotImplementedError(NOT_IMPLEMENTED)


def _run(fn, *args, world_size=4):
    # tp_checks' launch: a rank whose learner code raised while its peers wait for it (CheckRaised)
    # leaves at once, and its error (with the learner's line) is what the kernel shows
    return shared._run(fn, *args, world_size=world_size, timeout=TIMEOUT)


# ---------------------------------------------------------------- the steps on the ranks
_LABELS = {
    "a2a": "forward",
    "a2a_grad": "backward",
    "combine_grad": "the gradient through dispatch and combine",
    "probe": f"a second forward at capacity factor {PROBE_CF} (where the capacity is counted shows there)",
    "sync": "sync_grads",
}


def _step(res, name, thunk, ctrl, where, hint, valid=None) -> bool:
    """res[name] = thunk()'s value, its error (shared._try) or what `valid` finds wrong with it
    ("what\nhint: hint"), then every rank agrees over ctrl: True when no rank erred. A rank
    whose thunk raised while a peer waits for it in a collective ends the launch (CheckRaised)."""
    value = shared._try(thunk)
    if valid is not None and not _is_str(value):
        value = valid(value) or value
    res[name] = value
    ok = shared._agree(value, where=f"{where}, {_LABELS.get(name, name)}", hint=hint, group=ctrl)
    if not ok:
        res["broken"] = name
    return ok


def _rows_of(what, value, d, dtype=None, rows=None):
    """Why `value` is not a (rows, d) tensor of the checks' dtype, as "what\nhint: ..."; None if it is."""
    dtype = dtype or M.DTYPE
    if value is None:
        return f"{what} returned None\nhint: return the tensor (a forgotten `return`?)"
    if not isinstance(value, torch.Tensor):
        return f"{what} returned {type(value).__name__}, not a tensor\nhint: return a torch.Tensor of rows (n, {d})"
    if value.ndim != 2 or value.shape[1] != d or (rows is not None and value.shape[0] != rows):
        want = f"({rows if rows is not None else 'n'}, {d})"
        return (
            f"{what} returned shape {tuple(value.shape)}, expected {want}\nhint: rows stay rows: one "
            f"row of {d} numbers per token (no flatten, no transpose, no extra dimension)"
        )
    if value.dtype != dtype:
        return (
            f"{what} returned dtype {value.dtype}, expected {dtype}\nhint: keep the rows' dtype: "
            "allocate with x.new_empty(...) (or dtype=x.dtype), not torch.empty's default float32"
        )
    return None


def _errors(results, names, where, hints) -> None:
    """The first step (in `names` order) that some rank's error string stopped: that rank's error
    (with the learner's line), and its hint (its own "\nhint:", else hints[name](error))."""
    for name in names:
        for rank, res in enumerate(results):
            value = res.get(name)
            if _is_str(value):
                what, sep, hint = value.partition("\nhint: ")
                shared._fail(
                    f"{where(rank)}, {_LABELS.get(name, name)}: {what}", hint if sep else hints[name](value)
                )


# ---------------------------------------------------------------- 1. the router
def _logits(n, e, seed):
    return torch.randn(n, e, dtype=M.DTYPE, generator=torch.Generator().manual_seed(seed)) * 2


def _by_expert(idx, gates, n_experts):
    """(N, E) gate per expert (0 where not chosen): compares answers whatever the top-k's order."""
    return torch.zeros(idx.shape[0], n_experts, dtype=M.DTYPE).scatter(1, idx, gates.to(M.DTYPE))


def check_router(route: Callable, aux_loss: Callable) -> None:
    for n, e, k, seed in ((6, 4, 2, 0), (5, 8, 3, 1), (4, 4, 1, 2)):
        _router_case(route, n, e, k, seed)
    for case in AUX_CASES:
        _aux_case(aux_loss, *case)
    print(
        "the router: softmax over the experts, the top-k, gates renormalised (with their gradient); "
        f"the aux loss E·Σ f_e·P_e, its value and gradient (atol {ATOL:g})"
    )


def _router_case(route, n, e, k, seed):
    logits = _logits(n, e, seed).requires_grad_()
    where = f"route, {n} tokens, {e} experts, top-{k}"
    got = _attempt(route, logits, k)
    _todo(got)
    if _is_str(got):
        _fail(f"{where}: {got}", "see the error above")
    if not isinstance(got, tuple) or len(got) != 3:
        _fail(f"{where}: returned {type(got).__name__}", "return (probs, topk_idx, gates)")
    probs, idx, gates = got
    want_p, want_i, want_g = M.route(logits.detach(), k)
    if not _close(want_p, probs):
        hint = "probs: softmax of the logits over the experts (dim -1)"
        if _close(torch.softmax(logits.detach(), 0), probs):
            hint = "softmax over the tokens (dim 0): each token's probabilities are over the experts, dim -1"
        _fail(f"{where}, probs: {_diff(want_p, probs)}", hint)
    if not isinstance(idx, torch.Tensor) or idx.shape != want_i.shape:
        _fail(f"{where}, topk_idx: {_diff(want_i, idx)}", "topk_idx is (N, k): probs.topk(k, dim=-1)")
    if not torch.equal(idx.sort(-1).values, want_i.sort(-1).values):
        hint = "topk_idx: the k MOST probable experts of each token"
        if torch.equal(idx.sort(-1).values, probs.detach().topk(k, -1, largest=False)[1].sort(-1).values):
            hint = "the k least probable experts: topk's default, largest=True, takes the most probable"
        _fail(f"{where}, topk_idx: other experts than the k most probable", hint)
    if not isinstance(gates, torch.Tensor) or gates.shape != want_g.shape:
        _fail(f"{where}, gates: {_diff(want_g, gates)}", "gates is (N, k), one per chosen expert")
    mine = _by_expert(idx, gates.detach(), e)
    if not _close(_by_expert(want_i, want_g, e), mine):
        top = probs.detach().gather(1, idx)
        if _close(_by_expert(idx, top, e), mine):
            hint = (
                "gates not renormalised after top-k: divide the k probabilities by their sum, so each "
                "token's output is a weighted average of its experts"
            )
        elif _close(_by_expert(idx, torch.softmax(top, -1), e), mine):
            hint = (
                "softmax after top-k: the k probabilities went through a second softmax; renormalise "
                "them by their sum (softmax of the k LOGITS would be the same thing)"
            )
        else:
            hint = "gates: the chosen probabilities divided by their sum"
        _fail(f"{where}, gates: {_diff(_by_expert(want_i, want_g, e), mine)}", hint)
    if not gates.requires_grad:
        _fail(
            f"{where}, gates: no gradient reaches the logits",
            "the gates are detached (or built from topk_idx alone): the router learns through them",
        )


# (tokens, experts, top-k, seed, the last expert left without assignments). None balanced: with
# every f_e = 1/E the loss is 1 whatever P (the uniform router's value), so a wrong formula would
# read "expected 1"; the first is square (N = E), where P on the wrong axis still gives a number;
# the last leaves expert E-1 unchosen, where a bincount without minlength comes out one short.
AUX_CASES = ((4, 4, 2, 10, False), (10, 4, 2, 13, False), (7, 6, 3, 5, False), (6, 5, 2, 9, True))


def _aux_case(aux_loss, n, e, k, seed, starve_last=False):
    logits = _logits(n, e, seed)
    if starve_last:
        logits[:, -1] -= 50  # expert e-1: never in the top-k
    logits.requires_grad_()
    probs, idx, _ = M.route(logits, k)
    where = f"aux loss, {n} tokens, {e} experts, top-{k}" + (
        f" (expert {e - 1}, the last, gets no assignment)" if starve_last else ""
    )
    got = _attempt(aux_loss, probs, idx.clone(), e)
    _todo(got)
    wrong_axis = (
        "the aux loss on the wrong axis: P_e is the mean over the TOKENS (probs.mean(dim=0), one per "
        "expert), f_e the fraction of assignments per expert"
    )
    if _is_str(got):
        hint = "see the error above"
        if "size of tensor" in got or "must match" in got:
            hint = wrong_axis
            if starve_last and f"({e - 1})" in got:
                hint = (
                    f"bincount without minlength: no assignment went to expert {e - 1}, so "
                    f"torch.bincount(topk_idx.reshape(-1)) counted {e - 1} experts, not {e}; pass "
                    "minlength=n_experts (one count per expert, 0 for an expert nobody chose)"
                )
        _fail(f"{where}: {got}", hint)
    want = M.load_balancing_loss(probs.detach(), idx, e)
    if not isinstance(got, torch.Tensor) or got.numel() != 1:
        _fail(f"{where}: {_diff(want, got)}", "return one number (a 0-d tensor): E · Σ_e f_e · P_e")
    got0 = got.reshape(())
    if not _close(want, got0.detach()):
        p = probs.detach()
        f = torch.bincount(idx.reshape(-1), minlength=e).to(M.DTYPE)
        cands = [
            (e * (f / idx.numel() * p.mean(1)[:e]).sum() if n == e else None, wrong_axis),
            (
                want / e,
                "the Switch loss is multiplied by the number of experts E (so uniform routing scores 1)",
            ),
            (want * k, "f_e is the fraction of the N·k assignments (divide the counts by N·k, not N)"),
            (
                e * (p.mean(0) ** 2).sum(),
                "f_e counts the assignments (bincount of topk_idx), not the mean probability",
            ),
            (
                e * (f / idx.numel() * p.sum(0)).sum(),
                "P_e is the MEAN probability over the tokens, not the sum",
            ),
        ]
        hint = next((h for c, h in cands if c is not None and _close(c, got0.detach())), "E · Σ_e f_e · P_e")
        _fail(f"{where}: {got0.item():.6g}, expected {want.item():.6g}", hint)
    if not got.requires_grad:
        _fail(
            f"{where}: no gradient reaches the router",
            "P_e must come from probs, not detached: the aux loss trains the router through P",
        )
    (g,) = torch.autograd.grad(got0, logits, retain_graph=True)
    (want_g,) = torch.autograd.grad(M.load_balancing_loss(probs, idx, e), logits)
    if not _close(want_g, g):
        _fail(
            f"{where}, gradient: {_diff(want_g, g)}",
            "only P_e carries the gradient; f_e is a count (from topk_idx, no gradient)",
        )


# ---------------------------------------------------------------- 2. the dispatch
# whole shares, a share that round() takes up (4.67: the same as ceil) before shares it takes down
# (6.25, 2.33, 4.5 → 4: Python rounds half to even), so rounding to nearest shows apart from int()
CAPACITY_CASES = ((24, 4, 2, 1.0), (7, 3, 2, 1.0), (10, 4, 2, 1.25), (7, 3, 1, 1.0), (9, 6, 2, 1.5))


def check_dispatch(capacity: Callable, plan: Callable) -> None:
    rounded_up = []  # the fractional shares the learner's capacity took up (as ceil does)
    for n, e, k, cf in CAPACITY_CASES:
        want = M.capacity(n, e, k, cf)
        got = _attempt(capacity, n, e, k, cf)
        _todo(got)
        where = f"capacity({n} tokens, {e} experts, top-{k}, factor {cf})"
        share = cf * n * k / e
        if got != want:
            up = ", ".join(f"{s:.3g} up to {c}" for s, c in rounded_up)
            cands = [
                (
                    int(share) if rounded_up else None,
                    f"capacity rounded to nearest (round()): it took {up} but {share:.3g} down to {got}; "
                    "ceil (math.ceil) always rounds up, so the even share always fits",
                ),
                (int(share), "capacity off by one: rounded down; a fractional share needs ceil (math.ceil)"),
                (want + 1, "capacity off by one: one slot too many; ceil(factor·N·k/E), no +1"),
                (M.capacity(n, e, 1, cf), "capacity without top_k: each token makes k assignments"),
            ]
            hint = next(
                (h for c, h in cands if got == c), "ceil(capacity_factor · n_tokens · top_k / n_experts)"
            )
            _fail(f"{where}: {got}, expected {want}", hint)
        if int(share) != share:
            rounded_up.append((share, got))
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(12)])
    idx[:5, 0] = 1  # expert 1 popular: drops with a capacity of 3
    for cap in (3, 5, None):
        _plan_case(plan, idx, 6, cap, 3)
    print("capacity: ceil(factor·N·k/E) on every case; the plan: every assignment's rank, slot and kept flag")


def _plan_case(plan, idx, e, cap, ep):
    where = f"dispatch_plan, {len(idx)} tokens, top-{idx.shape[1]}, {e} experts on {ep} ranks, capacity {cap}"
    got = _attempt(plan, idx.clone(), e, cap, ep)
    _todo(got)
    if _is_str(got):
        _fail(f"{where}: {got}", "see the error above")
    if not isinstance(got, tuple) or len(got) != 3:
        _fail(f"{where}: returned {type(got).__name__}", "return (dest_rank, slot, kept), each (N, k)")
    dest, slot, kept = (torch.as_tensor(t) for t in got)
    want_d, want_s, want_k = M.dispatch_plan(idx, e, cap, ep)
    if not torch.equal(want_d, dest):
        cands = [
            (
                idx % ep,
                "experts sit in contiguous blocks: rank r holds [r·E/ep, (r+1)·E/ep), dest = e // (E/ep), not e % ep",
            ),
            (idx // ep, "each rank holds E/ep experts: dest = e // (E/ep), not e // ep"),
        ]
        hint = next((h for c, h in cands if torch.equal(c, dest)), "dest = expert // (E/ep)")
        _fail(f"{where}, dest_rank: {dest.tolist()[:4]}..., expected {want_d.tolist()[:4]}...", hint)
    if not torch.equal(want_s, slot):
        flat_rank = want_d.reshape(-1)
        oh = torch.nn.functional.one_hot(flat_rank, ep)
        per_rank = ((oh.cumsum(0) - 1) * oh).sum(-1).reshape(idx.shape)
        t_idx = idx.T.contiguous()
        choice_major = M.dispatch_plan(t_idx, e, cap, ep)[1].T
        cands = [
            (want_s + 1, "slots count from 0: the first assignment to an expert takes slot 0"),
            (per_rank, "slot counted per destination rank: each EXPERT has its own buffer of slots"),
            (
                choice_major,
                "slots fill in token order (token 0's choices, then token 1's ...), not choice by choice",
            ),
        ]
        hint = next(
            (h for c, h in cands if torch.equal(c, slot)),
            "slot = how many earlier assignments (token-major) went to the same expert",
        )
        _fail(f"{where}, slot: {_diff(want_s, slot)}", hint)
    if kept.shape != want_k.shape:
        _fail(
            f"{where}, kept: shape {tuple(kept.shape)}, expected {tuple(want_k.shape)}",
            "kept is a mask, one True/False per assignment, shaped like topk_idx (N, k)"
            + (": not the count of kept assignments" if kept.numel() == 1 else ""),
        )
    if kept.dtype != torch.bool:
        same = torch.equal(kept.to(torch.int64), want_k.to(torch.int64))
        _fail(
            f"{where}, kept: dtype {kept.dtype}, expected torch.bool"
            + (" (the right assignments marked)" if same else ""),
            f"kept is a boolean mask (True where kept), not {kept.dtype} 0/1 counts: slot < capacity is "
            "a bool tensor already (no .int(), .long() or .float()); an integer tensor used as an index "
            "picks rows 0 and 1 instead of masking",
        )
    if not torch.equal(want_k, kept):
        if cap is None:
            hint = "capacity None is the dropless mode: every assignment kept"
        elif torch.equal(slot <= cap, kept):
            hint = (
                "a buffer of `capacity` slots holds slots 0..capacity-1: kept is slot < capacity (off by one)"
            )
        else:
            hint = "kept = slot < capacity (a bool tensor)"
        said = f"{int(kept.sum())} kept, expected {int(want_k.sum())}"
        if int(kept.sum()) == int(want_k.sum()):
            said = f"{int((kept != want_k).sum())} assignments marked otherwise (as many kept: {int(kept.sum())})"
        _fail(f"{where}, kept: {said}", hint)


# ---------------------------------------------------------------- 3. the all-to-all pair
SEND = {0: [2, 0], 1: [3, 1]}  # rows group rank i sends to each group rank: uneven, one empty
D = 3
DESTS = {
    0: torch.tensor([1, 0, 1, 1, 0]),
    1: torch.tensor([0, 0, 0, 0, 0]),
}  # group rank 0 gets 2 + 5 rows, 1 gets 3 + 0: group rank 1 sends the last rank (itself) none, so
# a count of rows per rank without minlength (torch.bincount(dest)) comes out one short there


def _rows(rank, n, scale=1.0):
    return (torch.arange(n * D, dtype=M.DTYPE).reshape(n, D) + 100 * rank + 1) * scale


def _a2a_rank(a2a, dispatch, combine):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ctrl = dist.new_group(backend="gloo")  # the agreement's own group (see shared._agree)
    group, rank = mesh.get_group("ep"), dist.get_rank()
    r = dist.get_rank(group)
    where = f"rank {rank} (index {r} in ep group {_peers(rank)})"
    send, recv = SEND[r], [SEND[i][r] for i in range(2)]
    res: dict = {}
    x = _rows(rank, sum(send)).requires_grad_()

    def step(name, thunk, hint, valid, label=where):
        return _step(res, name, thunk, ctrl, label, hint, valid)

    a2a_valid = lambda v: _rows_of("the all-to-all's forward", v, D)  # noqa: E731
    if not step(
        "a2a", lambda: a2a(x, list(recv), list(send), group), _a2a_hint, a2a_valid, f"{where}, the all-to-all"
    ):
        return res
    out, res["a2a"] = res["a2a"], res["a2a"].detach().clone()
    up = _rows(rank, out.shape[0], -0.5)
    grad_valid = lambda g: _grad_of("the all-to-all's backward", g, x)  # noqa: E731
    if not step(
        "a2a_grad", lambda: _grad(out, x, up), _a2a_grad_hint, grad_valid, f"{where}, the all-to-all"
    ):
        return res
    res["a2a_grad"] = res["a2a_grad"].clone()
    # dispatch / combine: 5 rows, destinations within the group, the "expert" scales by (10 + rank)
    xs = _rows(rank, 5, 0.1).requires_grad_()
    dest = DESTS[r].clone()
    hint = lambda m: _a2a_hint(m, exchanged=False)  # noqa: E731
    if not step("dispatch", lambda: dispatch(xs, dest.clone(), group), hint, _dispatch_valid):
        return res
    received, plan = res["dispatch"]
    res["dispatch"] = received.detach().clone()
    valid = lambda v: _rows_of("combine", v, D, rows=len(xs)) or _detached("combine's output", v, "combine")  # noqa: E731
    if not step("combine", lambda: combine(received * (10 + r), plan, group), _combine_hint, valid):
        return res
    back, res["combine"] = res["combine"], res["combine"].detach().clone()
    valid = lambda g: _combine_grad_valid(g, xs)  # noqa: E731
    if step("combine_grad", lambda: _grad(back.square().sum(), xs), lambda _: "see the error above", valid):
        res["combine_grad"] = res["combine_grad"].clone()
    return res


_DETACHED = (
    "a .detach(), .data, torch.no_grad(), or all_to_all_single called directly (it writes into a tensor "
    "with no gradient): send the rows with your autograd Function (MyAllToAll.apply), so the gradient "
    "comes back the way the rows went"
)


def _detached(what, value, piece):
    """Why `value` (built from rows that carry a gradient) is detached, as "what\nhint: ..."; None if not."""
    if not value.requires_grad:
        return f"{what}: no gradient, detached from the input rows\nhint: detached in {piece}: {_DETACHED}"
    return None


def _combine_grad_valid(g, xs):
    if g is None:
        return (
            "the gradient through dispatch and combine: none reached dispatch's input rows: combine's "
            f"output is detached from the rows it was given\nhint: detached in combine: {_DETACHED}"
        )
    return _rows_of("the gradient through dispatch and combine", g, xs.shape[1], rows=len(xs))


def _grad(out, x, up=None):
    return torch.autograd.grad(out, x, up, allow_unused=True)[0]


def _grad_of(what, g, x):
    if g is None:
        return (
            f"{what}: no gradient reached the input rows\nhint: backward returns (grad of x, None, None, "
            "None): the reverse all-to-all of grad"
        )
    return _rows_of(what, g, x.shape[1], rows=len(x))


def _dispatch_valid(got):
    if not isinstance(got, tuple) or len(got) != 2:
        return (
            f"dispatch returned {type(got).__name__ if got is not None else 'None'}\nhint: dispatch "
            "returns a pair: (the rows received, plan), plan being what combine needs (order, send, recv)"
        )
    return _rows_of("dispatch's received rows", got[0], D) or _detached(
        "dispatch's received rows", got[0], "dispatch"
    )


def _a2a_grad_hint(g):
    if "invalid gradient" in g:
        return (
            "backward returned the gradient as it came (the received rows' shape): it must travel back "
            "through the reverse all-to-all, to the x this rank sent"
        )
    if "split" in g.lower() or "size" in g.lower():
        return (
            "backward sends each gradient row back where its row came from: the forward's splits swapped "
            "(output_split_sizes=send_splits, input_split_sizes=recv_splits)"
        )
    return "backward returns (grad of x, None, None, None): the reverse all-to-all of grad"


def _combine_hint(_message):
    return "combine is dispatch reversed: it sends plan's recv counts and receives its send counts"


EP_GROUP = 2  # the checks' ep groups' size (a 2 x 2 mesh): a list of another length for the world's 4


def _a2a_hint(message: str, exchanged: bool = True) -> str:
    length = re.search(
        r"(?:has (\d+) (?:entries|count\(s\)), (?:not )?|dim 0 \((\d+)\) does not divide equally across )"
        r"the group (?:size )?(\d+)",
        message,
    )  # a list of counts, or a tensor of them, against the group's size
    have, size = (int(length[1] or length[2]), int(length[3])) if length else (0, 0)
    if length and have < size == EP_GROUP:  # the ep group, and fewer counts than its ranks
        return (
            "bincount without minlength: no row goes to the group's last rank here, so "
            "torch.bincount(dest) came out one count short; pass minlength=the group's size "
            "(dist.get_world_size(group)): one count per rank, 0 for a rank no row goes to"
        )
    if length and size != EP_GROUP:
        return (
            f"the wrong group: a group of {size} ranks where the ep group ({EP_GROUP}) belongs: the "
            "all-to-alls and the count exchange run over the group given (its split lists have one entry "
            "per ep rank), not the world"
        )
    if "save_for_backward" in message:
        return (
            "ctx.save_for_backward takes tensors only: keep the split lists and the group as ctx "
            "attributes (ctx.splits = ..., ctx.group = group)"
        )
    if "disagree" in message and not exchanged:
        return (
            "the ranks disagree on the split sizes: what rank j receives from rank i must be what rank i "
            "sends it; recv counts come from the peers (exchange the counts with an all-to-all first), "
            "not copied from send"
        )
    if "split" in message.lower() and (
        "world" in message.lower() or "group" in message.lower() or "length" in message.lower()
    ):
        return "the wrong group: the all-to-all runs over the ep group (its split lists have one entry per ep rank), not the world"
    if "split" in message.lower() or "size" in message.lower() or "shape" in message.lower():
        return (
            "split sizes sent instead of received? output_split_sizes are the rows this rank RECEIVES "
            "from each rank (recv_splits), input_split_sizes the rows it sends (send_splits)"
        )
    return "see the error above"


def check_all_to_all(a2a: Callable, dispatch: Callable, combine: Callable) -> None:
    from labkit.launch._report import RankError

    try:
        results = _run(_a2a_rank, a2a, dispatch, combine)
    except RankError as exc:  # gloo aborts a rank when the sizes sent and expected disagree
        said = str(exc)
        if "size" not in said and "mismatch" not in said:
            raise
        _fail(
            f"the all-to-all aborted a rank: {said.splitlines()[0]} ({said.splitlines()[2].strip()[:160]})",
            "the ranks disagree on the split sizes: what rank j receives from rank i must be what rank i "
            "sends it; recv counts come from the peers (exchange the counts with an all-to-all first), "
            "not copied from send",
        )
    _todo(*(res.get(k) for res in results for k in ("a2a", "dispatch", "combine", "a2a_grad")))
    in_group = lambda rank: f"rank {rank} (index {rank % 2} in ep group {_peers(rank)})"  # noqa: E731
    a2a_where = lambda rank: f"{in_group(rank)}, the all-to-all"  # noqa: E731
    for name, where, hint, check in (  # each step's errors, then its values, in the order they ran
        ("a2a", a2a_where, _a2a_hint, _check_a2a_forward),
        ("a2a_grad", a2a_where, _a2a_grad_hint, _check_a2a_backward),
        ("dispatch", in_group, lambda m: _a2a_hint(m, exchanged=False), _check_dispatch_rows),
        ("combine", in_group, _combine_hint, _check_combine_rows),
        ("combine_grad", in_group, lambda _: "see the error above", _check_combine_grad),
    ):
        _errors(results, (name,), where, {name: hint})
        for rank, res in enumerate(results):
            check(rank, res)
    print(
        "the all-to-all: uneven splits (an empty one) forward and backward on both ep groups; "
        "dispatch then combine: every row to its rank and back in its place, with its gradient"
    )


def _peers(rank):
    return [rank // 2 * 2, rank // 2 * 2 + 1]


# the values of each step (its errors and bad returns failed in _errors already, each with its hint)
def _check_a2a_forward(rank, res):
    r, peers = rank % 2, _peers(rank)
    where = f"rank {rank} (index {r} in ep group {peers}), the all-to-all"
    out = res["a2a"]
    pieces = {p: torch.split(_rows(p, sum(SEND[p % 2])), SEND[p % 2]) for p in peers}
    want = torch.cat([pieces[p][r] for p in peers])
    if not _close(want, out):
        hint = "row block i of the output comes from group rank i: the rows it sent to this rank"
        if _close(_rows(rank, sum(SEND[r])), out):
            hint = (
                "the forward returned its input: it returns the sum(output_split_sizes) rows received, "
                "written by all_to_all_single into a new tensor"
            )
        _fail(f"{where}, forward: {_diff(want, out)}", hint)


def _check_a2a_backward(rank, res):
    r, peers = rank % 2, _peers(rank)
    where = f"rank {rank} (index {r} in ep group {peers}), the all-to-all"
    g = res["a2a_grad"]
    ups = {p: _rows(p, sum(SEND[i][p % 2] for i in range(2)), -0.5) for p in peers}
    recvs = {p: [SEND[i][p % 2] for i in range(2)] for p in peers}
    want = torch.cat([torch.split(ups[p], recvs[p])[r] for p in peers])
    if not _close(want, g):
        _fail(
            f"{where}, backward: {_diff(want, g)}",
            "backward sends each gradient row back where its row came from: the same all-to-all with the "
            "splits swapped, its result returned",
        )


def _pair_expected(rank):
    r, peers = rank % 2, _peers(rank)
    dests = {p: DESTS[p % 2] for p in peers}
    xs = {p: _rows(p, 5, 0.1) for p in peers}
    received = torch.cat(
        [xs[p][torch.argsort(dests[p], stable=True)][dests[p].sort(stable=True).values == r] for p in peers]
    )
    x, d = xs[rank], dests[rank]
    back = x * (10 + d)[:, None].to(M.DTYPE)
    return received, back, 2 * back * (10 + d)[:, None].to(M.DTYPE), x, d


def _unsorted_received(rank):
    r, peers = rank % 2, _peers(rank)
    rows = []
    for p in peers:
        d = DESTS[p % 2]
        counts = torch.bincount(d, minlength=2).tolist()
        rows.append(torch.split(_rows(p, 5, 0.1), counts)[r])
    return torch.cat(rows)


def _check_dispatch_rows(rank, res):
    where = f"rank {rank} (index {rank % 2} in ep group {_peers(rank)})"
    received, back, grad, x, d = _pair_expected(rank)
    got = res["dispatch"]
    if not _close(received, got):
        hint = "dispatch: sort the rows by destination rank (stable), count them per rank, one all-to-all"
        if _close(_unsorted_received(rank), got):
            hint = "the rows not sorted by destination first: all-to-all sends the first send[0] rows to rank 0, the next send[1] to rank 1 ..."
        elif got.shape == received.shape and _close(received.sort(0).values, got.sort(0).values):
            hint = "the right rows in another order: sort by destination with a STABLE sort, each source's rows in their order"
        _fail(f"{where}, dispatch: rows received {_diff(received, got)}", hint)


def _check_combine_rows(rank, res):
    where = f"rank {rank} (index {rank % 2} in ep group {_peers(rank)})"
    received, back, grad, x, d = _pair_expected(rank)
    out = res["combine"]
    if not _close(back, out):
        order = torch.argsort(d, stable=True)
        hint = "combine: the reverse all-to-all, then each row back to its place (undo the sort)"
        if _close(back[order], out):
            hint = "combine in the dispatch's order: the rows come back sorted by rank; undo the sort (out[order] = rows)"
        elif _close(back[order][order], out) or _close(back[torch.argsort(order)][order], out):
            hint = (
                "the sort undone the wrong way: rows[argsort(order)] (or out[order] = rows), not rows[order]"
            )
        _fail(f"{where}, combine: {_diff(back, out)}", hint)


def _check_combine_grad(rank, res):
    where = f"rank {rank} (index {rank % 2} in ep group {_peers(rank)})"
    received, back, grad, x, d = _pair_expected(rank)
    g = res["combine_grad"]
    if not _close(grad, g):
        _fail(
            f"{where}, the gradient through dispatch and combine: {_diff(grad, g)}",
            "the values are right but not their gradient, and the all-to-all's own backward passed: "
            "something between the rows and the all-to-alls bends the gradient (a .detach() or .data "
            "mixed in, a tensor rebuilt from values)",
        )


# ---------------------------------------------------------------- 4. the EP layer
EP = dict(d=6, hidden=8, experts=4, top_k=2, capacity_factor=1.0, tokens=12, aux_coef=0.1)


def _full(capacity_factor=EP["capacity_factor"]):
    return M.MoE(EP["d"], EP["hidden"], EP["experts"], EP["top_k"], capacity_factor, seed=5)


def _x():
    return torch.randn(4 * EP["tokens"], EP["d"], dtype=M.DTYPE, generator=torch.Generator().manual_seed(6))


def _ep_rank(ep_forward, sync_grads):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ctrl = dist.new_group(backend="gloo")  # the agreement's own group (see shared._agree)
    layer = M.EPLayer(_full(), mesh.get_group("ep"))
    rank = dist.get_rank()
    x = torch.chunk(_x(), 4)[rank]
    where = _ep_where(rank)
    res: dict = {}
    valid = lambda got: _ep_valid(got, x)  # noqa: E731
    if not _step(res, "forward", lambda: ep_forward(layer, x), ctrl, where, _ep_error_hint, valid):
        return res
    y, aux = res["forward"]
    res.update(forward=(y.detach().clone(), aux.detach().clone()), out_of_range=layer.out_of_range)
    res["seen"] = torch.cat(layer.seen).tolist() if layer.seen else []
    # a second forward where a capacity counted on more tokens than this rank's still drops (at
    # factor 1.0 it would keep everything, as no capacity at all does): read by _ep_forward_hint only
    probe = M.EPLayer(_full(PROBE_CF), mesh.get_group("ep"))
    if _step(res, "probe", lambda: ep_forward(probe, x), ctrl, where, _ep_error_hint):
        res["probe"] = res["probe"][0].detach().clone() if isinstance(res["probe"], tuple) else None
    loss = lambda: (y.square().sum(-1).mean() + EP["aux_coef"] * aux.reshape(())).backward()  # noqa: E731
    if not _step(res, "backward", loss, ctrl, where, _a2a_grad_hint, lambda _: _no_grads(layer, "backward")):
        return res
    res["local"] = {n: p.grad.clone() for n, p in layer.named_parameters()}
    sync = lambda: sync_grads(layer, mesh.get_group("dp"))  # noqa: E731
    if not _step(res, "sync", sync, ctrl, where, _sync_error_hint, lambda _: _no_grads(layer, "the sync")):
        return res
    res["sync"] = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return res


def _ep_where(rank):
    return f"rank {rank} (ep index {rank % 2}, dp index {rank // 2})"


def _ep_valid(got, x):
    if not isinstance(got, tuple) or len(got) != 2:
        return (
            f"ep_forward returned {type(got).__name__ if got is not None else 'None'}\nhint: ep_forward "
            "returns a pair: (y, aux), y the layer's output (one row per token), aux the load-balancing loss"
        )
    y, aux = got
    bad = _rows_of("ep_forward's y", y, x.shape[1], rows=len(x))
    if bad:
        return bad
    if not isinstance(aux, torch.Tensor) or aux.numel() != 1:
        shape = tuple(aux.shape) if isinstance(aux, torch.Tensor) else type(aux).__name__
        return (
            f"ep_forward's aux is {shape}, expected one number\nhint: aux is this rank's "
            "load_balancing_loss(probs, idx, E): a 0-d tensor"
        )
    if not y.requires_grad:
        return (
            "ep_forward's y carries no gradient\nhint: y is built from the experts' outputs and the gates "
            "(no .detach(), no torch.no_grad()): the experts and the router learn through it"
        )
    return None


def _no_grads(layer, after):
    missing = [n for n, p in layer.named_parameters() if p.grad is None]
    if missing:
        return (
            f"after {after}, no gradient on {', '.join(missing)}\nhint: every parameter gets a gradient: "
            "the router through the gates and the aux loss, each local expert through the rows it received "
            "(the all-to-all's backward)"
        )
    return None


def _sync_error_hint(message):
    if "DeviceMesh" in message:
        return "group= takes a ProcessGroup: dp_group is one already (use it as it is)"
    return "router: all-reduce over the world; experts: over dp_group; both divided by the world size"


def check_ep(ep_forward: Callable, sync_grads: Callable) -> None:
    results = _run(_ep_rank, ep_forward, sync_grads)
    _todo(*(r.get("forward") for r in results), *(r.get("sync") for r in results))
    full, x = _full(), _x()
    y, aux = full(x, groups=4)
    (y.square().sum(-1).mean() + EP["aux_coef"] * aux).backward()
    local = EP["experts"] // 2
    _errors(results, ("forward",), _ep_where, {"forward": _ep_error_hint})
    _dest_as_expert(results, full)
    for rank, res in enumerate(results):
        if res.get("out_of_range"):
            _fail(
                f"rank {rank}, layer.experts got local expert indices {res['out_of_range']}",
                "this rank holds experts [first, first + E/ep): the local index is expert - layer.first",
            )
    for rank, res in enumerate(results):
        where = f"rank {rank} (ep index {rank % 2}, dp index {rank // 2})"
        my_y, my_aux = res["forward"]
        want = torch.chunk(y.detach(), 4)[rank]
        if not _close(want, my_y):
            _fail(f"{where}, output: {_diff(want, my_y)}", _ep_forward_hint(rank, my_y, res.get("probe")))
        if not _close(full.last["aux"][rank], my_aux.reshape(())):
            _fail(
                f"{where}, aux loss {my_aux.item():.6g}, expected {full.last['aux'][rank].item():.6g}",
                "the aux loss of this rank's tokens: load_balancing_loss(probs, idx, E)",
            )
    _errors(results, ("backward", "sync"), _ep_where, {"backward": _a2a_grad_hint, "sync": _sync_error_hint})
    for rank, res in enumerate(results):
        where = _ep_where(rank)
        first = (rank % 2) * local
        want = {
            "router": full.router.grad,
            "w1": full.w1.grad[first : first + local],
            "w2": full.w2.grad[first : first + local],
        }
        got = res["sync"]
        for name, w in want.items():
            if _close(w, got[name]):
                continue
            _fail(
                f"{where}, {name}'s gradient after the sync: {_diff(w, got[name])}",
                _sync_hint(name, rank, results, w),
            )
    print(
        f"the EP layer: every rank's output, aux loss and, after the sync, the router's and its experts' "
        f"gradients equal one process's on the whole batch (capacity factor {EP['capacity_factor']}, "
        f"{full.last['dropped']} of {full.last['assignments']} assignments dropped; atol {ATOL:g})"
    )


def _ep_error_hint(message):
    if "layer.experts(rows, local_expert)" in message:
        return (
            "layer.experts(rows, local_index) takes a tensor of local expert indices, one per row (each "
            "row's expert - layer.first, e.g. from the expert indices you dispatched with the rows), "
            "not one int for all the rows"
        )
    if "index" in message and "out of bounds" in message or "out of range" in message:
        return "this rank holds experts [first, first + E/ep): the local index is expert - layer.first"
    return _a2a_hint(message)


def _dest_as_expert(results, full):
    """Every rank's experts given its own ep index (dest sent as the expert), as is or less
    layer.first, where the rows it received are for both its experts: fails naming it."""
    local = EP["experts"] // 2
    given = {"dest": [], "dest - layer.first": []}
    for rank, res in enumerate(results):
        r, seen = rank % 2, res.get("seen") or []
        want = []
        for p in _peers(rank):
            x = torch.chunk(_x(), 4)[p]
            _, idx, _ = M.route(x @ full.router.detach().T, EP["top_k"])
            cap = M.capacity(len(x), EP["experts"], EP["top_k"], EP["capacity_factor"])
            dest, _, kept = M.dispatch_plan(idx, EP["experts"], cap, 2)
            want += (idx[kept & (dest == r)] - r * local).tolist()
        if len(set(want)) < 2 or sorted(seen) == sorted(want):
            return
        given["dest"].append(bool(seen) and set(seen) == {r})
        given["dest - layer.first"].append(bool(seen) and set(seen) == {r - r * local})
    for how, ranks in given.items():
        if all(ranks):
            _fail(
                f"every rank's layer.experts got the local index {how} for all its rows (rank 1: "
                f"{sorted(set(results[1]['seen']))}), where its rows are for {local} experts",
                "the destination rank sent as the expert index: the second dispatch carries each row's "
                "EXPERT, idx[tok, j] (0..E-1; dest[tok, j] is the rank it goes to, the same for every row "
                "a rank receives); on its rank, the local index is expert - layer.first",
            )


def _rank_output(x, cap, gated=True):
    """One process's output for these tokens with this capacity (None: dropless)."""
    full = _full()
    probs, idx, gates = M.route(x @ full.router.detach().T, EP["top_k"])
    _, _, kept = M.dispatch_plan(idx, EP["experts"], cap, 1)
    y = torch.zeros_like(x)
    for e in range(EP["experts"]):
        tok, j = torch.nonzero((idx == e) & kept, as_tuple=True)
        out = full.expert(e, x[tok]).detach()
        y = y.index_add(0, tok, gates[tok, j, None] * out if gated else out)
    return y


def _ep_forward_hint(rank, got, probe=None):
    x = torch.chunk(_x(), 4)[rank]
    e, k = EP["experts"], EP["top_k"]
    cap = M.capacity(len(x), e, k, EP["capacity_factor"])
    if _close(_rank_output(x, None), got):  # everything kept: no filter, or a capacity on more tokens
        hint = "dropped tokens included: an assignment with slot >= capacity contributes nothing"
        if isinstance(probe, torch.Tensor):
            for tokens, batch in (
                (len(x) * 4, "the global batch (all 4 ranks' tokens)"),
                (len(x) * 2, "the ep group's tokens"),
            ):
                if not _close(_rank_output(x, None), probe) and _close(
                    _rank_output(x, M.capacity(tokens, e, k, PROBE_CF)), probe
                ):
                    hint = (
                        f"the capacity counted on {batch}, {tokens} tokens: it is counted on THIS rank's "
                        f"tokens, capacity(len(x), ...) (GShard's groups: each rank's buffers hold its own "
                        f"tokens' assignments); at factor {EP['capacity_factor']} yours keeps every assignment"
                    )
        return hint
    if _close(_rank_output(x, cap, gated=False), got):
        return "the experts' outputs not weighted by the gates: y[token] += gate · expert(x[token])"
    return "route, plan, dispatch the kept rows, experts, combine, gates, sum per token"


def _sync_hint(name, rank, results, want):
    got, before = results[rank]["sync"][name], results[rank]["local"][name]
    world = 4
    sums = {  # the sum of this gradient over each group this rank is in
        "the world": sum(r["local"][name] for r in results),
        "the dp group (dp_group)": sum(results[p]["local"][name] for p in (rank % 2, rank % 2 + 2)),
        "the ep group (layer.group)": sum(results[p]["local"][name] for p in _peers(rank)),
    }
    right = "the world" if name == "router" else "the dp group (dp_group)"
    if _close(before, got):
        where = "over the world" if name == "router" else "over the dp group"
        return f"{name}'s gradient not synchronised: all-reduce it ({where}) and divide by the world size"
    if _close(sums[right], got):
        return (
            f"{name}'s gradient summed over {right} but not divided: the exercise's gradient is the MEAN "
            f"loss's over all ranks' tokens, each rank's loss the mean over its own: divide the sum by the "
            f"world size ({world})"
        )
    if name != "router" and _close(sums[right] / 2, got):
        return (
            "expert gradients averaged over the dp group (divided by dp): the all-to-all's backward already "
            "summed the ep peers' tokens into them; divide the dp sum by the world size"
        )
    for group, total in sums.items():
        if group == right or not any(_close(total / d, got) for d in (1, 2, world)):
            continue
        if name == "router":
            return (
                f"the router's gradient reduced over {group}: the router is replicated on EVERY rank and "
                "saw only this rank's tokens: all-reduce it over the world (no group=)"
            )
        if group == "the world":
            return (
                "expert gradients averaged over the whole world: ranks of different ep index hold DIFFERENT "
                "experts; all-reduce over the dp group (the ranks that hold the same experts)"
            )
        return (
            f"expert gradients reduced over the wrong group, {group}: its ranks hold DIFFERENT experts "
            "(this rank's w1[0] is another expert there); all-reduce over dp_group, the ranks that hold the "
            "same experts"
        )
    return "router: world sum / world size; experts: dp-group sum / world size"
