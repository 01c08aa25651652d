"""Checks for seq_lab's exercises. Each runs the learner's code where its bug would show and
raises one AssertionError naming the rank and case, with a "hint:" for the mistake it recognises.

    check_sp_pair(gather, scatter)   SP's conjugate pair on 4 ranks, tp groups {0, 1} and {2, 3} of a
                                     2 x 2 mesh (so a global rank used for the group's shows):
                                     unit cases on integer data, the ops the tracer saw, then an
                                     SP MLP block against one process and torch's SequenceParallel /
                                     ColwiseParallel(input_layouts=Shard(1)) / RowwiseParallel(
                                     output_layouts=Shard(1)) (parallelize_module on gloo)
    check_merge(merge)               in one process: partial attentions against the attention over
                                     both blocks, with scores large enough to overflow exp()
                                     and an empty partial (lse -inf)
    check_ring(ring_attention)       4 ranks: causal and not on the world's ring (n = 4), causal on
                                     groups {0, 2} and {1, 3} (n = 2), against one process's
                                     scaled_dot_product_attention; the point-to-point calls are
                                     watched (a buffer received into while it is being sent; a
                                     wait longer than wait_s is a hang, reported, never waited out)
    check_zigzag(positions, pairs)   in one process: the positions of each rank for several n and
                                     T, the causal pair count, and the balance they give
    check_ulysses(to_heads, to_seq)  4 ranks: Ulysses' all-to-all pair on groups {0, 2} / {1, 3}
                                     (n = 2) then the world (n = 4): seq_to_heads of values naming
                                     their (b, h, t, d), the round trip, causal attention built
                                     from the pair against one process's (forward, dq, dk, dv),
                                     one all-to-all per call of layer_bytes' bytes (traced), and
                                     3 heads over 2 ranks refused by a ValueError naming both

The hints of check_ring come from simulating the classic mistakes in one process (the diagonal
block unmasked, the mask on the wrong blocks, the ring turned the wrong way, a step short, the
partials averaged...) and naming the one whose output the learner's equals on the first rank
that differs. Float64 throughout: values within 1e-10 of one process (measured: 1e-15).

On ranks, every piece of the learner's code is followed by tp_checks.shared's agreement: a rank
whose code raised while its peers wait for it in a collective or a receive ends the check at once,
and that rank's error is the one shown. What the learner's functions return is validated before
use (a tensor, not None or a tuple); a receive buffer whose dtype or size differs from what the
ring sends is refused before gloo sees it (gloo would abort the process).
"""

from __future__ import annotations

import copy
import datetime
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from labkit.checks import NOT_IMPLEMENTED
from labkit.checks import attempt as _attempt
from labkit.checks import fail as _fail
from labkit.labs import seq_lab
from labkit.labs.tp_checks import shared

ATOL = 1e-10
WAIT_S = 20.0  # a ring step that waits longer than this on 4 CPU ranks is a hang
HEADER_BYTES = 64  # the cross-rank check's header, one per peer per hand-written collective


def _run(fn, *args, world_size=4):
    # tp_checks' launch: a rank whose code raised while its peers wait for it leaves at once (CheckRaised)
    return shared._run(fn, *args, world_size=world_size)


def _returned(fn, *args):
    """fn(*args) as shared._try, a value that is not a tensor a plain string naming what came back."""
    y = shared._try(fn, *args)
    if isinstance(y, str) or isinstance(y, torch.Tensor):
        return y
    what = type(y).__name__ + (f" of {len(y)}" if isinstance(y, (tuple, list)) else "")
    return f"returned {what}, not a tensor"


def _returned_hint(message, what):
    if "returned NoneType" in message:
        return f"{what}: a function without `return` gives None"
    if "returned tuple" in message or "returned list" in message:
        return f"{what}, a single tensor (not a tuple: its lse stays inside the ring)"
    return f"{what}"


def _is_str(value) -> bool:
    return isinstance(value, str)


def _close(a, b, atol=ATOL):
    return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=atol)


def _diff(a, b):
    if not isinstance(b, torch.Tensor):
        return f"got {type(b).__name__}"
    if a.shape != b.shape:
        return f"shape {tuple(b.shape)}, expected {tuple(a.shape)}"
    return f"max |diff| {(a - b).abs().max().item():.3g}"


# ---------------------------------------------------------------- 1. SP's pair
SP_LOCAL = (2, 3, 5)  # (B, T/n, d): 3 tokens per rank, so a gather along another dim shows in the shape


def _unit(rank, shape, scale=1):
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=seq_lab.DTYPE).reshape(shape) % 7 + 1) * (rank + 1) * scale


def _sp_rank(gather, scatter):
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.comm import collectives
    from labkit.observe import tracing

    collectives.DIRECT_MAX_BYTES = 0  # the ring: its bytes are the formula's
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    group, rank = mesh.get_group("tp"), dist.get_rank()
    B, Tl, d = SP_LOCAL
    full_shape = (B, 2 * Tl, d)
    res: dict = {"windows": {}}
    agreed = True  # every rank's every piece ran: the same on every rank (the agreements say so)
    for name, fn, x, up in (
        ("gather", gather, _unit(rank, SP_LOCAL), _unit(rank, full_shape, -2) + 3),
        ("scatter", scatter, _unit(rank, full_shape), _unit(rank, SP_LOCAL, -2) + 3),
    ):
        x = x.clone().requires_grad_()
        before = x.detach().clone()
        dist.barrier()
        t0 = tracing.clock()
        y = _returned(fn, x, group)
        t1 = tracing.clock()
        where = f"rank {rank} (index {dist.get_rank(group)} in tp group {_peers(rank)}), {name}"
        hint = lambda msg, name=name: _error_hint(msg, rank, name)  # noqa: E731
        # the agreements' all-reduces fall between the windows the tracer is read in
        if not shared._agree(y, where=f"{where}, forward", hint=hint):
            res[name] = y if _is_str(y) else f"{shared.ANOTHER} raised"
            agreed = False
            break
        t2 = tracing.clock()
        grad = shared._try(lambda: torch.autograd.grad(y, x, up)[0])
        t3 = tracing.clock()
        agreed = shared._agree(grad, where=f"{where}, backward", hint=hint) and agreed
        res["windows"][name] = ((t0, t1), (t2, t3))
        res[name] = {
            "out": y.detach().clone(),
            "grad": grad if _is_str(grad) else grad.clone(),
            "changed": not torch.equal(before, x.detach()),
        }
    if not agreed:
        return res
    res["block"] = shared._try(_sp_block, gather, scatter, mesh)
    shared._agree(res["block"], where=f"rank {rank}, the SP block with your pair")
    return res


def _sp_block(gather, scatter, mesh):
    """The SP MLP block by hand (the learner's pair) and torch's, on this rank's piece."""
    group, r = mesh.get_group("tp"), mesh.get_local_rank("tp")
    full = seq_lab.make_block()
    x = seq_lab.sp_input(2, 6, 5)
    mine = seq_lab.HandBlock(full, group, True, gather, scatter)
    xm = torch.chunk(x, 2, 1)[r].clone().requires_grad_()
    out = mine(xm)
    out.square().sum().backward()
    mine.sync_replicated_grads()
    theirs = seq_lab.torch_sp_block(copy.deepcopy(full), mesh["tp"])
    xt = torch.chunk(x, 2, 1)[r].clone().requires_grad_()
    out_t = theirs(xt)
    out_t.square().sum().backward()

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    mine_grads = {
        "ln.weight": mine.ln.weight.grad,
        "ln.bias": mine.ln.bias.grad,
        "fc1.weight": mine.w1.grad,
        "fc1.bias": mine.b1.grad,
        "fc2.weight": mine.w2.grad,
        "fc2.bias": mine.b2.grad,
    }
    return {
        "out": out.detach().clone(),
        "x_grad": xm.grad.clone(),
        "grads": {k: v.clone() for k, v in mine_grads.items()},
        "torch": {
            "out": torch.as_tensor(out_t.detach()).clone(),
            "x_grad": xt.grad.clone(),
            "grads": {n: whole(p.grad).clone() for n, p in theirs.named_parameters()},
        },
    }


