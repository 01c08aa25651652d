"""Checks for tp_lab's exercises: each runs the learner's code on gloo ranks and compares it
element-wise with one process AND with torch's tensor parallelism (parallelize_module with
ColwiseParallel / RowwiseParallel; for FSDP x TP also fully_shard(mesh=mesh["dp"])).

    check_conjugates(f, g)              f(x, group), g(x, group): the autograd conjugates (2 ranks)
    check_linears(Col, Row)             Col(full, group, copy_input=True), Row(full, group) (2 ranks)
    check_blocks(TPMLP, TPAttention)    the TP MLP and attention blocks, one all-reduce forward and
                                        one backward each (2 ranks, counted by the tracer)
    check_fsdp_tp(shard, gather, reduce_grad)   the dp sharding of FSDP x TP on 2 x 2 ranks, then 3
                                        SGD steps of the block (4 ranks)

Each raises one AssertionError naming the rank and case, with a "hint:" for the mistake it
recognises (f and g swapped, an all-reduce left out or added, AVG for SUM, the input reduced in
place, the weight split along the wrong dim or not as torch.chunk, the bias added on every rank,
f applied per projection, the global head count, the wrong mesh dimension or rank, SUM for AVG).
Tolerances: fp32; a row-parallel layer sums its input features as tp partial sums (another
order than one process), and torch's RowwiseParallel adds bias / tp on each rank before the
all-reduce: both differ from ours in the last bits (measured <= 1.5e-8 on 3 steps of the block),
so values are compared within atol 1e-6 (a mistake is off by far more).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.labs import tp_lab

NOT_IMPLEMENTED = "not implemented yet"
ATOL = 1e-6


def _run(fn, *args, world_size=2):
    import labkit

    # gloo even on a GPU machine: the lab's meshes and tensors are CPU ones
    return labkit.run(fn, *args, world_size=world_size, backend="gloo", timeout=180)


def _fail(what, hint):
    raise AssertionError(f"{what}\nhint: {hint}")


def _attempt(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        return NOT_IMPLEMENTED
    except Exception as exc:  # reported by the kernel, with the case
        return f"raised {type(exc).__name__}: {exc}"


def _not_implemented(values):
    if any(isinstance(v, str) and v == NOT_IMPLEMENTED for v in values):
        raise NotImplementedError(NOT_IMPLEMENTED)


def _close(a, b, atol=ATOL):
    return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=atol)


def _diff(a, b):
    return (
        f"max |diff| {(a - b).abs().max().item():.3g}"
        if a.shape == b.shape
        else f"shape {tuple(b.shape)}, expected {tuple(a.shape)}"
    )


def _quiet_torch():
    """torch's DTensor warns (stderr) that its 2-D full_tensor() takes two all-gathers: not ours."""
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------- 1. f and g
def _data(rank, shape=(2, 3), scale=1):
    return (torch.arange(6.0).reshape(shape) * (rank + 1) * scale + 1).float()


def _conj_rank(f, g):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh()
    group, rank = mesh.get_group(), dist.get_rank()
    up = _data(rank, scale=-2) + 3
    res = {}
    for name, fn in (("f", f), ("g", g)):
        x = _data(rank).requires_grad_()
        before = x.detach().clone()
        y = _attempt(fn, x, group)
        if isinstance(y, str):
            res[name] = y
            continue
        after = x.detach().clone()
        grad = _attempt(lambda: torch.autograd.grad(y, x, up)[0])
        res[name] = {"out": y.detach().clone(), "grad": grad, "changed": not torch.equal(before, after)}
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
    out_h = _attempt(hand, xh)
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
    return res, full.state_dict(), x


def _written(res) -> bool:
    """False when f's (or g's) forward or backward raised NotImplementedError."""
    if isinstance(res, str):
        return res != NOT_IMPLEMENTED
    return not (isinstance(res["grad"], str) and res["grad"] == NOT_IMPLEMENTED)


