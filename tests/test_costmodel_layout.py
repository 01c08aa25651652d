"""costmodel.layout_step and costmodel.search against published runs (labkit/costmodel/published.py,
docs/published_runs.md): every predicted row within 15% of its published TFLOP/s per GPU, the
calibration rows reproduced by the stated efficiencies, search's top three holding the published
layout or one within 10% of its modelled step, and the argument checks; and what cannot run is
refused or priced as it runs (issue: CP not cutting the sequence, kv_heads above or not dividing
the heads, tp beyond the K/V heads, a billion GPUs, micro-batch 0, an empty search). Pure Python, fast."""

import contextlib
import re
import signal
import threading
import time

import pytest

from labkit import costmodel as cm
from labkit.costmodel import published as P
from labkit.costmodel.layout_search import _divisors, rank_of

ROWS = {r["name"]: r for r in P.table()}
# rows where search's top three miss the published layout by more than 10% (the model's
# disagreements, docs/published_runs.md says why): the top's step over the published layout's
KNOWN_MISSES = {"Megatron 39.1B": 0.86, "Llama 3 405B, 16,384 GPUs, cp 16, seq 131,072": 0.84}


@pytest.mark.parametrize("name", sorted(P.ANCHORS))
def test_every_anchor_within_15_percent(name):
    row = ROWS[name]
    assert row["fits"], row
    assert abs(row["ratio"] - 1) <= 0.15, row


@pytest.mark.parametrize("gpu", sorted(P.CALIBRATED))
def test_the_stated_efficiency_is_the_calibration_rows(gpu):
    anchor = P.ANCHORS[P.CALIBRATED[gpu]]
    assert P.calibrate(anchor) == pytest.approx(anchor.cluster.matmul_efficiency, abs=2e-3)
    assert ROWS[anchor.name]["ratio"] == pytest.approx(1.0, abs=0.01)
    assert ROWS[anchor.name]["calibrated"]
    assert sum(r["calibrated"] for r in ROWS.values()) == len(P.CALIBRATED)  # one row per GPU type


@pytest.mark.parametrize("name", sorted(P.ANCHORS))
def test_search_top_three_holds_the_published_layout_or_one_within_10_percent(name):
    anchor = P.ANCHORS[name]
    rows = anchor.search()
    published = anchor.step()["step_s"]
    assert rank_of(rows, anchor.layout, anchor.micro_batch) is not None  # it fits and is searched
    near = [abs(r["step_s"] / published - 1) <= 0.10 for r in rows[:3]]
    if name in KNOWN_MISSES:
        assert not any(near) and rows[0]["step_s"] / published == pytest.approx(KNOWN_MISSES[name], abs=0.02)
    else:
        assert any(near), [(r["layout"], r["micro_batch"], r["step_s"] / published) for r in rows[:3]]
    steps = [r["step_s"] for r in rows]
    assert steps == sorted(steps) and all(r["fits"] for r in rows)


@pytest.mark.parametrize("name", sorted(P.FIGURES))
def test_the_model_orders_megatrons_measured_comparisons_as_the_paper(name):
    # Narayanan et al. 2021, Figures 13-15: the layouts in the paper's order, fastest first
    for batch, tflops in P.figure_throughputs(name).items():
        assert tflops == sorted(tflops, reverse=True), (batch, tflops)


def test_megatron_2021_rules_allow_the_published_layouts_and_refuse_what_it_could_not_run():
    for a in P.ANCHORS.values():
        if a.counts == "hw":
            assert P.megatron_2021_allows(a.step() | {"layers": a.model.layers}), a.name
    row = {"layout": {"pp": 2, "v": 2}, "m": 8, "layers": 48}  # interleaving needs pp > 2
    assert not P.megatron_2021_allows(row)
    assert not P.megatron_2021_allows(row | {"layout": {"pp": 4, "v": 2}, "m": 6})  # m % pp
    assert not P.megatron_2021_allows(row | {"layout": {"pp": 4, "v": 5}})  # 12 layers in 5 chunks
    assert not P.megatron_2021_allows(row | {"layout": {"pp": 5, "v": 1}})  # 48 layers on 5 stages
    assert all(P.megatron_2021_allows(r | {"layers": 48}) for r in P.ANCHORS["Megatron 39.1B"].search())


