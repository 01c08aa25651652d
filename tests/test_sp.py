"""Sequence parallelism: parallelize_by_hand's SP styles ("sequence", "colwise_sp", "rowwise_sp")
equal to torch's SequenceParallel(), ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(
output_layouts=Shard(1)) and to one process on a LayerNorm -> Linear -> GELU -> Linear stack
(float64, output pieces and every parameter's gradient); the loop strategies "sp" and "torch-sp"
(tp=2 on TinyGPT) equal to loop.reference (float64 within 1e-12, float32 at test_tp_strategies'
tolerances) and to each other; misuse. One 2-rank launch, module-scoped.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import loop, strategies
from labkit.checks import compare

STEPS = 3
CFG = loop.PRESETS["dp"]
WIDE = CFG.replace(dtype=torch.float64)
FP32 = dict(rtol=1e-5, atol=1e-7)
FP32_GPT_STATE = dict(rtol=1e-5, atol=5e-5)
FP64 = dict(rtol=0, atol=1e-12)
RUNS = {
    "sp": dict(strategy="sp"),
    "torch-sp": dict(strategy="torch-sp"),
    "sp float64": dict(strategy="sp", cfg=WIDE),
    "torch-sp float64": dict(strategy="torch-sp", cfg=WIDE),
    "sp comm=torch float64": dict(strategy="sp", cfg=WIDE, comm="torch"),  # torch.distributed's collectives
}
PLAN = {"ln": "sequence", "fc": "colwise_sp", "out": "rowwise_sp"}


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.ln, self.fc, self.out = nn.LayerNorm(6), nn.Linear(6, 10), nn.Linear(10, 6)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.double()

    def forward(self, x):
        return self.out(F.gelu(self.fc(self.ln(x))))


def _styles_case():
    """ours, torch's and one process's output pieces and whole gradients for PLAN."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from labkit.strategies.tp import parallelize_by_hand

    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    g = torch.Generator().manual_seed(5)
    x, w = (
        torch.randn(2, 8, 6, generator=g, dtype=torch.float64),
        torch.randn(2, 8, 6, generator=g, dtype=torch.float64),
    )
    piece = slice(rank * 8 // n, (rank + 1) * 8 // n)

    def run(model):  # this rank's piece in and out; every parameter's whole gradient
        y = model(x[:, piece])
        (y * w[:, piece]).sum().backward()
        grads = {
            k: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach()
            for k, p in model.named_parameters()
        }
        return y.detach(), grads

    whole = Stack()  # one process: the whole sequence, the loss of every position
    y = whole(x)
    (y * w).sum().backward()
    one = (y[:, piece].detach(), {k: p.grad.detach() for k, p in whole.named_parameters()})
    ours = run(parallelize_by_hand(Stack(), mesh, PLAN))
    torch_plan = {
        "ln": SequenceParallel(),
        "fc": ColwiseParallel(input_layouts=Shard(1)),
        "out": RowwiseParallel(output_layouts=Shard(1)),
    }
    theirs = run(parallelize_module(Stack(), mesh, torch_plan))
    classes = {k: type(m).__name__ for k, m in parallelize_by_hand(Stack(), mesh, PLAN).named_children()}
    dtypes = {}  # under bf16 autocast: the output's dtype, ours and torch's
    for label, model in (
        ("ours", parallelize_by_hand(Stack().float(), mesh, PLAN)),
        ("torch", parallelize_module(Stack().float(), mesh, torch_plan)),
    ):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dtypes[label] = str(model(x[:, piece].float()).dtype)
    return {"one": one, "ours": ours, "torch": theirs, "classes": classes, "autocast dtypes": dtypes}


def _misuse():
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.strategies.tp import parallelize_by_hand

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    calls = {
        "sequence on a Linear": lambda: parallelize_by_hand(Stack(), mesh, {"fc": "sequence"}),
        "colwise_sp on a LayerNorm": lambda: parallelize_by_hand(Stack(), mesh, {"ln": "colwise_sp"}),
        "unknown style": lambda: parallelize_by_hand(Stack(), mesh, {"fc": "colwise-sp"}),
        "odd sequence": lambda: _odd_sequence(),
    }
    for label, call in calls.items():
        try:
            call()
            out[label] = None
        except (ValueError, TypeError) as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def _odd_sequence():
    cfg = CFG.replace(seq_len=31)
    s = strategies.build("sp", loop.build_model(cfg), cfg)
    x, y = loop.global_batch(cfg, 0)
    s(x, y)


def _state_dict_case(name):
    """After one step on `name`: the loss of a plain TinyGPT loaded strictly from model.state_dict()
    and from get_model_state_dict(full_state_dict=True), the strategy's own, and after loading a
    plain state dict back into the parallelized model."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    model = loop.build_model(WIDE)
    s = strategies.build(name, model, WIDE)
    x, y = loop.global_batch(WIDE, 0)
    s.zero_grad()
    s(x, y)[1].backward()
    s.step()
    out = {"strategy": s(x, y)[1].item()}
    options = StateDictOptions(full_state_dict=True)
    for label, state in (
        (
            "state_dict",
            {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()},
        ),
        ("get_model_state_dict", get_model_state_dict(model, options=options)),
    ):
        plain = loop.build_model(WIDE)
        plain.load_state_dict(state, strict=True)
        out[label] = plain(x, y)[1].item()
    fresh = loop.build_model(WIDE)
    other = strategies.build(name, fresh, WIDE)
    set_model_state_dict(fresh, plain.state_dict(), options=options)  # one process's, loaded back
    out["loaded back"] = other(x, y)[1].item()
    return out


def _rank():
    out = dict(zip(RUNS, loop.sweep(list(RUNS.values()), cfg=CFG, steps=STEPS, spans=False)))
    out["state dicts"] = {name: _state_dict_case(name) for name in ("sp", "torch-sp")}
    out["styles"] = _styles_case()
    out["misuse"] = _misuse()
    return out


@pytest.fixture(scope="module")
def two():
    return labkit.run(_rank, world_size=2, timeout=600)


@pytest.fixture(scope="module")
def references():
    return {torch.float32: loop.reference(CFG, STEPS), torch.float64: loop.reference(WIDE, STEPS)}


def _check(expected, got, label, wide):
    state_tol, grad_tol = (FP64, FP64) if wide else (FP32_GPT_STATE, FP32)
    compare(expected["grads"], got["grads"], label=label + " grads", **grad_tol).raise_if_failed()
    compare(expected["state"], got["state"], label=label + " state", **state_tol).raise_if_failed()
    assert got["grads"].keys() == expected["grads"].keys(), label
    assert got["losses"] == pytest.approx(expected["losses"], rel=1e-12 if wide else 1e-5), label


def test_sp_strategies_equal_one_process(two, references):
    for label in RUNS:
        wide = "float64" in label
        for rank, got in enumerate(two):
            _check(
                references[torch.float64 if wide else torch.float32], got[label], f"{label} rank {rank}", wide
            )


def test_sp_equals_torch_sp(two):
    for rank, got in enumerate(two):
        for suffix, wide in (("", False), (" float64", True)):
            _check(got["torch-sp" + suffix], got["sp" + suffix], f"sp vs torch-sp{suffix} rank {rank}", wide)


def test_sp_styles_equal_torch_and_one_process(two):
    for rank, got in enumerate(two):
        case = got["styles"]
        for other in ("one", "torch"):
            y, grads = case[other]
            assert (case["ours"][0] - y).abs().max() <= 1e-12, (rank, other)
            compare(grads, case["ours"][1], label=f"rank {rank} vs {other}", **FP64).raise_if_failed()
        assert case["autocast dtypes"] == {"ours": "torch.bfloat16", "torch": "torch.bfloat16"}, rank
        assert case["classes"] == {
            "ln": "TPSequenceLayerNorm",
            "fc": "TPColwiseSPLinear",
            "out": "TPRowwiseSPLinear",
        }


def test_sp_misuse(two):
    for got in two:
        m = got["misuse"]
        assert "'sequence' takes an nn.LayerNorm" in m["sequence on a Linear"]
        assert "'colwise_sp' takes an nn.Linear" in m["colwise_sp on a LayerNorm"]
        assert "the styles are" in m["unknown style"]
        assert "31 positions does not split evenly over 2 tp ranks" in m["odd sequence"]


def test_state_dict_loads_into_one_process(two):
    """sp / torch-sp: model.state_dict() and get_model_state_dict(full_state_dict=True) hold the
    qkv rows in [q; k; v] order: a plain TinyGPT loading them strictly gives the same loss (and
    a plain state dict loads back into the parallelized model)."""
    for rank, got in enumerate(two):
        for name, case in got["state dicts"].items():
            for label in ("state_dict", "get_model_state_dict", "loaded back"):
                assert case[label] == pytest.approx(case["strategy"], rel=1e-12), (rank, name, label, case)