def check_conjugates(f: Callable, g: Callable) -> None:
    results = _run(_conj_rank, f, g)
    # f and g are checked apart: one written and wrong says so while the other is still a TODO
    written = {name: all(_written(r[0][name]) for r in results) for name in ("f", "g")}
    if not any(written.values()):
        raise NotImplementedError(NOT_IMPLEMENTED)
    xs, ups = [_data(r) for r in (0, 1)], [_data(r, scale=-2) + 3 for r in (0, 1)]
    for rank, (res, _, _) in enumerate(results):
        for name in ("f", "g"):
            if not written[name]:
                continue
            got = res[name]
            where = f"rank {rank}, {name}"
            if isinstance(got, str):
                _fail(f"{where}: {got}", "see the error above")
            if isinstance(got["grad"], str):
                hint = (
                    "backward returns one gradient per input of forward: (grad, None), None for the group"
                    if "incorrect number of gradients" in got["grad"]
                    else "see the error above"
                )
                _fail(f"{where}, backward: {got['grad']}", hint)
            if got["changed"]:
                _fail(
                    f"{where}: the input x changed",
                    "ring_all_reduce works in place: all-reduce a copy (x.clone()), never the caller's tensor",
                )
        if written["f"]:
            _check_f(rank, res["f"], xs, ups)
        if written["g"]:
            _check_g(rank, res["g"], xs, ups)
    if not all(written.values()):
        raise NotImplementedError(NOT_IMPLEMENTED)  # the one written is right so far
    _check_conj_mlp(results)
    print(
        "f and g: forward and backward right on both ranks; in a column -> row MLP equal to one "
        f"process and to torch's parallelize_module (atol {ATOL:g})"
    )


def _check_f(rank, f_res, xs, ups):
    total_x, total_up = xs[0] + xs[1], ups[0] + ups[1]
    if not torch.equal(f_res["out"], xs[rank]):
        hint = (
            "f and g swapped? f's forward is the identity (every rank already holds the whole x); "
            "its all-reduce is in backward"
            if torch.equal(f_res["out"], total_x)
            else "f's forward returns x itself (x.view_as(x))"
        )
        _fail(f"rank {rank}, f forward: {f_res['out'].tolist()}, expected {xs[rank].tolist()}", hint)
    if not torch.equal(f_res["grad"], total_up):
        if torch.equal(f_res["grad"], ups[rank]):
            hint = (
                "f's backward must SUM the gradient over the group (ring_all_reduce): each rank's "
                "column block contributed only its part of dL/dx"
            )
        elif torch.allclose(f_res["grad"] * 2, total_up):
            hint = "an average: f's backward sums (op='sum'), every rank's part is a whole contribution"
        else:
            hint = "f's backward: the gradient all-reduced (sum) over the group"
        _fail(f"rank {rank}, f backward: {f_res['grad'].tolist()}, expected {total_up.tolist()}", hint)


def _check_g(rank, g_res, xs, ups):
    total_x, total_up = xs[0] + xs[1], ups[0] + ups[1]
    if not torch.equal(g_res["out"], total_x):
        if torch.equal(g_res["out"], xs[rank]):
            hint = "g's forward must SUM the partial outputs over the group (f and g swapped?)"
        elif torch.allclose(g_res["out"] * 2, total_x):
            hint = "an average: g's forward sums (op='sum'), each rank holds a partial SUM"
        else:
            hint = "g's forward: a copy of x all-reduced (sum) over the group"
        _fail(f"rank {rank}, g forward: {g_res['out'].tolist()}, expected {total_x.tolist()}", hint)
    if not torch.equal(g_res["grad"], ups[rank]):
        hint = (
            "g's backward is the identity: every rank already holds the whole gradient of g's "
            "(replicated) output; summing it counts it once per rank"
            if torch.equal(g_res["grad"], total_up)
            else "g's backward returns the gradient unchanged: (grad, None)"
        )
        _fail(f"rank {rank}, g backward: {g_res['grad'].tolist()}, expected {ups[rank].tolist()}", hint)


def _check_conj_mlp(results):
    state, x = results[0][1], results[0][2]
    full = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 6, bias=False))
    full.load_state_dict(state)
    xr = x.clone().requires_grad_()
    out = full(xr)
    out.square().sum().backward()
    for rank, (res, _, _) in enumerate(results):
        mlp = res["mlp"]
        if isinstance(mlp, str):
            _fail(f"rank {rank}, the MLP with your f and g: {mlp}", "see the error above")
        want = {
            "0.weight": torch.chunk(full[0].weight.grad, 2, 0)[rank],
            "0.bias": torch.chunk(full[0].bias.grad, 2)[rank],
            "2.weight": torch.chunk(full[2].weight.grad, 2, 1)[rank],
        }
        for ref_name, ref in (
            ("one process", {"out": out, "x_grad": xr.grad, "grads": want}),
            ("torch", mlp["torch"]),
        ):
            for key in ("out", "x_grad"):
                if not _close(ref[key].detach(), mlp[key]):
                    _fail(
                        f"rank {rank}, the MLP with your f and g: {key} differs from {ref_name}'s ({_diff(ref[key], mlp[key])})",
                        "f in front of the column-parallel layer, g after the row-parallel one",
                    )
            for n, g in ref["grads"].items():
                if not _close(g, mlp["grads"][n]):
                    _fail(
                        f"rank {rank}, the MLP: {n}'s gradient differs from {ref_name}'s ({_diff(g, mlp['grads'][n])})",
                        "see f's and g's backward",
                    )