def _peers(rank):
    return [rank // 2 * 2, rank // 2 * 2 + 1]  # the tp group of a ("dp", "tp") 2 x 2 mesh


def _ops(trace, window):
    return [
        e["op"] for e in trace["events"] if window[0] <= e["start"] < window[1] and e["kind"] == "collective"
    ]


def check_sp_pair(gather: Callable, scatter: Callable) -> None:
    results = _run(_sp_rank, gather, scatter)
    flat = [r[k] if _is_str(r[k]) else r[k]["grad"] for r in results for k in ("gather", "scatter") if k in r]
    if any(_is_str(v) and v == NOT_IMPLEMENTED for v in flat):
        raise NotImplementedError(NOT_IMPLEMENTED)
    # a rank's own error first (its peers' "another rank raised" are its consequence)
    for name in ("gather", "scatter"):
        for rank, res in enumerate(results):
            got = res.get(name)
            if _is_str(got) and not got.startswith(shared.ANOTHER):
                where = f"rank {rank} (index {rank % 2} in tp group {_peers(rank)}), {name}"
                _fail(f"{where}, forward: {got}", _error_hint(got, rank, name))
    B, Tl, d = SP_LOCAL
    for rank, res in enumerate(results):
        peers, r = _peers(rank), rank % 2
        xs = {p: _unit(p, SP_LOCAL) for p in peers}
        fulls = {p: _unit(p, (B, 2 * Tl, d)) for p in peers}
        ups_full = {p: _unit(p, (B, 2 * Tl, d), -2) + 3 for p in peers}
        ups_local = {p: _unit(p, SP_LOCAL, -2) + 3 for p in peers}
        for name in ("gather", "scatter"):
            got = res[name]
            where = f"rank {rank} (index {r} in tp group {peers}), {name}"
            if _is_str(got):
                _fail(f"{where}, forward: {got}", _error_hint(got, rank))
            if got["changed"]:
                _fail(
                    f"{where}: the input x changed",
                    "labkit's collectives write their output: gather / reduce-scatter into a new tensor, never the caller's",
                )
        _check_gather(rank, r, peers, res["gather"], xs, ups_full)
        _check_scatter(rank, r, peers, res["scatter"], fulls, ups_local)
    _check_sp_ops(results)
    _check_sp_block(results)
    print(
        "SP's pair: all-gather / reduce-scatter along the sequence right on every rank of both tp groups "
        f"(one ring collective each way); the SP block equal to one process and to torch's SequenceParallel "
        f"plan (atol {ATOL:g})"
    )


def _group_confusion(message, world=4, tp=2):
    """The hint when a labkit collective's size error shows the world (4 ranks) where the tp group
    (2) belongs: the buffer sized with dist.get_world_size(), or the collective run without group=."""
    import re

    found = re.search(r"has (\d+) elements but world_size × \w+ = (\d+) × (\d+)", message)
    if not found:
        return None
    total, n, piece = (int(g) for g in found.groups())
    if n == tp and piece and world <= total / piece < 2 * world:  # the rows // world of the buffer
        return (
            f"n is the tp group's size, dist.get_world_size(group) ({tp} here), not the world's ({world}): "
            f"the buffer was sized for {world} ranks while the collective runs over the group's {tp}"
        )
    if n == world and total == tp * piece:
        return (
            f"the collective ran over the world ({world} ranks): pass group=group (the tp group, {tp} ranks) "
            "to ring_all_gather / ring_reduce_scatter, in forward and in backward (ctx.group)"
        )
    return None


def _error_hint(message, rank, name=None):
    if "returned" in message and "not a tensor" in message:
        return _returned_hint(
            message, f"{name or 'the function'} returns the autograd Function's output tensor"
        )
    if _group_confusion(message):
        return _group_confusion(message)
    if "invalid gradient" in message or "expected shape compatible" in message:
        if name == "gather":
            return (
                "gather's backward returns this rank's piece (B, T/n, d): a reduce-scatter of the "
                "gradient along the sequence, not an all-reduce of the whole"
            )
        return (
            "scatter's backward returns the whole (B, T, d): an all-gather of the gradient along the sequence"
        )
    if "incorrect number of gradients" in message:
        return "backward returns one gradient per input of forward: (grad, None), None for the group"
    if rank >= 2 and ("index" in message or "range" in message or "size" in message):
        return "this rank's index in its group is dist.get_rank(group), not the global rank"
    if "numel" in message or "size" in message or "shape" in message:
        return (
            "labkit's collectives concatenate along dim 0: move the sequence (dim 1) first "
            "(x.transpose(0, 1).contiguous()), gather, move it back"
        )
    return "see the error above"


def _backward_ran(rank, peers, name, got):
    if _is_str(got["grad"]):
        where = f"rank {rank} (index {rank % 2} in tp group {peers}), {name}"
        _fail(f"{where}, backward: {got['grad']}", _error_hint(got["grad"], rank, name))


def _check_gather(rank, r, peers, got, xs, ups):
    want = torch.cat([xs[p] for p in peers], dim=1)
    out = got["out"]
    if not _close(want, out):
        if out.shape == torch.cat([xs[p] for p in peers], dim=0).shape:
            hint = (
                "gathered along dim 0, the batch: the sequence is dim 1 (move it first, gather, move it back)"
            )
        elif out.shape == torch.cat([xs[p] for p in peers], dim=2).shape:
            hint = "gathered along the features (dim 2): the sequence is dim 1"
        elif out.shape[1] == 4 * SP_LOCAL[1]:
            hint = "gathered over all 4 ranks: SP gathers over its tp group (the group argument)"
        elif _close(torch.cat([xs[p] for p in reversed(peers)], dim=1), out):
            hint = "the pieces in the wrong order: rank i of the group holds positions [i T/n, (i+1) T/n)"
        else:
            hint = "gather's forward: the pieces of every rank of the group, concatenated along the sequence"
        _fail(f"rank {rank}, gather forward: {_diff(want, out)}", hint)
    _backward_ran(rank, peers, "gather", got)
    total = sum(ups[p] for p in peers)
    want = torch.chunk(total, 2, 1)[r]
    grad = got["grad"]
    if not _close(want, grad):
        if _close(torch.chunk(ups[rank], 2, 1)[r], grad):
            hint = (
                "gather's backward must SUM the gradient over the group (a reduce-scatter): every rank's "
                "later layers used this rank's tokens"
            )
        elif _close(want / 2, grad):
            hint = (
                "an average: gather's backward sums (op='sum'), each rank's gradient is a whole contribution"
            )
        elif _close(torch.chunk(total, 2, 1)[1 - r], grad):
            hint = "the other rank's piece: this rank's index in its group is dist.get_rank(group)"
        else:
            hint = "gather's backward: reduce-scatter (sum) of the gradient along the sequence"
        _fail(f"rank {rank}, gather backward: {_diff(want, grad)}", hint)


def _check_scatter(rank, r, peers, got, fulls, ups):
    total = sum(fulls[p] for p in peers)
    want = torch.chunk(total, 2, 1)[r]
    out = got["out"]
    if not _close(want, out):
        if _close(torch.chunk(fulls[rank], 2, 1)[r], out):
            hint = "scatter's forward must SUM the partial sums over the group (a reduce-scatter), not just slice"
        elif _close(want / 2, out):
            hint = "an average: the row-parallel outputs are partial SUMS (op='sum')"
        elif _close(total, out):
            hint = "scatter's forward keeps this rank's piece of the sum (B, T/n, d): reduce-scatter, not all-reduce"
        elif _close(torch.chunk(total, 2, 1)[1 - r], out):
            hint = "the other rank's piece: this rank's index in its group is dist.get_rank(group)"
        elif out.shape == torch.chunk(total, 2, 0)[r].shape:
            hint = "scattered along dim 0, the batch: the sequence is dim 1"
        else:
            hint = "scatter's forward: reduce-scatter (sum) along the sequence"
        _fail(f"rank {rank}, scatter forward: {_diff(want, out)}", hint)
    _backward_ran(rank, peers, "scatter", got)
    want = torch.cat([ups[p] for p in peers], dim=1)
    grad = got["grad"]
    if not _close(want, grad):
        if _close(torch.cat([ups[p] for p in reversed(peers)], dim=1), grad):
            hint = "the pieces in the wrong order: rank i of the group holds positions [i T/n, (i+1) T/n)"
        else:
            hint = "scatter's backward all-gathers the gradient along the sequence"
        _fail(f"rank {rank}, scatter backward: {_diff(want, grad)}", hint)


def _check_sp_ops(results):
    for rank, (trace, res) in enumerate(zip(results.traces, results)):
        for name, (fwd, bwd) in res["windows"].items():
            want = ("all_gather", "reduce_scatter") if name == "gather" else ("reduce_scatter", "all_gather")
            for direction, window, kind in (("forward", fwd, want[0]), ("backward", bwd, want[1])):
                ops = _ops(trace, window)
                if any("all_reduce" in op for op in ops):
                    _fail(
                        f"rank {rank}, {name} {direction}: an all-reduce ({ops})",
                        f"reduce-scatter replaced by all-reduce: the values come out right once sliced, but "
                        f"each rank sends 2(n-1)/n of the tensor instead of (n-1)/n; SP's {name} {direction} "
                        f"is one {kind.replace('_', '-')}",
                    )
                if len(ops) != 1 or kind not in ops[0]:
                    _fail(
                        f"rank {rank}, {name} {direction}: collectives {ops}, expected one {kind}",
                        f"SP's {name} {direction} is one {kind.replace('_', '-')} over the group (labkit's ring_{kind})",
                    )


def _check_sp_block(results):
    full = seq_lab.make_block()
    x = seq_lab.sp_input(2, 6, 5).requires_grad_()
    out = full(x)
    out.square().sum().backward()
    grads = {n: p.grad for n, p in full.named_parameters()}
    for rank, res in enumerate(results):
        r, mine = rank % 2, res["block"]
        if _is_str(mine):
            _fail(f"rank {rank}, the SP block with your pair: {mine}", "see the error above")
        pieces = {
            "fc1.weight": torch.chunk(grads["fc1.weight"], 2, 0)[r],
            "fc1.bias": torch.chunk(grads["fc1.bias"], 2)[r],
            "fc2.weight": torch.chunk(grads["fc2.weight"], 2, 1)[r],
        }
        one = {
            "out": torch.chunk(out.detach(), 2, 1)[r],
            "x_grad": torch.chunk(x.grad, 2, 1)[r],
            "grads": {n: pieces.get(n, g) for n, g in grads.items()},
        }
        theirs = mine["torch"]
        theirs = {
            "out": theirs["out"],
            "x_grad": theirs["x_grad"],
            "grads": {n: _pieces_of(n, g, r) for n, g in theirs["grads"].items()},
        }
        for ref_name, ref in (("one process", one), ("torch's SequenceParallel plan", theirs)):
            for key in ("out", "x_grad"):
                if not _close(ref[key], mine[key]):
                    _fail(
                        f"rank {rank}, the SP block: {key} differs from {ref_name}'s ({_diff(ref[key], mine[key])})",
                        "norm on the piece, gather before fc1, scatter after fc2",
                    )
            for n, g in ref["grads"].items():
                if not _close(g, mine["grads"][n]):
                    _fail(
                        f"rank {rank}, the SP block: {n}'s gradient differs from {ref_name}'s ({_diff(g, mine['grads'][n])})",
                        "see the pair's backward",
                    )


def _pieces_of(name, g, r):
    if name == "fc1.weight":
        return torch.chunk(g, 2, 0)[r]
    if name == "fc1.bias":
        return torch.chunk(g, 2)[r]
    if name == "fc2.weight":
        return torch.chunk(g, 2, 1)[r]
    return g


# ---------------------------------------------------------------- 2. the merge
def _merge_cases():
    """(name, q, k1, v1, k2, v2): attention over k1 then k2 of the same queries."""
    g = torch.Generator().manual_seed(7)

    def t(*shape, scale=1.0):
        return torch.randn(*shape, dtype=seq_lab.DTYPE, generator=g) * scale

    B, H, T, D = 1, 2, 5, 3  # T != D: a weight that is not unsqueezed does not broadcast silently
    cases = [("random scores", t(B, H, T, D), t(B, H, 4, D), t(B, H, 4, D), t(B, H, 6, D), t(B, H, 6, D))]
    # scores in the thousands, the second block's far above the first's: exp() overflows float64
    q = t(B, H, T, D, scale=40.0)
    k = t(B, H, 4, D, scale=40.0)
    cases.append(("scores near 2000 (exp overflows)", q, k, t(B, H, 4, D), k * 1.5, t(B, H, 4, D)))
    return cases


def check_merge(merge: Callable) -> None:
    for name, q, k1, v1, k2, v2 in _merge_cases():
        o1, l1 = seq_lab.block_attention(q, k1, v1)
        o2, l2 = seq_lab.block_attention(q, k2, v2)
        want_o, want_l = seq_lab.block_attention(q, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2))
        got = _attempt(merge, o1.clone(), l1.clone(), o2.clone(), l2.clone())
        if _is_str(got) and got == NOT_IMPLEMENTED:
            raise NotImplementedError(NOT_IMPLEMENTED)
        where = f"merge, {name}"
        if _is_str(got):
            hint = (
                "lse has shape (B, H, T), o (B, H, T, D): unsqueeze(-1) the weights to scale o"
                if "size of tensor" in got or "must match" in got
                else "see the error above"
            )
            _fail(f"{where}: {got}", hint)
        if not isinstance(got, tuple) or len(got) != 2:
            _fail(
                f"{where}: returned {type(got).__name__}",
                "return (o, lse): the merged output and its log-sum-exp",
            )
        o, lse = got
        if not (isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)):
            _fail(
                f"{where}: returned ({type(o).__name__}, {type(lse).__name__})", "return two tensors (o, lse)"
            )
        if not (torch.isfinite(o).all() and torch.isfinite(lse).all()):
            w1, w2 = torch.exp(l1 - l1), torch.exp(l2 - l1)
            by_first = (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1)
            if o.shape == by_first.shape and torch.equal(torch.isfinite(o), torch.isfinite(by_first)):
                hint = (
                    "shifted by lse1 alone: exp(lse2 - lse1) overflows where the second block's scores are "
                    "far larger; shift by the larger of the two, m = max(lse1, lse2)"
                )
            else:
                hint = (
                    "exp() of a score in the thousands overflows: shift by the larger lse first "
                    "(m = max(lse1, lse2); exp(lse1 - m), exp(lse2 - m)), the log-sum-exp trick"
                )
            _fail(f"{where}: the result holds inf or NaN", hint)
        shift = torch.maximum(l1, l2)
        unshifted = torch.log(torch.exp(l1 - shift) + torch.exp(l2 - shift))
        if not _close(want_l, lse):
            if _close(unshifted, lse):
                hint = (
                    "the shift left out of the result: lse = m + log(exp(lse1 - m) + exp(lse2 - m)); the "
                    "log of the shifted sum is the lse minus m"
                )
            elif _close(shift - unshifted, lse):
                hint = "the log-sum-exp with the wrong sign: lse = m + log(...), not m - log(...)"
            elif _close(torch.maximum(l1, l2), lse):
                hint = "the merged lse is log(exp(lse1) + exp(lse2)), not the max: the max is only the shift"
            elif _close(l1 + l2, lse):
                hint = (
                    "log-sum-exp adds the exponentials, not the logs: m + log(exp(lse1 - m) + exp(lse2 - m))"
                )
            else:
                hint = "lse = m + log(exp(lse1 - m) + exp(lse2 - m)), m = max(lse1, lse2)"
            _fail(f"merge, {name}: lse {_diff(want_l, lse)}", hint)
        if not _close(want_o, o):
            w1 = torch.exp(l1 - want_l).unsqueeze(-1)
            w2 = torch.exp(l2 - want_l).unsqueeze(-1)
            if _close((o1 + o2) / 2, o):
                hint = "the partials averaged: weight each by its share of the softmax mass, exp(lse_i - lse)"
            elif _close(o1 / w1 + o2 / w2, o):
                hint = (
                    "the weights with the wrong sign: exp(lse_i - lse) (a share of the mass, at most 1), "
                    "not exp(lse - lse_i)"
                )
            elif _close(o1 * w2 + o2 * w1, o):
                hint = "the weights swapped: o1 takes exp(lse1 - lse), o2 exp(lse2 - lse)"
            elif (
                _close(o1 * (w1 / w2.clamp_min(1e-300)), o)
                or _close(o1 * w1 + o2, o)
                or _close(o1 + o2 * w2, o)
            ):
                hint = "weight BOTH partials, each by exp(lse_i - lse)"
            else:
                hint = "o = o1 exp(lse1 - lse) + o2 exp(lse2 - lse): each partial is normalized over its own block"
            _fail(f"{where}: o {_diff(want_o, o)}", hint)
    # an empty partial, the accumulator's start (o 0, lse -inf), leaves the other unchanged
    _, q, k1, v1, _, _ = _merge_cases()[0]
    o2, l2 = seq_lab.block_attention(q, k1, v1)
    empty_o, empty_l = torch.zeros_like(o2), torch.full_like(l2, -math.inf)
    got = _attempt(merge, empty_o, empty_l, o2.clone(), l2.clone())
    if _is_str(got) or not (_close(o2, got[0]) and _close(l2, got[1])):
        _fail(
            f"merge of an empty partial (o 0, lse -inf) with another: {got if _is_str(got) else _diff(o2, got[0])}",
            "an empty partial has weight exp(-inf - m) = 0: shift by the max of BOTH lse (never by lse1 alone, "
            "and not by a difference: -inf - (-inf) is NaN)",
        )
    print(
        f"merge: equal to attention over both blocks (atol {ATOL:g}), no overflow at scores near 2000, empty partial kept"
    )


