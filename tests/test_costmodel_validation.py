"""The cost model refuses nonsense (issue: it answered negative parameter counts, stage 7, a
negative world size, fractional n, negative message sizes and mfu > 1 with numbers)."""

import pytest

from labkit import costmodel as cm
from labkit.costmodel import links

NET = links.Link("net", 5e-6, 10e9)

BAD = [
    ("negative parameter count", lambda: cm.memory_per_rank(-7.5e9, 64, 3), "model_params"),
    ("stage 7", lambda: cm.memory_per_rank(7.5e9, 64, 7), "stage"),
    ("stage as a name", lambda: cm.memory_per_rank(7.5e9, 64, "zero2"), "STAGE"),
    ("negative world size", lambda: cm.memory_per_rank(7.5e9, -4, 1), "n must be"),
    ("fractional n", lambda: cm.memory_per_rank(7.5e9, 2.5, 1), "n must be"),
    ("zero n", lambda: cm.step_time(cm.GPT_1_3B, 0, "ddp", NET, cm.A100), "n must be"),
    ("bool n", lambda: cm.memory_per_rank(7.5e9, True, 1), "n must be"),
    ("unknown precision", lambda: cm.memory_per_rank(7.5e9, 8, 1, precision="bf16"), "precision"),
    ("negative message", lambda: links.collective_time("all_reduce", 4, -1.0, NET), "size_bytes"),
    ("unknown op", lambda: links.collective_time("broadcast", 1, 1.0, NET), "unknown collective"),
    ("mfu above 1", lambda: cm.with_mfu(cm.A100, 1.5), "mfu"),
    ("mfu 0", lambda: cm.with_mfu(cm.A100, 0), "mfu"),
    ("Hardware mfu 0", lambda: cm.Hardware("x", 1e12, 0.0), "mfu"),
    ("negative bandwidth", lambda: links.Link("x", 1e-6, -1e9), "busbw"),
    ("nan latency", lambda: links.Link("x", float("nan"), 1e9), "alpha"),
    ("gpus per node 0", lambda: links.TwoLevel(NET, NET, 0), "gpus_per_node"),
    ("model with 0 layers", lambda: cm.Model("m", 1e9, 0, 1024, 2048), "layers"),
    ("step_time strategy typo", lambda: cm.step_time(cm.GPT_1_3B, 8, "zero-2", NET, cm.A100), "strategy"),
    ("step_time link swapped with hw", lambda: cm.step_time(cm.GPT_1_3B, 8, "ddp", cm.A100, NET), "link"),
    (
        "step_time negative batch",
        lambda: cm.step_time(cm.GPT_1_3B, 8, "ddp", NET, cm.A100, -1),
        "global_batch",
    ),
    (
        "step_time grad_bytes 0",
        lambda: cm.step_time(cm.GPT_1_3B, 8, "ddp", NET, cm.A100, grad_bytes=0),
        "grad_bytes",
    ),
    (
        "step_time misspelled knob",
        lambda: cm.step_time(cm.GPT_1_3B, 8, "ddp", NET, cm.A100, overlapp=True),
        "overlapp",
    ),
    ("activation tokens 0", lambda: cm.activation_bytes(cm.GPT_1_3B, 0), "tokens_per_rank"),
    ("fit with one point", lambda: links.fit_alpha_beta([1e6], [1e-3]), "2 or more"),
    ("fit with a negative time", lambda: links.fit_alpha_beta([1e6, 2e6], [1e-3, -1e-3]), "> 0"),
    ("calibration with step 0", lambda: cm.Hardware.from_measured_step("cpu", 1e9, 0.0), "step_s"),
]


@pytest.mark.parametrize("what, call, named", BAD, ids=[b[0] for b in BAD])
def test_nonsense_is_refused_naming_what_is_allowed(what, call, named):
    with pytest.raises((ValueError, TypeError)) as err:
        call()
    assert named in str(err.value), (what, str(err.value))


def test_sensible_inputs_still_answer():
    assert cm.paper_table() == cm.ZERO_TABLE_GB
    assert cm.memory_per_rank(1000, 4, 1, precision="fp32")["optimizer"] == 2000
    assert links.collective_time("all_reduce", 1, 1e6, NET) == 0.0
    assert links.collective_time("all_reduce", 4, 0, NET) == pytest.approx(6 * 5e-6)
    assert (
        cm.step_time(cm.GPT_1_3B, 16, "fsdp", links.DGX_A100_IB200, cm.with_mfu(cm.A100, 1.0))["step_s"] > 0
    )
