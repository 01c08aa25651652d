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
# state. ZeRO keeps the weights whole for compute but **shards the optimizer state** (stage 1)
# and then **the gradients** (stage 2) across the N ranks. You build both on real
# `torch.distributed` ranks: the flat partition, a sharded optimizer that wraps any PyTorch
# optimizer, the ZeRO-1 step, and ZeRO-2's reduce-scatter during backward. Then you measure,
# not claim, what they save: in fp32, and in the paper's mixed precision (bf16 weights and
# gradients, fp32 master weights), where its formulas are checked to the byte.
#
# The lab's model is `loop.PRESETS["zero"]`: a TinyGPT on short sequences, so that model
# state, not activations, dominates memory. Every run trains through `labkit.loop.train`.

# %%
import labkit  # first (it needs no torch): the ranks' forkserver imports torch on another core meanwhile
import torch
import torch.distributed as dist

import labkit.exercise
from labkit import loop
from labkit.checks import assert_match, compare
from labkit.units import fmt_bytes
from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter
from labkit.models import num_params
from labkit.strategies import Strategy, zero
from labkit.labs.zero_lab import layout_elements, wire_bytes

# %%
CFG = loop.PRESETS["zero"]  # model, batch, seed and AdamW: every run below
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
# Your strategies run fp32: weights 4P, gradients 4P, Adam 8P, so ZeRO-1 is 4P + 4P + 8P/N and
# ZeRO-2 is 4P + 4P/N + 8P/N; section 6 also measures the mixed-precision rows. The ZeRO paper's
# example: 7.5 B parameters on N = 64 GPUs.

# %%
table = paper_table(params=7.5e9, n=64)
print("GB per rank by stage:", table)  # NBVAL_CHECK_OUTPUT


assert table == ZERO_TABLE_GB, f"the formulas give {table} GB, the paper's table {ZERO_TABLE_GB} GB"
print(
    "checked: these formulas reproduce the ZeRO paper's table (7.5 B, N = 64) exactly"
)  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# The calculator: type a parameter count (or pick a model), N, stage, precision, activations.
# The inputs are exact numbers, so the bars read the paper's 120 / 31.4 / 16.6 / 1.9 GB.
# Under CI it draws once, with these values.

# %%
calculator = memory_calculator(params=7.5e9, n=64, stage=1, precision="mixed", sizes={"this lab's model": P})

# %% [markdown]
# The same formulas for the lab's own model (its exact P), with the DDP bars you just measured.

# %%
measured_ddp = {"DDP measured (rank 0)": after_step(ddp[0])}
memory_calculator(params=P, n=N, stage=0, precision="fp32", measured=measured_ddp)

# %% [markdown]
# **Summary.** Adam's state is half of DDP's model state in fp32 (8 of 16 bytes per parameter)
# and 12 of 16 with mixed precision; nothing about it needs to be replicated.
#
# **Questions.** (a) The measured "other" holds about 4P: what is it in the bucketed DDP?
# (b) At which N does ZeRO-2 need less than a quarter of DDP's model state (mixed precision)?

# %% [markdown]
# ## 2. The flat partition: one buffer, N equal chunks
#
# Lay the trainable parameters end to end in one flat buffer of `numel` elements, pad it to
# `padded_numel`, a multiple of N, and give rank k the k-th of N equal chunks (equal chunks are
# what reduce-scatter and all-gather need). Every parameter then becomes a **view** of the
# buffer, so one collective on the buffer updates the whole model.
#
# **Exercise 1.** Write `MyFlatPartition(params, world_size)`:
# - `params`: the trainable tensors, each once (skip `requires_grad=False`; a tied weight is
#   listed twice but is one tensor), `numels`, `offsets` (where each starts in the buffer),
#   `numel`, `chunk` = ceil(numel / N), `padded_numel` = N · chunk;
# - `rank_range(rank)`: the real elements `[start, end)` rank owns (padding excluded);
# - `views(flat)`: one view of `flat` per parameter, shaped like it (no copy);
# - `segments(rank)`: `(param index, lo, hi)` for every parameter piece inside `rank_range`;
#   `lo, hi` are indices into the flat buffer (the piece is `flat[lo:hi]`), not positions inside
#   the parameter (it starts `lo - offsets[i]` elements into parameter i).