# ---------------------------------------------------------------- the model's own invariants
LLAMA = P.ANCHORS["Llama 3 405B, 8,192 GPUs, cp 1, seq 8,192"]
KW = dict(seq_len=8192, global_batch_tokens=16 * 2**20, micro_batch=1)


def _step(**layout):
    return cm.layout_step(P.LLAMA3_405B, {**LLAMA.layout, **layout}, P.META_H100, **KW)


def test_bubble_is_p_minus_1_over_v_m_plus_p_minus_1():
    for v in (1, 2, 4):
        row = _step(v=v)
        assert row["bubble"] == pytest.approx(15 / (v * row["m"] + 15))


def test_fewer_micro_batches_than_stages_wait_for_the_first_to_come_round():
    # m = 4 < p = 16, v = 4: each round waits p slots for its first micro-batch, v p + m - 1 slots
    small = KW | {"global_batch_tokens": 8192 * 64 * 4}
    row = cm.layout_step(P.LLAMA3_405B, LLAMA.layout, P.META_H100, **small)
    assert row["m"] == 4
    assert row["bubble"] == pytest.approx(1 - 4 * 4 / (4 * 16 + 4 - 1))
    flat = cm.layout_step(P.LLAMA3_405B, {**LLAMA.layout, "v": 1}, P.META_H100, **small)
    assert flat["bubble"] == pytest.approx(15 / (4 + 15))  # v = 1: m + p - 1 either way


def test_global_batch_sets_the_micro_batches_and_refuses_what_does_not_divide():
    assert _step()["m"] == 16 * 2**20 // 8192 // 64
    with pytest.raises(ValueError, match="global batch"):
        cm.layout_step(P.LLAMA3_405B, {**LLAMA.layout, "dp": 48}, P.META_H100, **KW)


def test_fsdp_resharding_under_pp_gathers_every_micro_batch():
    keep, reshard = _step(zero=3, reshard=False), _step(zero=3, reshard=True)
    assert reshard["exposed_comm_s"]["param_gather"] > 10 * keep["exposed_comm_s"]["param_gather"]
    assert reshard["memory_bytes"]["unsharded"] < keep["memory_bytes"]["unsharded"]


def test_activations_shrink_with_tp_and_recompute_and_grow_with_interleaving():
    base = _step()["memory_bytes"]["activations"]
    assert _step(recompute="full")["memory_bytes"]["activations"] < base / 5
    assert _step(v=1)["memory_bytes"]["activations"] < base
    with_tp4 = cm.layout_step(P.LLAMA3_405B, {**LLAMA.layout, "tp": 4, "dp": 128}, P.META_H100, **KW)
    assert with_tp4["memory_bytes"]["activations"] == pytest.approx(2 * base)


def test_fp32_gradients_by_default_bf16_halves_them():
    fp32, bf16 = _step(zero=1), _step(zero=1, reduce_dtype="bf16")
    assert fp32["memory_bytes"]["gradients"] == pytest.approx(2 * bf16["memory_bytes"]["gradients"])


def test_flat_fsdp_is_priced_per_rail():
    # a ring across nodes spread over the node's 8 NICs: 8x less than one NIC carrying it all
    from labkit.costmodel import links

    model = P.gpt(7.5, 32, 4096, 36)
    row = cm.layout_step(model, {"dp": 64, "zero": 3, "reshard": False}, P.SELENE, seq_len=2048,
                         global_batch_tokens=64 * 2048, micro_batch=1, overlap=False)  # fmt: skip
    one_nic = links.collective_time("all_gather", 64, 2 * model.params, links.TwoLevel(
        links.NVLINK_A100, links.IB_200G, 1))  # fmt: skip
    assert row["exposed_comm_s"]["param_gather"] < one_nic / 4


# ---------------------------------------------------------------- gradient accumulation over micro-batches
# (issue 57, item 1: ZeRO-2 and FSDP without reshard had been priced ZeRO-1's one reduce-scatter per
# step with ZeRO-2's sharded gradients.) pp_lab's 70B on 2,048 GPUs, at its verdict's degrees.
SEVENTY = cm.Transformer("70B", 80, 8192, 64, 28672, 32000, kv_heads=8, gated=True)
VERDICT_70B = {"dp": 256, "tp": 4, "pp": 2, "v": 8, "recompute": "none"}