# ---------------------------------------------------------------- 3. the ring
class RingHang(RuntimeError):
    """A wait on a point-to-point request that never completed: the ring deadlocked."""


class BufferMismatch(ValueError):
    """A receive buffer that cannot match what the ring sends (refused before gloo aborts)."""


class _Watch:
    """Wraps dist.isend / irecv / send / recv while the learner's ring runs: every wait has a
    deadline, a buffer received into while a send of it is in flight is noted, and a sent buffer
    changed before its send completed is noted."""

    def __init__(self, wait_s, block=None):
        self.wait_s, self.problems, self.sends, self.recvs = wait_s, [], [], []
        self.block = block  # this rank's K (or V) piece: what a receive buffer must match
        self.saved = {n: getattr(dist, n) for n in ("isend", "irecv", "send", "recv")}

    def __enter__(self):
        orig_isend, orig_irecv = self.saved["isend"], self.saved["irecv"]
        watch = self

        class Watched:
            def __init__(self, work, entry):
                self.work, self.entry = work, entry

            def wait(self, *args, **kwargs):
                try:
                    self.work.wait(datetime.timedelta(seconds=watch.wait_s))
                except RuntimeError as exc:
                    if "imed out" in str(exc) or "imeout" in str(exc):
                        watch.problems.append("hang")
                        raise RingHang(
                            f"a wait on {self.entry['kind']} took over {watch.wait_s:g} s"
                        ) from None
                    if "by peer" in str(exc):  # a peer stopped (its own wait ran out, or it failed)
                        watch.problems.append("peer stopped")
                        raise RingHang(f"a peer stopped during a wait on {self.entry['kind']}") from None
                    raise
                watch.done(self.entry)
                return True

            def is_completed(self):
                return self.work.is_completed()

        def storage(t):
            return t.untyped_storage().data_ptr()

        def peer(args, kwargs, key, what):
            """The global rank a p2p call names, refused unless it is a rank of its group (gloo
            aborts the process on a rank out of range)."""
            rank = kwargs.get(key, args[0] if args else None)
            group = kwargs.get("group") or dist.group.WORLD
            ranks = dist.get_process_group_ranks(group)
            if isinstance(rank, int) and rank not in ranks:
                raise ValueError(
                    f"dist.{what}({key}={rank}): not a rank of its group, whose global ranks are {ranks}"
                )

        def isend(tensor, *args, **kwargs):
            peer(args, kwargs, "dst", "isend")
            if any(storage(e["tensor"]) == storage(tensor) for e in self.recvs if not e["done"]):
                self.problems.append("overwritten")
            entry = {"kind": "isend", "tensor": tensor, "copy": tensor.detach().clone(), "done": False}
            self.sends.append(entry)
            return Watched(orig_isend(tensor, *args, **kwargs), entry)

        def irecv(tensor, *args, **kwargs):
            peer(args, kwargs, "src", "irecv")
            self.check_buffer(tensor)
            if any(storage(e["tensor"]) == storage(tensor) for e in self.sends if not e["done"]):
                self.problems.append("overwritten")
            entry = {"kind": "irecv", "tensor": tensor, "done": False}
            self.recvs.append(entry)
            return Watched(orig_irecv(tensor, *args, **kwargs), entry)

        def send(tensor, *args, **kwargs):
            isend(tensor, *args, **kwargs).wait()

        def recv(tensor, *args, **kwargs):
            irecv(tensor, *args, **kwargs).wait()
            src = kwargs.get("src", args[0] if args else None)
            return src

        for name, fn in (("isend", isend), ("irecv", irecv), ("send", send), ("recv", recv)):
            setattr(dist, name, fn)
        return self

    def check_buffer(self, tensor):
        """Refuse a receive buffer that cannot match what the ring sends (another dtype, or a size
        neither a block's nor K and V's together, nor this rank's own send at the same step):
        gloo would abort the process on the size mismatch."""
        if self.block is None:
            return
        k = self.block
        sent = self.sends[len(self.recvs)]["tensor"] if len(self.sends) > len(self.recvs) else None
        if tensor.dtype != k.dtype:
            raise BufferMismatch(
                f"irecv into a {str(tensor.dtype).removeprefix('torch.')} buffer; the K/V blocks are "
                f"{str(k.dtype).removeprefix('torch.')}"
            )
        sizes = {sent.numel()} if sent is not None else {k.numel(), 2 * k.numel()}
        if tensor.numel() not in sizes:
            raise BufferMismatch(
                f"irecv into a buffer of shape {tuple(tensor.shape)} ({tensor.numel()} elements); "
                f"what arrives has {' or '.join(str(n) for n in sorted(sizes))}"
            )

    def done(self, entry):
        entry["done"] = True
        if entry["kind"] == "isend" and not torch.equal(entry["tensor"], entry["copy"]):
            self.problems.append("overwritten")

    def finish(self):
        for entry in self.sends:
            if not entry["done"] and not torch.equal(entry["tensor"], entry["copy"]):
                self.problems.append("overwritten")
        if any(not e["done"] for e in self.sends + self.recvs):
            self.problems.append("unwaited")

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


