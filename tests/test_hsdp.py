"""HSDP by hand (labkit.strategies.fsdp.hsdp) on 4 ranks as 2 nodes x 2: equal to single-process
training and to torch's fully_shard on the same 2-D mesh, on a model the course never built (odd
sizes, a 1-element parameter, a weight tied across units, a frozen layer, float32 and float64), and
through loop.train ("hsdp", "torch-hsdp") on the toy preset; its traffic stays in the node but for
the gradient shards' all-reduce."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import loop, strategies
from labkit.checks import compare
from labkit.launch.topology import NodeLink

FAST = NodeLink(bandwidth_Bps=1e10, latency_s=0.0)  # the topology without its wait
STEPS = 3
VOCAB, WIDTH, ROWS, COLS = 13, 10, 8, 5


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, hidden), nn.Linear(hidden, WIDTH)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(h)))


class Oddball(nn.Module):
    """Embedding tied to the output layer (a weight in two units), blocks of 7 and 3 hidden
    units (odd: padded shards on 2 ranks), a frozen mixing layer, a 1-element temperature."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(7), Block(3)])
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.mix.requires_grad_(False)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = self.emb.weight
        self.temperature = nn.Parameter(torch.tensor([1.25]))  # torch refuses 0-dim
        self.to(dtype)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.out(self.mix(h)) * self.temperature


def _batch(step, dtype):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (ROWS, COLS), generator=g), torch.randint(
        0, VOCAB, (ROWS, COLS), generator=g
    )


def _loss(model, x, y, count):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1), reduction="sum") / count


def _train(dtype, way, rank=0, world_size=1, mesh=None):
    """{"losses", "grads" (step 0), "state"}: one process on the whole batch, or this rank's
    rows of it under labkit's HSDP ("hsdp") or torch's fully_shard on the same mesh ("torch")."""
    from labkit.strategies.fsdp import full_grad_dict, full_state_dict, fully_shard_by_hand

    model, scale = Oddball(dtype), 1.0
    if way == "hsdp":
        for m in (*model.blocks, model.mix, model.out):  # out's weight is tied to the root's
            fully_shard_by_hand(m, mesh=mesh)
        fully_shard_by_hand(model, mesh=mesh)  # averages over all N ranks, as torch's
    elif way == "torch":
        from torch.distributed.fsdp import fully_shard

        for m in (*model.blocks, model.mix):  # fully_shard cannot give one weight to two units
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if way != "one":
        scale = world_size  # the average of rank losses x N
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2, momentum=0.9)
    per = ROWS // world_size
    losses, grads = [], None
    for step in range(STEPS):
        x, y = _batch(step, dtype)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, x, y, ROWS * COLS)
        (loss * scale).backward()
        if step == 0:
            grads = _grads(model, way, full_grad_dict)
        opt.step()
        total = loss.detach().double()
        if way != "one":
            dist.all_reduce(total)
        losses.append(total.item())
    state = _state(model, way, full_state_dict)
    return {"losses": losses, "grads": grads, "state": state}


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _grads(model, way, full_grad_dict):
    if way == "hsdp":
        return full_grad_dict(model)
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _state(model, way, full_state_dict):
    if way == "hsdp":
        return full_state_dict(model)
    return {k: _full(v) for k, v in model.state_dict().items()}


def _both_ways(dtypes):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rank, n = dist.get_rank(), dist.get_world_size()
    placements = None
    out = {}
    for dtype in dtypes:
        for way in ("hsdp", "torch"):
            out[(str(dtype), way)] = _train(dtype, way, rank, n, mesh)
    # What torch's fully_shard made of the same mesh: every parameter Replicate() x Shard(0).
    from torch.distributed.fsdp import fully_shard

    probe = fully_shard(nn.Linear(3, 5), mesh=mesh)
    placements = [type(p).__name__ + str(getattr(p, "dim", "")) for p in probe.weight.placements]
    return out, placements


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}


@pytest.fixture(scope="module")
def oddball_runs():
    dtypes = (torch.float32, torch.float64)
    results = labkit.run(_both_ways, dtypes, world_size=4, nodes=2, inter_node=FAST, timeout=300)
    return dtypes, results


