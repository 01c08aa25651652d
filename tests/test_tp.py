"""Tensor parallelism by hand (labkit.strategies.tp) on 2 gloo ranks, against one process and
against torch's parallelize_module (ColwiseParallel / RowwiseParallel, default layouts) on the
same mesh, on a model the course never built: Linear(7, 10, bias=False) colwise -> ReLU ->
Linear(10, 6) rowwise -> ReLU -> Linear(6, 9) colwise (9 outputs: torch.chunk's 5 + 4), its
sharded output gathered for a cross-entropy loss (ours by gather_from_tp, torch's by
DTensor.full_tensor()), 3 SGD steps. Also: the conjugate operations against a hand computation,
an uneven rowwise layer (which torch's RowwiseParallel refuses), and misuse. Then on 2 x 2
("dp", "tp"), 4 ranks: parallelize_by_hand on mesh["tp"], then fully_shard_by_hand(mesh=mesh["dp"])
(FSDP x TP by hand), against one process on the whole batch and torch's parallelize_module +
fully_shard(mesh=mesh["dp"]): training, the 2-D placements, the full dicts, clip_grad_norm_.
One launch per mesh, module-scoped. (TinyGPT's strategies: tests/test_tp_strategies.py.)

Tolerances (fp32, the runs are seeded, so the numbers are the same every run):
- vs one process atol 1e-6: the rowwise layer sums its 10 input features as two partial sums of 5
  (another summation order); measured <= 6e-8 (outputs), <= 3e-8 (gradients, state).
- vs torch atol 1e-7: torch's RowwiseParallel adds bias / 2 on each rank before the all-reduce,
  ours adds the whole bias after it (parallelize.py); measured <= 6e-8. The colwise layers are
  bit-identical to torch's (the same local F.linear).
- the uneven rowwise model vs one process: atol 1e-6, measured <= 1.2e-7 (outputs near 2).
- 2 x 2: the same bounds; measured <= 6e-8 vs one process and vs torch.
- the conjugate operations: exact (a two-term sum is one rounding either way).
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit

STEPS, LR, ROWS, OUT = 3, 0.1, 5, 9
PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise"}
FP32, VS_TORCH = 1e-6, 1e-7


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(7, 10, bias=False), nn.ReLU(), nn.Linear(10, 6), nn.ReLU(), nn.Linear(6, OUT)
    )


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 7, generator=g), torch.randint(0, OUT, (ROWS,), generator=g)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, gather):
    """{"outs", "grads" (per step), "state"} of 3 SGD steps; gather(local output) -> whole output."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    outs, grads = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        out = gather(model(x))
        F.cross_entropy(out, y).backward()
        outs.append(out.detach().clone())
        grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
    return {
        "outs": outs,
        "grads": grads,
        "state": {k: _full(v).clone() for k, v in model.state_dict().items()},
    }


def _conjugates(rank):
    """The conjugate ops on rank-dependent inputs: {name: tensor} to compare with a hand computation."""
    from labkit.strategies.tp import copy_to_tp, gather_from_tp, reduce_from_tp

    res = {}
    x = torch.arange(6.0).reshape(2, 3).mul(rank + 1).add(0.25).requires_grad_()
    up = torch.linspace(-1, 1, 6).reshape(2, 3).mul(3 * rank + 1)
    y = copy_to_tp(x)
    y.backward(up)
    res["f_out"], res["f_grad"] = y.detach().clone(), x.grad.clone()
    x.grad = None
    y = reduce_from_tp(x)
    y.backward(up)
    res["g_out"], res["g_grad"] = y.detach().clone(), x.grad.clone()
    # gather of 5 columns: rank 0 holds 3, rank 1 holds 2 (torch.chunk)
    xs = torch.arange(12.0).reshape(4, 3)[:, :3] if rank == 0 else -torch.arange(8.0).reshape(4, 2)
    xs.requires_grad_()
    y = gather_from_tp(xs, 5)
    y.backward(torch.arange(20.0).reshape(4, 5))
    res["gather_out"], res["gather_grad"] = y.detach().clone(), xs.grad.clone()
    return res