# %% nbgrader={"grade": false, "grade_id": "flat-partition", "locked": false, "schema_version": 3, "solution": true}
class MyFlatPartition:
    """The trainable parameters end to end, padded to N equal chunks. Leaves out: several dtypes."""

    def __init__(self, params, world_size):
        self.world_size = world_size
        ### BEGIN SOLUTION
        unique = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)  # a tied weight once
        self.params = list(unique.values())
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.params))]
        self.numel = sum(self.numels)
        self.chunk = -(-self.numel // world_size)  # ceil
        self.padded_numel = self.chunk * world_size
        ### END SOLUTION

    def rank_range(self, rank):
        ### BEGIN SOLUTION
        start = min(rank * self.chunk, self.numel)
        return start, min(start + self.chunk, self.numel)
        ### END SOLUTION

    def views(self, flat):
        ### BEGIN SOLUTION
        return [flat[o : o + n].view_as(p) for p, o, n in zip(self.params, self.offsets, self.numels)]
        ### END SOLUTION

    def segments(self, rank):
        ### BEGIN SOLUTION
        start, end = self.rank_range(rank)
        out = []
        for i, (o, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(o, start), min(o + n, end)
            if lo < hi:
                out.append((i, lo, hi))
        return out
        ### END SOLUTION

    def chunk_slice(self, rank):  # given: rank's chunk of the padded buffer
        return slice(rank * self.chunk, (rank + 1) * self.chunk)

    def flatten(self, tensors):  # given: a new padded buffer holding `tensors`
        like = self.params[0]
        flat = torch.zeros(self.padded_numel, dtype=like.dtype, device=like.device)
        for view, t in zip(self.views(flat), tensors):
            if t is not None:
                view.copy_(t)
        return flat


# %% nbgrader={"grade": true, "grade_id": "flat-partition-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
from labkit.labs.zero_checks import check_flat_partition, check_sharded_optimizer
from labkit.labs.zero_stage_checks import check_zero1, check_zero2

labkit.exercise.check("flat partition", lambda: check_flat_partition(MyFlatPartition))

# %%
partition_impl = labkit.exercise.pick("flat partition", MyFlatPartition, zero.FlatPartition)

# %% [markdown]
# On the lab's model: every rank's range, its pieces, and the padding, which is always less
# than N elements (the last rank's chunk is partly padding when N does not divide P).

# %%
for n in (2, 3):
    part = partition_impl(model.parameters(), n)
    for rank in range(n):
        start, end = part.rank_range(rank)
        print(
            f"N={n} rank {rank}: [{start:,}, {end:,}), {len(part.segments(rank))} pieces, "
            f"padding {part.chunk - (end - start)}"
        )  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# The contrast: per-tensor (owner-rank) partitioning gives each whole tensor to one rank, as
# torch's `ZeroRedundancyOptimizer` does (largest first, to the least loaded rank). Whole
# tensors cannot split evenly; the most loaded rank sets the memory. Elements per rank, max/mean:

# %%
numels = [p.numel() for p in model.parameters() if p.requires_grad]
for n in (2, 4, 8):
    load = zero.per_tensor_partition(numels, n)
    print(
        f"N={n}: per-tensor max/mean = {max(load) / (sum(load) / n):.3f}, "
        f"flat max/mean = {partition_impl(model.parameters(), n).chunk * n / sum(numels):.5f}"
    )  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# Measured at N = 8, without launching ranks: give each of 8 AdamW optimizers the tensors that
# one owner rank would get, take one step, and count the bytes of their real state tensors.

# %%
import copy


def adam_state_bytes(params):
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = CFG.make_optimizer(params)
    optimizer.step()
    return sum(t.nbytes for state in optimizer.state.values() for t in state.values())


params = [p for p in copy.deepcopy(model).parameters() if p.requires_grad]
owned_bytes = [adam_state_bytes([params[i] for i in owned]) for owned in zero.per_tensor_owners(numels, 8)]
print("per-tensor Adam bytes per rank:", owned_bytes)  # NBVAL_CHECK_OUTPUT
print(
    f"max / mean = {max(owned_bytes) / (sum(owned_bytes) / 8):.3f}; flat: "
    f"{8 * partition_impl(params, 8).chunk:,} B on every rank"
)  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# And on real ranks: torch's ZeroRedundancyOptimizer, 2 ranks, five steps (section 4 reuses
# this run). Its Adam bytes per rank are 8 per owned element plus the 4-byte step counters, as
# the owner-rank split predicts (at N = 2 it happens to balance).

# %%
torch_zero = labkit.run(loop.train, "torch-zero1", CFG, 5, track_memory=True, world_size=N)
load = zero.per_tensor_partition(numels, N)
for rank in range(N):
    assert_match(
        f"ZeroRedundancyOptimizer rank {rank} Adam bytes",
        8 * load[rank],
        after_step(torch_zero[rank])["optimizer"],
    )

# %% [markdown]
# **Summary.** A flat, padded, dim-0 partition balances to the element, and its views make one
# collective move the whole model; owner-rank partitioning cuts no tensor, but the most loaded
# rank sets the memory. **Question:** which tensor of TinyGPT makes the per-tensor split worst
# at N = 8?

# %% [markdown]
# ## 3. A sharded optimizer that wraps any optimizer
#
# `ZeroRedundancyOptimizer(params, optimizer_class=AdamW, lr=...)` takes any PyTorch optimizer.
# Its contract: the gradients it reads are already the same on every rank (after DDP's
# all-reduce, or when every rank saw the same data). Yours does the same on the flat partition:
#
# **Exercise 2a.** Write `MyShardedOptimizer(params, optimizer_cls, **kwargs)`. `params` are
# tensors or parameter groups (dicts with their own `lr`, `weight_decay`). In `__init__`:
# 1. put the parameters into one flat buffer `self.flat_param` and make each parameter a view
#    of it (`p.data = view`), so an all-gather into the buffer updates the model;
# 2. for each of this rank's segments make one leaf tensor, `self.flat_param[lo:hi].detach()
#    .requires_grad_()` (it shares the buffer's memory), and give them to `optimizer_cls`, in
#    the parameter group of the parameter they belong to: only this rank's state exists.
#
# `step()`: give each piece its slice of `p.grad` (or None when `p.grad` is None: the
# optimizer then skips it, as torch does), step the wrapped optimizer, all-gather the chunks.


# %% nbgrader={"grade": false, "grade_id": "sharded-optimizer", "locked": false, "schema_version": 3, "solution": true}
class MyShardedOptimizer:
    """optimizer_cls on this rank's chunk only, then an all-gather. Leaves out: state_dict,
    closures, add_param_group, buckets (the reference, zero.ShardedOptimizer, has them)."""

    def __init__(self, params, optimizer_cls, **kwargs):
        groups = list(params)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.partition = partition_impl([p for g in groups for p in g["params"]], self.world_size)
        ### BEGIN SOLUTION
        with torch.no_grad():
            self.flat_param = self.partition.flatten([p.detach() for p in self.partition.params])
            for p, view in zip(self.partition.params, self.partition.views(self.flat_param)):
                p.data = view
        group_of = {id(p): k for k, g in enumerate(groups) for p in g["params"]}
        inner = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
        self.pieces = []  # (parameter, where the piece starts inside it, the piece)
        for i, lo, hi in self.partition.segments(self.rank):
            p = self.partition.params[i]
            piece = self.flat_param[lo:hi].detach().requires_grad_()
            self.pieces.append((p, lo - self.partition.offsets[i], piece))
            inner[group_of[id(p)]]["params"].append(piece)
        self.optim = optimizer_cls(inner, **kwargs)
        ### END SOLUTION
        self.param_groups, self.state = self.optim.param_groups, self.optim.state  # what trackers read

    def step(self):
        ### BEGIN SOLUTION
        for p, start, piece in self.pieces:
            piece.grad = None if p.grad is None else p.grad.reshape(-1)[start : start + piece.numel()]
        self.optim.step()
        ring_all_gather(self.flat_param, self.flat_param[self.partition.chunk_slice(self.rank)])
        ### END SOLUTION

    def zero_grad(self, set_to_none=True):
        for p in self.partition.params:
            p.grad = None


# %% [markdown]
# The check trains the `toy` preset (a frozen weight, a tied one, `extra.*` unused on even steps,
# odd sizes) for 3 steps on 2 ranks, every rank on the whole batch, with AdamW and with SGD +
# momentum, two parameter groups each, and compares every element with single-process training
# and with torch's ZeroRedundancyOptimizer on the same run.

# %% nbgrader={"grade": true, "grade_id": "sharded-optimizer-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
labkit.exercise.check("sharded optimizer", lambda: check_sharded_optimizer(MyShardedOptimizer))

# %%
sharded_impl = labkit.exercise.pick("sharded optimizer", MyShardedOptimizer, zero.ShardedOptimizer)

# %% [markdown]
# **Summary.** Any element-wise optimizer (AdamW, SGD with momentum) computes on 1/N of the
# elements exactly what it computes on all of them; one piece per parameter keeps torch's rules
# (a parameter without gradient is skipped, each group keeps its options) and keeps the padding
# out. **Question:** why would one flat piece per rank be wrong for a parameter with no gradient?

# %% [markdown]
# ## 4. The ZeRO-1 step: reduce-scatter instead of all-reduce
#
# DDP + your sharded optimizer all-reduces the whole gradient, then reads 1/N of it. ZeRO-1
# reduces only what the rank steps: a **reduce-scatter** of the flat gradient into this rank's
# chunk of it. `MyZeRO1` (a `labkit.strategies.Strategy`, so `loop.train` drives it) keeps every
# `p.grad` a view of one flat buffer `self.flat_grad`, so backward writes into it; a hook
# records which parameters got a gradient.
#
# **Exercise 2b.** Write `step()`: reduce-scatter `self.flat_grad` into its chunk
# `self.flat_grad[self.partition.chunk_slice(self.rank)]` with the loop's convention (each rank's
# loss is already divided by the global token count: `reduce_op = "sum"`), set `p.grad = None`
# for the parameters without a gradient this step, then step the sharded optimizer.


# %% nbgrader={"grade": false, "grade_id": "zero1-step", "locked": false, "schema_version": 3, "solution": true}
class MyZeRO1(Strategy):
    """ZeRO-1: optimizer state sharded; gradients and weights whole. Leaves out: overlap (ZeRO-2
    adds it), mixed precision (labkit's "zero1" has it)."""

    reduce_op = "sum"  # the loop's convention

    def __init__(self, model, cfg):
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = sharded_impl(params, cfg.optimizer, **cfg.optimizer_kwargs)
        self.rank = dist.get_rank()
        self.partition = partition_impl(params, dist.get_world_size())  # the optimizer's geometry
        self.flat_grad = torch.zeros(
            self.partition.padded_numel, dtype=params[0].dtype, device=params[0].device
        )
        self.got_grad = set()
        for p in self.partition.params:
            p.register_post_accumulate_grad_hook(lambda p: self.got_grad.add(id(p)))

    def zero_grad(self):
        self.flat_grad.zero_()
        self.got_grad.clear()
        for p, view in zip(self.partition.params, self.partition.views(self.flat_grad)):
            p.grad = view  # backward accumulates into the flat buffer, in place

    def step(self):
        ### BEGIN SOLUTION
        ring_reduce_scatter(
            self.flat_grad[self.partition.chunk_slice(self.rank)], self.flat_grad, op=self.reduce_op
        )
        for p in self.partition.params:
            if id(p) not in self.got_grad:
                p.grad = None
        self.optimizer.step()
        ### END SOLUTION


# %% [markdown]
# The check trains the toy preset 3 steps through `loop.train` on 2 ranks: first this rank's
# range of the step-0 gradient after your reduce-scatter (a SUM-vs-AVG slip shows there: AdamW's
# scale invariance would hide it in the weights), then the weights, against single-process
# training. (torch's ZeroRedundancyOptimizer comes next, on the lab's model.)

# %% nbgrader={"grade": true, "grade_id": "zero1-step-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
labkit.exercise.check("ZeRO-1 step", lambda: check_zero1(MyZeRO1))

# %%
zero1_impl = labkit.exercise.pick("ZeRO-1 step", MyZeRO1, "zero1")

# %% [markdown]
# Five steps on the lab's model with your ZeRO-1, against single-process training on the whole
# batch and against torch's ZeroRedundancyOptimizer (with torch's DDP averaging the gradients).
#
# With 2 ranks a + b has one order only, so against torch's run the weights agree to the bit.
# Against one process they cannot: the whole-batch gradient sums the rows in another order, and
# AdamW turns a rounding difference δg of a gradient smaller than its eps (1e-6, `loop.EPS`)
# into a weight difference of about lr·δg/eps = 1e4·δg, and how big δg is depends on how the
# CPU's matrix kernels order their sums (up to 2e-5 in the weights seen on an AVX-512 Xeon, a
# few 1e-6 on other machines). torch's own run shows the same gap (its max |diff| is printed
# beside yours), hence atol 1e-4 there: 1% of one step's movement (lr = 1e-2), where a wrong
# update is off by a whole step.

# %%
zero1 = labkit.run(loop.train, zero1_impl, CFG, 5, track_memory=True, world_size=N)
single = loop.reference(CFG, 5)


def check_against_oracles(results, name):
    bitwise = compare(
        torch_zero[0]["state"],
        results[0]["state"],
        rtol=0,
        atol=0,
        label=f"{name} vs ZeroRedundancyOptimizer, to the bit",
    )
    print(bitwise.summary())
    bitwise.raise_if_failed()
    ours = compare(
        single["state"], results[0]["state"], rtol=1e-5, atol=1e-4, label=f"{name} vs single process"
    )
    theirs = compare(single["state"], torch_zero[0]["state"], rtol=1e-5, atol=1e-4)
    print(
        ours.summary(),
        f"(max |diff| {max(e.max_diff for e in ours.entries):.2g}; "
        f"ZeroRedundancyOptimizer's {max(e.max_diff for e in theirs.entries):.2g})",
    )
    ours.raise_if_failed()
    same = all(compare(results[0]["state"], r["state"], rtol=0, atol=0).ok for r in results)
    assert same, f"{name}: the ranks hold different weights"


check_against_oracles(zero1, "ZeRO-1")

# %% [markdown]
# **Summary.** Reduce-scatter → the wrapped optimizer on 1/N → all-gather computes what DDP
# computes: each element's update depends only on that element's gradient and state, and the
# reduce-scatter reduced exactly the elements this rank steps. **Questions.** (a) With Adam, SUM
# instead of AVG changes the weights only slightly: why, and which check caught it? (b) The full
# gradient still exists on every rank at the end of backward: when could it be reduced earlier?

# %% [markdown]
# ## 5. ZeRO-2: reduce-scatter during backward
#
# After the reduce-scatter a rank needs only its chunk of the gradient; ZeRO-2 never keeps the
# rest. As in the DDP lab's bucketed hooks, the parameters are grouped into buckets in reverse
# order (backward's order), but now each bucket is reduce-scattered, and its full gradient freed,
# as soon as backward has produced it. The layout (`zero.FlatLayout`) cuts every bucket N ways
# on its own: rank k owns chunk k of every bucket, `self.grad_shard` holds them end to end
# (`layout.shard_slice(b)` is bucket b's place in it). The reference `zero.ShardedOptimizer`
# with the same buckets does the sharded step on that shard.
#
# **Exercise 3.** Write the bucket hooks of `MyZeRO2`:
# - `grad_ready(p)` (a post-accumulate-grad hook): record p; while bucket `self.launched` is
#   complete, `launch` it: buckets go strictly in order, the same on every rank;
# - `launch(b)`: with two buckets in flight, wait for the oldest (and drop its send buffer); copy
#   the bucket's gradients into a send buffer (`bucket.flatten(...)`), free them (`p.grad = None`),
#   and launch an async reduce-scatter into `self.grad_shard[layout.shard_slice(b)]`;
# - `after_backward()`: launch what backward did not complete (a bucket holding an unused
#   parameter), then wait for every bucket before the step.


# %% nbgrader={"grade": false, "grade_id": "zero2-hooks", "locked": false, "schema_version": 3, "solution": true}
class MyZeRO2(Strategy):
    """ZeRO-2: gradients reduce-scattered bucket by bucket during backward, only the shard kept.
    Leaves out: gradient accumulation (no_sync), overlapping the all-gather with forward, mixed
    precision (labkit's "zero2" has it)."""

    reduce_op = "sum"

    def __init__(self, model, cfg, bucket_cap_mb=0.25):
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = zero.ShardedOptimizer(
            params, cfg.optimizer, bucket_cap_mb=bucket_cap_mb, **cfg.optimizer_kwargs
        )
        self.layout = self.optimizer.layout
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.layout.buckets) for p in bucket.params}
        self.index = {id(p): i for i, p in enumerate(self.layout.params)}
        self.grad_shard = self.layout.empty(self.layout.shard_numel)
        for p in self.layout.params:
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def zero_grad(self):
        self.observe("tag", "gradients", self.grad_shard)  # the memory tracker's category
        for p in self.layout.params:
            p.grad = None
        self.ready = [set() for _ in self.layout.buckets]  # ids of the params with a gradient
        self.launched, self.in_flight, self.got_grad = 0, [], set()

    def grad_ready(self, p):
        self.got_grad.add(self.index[id(p)])
        ### BEGIN SOLUTION
        self.ready[self.bucket_of[id(p)]].add(id(p))
        buckets = self.layout.buckets
        while self.launched < len(buckets) and len(self.ready[self.launched]) == len(
            buckets[self.launched].params
        ):
            self.launch(self.launched)
        ### END SOLUTION

    def launch(self, b):
        ### BEGIN SOLUTION
        if len(self.in_flight) == 2:
            self.in_flight.pop(0)[0].wait()  # its send buffer goes with it
        bucket = self.layout.buckets[b]
        send = bucket.flatten([p.grad for p in bucket.params])
        self.observe("tag", "gradients", send)
        for p in bucket.params:
            p.grad = None
        out = self.grad_shard[self.layout.shard_slice(b)]
        self.in_flight.append((ring_reduce_scatter(out, send, op=self.reduce_op, async_op=True), send))
        self.launched = b + 1
        ### END SOLUTION

    def after_backward(self):
        ### BEGIN SOLUTION
        while self.launched < len(self.layout.buckets):
            self.launch(self.launched)
        while self.in_flight:
            self.in_flight.pop(0)[0].wait()
        ### END SOLUTION

    def step(self):
        self.optimizer.attach_grads(self.grad_shard, has_grad=self.got_grad)
        self.optimizer.local_step()
        self.optimizer.all_gather_params()