# ---------------------------------------------------------------- 2. the parallel linears
def _linear_rank(col, row):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh()
    group = mesh.get_group()
    torch.manual_seed(5)
    full = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 6))
    uneven = nn.Linear(7, 9)
    gen = torch.Generator().manual_seed(6)
    x, xu, up = (
        torch.randn(3, 8, generator=gen),
        torch.randn(3, 7, generator=gen),
        torch.randn(3, 6, generator=gen),
    )
    res = {"state": full.state_dict(), "uneven_state": uneven.state_dict(), "x": x, "xu": xu, "up": up}

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

    model = _attempt(build)
    if isinstance(model, str):
        res["mine"] = model
    else:
        res["split"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        res["mine"] = _attempt(run, model, x, up)
    res["torch"] = run(
        parallelize_module(copy.deepcopy(full), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}), x, up
    )
    res["uneven"] = _attempt(lambda: run(col(uneven, group), xu, None))
    res["uneven_torch"] = run(parallelize_module(copy.deepcopy(uneven), mesh, ColwiseParallel()), xu, None)
    res["no_copy"] = _attempt(lambda: run(col(full[0], group, copy_input=False), x, None))
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


def _check_split(rank, full, split):
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
                f"rank {rank}: no parameter {name!r} (yours: {sorted(split)})",
                "self.weight and self.bias, nn.Parameter (bias None when the layer has none)",
            )
        if torch.equal(got, want.detach()):
            continue
        if name == "0.weight" and got.shape == torch.chunk(full[0].weight, 2, 1)[rank].shape:
            hint = "column-parallel splits the OUTPUT features: the weight's rows, torch.chunk(w, tp, dim=0)"
        elif name == "2.weight" and got.shape == torch.chunk(full[2].weight, 2, 0)[rank].shape:
            hint = "row-parallel splits the INPUT features: the weight's columns, torch.chunk(w, tp, dim=1)"
        elif name == "2.bias":
            hint = "the row-parallel bias stays whole: it is added once, to the summed output"
        elif got.shape == want.shape:
            hint = "rank r keeps piece r of torch.chunk: r = dist.get_rank(group)"
        else:
            hint = "torch.chunk(weight, tp, dim)[rank] (and the bias's matching piece)"
        _fail(f"rank {rank}, {name}: {_diff(want.detach(), got)} from torch.chunk's piece", hint)