RING_CASES = (("world", True), ("world", False), ("pairs", True))


def _ring_rank(ring_fn, wait_s):
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ctrl = dist.new_group(backend="gloo")  # the agreement's own: a hang closes the ring's group
    q, k, v = seq_lab.attn_inputs(3)
    out = []
    for where, causal in RING_CASES:
        group = dist.group.WORLD if where == "world" else pairs[rank % 2]
        r, n = dist.get_rank(group), dist.get_world_size(group)
        pieces = [torch.chunk(t, n, 2)[r].contiguous() for t in (q, k, v)]
        with _Watch(wait_s, pieces[1]) as watch:
            got = _returned(ring_fn, *pieces, causal, group)
            if isinstance(got, shared.Raised) and isinstance(got.exc, RingHang):
                got = str(got)  # every rank of a deadlock times out: nobody is to blame first
            else:
                watch.finish()
        out.append(
            {"out": got if _is_str(got) else got.detach().clone(), "problems": sorted(set(watch.problems))}
        )
        if {"hang", "peer stopped"} & set(watch.problems):
            break  # this process group has requests that will never complete
        label = f"rank {rank}, the ring on the {where} group (causal={causal})"
        if not shared._agree(
            got, where=label, hint=lambda msg, w=where: _ring_error_hint(msg, w), group=ctrl
        ):
            break
    return out


