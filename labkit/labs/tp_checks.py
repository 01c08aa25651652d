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

from labkit.checks import NOT_IMPLEMENTED
from labkit.checks import attempt as _attempt
from labkit.checks import fail as _fail
from labkit.labs import tp_lab

ATOL = 1e-6


def _run(fn, *args, world_size=2):
    import labkit

    # gloo even on a GPU machine: the lab's meshes and tensors are CPU ones
    return labkit.run(fn, *args, world_size=world_size, backend="gloo", timeout=180)


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


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


TP = 2  # the tp group's size in exercises 1-3


def _mesh():
    """4 ranks as a ("tp", "dp") mesh: the tp groups are {0, 2} and {1, 3}, so a tp group is NOT
    the world and a rank's index in it is not its global rank (rank 1 is 0 of {1, 3}, rank 2 is
    1 of {0, 2}): f / g over the default group, or a piece picked by dist.get_rank(), show here."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (TP, 2), mesh_dim_names=("tp", "dp"))["tp"]


def _where(res):
    """'rank R (R' of tp group [a, b])': the global rank and its place in its tp group."""
    return f"rank {res['rank']} ({res['tp_rank']} of tp group {res['peers']})"


ANOTHER = "another rank"


def _agree(*values) -> bool:
    """True on every rank when no rank's value is an error string: a mistake that raises on some
    ranks only (a piece picked by the world rank) must not leave the others waiting in a collective
    for it. torch's all-reduce over the world, outside the windows the checks read."""
    ok = torch.tensor([0 if any(isinstance(v, str) for v in values) else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _build_then_run(build, run):
    """run(build()), every rank agreeing after each half: a build that raises on some ranks never
    leaves the others in a collective."""
    built = _attempt(build)
    if not _agree(built):
        return built if isinstance(built, str) else f"{ANOTHER} raised, building it"
    out = _attempt(run, built)
    _agree(out)
    return out


def _group_info(mesh):
    group = mesh.get_group()
    return {
        "rank": dist.get_rank(),
        "tp_rank": dist.get_rank(group),
        "peers": dist.get_process_group_ranks(group),
    }


def _torch_collectives(trace, window):
    """torch.distributed's own collectives (not labkit's traced ring) the recording saw in window."""
    return [
        e["op"]
        for e in trace["events"]
        if not e["op"].startswith("ring_")
        and window[0] <= e["start"] < window[1]
        and e["op"] not in ("send", "recv", "isend", "irecv", "barrier")
    ]


TORCH_COLLECTIVES = (
    "torch.distributed's own collectives ({ops}) bypass the course's traced ring and its simulated "
    "link: the values can be right, but sections 5 and 7 count and price labkit's ring_all_reduce "
    "only. Write it with ring_all_reduce(t, op='sum', group=group)"
)
WORLD_GROUP = (
    "all-reduced over the default group (every rank: {n} here), not over `group` (the tp group, "
    "{t} of them): pass group=group to ring_all_reduce"
)
WORLD_RANK = (
    "dist.get_rank() is the rank in the WORLD ({rank} here); the piece is picked by the rank in "
    "the tp group ({tp_rank} here): dist.get_rank(group)"
)
MESH_AS_GROUP = (
    "group= takes a ProcessGroup, not a DeviceMesh: the group argument the check passes you is "
    "already the tp group (use it as it is)"
)


def _error_hint(res, msg, default="see the error above"):
    """The hint for an error a rank raised: a world rank used as an index, a DeviceMesh as a group."""
    if "DeviceMesh" in msg:
        return MESH_AS_GROUP
    if ("index" in msg and "out of range" in msg) and res["rank"] != res["tp_rank"]:
        return WORLD_RANK.format(**res)
    return default


# ---------------------------------------------------------------- 1. f and g
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
    res["windows"] = {}
    for name, fn in (("f", f), ("g", g)):
        x = _data(rank).requires_grad_()
        up = _up(rank)  # each its own: an in-place backward shows on this tensor, not on g's
        before = x.detach().clone()
        start = tracing.clock()
        y = _attempt(fn, x, group)
        res["windows"][f"{name} forward"] = (start, tracing.clock())
        if not _agree(y):
            res[name] = y if isinstance(y, str) else "another rank raised"
            continue
        after = x.detach().clone()
        start = tracing.clock()
        grad = _attempt(lambda: torch.autograd.grad(y, x, up)[0])
        res["windows"][f"{name} backward"] = (start, tracing.clock())
        _agree(grad)
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
    res["state"], res["x"] = full.state_dict(), x
    return res


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
                hint = (
                    "backward returns one gradient per input of forward: (grad, None), None for the group"
                    if "incorrect number of gradients" in got["grad"]
                    else _error_hint(res, got["grad"])
                )
                _fail(f"{where}, {name}, backward: {got['grad']}", hint)
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


# ---------------------------------------------------------------- 2. the parallel linears
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

    model = _attempt(build)
    if not _agree(model):
        res["mine"] = model if isinstance(model, str) else f"{ANOTHER} raised, building the layers"
        if not isinstance(model, str):
            res["split"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        res["split"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        res["mine"] = _attempt(run, model, x, up)
        _agree(res["mine"])
    res["torch"] = run(
        parallelize_module(copy.deepcopy(full), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}), x, up
    )
    res["uneven"] = _build_then_run(lambda: col(uneven, group), lambda m: run(m, xu, None))
    res["uneven_torch"] = run(parallelize_module(copy.deepcopy(uneven), mesh, ColwiseParallel()), xu, None)
    res["no_copy"] = _build_then_run(lambda: col(full[0], group, copy_input=False), lambda m: run(m, x, None))
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
            hint = (
                "keep this rank's pieces as nn.Parameter attributes self.weight and self.bias"
                if "nn.Parameter" in res["mine"]
                else _error_hint(res, res["mine"])
            )
            _fail(f"{_where(res)}, building the layers: {res['mine']}", hint)
        _check_split(res, full, res["split"])
    for res in results:
        rank, where = res["tp_rank"], _where(res)
        if isinstance(res["mine"], str) and "split" not in res:
            hint = (
                "keep this rank's pieces as nn.Parameter attributes self.weight and self.bias"
                if "nn.Parameter" in res["mine"]
                else _error_hint(res, res["mine"])
            )
            _fail(f"{where}, building the layers: {res['mine']}", hint)
        _check_split(res, full, res["split"])
        for case in ("mine", "uneven", "no_copy"):
            if isinstance(res[case], str):
                hint = (
                    "keep this rank's pieces as nn.Parameter attributes self.weight and self.bias"
                    if "nn.Parameter" in res[case]
                    else _error_hint(res, res[case])
                )
                _fail(f"{where}, {case}: {res[case]}", hint)
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


# ---------------------------------------------------------------- 3. the TP blocks
SUBS = {"attention": ("attn", ("q", "k", "v", "o")), "MLP": ("mlp", ("fc1", "fc2"))}


def _sub_rank(cls, module, group, x, up):
    """Build cls(module, group), record its pieces, run forward and backward (windows on the trace
    clock) on x with upstream gradient up."""
    from labkit.observe import tracing

    out = {}
    built = _attempt(cls, module, group)
    if not isinstance(built, str):
        out["pieces"] = {n: _local(p).detach().clone() for n, p in built.named_parameters()}
    if not _agree(built):
        return {
            **out,
            "error": built if isinstance(built, str) else f"{ANOTHER} raised",
            "when": "building it",
        }
    xin = x.clone().requires_grad_()
    start = tracing.clock()
    y = _attempt(built, xin)
    out["windows"] = {"forward": (start, tracing.clock())}
    if not _agree(y):
        y = y if isinstance(y, str) else "another rank's forward raised"
        return {**out, "error": y, "when": "its forward"}
    start = tracing.clock()
    done = _attempt(lambda: y.backward(up))
    out["windows"]["backward"] = (start, tracing.clock())
    if not _agree(done):
        done = done if isinstance(done, str) else "another rank's backward raised"
        return {**out, "error": done, "when": "its backward"}
    out["out"], out["x_grad"] = y.detach().clone(), xin.grad.clone()
    out["grads"] = {
        n: None if p.grad is None else _local(p.grad).clone() for n, p in built.named_parameters()
    }
    return out


def _block_rank(mlp_cls, attn_cls):
    from labkit.comm import collectives

    collectives.DIRECT_MAX_BYTES = 0
    mesh = _mesh()
    group = mesh.get_group()
    res = _group_info(mesh)
    x = tp_lab.batch(0, rows=2)[0]
    up = tp_lab.batch(1, rows=2)[0]
    # each sub-block alone first (a mistake is named where it is), then the whole block
    for sub, cls in (("attention", attn_cls), ("MLP", mlp_cls)):
        module = getattr(tp_lab.make_block(0), SUBS[sub][0])
        res[sub] = _sub_rank(cls, module, group, x, up)

    def run(block):
        xin = x.clone().requires_grad_()
        h = xin + block.attn(block.ln1(xin))
        out = h + block.mlp(block.ln2(h))
        out.square().mean().backward()
        params = {
            n: (_local(p).detach().clone(), None if p.grad is None else _local(p.grad).clone())
            for n, p in block.named_parameters()
        }
        return {"out": out.detach().clone(), "x_grad": xin.grad.clone(), "params": params}

    res["mine"] = (
        _attempt(lambda: run(tp_lab.tp_block(tp_lab.make_block(0), group, mlp_cls, attn_cls)))
        if all("error" not in res[sub] for sub in SUBS)
        else "a sub-block failed"
    )
    _agree(res["mine"])
    res["torch"] = run(tp_lab.torch_tp_block(tp_lab.make_block(0), mesh))
    res["x"], res["up"] = x, up
    return res


def _attention_sim(attn, x, causal=True, split="view", merge="transpose"):
    """What TP attention on TP ranks computes (full weights, cut per rank), with a head layout
    (split: how q / k / v become (B, heads, T, head_dim); merge: how the heads go back to
    (B, T, d)) and the causal mask as given: the correct one, or a mistake's."""
    B, T, _ = x.shape
    hd, total = attn.head_dim, 0
    for r in range(TP):
        proj = [
            F.linear(
                x,
                *(
                    tp_lab.tp_piece(getattr(attn, n).get_parameter(a).detach(), f"attn.{n}.{a}", r, TP)
                    for a in ("weight", "bias")
                ),
            )
            for n in ("q", "k", "v")
        ]
        heads = proj[0].shape[-1] // hd
        if split == "view":
            qkv = [p.view(B, T, heads, hd).transpose(1, 2) for p in proj]
        elif split == "no transpose":
            qkv = [p.view(B, heads, T, hd) for p in proj]
        else:  # "head_dim first"
            qkv = [p.view(B, T, hd, heads).permute(0, 3, 1, 2) for p in proj]
        y = F.scaled_dot_product_attention(*qkv, is_causal=causal)
        y = y.transpose(1, 2).reshape(B, T, -1) if merge == "transpose" else y.reshape(B, T, -1)
        w = tp_lab.tp_piece(attn.o.weight.detach(), "attn.o.weight", r, TP)
        total = total + F.linear(y, w)
    return total + attn.o.bias.detach()


ATTENTION_MISTAKES = (
    (
        dict(causal=False),
        "attention: the causal mask is missing: F.scaled_dot_product_attention(q, k, v, is_causal=True), as the original",
    ),
    (
        dict(split="no transpose"),
        "attention: the heads are grouped wrong: q(x) is (B, T, heads x head_dim), each token's row "
        "holding its heads side by side; view(B, T, heads, head_dim).transpose(1, 2), not view(B, heads, T, head_dim)",
    ),
    (
        dict(split="head_dim first"),
        "attention: the heads are grouped wrong: the original's layout is head-major, "
        "view(B, T, heads, head_dim) (head h is columns [h*head_dim, (h+1)*head_dim)), not (B, T, head_dim, heads)",
    ),
    (
        dict(merge="reshape"),
        "attention: the heads are merged back wrong: y is (B, heads, T, head_dim); "
        "y.transpose(1, 2).reshape(B, T, heads * head_dim) before o, not y.reshape(B, T, -1)",
    ),
)


def _mlp_sim(mlp, x, act=F.gelu, after=False):
    h = act(F.linear(x, mlp.fc1.weight.detach(), mlp.fc1.bias.detach()))
    if after:
        return act(
            F.linear(
                F.linear(x, mlp.fc1.weight.detach(), mlp.fc1.bias.detach()),
                mlp.fc2.weight.detach(),
                mlp.fc2.bias.detach(),
            )
        )
    return F.linear(h, mlp.fc2.weight.detach(), mlp.fc2.bias.detach())


MLP_MISTAKES = (
    (
        dict(act=lambda t: F.gelu(t, approximate="tanh")),
        "MLP: the tanh approximation of GELU: the original's is the exact one, F.gelu(h) (nn.GELU()'s default)",
    ),
    (dict(act=F.relu), "MLP: ReLU: the original's activation is the exact GELU, F.gelu(h)"),
    (dict(act=lambda t: t), "MLP: the GELU is missing between fc1 and fc2"),
    (
        dict(after=True),
        "MLP: the GELU after fc2's all-reduce: fc1 column, GELU on this rank's hidden columns, fc2 row "
        "(the GELU is elementwise, so it runs before the sum)",
    ),
)

STYLES = {"column": 0, "row": 1}


def _piece_hint(sub, layer, got, full, tp_rank, res):
    """Why layer's piece is not tp_piece's: the other split (column for row or back), the world
    rank's piece, the whole weight."""
    want_style = "column" if tp_lab.PLAN[f"{SUBS[sub][0]}.{layer}"] == "colwise" else "row"
    other = "row" if want_style == "column" else "column"
    if got.shape == full.shape:
        return f"{sub}: {layer} holds the whole weight: it is {want_style}-parallel, this rank keeps its torch.chunk piece"
    if got.dim() == 2 and torch.equal(got, torch.chunk(full, TP, STYLES[other])[tp_rank]):
        swapped = {"fc1": "fc2", "fc2": "fc1"}.get(layer)
        return (
            f"{sub}: {layer} is {want_style}-parallel, yours is {other}-parallel"
            + (" (fc1 and fc2 swapped? fc1 column-parallel, GELU, fc2 row-parallel)" if swapped else "")
            + (
                ": o takes this rank's heads (its d/t input features) and its g sums the partial outputs"
                if layer == "o"
                else ""
            )
        )
    if res["rank"] != tp_rank and res["rank"] < TP:
        dim = STYLES[want_style] if got.dim() == 2 else 0
        if torch.equal(got, torch.chunk(full, TP, dim)[res["rank"]]):
            return WORLD_RANK.format(**res)
    return f"{sub}: {layer} as exercise 2 splits it: ColumnLinear / RowLinear (yours, or labkit's)"


def _check_pieces(sub, res, full):
    """One sub-block of one rank, as built: its error (one of its own), its layers' pieces."""
    mine, where = res[sub], f"{_where(res)}, {sub}"
    prefix, layers = SUBS[sub]
    module = getattr(full, prefix)
    if mine.get("when") == "building it" and not mine["error"].startswith(ANOTHER):
        _fail(f"{where}: building it raised {mine['error']}", _error_hint(res, mine["error"]))
    if "pieces" not in mine:
        return
    pieces = mine["pieces"]
    want_names = {f"{n}.{a}" for n in layers for a in ("weight", "bias")}
    if want_names - set(pieces):
        _fail(
            f"{where}: no {sorted(want_names - set(pieces))} (it has {sorted(pieces)})",
            "name the layers as the original's: attention q, k, v, o; MLP fc1, fc2",
        )
    for layer in layers:
        w = getattr(module, layer).weight.detach()
        want = tp_lab.tp_piece(w, f"{prefix}.{layer}.weight", res["tp_rank"], TP)
        if not torch.equal(pieces[f"{layer}.weight"], want):
            _fail(
                f"{where}: {layer}.weight {_diff(want, pieces[f'{layer}.weight'])} from its TP piece",
                _piece_hint(sub, layer, pieces[f"{layer}.weight"], w, res["tp_rank"], res),
            )


def _check_sub(sub, res, results, trace, full, x, up, S):
    """One sub-block of one rank, after every rank's pieces: forward, backward, values, all-reduces."""
    mine, where = res[sub], f"{_where(res)}, {sub}"
    prefix, layers = SUBS[sub]
    module = getattr(full, prefix)
    if "error" in mine:
        msg = mine["error"]
        hint = _error_hint(res, msg, "")
        if not hint and sub == "attention" and ("view" in msg or "shape" in msg):
            hint = (
                "attention: this rank holds n_heads / tp heads: view(B, T, n_heads // tp, head_dim), "
                "tp = dist.get_world_size(group) (the tp group's size, not the world's)"
            )
        _fail(f"{where}: {mine['when']} raised {msg}", hint or "see the error above")
    xr = x.clone().requires_grad_()
    out = module(xr)
    out.backward(up)
    if not _close(out.detach(), mine["out"]):
        hint = None
        if _close(2 * out.detach(), mine["out"]):
            hint = (
                f"{sub}: the output is summed twice (an extra g): the row-parallel "
                f"{layers[-1]} already all-reduces its partial output once"
            )
        mistakes = (
            [(_attention_sim(module, x, **kw), h) for kw, h in ATTENTION_MISTAKES]
            if sub == "attention"
            else [(_mlp_sim(module, x, **kw), h) for kw, h in MLP_MISTAKES]
        )
        hint = hint or next((h for v, h in mistakes if _close(v, mine["out"], 1e-5)), None)
        _fail(
            f"{where}: the output differs from one process's ({_diff(out.detach(), mine['out'])})",
            hint
            or (
                "attention: f once on x, q / k / v column-parallel (this rank's heads, "
                "view(B, T, heads, head_dim).transpose(1, 2)), causal attention, o row-parallel"
                if sub == "attention"
                else "MLP: fc1 column-parallel, exact GELU, fc2 row-parallel"
            ),
        )
    if not _close(xr.grad, mine["x_grad"]):
        peers = [r[sub] for r in results if r["peers"] == res["peers"]]
        parts = sum(p["x_grad"] for p in peers)
        if _close(xr.grad, parts):
            hint = f"{sub}: f is missing: each rank's x_grad is only its part of dL/dx; apply f to the " + (
                "input once (x = f(x, group)) before q, k, v"
                if sub == "attention"
                else "input (fc1 with copy_input=True)"
            )
        elif _close(xr.grad * TP, mine["x_grad"]):
            hint = f"{sub}: dL/dx summed twice: f applied twice (f on x, and q / k / v with copy_input=True?)"
        else:
            hint = f"{sub}: f once on the input; its backward sums dL/dx over the tp group"
        _fail(
            f"{where}: the input's gradient differs from one process's ({_diff(xr.grad, mine['x_grad'])})",
            hint,
        )
    for layer in layers:
        for attr in ("weight", "bias"):
            name = f"{layer}.{attr}"
            want = tp_lab.tp_piece(
                getattr(module, layer).get_parameter(attr).grad, f"{prefix}.{name}", res["tp_rank"], TP
            )
            if not _close(want, mine["grads"][name]):
                _fail(f"{where}: {name}'s gradient differs from one process's", "see the forward above")
    # the communication: one all-reduce in forward (g), one in backward (f), of the activations
    for phase, window in mine["windows"].items():
        torch_ops = _torch_collectives(trace, window)
        if torch_ops:
            _fail(
                f"{where}, {phase}: torch.distributed's {sorted(set(torch_ops))} called",
                TORCH_COLLECTIVES.format(ops=", ".join(sorted(set(torch_ops)))),
            )
        events = tp_lab.all_reduces(trace, window)
        if len(events) != 1:
            if phase == "backward" and len(events) > 1:
                hint = (
                    "f once per block: a column layer with its own f all-reduces dL/dx once per q, k, v; "
                    "apply f to x once and build q, k, v with copy_input=False"
                    if sub == "attention"
                    else "MLP: one f, in fc1 (fc2 row-parallel takes its input as it is)"
                )
            elif phase == "forward" and len(events) > 1:
                hint = f"{sub}: an extra g in forward: the row-parallel {layers[-1]} already all-reduces once"
            elif phase == "forward":
                hint = f"{sub}: no g in forward: the row-parallel {layers[-1]} all-reduces its partial output"
            else:
                hint = f"{sub}: no f in backward: f on the input all-reduces dL/dx"
            _fail(f"{where}, {phase}: {len(events)} all-reduces, expected 1", hint)
        if events[0]["nbytes"] != S:
            _fail(
                f"{where}, {phase}: an all-reduce of {events[0]['nbytes']} bytes, expected {S} (the activations)",
                "all-reduce the (B, T, d) activations, nothing else",
            )


def check_blocks(mlp_cls: type, attn_cls: type) -> None:
    results = _run(_block_rank, mlp_cls, attn_cls, world_size=4)
    _not_implemented([r[s].get("error") for r in results for s in SUBS] + [r["mine"] for r in results])
    x, up = results[0]["x"], results[0]["up"]
    S = x.numel() * 4
    # the attention first, then the MLP, on every rank: a mistake is named in its sub-block
    for sub in SUBS:
        for res in results:
            _check_pieces(sub, res, tp_lab.make_block(0))
        for res in sorted(results, key=lambda r: ANOTHER in r[sub].get("error", "")):
            _check_sub(sub, res, results, results.traces[res["rank"]], tp_lab.make_block(0), x, up, S)
    full = tp_lab.make_block(0)
    xr = x.clone().requires_grad_()
    out = full(xr)
    out.square().mean().backward()
    want_params = dict(full.named_parameters())
    for res in results:
        mine, theirs, where = res["mine"], res["torch"], _where(res)
        if isinstance(mine, str):
            _fail(f"{where}, the whole block: {mine}", _error_hint(res, mine))
        for ref_name, ref in (("one process", {"out": out.detach(), "x_grad": xr.grad}), ("torch", theirs)):
            for key in ("out", "x_grad"):
                if not _close(ref[key], mine[key]):
                    _fail(
                        f"{where}, the whole block: {key} differs from {ref_name}'s ({_diff(ref[key], mine[key])})",
                        "the sub-blocks pass alone: see how tp_lab.tp_block puts them together",
                    )
        for name, p in want_params.items():
            got_value, got_grad = mine["params"][name]
            for ref_name, value, grad in (
                (
                    "one process",
                    tp_lab.tp_piece(p.detach(), name, res["tp_rank"], TP),
                    tp_lab.tp_piece(p.grad, name, res["tp_rank"], TP),
                ),
                ("torch", *theirs["params"][name]),
            ):
                if not _close(value, got_value) or not _close(grad, got_grad):
                    _fail(
                        f"{where}: {name} (value or gradient) differs from {ref_name}'s",
                        "see exercise 2's split",
                    )
    print(
        "TP attention and MLP on 4 ranks (tp groups {0, 2}, {1, 3}), each alone and in the block: "
        "output, input and parameter gradients equal to one process and (the block) to torch's "
        f"parallelize_module (atol {ATOL:g}); one all-reduce of {S} B per sub-block in forward, one in backward"
    )


# ---------------------------------------------------------------- 4. FSDP x TP
SHARD_CASES = ((7, 3), (5,), (6, 2))  # (6, 2): ceil(6 / 2) = 3 rows, not 6 // 2 + 1 = 4


def _fsdp_tp_rank(shard, gather, reduce_grad):
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.comm import collectives
    from labkit.observe import tracing

    _quiet_torch()
    collectives.DIRECT_MAX_BYTES = 0  # rings: the bytes below are the ring's
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
        case = {"local": local, "grad": grad, "shard": _attempt(shard, local.clone(), mesh), "windows": {}}
        for key, fn, args in (
            ("gathered", gather, (right.clone(), shape[0], mesh)),
            ("reduced", reduce_grad, (grad.clone(), mesh)),
        ):
            start = tracing.clock()
            case[key] = _attempt(fn, *args)
            case["windows"][key] = (start, tracing.clock())
        cases.append(case)
    out = {"cases": cases, "dp": mesh.get_local_rank("dp"), "tp": mesh.get_local_rank("tp")}
    if any(isinstance(c[k], str) for c in cases for k in ("shard", "gathered", "reduced")):
        return out
    out["mine"] = _attempt(tp_lab.train_fsdp_tp, dp_fns=(shard, gather, reduce_grad))
    out["torch"] = tp_lab.train_torch_fsdp_tp()
    return out


def _dp_error_hint(msg):
    if "DeviceMesh" in msg:
        return (
            "group= takes a ProcessGroup, not the DeviceMesh: the dp group is mesh.get_group('dp') "
            "(this rank's index in it: mesh.get_local_rank('dp'))"
        )
    return "see the error above"


def _dp_ops(trace, window):
    return [e for e in trace["events"] if window[0] <= e["start"] < window[1] and e["op"] not in ("barrier",)]


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
                    _fail(f"{where}, {k}: {c[k]}", _dp_error_hint(c[k]))
            want = _rows(c["local"], dp, 2)
            if not torch.equal(c["shard"], want):
                if torch.equal(c["shard"], _rows(c["local"], tp, 2)) and dp != tp:
                    hint = "the tp rank as the shard's index: the replicas sharing it are the dp group, mesh.get_local_rank('dp')"
                elif c["shard"].shape == _rows(c["local"], 0, 4).shape:
                    hint = "sharded over all 4 ranks: FSDP x TP shards each TP-local tensor over the 'dp' dimension only (2 ranks)"
                elif c["shard"].shape[0] == shape[0] // 2 + 1 and shape[0] % 2 == 0:
                    hint = (
                        f"rows // dp + 1 = {shape[0] // 2 + 1} rows per shard: one too many when dp "
                        f"divides the rows; R = ceil(rows / dp) = -(-rows // dp) = {want.shape[0]}"
                    )
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
    # what crossed: the text asks for an all-gather and a reduce-scatter over "dp", labkit's ring
    for c_i, shape in enumerate(SHARD_CASES):
        for rank, (res, trace) in enumerate(zip(results, results.traces)):
            where = f"rank {rank} (dp {res['dp']}, tp {res['tp']}), a {shape} TP-local tensor"
            for key, want_op in (("gathered", "ring_all_gather"), ("reduced", "ring_reduce_scatter")):
                ops = [e["op"] for e in _dp_ops(trace, res["cases"][c_i]["windows"][key])]
                theirs = sorted({o for o in ops if not o.startswith("ring_")})
                if theirs:
                    _fail(f"{where}, {key}: called {theirs}", TORCH_COLLECTIVES.format(ops=", ".join(theirs)))
                if ops != [want_op]:
                    hint = (
                        "an all-reduce, then a slice: every rank receives the whole averaged gradient "
                        "and keeps 1/dp of it. A ring all-reduce sends 2(n-1)/n of the tensor per rank, a "
                        "reduce-scatter (n-1)/n: half the bytes, for the same shard. "
                        "ring_reduce_scatter(out, padded, op='avg', group=mesh.get_group('dp'))"
                        if key == "reduced" and "ring_all_reduce" in ops
                        else f"one {want_op} over mesh.get_group('dp'), nothing else"
                    )
                    _fail(f"{where}, {key}: collectives {ops}, expected ['{want_op}']", hint)
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