def _seventy(micro_batch: int = 2, **layout) -> dict:
    return cm.layout_step(SEVENTY, {**VERDICT_70B, **layout}, P.META_H100, seq_len=4096,
                          global_batch_tokens=4 * 2**20, micro_batch=micro_batch)  # fmt: skip


SHARDED = [{"zero": 2}, {"zero": 3, "reshard": False}, {"zero": 3, "reshard": True}]


@pytest.mark.parametrize("sharded", SHARDED[:2], ids=["zero2", "fsdp"])
def test_sharded_gradients_pay_for_accumulation_in_time_or_in_memory(sharded):
    zero1 = _seventy(zero=1)
    each, hold = (_seventy(**sharded, accumulate=a) for a in ("reduce_each", "hold"))
    m = zero1["m"]
    assert m == 2 and zero1["memory_bytes"]["gradients"] == 4 * SEVENTY.params / 8  # fp32, unsharded
    # reduce-scatter each micro-batch: m of them, more exposed time than ZeRO-1's one; sharded gradients
    assert each["dp_bytes"]["reduce_scatter"] == pytest.approx(m * zero1["dp_bytes"]["reduce_scatter"])
    assert each["exposed_comm_s"]["grad_reduce"] > zero1["exposed_comm_s"]["grad_reduce"] * (1 + 1e-6)
    assert each["memory_bytes"]["gradients"] == pytest.approx(zero1["memory_bytes"]["gradients"] / 256)
    # hold them to the last micro-batch: ZeRO-1's one reduce-scatter, and its unsharded fp32 gradients
    assert hold["dp_bytes"]["reduce_scatter"] == pytest.approx(zero1["dp_bytes"]["reduce_scatter"])
    assert hold["exposed_comm_s"]["grad_reduce"] == pytest.approx(zero1["exposed_comm_s"]["grad_reduce"])
    assert hold["memory_bytes"]["gradients"] == zero1["memory_bytes"]["gradients"]
    # no layout has ZeRO-1's reduce-scatter time and ZeRO-2's gradient memory at once
    for row in (each, hold, _seventy(**sharded)):  # the stage's default too
        cheap = row["exposed_comm_s"]["grad_reduce"] <= zero1["exposed_comm_s"]["grad_reduce"] * (1 + 1e-6)
        unsharded = row["memory_bytes"]["gradients"] >= zero1["memory_bytes"]["gradients"]
        assert not cheap or unsharded, row["layout"]


def test_fsdp_with_reshard_pays_for_accumulation_too():
    # its backwards already gather every layer again; reducing each micro-batch adds m reduce-scatters
    # to those windows, holding keeps ZeRO-1's unsharded fp32 gradients
    zero1 = _seventy(zero=1)
    each, hold = (_seventy(zero=3, reshard=True, accumulate=a) for a in ("reduce_each", "hold"))
    assert each["dp_bytes"]["reduce_scatter"] == pytest.approx(2 * hold["dp_bytes"]["reduce_scatter"])
    assert each["dp_bytes"]["all_gather"] == hold["dp_bytes"]["all_gather"]
    assert each["exposed_comm_s"]["grad_reduce"] > hold["exposed_comm_s"]["grad_reduce"] * (1 + 1e-6)
    assert each["step_s"] > hold["step_s"]
    assert hold["memory_bytes"]["gradients"] == zero1["memory_bytes"]["gradients"]
    assert each["memory_bytes"]["gradients"] == pytest.approx(zero1["memory_bytes"]["gradients"] / 256)


def test_zero2_holding_is_zero1_and_pp_labs_70b_verdict_pays_for_its_sharded_gradients():
    zero1, held = _seventy(zero=1), _seventy(zero=2, accumulate="hold")
    for key in ("step_s", "memory_total", "dp_bytes", "exposed_comm_s", "memory_bytes"):
        assert held[key] == pytest.approx(zero1[key], rel=1e-12), key
    each = _seventy(zero=2)  # DeepSpeed's ZeRO-2: the default, reduce-scatter each micro-batch
    assert each["layout"]["accumulate"] == "reduce_each" and each["fits"] and not zero1["fits"]
    assert each["step_s"] > zero1["step_s"]  # the second reduce-scatter's exposed part


