"""Exercise 3's check: the TP MLP and attention on 4 ranks (tp groups {0, 2} and {1, 3}), each
sub-block alone (its pieces, forward, backward, and one all-reduce of the activations forward and
one backward, counted by the tracer), then the whole block against one process and torch's
parallelize_module. A mistake is named in its sub-block (block_mistakes)."""

from __future__ import annotations

import torch

from labkit.labs import tp_lab
from labkit.labs.tp_checks.block_mistakes import (
    ATTENTION_MISTAKES,
    MLP_MISTAKES,
    SUBS,
    _attention_sim,
    _mlp_sim,
    _piece_hint,
)
from labkit.labs.tp_checks.shared import (
    _fail,
    ANOTHER,
    ATOL,
    TORCH_COLLECTIVES,
    TP,
    _agree,
    _close,
    _diff,
    _error_hint,
    _group_info,
    _local,
    _mesh,
    _not_implemented,
    _run,
    _torch_collectives,
    _try,
    _where,
)


def _sub_error_hint(sub, res, msg):
    """The hint for an error sub's code raised: a world rank, a DeviceMesh, the global head count."""
    hint = _error_hint(res, msg, "")
    if not hint and sub == "attention" and ("view" in msg or "shape" in msg):
        hint = (
            "attention: this rank holds n_heads / tp heads: view(B, T, n_heads // tp, head_dim), "
            "tp = dist.get_world_size(group) (the tp group's size, not the world's)"
        )
    return hint or "see the error above"


def _sub_rank(sub, cls, module, res, x, up):
    """Build cls(module, group), record its pieces, run forward and backward (windows on the trace
    clock) on x with upstream gradient up."""
    from labkit.observe import tracing

    out, where, hint = {}, f"{_where(res)}, {sub}", lambda msg: _sub_error_hint(sub, res, msg)
    built = _try(cls, module, res["group"])
    if not isinstance(built, str):
        out["pieces"] = {n: _local(p).detach().clone() for n, p in built.named_parameters()}
    if not _agree(built, where=f"{where}: building it", hint=hint):
        return {
            **out,
            "error": built if isinstance(built, str) else f"{ANOTHER} raised",
            "when": "building it",
        }
    xin = x.clone().requires_grad_()
    start = tracing.clock()
    y = _try(built, xin)
    out["windows"] = {"forward": (start, tracing.clock())}
    if not _agree(y, where=f"{where}: its forward", hint=hint):
        y = y if isinstance(y, str) else "another rank's forward raised"
        return {**out, "error": y, "when": "its forward"}
    start = tracing.clock()
    done = _try(lambda: y.backward(up))
    out["windows"]["backward"] = (start, tracing.clock())
    if not _agree(done, where=f"{where}: its backward", hint=hint):
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
        res[sub] = _sub_rank(sub, cls, module, {**res, "group": group}, x, up)

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
        _try(lambda: run(tp_lab.tp_block(tp_lab.make_block(0), group, mlp_cls, attn_cls)))
        if all("error" not in res[sub] for sub in SUBS)
        else "a sub-block failed"
    )
    _agree(res["mine"], where=f"{_where(res)}, the whole block", hint=lambda msg: _error_hint(res, msg))
    res["torch"] = run(tp_lab.torch_tp_block(tp_lab.make_block(0), mesh))
    res["x"], res["up"] = x, up
    return res


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
        _fail(f"{where}: {mine['when']} raised {msg}", _sub_error_hint(sub, res, msg))
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