def _simulate(q, k, v, n, causal, mistake=None):
    """What each rank of a contiguous ring returns, right (mistake None) or with a classic mistake."""
    qs, ks, vs = (torch.chunk(t, n, 2) for t in (q, k, v))
    outs = []
    for r in range(n):
        parts = []
        steps = n - 1 if mistake == "one step short" else n
        for s in range(steps):
            j = (r - s) % n  # whose block this rank holds
            label = (r + s) % n if mistake == "labels the other way" else j
            held = (r + s) % n if mistake == "data the other way" else j
            if not causal:
                kind = "diag" if (mistake == "diag masked, not causal" and label == r) else "full"
            elif label == r:
                kind = "full" if mistake == "diag unmasked" else "diag"
            elif label < r:
                kind = "diag" if mistake == "mask every block" else "full"
            else:
                kind = {"future seen": "full", "future masked": "diag"}.get(mistake or "", "skip")
            if kind != "skip":
                parts.append(seq_lab.block_attention(qs[r], ks[held], vs[held], causal=kind == "diag"))
        if not parts:
            outs.append(None)
            continue
        if mistake == "last only":
            outs.append(parts[-1][0])
        elif mistake == "averaged":
            outs.append(sum(p[0] for p in parts) / len(parts))
        else:
            o, lse = parts[0]
            for p in parts[1:]:
                o, lse = seq_lab.merge(o, lse, *p)
            outs.append(o)
    return outs


RING_HINTS = {
    "diag unmasked": "the diagonal block (this rank's own K/V, step 0) needs the causal mask: query i sees keys 0..i",
    "mask every block": "the causal mask belongs to the diagonal block only: a block of an EARLIER rank is seen whole",
    "future seen": "causal: a block from a LATER rank (j > r) is all in the future: skip it",
    "future masked": "the causal mask applied to the wrong K/V block: a later rank's block (j > r) is skipped, not masked; only j == r is masked",
    "labels the other way": "the K/V go to the next rank and come from the previous one: at step s this rank holds rank (r - s) mod n's block, not (r + s)'s",
    "data the other way": "send to the next rank (r + 1), receive from the previous (r - 1): the blocks arrive in the order (r - s) mod n",
    "one step short": "n steps: this rank's own block, then n - 1 received ones (the last one received is also used)",
    "last only": "merge every step's partial into the running (o, lse): the output is not the last partial",
    "averaged": "the partials averaged: merge them with their log-sum-exp (exercise 2)",
    "diag masked, not causal": "causal=False: every block is seen whole, the diagonal too",
}


def check_ring(ring_fn: Callable, wait_s: float = WAIT_S) -> None:
    results = _run(_ring_rank, ring_fn, wait_s)
    if any(_is_str(c["out"]) and c["out"] == NOT_IMPLEMENTED for res in results for c in res):
        raise NotImplementedError(NOT_IMPLEMENTED)
    q, k, v = seq_lab.attn_inputs(3)
    for c_i, (where, causal) in enumerate(RING_CASES):
        n = 4 if where == "world" else 2
        want = torch.chunk(seq_lab.one_process(q, k, v, causal), n, 2)
        ran = [(rank, res[c_i]) for rank, res in enumerate(results) if len(res) > c_i]
        # an error on one rank is the cause of a hang on its peers: report it first
        for rank, got in ran:
            if _is_str(got["out"]) and not {"hang", "peer stopped"} & set(got["problems"]):
                _fail(
                    f"rank {rank}, the ring on the {where} group (causal={causal}): {got['out']}",
                    _ring_error_hint(got["out"], where),
                )
        for rank, got in ran:
            if "hang" in got["problems"]:
                _fail(
                    f"rank {rank}, the ring on the {where} group (causal={causal}): a send or receive waited "
                    f"over {wait_s:g} s, stopped",
                    "the ring deadlocked: every rank waits for a receive (or a blocking send) before anyone "
                    "sends. Post both at once: dist.isend(block, dst=next) and dist.irecv(buffer, src=prev), "
                    "then wait() both"
                    + (
                        "; on a group, isend / irecv take GLOBAL ranks: dist.get_global_rank(group, (r + 1) % n)"
                        if where == "pairs"
                        else ""
                    ),
                )
        for rank, got in ran:
            r = rank if where == "world" else rank // 2
            label = f"rank {rank}, the ring on the {where} group ({'n = 4' if n == 4 else 'groups {0, 2}, {1, 3}'}, causal={causal})"
            if "overwritten" in got["problems"]:
                _fail(
                    f"{label}: a K/V buffer was written while its send was in flight",
                    "a K/V buffer overwritten before it is sent on: receive into a fresh buffer "
                    "(torch.empty_like), wait() the send, then swap",
                )
            if _is_str(got["out"]):
                _fail(f"{label}: {got['out']}", _ring_error_hint(got["out"], where))
            if "unwaited" in got["problems"] and not _close(want[r], got["out"]):
                _fail(
                    f"{label}: {_diff(want[r], got['out'])}, with requests never waited",
                    "wait() every isend / irecv before using or reusing its buffer",
                )
            if not _close(want[r], got["out"]):
                if where == "pairs":
                    _fail(
                        f"{label}: {_diff(want[r], got['out'])}",
                        "the ring is the group's: r = dist.get_rank(group), n = dist.get_world_size(group), "
                        "and isend / irecv take GLOBAL ranks: dist.get_global_rank(group, (r + 1) % n)",
                    )
                _fail(
                    f"{label}: {_diff(want[r], got['out'])}",
                    _ring_value_hint(q, k, v, n, causal, r, got["out"]),
                )
    print(
        "ring attention: equal to one process's scaled_dot_product_attention on 4 ranks (causal and not) and on "
        f"groups {{0, 2}}, {{1, 3}} (atol {ATOL:g}); no buffer overwritten in flight"
    )