@pytest.mark.parametrize("sharded", SHARDED, ids=["zero2", "fsdp", "fsdp-reshard"])
def test_at_one_micro_batch_holding_and_reducing_each_are_the_same(sharded):
    each, hold = (_seventy(micro_batch=4, **sharded, accumulate=a) for a in ("reduce_each", "hold"))
    assert each["m"] == 1
    for key in ("step_s", "memory_total", "memory_bytes", "dp_bytes", "exposed_comm_s"):
        assert each[key] == hold[key], key


def test_each_stage_accumulates_as_its_framework_by_default():
    norm = cm.layout.normalise
    assert norm({"zero": 0})["accumulate"] == norm({"zero": 1, "pp": 4})["accumulate"] == "hold"
    assert norm({"zero": 2})["accumulate"] == norm({"zero": 2, "pp": 4})["accumulate"] == "reduce_each"
    assert norm({"zero": 3, "pp": 4, "reshard": False})["accumulate"] == "hold"  # pipelining, Llama 3
    assert norm({"zero": 3, "pp": 4})["accumulate"] == "hold"
    flat = (norm({"zero": 3}), norm({"zero": 3, "reshard": False}))  # no pipeline: FSDP's default sync
    assert flat[0]["accumulate"] == flat[1]["accumulate"] == "reduce_each"
    # Llama 3's calibration row holds its stage's fp32 gradients (12.6 GB) and still fits 80 GB
    row = LLAMA.step()
    piece = P.LLAMA3_405B.params / (8 * 16)
    assert row["layout"]["accumulate"] == "hold" and row["m"] == 32 and row["fits"]
    assert row["memory_bytes"]["gradients"] == pytest.approx(4 * piece)


def test_search_prices_both_accumulations_where_they_differ():
    space = {"tp": (1,), "cp": (1,), "v": (1,), "pp": (1, 2), "recompute": ("none",), "micro_batch": (1, 8)}
    rows = cm.search(SMALL, 8, P.META_H100, seq_len=4096, global_batch_tokens=64 * 4096, space=space)
    seen = {(r["layout"]["zero"], r["layout"]["accumulate"], r["m"] > 1) for r in rows}
    assert {(3, "reduce_each", True), (3, "hold", True), (2, "reduce_each", True)} <= seen
    assert (2, "hold", True) not in seen  # ZeRO-2 holding is ZeRO-1, searched as zero 1
    assert not {(z, "hold", False) for z in (2, 3)} & seen  # m = 1: one layout, priced once
    alone = cm.search(SMALL, 8, P.META_H100, seq_len=4096, global_batch_tokens=64 * 4096,
                      space=space | {"zero": (2,)})  # fmt: skip
    assert {r["layout"]["accumulate"] for r in alone if r["m"] > 1} == {"reduce_each", "hold"}


# ---------------------------------------------------------------- argument checks
@pytest.mark.parametrize(
    "call, error, named",
    [
        (lambda: _step(zeros=1), ValueError, "unknown layout keys"),
        (
            lambda: cm.layout_step(P.LLAMA3_405B, LLAMA.layout, P.META_H100, **KW, overlapp=True),
            TypeError,
            "overlapp",
        ),
        (lambda: _step(recompute="some"), ValueError, "recompute"),
        (lambda: _step(recompute=1.5), ValueError, "recompute"),
        (lambda: _step(reduce_dtype="fp8"), ValueError, "reduce_dtype"),
        (lambda: _step(accumulate="sometimes"), ValueError, "accumulate"),
        (lambda: _step(zero=1, accumulate="reduce_each"), ValueError, "sharded gradients"),
        (lambda: _step(zero=4), ValueError, "stage"),
        (lambda: _step(zero=3, shard=3), ValueError, "shard.*divide"),
        (lambda: _step(zero=0, shard=8), ValueError, "shard.*DDP shards nothing"),
        (lambda: _step(zero=3, shard=0), ValueError, "shard"),
        (lambda: _step(tp=16, dp=32), ValueError, "inside a node"),
        (lambda: _step(v=8, pp=1, dp=1024), ValueError, "chunks|pipeline"),
        (lambda: cm.layout_step(P.LLAMA3_405B, LLAMA.layout, P.SELENE.net, **KW), TypeError, "cluster"),
        (
            lambda: cm.search(
                P.LLAMA3_405B, 64, P.META_H100, seq_len=8192, global_batch_tokens=2**20, space={"tpp": (1,)}
            ),
            ValueError,
            "tpp",
        ),  # fmt: skip
        (
            lambda: cm.search(
                P.LLAMA3_405B, 64, P.META_H100, seq_len=8192, global_batch_tokens=2**20, overlapp=True
            ),
            TypeError,
            "overlapp",
        ),  # fmt: skip
    ],
)
def test_nonsense_is_refused_by_name(call, error, named):
    with pytest.raises(error, match=named):
        call()