def _misuse(mesh):
    """{case: the error's type and message} of parallelize_by_hand's refusals."""
    from labkit.strategies.tp import parallelize_by_hand

    cases = {
        "bad style": {"0": "colwise", "2": "diagonal"},
        "missing name": {"0": "colwise", "blocks.7": "rowwise"},
        "not a Linear": {"1": "colwise"},
    }
    res = {}
    for case, plan in cases.items():
        model = _model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            parallelize_by_hand(model, mesh, plan)
            res[case] = None
        except (ValueError, TypeError) as exc:
            untouched = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            res[case] = (type(exc).__name__, str(exc), untouched, type(model[0]) is nn.Linear)
    model = parallelize_by_hand(_model(), mesh, {"0": "colwise"})
    try:
        parallelize_by_hand(model, mesh, {"2": "rowwise", "0": "rowwise"})
        res["twice"] = None
    except ValueError as exc:
        kept = str(model[0].weight.placements) == "(Shard(dim=0),)" and type(model[2]) is nn.Linear
        res["twice"] = ("ValueError", str(exc), kept, True)
    return res


def _uneven(mesh):
    """Linear(7, 9) colwise -> Linear(9, 4) rowwise (9 in_features: 5 + 4 columns): our output and
    input gradient, and torch's RowwiseParallel's error on the same model."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from labkit.strategies.tp import parallelize_by_hand

    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 4))
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(2)).requires_grad_()
    ours = parallelize_by_hand(copy.deepcopy(base), mesh, {"0": "colwise", "2": "rowwise"})
    out = ours(x)
    out.square().sum().backward()
    res = {"out": out.detach().clone(), "x_grad": x.grad.clone()}
    res["grads"] = {n: p.grad.full_tensor().clone() for n, p in ours.named_parameters()}
    theirs = parallelize_module(copy.deepcopy(base), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    try:
        theirs(x)
        res["torch_error"] = None
    except RuntimeError as exc:
        res["torch_error"] = str(exc).splitlines()[0]
    return res


def _clipped(model, gather):
    """clip_grad_norm_(max_norm=0.5) after one backward: {"norm": the total norm, "grads": clipped}."""
    x, y = _batch(0)
    F.cross_entropy(gather(model(x)), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    return {
        "norm": _full(norm).clone(),
        "grads": {n: _full(p.grad).clone() for n, p in model.named_parameters()},
    }


def _on_rank():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from labkit.strategies.tp import gather_from_tp, parallelize_by_hand

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    hand = parallelize_by_hand(_model(), mesh, PLAN)

    def layout(model):
        return {
            n: (type(p).__name__, tuple(p.shape), tuple(p.to_local().shape), tuple(map(str, p.placements)))
            for n, p in model.named_parameters()
        }

    res = {"layout": layout(hand), "hand": _train(hand, lambda o: gather_from_tp(o, OUT, mesh.get_group()))}
    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
    theirs = parallelize_module(_model(), mesh, {k: styles[v] for k, v in PLAN.items()})
    res["torch_layout"] = layout(theirs)

    def torch_gather(o):
        return DTensor.from_local(
            o, mesh, [torch.distributed.tensor.Shard(1)], shape=(ROWS, OUT), stride=(OUT, 1)
        )

    res["torch"] = _train(theirs, lambda o: torch_gather(o).full_tensor())
    res["clip_hand"] = _clipped(
        parallelize_by_hand(_model(), mesh, PLAN), lambda o: gather_from_tp(o, OUT, mesh.get_group())
    )
    res["clip_torch"] = _clipped(
        parallelize_module(_model(), mesh, {k: styles[v] for k, v in PLAN.items()}),
        lambda o: torch_gather(o).full_tensor(),
    )
    res["conjugates"] = _conjugates(rank)
    res["misuse"] = _misuse(mesh)
    res["uneven"] = _uneven(mesh)
    return res


@pytest.fixture(scope="module")
def ranks():
    return labkit.run(_on_rank, world_size=2, timeout=300)


def _maxdiff(expected, got):
    """The largest |expected - got| over two equal-keyed dicts (or lists) of tensors."""
    if isinstance(expected, dict):
        assert expected.keys() == got.keys()
        expected, got = list(expected.values()), [got[k] for k in expected]
    worst = 0.0
    for e, g in zip(expected, got, strict=True):
        assert e.shape == g.shape, (e.shape, g.shape)
        worst = max(worst, (e - g).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def single():
    return _train(_model(), lambda o: o)


def _assert_equal_to_both(ref, res, part, tag):
    """One rank's `part` ("outs", "grads": one per step; "state": the final one), ours and torch's,
    against one process (within FP32), then ours against torch's (within VS_TORCH)."""
    listed = (lambda v: [v]) if part == "state" else (lambda v: v)  # noqa: E731
    for way in ("hand", "torch"):
        for step, (e, g) in enumerate(zip(listed(ref), listed(res[way][part]), strict=True)):
            d = _maxdiff(e, g)
            print(f"{tag} {way} vs one process, {part}[{step}]: max diff {d:.3g}")
            assert d <= FP32, (tag, way, part, step, d)
    for step, (e, g) in enumerate(zip(listed(res["torch"][part]), listed(res["hand"][part]), strict=True)):
        d = _maxdiff(e, g)
        print(f"{tag} hand vs torch, {part}[{step}]: max diff {d:.3g}")
        assert d <= VS_TORCH, (tag, part, step, d)


