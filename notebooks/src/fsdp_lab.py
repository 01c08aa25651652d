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
# # 03 · FSDP (ZeRO-3) by hand: unshard, compute, reshard
#
# ZeRO-2 sharded the gradients and the Adam state; every rank still held all the weights.
# FSDP shards **the weights too**: each rank keeps 1/N of every unit's parameters, gradients and
# optimizer state, and a unit's full weights exist only while that unit computes.
# You build it on the course's TinyGPT (2 blocks, tied embedding / LM head) on real gloo ranks,
# and every step ends in a check that can fail.

# %%
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import labkit
import labkit.exercise
from labkit import loop
from labkit.checks import assert_match, check_close, compare
from labkit.units import fmt_bytes
from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter, shard_range
from labkit.observe.memory_plot import plot_memory_timeline
from labkit.models import num_params
from labkit.labs import drills
from labkit.labs.fsdp_lab import peak_formula, unit_sizes
from labkit.strategies.fsdp import collective_counts as fsdp_counts
from labkit.observe.timeline import plot_timeline
from labkit.observe.trace_stats import collective_counts

# %%
CFG = loop.PRESETS["fsdp"]   # the model, batch (8 rows), seed and AdamW of every run below
model = loop.build_model(CFG)
P, N = num_params(model), 2
sizes = unit_sizes(model, "block")
print(f"TinyGPT: {P:,} parameters; units (root, block 0, block 1): {sizes}")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## 1. Shard everything
#
# The worked example: 8 parameters on 2 ranks. Rank 0 holds w0..w3, rank 1 holds w4..w7.
# Before a unit computes, an **all-gather** gives every rank w0..w7; after backward each rank has
# its own full gradient (g0 on rank 0, g1 on rank 1), and a **reduce-scatter** leaves rank 0 with
# the average of g0 and g1 over positions 0..3, rank 1 over 4..7. Real ranks, real collectives:

# %%
def worked_example():
    rank = dist.get_rank()
    shard = torch.arange(4.0) + 4 * rank                      # w0..w3 or w4..w7
    full = torch.empty(8)
    ring_all_gather(full, shard)
    grad = torch.full((8,), 1.0 + rank)                       # g0 = all ones, g1 = all twos
    grad_shard = torch.empty(4)
    ring_reduce_scatter(grad_shard, grad, op="avg")
    return full.tolist(), grad_shard.tolist()


for rank, (full, grad_shard) in enumerate(labkit.run(worked_example, world_size=2)):
    print(f"rank {rank}: gathered {full}, averaged grad shard {grad_shard}")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# Real units have any size: flatten a unit's parameters into one buffer, pad it to a multiple of
# N, and let rank k own chunk k (`shard_range`). **Exercise:** write `unshard` (all-gather the
# padded shards, drop the padding) and `reduce_grad` (pad the full gradient, reduce-scatter with
# AVG) from `ring_all_gather` / `ring_reduce_scatter`.

# %% nbgrader={"grade": false, "grade_id": "unshard-reduce", "locked": false, "schema_version": 3, "solution": true}
def unshard(shard, numel):
    ### BEGIN SOLUTION
    full = torch.empty(shard.numel() * dist.get_world_size())
    ring_all_gather(full, shard)
    return full[:numel]
    ### END SOLUTION