def check_linears(col: type, row: type) -> None:
    results = _run(_linear_rank, col, row)
    _not_implemented([r[k] for r in results for k in ("mine", "uneven", "no_copy")])
    full, out, x_grad, uneven, out_u, xu_grad = _one_process_linears(results[0])
    for rank, res in enumerate(results):
        if isinstance(res["mine"], str) and "split" not in res:
            hint = (
                "keep this rank's pieces as nn.Parameter attributes self.weight and self.bias"
                if "nn.Parameter" in res["mine"]
                else "see the error above"
            )
            _fail(f"rank {rank}, building the layers: {res['mine']}", hint)
        _check_split(rank, full, res["split"])
        for case in ("mine", "uneven", "no_copy"):
            if isinstance(res[case], str):
                hint = (
                    "keep this rank's pieces as nn.Parameter attributes self.weight and self.bias"
                    if "nn.Parameter" in res[case]
                    else "see the error above"
                )
                _fail(f"rank {rank}, {case}: {res[case]}", hint)
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
                    f"rank {rank}, column -> GELU -> row: output differs from {ref_name}'s ({_diff(ref['out'], mine['out'])})",
                    hint,
                )
            if not _close(ref["x_grad"], mine["x_grad"]):
                _fail(
                    f"rank {rank}, column -> GELU -> row: the input's gradient differs from {ref_name}'s ({_diff(ref['x_grad'], mine['x_grad'])})",
                    "the column-parallel layer applies f to its input (copy_input=True): the input's gradient is the sum of every rank's part",
                )
        grads = {
            "0.weight": torch.chunk(full[0].weight.grad, 2, 0)[rank],
            "0.bias": torch.chunk(full[0].bias.grad, 2)[rank],
            "2.weight": torch.chunk(full[2].weight.grad, 2, 1)[rank],
            "2.bias": full[2].bias.grad,
        }
        for name, want in grads.items():
            got = mine["params"][name][1]
            for ref_name, ref in (("one process", want), ("torch", theirs["params"][name][1])):
                if not _close(ref, got):
                    _fail(
                        f"rank {rank}: {name}'s gradient differs from {ref_name}'s ({'none' if got is None else _diff(ref, got)})",
                        "see the forward above",
                    )
        # uneven: Linear(7, 9) colwise gives 5 and 4 output features
        mine_u, theirs_u = res["uneven"], res["uneven_torch"]
        want = torch.chunk(out_u, 2, -1)[rank]
        for ref_name, ref in (("one process", want), ("torch", theirs_u["out"])):
            if not _close(ref, mine_u["out"]):
                _fail(
                    f"rank {rank}, Linear(7, 9) column-parallel: output {_diff(ref, mine_u['out'])} from {ref_name}'s",
                    "torch.chunk: 9 rows over 2 ranks are ceil(9/2) = 5, then 4 (not 9 // 2 = 4 each)",
                )
        for ref_name, ref in (("one process", xu_grad), ("torch", theirs_u["x_grad"])):
            if not _close(ref, mine_u["x_grad"]):
                _fail(
                    f"rank {rank}, Linear(7, 9): the input's gradient differs from {ref_name}'s",
                    "f in front: the gradient summed over the ranks",
                )
        # copy_input=False: no f (the caller applied it); the input's gradient stays this rank's part
        w = torch.chunk(full[0].weight.detach(), 2, 0)[rank]
        part = torch.ones(3, w.shape[0]) @ w
        if not _close(part, res["no_copy"]["x_grad"]):
            _fail(
                f"rank {rank}, copy_input=False: the input's gradient is not this rank's own part",
                "with copy_input=False the layer applies no f: the caller (exercise 3's attention) applies it once",
            )
    print(
        "column- and row-parallel Linear: torch.chunk's pieces, outputs and gradients equal to one process "
        f"and to torch's ColwiseParallel / RowwiseParallel (atol {ATOL:g}), also Linear(7, 9) split 5 + 4"
    )


# ---------------------------------------------------------------- 3. the TP blocks
def _block_rank(mlp_cls, attn_cls):
    from labkit.comm import collectives
    from labkit.observe import tracing

    collectives.DIRECT_MAX_BYTES = 0
    mesh = _mesh()
    group = mesh.get_group()
    x = tp_lab.batch(0, rows=2)[0]

    def run(block, windows=None):
        xin = x.clone().requires_grad_()

        def timed(name, fn, *args):
            start = tracing.clock()
            value = fn(*args)
            if windows is not None:
                windows[name] = (start, tracing.clock())
            return value

        h = xin + timed("attention forward", block.attn, block.ln1(xin))
        out = h + timed("MLP forward", block.mlp, block.ln2(h))
        timed("backward", out.square().mean().backward)
        params = {
            n: (_local(p).detach().clone(), None if p.grad is None else _local(p.grad).clone())
            for n, p in block.named_parameters()
        }
        return {"out": out.detach().clone(), "x_grad": xin.grad.clone(), "params": params}

    windows = {}
    mine = _attempt(lambda: run(tp_lab.tp_block(tp_lab.make_block(0), group, mlp_cls, attn_cls), windows))
    theirs = run(tp_lab.torch_tp_block(tp_lab.make_block(0), mesh))
    return {"mine": mine, "torch": theirs, "windows": windows, "x": x}