@pytest.mark.parametrize("part", ["outs", "grads", "state"])
def test_training_equals_one_process_and_torch(ranks, single, part):
    for rank, res in enumerate(ranks):
        _assert_equal_to_both(single[part], res, part, f"rank {rank}")


def test_clip_grad_norm_sees_the_whole_model(ranks):
    """The parameters are DTensors of the global shape, so clip_grad_norm_ computes the norm of the
    whole gradient (not of this rank's shard) and clips every shard by the same factor."""
    ref = _clipped(_model(), lambda o: o)
    assert ref["norm"] > 0.5  # the clip really scales
    for rank, res in enumerate(ranks):
        for way in ("clip_hand", "clip_torch"):
            d = max(_maxdiff([ref["norm"]], [res[way]["norm"]]), _maxdiff(ref["grads"], res[way]["grads"]))
            print(f"rank {rank} {way} vs one process: max diff {d:.3g}")
            assert d <= FP32, (rank, way, d)
        d = max(
            _maxdiff([res["clip_torch"]["norm"]], [res["clip_hand"]["norm"]]),
            _maxdiff(res["clip_torch"]["grads"], res["clip_hand"]["grads"]),
        )
        print(f"rank {rank} clip hand vs torch: max diff {d:.3g}")
        assert d <= VS_TORCH, (rank, d)


def test_training_moves_the_weights(single):
    """The comparisons above are of a run that learns: every weight moved, every gradient nonzero."""
    start = _model().state_dict()
    for k, v in single["state"].items():
        assert (v - start[k]).abs().max() > 1e-3, k
    for grads in single["grads"]:
        assert all(g.abs().max() > 0 for g in grads.values())


def test_parameters_are_dtensors_like_torchs(ranks):
    expected = {
        "0.weight": ("DTensor", (10, 7), None, ("S(0)",)),
        "2.weight": ("DTensor", (6, 10), (6, 5), ("S(1)",)),
        "2.bias": ("DTensor", (6,), (6,), ("R",)),
        "4.weight": ("DTensor", (9, 6), None, ("S(0)",)),
        "4.bias": ("DTensor", (9,), None, ("S(0)",)),
    }
    local = {"0.weight": [(5, 7)] * 2, "4.weight": [(5, 6), (4, 6)], "4.bias": [(5,), (4,)]}
    for rank, res in enumerate(ranks):
        assert res["layout"] == res["torch_layout"], rank
        assert res["layout"].keys() == expected.keys()
        for name, (kind, shape, local_shape, placements) in expected.items():
            want = local_shape or local[name][rank]
            assert res["layout"][name] == (kind, shape, want, placements), (rank, name)


def test_conjugate_ops_against_hand_computation(ranks):
    x = [torch.arange(6.0).reshape(2, 3).mul(r + 1).add(0.25) for r in (0, 1)]
    up = [torch.linspace(-1, 1, 6).reshape(2, 3).mul(3 * r + 1) for r in (0, 1)]
    pieces = [torch.arange(12.0).reshape(4, 3), -torch.arange(8.0).reshape(4, 2)]
    g_up = torch.arange(20.0).reshape(4, 5)
    for r, res in enumerate(ranks):
        c = res["conjugates"]
        assert torch.equal(c["f_out"], x[r])  # f: identity forward
        assert torch.equal(c["f_grad"], up[0] + up[1])  # f: all-reduced gradient
        assert torch.equal(c["g_out"], x[0] + x[1])  # g: all-reduced forward
        assert torch.equal(c["g_grad"], up[r])  # g: identity backward
        assert torch.equal(c["gather_out"], torch.cat(pieces, dim=1))
        assert torch.equal(c["gather_grad"], g_up[:, :3] if r == 0 else g_up[:, 3:])