# %% [markdown]
# The check trains the toy preset with tiny buckets (200 bytes) and the memory tracker on:
# the gradient shard, the weights, then what makes it ZeRO-2: the buckets' reduce-scatters in
# bucket order, started during backward, and the gradient bytes alive at the end of backward
# (at most the shard plus two buckets in flight).

# %% nbgrader={"grade": true, "grade_id": "zero2-hooks-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
labkit.exercise.check("ZeRO-2 bucket hooks", lambda: check_zero2(MyZeRO2))

# %%
zero2_impl = labkit.exercise.pick("ZeRO-2 bucket hooks", MyZeRO2, "zero2")


def layout_of(strategy):  # loop.train's report hook: the buckets this run used
    layout = strategy.layout
    return {
        "bucket_bytes": [4 * b.padded_numel for b in layout.buckets],
        "shard_bytes": 4 * layout.shard_numel,
    }


zero2 = labkit.run(
    loop.train, zero2_impl, CFG, 5, track_memory=True, hooks=loop.Hooks(report=layout_of), world_size=N
)
check_against_oracles(zero2, "ZeRO-2")

# %% [markdown]
# **Summary.** ZeRO-2 is ZeRO-1's arithmetic with the gradient reduced bucket by bucket while
# backward runs; a bucket's full gradient lives only until its reduce-scatter is launched.
# **Question:** why must the buckets be launched in the same order on every rank?

