"""Exercise 4's check: the dp sharding of FSDP x TP on a 2 x 2 ("dp", "tp") mesh: shard, gather
and the gradient's reduce-scatter of TP-local tensors (shapes that tell ceil(rows / dp) from
rows // dp + 1) against their definitions, what crossed (one ring_all_gather, one
ring_reduce_scatter over "dp", labkit's traced ring), then 3 SGD steps of the block with the
learner's functions against one process and torch's parallelize_module + fully_shard."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from labkit.labs import tp_lab
from labkit.labs.tp_checks.shared import (
    _fail,
    ATOL,
    TORCH_COLLECTIVES,
    _agree,
    _close,
    _diff,
    _not_implemented,
    _quiet_torch,
    _run,
    _try,
)


SHARD_CASES = ((7, 3), (5,), (6, 2))  # (6, 2): ceil(6 / 2) = 3 rows, not 6 // 2 + 1 = 4


def _fsdp_tp_rank(shard, gather, reduce_grad):
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.comm import collectives
    from labkit.observe import tracing

    _quiet_torch()
    collectives.DIRECT_MAX_BYTES = 0  # rings: the bytes below are the ring's
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank, dp, tp = dist.get_rank(), mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    cases, agreed = [], True
    for shape in SHARD_CASES:
        # a TP-local tensor: the same on both dp replicas, different on the tp peers
        local = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 100 * tp
        grad = torch.randint(-9, 9, shape, generator=torch.Generator().manual_seed(rank)).float()
        right = tp_lab.shard_over_dp(local, mesh)
        where = f"rank {rank} (dp {dp}, tp {tp}), a {shape} TP-local tensor"
        case = {"local": local, "grad": grad, "shard": _try(shard, local.clone(), mesh), "windows": {}}
        agreed &= _agree(case["shard"], where=f"{where}, shard", hint=_dp_error_hint)
        for key, fn, args in (
            ("gathered", gather, (right.clone(), shape[0], mesh)),
            ("reduced", reduce_grad, (grad.clone(), mesh)),
        ):
            start = tracing.clock()
            case[key] = _try(fn, *args)
            case["windows"][key] = (start, tracing.clock())
            agreed &= _agree(case[key], where=f"{where}, {key}", hint=_dp_error_hint)
        cases.append(case)
    out = {"cases": cases, "dp": dp, "tp": tp}
    if not agreed:  # every rank returns here: none waits in the training for one that left
        return out
    out["mine"] = _try(tp_lab.train_fsdp_tp, dp_fns=(shard, gather, reduce_grad))
    _agree(out["mine"], where=f"rank {rank}, training FSDP x TP with your functions", hint=_dp_error_hint)
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