def _ring_error_hint(message, where):
    if "not a tensor" in message:
        return _returned_hint(message, "return o, this rank's (B, H, T/n, D) output")
    if "irecv into a" in message and "buffer;" in message:
        return (
            "the receive buffer must match what arrives, dtype and size: torch.empty_like(kv) (the "
            "K/V are float64; torch.empty's default is float32, and gloo aborts on a size mismatch)"
        )
    if "irecv into a buffer of shape" in message:
        return "receive into a buffer shaped like what the previous rank sends: torch.empty_like(kv)"
    import re

    found = re.search(r"Group rank (-?\d+) is not part of group", message)
    size = 2 if where == "pairs" else 4
    if found and int(found.group(1)) > size:
        return (
            f"n is the ring group's size, dist.get_world_size(group) ({size} here), not the world's (4): "
            "the neighbours are (r ± 1) % n of the group"
        )
    named = re.search(
        r"\((?:dst|src)=(-?\d+)\): not a rank of its group, whose global ranks are \[([\d, ]+)\]", message
    )
    if named and 0 <= int(named.group(1)) < len(named.group(2).split(",")):
        return (
            "isend / irecv take GLOBAL ranks, also on a group: dist.get_global_rank(group, (r + 1) % n), "
            "not the group's index (r + 1) % n"
        )
    if found or named:
        return (
            "the neighbours wrap round the ring: dist.get_global_rank(group, (r + 1) % n) and (r - 1) % n, "
            "n = dist.get_world_size(group) (the last rank's next is rank 0 of the group)"
        )
    if where == "pairs" and ("group" in message or "rank" in message):
        return (
            "the ring is the group's: r = dist.get_rank(group), and isend / irecv take GLOBAL ranks: "
            "dist.get_global_rank(group, (r + 1) % n)"
        )
    if "size of tensor" in message or "must match" in message:
        return "merge's lse has shape (B, H, T): see exercise 2"
    return "see the error above"


def _ring_value_hint(q, k, v, n, causal, r, got):
    for mistake, hint in RING_HINTS.items():
        sim = _simulate(q, k, v, n, causal, mistake)[r]
        if sim is not None and _close(sim, got):
            return hint
    return "at step s this rank holds rank (r - s) mod n's K/V: causal, j == r masked, j < r whole, j > r skipped"


# ---------------------------------------------------------------- 4. zigzag
ZIGZAG_CASES = ((4, 24), (2, 24), (3, 18), (4, 8))


def check_zigzag(positions: Callable, pairs: Callable) -> None:
    for n, T in ZIGZAG_CASES:
        c = T // (2 * n)
        for r in range(n):
            got = _attempt(positions, r, n, T)
            if _is_str(got) and got == NOT_IMPLEMENTED:
                raise NotImplementedError(NOT_IMPLEMENTED)
            where = f"positions(rank={r}, n={n}, T={T})"
            if _is_str(got):
                _fail(f"{where}: {got}", "see the error above")
            if not isinstance(got, (torch.Tensor, list, tuple, range)):
                _fail(
                    f"{where}: returned {type(got).__name__}",
                    "return this rank's positions, a 1-D tensor of T/n integers"
                    + (": a function without `return` gives None" if got is None else ""),
                )
            got = torch.as_tensor(got).flatten()
            want = seq_lab.zigzag_positions(r, n, T)
            if torch.equal(got, want):
                continue
            if torch.equal(got, want.roll(c)):
                hint = "the zigzag order reversed: rank r holds chunk r FIRST, then chunk 2n-1-r"
            elif torch.equal(got, seq_lab.contiguous_positions(r, n, T)):
                hint = "that is the contiguous layout: zigzag cuts 2n chunks and gives rank r chunks r and 2n-1-r"
            elif len(got) == len(want) and torch.equal(got[:c], want[:c]):
                hint = "the partner chunk is 2n-1-r (rank 0 takes the first and the LAST chunk)"
            elif len(got) == 2 * len(want):
                hint = f"2n = {2 * n} chunks of T/(2n) = {c} positions: a rank holds T/n = {T // n} in all"
            elif len(got) != len(want):
                hint = f"each chunk is exactly T/(2n) = {c} positions (torch.arange(i*c, (i+1)*c)): no off-by-one"
            else:
                hint = "rank r holds chunk r then chunk 2n-1-r of 2n chunks of T/(2n)"
            _fail(f"{where}: {got.tolist()}, expected {want.tolist()}", hint)
    for qp, kp in (
        ([3, 4, 5], [0, 1, 2]),
        ([3, 4, 5], [3, 4, 5]),
        ([0, 1, 7], [6, 7, 8, 9]),
        ([2, 5], [9, 10]),
    ):
        got = _attempt(pairs, torch.tensor(qp), torch.tensor(kp))
        if _is_str(got) and got == NOT_IMPLEMENTED:
            raise NotImplementedError(NOT_IMPLEMENTED)
        where = f"pairs(q={qp}, k={kp})"
        if isinstance(got, torch.Tensor) and got.numel() != 1:
            _fail(
                f"{where}: returned a tensor of shape {tuple(got.shape)}",
                "return the COUNT of the pairs the mask keeps (a number): .sum() of the mask, not the mask",
            )
        if not _is_str(got) and not isinstance(got, (int, float, torch.Tensor)) or isinstance(got, bool):
            _fail(
                f"{where}: returned {type(got).__name__}",
                "return the number of (q, k) pairs with key <= query"
                + (": a function without `return` gives None" if got is None else ""),
            )
        want = seq_lab.causal_pairs(qp, kp)
        if _is_str(got) or int(got) != want:
            strict = sum(k < q for q in qp for k in kp)
            future = sum(k >= q for q in qp for k in kp)
            if not _is_str(got) and int(got) == strict:
                hint = "a query sees its own position too: key <= query (the diagonal counts)"
            elif not _is_str(got) and int(got) == future:
                hint = "causal: a query sees the keys at or BEFORE it (key <= query), not after"
            elif not _is_str(got) and int(got) == len(qp) * len(kp):
                hint = "count only the pairs the causal mask keeps (key <= query), not the whole block"
            else:
                hint = "the number of (q, k) pairs with key position <= query position"
            _fail(f"pairs(q={qp}, k={kp}): {got}, expected {want}", hint)
    # the balance the two give: every rank the same causal work under zigzag
    for n, T in ((4, 24), (3, 18)):
        pos = [torch.as_tensor(positions(r, n, T)) for r in range(n)]
        per_rank = [sum(int(pairs(pos[r], pos[j])) for j in range(n)) for r in range(n)]
        if len(set(per_rank)) != 1 or sum(per_rank) != T * (T + 1) // 2:
            _fail(f"causal pairs per rank under zigzag, n={n}, T={T}: {per_rank}", "see the positions above")
    print(
        "zigzag: every rank's positions right for n = 2, 3, 4; causal pairs counted right; the causal work equal on every rank"
    )


# ---------------------------------------------------------------- 5. Ulysses' all-to-all pair
ULYSSES_SHAPE = (3, 4, 12, 5)  # (B, H, T, D): n = 2 gives 2 heads and 6 positions per rank, D = 5;
# every size differs from the others it could be mistaken for (heads vs positions, T/n vs D, B vs H)
ULYSSES_CASES = ("pairs", "world")  # groups {0, 2} / {1, 3} (n = 2, not the world) first, then n = 4
ODD_HEADS = (1, 3, 2, 2)  # 3 heads do not split over 2 ranks: refused
A2A = "all_to_all_single"


def _labelled(shape=ULYSSES_SHAPE):
    """The whole (B, H, T, D) whose value names its place: 1 + 10000 b + 1000 h + 10 t + d."""
    idx = torch.meshgrid(*(torch.arange(s) for s in shape), indexing="ij")
    return (1 + 10000 * idx[0] + 1000 * idx[1] + 10 * idx[2] + idx[3]).to(seq_lab.DTYPE)


def _ulysses_group(where, rank, pairs):
    return pairs[rank % 2] if where == "pairs" else dist.group.WORLD