# %% [markdown]
# ## 6. Measured, not claimed
#
# Per-rank bytes after the step, your strategies at N = 2 and N = 4 against the fp32 formulas:
# ZeRO-1 = 4P + 4P + 8P/N, ZeRO-2 = 4P + 4P/N + 8P/N (within 1%: the padding, and AdamW's 4-byte
# `step` counter per piece). The N = 4 runs: one launch, two steps each.


# %%
def stage_runs():
    return {
        name: loop.train(impl, CFG, 2, track_memory=True, return_state=False)
        for name, impl in (("ZeRO-1", zero1_impl), ("ZeRO-2", zero2_impl))
    }


four = labkit.run(stage_runs, world_size=4)
measured = {
    (2, "ZeRO-1"): zero1,
    (2, "ZeRO-2"): zero2,
    (4, "ZeRO-1"): [r["ZeRO-1"] for r in four],
    (4, "ZeRO-2"): [r["ZeRO-2"] for r in four],
}
for (n, name), results in measured.items():
    theory = memory_per_rank(P, n, {"ZeRO-1": 1, "ZeRO-2": 2}[name], precision="fp32")
    for category in ("parameters", "gradients", "optimizer"):
        assert_match(f"N={n} {name} rank 0 {category}", theory[category], after_step(results[0])[category])