@pytest.mark.parametrize("way", ["hsdp", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_oddball_equals_one_process(oddball_runs, dtype, way):
    one = _train(dtype, "one")
    _, results = oddball_runs
    for rank, (out, _) in enumerate(results):
        got = out[(str(dtype), way)]
        compare(one["grads"], got["grads"], rank=rank, world_size=4, **TOL[dtype]).raise_if_failed()
        compare(one["state"], got["state"], rank=rank, world_size=4, **TOL[dtype]).raise_if_failed()
        assert got["losses"] == pytest.approx(one["losses"], rel=1e-6)
        assert set(got["state"]) == set(one["state"])  # both keys of the tied weight
        assert got["state"]["mix.weight"].equal(one["state"]["mix.weight"])  # frozen: unchanged


def test_oddball_hsdp_equals_torch_fully_shard_2d(oddball_runs):
    _, results = oddball_runs
    assert results[0][1] == ["Replicate", "Shard0"]
    for rank, (out, _) in enumerate(results):
        ours, theirs = out[("torch.float32", "hsdp")], out[("torch.float32", "torch")]
        compare(
            theirs["state"], ours["state"], rank=rank, world_size=4, **TOL[torch.float32]
        ).raise_if_failed()


def _shard_sizes():
    from torch.distributed.device_mesh import init_device_mesh
    from labkit.strategies.fsdp import fully_shard_by_hand

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fully_shard_by_hand(nn.Linear(4, 9), mesh=mesh)
    errors = []
    for bad in (dict(mesh=mesh, group=dist.group.WORLD), dict(mesh="2x2")):
        try:
            fully_shard_by_hand(nn.Linear(2, 2), **bad)
        except ValueError as exc:
            errors.append(str(exc)[:40])
    for name, opts in (
        ("hsdp", dict(group=None)),
        ("hsdp", dict(mesh=mesh["shard"])),
        ("hsdp", dict(prefech=2)),
        ("torch-hsdp", dict(mesh=mesh["shard"])),
    ):
        try:
            strategies.build(name, nn.Linear(2, 2), loop.PRESETS["toy"], **opts)
        except (TypeError, ValueError) as exc:
            errors.append(type(exc).__name__)
    # The padded shard this rank holds (the module's parameter is a DTensor of the global shape,
    # placements (Replicate(), Shard(0)) as fully_shard's on a 2-D mesh).
    assert tuple(model.weight.shape) == (9, 4)
    return tuple(model._fsdp_group.params[0].padded.shape), errors


def test_shards_within_the_node_and_refuses_bad_options():
    out = labkit.run(_shard_sizes, world_size=4, nodes=2, inter_node=FAST)
    for shape, errors in out:
        assert shape == (5, 4)  # 9 rows over the node's 2 ranks, not over 4: ceil(9/2)
        assert len(errors) == 6 and errors[2:] == ["TypeError", "ValueError", "TypeError", "ValueError"]


def _loop_runs(cfg):
    out = {}
    for name, opts in (("hsdp", {}), ("hsdp-avg", dict(reduce_op="avg")), ("torch-hsdp", {}), ("fsdp", {})):
        before = len(labkit_events())
        out[name] = loop.train(name.replace("-avg", ""), cfg, STEPS, **opts)
        out[name]["inter"] = sum(ev.get("inter_bytes", 0) for ev in labkit_events()[before:])
    return out


def labkit_events():
    from labkit.observe import tracing

    return tracing._recorder.events


@pytest.fixture(scope="module")
def toy_runs():
    cfg = loop.PRESETS["toy"].replace(batch_size=8)
    return cfg, labkit.run(_loop_runs, cfg, world_size=4, nodes=2, inter_node=FAST, timeout=300)


@pytest.mark.parametrize("name", ["hsdp", "hsdp-avg", "torch-hsdp"])
def test_loop_train_equals_reference(toy_runs, name):
    cfg, results = toy_runs
    reference = loop.reference(cfg, STEPS)
    for rank, out in enumerate(results):
        got = out[name]
        compare(reference["grads"], got["grads"], rank=rank, world_size=4).raise_if_failed()
        compare(reference["state"], got["state"], rank=rank, world_size=4).raise_if_failed()
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)


def test_hsdp_crosses_nodes_less_than_fsdp(toy_runs):
    _, results = toy_runs
    hsdp = sum(out["hsdp"]["inter"] for out in results)
    fsdp = sum(out["fsdp"]["inter"] for out in results)
    assert 0 < hsdp < 0.6 * fsdp
    assert "hsdp" in strategies.NAMES and "torch-hsdp" in strategies.NAMES