def check_blocks(mlp_cls: type, attn_cls: type) -> None:
    results = _run(_block_rank, mlp_cls, attn_cls)
    _not_implemented([r["mine"] for r in results])
    full = tp_lab.make_block(0)
    x = results[0]["x"].clone().requires_grad_()
    out = full(x)
    out.square().mean().backward()
    want_params = dict(full.named_parameters())
    for rank, res in enumerate(results):
        mine, theirs = res["mine"], res["torch"]
        if isinstance(mine, str):
            hint = (
                "this rank holds n_heads / tp heads: view(B, T, n_heads // tp, head_dim)"
                if "view" in mine or "shape" in mine
                else "see the error above"
            )
            _fail(f"rank {rank}: {mine}", hint)
        missing = sorted(set(want_params) - set(mine["params"]))
        if missing:
            _fail(
                f"rank {rank}: the TP block has no {missing} (it has {sorted(mine['params'])})",
                "name the layers as the original's: attention q, k, v, o; MLP fc1, fc2",
            )
        for ref_name, ref in (("one process", {"out": out.detach(), "x_grad": x.grad}), ("torch", theirs)):
            for key in ("out", "x_grad"):
                if not _close(ref[key], mine[key]):
                    _fail(
                        f"rank {rank}, the block: {key} differs from {ref_name}'s ({_diff(ref[key], mine[key])})",
                        "attention: f once on x, q / k / v column-parallel (this rank's heads), "
                        "attention on the local heads, o row-parallel; MLP: fc1 column, GELU, fc2 row",
                    )
        for name, p in want_params.items():
            got_value, got_grad = mine["params"][name]
            for ref_name, value, grad in (
                (
                    "one process",
                    tp_lab.tp_piece(p.detach(), name, rank, 2),
                    tp_lab.tp_piece(p.grad, name, rank, 2),
                ),
                ("torch", *theirs["params"][name]),
            ):
                if not _close(value, got_value) or not _close(grad, got_grad):
                    _fail(
                        f"rank {rank}: {name} (value or gradient) differs from {ref_name}'s",
                        "see exercise 2's split",
                    )
    # the communication: one all-reduce per sub-block forward, one each in backward
    S = results[0]["x"].numel() * 4
    for rank, (trace, res) in enumerate(zip(results.traces, results)):
        counts = {k: tp_lab.all_reduces(trace, w) for k, w in res["windows"].items()}
        for name, want in (("attention forward", 1), ("MLP forward", 1), ("backward", 2)):
            events = counts[name]
            if len(events) != want:
                hint = (
                    "f once per block: a column layer with its own f all-reduces dL/dx once per q, k, v; "
                    "apply f to x once and build q, k, v with copy_input=False"
                    if name == "backward" and len(events) > want
                    else "one g per block in forward (after the row-parallel layer), one f in backward"
                )
                _fail(f"rank {rank}, {name}: {len(events)} all-reduces, expected {want}", hint)
            for e in events:
                if e["nbytes"] != S:
                    _fail(
                        f"rank {rank}, {name}: an all-reduce of {e['nbytes']} bytes, expected {S} (the activations)",
                        "all-reduce the (B, T, d) activations, nothing else",
                    )
    print(
        f"TP MLP and attention: output, input and parameter gradients equal to one process and to "
        f"torch's parallelize_module (atol {ATOL:g}); one all-reduce of {S} B per block in forward, one in backward"
    )


# ---------------------------------------------------------------- 4. FSDP x TP
SHARD_CASES = ((7, 3), (5,))


def _fsdp_tp_rank(shard, gather, reduce_grad):
    from torch.distributed.device_mesh import init_device_mesh

    _quiet_torch()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    cases = []
    for shape in SHARD_CASES:
        # a TP-local tensor: the same on both dp replicas, different on the tp peers
        local = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(
            shape
        ) + 100 * mesh.get_local_rank("tp")
        grad = torch.randint(-9, 9, shape, generator=torch.Generator().manual_seed(rank)).float()
        right = tp_lab.shard_over_dp(local, mesh)
        cases.append(
            {
                "local": local,
                "grad": grad,
                "shard": _attempt(shard, local.clone(), mesh),
                "gathered": _attempt(gather, right.clone(), shape[0], mesh),
                "reduced": _attempt(reduce_grad, grad.clone(), mesh),
            }
        )
    out = {"cases": cases, "dp": mesh.get_local_rank("dp"), "tp": mesh.get_local_rank("tp")}
    if any(isinstance(c[k], str) for c in cases for k in ("shard", "gathered", "reduced")):
        return out
    out["mine"] = _attempt(tp_lab.train_fsdp_tp, dp_fns=(shard, gather, reduce_grad))
    out["torch"] = tp_lab.train_torch_fsdp_tp()
    return out