# ---------------------------------------------------------------- HSDP: sharded in a node, replicated across
def test_hsdp_shards_in_the_node_and_all_reduces_the_shard_across_nodes():
    # 70B at tp 4: a node holds 2 of each data-parallel group's ranks (stride 4); HSDP shards over them
    fsdp = _seventy(zero=3, reshard=False)
    hsdp = _seventy(zero=3, reshard=False, shard=2)
    group, s = 256, 2
    piece = SEVENTY.params / 8
    assert fsdp["layout"]["shard"] == group and hsdp["layout"]["shard"] == s
    assert hsdp["memory_bytes"]["optimizer"] == pytest.approx(12 * piece / s)
    assert hsdp["memory_bytes"]["parameters"] == pytest.approx(2 * piece / s)
    g = 4 * piece  # fp32 gradients, held to the last micro-batch under the pipeline: one reduction
    assert hsdp["dp_bytes"]["reduce_scatter"] == pytest.approx((s - 1) / s * g)
    assert hsdp["dp_bytes"]["all_reduce"] == pytest.approx(2 * (group // s - 1) / (group // s) * g / s)
    assert hsdp["dp_bytes"]["all_gather"] == pytest.approx((s - 1) / s * 2 * piece)
    assert fsdp["dp_bytes"]["all_reduce"] == 0.0
    # only the replicas' all-reduce leaves the node: the shard (g / s) over its 128 nodes, spread
    # over the node's NICs (each GPU carries 1 / (8 / (4 s)) of it: the ring of its own rail)
    replicas, per_node = group // s, 8 // (4 * s)
    assert hsdp["inter_node_bytes"]["dp"] == pytest.approx(
        2 * (replicas / per_node - 1) / (replicas / per_node) * g / s / per_node
    )
    assert hsdp["dp_collectives"] == fsdp["dp_collectives"] + 1  # the all-reduce beside the reduce-scatter
    assert hsdp["memory_total"] > fsdp["memory_total"]


def test_search_prices_hsdp_only_where_a_node_holds_fewer_than_the_group():
    kw = dict(seq_len=4096, global_batch_tokens=2**19)
    thirteen = cm.Transformer("13B", 40, 5120, 40, 13824, 32000, gated=True)
    rows = cm.search(thirteen, 64, P.META_H100, **kw, space={"zero": (3,), "pp": (1,), "cp": (1,)})
    hsdp = [r for r in rows if r["layout"]["shard"] < r["layout"]["dp"]]
    assert hsdp and all(r["layout"]["shard"] * r["layout"]["tp"] == 8 for r in hsdp)
    only_fsdp = cm.search(
        thirteen, 64, P.META_H100, **kw, space={"zero": (3,), "pp": (1,), "cp": (1,), "shard": ("all",)}
    )
    assert all(r["layout"]["shard"] == r["layout"]["dp"] for r in only_fsdp)
    assert len(only_fsdp) == len(rows) - len(hsdp)
    one_node = cm.search(thirteen, 8, P.META_H100, **kw, space={"zero": (3,), "shard": ("node",)})
    assert not one_node and "HSDP refused" in one_node.why  # nothing to replicate across: said, not dropped


# ---------------------------------------------------------------- zero-bubble schedules, priced by their replay
def test_zero_bubble_schedules_are_priced_by_their_replayed_orders():
    from labkit.strategies.pp import schedule as sched

    kw = dict(seq_len=4096, global_batch_tokens=2**20, micro_batch=1)  # m = 8 at dp 32
    lay = {"dp": 32, "tp": 4, "pp": 4, "zero": 1}
    one, zb = (cm.layout_step(SEVENTY, {**lay, "schedule": s}, P.META_H100, **kw) for s in ("1f1b", "zb-h1"))
    inter, zbv = (
        cm.layout_step(SEVENTY, {**lay, "v": 2, "schedule": s}, P.META_H100, **kw) for s in ("1f1b", "zbv")
    )
    assert one["m"] == 8 and one["bubble"] == pytest.approx(3 / 11)
    assert (
        zb["bubble"]
        == pytest.approx(sched.bubble_fraction(sched.orders("zb-h1", 4, 8)))
        == pytest.approx(1 / 9)
    )
    assert zbv["bubble"] == pytest.approx(sched.bubble_fraction(sched.orders("zbv", 4, 8, 2)))
    assert zb["step_s"] < one["step_s"] and zbv["step_s"] < inter["step_s"]
    # zb-h1 holds what 1F1B holds on the first rank; zbv's V holds less than interleaving's estimate
    assert zb["memory_bytes"]["activations"] == pytest.approx(one["memory_bytes"]["activations"])
    assert zbv["memory_bytes"]["activations"] < inter["memory_bytes"]["activations"]
    for bad, named in (({"schedule": "zb-h1", "v": 2}, "v = 1"), ({"schedule": "zbv"}, "v = 2"),
                       ({"schedule": "zb-h1", "pp": 1, "dp": 128}, "pipeline"), ({"schedule": "zb"}, "one of")):  # fmt: skip
        with pytest.raises(ValueError, match=named):
            cm.layout_step(SEVENTY, {**lay, **bad}, P.META_H100, **kw)
    with pytest.raises(ValueError):  # m = 2 < p = 4: the schedule cannot run
        cm.layout_step(SEVENTY, {**lay, "schedule": "zb-h1"}, P.META_H100, **{**kw, "micro_batch": 4})


def test_search_prices_zero_bubble_schedules_only_when_asked():
    kw = dict(seq_len=4096, global_batch_tokens=2**20)
    space = {"cp": (1,), "tp": (4,), "zero": (1,), "recompute": ("none",), "micro_batch": (1,)}
    plain = cm.search(SEVENTY, 64, P.META_H100, **kw, space=space)
    assert plain and all(r["layout"]["schedule"] == "1f1b" for r in plain)
    both = cm.search(SEVENTY, 64, P.META_H100, **kw, space={**space, "schedule": ("1f1b", "zb-h1", "zbv")})
    zero = [r for r in both if r["layout"]["schedule"] != "1f1b"]
    assert {r["layout"]["schedule"] for r in zero} == {"zb-h1", "zbv"}
    assert all(r["layout"]["v"] == {"zb-h1": 1, "zbv": 2}[r["layout"]["schedule"]] for r in zero)
    assert both[0]["step_s"] <= plain[0]["step_s"]
    with pytest.raises(ValueError, match="schedule"):
        cm.search(SEVENTY, 64, P.META_H100, **kw, space={"schedule": ("zb",)})


# ---------------------------------------------------------------- what cannot run (issue: the cost model priced it)
SMALL = cm.Transformer("small", 4, 1024, 8, 4096, 1000)


def _gqa(kv_heads: int, heads: int = 32) -> cm.Transformer:
    return cm.Transformer("gqa", 8, 4096, heads, 11008, 32000, kv_heads=kv_heads, gated=True)


@contextlib.contextmanager
def _cpu_seconds(limit: float):
    """The block must finish within `limit` seconds of this process's CPU time (time.process_time,
    so a busy machine does not fail it); where SIGPROF exists, a block past it is stopped there
    (TimeoutError) rather than left to hang."""
    timer = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()

    def over(signum, frame):
        raise TimeoutError(f"more than {limit} s of CPU time")

    if timer:
        previous = signal.signal(signal.SIGPROF, over)
        signal.setitimer(signal.ITIMER_PROF, limit)
    start = time.process_time()
    try:
        yield
    finally:
        if timer:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(signal.SIGPROF, previous)
    assert time.process_time() - start < limit


def test_cp_must_cut_the_sequence_into_2_cp_equal_chunks():
    # the model prices every CP rank the same attention work: Llama 3's load-balanced CP (and
    # labkit.strategies.cp's zigzag), 2 cp chunks, rank r holding r and 2 cp - 1 - r
    for cp, seq in ((3, 4096), (8, 4), (2, 6)):  # 3 does not divide 4,096; 8 > 4; 4 chunks of 6
        with pytest.raises(ValueError, match=rf"cp \({cp}\).*seq_len \({seq}\)"):
            cm.layout_step(
                SMALL, {"cp": cp}, P.META_H100, seq_len=seq, global_batch_tokens=seq, micro_batch=1
            )
    row = cm.layout_step(SMALL, {"cp": 2}, P.META_H100, seq_len=8, global_batch_tokens=8, micro_batch=1)
    assert row["n_gpus"] == 2  # 4 chunks of 2 tokens: priced
    rows = cm.search(SMALL, 3, P.META_H100, seq_len=4096, global_batch_tokens=4096, space={"cp": (3,)})
    assert not rows and "seq_len not cut into 2 x cp equal chunks" in rows.why


def test_transformer_refuses_kv_heads_above_or_not_dividing_the_heads():
    for heads, kv in ((4, 8), (12, 8), (6, 4)):
        with pytest.raises(ValueError, match=rf"kv_heads \({kv}\).*heads \({heads}\)"):
            cm.Transformer("gqa", 2, 1536, heads, 4096, 1000, kv_heads=kv)
    assert cm.Transformer("gqa", 2, 1536, 12, 4096, 1000, kv_heads=4).kv == 4
    assert cm.Transformer("mha", 2, 1536, 12, 4096, 1000).kv == 12


def test_tp_beyond_the_kv_heads_prices_a_whole_replicated_kv_head_per_rank():
    # 32 query heads on tp 8: with 2 K/V heads each rank holds one whole (replicated) K/V head, as
    # with 8 K/V heads -- the same parameters, FLOPs, K/V all-gather and memory per rank
    kw = dict(seq_len=4096, global_batch_tokens=64 * 4096, micro_batch=1)
    layout = {"dp": 4, "tp": 8, "cp": 2, "zero": 1}
    two, eight = (cm.layout_step(_gqa(kv), layout, P.META_H100, **kw) for kv in (2, 8))
    assert two["step_s"] == pytest.approx(eight["step_s"], rel=1e-12)
    assert two["compute_s"] == pytest.approx(eight["compute_s"], rel=1e-12)
    assert two["exposed_comm_s"] == pytest.approx(eight["exposed_comm_s"], rel=1e-12)
    assert two["memory_bytes"] == pytest.approx(eight["memory_bytes"], rel=1e-12)
    assert two["hw_tflops_per_gpu"] == pytest.approx(eight["hw_tflops_per_gpu"], rel=1e-12)
    assert two["tflops_per_gpu"] < eight["tflops_per_gpu"]  # the copies are no model FLOPs
    m = _gqa(2)  # bf16 parameters per rank: 1/8 of the model and 3/4 of a K/V head's K and V more
    kv_head = 2 * m.d * (m.d // m.heads)
    expected = m.params / 8 + m.layers * kv_head * (1 - 2 / 8)
    assert two["memory_bytes"]["parameters"] == pytest.approx(2 * expected, rel=1e-12)
    # at or below the K/V heads nothing changes: a 1/tp share of every matrix
    row = cm.layout_step(m, {"dp": 32, "tp": 2}, P.META_H100, **kw)
    assert row["memory_bytes"]["parameters"] == pytest.approx(2 * m.params / 2, rel=1e-12)
    # tp must divide the heads, and tp and the K/V heads one another (4 ranks would cut one of 6)
    with pytest.raises(ValueError, match=r"tp \(4\) and the key/value heads \(6\)"):
        cm.layout_step(_gqa(6, heads=24), {"dp": 16, "tp": 4}, P.META_H100, **kw)
    with pytest.raises(ValueError, match=r"tp \(8\) must divide the heads \(12\)"):
        cm.layout_step(_gqa(4, heads=12), {"dp": 8, "tp": 8}, P.META_H100, **kw)
    rows = cm.search(
        _gqa(6, heads=24), 16, P.META_H100, seq_len=4096, global_batch_tokens=64 * 4096, space={"tp": (4,)}
    )
    assert not rows and "tp and the key/value heads not dividing one another" in rows.why


def test_divisors_come_from_the_prime_factorisation_at_any_size():
    for k in range(1, 1500):
        assert _divisors(k) == [d for d in range(1, k + 1) if k % d == 0], k
    with _cpu_seconds(2.0):
        billion = _divisors(10**9)
        composite = _divisors(963761198400)  # highly composite: 6,720 divisors
        prime = _divisors(2**61 - 1)
        semiprime = _divisors((2**31 - 1) * (2**61 - 1))
        square = _divisors(1000003**2)
    assert len(billion) == 100 and billion == sorted(billion) and all(10**9 % d == 0 for d in billion)
    assert len(composite) == 6720 and all(963761198400 % d == 0 for d in composite)
    assert prime == [1, 2**61 - 1]
    assert semiprime == [1, 2**31 - 1, 2**61 - 1, (2**31 - 1) * (2**61 - 1)]
    assert square == [1, 1000003, 1000003**2]


@pytest.mark.parametrize("n_gpus", [10**9, 735134400])  # a billion; highly composite (1,344 divisors)
def test_search_over_a_billion_gpus_answers_within_two_cpu_seconds(n_gpus):
    with _cpu_seconds(2.0):
        rows = cm.search(P.LLAMA3_405B, n_gpus, P.META_H100, seq_len=8192, global_batch_tokens=16 * 2**20)
    assert not rows and "2048 sequences per step not dp x micro_batch" in rows.why


@pytest.mark.parametrize(
    "space, error, named",
    [
        ({"micro_batch": (0,)}, ValueError, r"space\['micro_batch'\] entry must be an integer >= 1"),
        ({"tp": (0,)}, ValueError, r"space\['tp'\]"),
        ({"cp": (-2,)}, ValueError, r"space\['cp'\]"),
        ({"pp": (2.5,)}, TypeError, r"space\['pp'\]"),
        ({"v": (True,)}, TypeError, r"space\['v'\]"),
        ({"zero": (5,)}, ValueError, r"space\['zero'\]"),
        ({"reshard": ("yes",)}, TypeError, r"space\['reshard'\]"),
        ({"recompute": ("some",)}, ValueError, r"space\['recompute'\]"),
        ({"recompute": "full"}, TypeError, r"space\['recompute'\] is a collection"),
        ({"reduce_dtype": ("fp8",)}, ValueError, r"space\['reduce_dtype'\]"),
        ({"accumulate": ("both",)}, ValueError, r"space\['accumulate'\]"),
        ({"tp": ()}, ValueError, r"space\['tp'\] is empty"),
    ],
)
def test_search_checks_every_space_entry(space, error, named):
    with pytest.raises(error, match=named):
        cm.search(SMALL, 8, P.META_H100, seq_len=4096, global_batch_tokens=64 * 4096, space=space)


def test_an_empty_search_says_why_counting_each_refusal():
    kw = dict(seq_len=8192, global_batch_tokens=2**20)
    rows = cm.search(
        P.LLAMA3_405B, 8, P.META_H100, **kw, space={"cp": (1, 16), "v": (1,), "micro_batch": (1,)}
    )
    # 10 (tp, pp) x 4 recomputations x 7 ways to hold the data-parallel state: DDP, ZeRO-1, ZeRO-2
    # (reducing each micro-batch: holding is ZeRO-1), FSDP with or without reshard, each holding or not
    assert rows == [] and rows.refused == {
        "layouts exceed HBM": 280,
        "(tp, cp) pairs refused: tp x cp not dividing 8 GPUs": 4,
    }
    assert re.fullmatch(
        r"no layout of 8 GPUs fits: 280 layouts exceed HBM \(the least needs [\d.]+ GB of 80\.0 GB\); "
        r"4 \(tp, cp\) pairs refused: tp x cp not dividing 8 GPUs",
        rows.why,
    ), rows.why
    with pytest.raises(IndexError, match="280 layouts exceed HBM"):
        rows[0]
    rows = cm.search(
        SMALL, 8, P.META_H100, seq_len=4096, global_batch_tokens=64 * 4096, allowed=lambda r: False
    )
    assert not rows and re.search(r"\d+ layouts refused by allowed", rows.why)
    # a search that finds layouts answers them, fastest first, and keeps its counts
    rows = cm.search(SMALL, 8, P.META_H100, seq_len=4096, global_batch_tokens=64 * 4096, top=3)
    assert len(rows) == 3 and rows.why == "" and rows.refused
