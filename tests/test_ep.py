"""Expert parallelism (labkit.strategies.ep): the MoE pieces in one process, the expert-parallel
layer against one process in float64, and the "ep" strategy through loop.train against
loop.reference on the "moe" preset.

Two launches (2 and 4 ranks), each checking several things:
- loop.train("ep", PRESETS["moe"]) dropless, with capacity drops (capacity_factor 1.0), float64,
  reduce_op "avg", comm="torch", and on 4 ranks ep=2 (a 2 x 2 mesh): equal to loop.reference
  (losses rel 1e-5, step-0 gradients fp32 1e-5 / 1e-7, state atol 1e-4; float64 1e-12);
- the MoE layer on E=4 experts split over 1, 2 and 4 ranks (an ep group of that size, tokens
  over every rank), dropless and with drops, and with its router frozen (also one "ep" step with
  every router frozen, its gradients against one process's): forward, the
  load-balancing loss, the input's, router's and every expert's gradient within 1e-12 of one
  process in float64;
- misuse refused, naming why (micro-batches, an uneven ep, no MoE layer, unknown options,
  a layer split twice, experts frozen unlike).
"""

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import loop, strategies
from labkit.checks import compare
from labkit.models import GPTConfig, TinyGPT
from labkit.strategies import ep as E

CFG = loop.PRESETS["moe"]
DROPS = CFG.replace(gpt={**CFG.gpt, "capacity_factor": 1.0})
WIDE = CFG.replace(dtype=torch.float64, gpt={**CFG.gpt, "capacity_factor": 1.0})
FP32 = dict(rtol=1e-5, atol=1e-7)
STATE = dict(rtol=1e-5, atol=1e-4)
FP64 = dict(rtol=0, atol=1e-12)

RUNS = {
    2: {
        "dropless": dict(cfg=CFG),
        "drops": dict(cfg=DROPS),
        "float64": dict(cfg=WIDE),
        "avg": dict(cfg=DROPS, reduce_op="avg"),
    },
    4: {
        "dropless": dict(cfg=CFG),
        "drops ep=2": dict(cfg=DROPS, ep=2),
        "float64 ep=2": dict(cfg=WIDE, ep=2),
        "torch comm": dict(cfg=DROPS, comm="torch"),
    },
}


# ---------------------------------------------------------------- one process


def test_route_capacity_and_plan():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 5.0, 0.5]])
    probs, idx, gates = E.route(logits, 2)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert idx.tolist() == [[3, 2], [0, 1], [2, 1]]
    assert torch.allclose(gates.sum(-1), torch.ones(3))  # renormalised over the k
    assert torch.allclose(gates[0], probs[0, [3, 2]] / probs[0, [3, 2]].sum())
    # Balanced: f = P = 1/E gives 1.
    even = torch.full((4, 4), 0.25)
    assert E.load_balancing_loss(
        even, torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]), 4
    ).item() == pytest.approx(1)
    assert (
        E.capacity(64, 4, 2, 1.25) == 40 and E.capacity(10, 4, 2, 1.1) == 6 and E.capacity(8, 4, 1, 1.0) == 2
    )
    plan = E.dispatch_plan(torch.tensor([[0, 1], [0, 2], [0, 1]]), 4, 2)
    assert plan.slot.tolist() == [[0, 0], [1, 0], [2, 1]]
    assert plan.kept.tolist() == [[True, True], [True, True], [False, True]] and plan.dropped == 1
    assert E.dispatch_plan(torch.tensor([[0, 1], [0, 2], [0, 1]]), 4, None).dropped == 0
    for bad in (
        lambda: E.route(logits, 5),
        lambda: E.capacity(8, 4, 2, 0),
        lambda: E.capacity(8, 4, 2, None),
    ):
        with pytest.raises(ValueError):
            bad()


