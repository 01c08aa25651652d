# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python (labkit course)
#     language: python
#     name: labkit
# ---

# %% [markdown]
# # 02 · ZeRO-1 and ZeRO-2 by hand
#
# In data parallelism every rank holds the same weights, the same gradients and the same Adam
# state. ZeRO keeps the first two for compute but **shards the optimizer state** (stage 1) and
# then **the gradients** (stage 2) across the N ranks. You will build both on real
# `torch.distributed` ranks and measure, not claim, what they save.
#
# The lab's model is a TinyGPT of 4 layers, width 128, on the course corpus; every rank trains
# on its slice of the same global batch (as in the DDP lab).

# %%
import torch
import matplotlib.pyplot as plt

import labkit
import labkit.exercise
from labkit import loop
from labkit.checks import assert_match, compare
from labkit.units import fmt_bytes
from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter, shard_range
from labkit.models import num_params
from labkit.labs.zero_lab import wire_bytes

# %%
CFG = loop.PRESETS["zero"]   # the lab's model, 8 rows, seed and AdamW: every run below
model = loop.build_model(CFG)
P, N = num_params(model), 2
print(f"lab model: {P:,} parameters, {fmt_bytes(4 * P)} of fp32 weights; N = {N} ranks")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## 1. Where the memory goes
#
# Claim: with fp32 AdamW every DDP rank holds 4P bytes of weights, 4P of gradients and 8P of
# Adam state (m and v). Measure it: two DDP steps on 2 ranks with the memory tracker on.

# %%
ddp = labkit.run(loop.train, "ddp-bucketed", CFG, 2, track_memory=True, world_size=N)
print(ddp.memory[0].table())


def after_step(result):
    """Bytes by category at the memory tracker's last sample: after the last step."""
    return result["memory"].samples[-1].by_category

# %% [markdown]
# The formulas (labkit.costmodel.memory_per_rank) against the bytes measured after the last step.
# The optimizer also holds one 4-byte `step` counter per tensor: within 1%.

# %%
from labkit.costmodel import ZERO_TABLE_GB, memory_per_rank, paper_table
from labkit.labs.memory_widget import draw_memory_bars, memory_calculator

theory_ddp = memory_per_rank(P, N, 0, precision="fp32")
for category in ("parameters", "gradients", "optimizer"):
    assert_match(f"DDP {category}", theory_ddp[category], after_step(ddp[0])[category])

# %% [markdown]
# ZeRO's formulas, per rank, with mixed precision (bf16 weights and gradients, K = 12 bytes of
# fp32 master weights + Adam m, v per parameter):
#
# | stage | shards | bytes per rank |
# |---|---|---|
# | DDP | nothing | (2 + 2 + K) P = 16P |
# | ZeRO-1 | optimizer state | 4P + 12P/N |
# | ZeRO-2 | + gradients | 2P + 14P/N |
# | ZeRO-3 (FSDP) | + weights | 16P/N |
#
# This lab runs fp32: weights 4P, gradients 4P, Adam 8P, so ZeRO-1 is 8P + 8P/N and ZeRO-2 is
# 4P + 12P/N. The ZeRO paper's example: 7.5 B parameters on N = 64 GPUs.

# %%
table = paper_table(params=7.5e9, n=64)
print("GB per rank by stage:", table)  # NBVAL_CHECK_OUTPUT


def check_paper_table():
    assert table == ZERO_TABLE_GB, f"expected the paper's {ZERO_TABLE_GB} GB, got {table}"


labkit.exercise.check("ZeRO paper's table", check_paper_table)

# %% [markdown]
# The calculator: move the sliders (parameter count, N, stage, precision, activations). Under
# CI it draws once, with the paper's numbers.

# %%
memory_calculator(params=7.5e9, n=64, stage=1, precision="mixed");

# %% [markdown]
# The same formulas for the lab's own model, with the DDP bars you just measured beside them.

# %%
measured_ddp = {"DDP measured (rank 0)": after_step(ddp[0])}
memory_calculator(params=P, n=N, stage=0, precision="fp32", measured=measured_ddp);

# %% [markdown]
# **Summary.** Adam's state is half of DDP's model state in fp32 (8 of 16 bytes per parameter)
# and 12 of 16 with mixed precision; nothing about it needs to be replicated.
#
# **Questions.** (a) The measured "other" holds about 4P: what is it in the hand-written DDP?
# (b) At which N does ZeRO-2 need less than a quarter of DDP's model state (mixed precision)?