# %% [markdown]
# Communication per step, from the tracer: a ring all-reduce of S bytes sends 2(N-1)/N·S per
# rank; a reduce-scatter plus an all-gather send (N-1)/N·S each: the same bytes. (DDP's
# broadcasts are its start-up weight sync, before the first step: not counted.)

# %%
from labkit.observe.trace_stats import collective_counts, steps

for name, r in (("DDP", ddp), ("ZeRO-1", zero1), ("ZeRO-2", zero2)):
    print(
        f"{name:7}", {op: count for op, (count, _) in collective_counts(r.traces[0]).items()}
    )  # NBVAL_CHECK_OUTPUT
per_step = {
    name: wire_bytes(r.traces[0]) / len(steps(r.traces[0]))
    for name, r in (("DDP", ddp), ("ZeRO-1", zero1), ("ZeRO-2", zero2))
}
assert_match("bytes sent per rank per step, ZeRO-1 vs DDP", per_step["DDP"], per_step["ZeRO-1"])
assert_match("bytes sent per rank per step, ZeRO-2 vs DDP", per_step["DDP"], per_step["ZeRO-2"])

# %% [markdown]
# ZeRO-2's point is the **backward peak**: at the end of backward ZeRO-1 (and DDP) hold the
# whole gradient, 4P bytes; ZeRO-2 holds its shard, 4P/N, plus at most two buckets in flight.
# Measured at the sample the loop takes when backward returns, every step:

# %%
from labkit.strategies.zero import backward_grad_bytes