def test_moe_layer_drops_and_its_loss_reaches_the_model_loss():
    torch.manual_seed(0)
    moe = E.MoE(8, 16, 4, top_k=2, capacity_factor=0.5, seed=1).double()
    h = torch.randn(2, 5, 8, dtype=torch.float64)
    y = moe(h)
    tokens = h.reshape(-1, 8)
    probs, idx, gates = E.route(moe.router(tokens), 2)
    plan = E.dispatch_plan(idx, 4, E.capacity(10, 4, 2, 0.5))
    want = torch.zeros_like(tokens)
    for t in range(10):
        for j in range(2):
            if plan.kept[t, j]:  # a dropped one adds nothing; the other gate is not renormalised
                want[t] += gates[t, j] * moe.experts[int(idx[t, j])](tokens[t])
    assert torch.allclose(y.reshape(-1, 8), want, atol=1e-14) and moe.dropped == plan.dropped > 0
    assert moe.aux_loss.item() == pytest.approx(E.load_balancing_loss(probs, idx, 4).item(), rel=1e-12)
    config = GPTConfig(seq_len=8, d_model=16, n_layers=2, n_experts=4, aux_loss_coef=0.5)
    with pytest.raises(ValueError, match="needs its MoE layer"):
        TinyGPT(config)
    model = TinyGPT(config, mlp=E.moe_mlp)
    x = torch.randint(0, config.vocab_size, (2, 8))
    logits, loss = model(x, x)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1))
    aux = sum(b.mlp.aux_loss for b in model.blocks)
    assert loss.item() == pytest.approx((ce + 0.5 * aux).item(), rel=1e-6)
    _, summed = model(x, x, reduction="sum")
    assert summed.item() == pytest.approx(16 * loss.item(), rel=1e-5)
    dense = loop.build_model(loop.PRESETS["dp"])  # n_experts=0: the dense TinyGPT, unchanged
    assert not any(isinstance(m, E.MoE) for m in dense.modules())


# ---------------------------------------------------------------- the layer over ranks