def _a2a_events(trace, window):
    """The collectives and point-to-point calls in `window`: (op, nbytes, bytes sent)."""
    return [
        (e["op"], e["nbytes"], e.get("intra_bytes", 0) + e.get("inter_bytes", 0))
        for e in trace["events"]
        if window[0] <= e["start"] < window[1] and e["kind"] == "collective"
    ]


def _ulysses_rank(to_heads, to_seq):
    from labkit.observe import tracing

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    B, H, T, D = ULYSSES_SHAPE
    labelled = _labelled()
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(ULYSSES_SHAPE, dtype=seq_lab.DTYPE, generator=g) for _ in range(4))
    out: dict = {}
    for where in ULYSSES_CASES:
        group = _ulysses_group(where, rank, pairs)
        r, n = dist.get_rank(group), dist.get_world_size(group)
        res: dict = {"windows": {}}
        out[where] = res
        label = f"rank {rank} (index {r} of n = {n}, {where} group)"
        hint = lambda msg, w=where: _ulysses_error_hint(msg, w, rank)  # noqa: E731
        # 1. labelled values: seq_to_heads, then back
        x = torch.chunk(labelled, n, 2)[r].contiguous()
        t0 = tracing.clock()
        h = _returned(to_heads, x.clone(), group)
        res["windows"]["seq_to_heads"] = (t0, tracing.clock())
        res["heads"] = h if _is_str(h) else h.detach().clone()
        if not shared._agree(h, where=f"{label}, seq_to_heads", hint=hint):
            return out
        t0 = tracing.clock()
        back = _returned(to_seq, h.detach().clone(), group)
        res["windows"]["heads_to_seq"] = (t0, tracing.clock())
        res["back"] = back if _is_str(back) else back.detach().clone()
        if not shared._agree(back, where=f"{label}, heads_to_seq", hint=hint):
            return out
        # 2. attention built from the pair, forward and backward
        mine = [torch.chunk(t, n, 2)[r].clone().requires_grad_() for t in (q, k, v)]
        t0 = tracing.clock()
        o = shared._try(seq_lab.ulysses_attention, *mine, True, group, to_heads, to_seq)
        res["windows"]["forward"] = (t0, tracing.clock())
        if not _is_str(o) and not isinstance(o, torch.Tensor):
            o = f"returned {type(o).__name__}, not a tensor"
        if not _is_str(o) and not o.requires_grad:
            o = "detached"
        res["out"] = o if _is_str(o) else o.detach().clone()
        if not shared._agree(o, where=f"{label}, attention built from your pair", hint=hint):
            return out
        t0 = tracing.clock()
        grads = shared._try(
            torch.autograd.grad, o, mine, torch.chunk(dout, n, 2)[r].contiguous(), allow_unused=True
        )
        res["windows"]["backward"] = (t0, tracing.clock())
        res["grads"] = grads if _is_str(grads) else [None if gr is None else gr.clone() for gr in grads]
        if not shared._agree(grads, where=f"{label}, backward", hint=hint):
            return out
    # 3. a head count the group does not divide: refused on every rank before any message
    group = pairs[rank % 2]
    odd = shared._try(to_heads, _labelled(ODD_HEADS), group)
    out["refusal"] = odd if _is_str(odd) else f"returned {type(odd).__name__}"
    return out


def _ulysses_error_hint(message, where, rank=None):
    if "returned NoneType" in message:
        return "a function without `return` gives None: return the all-to-all's result, reshaped"
    if "not a tensor" in message:
        return "return one tensor: (B, H/n, T, D) from seq_to_heads, (B, H, T/n, D) from heads_to_seq"
    if message == "detached":
        return (
            "no gradient reaches q, k, v: the output does not require grad. all_to_all_single writes "
            "into a buffer autograd does not see (and .detach() cuts the graph): use "
            "all_to_all_autograd, whose backward is the all-to-all the other way"
        )
    if "does not divide equally across the group size 4" in message and where == "pairs":
        return (
            "the all-to-all ran over the world (4 ranks): pass group=group, the Ulysses group "
            "(2 ranks here): all_to_all_autograd(send, group=group)"
        )
    if "must be contiguous" in message or "view size is not compatible" in message:
        return (
            "a transposed or permuted tensor is not contiguous: .contiguous() before the all-to-all "
            "(labkit's all_to_all_single refuses it) and .reshape (not .view) after a permute"
        )
    if where == "pairs" and rank is not None and rank >= 2 and ("index" in message or "range" in message):
        return (
            f"global rank {rank} is index {rank // 2} of its group: dist.get_rank(group), not dist.get_rank() "
            "(the group's ranks are numbered 0 .. n-1)"
        )
    if "stack expects each tensor to be equal size" in message or "split_sizes" in message:
        return "n must divide the heads (seq_to_heads) and the positions (heads_to_seq): check it first"
    if "does not divide equally" in message:
        return "the all-to-all's dim 0 is the destination rank: n rows, one per rank of the group"
    return "see the error above"


