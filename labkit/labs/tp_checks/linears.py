"""Exercise 2's check: column- and row-parallel Linear on 4 ranks (tp groups {0, 2} and {1, 3}):
each rank's pieces against torch.chunk's, then column -> GELU -> row forward and backward against
one process and torch's ColwiseParallel / RowwiseParallel, an uneven Linear(7, 9) (5 + 4 output
features) and copy_input=False (no f: the caller applies it)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from labkit.labs.tp_checks.shared import (
    _fail,
    ANOTHER,
    ATOL,
    TP,
    WORLD_RANK,
    _agree,
    _build_then_run,
    _close,
    _diff,
    _error_hint,
    _group_info,
    _local,
    _mesh,
    _not_implemented,
    _run,
    _try,
    _where,
)


def _linear_hint(res, msg):
    if "nn.Parameter" in msg:
        return "keep this rank's pieces as nn.Parameter attributes self.weight and self.bias"
    return _error_hint(res, msg)


def _linear_rank(col, row):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh()
    group = mesh.get_group()
    info = _group_info(mesh)
    torch.manual_seed(5)
    full = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 6))
    uneven = nn.Linear(7, 9)
    gen = torch.Generator().manual_seed(6)
    x, xu, up = (
        torch.randn(3, 8, generator=gen),
        torch.randn(3, 7, generator=gen),
        torch.randn(3, 6, generator=gen),
    )
    res = {
        **info,
        "state": full.state_dict(),
        "uneven_state": uneven.state_dict(),
        "x": x,
        "xu": xu,
        "up": up,
    }

    def run(model, xin, upstream):
        xin = xin.clone().requires_grad_()
        out = model(xin)
        out.backward(upstream if upstream is not None else torch.ones_like(out))
        params = {
            n: (_local(p).detach().clone(), None if p.grad is None else _local(p.grad).clone())
            for n, p in model.named_parameters()
        }
        return {"out": out.detach().clone(), "x_grad": xin.grad.clone(), "params": params}

    def build():
        model = nn.Sequential(col(full[0], group), nn.GELU(), row(full[2], group))
        for i in (0, 2):
            if not isinstance(getattr(model[i], "weight", None), nn.Parameter):
                raise AttributeError(f"layer {i}: no nn.Parameter self.weight")
        return model

    where, hint = _where(info), lambda msg: _linear_hint(info, msg)
    model = _try(build)
    if not _agree(model, where=f"{where}, building the layers", hint=hint):
        res["mine"] = model if isinstance(model, str) else f"{ANOTHER} raised, building the layers"
        if not isinstance(model, str):
            res["split"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        res["split"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        res["mine"] = _try(run, model, x, up)
        _agree(res["mine"], where=f"{where}, column -> GELU -> row", hint=hint)
    res["torch"] = run(
        parallelize_module(copy.deepcopy(full), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}), x, up
    )
    res["uneven"] = _build_then_run(
        lambda: col(uneven, group), lambda m: run(m, xu, None), f"{where}, Linear(7, 9) column-parallel", hint
    )
    res["uneven_torch"] = run(parallelize_module(copy.deepcopy(uneven), mesh, ColwiseParallel()), xu, None)
    res["no_copy"] = _build_then_run(
        lambda: col(full[0], group, copy_input=False),
        lambda m: run(m, x, None),
        f"{where}, copy_input=False",
        hint,
    )
    return res


def _one_process_linears(res):
    full = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 6))
    full.load_state_dict(res["state"])
    x = res["x"].clone().requires_grad_()
    out = full(x)
    out.backward(res["up"])
    uneven = nn.Linear(7, 9)
    uneven.load_state_dict(res["uneven_state"])
    xu = res["xu"].clone().requires_grad_()
    out_u = uneven(xu)
    out_u.backward(torch.ones_like(out_u))
    return full, out.detach(), x.grad, uneven, out_u.detach(), xu.grad


def _check_split(res, full, split):
    rank, where = res["tp_rank"], _where(res)
    pieces = {
        "0.weight": torch.chunk(full[0].weight, 2, 0)[rank],
        "0.bias": torch.chunk(full[0].bias, 2)[rank],
        "2.weight": torch.chunk(full[2].weight, 2, 1)[rank],
        "2.bias": full[2].bias,
    }
    for name, want in pieces.items():
        got = split.get(name)
        if got is None:
            _fail(
                f"{where}: no parameter {name!r} (yours: {sorted(split)})",
                "self.weight and self.bias, nn.Parameter (bias None when the layer has none)",
            )
        if torch.equal(got, want.detach()):
            continue
        world = res["rank"]
        dim = 1 if name == "2.weight" else 0
        chunks = torch.chunk(full[int(name[0])].get_parameter(name[2:]).detach(), TP, dim)
        if name != "2.bias" and world != rank and world < TP and torch.equal(got, chunks[world]):
            hint = WORLD_RANK.format(**res)
        elif name == "0.weight" and got.shape == torch.chunk(full[0].weight, 2, 1)[rank].shape:
            hint = "column-parallel splits the OUTPUT features: the weight's rows, torch.chunk(w, tp, dim=0)"
        elif name == "2.weight" and got.shape == torch.chunk(full[2].weight, 2, 0)[rank].shape:
            hint = "row-parallel splits the INPUT features: the weight's columns, torch.chunk(w, tp, dim=1)"
        elif name == "2.bias":
            hint = "the row-parallel bias stays whole: it is added once, to the summed output"
        elif got.shape == want.shape:
            hint = "rank r keeps piece r of torch.chunk: r = dist.get_rank(group)"
        else:
            hint = "torch.chunk(weight, tp, dim)[rank] (and the bias's matching piece)"
        _fail(f"{where}, {name}: {_diff(want.detach(), got)} from torch.chunk's piece", hint)


def check_linears(col: type, row: type) -> None:
    results = _run(_linear_rank, col, row, world_size=4)
    _not_implemented([r[k] for r in results for k in ("mine", "uneven", "no_copy")])
    full, out, x_grad, uneven, out_u, xu_grad = _one_process_linears(results[0])
    for res in results:  # every rank's build and pieces first: a rank that raised names the cause
        if isinstance(res["mine"], str) and "split" not in res:
            _fail(f"{_where(res)}, building the layers: {res['mine']}", _linear_hint(res, res["mine"]))
        _check_split(res, full, res["split"])
    for res in results:
        rank, where = res["tp_rank"], _where(res)  # every rank's build and pieces passed above
        for case in ("mine", "uneven", "no_copy"):
            if isinstance(res[case], str):
                _fail(f"{where}, {case}: {res[case]}", _linear_hint(res, res[case]))
        # the split first: weights and biases as torch.chunk's (a wrong one may fail the forward)
        mine, theirs = res["mine"], res["torch"]
        for ref_name, ref in (("one process", {"out": out, "x_grad": x_grad}), ("torch", theirs)):
            if not _close(ref["out"], mine["out"]):
                bias = full[2].bias.detach()
                if _close(ref["out"] + bias, mine["out"]):
                    hint = "the bias was added on every rank before g: add it once, after the sum"
                else:
                    hint = "the row-parallel output is g(F.linear(x_local, w_local)) + bias: each rank's product is a partial sum"
                _fail(
                    f"{where}, column -> GELU -> row: output differs from {ref_name}'s ({_diff(ref['out'], mine['out'])})",
                    hint,
                )
            if not _close(ref["x_grad"], mine["x_grad"]):
                _fail(
                    f"{where}, column -> GELU -> row: the input's gradient differs from {ref_name}'s ({_diff(ref['x_grad'], mine['x_grad'])})",
                    "the column-parallel layer applies f to its input (copy_input=True): the input's gradient is the sum of every rank's part",
                )
        grads = {
            "0.weight": torch.chunk(full[0].weight.grad, TP, 0)[rank],
            "0.bias": torch.chunk(full[0].bias.grad, TP)[rank],
            "2.weight": torch.chunk(full[2].weight.grad, TP, 1)[rank],
            "2.bias": full[2].bias.grad,
        }
        for name, want in grads.items():
            got = mine["params"][name][1]
            for ref_name, ref in (("one process", want), ("torch", theirs["params"][name][1])):
                if not _close(ref, got):
                    _fail(
                        f"{where}: {name}'s gradient differs from {ref_name}'s ({'none' if got is None else _diff(ref, got)})",
                        "see the forward above",
                    )
        # uneven: Linear(7, 9) colwise gives 5 and 4 output features
        mine_u, theirs_u = res["uneven"], res["uneven_torch"]
        want = torch.chunk(out_u, TP, -1)[rank]
        for ref_name, ref in (("one process", want), ("torch", theirs_u["out"])):
            if not _close(ref, mine_u["out"]):
                _fail(
                    f"{where}, Linear(7, 9) column-parallel: output {_diff(ref, mine_u['out'])} from {ref_name}'s",
                    "torch.chunk: 9 rows over 2 ranks are ceil(9/2) = 5, then 4 (not 9 // 2 = 4 each)",
                )
        for ref_name, ref in (("one process", xu_grad), ("torch", theirs_u["x_grad"])):
            if not _close(ref, mine_u["x_grad"]):
                _fail(
                    f"{where}, Linear(7, 9): the input's gradient differs from {ref_name}'s",
                    "f in front: the gradient summed over the ranks",
                )
        # copy_input=False: no f (the caller applied it); the input's gradient stays this rank's part
        w = torch.chunk(full[0].weight.detach(), TP, 0)[rank]
        part = torch.ones(3, w.shape[0]) @ w
        if not _close(part, res["no_copy"]["x_grad"]):
            _fail(
                f"{where}, copy_input=False: the input's gradient is not this rank's own part",
                "with copy_input=False the layer applies no f: the caller (exercise 3's attention) applies it once",
            )
    print(
        "column- and row-parallel Linear on 4 ranks (tp groups {0, 2}, {1, 3}): torch.chunk's pieces, outputs and gradients equal to one process "
        f"and to torch's ColwiseParallel / RowwiseParallel (atol {ATOL:g}), also Linear(7, 9) split 5 + 4"
    )