def _layer_case(ep, capacity_factor, frozen_router):
    """(problems) for one MoE layer split over an ep group of `ep` ranks, tokens over the world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = E.MoE(8, 12, 4, top_k=2, capacity_factor=capacity_factor, aux_loss_coef=0.3, seed=5).double()
    moe = E.MoE(8, 12, 4, top_k=2, capacity_factor=capacity_factor, aux_loss_coef=0.3, seed=5).double()
    for m in (ref, moe):
        m.router.weight.requires_grad_(not frozen_router)
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(world * 3, 5, 8, generator=gen, dtype=torch.float64)  # rows over the world
    c = torch.randn(world * 3, 5, 8, generator=gen, dtype=torch.float64)
    x = h.clone().requires_grad_()
    (ref(x) * c).sum().add(ref.loss_term()).backward()
    groups = [dist.new_group(list(range(g, g + ep))) for g in range(0, world, ep)]
    replicas = [dist.new_group(list(range(i, world, ep))) for i in range(ep)]
    E.expert_parallel(moe, groups[rank // ep])
    rows = slice(3 * rank, 3 * rank + 3)
    mine = h[rows].clone().requires_grad_()
    y = moe(mine)
    (y * c[rows]).sum().add(moe.loss_term()).backward()
    bad = []
    label = f"ep={ep} cf={capacity_factor} frozen={frozen_router}"
    if (y - ref(h)[rows]).abs().max() > 1e-12:
        bad.append(f"{label}: forward")
    if (mine.grad - x.grad[rows]).abs().max() > 1e-12:
        bad.append(f"{label}: input grad")
    aux = moe.aux_loss.detach().clone()
    dist.all_reduce(aux)
    if (capacity_factor is not None) != (ref.dropped > 0):
        bad.append(f"{label}: {ref.dropped} dropped")
    if abs(aux.item() - ref.aux_loss.item()) > 1e-12 or moe.dropped != ref.dropped:
        bad.append(
            f"{label}: aux {aux.item()} vs {ref.aux_loss.item()}, dropped {moe.dropped} vs {ref.dropped}"
        )
    if frozen_router:
        if moe.router.weight.grad is not None:
            bad.append(f"{label}: a frozen router got a gradient")
    else:
        g = moe.router.weight.grad.clone()
        dist.all_reduce(g)
        if (g - ref.router.weight.grad).abs().max() > 1e-12:
            bad.append(f"{label}: router grad")
    for e in moe.ep.local:
        for (name, p), q in zip(moe.experts[e].named_parameters(), ref.experts[e].parameters()):
            g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            dist.all_reduce(g, group=replicas[rank % ep])  # over the ranks holding expert e
            want = torch.zeros_like(q) if q.grad is None else q.grad
            if (g - want).abs().max() > 1e-12:
                bad.append(f"{label}: expert {e} {name} grad off by {(g - want).abs().max().item():.2e}")
    held = {n for n, _ in moe.named_parameters() if n.startswith("experts.")}
    if held != {
        f"experts.{e}.{k}" for e in moe.ep.local for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    }:
        bad.append(f"{label}: holds {sorted(held)}")
    return bad


def _misuse(world):
    """{case: the error's text, or None when it was accepted}."""

    def raised(fn):
        try:
            fn()
            return None
        except (ValueError, TypeError, NotImplementedError) as exc:
            return f"{type(exc).__name__}: {exc}"

    out = {
        "accum 2": raised(lambda: loop.train("ep", CFG, 1, accum_steps=2, spans=False)),
        "ep=3": raised(lambda: strategies.build("ep", loop.build_model(CFG), CFG, ep=3)),
        "dense model": raised(lambda: strategies.build("ep", loop.build_model(loop.PRESETS["dp"]), CFG)),
        "unknown option": raised(lambda: strategies.build("ep", loop.build_model(CFG), CFG, epp=2)),
        "mixed precision": raised(
            lambda: strategies.build("ep", loop.build_model(CFG), CFG, mp_policy="bf16")
        ),
        "checkpointing": raised(
            lambda: strategies.build("ep", loop.build_model(CFG), CFG.replace(activation_checkpointing=True))
        ),
    }
    twice = E.MoE(8, 8, 4)
    E.expert_parallel(twice)
    out["split twice"] = raised(lambda: E.expert_parallel(twice))
    out["3 experts"] = raised(lambda: E.expert_parallel(E.MoE(8, 8, 3 if world > 1 else 1)))
    model = loop.build_model(CFG)
    model.blocks[0].mlp.experts[1].fc1.weight.requires_grad_(False)
    out["frozen unlike"] = raised(lambda: strategies.build("ep", model, CFG))
    return out


def _frozen_routers():
    """Problems of one "ep" step whose routers are frozen, against one process (step-0 grads)."""
    from labkit.data import shard_batch

    cfg = DROPS
    models = [loop.build_model(cfg), loop.build_model(cfg)]
    for model in models:
        for layer in E.moe_layers(model).values():
            layer.router.weight.requires_grad_(False)
    ref, model = models
    x, y = loop.global_batch(cfg, 0)
    (loop.summed_loss(ref, cfg, x, y, 0) / y.numel()).backward()
    s = strategies.build("ep", model, cfg)
    rows = shard_batch(x, y, dist.get_rank(), dist.get_world_size())
    loop.train_step(s, loop.Batch([rows], count=y.numel(), step=0), cfg)
    want = strategies.replica_grads(ref)
    got = s.full_grad_dict()
    bad = [n for n in got if "router" in n]
    report = compare(want, got, label="frozen routers", **FP32)
    return bad + ([] if report.ok else [str(report)])


def _rank(world_size):
    results = dict(
        zip(RUNS[world_size], loop.sweep(list(RUNS[world_size].values()), strategy="ep", spans=False))
    )
    layers = []
    for ep in sorted({1, 2, world_size}):
        for cf in (None, 0.75):
            layers += _layer_case(ep, cf, frozen_router=False)
    layers += _layer_case(world_size, 0.75, frozen_router=True)
    layers += _frozen_routers()
    return {"runs": results, "layers": layers, "misuse": _misuse(world_size)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_ep_equals_one_process(world_size):
    out = labkit.run(_rank, world_size, world_size=world_size, timeout=600)
    refs = {}
    for label, run in RUNS[world_size].items():
        cfg = run["cfg"]
        ref = refs.get(repr(cfg)) or refs.setdefault(repr(cfg), loop.reference(cfg))
        wide = cfg.dtype == torch.float64
        for rank, result in enumerate(out):
            got = result["runs"][label]
            where = f"ep {label} rank {rank}"
            compare(
                ref["grads"], got["grads"], label=where + " grads", **(FP64 if wide else FP32)
            ).raise_if_failed()
            compare(
                ref["state"], got["state"], label=where + " state", **(FP64 if wide else STATE)
            ).raise_if_failed()
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-12 if wide else 1e-5), where
            assert set(got["state"]) == set(ref["state"]), where
    assert all(r["layers"] == [] for r in out), [r["layers"] for r in out]
    misuse = out[0]["misuse"]
    assert all(v is not None for v in misuse.values()), misuse
    assert "micro-batches" in misuse["accum 2"] and "accum_steps must be 1" in misuse["accum 2"]
    assert "dividing the world size" in misuse["ep=3"]
    assert "no MoE layer" in misuse["dense model"] and "epp" in misuse["unknown option"]
    assert (
        "mp_policy must be None or" in misuse["mixed precision"]
        and "checkpointing" in misuse["checkpointing"]
    )
    assert "already" in misuse["split twice"] and "do not split" in misuse["3 experts"]
    assert "frozen alike" in misuse["frozen unlike"]