def _ulysses_hint(got, x_whole, r, n, what):
    """The mistake whose result `got` equals (seq_to_heads' output of the labelled input)."""
    B, H, T, D = x_whole.shape
    h, tl = H // n, T // n
    pieces = torch.chunk(x_whole, n, 2)
    sims = {
        "interleaved": x_whole[:, r::n],
        "reversed": torch.cat(pieces[::-1], 2)[:, r * h : (r + 1) * h],
        "T and D": x_whole[:, r * h : (r + 1) * h].transpose(2, 3).reshape(B, h, T, D),
        "pieces T and D": torch.cat(
            [p[:, r * h : (r + 1) * h].transpose(2, 3).reshape(B, h, tl, D) for p in pieces], 2
        ),
    }
    if not isinstance(got, torch.Tensor):
        return "see the error above"
    for name, sim in sims.items():
        if _close(sim, got, 0):
            return ULYSSES_HINTS[name]
    if got.shape == (B, h, D, T) or got.shape == (B, h, D, tl):
        return ULYSSES_HINTS["T and D"]
    if got.shape == (B, H, tl, D) or got.shape == (B, H, T // (n * n), D):
        return ULYSSES_HINTS["positions"]
    if got.shape[1] == H // 4 and n == 2:
        return ULYSSES_HINTS["world n"]
    if got.shape != (B, h, T, D):
        return f"{what} returns (B, H/n, T, D) = {(B, h, T, D)}"
    return f"{what}: rank r gets heads [r H/n, (r+1) H/n) of every rank's positions, in rank order"


ULYSSES_HINTS = {
    "interleaved": "heads interleaved: rank j must get the heads [j H/n, (j+1) H/n), a contiguous block "
    "(torch.chunk(x, n, dim=1), or reshape(B, n, H/n, ...)), not heads j, j + n, ... (reshape(B, H/n, n, ...))",
    "reversed": "the sequence pieces in the wrong rank order: what arrives from group rank i holds positions "
    "[i T/n, (i+1) T/n) and goes i-th along the sequence (dim 0 of the all-to-all's output is the source)",
    "T and D": "positions and head_dim swapped: a transpose(-1, -2) (or permute) exchanged T and D; "
    "the output is (B, H/n, T, D)",
    "pieces T and D": "positions and head_dim swapped inside each rank's piece: a transpose exchanged T/n "
    "and D before the reshape",
    "positions": "chunked the positions where the heads go: seq_to_heads splits the HEADS (dim 1) into n "
    "groups, group j to rank j, and concatenates what arrives along the positions (dim 2)",
    "world n": "n is the Ulysses group's size, dist.get_world_size(group) (2 here), not the world's (4)",
}


def _round_trip_hint(back, x, heads, n):
    """The mistake heads_to_seq's `back` shows, seq_to_heads' right `heads` its input."""
    B, H, tl, D = x.shape
    if not isinstance(back, torch.Tensor):
        return "see the error above"
    if _close(heads, back, 0):
        return (
            "heads_to_seq returned its input, (B, H/n, T, D): the output is not turned back. "
            "heads_to_seq is an all-to-all too (the 4th of a layer): positions piece j to rank j"
        )
    if back.shape == (B, H // n, tl, D):
        return (
            "heads_to_seq kept this rank's positions of its own heads only: every rank's heads must "
            "come back, one all-to-all (positions piece j to rank j, what arrives along the heads)"
        )
    if _close(torch.cat(torch.chunk(x, n, 1)[::-1], 1), back, 0):
        return (
            "the heads in the wrong rank order: what arrives from group rank i holds heads [i H/n, (i+1) H/n)"
        )
    if back.shape != x.shape:
        return (
            "heads_to_seq is seq_to_heads' inverse: split the POSITIONS (dim 2) into n pieces, piece j to "
            "rank j, and concatenate what arrives along the heads (dim 1): (B, H, T/n, D)"
        )
    return "heads_to_seq must undo seq_to_heads exactly: heads_to_seq(seq_to_heads(x)) == x"


def check_ulysses(to_heads: Callable, to_seq: Callable) -> None:
    from labkit.comm.all_to_all import wire_bytes
    from labkit.strategies.ulysses import layer_bytes

    results = _run(_ulysses_rank, to_heads, to_seq)
    flat = [c.get(key) for res in results for c in res.values() if isinstance(c, dict) for key in c]
    flat += [res.get("refusal") for res in results]
    if any(_is_str(v) and v == NOT_IMPLEMENTED for v in flat):
        raise NotImplementedError(NOT_IMPLEMENTED)
    whole = _labelled()
    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(ULYSSES_SHAPE, dtype=seq_lab.DTYPE, generator=g) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = seq_lab.one_process(ref[0], ref[1], ref[2], True)
    want.backward(dout)
    for where in ULYSSES_CASES:
        n = 2 if where == "pairs" else 4
        ran = [(rank, res[where]) for rank, res in enumerate(results) if where in res]
        for step in ("heads", "back", "out", "grads"):
            _ulysses_errors(ran, where, n, step)
            for rank, got in ran:
                _ulysses_values(rank, got, where, n, step, whole, want, ref)
        _check_ulysses_bytes(results, where, n, wire_bytes, layer_bytes)
    for rank, res in enumerate(results):
        said = res.get("refusal")
        ok = isinstance(said, str) and "ValueError" in said and "3" in said and "2" in said and "head" in said
        if not ok:
            _fail(
                f"rank {rank}, seq_to_heads of 3 heads over 2 ranks: {said}",
                "refuse a head count the group does not divide, before any message: raise ValueError "
                'naming both (e.g. f"{H} heads do not split over {n} ranks"); Ulysses gives every rank '
                "H/n whole heads (with GQA, the KV heads too)",
            )
    print(
        "Ulysses' pair: right on groups {0, 2}, {1, 3} (n = 2) and on 4 ranks, heads_to_seq(seq_to_heads(x)) "
        f"== x; causal attention from it equal to one process's, forward and dq, dk, dv (atol {ATOL:g}); "
        "one all-to-all per call, a layer's bytes layer_bytes'; 3 heads over 2 ranks refused"
    )


def _ulysses_errors(ran, where, n, step):
    """A rank's own error at this step first (its peers' "another rank raised" are its consequence)."""
    what = {"heads": "seq_to_heads", "back": "heads_to_seq", "out": "attention", "grads": "backward"}[step]
    for rank, got in ran:
        value = got.get(step)
        if _is_str(value) and not value.startswith(shared.ANOTHER):
            _fail(
                f"rank {rank}, {where} group (n = {n}), {what}: {value}",
                _ulysses_error_hint(value, where, rank),
            )


def _ulysses_values(rank, got, where, n, step, whole, want, ref):
    H = ULYSSES_SHAPE[1]
    r = rank // 2 if where == "pairs" else rank
    label = f"rank {rank} (index {r} of n = {n}, {where} group)"
    x = torch.chunk(whole, n, 2)[r]
    want_h = whole[:, r * H // n : (r + 1) * H // n]
    if step == "heads" and not _close(want_h, got["heads"], 0):
        _fail(
            f"{label}, seq_to_heads of (B, H, T/n, D) = {tuple(x.shape)}: {_diff(want_h, got['heads'])}",
            _ulysses_hint(got["heads"], whole, r, n, "seq_to_heads"),
        )
    if step == "back" and not _close(x, got["back"], 0):
        _fail(
            f"{label}, heads_to_seq(seq_to_heads(x)) is not x: {_diff(x, got['back'])}",
            _round_trip_hint(got["back"], x, got["heads"], n),
        )
    if step == "out":
        expected = torch.chunk(want.detach(), n, 2)[r]
        if not _close(expected, got["out"]):
            _fail(
                f"{label}, causal attention built from your pair: {_diff(expected, got['out'])} from one "
                "process's scaled_dot_product_attention",
                "seq_to_heads on q, k and v, attention on (B, H/n, T, D), heads_to_seq back",
            )
    if step == "grads":
        for name, w, gr in zip("qkv", ref, got["grads"]):
            expected = torch.chunk(w.grad, n, 2)[r]
            if gr is None:
                _fail(f"{label}, backward: no gradient for {name}", _ulysses_error_hint("detached", where))
            if not _close(expected, gr):
                _fail(
                    f"{label}, backward: d{name} {_diff(expected, gr)} from one process's",
                    "the all-to-all's backward is the all-to-all the other way: all_to_all_autograd "
                    "(or moe_lab's Function) carries it; a hand-written backward must send each "
                    "gradient row back to where its row came from",
                )


def _check_ulysses_bytes(results, where, n, wire_bytes, layer_bytes):
    B, H, T, D = ULYSSES_SHAPE
    local = B * H * (T // n) * D * 8  # one of q, k, v, out on a rank, float64
    for rank, (trace, res) in enumerate(zip(results.traces, results)):
        r = rank // 2 if where == "pairs" else rank
        label = f"rank {rank} (index {r} of n = {n}, {where} group)"
        wins = res[where]["windows"]
        for name in ("seq_to_heads", "heads_to_seq"):
            events = _a2a_events(trace, wins[name])
            ops = [e[0] for e in events]
            if ops != [A2A]:
                gathers = any("gather" in op for op in ops)
                _fail(
                    f"{label}, {name}: the tracer saw {ops or 'no collective'}, expected one {A2A}",
                    "an all-gather sends every rank's whole piece to every rank, (n-1) x the local tensor, where "
                    "the all-to-all sends (n-1)/n of it: one all-to-all per call"
                    if gathers
                    else f"{name} is ONE all-to-all over the group (labkit's all_to_all_autograd)",
                )
            _, nbytes, sent = events[0]
            formula = wire_bytes([1] * n, r, local // n)
            if nbytes != local or sent != formula:
                _fail(
                    f"{label}, {name}: an all-to-all of {nbytes} bytes sending {sent}; expected the rank's "
                    f"{local} bytes, sending {formula} ((n-1)/n of them plus headers)",
                    "the all-to-all moves this rank's whole tensor once, n pieces of equal size",
                )
        want = layer_bytes(B, T, H * D, n, 8, r)["wire"]
        for direction in ("forward", "backward"):
            events = _a2a_events(trace, wins[direction])
            sent = sum(e[2] for e in events)
            if [e[0] for e in events] != [A2A] * 4 or sent != want:
                _fail(
                    f"{label}, attention {direction}: {len(events)} collectives sending {sent} bytes, expected 4 "
                    f"all-to-alls sending layer_bytes' {want}",
                    "q, k, v in and the output back: 4 all-to-alls each way, nothing else",
                )