bucket_bytes, shard_bytes = max(zero2[0]["bucket_bytes"]), zero2[0]["shard_bytes"]
end_of_backward = {
    name: backward_grad_bytes(r[0]["memory"]) for name, r in (("ZeRO-1", zero1), ("ZeRO-2", zero2))
}
for grad_bytes in end_of_backward["ZeRO-1"]:
    assert_match("ZeRO-1 gradient bytes at the end of backward vs 4P", 4 * P, grad_bytes)
for grad_bytes in end_of_backward["ZeRO-2"]:
    line = (
        f"ZeRO-2 gradient bytes at the end of backward: {fmt_bytes(grad_bytes)} = {grad_bytes / (4 * P):.2f} x 4P; "
        f"bound: the shard (4P/N + padding) + 2 buckets = {fmt_bytes(shard_bytes + 2 * bucket_bytes)}"
    )
    print(line)
    assert grad_bytes <= shard_bytes + 2 * bucket_bytes, line

# %% [markdown]
# The memory timeline of rank 0's last steps, ZeRO-1 above, ZeRO-2 below: the gradient band
# (same color in every lab) stays whole through ZeRO-1's backward and drops to the shard in
# ZeRO-2's, while Adam's state is 1/N in both.

# %%
from labkit.observe.memory_plot import plot_memory_bars, plot_memory_timeline

theory = {
    "params + grads + Adam, ZeRO-1": 4 * P + 4 * P + 8 * P / N,
    "params + grads + Adam, ZeRO-2": 4 * P + 4 * P / N + 8 * P / N,
}
plot_memory_timeline(
    [zero1.memory[0], zero2.memory[0]], theory=theory, title="rank 0: ZeRO-1 (top), ZeRO-2 (bottom)"
)
# %% [markdown]
# The timeline of ZeRO-2's last step: the buckets' reduce-scatters start while backward runs.

# %%
from labkit.observe.timeline import plot_timeline

offset_ms = (zero2.traces[0]["t0"] - min(t["t0"] for t in zero2.traces)) * 1e3
last_start, last_end = steps(zero2.traces[0])[-1]
plot_timeline(
    zero2.traces,
    title="ZeRO-2, last step",
    t_range=(last_start * 1e3 + offset_ms, last_end * 1e3 + offset_ms),
)
# %% [markdown]
# Counted in every step, from rank 0's trace: the reduce-scatters, their sizes in launch order
# against the buckets', and how many started while that step's backward ran.

# %%
from labkit.labs.zero_stage_checks import bucket_launches

buckets = zero2[0]["bucket_bytes"]
for step, (sizes, early) in enumerate(bucket_launches(zero2.traces[0], 5)):
    print(
        f"step {step}: {len(sizes)} reduce-scatters in bucket order: {sizes == buckets}; "
        f"{early} started during backward"
    )
    assert sizes == buckets and early >= len(buckets) - 1, "ZeRO-2's buckets did not overlap backward"

# %% [markdown]
# Peak memory per rank, measured, and the formulas' bars beside the measured model state.

# %%
plot_memory_bars({"DDP": ddp.memory, "ZeRO-1": zero1.memory, "ZeRO-2": zero2.memory})
# %%
after = {"ZeRO-1 measured": after_step(zero1[0]), "ZeRO-2 measured": after_step(zero2[0])}
draw_memory_bars(P, N, stage=2, precision="fp32", measured=after)
# %% [markdown]
# **Try it on real ranks.** Pick N and a stage; the control re-runs two steps with your
# strategies and redraws the memory timeline (under CI it runs once: N = 2, ZeRO-2).

# %%
from labkit.labs.memory_widget import experiment_control


def run_and_plot(world_size, stage):
    impl = {0: "ddp-bucketed", 1: zero1_impl, 2: zero2_impl}[stage]
    results = labkit.run(
        loop.train, impl, CFG, 2, track_memory=True, return_state=False, world_size=world_size
    )
    theory = memory_per_rank(P, world_size, stage, precision="fp32")
    plot_memory_timeline(
        results.memory[:2],
        theory={
            "params + grads + Adam (theory)": int(
                theory["parameters"] + theory["gradients"] + theory["optimizer"]
            )
        },
    )


experiment_control(run_and_plot, world_sizes=(2, 4), stages=(0, 1, 2), default=(2, 2))

# %% [markdown]
# ### The bucket size: memory against collectives
#
# Smaller buckets keep fewer gradient bytes alive during backward, but every bucket is one more
# reduce-scatter, and each collective costs a round of latency (here ranks share 2 CPU cores, so
# a round costs about a millisecond of CPU per rank). labkit's `zero2` with its default buckets
# against one big bucket (every parameter but the embeddings' small last bucket), on 4 ranks:
# the peak and the most gradient bytes alive during backward, from the memory tracker, and the
# step time over several timed steps, with its spread (a shared machine: printed, not asserted;
# the two take turns, round by round, so both meet the same load).


# %%
def grad_bytes_in_backward(record):
    """The most gradient bytes any sample inside a backward phase saw."""
    return max(
        s.by_category.get("gradients", 0)
        for name, first, last in record.phases
        if name == "backward"
        for s in record.samples[first : last + 1]
    )


