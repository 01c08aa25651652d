"""CPU offload by hand (labkit.strategies.fsdp.offload: offload_policy=CPUOffloadPolicy on the FSDP
strategy / fully_shard_by_hand) on 2 gloo ranks, one launch: equal to single-process training
(loop.reference) and to torch's fully_shard(offload_policy=CPUOffloadPolicy(pin_memory=False)) on
the same units (torch runs it on a CPU mesh; pin_memory=True needs an accelerator there, in
torch and here); the traced h2d / d2h bytes equal offload_formula's; the memory tracker's device
pool drops by exactly what its host pool holds, and that is offload_formula's "host"; the shards,
their gradients and the optimizer state are host tensors in the host pool. Also the refusals, the
host-link price and the tracker's pools on one process.

Tolerances: vs fully_shard and vs the same strategy without offload EXACT (the same arithmetic,
only copied between pools: measured bit-identical); vs loop.reference as tests/test_fsdp.py's
TinyGPT bounds (summation order).
"""

import functools

import pytest
import torch

import labkit
from labkit import loop
from labkit.checks import compare
from labkit.observe.trace_stats import collective_counts
from labkit.strategies.fsdp import CPUOffloadPolicy
from labkit.strategies.fsdp.offload import check_offload, offload_formula

CFG = loop.PRESETS["dp"]  # TinyGPT, 2 blocks: block units + the root
STEPS = 3
OFF = CPUOffloadPolicy(pin_memory=False)
EXACT = dict(rtol=0, atol=0)
FP32 = dict(rtol=1e-5, atol=1e-7)
FP32_STATE = dict(rtol=1e-5, atol=5e-5)


def _formula(s):
    return {"formula": offload_formula(s.units), "where": _where(s), "gathers": s.ctx.gathers}


def _where(s):
    """Devices and pools of what the strategy holds after its last step."""
    from labkit.observe._memory_ledger import is_marked_host

    shards = [p.padded for u in s.units for p in u.params]
    grads = [p.sharded.grad for u in s.units for p in u.params if p.sharded.grad is not None]
    grads = [getattr(g, "_local_tensor", g) for g in grads]
    state = [t for st in s.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    tensors = shards + grads
    return {
        "devices": sorted({t.device.type for t in tensors + state}),
        "marked": all(is_marked_host(t.untyped_storage()) for t in tensors),
        "unit_devices": sorted({u.device.type for u in s.units}),
    }


def _rank():
    report = loop.Hooks(report=_formula)
    runs = [
        dict(strategy="fsdp", offload_policy=OFF, hooks=report),  # traced
        dict(strategy="fsdp"),
        dict(strategy="torch-fsdp", offload_policy=OFF),
        dict(strategy="fsdp", offload_policy=OFF, track_memory=True, return_state=False),
        dict(strategy="fsdp", track_memory=True, return_state=False),
    ]
    return loop.sweep(runs, cfg=CFG, steps=STEPS, spans=False)


@functools.lru_cache(maxsize=None)
def _launch():
    results = labkit.run(_rank, world_size=2, timeout=600)
    return list(results), results.traces


def test_equals_reference_torch_and_plain():
    ranks, _ = _launch()
    expected = loop.reference(CFG, STEPS)
    for rank, (off, plain, torch_off, _, _) in enumerate(ranks):
        where = f"rank {rank}"
        compare(
            expected["grads"], off["grads"], label=f"{where} grads vs reference", **FP32
        ).raise_if_failed()
        compare(
            expected["state"], off["state"], label=f"{where} state vs reference", **FP32_STATE
        ).raise_if_failed()
        for other, name in ((plain, "fsdp without offload"), (torch_off, "fully_shard with offload")):
            compare(other["grads"], off["grads"], label=f"{where} grads vs {name}", **EXACT).raise_if_failed()
            compare(other["state"], off["state"], label=f"{where} state vs {name}", **EXACT).raise_if_failed()
        assert off["losses"] == plain["losses"]


def test_shards_grads_state_on_host_and_unit_computes_on_device():
    ranks, _ = _launch()
    for off, *_ in ranks:
        assert off["where"] == {"devices": ["cpu"], "marked": True, "unit_devices": ["cpu"]}, off["where"]


def test_traced_bytes_equal_formula():
    ranks, traces = _launch()
    for rank, (off, *_) in enumerate(ranks):
        counts = collective_counts(traces[rank])
        f = off["formula"]
        # Two offloaded runs in the launch (the traced one and the tracked one), STEPS steps each.
        assert counts["h2d"][1] == 2 * STEPS * f["h2d"], (counts["h2d"], f)
        assert counts["d2h"][1] == 2 * STEPS * f["d2h"], (counts["d2h"], f)
        assert counts["h2d"][0] == 2 * off["gathers"]  # one move before each unit's all-gather


def test_device_pool_drops_by_host_pool_and_formula():
    ranks, _ = _launch()
    for off, _, _, mem_off, mem_plain in ranks:
        after_off = [s for s in mem_off["memory"].samples if s.label == "after step"][-1]
        after_plain = [s for s in mem_plain["memory"].samples if s.label == "after step"][-1]
        host = sum(after_off.host.values())
        assert host == off["formula"]["host"], (after_off.host, off["formula"])
        assert after_plain.total - after_off.total == host, (
            after_plain.by_category,
            after_off.by_category,
            host,
        )
        for category in ("parameters", "gradients", "optimizer"):
            assert after_off.by_category[category] == 0, after_off.by_category
        assert not any(s.host for s in mem_plain["memory"].samples)
        assert mem_off["memory"].host_peak >= host


def test_refusals():
    with pytest.raises(TypeError, match="offload_policy must be"):
        check_offload("cpu", "FSDP")
    with pytest.raises(TypeError, match="pin_memory must be a bool"):
        CPUOffloadPolicy(pin_memory="yes")
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPU, OffloadPolicy

    assert check_offload(OffloadPolicy(), "x") is None
    assert check_offload(TorchCPU(pin_memory=False), "x") == OFF
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="on a CPU-only machine"):
            check_offload(CPUOffloadPolicy(), "FSDP")


def test_host_link_price():
    from labkit.costmodel.links import PCIE_GEN5_X16, host_copy_time

    assert PCIE_GEN5_X16.busbw_Bps == pytest.approx(63.0e9, rel=0.01)
    assert host_copy_time(0) == 0.0
    assert host_copy_time(63e9) == pytest.approx(1.0 + PCIE_GEN5_X16.alpha_s, rel=0.01)
