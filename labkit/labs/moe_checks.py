"""Checks for moe_lab's exercises. Each runs the learner's code where its bug would show and
raises one AssertionError naming the case, with a "hint:" for the mistake it recognises.

    check_router(route, aux_loss)      in one process: softmax, top-k, renormalised gates with
                                       their gradient; Switch's aux loss (value and gradient) on
                                       random logits, on N = E tokens (an axis mix-up gives a value
                                       there) and on a uniform router (1.0)
    check_dispatch(capacity, plan)     in one process: capacities (whole and fractional shares),
                                       each assignment's rank, slot and kept flag for E = 6 experts
                                       on 3 ranks (so e // ep and e % ep differ from e // (E/ep))
    check_all_to_all(a2a, dispatch, combine)
                                       4 ranks, ep groups {0, 1} and {2, 3} of a 2 x 2 ("dp", "ep")
                                       mesh: the Function on uneven splits (an empty one included),
                                       forward and backward; dispatch then combine of rows whose
                                       "expert" scales them by its rank, values and gradients
    check_ep(ep_forward, sync_grads)   4 ranks, the same mesh: the layer's output, aux loss and,
                                       after the sync, every gradient against one process's MoE on
                                       the whole batch (capacity factor 1.0: some tokens dropped)

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
    for n, e, k, seed in ((10, 4, 2, 3), (4, 4, 2, 4), (7, 6, 3, 5)):
        _aux_case(aux_loss, n, e, k, seed)
    _aux_uniform(aux_loss)
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


def _aux_case(aux_loss, n, e, k, seed):
    logits = _logits(n, e, seed).requires_grad_()
    probs, idx, _ = M.route(logits, k)
    where = f"aux loss, {n} tokens, {e} experts, top-{k}"
    got = _attempt(aux_loss, probs, idx.clone(), e)
    _todo(got)
    wrong_axis = (
        "the aux loss on the wrong axis: P_e is the mean over the TOKENS (probs.mean(dim=0), one per "
        "expert), f_e the fraction of assignments per expert"
    )
    if _is_str(got):
        _fail(
            f"{where}: {got}",
            wrong_axis if "size of tensor" in got or "must match" in got else "see the error above",
        )
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


def _aux_uniform(aux_loss):
    e = 4
    probs = torch.full((8, e), 1 / e, dtype=M.DTYPE)
    idx = torch.tensor([[t % e, (t + 1) % e] for t in range(8)])
    got = _attempt(aux_loss, probs, idx, e)
    if not isinstance(got, torch.Tensor) or not _close(torch.tensor(1.0, dtype=M.DTYPE), got.reshape(())):
        _fail(
            f"aux loss, a uniform router (every expert 1/E of the assignments): {got}, expected 1.0",
            "E · Σ_e f_e · P_e with f_e = P_e = 1/E is 1",
        )


# ---------------------------------------------------------------- 2. the dispatch
CAPACITY_CASES = ((24, 4, 2, 1.0), (10, 4, 2, 1.25), (7, 3, 1, 1.0), (9, 6, 2, 1.5))


def check_dispatch(capacity: Callable, plan: Callable) -> None:
    for n, e, k, cf in CAPACITY_CASES:
        want = M.capacity(n, e, k, cf)
        got = _attempt(capacity, n, e, k, cf)
        _todo(got)
        where = f"capacity({n} tokens, {e} experts, top-{k}, factor {cf})"
        if got != want:
            share = cf * n * k / e
            cands = [
                (int(share), "capacity off by one: rounded down; a fractional share needs ceil (math.ceil)"),
                (want + 1, "capacity off by one: one slot too many; ceil(factor·N·k/E), no +1"),
                (round(share), "capacity rounded to nearest: ceil, so the even share always fits"),
                (M.capacity(n, e, 1, cf), "capacity without top_k: each token makes k assignments"),
            ]
            hint = next(
                (h for c, h in cands if got == c), "ceil(capacity_factor · n_tokens · top_k / n_experts)"
            )
            _fail(f"{where}: {got}, expected {want}", hint)
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
    if kept.dtype != torch.bool or not torch.equal(want_k, kept):
        if cap is None:
            hint = "capacity None is the dropless mode: every assignment kept"
        elif torch.equal(slot <= cap, kept):
            hint = (
                "a buffer of `capacity` slots holds slots 0..capacity-1: kept is slot < capacity (off by one)"
            )
        else:
            hint = "kept = slot < capacity (a bool tensor)"
        _fail(f"{where}, kept: {int(kept.sum())} kept, expected {int(want_k.sum())}", hint)


# ---------------------------------------------------------------- 3. the all-to-all pair
SEND = {0: [2, 0], 1: [3, 1]}  # rows group rank i sends to each group rank: uneven, one empty
D = 3
DESTS = {
    0: torch.tensor([1, 0, 1, 1, 0]),
    1: torch.tensor([1, 1, 0, 1, 1]),
}  # group rank 0 gets 3 rows, 1 gets 7


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
    valid = lambda v: _rows_of("combine", v, D, rows=len(xs))  # noqa: E731
    if not step("combine", lambda: combine(received * (10 + r), plan, group), _combine_hint, valid):
        return res
    back, res["combine"] = res["combine"], res["combine"].detach().clone()
    valid = lambda g: _grad_of("the gradient through dispatch and combine", g, xs)  # noqa: E731
    if step("combine_grad", lambda: _grad(back.square().sum(), xs), _combine_grad_hint, valid):
        res["combine_grad"] = res["combine_grad"].clone()
    return res


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
    return _rows_of("dispatch's received rows", got[0], D)


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


def _combine_grad_hint(_message):
    return "the all-to-all's backward: see its check above"


def _a2a_hint(message: str, exchanged: bool = True) -> str:
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
    where = lambda rank: f"rank {rank} (index {rank % 2} in ep group {_peers(rank)}), the all-to-all"  # noqa: E731
    hints = {"a2a": _a2a_hint, "a2a_grad": _a2a_grad_hint}
    _errors(results, ("a2a", "a2a_grad"), where, hints)
    for rank, res in enumerate(results):
        _check_a2a_rank(rank, res)
    where = lambda rank: f"rank {rank} (index {rank % 2} in ep group {_peers(rank)})"  # noqa: E731
    hints = {
        "dispatch": lambda m: _a2a_hint(m, exchanged=False),
        "combine": _combine_hint,
        "combine_grad": _combine_grad_hint,
    }
    _errors(results, ("dispatch", "combine", "combine_grad"), where, hints)
    for rank, res in enumerate(results):
        _check_pair_rank(rank, res)
    print(
        "the all-to-all: uneven splits (an empty one) forward and backward on both ep groups; "
        "dispatch then combine: every row to its rank and back in its place, with its gradient"
    )


def _peers(rank):
    return [rank // 2 * 2, rank // 2 * 2 + 1]


def _check_a2a_rank(rank, res):
    r, peers = rank % 2, _peers(rank)
    where = f"rank {rank} (index {r} in ep group {peers}), the all-to-all"
    out = res["a2a"]
    if _is_str(out):
        _fail(f"{where}, forward: {out}", _a2a_hint(out))
    pieces = {p: torch.split(_rows(p, sum(SEND[p % 2])), SEND[p % 2]) for p in peers}
    want = torch.cat([pieces[p][r] for p in peers])
    if not _close(want, out):
        hint = "row block i of the output comes from group rank i: the rows it sent to this rank"
        if out.shape[0] == sum(SEND[r]):
            hint = (
                "split sizes sent instead of received: the output holds sum(recv_splits) rows, "
                "output_split_sizes=recv_splits"
            )
        _fail(f"{where}, forward: {_diff(want, out)}", hint)
    g = res.get("a2a_grad")
    if _is_str(g) and "invalid gradient" in g:
        _fail(
            f"{where}, backward: {g}",
            "backward returned the gradient as it came (the received rows' shape): it must travel back "
            "through the reverse all-to-all, to the x this rank sent",
        )
    if _is_str(g) and ("split" in g.lower() or "size" in g.lower()):
        _fail(
            f"{where}, backward: {g}",
            "backward sends each gradient row back where its row came from: the forward's splits swapped "
            "(output_split_sizes=send_splits, input_split_sizes=recv_splits)",
        )
    if _is_str(g) or g is None:
        _fail(
            f"{where}, backward: {g}",
            "backward returns (grad of x, None, None, None): the reverse all-to-all of grad",
        )
    ups = {p: _rows(p, sum(SEND[i][p % 2] for i in range(2)), -0.5) for p in peers}
    recvs = {p: [SEND[i][p % 2] for i in range(2)] for p in peers}
    want = torch.cat([torch.split(ups[p], recvs[p])[r] for p in peers])
    if not _close(want, g):
        hint = "backward sends each gradient row back where its row came from: the same all-to-all with the splits swapped"
        if _close(_rows(rank, sum(SEND[r]), -0.5), g) if g.shape[0] == sum(SEND[r]) else False:
            hint = "backward returned the gradient as it came: it must travel back through the reverse all-to-all"
        _fail(f"{where}, backward: {_diff(want, g)}", hint)


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


def _check_pair_rank(rank, res):
    where = f"rank {rank} (index {rank % 2} in ep group {_peers(rank)})"
    received, back, grad, x, d = _pair_expected(rank)
    got = res["dispatch"]
    if _is_str(got):
        _fail(f"{where}, dispatch: {got}", _a2a_hint(got, exchanged=False))
    if not _close(received, got):
        hint = "dispatch: sort the rows by destination rank (stable), count them per rank, one all-to-all"
        if _close(_unsorted_received(rank), got):
            hint = "the rows not sorted by destination first: all-to-all sends the first send[0] rows to rank 0, the next send[1] to rank 1 ..."
        elif got.shape == received.shape and _close(received.sort(0).values, got.sort(0).values):
            hint = "the right rows in another order: sort by destination with a STABLE sort, each source's rows in their order"
        elif got.shape[0] == len(x):
            hint = "recv counts must come from the peers (exchange the counts with an all-to-all first), not copied from send"
        _fail(f"{where}, dispatch: rows received {_diff(received, got)}", hint)
    out = res["combine"]
    if _is_str(out):
        _fail(
            f"{where}, combine: {out}",
            "combine is dispatch reversed: it sends plan's recv counts and receives its send counts",
        )
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
    g = res.get("combine_grad")
    if _is_str(g) or g is None or not _close(grad, g):
        _fail(
            f"{where}, gradient through dispatch and combine: {g if _is_str(g) or g is None else _diff(grad, g)}",
            "the all-to-all's backward: see its check above",
        )


# ---------------------------------------------------------------- 4. the EP layer
EP = dict(d=6, hidden=8, experts=4, top_k=2, capacity_factor=1.0, tokens=12, aux_coef=0.1)


def _full():
    return M.MoE(EP["d"], EP["hidden"], EP["experts"], EP["top_k"], EP["capacity_factor"], seed=5)


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
    loss = lambda: (y.square().sum(-1).mean() + EP["aux_coef"] * aux.reshape(())).backward()  # noqa: E731
    if not _step(res, "backward", loss, ctrl, where, _a2a_grad_hint, lambda _: _no_grads(layer, "backward")):
        return res
    res["local"] = {n: p.grad.clone() for n, p in layer.named_parameters()}
    sync = lambda: sync_grads(layer, mesh.get_group("dp"))  # noqa: E731
    if _step(res, "sync", sync, ctrl, where, _sync_error_hint, lambda _: _no_grads(layer, "the sync")):
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
            _fail(f"{where}, output: {_diff(want, my_y)}", _ep_forward_hint(rank, my_y))
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
    if "index" in message and "out of bounds" in message or "out of range" in message:
        return "this rank holds experts [first, first + E/ep): the local index is expert - layer.first"
    return _a2a_hint(message)


def _ep_forward_hint(rank, got):
    full, x = _full(), torch.chunk(_x(), 4)[rank]
    nocap = M.MoE(EP["d"], EP["hidden"], EP["experts"], EP["top_k"], None, seed=5)
    nocap.load_state_dict(full.state_dict())
    probs, idx, gates = M.route(x @ full.router.detach().T, EP["top_k"])
    ungated = torch.zeros_like(x)
    cap = M.capacity(len(x), EP["experts"], EP["top_k"], EP["capacity_factor"])
    _, _, kept = M.dispatch_plan(idx, EP["experts"], cap, 2)
    for e in range(EP["experts"]):
        tok, j = torch.nonzero((idx == e) & kept, as_tuple=True)
        ungated = ungated.index_add(0, tok, full.expert(e, x[tok]).detach())
    cands = [
        (
            nocap(x)[0].detach(),
            "dropped tokens included: an assignment with slot >= capacity contributes nothing",
        ),
        (ungated, "the experts' outputs not weighted by the gates: y[token] += gate · expert(x[token])"),
    ]
    return next(
        (h for c, h in cands if _close(c, got)),
        "route, plan, dispatch the kept rows, experts, combine, gates, sum per token",
    )


def _sync_hint(name, rank, results, want):
    got, before = results[rank]["sync"][name], results[rank]["local"][name]
    world, peers_dp = 4, [rank % 2, rank % 2 + 2]
    if _close(before, got):
        return f"{name}'s gradient not synchronised: all-reduce it ({'over the world' if name == 'router' else 'over the dp group'}) and divide by the world size"
    everyone = sum(r["local"][name] for r in results)
    if name != "router" and _close(everyone / world, got):
        return (
            "expert gradients averaged over the whole world: ranks of different ep index hold DIFFERENT "
            "experts; all-reduce over the dp group (the ranks that hold the same experts)"
        )
    dp_sum = sum(results[p]["local"][name] for p in peers_dp)
    if name != "router" and _close(dp_sum / 2, got):
        return (
            "expert gradients averaged over the dp group (divided by dp): the all-to-all's backward already "
            "summed the ep peers' tokens into them; divide the dp sum by the world size"
        )
    if name == "router" and _close(dp_sum / 2, got) or _close(dp_sum / world, got):
        return "the router is replicated on EVERY rank and saw only this rank's tokens: all-reduce it over the world"
    return "router: world sum / world size; experts: dp-group sum / world size"