def check_fsdp_tp(shard: Callable, gather: Callable, reduce_grad: Callable) -> None:
    results = _run(_fsdp_tp_rank, shard, gather, reduce_grad, world_size=4)
    _not_implemented([c[k] for r in results for c in r["cases"] for k in ("shard", "gathered", "reduced")])
    for c_i, shape in enumerate(SHARD_CASES):
        for rank, res in enumerate(results):
            c = res["cases"][c_i]
            dp, tp = res["dp"], res["tp"]
            where = f"rank {rank} (dp {dp}, tp {tp}), a {shape} TP-local tensor"
            for k in ("shard", "gathered", "reduced"):
                if isinstance(c[k], str):
                    _fail(f"{where}, {k}: {c[k]}", "see the error above")
            want = _rows(c["local"], dp, 2)
            if not torch.equal(c["shard"], want):
                if torch.equal(c["shard"], _rows(c["local"], tp, 2)) and dp != tp:
                    hint = "the tp rank as the shard's index: the replicas sharing it are the dp group, mesh.get_local_rank('dp')"
                elif c["shard"].shape == _rows(c["local"], 0, 4).shape:
                    hint = "sharded over all 4 ranks: FSDP x TP shards each TP-local tensor over the 'dp' dimension only (2 ranks)"
                elif c["shard"].shape != want.shape:
                    hint = f"ceil(rows / dp) = {want.shape[0]} rows per shard, padded with zeros"
                else:
                    hint = "dp rank r keeps rows [r*R, (r+1)*R) of the zero-padded TP-local tensor"
                _fail(f"{where}: shard {c['shard'].tolist()}, expected {want.tolist()}", hint)
            if not torch.equal(c["gathered"], c["local"]):
                if c["gathered"].shape[0] > c["local"].shape[0]:
                    hint = "drop the padding rows: [:dim0]"
                else:
                    hint = "all-gather over the 'dp' group (mesh.get_group('dp')): the tp peers hold other pieces of the layer"
                _fail(f"{where}: gathered {c['gathered'].tolist()}, expected {c['local'].tolist()}", hint)
            peers = [r for r in results if r["tp"] == tp]
            avg = sum(r["cases"][c_i]["grad"] for r in peers) / 2
            want = _rows(avg, dp, 2)
            got = c["reduced"]
            if not _close(want, got):
                if _close(want * 2, got):
                    hint = "a SUM: average over dp (op='avg'), each replica's loss is the mean over its own rows, as under fully_shard"
                elif got.shape == want.shape and _close(
                    _rows(sum(r["cases"][c_i]["grad"] for r in results if r["dp"] == dp) / 2, dp, 2), got
                ):
                    hint = "reduced over the tp group: the replicas of the same TP-local gradient are the 'dp' group"
                else:
                    hint = "reduce-scatter (avg) the zero-padded gradient over mesh.get_group('dp'); return this rank's rows"
                _fail(f"{where}: reduced gradient {got.tolist()}, expected {want.tolist()}", hint)
    _check_training(results)


def _rows(t, r, n):
    rows = -(-t.shape[0] // n)
    padded = t.new_zeros((rows * n, *t.shape[1:]))
    padded[: t.shape[0]] = t
    return padded[r * rows : (r + 1) * rows]


def _check_training(results):
    one = tp_lab.train_one_process()
    for rank, res in enumerate(results):
        mine = res["mine"]
        if isinstance(mine, str):
            _fail(f"rank {rank}, training FSDP x TP with your functions: {mine}", "see the error above")
        for ref_name, ref in (
            ("one process", one["state"]),
            ("torch's parallelize_module + fully_shard(mesh['dp'])", res["torch"]["state"]),
        ):
            for name, want in ref.items():
                if not _close(want, mine["state"][name]):
                    _fail(
                        f"rank {rank}: after 3 SGD steps {name} differs from {ref_name}'s ({_diff(want, mine['state'][name])})",
                        "see the unit checks above",
                    )
    for step in range(len(one["loss"])):
        mean = sum(r["mine"]["loss"][step] for r in results) / 4
        if abs(mean - one["loss"][step]) > 1e-5:
            _fail(
                f"step {step}: the replicas' mean loss {mean:.6g}, one process {one['loss'][step]:.6g}",
                "each dp replica trains on its own rows",
            )
    print(
        "FSDP x TP on 2 x 2: shard, gather and the gradient's reduce-scatter right on every rank; 3 SGD "
        f"steps of the block equal to one process and to torch's parallelize_module + fully_shard (atol {ATOL:g})"
    )