def bucket_tradeoff(cfg, options, timed_steps=4, rounds=2):
    out = {}
    for label, opts in options.items():
        mem = loop.train(
            "zero2", cfg, 2, track_memory=True, return_state=False, hooks=loop.Hooks(report=layout_of), **opts
        )
        out[label] = {
            "buckets": len(mem["bucket_bytes"]),
            "peak": mem["peak"],
            "in_backward": grad_bytes_in_backward(mem["memory"]),
            "step_ms": [],
        }
    labels = list(options)
    for round_ in range(rounds):  # A B, then B A: the same moments of a changing load for both
        for label in labels if round_ % 2 == 0 else labels[::-1]:
            timed = loop.train(
                "zero2",
                cfg,
                timed_steps,  # after 1 untimed warm-up step
                spans=False,
                return_state=False,
                hooks=loop.Hooks(warmup=1),
                **options[label],
            )
            out[label]["step_ms"] = sorted(out[label]["step_ms"] + [1e3 * s for s in timed["step_s"]])
    return out


def quartiles(values):
    return values[len(values) // 4], values[len(values) // 2], values[(3 * len(values)) // 4]


options = {"default buckets": {}, "one big bucket": {"bucket_cap_mb": 1e3}}
tradeoff = labkit.run(bucket_tradeoff, CFG, options, world_size=4)
rows = {label: max(tradeoff, key=lambda r: r[label]["peak"])[label] for label in options}  # highest rank
for label, r in rows.items():
    q1, median, q3 = quartiles(r["step_ms"])
    print(
        f"{label:>16}: {r['buckets']} reduce-scatters per step, peak {fmt_bytes(r['peak'])}, "
        f"gradients alive during backward (most) {fmt_bytes(r['in_backward'])}, "
        f"step {median:.0f} ms (quartiles {q1:.0f}-{q3:.0f} over {len(r['step_ms'])} steps)"
    )
small, big = rows["default buckets"], rows["one big bucket"]
assert small["buckets"] > big["buckets"] == 2
assert small["peak"] < big["peak"], "smaller buckets should lower ZeRO-2's peak"
assert small["in_backward"] < big["in_backward"], (
    "smaller buckets should hold fewer gradient bytes in backward"
)
print(
    f"one big bucket's peak / the default's: {big['peak'] / small['peak']:.2f}; its gradient bytes "
    f"during backward / the default's: {big['in_backward'] / small['in_backward']:.2f} "
    f"(4P = {fmt_bytes(4 * P)})"
)

# %% [markdown]
# **Verdict.** The default buckets lower the peak; one big bucket saves collectives and holds
# nearly all the gradients at once, as ZeRO-1 does, until it is sent. Real runs pick the bucket
# (DeepSpeed's `reduce_bucket_size`, DDP's `bucket_cap_mb`) large enough that its collective is
# bandwidth-bound and small enough that two of them fit next to the model. The step times'
# quartiles overlap run to run on this shared machine: the price of one reduce-scatter is not
# something these two rows can measure. **Question:** which term of the peak does the big bucket
# bring back, and why are its gradient bytes during backward about 4P plus the shard while the
# default buckets' stay near the shard plus a few buckets?

# %% [markdown]
# ### Mixed precision: the paper's formulas, measured
#
# The paper's K = 12 shows once the model computes in bf16. `MixedPrecision(bf16, bf16)` in the
# preset gives labkit's `zero1` and `zero2` (the reference versions of your `MyZeRO1/2`, with
# the policy yours leave out) bf16 weights (2P, all-gathered after the step), bf16 gradients,
# and an fp32 master shard, counted with Adam's moments as optimizer state: 4 + 8 = 12 bytes per
# owned element.

# %%
from labkit.strategies.precision import MixedPrecision
from labkit.labs import precision_checks

CFG_MP = CFG.replace(mp=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))

# %% [markdown]
# One launch per N runs both strategies for two steps (`loop.sweep`); a report hook
# (`layout_elements`, from `labkit.labs.zero_lab`) returns what the formulas leave out, in
# elements: the padded flat buffer, the rank's shard, the last bucket, and the pieces the rank's
# AdamW steps.


# %%
mixed = {
    n: labkit.run(
        loop.sweep,
        [dict(strategy="zero1"), dict(strategy="zero2")],
        cfg=CFG_MP,
        steps=2,
        track_memory=True,
        return_state=False,
        hooks=loop.Hooks(report=layout_elements),
        world_size=n,
    )[0]
    for n in (2, 4)
}

# %% [markdown]
# Measured at the end of step 2's backward (the steady state). Each row's allowance is derived
# from the layout, not a tolerance: the padding (flat − P elements; shard − P/N), ZeRO-2's last
# bucket still on the wire (2 bytes per padded element of its send buffer: the earlier buckets
# have landed, one is in flight at a time), and AdamW's 4-byte `step` counter per piece.


# %%
def backward_end(result):
    """Parameter / gradient / optimizer bytes at the last "backward end" sample: step 2's."""
    end = [s for s in result["memory"].samples if s.label == "backward end"][-1]
    return {c: end.by_category[c] for c in ("parameters", "gradients", "optimizer")}


def allowance(stage, n, lay):
    """Bytes the layout adds to the paper's formula, per category, on rank 0 (its chunks are all
    real elements: a bucket's padding is in the last rank's chunk)."""
    pad, shard_pad = lay["flat"] - P, lay["shard"] - P / n
    in_flight = 2 * lay["last_bucket"] if stage == 2 else 0
    return {
        "parameters": 2 * pad,
        "gradients": 2 * (pad if stage == 1 else shard_pad) + in_flight,
        "optimizer": 12 * shard_pad + 4 * lay["pieces"],
    }


# %% [markdown]
# The paper's bytes are `memory_per_rank(P, N, stage, "mixed")`, the calculator's own formulas:
# ZeRO-1 = 2P + 2P + 12P/N = 4P + 12P/N, ZeRO-2 = 2P + 2P/N + 12P/N = 2P + 14P/N.