def reduce_grad(flat_grad):
    ### BEGIN SOLUTION
    n = dist.get_world_size()
    _, _, padded = shard_range(flat_grad.numel(), dist.get_rank(), n)
    padded_grad = torch.zeros(padded)
    padded_grad[:flat_grad.numel()] = flat_grad
    out = torch.empty(padded // n)
    ring_reduce_scatter(out, padded_grad, op="avg")
    return out
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "unshard-reduce-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
# 13 elements on 3 ranks (2 of padding); each function is checked on its own input.
from labkit.labs.collective_checks import check_unshard_and_reduce

labkit.exercise.check("unshard / reduce_grad", lambda: check_unshard_and_reduce(unshard, reduce_grad))

# %% [markdown]
# The full lifecycle is in `labkit.strategies.fsdp` (read it: about 300 lines). Per unit:
# pre-forward all-gather → forward → reshard (drop the buffer) → pre-backward all-gather (a hook on
# the unit's output) → backward → reduce-scatter (the backward of a custom autograd.Function,
# called once all of the unit's gradients exist) → AdamW on the shard, with no communication.
# Ops that save a weight for backward save only "unit, offset, shape" (saved_tensors_hooks), so
# dropping the buffer really frees it. One step, per-unit spans drawn:

# %%
one_step = labkit.run(loop.train, "fsdp", CFG, 2, report=fsdp_counts, return_state=False, world_size=N)
last = [s for s in one_step.traces[0]["spans"] if s["name"] == "step"][-1]
plot_timeline(one_step.traces, title="hand-written FSDP, one step (2 ranks)",
              t_range=(last["start"] * 1e3, last["end"] * 1e3), show_inner=True);

# %%
counts = collective_counts(one_step.traces[0])
print({op: count / 2 for op, (count, _) in counts.items()}, "per step on rank 0")
assert_match("all-gathers per step (root once, each block twice)", 1 + 2 * 2, one_step[0]["gathers"], unit="")
assert_match("reduce-scatters per step (one per unit)", 3, one_step[0]["reduce_scatters"], unit="")

# %% [markdown]
# **Summary.** Every unit's state is a padded flat shard; the full weights are a temporary.
# *Question:* why is the root (embedding, final LayerNorm, tied LM head) gathered once per step
# and not twice?

# %% [markdown]
# ## 2. Proof of equivalence
#
# Claim: 5 AdamW steps of FSDP on 2 ranks equal single-process training on the global batch,
# element-wise (fp32, rtol 1e-5, atol 1e-7; AdamW eps 1e-6, `loop.EPS` says why), and equal
# PyTorch's `fully_shard` (FSDP2) wrapping the same units on the same data.

# %%
ref_state = loop.reference(CFG, 5)["state"]
hand = labkit.run(loop.train, "fsdp", CFG, 5, world_size=N)
fsdp2 = labkit.run(loop.train, "torch-fsdp", CFG, 5, world_size=N)

# %%
check_close(ref_state, hand[1]["state"], rank=1, verbose=False)
check_close(fsdp2[0]["state"], hand[0]["state"], rank=0, verbose=False)
worst = max((hand[0]["state"][k] - ref_state[k]).abs().max().item() for k in ref_state)
print(f"largest difference from single-process: {worst:.2g}")

# %% [markdown]
# **Summary.** Sharding changes where bytes live, not the arithmetic (up to summation order).
# *Question:* each rank divides its summed token losses by the GLOBAL token count and the
# reduce-scatter SUMs. Run it with `reduce_op="avg"` (`labkit.run(loop.train, "fsdp", CFG, 5,
# reduce_op="avg", world_size=N)`): the checks still pass. What does the loop do differently for
# a strategy that averages, and why is that exact for N = 2?

# %% [markdown]
# ## 3. Memory, measured
#
# Claim: a unit's full parameters exist only while it computes, so the memory timeline is a
# saw-tooth; between steps each rank holds (4 + 4 + 8)P/N = 16P/N bytes of fp32 state.

# %%
tracked = labkit.run(loop.sweep, [dict(strategy="fsdp"), dict(strategy="torch-fsdp")], cfg=CFG, steps=3,
                     track_memory=True, return_state=False, world_size=N)
hand_mem, torch_mem = tracked[0]
plot_memory_timeline([hand_mem["memory"]], title="hand-written FSDP, rank 0: all_gather saw-tooth");

# %%
end_sample = hand_mem["memory"].samples[-1].by_category
steady = end_sample["parameters"] + end_sample["gradients"] + end_sample["optimizer"]
padded = sum(-(-s // N) * N for s in sizes)
assert_match("steady state 16P/N (padded, + 4-byte step counters)", 16 * padded / N, steady, rel_tol=0.01)

# %% [markdown]
# The peak: **M_peak ≈ shards + root + largest unit + prefetch buffer + its gradient temporaries
# + activations**. Activations do not depend on sharding: take them from the measurement.

# %%
activations = hand_mem["peak_by_category"]["activations"]
predicted, parts = peak_formula(model, N, "block", prefetch=1, activation_bytes=activations)
print({k: fmt_bytes(v) for k, v in parts.items()})
assert_match("hand-written peak vs formula", predicted, hand_mem["peak"], rel_tol=0.3)
ratio = hand_mem["peak"] / torch_mem["peak"]
print(f"hand-written peak / fully_shard's peak (same tracker): {ratio:.2f} (target <= 1.05)")
assert ratio <= 1.05, "the hand-written FSDP holds more than fully_shard: look at the timeline above"

# %% [markdown]
# **Summary.** The gathered weights come and go; what stays is 16P/N. On this tiny model the
# activations dominate the peak: FSDP saves model state, not activations.

# %% [markdown]
# ## 4. reshard_after_forward: memory or traffic
#
# Claim: resharding after forward costs one more all-gather per unit per step (parameter
# traffic 2 gathers + 1 reduce-scatter = 3P vs 2P) and saves the gathered weights between
# forward and backward.

# %%
raf = labkit.run(loop.sweep, [dict(reshard_after_forward=True), dict(reshard_after_forward=False)],
                 strategy="fsdp", cfg=CFG, steps=3, track_memory=True, report=fsdp_counts,
                 return_state=False, world_size=N)
step_spans = [s for s in raf.traces[0]["spans"] if s["name"] == "step"]   # 3 steps per setting


def traffic(trace, first, last):
    """Bytes of all-gather and reduce-scatter issued by this rank between two step spans."""
    lo, hi = step_spans[first]["start"], step_spans[last]["end"]
    return sum(ev["nbytes"] for ev in trace["events"] if lo <= ev["start"] <= hi and "ring_" in ev["op"])


rows = []
for i, (setting, result) in enumerate(zip((True, False), raf[0])):
    measured = traffic(raf.traces[0], 3 * i, 3 * i + 2) / 3
    pads = [-(-s // N) * N for s in sizes]
    expected = 4 * (pads[0] + (2 if setting else 1) * sum(pads[1:]) + sum(pads))   # gathers + reduce-scatter
    rows.append((setting, result["gathers"], result["peak"]))
    print(f"reshard_after_forward={setting!s:5}: all-gathers {result['gathers']:.0f}, reduce-scatters "
          f"{result['reduce_scatters']:.0f}, peak {fmt_bytes(result['peak'])}")
    assert_match(f"  parameter traffic per step (~{3 if setting else 2}P)", expected, measured, rel_tol=0.02)

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.bar(["True", "False"], [r[1] for r in rows]); ax1.set_title("all-gathers per step")
ax2.bar(["True", "False"], [r[2] / 2**20 for r in rows]); ax2.set_title("peak (MiB)")
fig.suptitle("reshard_after_forward, measured"); plt.show()

# %% [markdown]
# **Summary.** False is ZeRO-2-like for the weights (FSDP1's SHARD_GRAD_OP); True is ZeRO-3.
# *Question:* why is the memory difference small here, and when would it dominate?

# %% [markdown]
# ## 5. Prefetch
#
# Claim: issuing unit i+1's all-gather while unit i computes (forward), and unit i−1's in
# backward, hides communication behind compute; a rate limiter (at most 2 gathers in flight)
# bounds the extra memory. On 2 shared cores there is little idle compute for a gather to hide
# behind, so the clock may barely move (the medians below are this run's, not a promise): look at
# the timeline and the memory, not just the clock.

# %%
depths = labkit.run(loop.sweep, [dict(prefetch=d) for d in (0, 1, 2)], strategy="fsdp", cfg=CFG, steps=4,
                    track_memory=True, return_state=False, world_size=N)
for depth, result in zip((0, 1, 2), depths[0]):
    print(f"prefetch {depth}: peak {fmt_bytes(result['peak'])}, median step {result['median_step_s'] * 1e3:.0f} ms")

# %%
last = [s for s in depths.traces[0]["spans"] if s["name"] == "step"][-1]
plot_timeline(depths.traces, title="prefetch=2, last step", t_range=(last["start"] * 1e3, last["end"] * 1e3),
              show_inner=True);

# %% [markdown]
# **Summary.** Prefetch trades one unit's worth of memory for overlap. *Question:* with 24
# blocks and a rate limit of 2, how many blocks can be gathered at once?

# %% [markdown]
# ## 6. Wrap granularity
#
# Claim: the unit is the granule of memory and of communication. Root only: one big gather,
# the whole model unsharded at once. Per block: a few medium collectives. Per Linear: many small
# ones (latency-bound), the smallest unsharded group.

# %%
plans = ("root", "block", "linear")
wraps = labkit.run(loop.sweep, [dict(cfg=CFG.replace(units=u), prefetch=0 if u == "root" else 1) for u in plans],
                   strategy="fsdp", steps=3, track_memory=True, report=fsdp_counts, return_state=False,
                   world_size=N)
fig, axes = plt.subplots(1, 4, figsize=(14, 3))
for ax, (title, values) in zip(axes, [
        ("largest unsharded group (KiB)", [4 * max(unit_sizes(model, u)) / 1024 for u in plans]),
        ("collectives per step", [r["gathers"] + r["reduce_scatters"] for r in wraps[0]]),
        ("peak (MiB)", [r["peak"] / 2**20 for r in wraps[0]]),
        ("median step (ms)", [r["median_step_s"] * 1e3 for r in wraps[0]])]):
    ax.bar(plans, values); ax.set_title(title, fontsize=10)
plt.tight_layout(); plt.show()

# %% [markdown]
# **Exercise.** 24 transformer blocks of 0.5 GB each (fp32), 8 GPUs. Plan A: one unit per block.
# Plan B: one unit per 4 blocks. The profiler says: all-gather of 0.5 GB takes 6 ms, one block's
# forward 9 ms, and the GPU has 6 GB free for gathered weights. Which plan, and why? Return "A"
# or "B" from `choose_plan()`.

# %% nbgrader={"grade": false, "grade_id": "grouping-plan", "locked": false, "schema_version": 3, "solution": true}
def choose_plan():
    ### BEGIN SOLUTION
    # A: 6 ms gathers hide behind 9 ms blocks (prefetch 1 holds 2 x 0.5 GB). B: 2 GB units, a
    # 24 ms gather behind 36 ms of compute also hides, but holds 2 x 2 GB = 4 GB plus
    # fragmentation risk: A hides communication as well with a quarter of the memory.
    return "A"
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "grouping-plan-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
def check_plan():
    plan = choose_plan()
    assert plan == "A", f"plan {plan}: B's gathered units need 4 GB for the overlap A gets with 1 GB"


labkit.exercise.check("grouping plan", check_plan)

# %% [markdown]
# ## 7. Gradient accumulation
#
# Claim: with K micro-batches FSDP reduce-scatters after each one (gradients stay sharded), and
# gathers each block once per micro-batch unless the weights are kept between micro-batches.
# Each micro-batch's loss is its token-loss sum over the rank's token count for the whole step.

# %%
K = 4
accumulated = labkit.run(loop.sweep, [dict(reshard_between_micro_batches=r) for r in (True, False)],
                         strategy="fsdp", cfg=CFG, steps=1, accum_steps=K, report=fsdp_counts,
                         return_state=False, world_size=N)
for keep, result in zip(("reshard", "keep"), accumulated[0]):
    print(f"{keep:8s} between micro-batches: {result['gathers']:.0f} all-gathers, "
          f"{result['reduce_scatters']:.0f} reduce-scatters per update")  # NBVAL_CHECK_OUTPUT
assert_match("reshard: gathers per update = K x (1 + 2 blocks x 2)", K * 5, accumulated[0][0]["gathers"], unit="")

# %% [markdown]
# ## 8. The tied embedding: one parameter, both keys
#
# The embedding and the LM head are one Parameter. Both modules live in the root unit, so the
# weight is one segment of one flat buffer: one storage, one gradient (autograd sums the two
# uses), and the full state dict still has both keys.

# %%
state = hand[0]["state"]
assert set(state) == set(loop.build_model(CFG).state_dict()), "state-dict keys changed by sharding"
assert torch.equal(state["tok_emb.weight"], state["lm_head.weight"]), "the tied weights diverged"
print("tied: same keys as before sharding, embedding == LM head after 5 steps")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# Initialization without ever holding the model: ranks other than 0 build it on the **meta**
# device (shapes, no memory); rank 0 builds it for real and broadcasts one unit at a time, each
# rank keeping its chunk (FSDP1's `sync_module_states`). The result must equal single-process init.

# %%
def meta_init():
    if dist.get_rank() == 0:
        net = loop.build_model(CFG)
    else:
        with torch.device("meta"):
            net = loop.build_model(CFG)
    from labkit.strategies.fsdp_flat import fully_shard_by_hand
    return fully_shard_by_hand(net, units="block", sync_from_rank0=True).full_state_dict()


meta_states = labkit.run(meta_init, world_size=N)
print("meta-device init equals single-process init on every rank:",
      all(compare(loop.build_model(CFG).state_dict(), s, rtol=0, atol=0).ok for s in meta_states))  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## 9. Checkpoints, with nothing lost
#
# Each rank writes its shards + AdamW state + step + RNG; rank 0 writes a COMPLETE marker after
# everyone's file is on disk. Four ranks save at steps 2 and 4, the save at 4 "crashes" before its
# marker; two ranks resume from the latest complete one and must continue with the losses of the
# uninterrupted run of section 2.

# %%
import os
import tempfile
from labkit.strategies.fsdp_checkpoint import is_complete, latest_complete, train_resumable

ckpt_root = tempfile.mkdtemp(prefix="fsdp_ckpt_")
labkit.run(train_resumable, 4, ckpt_root, save_every=2, crash_save_at=4, world_size=4, timeout=300)
print("step 4 complete?", is_complete(os.path.join(ckpt_root, "step_000004")),
      "| latest complete:", os.path.basename(latest_complete(ckpt_root)))  # NBVAL_CHECK_OUTPUT

# %%
resumed = labkit.run(train_resumable, 5, ckpt_root, resume_from="latest", world_size=2)[0]
for step, loss in enumerate(resumed["losses"], start=resumed["start"]):
    assert_match(f"step {step} loss, 4 -> 2 ranks vs uninterrupted", hand[0]["losses"][step], loss,
                 rel_tol=1e-5, unit="")

# %% [markdown]
# ## 10. Debug drills
#
# The common-errors table, made runnable. Each mistake below runs for 2 steps on 2 ranks; the
# symptom shows in the course's own tools, and the last column is the shortest check that finds it.
#
# | mistake | symptom | shortest check |
# |---|---|---|
# | optimizer created before sharding | nothing trains: the optimizer holds the old, now unused parameters | largest weight change after a step == 0 |
# | SUM where AVG was meant | every gradient N× too large; AdamW hides most of it, the weights still drift | equivalence check vs single-process |
# | root-only wrap | one all-gather of the whole model per step; the whole model gathered at the peak | collective counts per step; `all_gather` bytes at the peak vs 4P |
# | missing reshard | the memory timeline never drops between units; gathered weights stay after the step | parameter bytes between steps vs 4P/N |
# | overlapping samplers | every rank trains on the same rows; the loss still goes down | equivalence check vs single-process |
#
# Each mistake is a small subclass of the reference FSDP or a wrong sampler, in
# `labkit.labs.drills` (read it: each is a few lines); the loop is the same one as above.
# The first two: an optimizer built **before** sharding, and SUM where AVG was meant (each rank's
# loss normalised for averaging, the reduce-scatter summing).

# %%
drill_runs = labkit.run(loop.sweep, [dict(strategy=drills.OptimizerBeforeSharding),
                                     dict(strategy=drills.SumWhereAvgWasMeant)], cfg=CFG, steps=2,
                        world_size=N)
early, summed = drill_runs[0]
initial = loop.build_model(CFG).state_dict()
moved = max((early["state"][k] - initial[k]).abs().max().item() for k in initial)
print(f"optimizer before sharding: largest weight change after 2 steps = {moved}")  # NBVAL_CHECK_OUTPUT
assert moved == 0, "the drill's optimizer moved a weight: it holds the shards after all"
two_reference = loop.reference(CFG, 2)
two_steps = two_reference["state"]
summed_report = compare(two_steps, summed["state"], rank=0)
print("SUM instead of AVG vs single-process:", summed_report.summary())
assert not summed_report.ok, "SUM where AVG was meant passed the equivalence check"
print(f"step-1 loss as reported: {summed['losses'][1]:.3f}, single-process: {two_reference['losses'][1]:.3f}")

# %% [markdown]
# **Root-only wrap.** `fully_shard` on the model alone, no inner units: the whole model is one
# unit, so each step is one all-gather and one reduce-scatter of everything, and the gathered
# buffer at the peak is the whole model's parameters, 4P bytes.

# %%
root_only = labkit.run(loop.train, "fsdp", CFG.replace(units="root"), 2, prefetch=0, track_memory=True,
                       return_state=False, world_size=N)
for op, (count, nbytes) in collective_counts(root_only.traces[0]).items():
    print(f"{op}: {count / 2:.0f} per step, {fmt_bytes(nbytes / count)} each")  # NBVAL_CHECK_OUTPUT

# %%
padded_model = -(-P // N) * N
assert_match("root-only: gathered at the peak = whole model 4P", 4 * padded_model,
             root_only[0]["peak_by_category"]["all_gather"])
largest_block_gather = max(ev["nbytes"] for ev in one_step.traces[0]["events"] if "all_gather" in ev["op"])
assert_match("block wrap (section 1): largest all-gather = 4 x (largest block)", 4 * max(sizes[1:]),
             largest_block_gather)
print(f"block wrap (section 3) gathered at its peak: {fmt_bytes(hand_mem['peak_by_category']['all_gather'])}")

# %% [markdown]
# With only 2 blocks the block wrap too holds the whole model at its backward peak (root, block 1,
# block 0 being gathered): on TinyGPT the collective counts give the root-only wrap away, not the
# peak. With 24 blocks the block wrap would hold the root and 2 blocks, the root-only wrap all 24.

# %% [markdown]
# **Missing reshard.** Nothing frees a unit's gathered weights (`drills.NeverReshards`: neither
# after forward nor after backward): each unshard adds a unit, the memory never drops between
# units, and after the step every rank still holds the whole model next to its shards.

# %%
no_reshard = labkit.run(loop.train, drills.NeverReshards, CFG, 2, track_memory=True, report=fsdp_counts,
                        return_state=False, world_size=N)
plot_memory_timeline([no_reshard[0]["memory"]], theory={"16P/N": 16 * padded / N},
                     title="missing reshard, rank 0: all_gather only grows");

# %%
after = no_reshard[0]["memory"].samples[-1].by_category
held = after["parameters"] + after["all_gather"]
print(f"parameter bytes between steps: {fmt_bytes(held)}; resharded it would be 4P/N = {fmt_bytes(4 * padded / N)}")
assert_match("missing reshard: shards 4P/N + every unit gathered 4P", 4 * padded / N + 4 * padded, held)
print(f"all-gathers issued in 2 steps: {2 * no_reshard[0]['gathers']:.0f} (3 units)")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# **Overlapping samplers.** Every rank reads the same rows (rank 0's share of the batch, what a
# DataLoader without a DistributedSampler gives each rank): the loss goes down, nothing crashes,
# and the equivalence check with single-process training on the global batch fails.

# %%
overlap = labkit.run(loop.train, "fsdp", CFG, 2, shard=drills.same_rows_on_every_rank, world_size=N)
report = compare(two_steps, overlap[0]["state"], rank=0)
print(report.summary())
assert not report.ok, "overlapping samplers passed the equivalence check"
print(report.failures()[0].problem if not report.ok else "no mismatch")
print("losses:", [round(loss, 3) for loss in overlap[0]["losses"]], "(they look fine)")

# %% [markdown]
# **Summary.** Each mistake leaves a measurable trace: weights that never move, a count of
# collectives per step, gathered bytes that stay, a failed equivalence check. Check those first,
# before reading code. *Questions:* with nothing resharded, which weights does the second step's
# forward compute with (count its all-gathers)? If every rank trained on the whole global batch
# instead of the same half, would the equivalence check catch it, and what would it cost?

# %% [markdown]
# ## 11. Inter-tensor vs intra-tensor sharding
#
# ZeRO-3 in DeepSpeed's original form gives whole tensors to owner ranks; FSDP cuts every flat
# buffer into N equal chunks. Bytes per rank on our model, N = 4:

# %%
def owner_partition(tensor_sizes, n):
    loads = [0] * n
    for size in sorted(tensor_sizes, reverse=True):   # greedy: biggest tensor to the lightest rank
        loads[loads.index(min(loads))] += 4 * size
    return loads


tensor_sizes = [p.numel() for p in model.parameters()]
inter = owner_partition(tensor_sizes, 4)
intra = [sum(4 * (-(-u // 4)) for u in sizes)] * 4   # every rank: ceil(unit / 4) of every unit
print("inter-tensor bytes per rank:", inter, f"imbalance {max(inter) / min(inter):.2f}x")  # NBVAL_CHECK_OUTPUT
print("intra-tensor bytes per rank:", intra, "imbalance 1.00x (padding only)")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## Try it: the knobs on real ranks
#
# Change reshard_after_forward, prefetch depth and wrap granularity; each change re-runs two
# short steps on 2 ranks and redraws the timeline and the memory.

# %%
def knob_experiment(reshard_after_forward=True, prefetch=1, units="block"):
    result = labkit.run(loop.train, "fsdp", CFG.replace(units=units), 2, track_memory=True, return_state=False,
                        reshard_after_forward=reshard_after_forward, prefetch=prefetch, world_size=N)
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(12, 7))
    plot_timeline(result.traces, ax=ax_t, title=f"raf={reshard_after_forward}, prefetch={prefetch}, units={units}")
    plot_memory_timeline([result[0]["memory"]], ax=ax_m)
    plt.show()
    return result


if labkit.exercise.widgets_enabled():
    import ipywidgets as widgets
    controls = dict(reshard_after_forward=widgets.Checkbox(value=True, description="reshard_after_forward"),
                    prefetch=widgets.IntSlider(value=1, min=0, max=2, description="prefetch"),
                    units=widgets.Dropdown(options=["root", "block", "linear"], value="block", description="wrap"))
    busy = widgets.HTML()
    out = widgets.Output()

    def rerun(_change=None):
        busy.value = "running on 2 ranks..."
        with out:
            out.clear_output(wait=True)
            labkit.exercise.draw_in_callback(knob_experiment, **{k: c.value for k, c in controls.items()})
        busy.value = "done"

    for control in controls.values():
        control.observe(rerun, names="value")
    display(widgets.VBox([widgets.HBox(list(controls.values())), busy, out]))
    rerun()
else:
    knob_experiment();

# %% [markdown]
# ## 12. The knobs, in the real APIs
#
# | hand-written knob | FSDP2 `fully_shard` | FSDP1 | DeepSpeed | Megatron-core |
# |---|---|---|---|---|
# | shard params + grads + optimizer, reshard after forward | `reshard_after_forward=True` | `ShardingStrategy.FULL_SHARD` | ZeRO stage 3 | `data_parallel_sharding_strategy="optim_grads_params"` |
# | keep params gathered until backward | `reshard_after_forward=False` | `SHARD_GRAD_OP` | ZeRO stage 2 (params never sharded) | `"optim_grads"` |
# | shard only the optimizer state | — | — | ZeRO stage 1 | `"optim"` |
# | no sharding (DDP) | — | `NO_SHARD` | stage 0 | `"no_shard"` |
# | `units=` (wrap granularity) | which modules get `fully_shard` | `auto_wrap_policy` | `stage3_param_persistence_threshold`, module granularity | per-layer FSDP units |
# | `prefetch=` depth | `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` | `forward_prefetch`, `backward_prefetch=BACKWARD_PRE` | `stage3_prefetch_bucket_size` | overlap flags |
# | `max_inflight` rate limiter | (streams bound it) | `limit_all_gathers=True` | `stage3_max_live_parameters` | — |
# | `reduce_op="avg"` | gradient divide factor | — | — | — |

# %% [markdown]
# ## At scale
#
# The same formulas at 64–512 GPUs, from `labkit.costmodel`. First the ZeRO paper's table
# (7.5 B parameters, N = 64), then the FSDP paper's GPT-175B throughput band, then where the
# model disagrees with what we measured on gloo.

# %%
from labkit import costmodel
from labkit.costmodel import plot as costmodel_plot

table = {stage: round(sum(v.values()) / 1e9, 1) for stage, v in costmodel_plot.zero_table().items()}
print("GB per rank:", table)  # NBVAL_CHECK_OUTPUT
for stage, paper in zip(("ddp", "zero1", "zero2", "fsdp"), costmodel.ZERO_TABLE_GB.values()):
    assert_match(f"{stage} vs ZeRO paper", paper * 1e9, table[stage] * 1e9, rel_tol=0.05)

# %%
for row in costmodel_plot.fsdp_paper_check():
    print(f"N={row['n']:4d} batch={row['batch']}: {row['hw_tflops']:.0f} TFLOPS/GPU "
          f"(paper 173-186), fits={row['fits']}")
for what, model_value, measured, why in costmodel_plot.disagreements():
    print(f"{what:45s} model {model_value:8.2f}  measured {measured:8.2f}  ({why})")

# %%
if labkit.exercise.widgets_enabled():
    display(costmodel_plot.what_if_widget(strategy="fsdp"))
else:
    print("what-if widget: runs in a live notebook (static run: the numbers above)")