# %% [markdown]
# ## 2. Partitioning: one flat buffer, N equal chunks
#
# Lay the trainable parameters end to end in one flat buffer of `numel` elements, pad it to a
# multiple of N, and give rank k the k-th of N equal chunks. Equal chunks are what
# reduce-scatter and all-gather need. **Exercise:** return `(start, end, padded_numel)`: the
# real elements `[start, end)` rank `rank` owns (padding excluded) and the padded size.

# %% nbgrader={"grade": false, "grade_id": "shard-range", "locked": false, "schema_version": 3, "solution": true}
def my_shard_range(numel, rank, world_size):
    ### BEGIN SOLUTION
    chunk = -(-numel // world_size)          # ceil(numel / world_size)
    start = min(rank * chunk, numel)
    return start, min(start + chunk, numel), chunk * world_size
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "shard-range-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
from labkit.labs.zero_checks import check_shard_range, check_zero_step

labkit.exercise.check("shard range", lambda: check_shard_range(my_shard_range))

# %%
shard_range_impl = labkit.exercise.pick("shard range", my_shard_range, shard_range)

# %% [markdown]
# On the lab's model: every rank's range, and the padding, which is less than N elements
# (805,248 splits evenly over 2 ranks, not over 5).

# %%
from labkit.strategies.zero import FlatPartition, per_tensor_partition

for n in (2, 5):
    for rank in range(n):
        start, end, padded = shard_range_impl(P, rank, n)
        print(f"N={n} rank {rank}: [{start:,}, {end:,}), padding {padded // n - (end - start)}")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# The alternative, per-tensor (owner-rank) partitioning, gives each whole tensor to one rank, as
# torch's `ZeroRedundancyOptimizer` does (largest first, to the least loaded rank). Whole
# tensors cannot split evenly. Predicted Adam bytes per rank for both:

# %%
numels = [p.numel() for p in model.parameters() if p.requires_grad]
for n in (2, 4, 8):
    load = per_tensor_partition(numels, n)
    print(f"N={n}: per-tensor max/mean = {max(load) / (sum(load) / n):.3f}, "
          f"flat max/mean = {FlatPartition(model.parameters(), n).chunk * n / sum(numels):.5f}")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# Measured at N = 8, without launching ranks: give each of 8 AdamW optimizers the tensors that
# one owner rank would get, take one step, and count the bytes of their real state tensors.

# %%
import copy
from labkit.models import make_optimizer
from labkit.strategies.zero import per_tensor_owners


def adam_state_bytes(params):
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = make_optimizer(params)
    optimizer.step()
    return sum(t.nbytes for state in optimizer.state.values() for t in state.values())


params = [p for p in copy.deepcopy(model).parameters() if p.requires_grad]
owned_bytes = [adam_state_bytes([params[i] for i in owned]) for owned in per_tensor_owners(numels, 8)]
print("per-tensor Adam bytes per rank:", owned_bytes)  # NBVAL_CHECK_OUTPUT
print(f"max / mean = {max(owned_bytes) / (sum(owned_bytes) / 8):.3f}; flat: {8 * FlatPartition(params, 8).chunk:,} B on every rank")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# And on real ranks: torch's ZeroRedundancyOptimizer, 2 ranks, five steps (section 3 reuses this
# run). Its Adam bytes per rank are 8 per owned element plus the 4-byte step counters, as the
# owner-rank split predicts (at N = 2 it happens to balance).

# %%
torch_zero = labkit.run(loop.train, "torch-zero1", CFG, 5, track_memory=True, world_size=N)
load = per_tensor_partition(numels, N)
for rank in range(N):
    assert_match(f"ZeroRedundancyOptimizer rank {rank} Adam bytes", 8 * load[rank],
                 after_step(torch_zero[rank])["optimizer"])

# %% [markdown]
# **Summary.** A flat, padded, dim-0 partition balances to the element; owner-rank partitioning
# is simpler (no tensor is cut) but the most loaded rank sets the memory. **Question:** which
# tensor of TinyGPT makes the per-tensor split worst at N = 8?

# %% [markdown]
# ## 3. The ZeRO-1 step
#
# `ZeRO1(model)` (labkit.strategies.zero) makes every parameter a view of `zero.flat_param`
# and every gradient a view of `zero.flat_grad` (both padded). Adam's state exists only for
# this rank's chunk. **Exercise:** write the step:
# 1. reduce-scatter `zero.flat_grad` with **AVG** into `zero.grad_shard` (this rank's chunk of
#    `flat_grad`: `zero.flat_grad[zero.partition.chunk_slice(zero.rank)]`);
# 2. `zero.local_step()`: AdamW on this rank's chunk only (it reads `zero.grad_shard`);
# 3. all-gather every rank's `zero.param_shard` back into `zero.flat_param`.

# %% nbgrader={"grade": false, "grade_id": "zero1-step", "locked": false, "schema_version": 3, "solution": true}
def my_zero1_step(zero):
    ### BEGIN SOLUTION
    zero.grad_shard = zero.flat_grad[zero.partition.chunk_slice(zero.rank)]
    ring_reduce_scatter(zero.grad_shard, zero.flat_grad, op="avg")
    zero.local_step()
    ring_all_gather(zero.flat_param, zero.param_shard)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "zero1-step-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
labkit.exercise.check("ZeRO-1 step", lambda: check_zero_step(my_zero1_step, world_size=N, stage=1))

# %%
zero1_step = labkit.exercise.pick("ZeRO-1 step", my_zero1_step, None)

# %% [markdown]
# Five steps on the lab's model with your step (it averages: `reduce_op="avg"` tells the loop,
# which then makes each rank's loss its own mean), against single-process training on the whole
# batch. Averaging per-rank means adds in another order than one whole-batch mean, so expect
# agreement to the last bits, not bit-equality. One place amplifies those bits: the attention's
# key bias has a gradient of exactly zero in exact arithmetic (softmax ignores a constant shift),
# so what it gets is rounding noise, which AdamW's eps (1e-6, `loop.EPS`) damps to ~1e-7.
# Hence rtol 1e-5, atol 1e-6.

# %%
zero1 = labkit.run(loop.train, "zero1", CFG, 5, track_memory=True, world_size=N,
                   step_fn=zero1_step, reduce_op="avg")
single = loop.reference(CFG, 5)
report = compare(single["state"], zero1[0]["state"], rtol=1e-5, atol=1e-6)
print(report.summary())  # NBVAL_CHECK_OUTPUT
report.raise_if_failed()

# %% [markdown]
# Against torch's `ZeroRedundancyOptimizer` (with torch's DDP averaging the gradients) on the
# same run: with 2 ranks a + b has only one order, so they agree to the bit.

# %%
report = compare(torch_zero[0]["state"], zero1[0]["state"], rtol=0, atol=0)
print(report.summary())  # NBVAL_CHECK_OUTPUT
report.raise_if_failed()
print("every rank holds the same weights:",
      all(compare(zero1[0]["state"], r["state"], rtol=0, atol=0).ok for r in zero1))  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# **Summary.** RS(AVG) → AdamW on 1/N → AG computes exactly what DDP computes: each element's
# update depends only on that element's gradient and state. **Questions.** (a) With Adam, SUM
# instead of AVG changes the weights only slightly: why? (Which check caught it?) (b) What goes
# wrong if a rank skips the all-gather?

# %% [markdown]
# ## 4. ZeRO-2: keep only the gradient shard
#
# After the reduce-scatter a rank needs only its chunk of the gradient. **Exercise:** the step
# again, but reduce-scatter into a fresh `zero.grad_shard` of `zero.partition.chunk` elements,
# then drop the full gradient (`p.grad = None` for every `p` in `zero.partition.params`, and
# `zero.flat_grad = None`; `zero.zero_grad()` makes a new one before the next backward).

# %% nbgrader={"grade": false, "grade_id": "zero2-step", "locked": false, "schema_version": 3, "solution": true}
def my_zero2_step(zero):
    ### BEGIN SOLUTION
    zero.grad_shard = torch.empty(zero.partition.chunk)
    ring_reduce_scatter(zero.grad_shard, zero.flat_grad, op="avg")
    for p in zero.partition.params:
        p.grad = None
    zero.flat_grad = None
    zero.local_step()
    ring_all_gather(zero.flat_param, zero.param_shard)
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "zero2-step-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
labkit.exercise.check("ZeRO-2 step", lambda: check_zero_step(my_zero2_step, world_size=N, stage=2))

# %%
zero2_step = labkit.exercise.pick("ZeRO-2 step", my_zero2_step, None)
zero2 = labkit.run(loop.train, "zero2", CFG, 2, track_memory=True, world_size=N,
                   step_fn=zero2_step, reduce_op="avg")

# %% [markdown]
# Claim: the gradient bytes alive after the step drop to one chunk, 1/N of DDP's (plus padding).

# %%
for rank in range(N):
    assert_match(f"rank {rank} gradient bytes, ZeRO-2 vs DDP / N", after_step(ddp[rank])["gradients"] / N,
                 after_step(zero2[rank])["gradients"])

# %% [markdown]
# **Summary.** ZeRO-2 is ZeRO-1 plus freeing; same math, same communication. What it leaves out:
# real ZeRO-2 reduce-scatters buckets *during* backward, so the full gradient never exists; ours
# lowers the steady state, not the end-of-backward peak. **Question:** how would you reduce
# during backward (hint: the DDP lab's bucket hooks)?

# %% [markdown]
# ## 5. Measured, not claimed
#
# Per-rank Adam state: 1/N of DDP's, within 1% plus the padding.

# %%
for rank in range(N):
    assert_match(f"rank {rank} optimizer bytes, ZeRO-1 vs DDP / N", after_step(ddp[rank])["optimizer"] / N,
                 after_step(zero1[rank])["optimizer"])

# %% [markdown]
# Communication per step, from the tracer: a ring all-reduce of S bytes sends 2(N-1)/N·S per
# rank; a reduce-scatter plus an all-gather send (N-1)/N·S each: the same bytes.
# (DDP's 56 broadcasts are its start-up weight sync, before the first step: not counted.)

# %%
from labkit.observe.trace_stats import collective_counts, steps

print("DDP   :", collective_counts(ddp.traces[0]))  # NBVAL_CHECK_OUTPUT
print("ZeRO-1:", collective_counts(zero1.traces[0]))  # NBVAL_CHECK_OUTPUT
per_step = {name: wire_bytes(r.traces[0]) / len(steps(r.traces[0]))
            for name, r in (("DDP", ddp), ("ZeRO-1", zero1), ("ZeRO-2", zero2))}
assert_match("bytes sent per rank per step, ZeRO-1 vs DDP", per_step["DDP"], per_step["ZeRO-1"])
assert_match("bytes sent per rank per step, ZeRO-2 vs DDP", per_step["DDP"], per_step["ZeRO-2"])

# %% [markdown]
# The timeline of the last ZeRO-1 step: reduce-scatter → optimizer step on the shard → all-gather.

# %%
from labkit.observe.timeline import plot_timeline

offset_ms = (zero1.traces[0]["t0"] - min(t["t0"] for t in zero1.traces)) * 1e3
last_start, last_end = steps(zero1.traces[0])[-1]
plot_timeline(zero1.traces, title="ZeRO-1, last step", t_range=(last_start * 1e3 + offset_ms, last_end * 1e3 + offset_ms));

# %%
def phase_order(trace):
    lo, hi = steps(trace)[-1]
    events = [(ev["start"], ev["op"]) for ev in trace["events"] if lo <= ev["start"] <= hi]
    events += [(sp["start"], sp["name"]) for sp in trace["spans"] if sp["name"] == "optimizer step" and lo <= sp["start"] <= hi]
    return [name for _, name in sorted(events)]


print(phase_order(zero1.traces[0]))  # NBVAL_CHECK_OUTPUT
assert phase_order(zero1.traces[0]) == ["ring_reduce_scatter", "optimizer step", "ring_all_gather"]

# %% [markdown]
# Peak memory per rank, measured, next to the fp32 formulas for the lab's model.

# %%
from labkit.observe.memory_plot import plot_memory_bars

plot_memory_bars({"DDP": ddp.memory, "ZeRO-1": zero1.memory, "ZeRO-2": zero2.memory});

# %%
after = {"ZeRO-1 measured": after_step(zero1[0]), "ZeRO-2 measured": after_step(zero2[0])}
draw_memory_bars(P, N, stage=1, precision="fp32", measured=after);

# %% [markdown]
# **Try it on real ranks.** Pick N and a stage; the control re-runs two steps and redraws the
# memory timeline (under CI it runs once: N = 2, ZeRO-1).

# %%
from labkit.observe.memory_plot import plot_memory_timeline
from labkit.labs.memory_widget import experiment_control


def run_and_plot(world_size, stage):
    name = {0: "ddp-bucketed", 1: "zero1", 2: "zero2"}[stage]
    results = labkit.run(loop.train, name, CFG, 2, track_memory=True, world_size=world_size)
    theory = memory_per_rank(P, world_size, stage, precision="fp32")
    plot_memory_timeline(results.memory[:2], theory={"params + grads + Adam (theory)": int(
        theory["parameters"] + theory["gradients"] + theory["optimizer"])})


experiment_control(run_and_plot, world_sizes=(2, 4), stages=(0, 1, 2), default=(2, 1))

# %% [markdown]
# **Summary.** Sharding the optimizer state cost no extra communication: the all-reduce was
# always a reduce-scatter plus an all-gather, and ZeRO puts the optimizer step between them.
# **Question:** in the peak bars, what else than model state sets the peak, and does ZeRO shrink it?

# %% [markdown]
# ## 6. Exercises with numbers
#
# A model has 12 GB of weights, 12 GB of gradients and 72 GB of optimizer state, over 8 ranks.
# (a) Per-rank steady state for ZeRO-1, ZeRO-2 and ZeRO-3. (b) ZeRO-3's peak lower bound when the
# largest unsharded layer group is 3 GB and the prefetch buffer for the next one is 3 GB.

# %% nbgrader={"grade": false, "grade_id": "memory-answers", "locked": false, "schema_version": 3, "solution": true}
def my_memory_answers():
    ### BEGIN SOLUTION
    weights, grads, optim, n = 12, 12, 72, 8
    return {"zero1": weights + grads + optim / n, "zero2": weights + (grads + optim) / n,
            "zero3": (weights + grads + optim) / n, "zero3_peak": (weights + grads + optim) / n + 3 + 3}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "memory-answers-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
def check_memory_answers():
    got = my_memory_answers()
    hints = {"zero1": "ZeRO-1 shards only the optimizer state: weights and gradients stay whole",
             "zero2": "ZeRO-2 shards gradients and optimizer state, not the weights",
             "zero3": "ZeRO-3 shards all three",
             "zero3_peak": "steady state + the gathered group + the prefetched one"}
    for key, want in {"zero1": 33.0, "zero2": 22.5, "zero3": 12.0, "zero3_peak": 18.0}.items():
        assert abs(got[key] - want) < 1e-6, f"{key}: got {got[key]} GB; hint: {hints[key]}"


labkit.exercise.check("memory arithmetic", check_memory_answers)

# %% [markdown]
# (c) Rank 0 holds g0 = [1, 2, 3, 4] and rank 1 holds g1 = [10, 20, 30, 40]. What does each rank
# hold after a reduce-scatter with SUM, and with AVG? The check runs it on real ranks.

# %% nbgrader={"grade": false, "grade_id": "reduce-scatter-answers", "locked": false, "schema_version": 3, "solution": true}
def my_reduce_scatter_answers():
    ### BEGIN SOLUTION
    return {"sum": [[11.0, 22.0], [33.0, 44.0]], "avg": [[5.5, 11.0], [16.5, 22.0]]}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "reduce-scatter-answers-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
def reduce_scatter_on_ranks():
    import torch.distributed as dist
    g = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])[dist.get_rank()]
    out = {}
    for op in ("sum", "avg"):
        shard = torch.empty(2)
        ring_reduce_scatter(shard, g, op=op)
        out[op] = shard.tolist()
    return out


def check_reduce_scatter_answers():
    got, measured = my_reduce_scatter_answers(), labkit.run(reduce_scatter_on_ranks, world_size=2)
    for op in ("sum", "avg"):
        for rank in range(2):
            assert got[op][rank] == measured[rank][op], (
                f"{op}, rank {rank}: you said {got[op][rank]}, the ranks computed {measured[rank][op]}"
                + ("; hint: AVG is the SUM divided by N = 2" if op == "avg" else
                   "; hint: rank k keeps the k-th half, summed over ranks"))


labkit.exercise.check("reduce-scatter by hand", check_reduce_scatter_answers)

# %% [markdown]
# **Wrap-up.** ZeRO-1 and ZeRO-2 shrink model state to 8P + 8P/N and 4P + 12P/N bytes (fp32)
# with DDP's communication volume. Next: ZeRO-3 / FSDP also shards the weights and pays 1.5×
# the communication to gather them layer by layer.