# %%
for n, runs in mixed.items():
    for stage, result in zip((1, 2), runs):
        paper, extra, got = (
            memory_per_rank(P, n, stage, "mixed"),
            allowance(stage, n, result),
            backward_end(result),
        )
        for c in got:  # rel_tol: float rounding of P/N only
            assert_match(
                f"N={n} ZeRO-{stage} {c:10} {paper[c]:>9,.0f} B paper + {extra[c]:>6,.0f} B layout,"
                f" {got[c]:>9,} B measured",
                paper[c] + extra[c],
                got[c],
                rel_tol=1e-12,
            )
        print(
            f"   total {sum(got.values()) / P:.3f} bytes/param; paper {'4 + 12' if stage == 1 else '2 + 14'}/{n}"
            f" = {sum(paper[c] for c in got) / P:.3f}"
        )

# %% [markdown]
# The calculator's "mixed" mode for the lab's model, with these rank-0 bars beside the predicted
# ones (black edges; set N to 4 for the other run; other P or N: predictions only).

# %%
measured_mixed = {
    (P, "mixed", n): {1: backward_end(z1), 2: backward_end(z2)} for n, (z1, z2) in mixed.items()
}
memory_calculator(params=P, n=N, stage=2, precision="mixed", measured_stages=measured_mixed)
# %% [markdown]
# Is bf16 ZeRO-1 still the same training? Not to the bit: each rank rounds its partial gradient
# to bf16 before the sum. So five steps are checked against single-process training **with the
# same casts**, within `precision_checks.check_same_casts`'s stated tolerances (4 ulp on step 0's
# gradients, the step-0 loss within eps/8, 10% of how far training moved the weights, and step-0
# gradients that differ from fp32 training's, so fp32 passed off as bf16 fails).

# %%
bf16_zero1 = labkit.run(loop.train, "zero1", CFG_MP, 5, world_size=N)[0]
figures = precision_checks.check_same_casts(bf16_zero1, CFG_MP, "bf16 ZeRO-1")
print(precision_checks.describe(figures))

# %% [markdown]
# **Summary.** Sharding the optimizer state and the gradients cost no extra communication: the
# all-reduce always was a reduce-scatter plus an all-gather, and ZeRO puts the optimizer step
# between them; ZeRO-2 also moves the reduce-scatter into backward, so the full gradient never
# exists at once. In mixed precision the paper's 4P + 12P/N and 2P + 14P/N hold to the byte
# once the layout's padding, the bucket in flight and the step counters are added, and bf16
# ZeRO-1 trains as one process with the same casts does. **Questions.** (a) In the peak bars,
# what else than model state sets the peak, and does ZeRO shrink it? (b) With bf16, which of
# the 16 bytes per parameter does ZeRO-1 shard, and why does ZeRO-2 gain less than in fp32?

# %% [markdown]
# ## 7. Exercises with numbers
#
# A model has 12 GB of weights, 12 GB of gradients and 72 GB of optimizer state, over 8 ranks.
# (a) Per-rank steady state for ZeRO-1, ZeRO-2 and ZeRO-3. (b) ZeRO-3's peak lower bound when the
# largest unsharded layer group is 3 GB and the prefetch buffer for the next one is 3 GB.
# Return a dict of numbers, GB per rank: `{"zero1": ..., "zero2": ..., "zero3": ...,
# "zero3_peak": ...}`.


# %% nbgrader={"grade": false, "grade_id": "memory-answers", "locked": false, "schema_version": 3, "solution": true}
def my_memory_answers():
    ### BEGIN SOLUTION
    weights, grads, optim, n = 12, 12, 72, 8
    return {
        "zero1": weights + grads + optim / n,
        "zero2": weights + (grads + optim) / n,
        "zero3": (weights + grads + optim) / n,
        "zero3_peak": (weights + grads + optim) / n + 3 + 3,
    }
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "memory-answers-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
from labkit.labs.zero_checks import check_memory_answers, check_reduce_scatter_answers

labkit.exercise.check("memory arithmetic", lambda: check_memory_answers(my_memory_answers))

# %% [markdown]
# (c) Rank 0 holds g0 = [1, 2, 3, 4] and rank 1 holds g1 = [10, 20, 30, 40]. What does each rank
# hold after a reduce-scatter with SUM, and with AVG? Return `{"sum": [[a, b], [c, d]], "avg":
# [[...], [...]]}`: for each op a list of two 2-lists, rank 0's two numbers then rank 1's (floats),
# not one flat list of 4. The check runs it on real ranks.


# %% nbgrader={"grade": false, "grade_id": "reduce-scatter-answers", "locked": false, "schema_version": 3, "solution": true}
def my_reduce_scatter_answers():
    ### BEGIN SOLUTION
    return {"sum": [[11.0, 22.0], [33.0, 44.0]], "avg": [[5.5, 11.0], [16.5, 22.0]]}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "reduce-scatter-answers-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
labkit.exercise.check(
    "reduce-scatter by hand", lambda: check_reduce_scatter_answers(my_reduce_scatter_answers)
)

# %% [markdown]
# **Wrap-up.** ZeRO-1 and ZeRO-2 shrink model state to 4P + 4P + 8P/N and 4P + 4P/N + 8P/N
# bytes in fp32 (4P + 12P/N and 2P + 14P/N in mixed precision, measured) with DDP's
# communication volume; ZeRO-2 also lowers the backward peak. Next:
# ZeRO-3 / FSDP also shards the weights and pays 1.5× the communication to gather them layer by
# layer.