def test_uneven_rowwise_equals_one_process_where_torch_refuses(ranks):
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 4))
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(2)).requires_grad_()
    out = base(x)
    out.square().sum().backward()
    grads = {n: p.grad for n, p in base.named_parameters()}
    for rank, res in enumerate(ranks):
        u = res["uneven"]
        d = max(_maxdiff([out.detach(), x.grad], [u["out"], u["x_grad"]]), _maxdiff(grads, u["grads"]))
        print(f"rank {rank} uneven rowwise vs one process: max diff {d:.3g}")
        assert d <= FP32
        # torch's RowwiseParallel assumes even shards of its input: no second reference here
        assert u["torch_error"] is not None and "same reduction dim" in u["torch_error"], u["torch_error"]


@pytest.mark.parametrize(
    "case, kind, words",
    [
        ("bad style", "ValueError", ["'2'", "'diagonal'", "colwise", "rowwise"]),
        ("missing name", "ValueError", ["'blocks.7'", "not a submodule"]),
        ("not a Linear", "TypeError", ["'1'", "ReLU", "nn.Linear"]),
        ("twice", "ValueError", ["'0'", "already parallelized"]),
    ],
)
def test_misuse_raises_naming_it(ranks, case, kind, words):
    for res in ranks:
        got = res["misuse"][case]
        assert got is not None, f"{case}: parallelize_by_hand accepted it"
        name, message, untouched, still_linear = got
        assert name == kind, (case, name, message)
        for word in words:
            assert word in message, (case, word, message)
        assert untouched and still_linear, f"{case}: the model was changed before the refusal"


# ---------------------------------------------------------------- 2 x 2: ("dp", "tp")
DP_ROWS = 6  # the global batch; each dp replica takes 3 rows


def _dp_rows(step, dp_rank):
    x, y = _batch_of(step, DP_ROWS)
    rows = slice(3 * dp_rank, 3 * dp_rank + 3)
    return x[rows], y[rows]


def _batch_of(step, rows):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(rows, 7, generator=g), torch.randint(0, OUT, (rows,), generator=g)


def _train_2d(model, gather, dp_rank, after_backward):
    """3 SGD steps on this dp replica's rows (the gradients averaged over dp by fully_shard)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    outs, grads = [], []
    for step in range(STEPS):
        x, y = _dp_rows(step, dp_rank)
        opt.zero_grad()
        out = gather(model(x))
        F.cross_entropy(out, y).backward()
        after_backward()
        outs.append(out.detach().clone())
        grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
    return {
        "outs": outs,
        "grads": grads,
        "state": {k: _full(v).clone() for k, v in model.state_dict().items()},
    }


def _layout_2d(model):
    return {
        n: (tuple(p.shape), tuple(p.to_local().shape), tuple(map(str, p.placements)))
        for n, p in model.named_parameters()
    }


def _on_rank_2d():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from labkit.strategies.fsdp import full_grad_dict, full_state_dict, fully_shard_by_hand
    from labkit.strategies.tp import gather_from_tp, parallelize_by_hand

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp = mesh["dp"].get_local_rank(), mesh["tp"]
    res = {"dp_rank": dp_rank}
    try:
        parallelize_by_hand(_model(), mesh, PLAN)
        res["2d_mesh_error"] = None
    except ValueError as exc:
        res["2d_mesh_error"] = str(exc)

    def hand_model():  # FSDP x TP by hand: TP on "tp", then the TP-local tensors sharded over "dp"
        return fully_shard_by_hand(parallelize_by_hand(_model(), tp, PLAN), mesh=mesh["dp"])

    def torch_model():
        styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
        return fully_shard(
            parallelize_module(_model(), tp, {k: styles[v] for k, v in PLAN.items()}), mesh=mesh["dp"]
        )

    def hand_gather(o):
        return gather_from_tp(o, OUT, tp.get_group())

    def torch_gather(o):
        return DTensor.from_local(o, tp, [Shard(1)], shape=(3, OUT), stride=(OUT, 1)).full_tensor()

    hand = hand_model()
    res["hand_layout"] = _layout_2d(hand)
    res["hand"] = _train_2d(hand, hand_gather, dp_rank, lambda: None)
    res["hand_full"] = {"state": full_state_dict(hand), "grads": full_grad_dict(hand)}
    theirs = torch_model()
    res["torch_layout"] = _layout_2d(theirs)
    res["torch"] = _train_2d(theirs, torch_gather, dp_rank, lambda: None)
    res["torch_last_grads"] = {n: _full(p.grad).clone() for n, p in theirs.named_parameters()}
    res["clip_hand"] = _clipped_2d(hand_model(), hand_gather, dp_rank)
    res["clip_torch"] = _clipped_2d(torch_model(), torch_gather, dp_rank)
    return res


def _clipped_2d(model, gather, dp_rank):
    """clip_grad_norm_(0.2) after one backward on this dp replica's rows: the norm, clipped grads."""
    x, y = _dp_rows(0, dp_rank)
    F.cross_entropy(gather(model(x)), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.2)
    return {
        "norm": _full(norm).clone(),
        "grads": {n: _full(p.grad).clone() for n, p in model.named_parameters()},
    }


