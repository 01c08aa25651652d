"""Exercise 1's check: f and g, the autograd conjugates, on 4 ranks (tp groups {0, 2} and {1, 3}):
each forward and backward against the sums over the tp group (and over the world, to name an
all-reduce over the default group), then a column -> row MLP built from torch's local shards with
the learner's f and g against one process and torch's parallelize_module."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.checks import NOT_IMPLEMENTED
from labkit.labs.tp_checks.shared import (
    _fail,
    ATOL,
    TORCH_COLLECTIVES,
    TP,
    WORLD_GROUP,
    _agree,
    _close,
    _diff,
    _error_hint,
    _group_info,
    _local,
    _mesh,
    _run,
    _torch_collectives,
    _try,
    _where,
)


def _data(rank, shape=(2, 3), scale=1):
    return (torch.arange(6.0).reshape(shape) * (rank + 1) * scale + 1).float()


def _up(rank):
    return _data(rank, scale=-2) + 3


def _conj_rank(f, g):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from labkit.observe import tracing

    mesh = _mesh()
    group, rank = mesh.get_group(), dist.get_rank()
    res = _group_info(mesh)
    res["windows"], where = {}, _where(res)
    for name, fn in (("f", f), ("g", g)):
        x = _data(rank).requires_grad_()
        up = _up(rank)  # each its own: an in-place backward shows on this tensor, not on g's
        before = x.detach().clone()
        start = tracing.clock()
        y = _try(fn, x, group)
        res["windows"][f"{name} forward"] = (start, tracing.clock())
        if not _agree(y, where=f"{where}, {name}", hint=lambda msg: _error_hint(res, msg)):
            res[name] = y if isinstance(y, str) else "another rank raised"
            continue
        after = x.detach().clone()
        start = tracing.clock()
        grad = _try(lambda: torch.autograd.grad(y, x, up)[0])
        res["windows"][f"{name} backward"] = (start, tracing.clock())
        _agree(grad, where=f"{where}, {name}, backward", hint=lambda msg: _backward_hint(res, msg))
        res[name] = {
            "out": y.detach().clone(),
            "grad": grad,
            "changed": not torch.equal(before, after),
            "up_changed": not torch.equal(up, _up(rank)),
        }
    # a 2-layer MLP from torch's local shards, with f and g: against torch's parallelize_module
    torch.manual_seed(3)
    full = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 6, bias=False))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    theirs = parallelize_module(copy.deepcopy(full), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    xt = x.clone().requires_grad_()
    out_t = theirs(xt)
    out_t.square().sum().backward()
    local = {n: _local(p).detach().clone().requires_grad_() for n, p in theirs.named_parameters()}

    def hand(xh):
        h = F.gelu(F.linear(f(xh, group), local["0.weight"], local["0.bias"]))
        out = g(F.linear(h, local["2.weight"]), group)
        out.square().sum().backward()
        return out

    xh = x.clone().requires_grad_()
    out_h = _try(hand, xh)
    _agree(out_h, where=f"{where}, the MLP with your f and g", hint=lambda msg: _error_hint(res, msg))
    res["mlp"] = out_h
    if not isinstance(out_h, str):
        res["mlp"] = {
            "out": out_h.detach().clone(),
            "x_grad": xh.grad.clone(),
            "grads": {n: p.grad.clone() for n, p in local.items()},
            "torch": {
                "out": out_t.detach().clone(),
                "x_grad": xt.grad.clone(),
                "grads": {n: _local(p.grad).clone() for n, p in theirs.named_parameters()},
            },
        }
    res["state"], res["x"] = full.state_dict(), x
    return res


def _backward_hint(res, msg):
    if "incorrect number of gradients" in msg:
        return "backward returns one gradient per input of forward: (grad, None), None for the group"
    return _error_hint(res, msg)


def _written(res) -> bool:
    """False when f's (or g's) forward or backward raised NotImplementedError."""
    if isinstance(res, str):
        return res != NOT_IMPLEMENTED
    return not (isinstance(res["grad"], str) and res["grad"] == NOT_IMPLEMENTED)


def check_conjugates(f: Callable, g: Callable) -> None:
    results = _run(_conj_rank, f, g, world_size=4)
    # f and g are checked apart: one written and wrong says so while the other is still a TODO
    written = {name: all(_written(r[name]) for r in results) for name in ("f", "g")}
    if not any(written.values()):
        raise NotImplementedError(NOT_IMPLEMENTED)
    for res, trace in zip(results, results.traces):
        where = _where(res)
        for name in ("f", "g"):
            if not written[name]:
                continue
            got = res[name]
            if isinstance(got, str):
                _fail(f"{where}, {name}: {got}", _error_hint(res, got))
            if isinstance(got["grad"], str):
                _fail(f"{where}, {name}, backward: {got['grad']}", _backward_hint(res, got["grad"]))
            if got["changed"]:
                _fail(
                    f"{where}, {name}: the input x changed",
                    "ring_all_reduce works in place: all-reduce a copy (x.clone()), never the caller's tensor",
                )
            if got["up_changed"]:
                _fail(
                    f"{where}, {name} backward: the incoming gradient changed",
                    f"{name}'s backward all-reduced the gradient it was given in place: autograd may "
                    "hold that tensor elsewhere (here the caller's own); all-reduce a copy "
                    "(grad.clone()) and return it",
                )
        if written["f"]:
            _check_f(res, results)
        if written["g"]:
            _check_g(res, results)
        for key, window in res["windows"].items():
            ops = _torch_collectives(trace, window)
            if ops and written[key[0]]:
                _fail(
                    f"{where}, {key}: called {sorted(set(ops))}",
                    TORCH_COLLECTIVES.format(ops=", ".join(sorted(set(ops)))),
                )
    if not all(written.values()):
        raise NotImplementedError(NOT_IMPLEMENTED)  # the one written is right so far
    _check_conj_mlp(results)
    print(
        "f and g on 4 ranks, tp groups {0, 2} and {1, 3}: forward and backward right on every rank; "
        "in a column -> row MLP equal to one process and to torch's parallelize_module "
        f"(atol {ATOL:g})"
    )


def _sums(results, res):
    """(x, upstream, their sums over res's tp group, their sums over the world)."""
    r = res["rank"]
    peers, world = res["peers"], range(len(results))
    return (
        _data(r),
        _up(r),
        sum(_data(p) for p in peers),
        sum(_up(p) for p in peers),
        sum(_data(p) for p in world),
        sum(_up(p) for p in world),
    )


def _check_f(res, results):
    x, up, total_x, total_up, world_x, world_up = _sums(results, res)
    f_res, where = res["f"], _where(res)
    if not torch.equal(f_res["out"], x):
        hint = (
            "f and g swapped? f's forward is the identity (every rank already holds the whole x); "
            "its all-reduce is in backward"
            if torch.equal(f_res["out"], total_x) or torch.equal(f_res["out"], world_x)
            else "f's forward returns x itself (x.view_as(x))"
        )
        _fail(f"{where}, f forward: {f_res['out'].tolist()}, expected {x.tolist()}", hint)
    if not torch.equal(f_res["grad"], total_up):
        if torch.equal(f_res["grad"], up):
            hint = (
                "f's backward must SUM the gradient over the group (ring_all_reduce): each rank's "
                "column block contributed only its part of dL/dx"
            )
        elif torch.equal(f_res["grad"], world_up):
            hint = "f's backward " + WORLD_GROUP.format(n=len(results), t=TP)
        elif torch.allclose(f_res["grad"] * 2, total_up):
            hint = "an average: f's backward sums (op='sum'), every rank's part is a whole contribution"
        else:
            hint = "f's backward: the gradient all-reduced (sum) over the group"
        _fail(f"{where}, f backward: {f_res['grad'].tolist()}, expected {total_up.tolist()}", hint)


def _check_g(res, results):
    x, up, total_x, total_up, world_x, world_up = _sums(results, res)
    g_res, where = res["g"], _where(res)
    if not torch.equal(g_res["out"], total_x):
        if torch.equal(g_res["out"], x):
            hint = "g's forward must SUM the partial outputs over the group (f and g swapped?)"
        elif torch.equal(g_res["out"], world_x):
            hint = "g's forward " + WORLD_GROUP.format(n=len(results), t=TP)
        elif torch.allclose(g_res["out"] * 2, total_x):
            hint = "an average: g's forward sums (op='sum'), each rank holds a partial SUM"
        else:
            hint = "g's forward: a copy of x all-reduced (sum) over the group"
        _fail(f"{where}, g forward: {g_res['out'].tolist()}, expected {total_x.tolist()}", hint)
    if not torch.equal(g_res["grad"], up):
        hint = (
            "g's backward is the identity: every rank already holds the whole gradient of g's "
            "(replicated) output; summing it counts it once per rank"
            if torch.equal(g_res["grad"], total_up) or torch.equal(g_res["grad"], world_up)
            else "g's backward returns the gradient unchanged: (grad, None)"
        )
        _fail(f"{where}, g backward: {g_res['grad'].tolist()}, expected {up.tolist()}", hint)


def _check_conj_mlp(results):
    state, x = results[0]["state"], results[0]["x"]
    full = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 6, bias=False))
    full.load_state_dict(state)
    xr = x.clone().requires_grad_()
    out = full(xr)
    out.square().sum().backward()
    for res in results:
        mlp, r = res["mlp"], res["tp_rank"]
        if isinstance(mlp, str):
            _fail(f"{_where(res)}, the MLP with your f and g: {mlp}", _error_hint(res, mlp))
        want = {
            "0.weight": torch.chunk(full[0].weight.grad, TP, 0)[r],
            "0.bias": torch.chunk(full[0].bias.grad, TP)[r],
            "2.weight": torch.chunk(full[2].weight.grad, TP, 1)[r],
        }
        for ref_name, ref in (
            ("one process", {"out": out, "x_grad": xr.grad, "grads": want}),
            ("torch", mlp["torch"]),
        ):
            for key in ("out", "x_grad"):
                if not _close(ref[key].detach(), mlp[key]):
                    _fail(
                        f"{_where(res)}, the MLP with your f and g: {key} differs from {ref_name}'s ({_diff(ref[key], mlp[key])})",
                        "f in front of the column-parallel layer, g after the row-parallel one",
                    )
            for n, g in ref["grads"].items():
                if not _close(g, mlp["grads"][n]):
                    _fail(
                        f"{_where(res)}, the MLP: {n}'s gradient differs from {ref_name}'s ({_diff(g, mlp['grads'][n])})",
                        "see f's and g's backward",
                    )