@pytest.fixture(scope="module")
def ranks_2d():
    return labkit.run(_on_rank_2d, world_size=4, timeout=300)


@pytest.fixture(scope="module")
def single_2d():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    outs, grads = [], []
    for step in range(STEPS):
        x, y = _batch_of(step, DP_ROWS)
        opt.zero_grad()
        out = model(x)
        F.cross_entropy(out, y).backward()
        outs.append(out.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"outs": outs, "grads": grads, "state": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("part", ["outs", "grads", "state"])
def test_2x2_fsdp_by_hand_x_tp_equals_one_process_and_torch_fsdp_tp(ranks_2d, single_2d, part):
    """parallelize_by_hand on mesh["tp"] of a ("dp", "tp") mesh, then fully_shard_by_hand(mesh=
    mesh["dp"]) (the TP-local tensors sharded over dp, gradients averaged over dp), 3 steps, vs one
    process on the whole batch and vs torch's parallelize_module + fully_shard(mesh=mesh["dp"]).
    The gradients and the state are read as torch's tools read them (DTensor.full_tensor() of the
    2-D DTensors), so the placements are checked too."""
    for rank, res in enumerate(ranks_2d):
        ref = single_2d[part]
        if part == "outs":
            rows = slice(3 * res["dp_rank"], 3 * res["dp_rank"] + 3)
            ref = [o[rows] for o in ref]
        _assert_equal_to_both(ref, res, part, f"2x2 rank {rank}")


def test_2x2_parameters_are_2d_dtensors_like_fully_shards(ranks_2d):
    """The placements torch's fully_shard gives TP parameters (str(_StridedShard(0, split_factor=2))
    is "_S(0, 2)"), the same global and local shapes
    (Linear(6, 9) colwise: 5 + 4 rows over tp, then 3 + 2 and 2 + 2 over dp)."""
    expected = {
        "0.weight": ("_S(0, 2)", "S(0)"),
        "2.weight": ("S(0)", "S(1)"),
        "2.bias": ("S(0)", "R"),
        "4.weight": ("_S(0, 2)", "S(0)"),
        "4.bias": ("_S(0, 2)", "S(0)"),
    }
    for rank, res in enumerate(ranks_2d):
        assert res["hand_layout"] == res["torch_layout"], (rank, res["hand_layout"], res["torch_layout"])
        assert {n: v[2] for n, v in res["hand_layout"].items()} == expected, rank


def test_2x2_full_dicts_are_whole(ranks_2d, single_2d):
    """full_state_dict / full_grad_dict (gathered by hand over dp, then tp) return whole tensors:
    the one-process state, and the last step's gradients as torch's full_tensor() reads them."""
    for rank, res in enumerate(ranks_2d):
        d = _maxdiff(single_2d["state"], res["hand_full"]["state"])
        print(f"2x2 rank {rank} full_state_dict vs one process: max diff {d:.3g}")
        assert d <= FP32, (rank, d)
        d = _maxdiff(res["torch_last_grads"], res["hand_full"]["grads"])
        print(f"2x2 rank {rank} full_grad_dict vs torch: max diff {d:.3g}")
        assert d <= VS_TORCH, (rank, d)


def test_2x2_clip_grad_norm_sees_the_whole_model(ranks_2d):
    """clip_grad_norm_ over the 2-D DTensors: the norm of the whole gradient (both dp replicas'
    rows averaged), every shard clipped by the same factor, as under torch's FSDP x TP."""
    for rank, res in enumerate(ranks_2d):
        assert res["clip_torch"]["norm"] > 0.2  # the clip really scales
        d = max(
            _maxdiff([res["clip_torch"]["norm"]], [res["clip_hand"]["norm"]]),
            _maxdiff(res["clip_torch"]["grads"], res["clip_hand"]["grads"]),
        )
        print(f"2x2 rank {rank} clip hand vs torch: max diff {d:.3g}")
        assert d <= VS_TORCH, (rank, d)


def test_2d_mesh_refused_naming_the_fix(ranks_2d):
    for res in ranks_2d:
        assert res["2d_mesh_error"] is not None and "mesh['tp']" in res["2d_mesh_error"], res["2d_mesh_error"]
