# ---
# jupyter:
#   kernelspec:
#     display_name: Python (labkit course)
#     language: python
#     name: labkit
# ---

# %% [markdown]
# # 01 · Data parallelism by hand: from a ring all-reduce to overlapped, bucketed DDP
#
# Data parallelism (DP) copies the whole model onto every rank, gives each rank a different slice
# of the batch, and averages the gradients so that every replica takes the *same* step. You will
# build it in stages, each checked tensor by tensor against single-process training:
#
# 1. the problem: what one replica costs in memory;
# 2. collectives from send/recv: ring reduce-scatter, all-gather, all-reduce, and their cost;
# 3. naive DDP: broadcast, shard, all-reduce every gradient;
# 4. flat: one all-reduce for all gradients;
# 5. overlapped and bucketed: all-reduce while backward still runs;
# 6. gradient accumulation without extra communication;
# 7. mixed precision: the same 16P as the paper splits it (2 + 2 + 12), measured;
# 8. what DP does not solve (the bridge to ZeRO).
#
# Exercises: replace each `raise NotImplementedError` with your code. Each exercise is followed by
# a check that compares with a reference and names the first mismatch. A check you have not done
# yet says "not implemented yet", one that fails says FAIL and why, and in both cases the cells
# below use labkit's reference instead.

# %%
import labkit  # first (it needs no torch): the ranks' forkserver imports torch on another core meanwhile
import contextlib, math, statistics, time
import matplotlib.pyplot as plt
import torch, torch.distributed as dist
from labkit import exercise, costmodel, loop
from labkit.observe import timeline, trace_stats
from labkit.checks import assert_match, compare
from labkit.units import fmt_bytes
from labkit.data import micro_batches, rank_slice, shard_batch  # noqa: F401 (section 4 asks about shard_batch)
from labkit.observe.memory import MemoryTracker
from labkit.models import num_params
from labkit.strategies import ddp
from labkit import drills
from labkit.labs import ddp_lab

# %% [markdown]
# ## 1 · The problem: every rank holds a full replica
#
# With DP each rank keeps all P parameters, their P gradients, and AdamW's two moments per
# parameter. In the mixed precision of the ZeRO paper that is 2P (fp16 weights) + 2P (fp16
# gradients) + 12P (fp32 master weights, momentum, variance) = **16P bytes per rank**. This lab
# runs in fp32: 4P + 4P + 8P, also 16P (plus AdamW's 4-byte step counter per parameter tensor).
#
# The lab's model is a small GPT whose LM head *is* its token embedding (one Parameter). Every run
# below uses the "dp" preset of `labkit.loop` (model, data, seed, AdamW), here with 8 rows:

# %%
CFG = loop.PRESETS["dp"].replace(batch_size=8)  # the preset's 7 rows come back in section 6
model = loop.build_model(CFG)
P, tensors = num_params(model), len(list(model.parameters()))
print(f"TinyGPT: P = {P:,} parameters in {tensors} tensors (the tied embedding counted once)")

# %% [markdown]
# The formula, then the bytes labkit's `MemoryTracker` finds after one AdamW step:


# %%
def replica_bytes(model):
    """Bytes by category after one forward/backward/AdamW step on this process."""
    optimizer = CFG.make_optimizer(model.parameters())
    with MemoryTracker(model=model, optimizer=optimizer) as tracker:
        x, y = loop.global_batch(CFG, 0)
        model(x, y)[1].backward()
        optimizer.step()
        return tracker.current().by_category


# %%
# NBVAL_CHECK_OUTPUT
measured = replica_bytes(loop.build_model(CFG))
expected = {"parameters": 4 * P, "gradients": 4 * P, "optimizer": 8 * P + 4 * tensors}
for category, nbytes in expected.items():
    assert_match(category, nbytes, measured[category], rel_tol=0)
assert_match(
    "replica (4+4+8)P + 4·tensors", sum(expected.values()), sum(measured[c] for c in expected), rel_tol=0
)

# %% [markdown]
# Tiny here, but 16P is 120 GB for a 7.5B-parameter model: more than one GPU holds. DP divides
# the *batch*, never these bytes. Keep that in mind; section 8 measures it for N = 1, 2, 4.
#
# ## 2 · Collectives from scratch
#
# DP needs one collective: **all-reduce** (every rank ends with the sum of everyone's tensor).
# The ring algorithm builds it from two halves, using only send/recv between neighbours:
#
# * **reduce-scatter**: cut the tensor in n chunks; in n−1 steps each rank sends one chunk to
#   rank+1 and adds the chunk it receives from rank−1. Afterwards rank r holds chunk r, summed.
# * **all-gather**: n−1 more steps pass the finished chunks around the ring.
#
# Each rank sends 2(n−1)/n of the tensor in total, whatever n is.
#
# **Exercise 1.** Write both halves with `dist.isend` / `dist.recv` (send asynchronously, so that
# every rank can receive at the same time without deadlock). `x.numel()` is a multiple of n.


# %% nbgrader={"grade": false, "grade_id": "ring", "locked": false, "schema_version": 3, "solution": true}
def my_reduce_scatter(x):
    """This rank's chunk of the sum over ranks of x (rank r gets chunk r)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    ### BEGIN SOLUTION
    chunks = [c.clone() for c in x.chunk(n)]
    incoming = torch.empty_like(chunks[0])
    for k in range(n - 1):
        request = dist.isend(chunks[(rank - k - 1) % n], dst=(rank + 1) % n)
        dist.recv(incoming, src=(rank - 1) % n)
        chunks[(rank - k - 2) % n] += incoming
        request.wait()
    return chunks[rank]
    ### END SOLUTION


def my_all_gather(shard):
    """Concatenation of every rank's shard, in rank order."""
    rank, n = dist.get_rank(), dist.get_world_size()
    ### BEGIN SOLUTION
    chunks = [torch.empty_like(shard) for _ in range(n)]
    chunks[rank] = shard.clone()
    for k in range(n - 1):
        request = dist.isend(chunks[(rank - k) % n], dst=(rank + 1) % n)
        dist.recv(chunks[(rank - k - 1) % n], src=(rank - 1) % n)
        request.wait()
    return torch.cat(chunks)
    ### END SOLUTION


# %% [markdown]
# The check runs each half alone (so it can say which one is wrong), then composes them into an
# all-reduce, on 2 and 4 ranks.

# %%
from labkit.labs.collective_checks import check_ring

# %% nbgrader={"grade": true, "grade_id": "ring-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
# Not compared by nbval: labkit.run adds a note about oversubscription only on machines with
# fewer than 4 cores.
exercise.check("ring collectives", lambda: check_ring(my_reduce_scatter, my_all_gather))

# %% [markdown]
# Which chunk moves where at each step, for 4 ranks: a cell shows whose data it sums ("0+3"),
# darker means more ranks; outlined cells are sent to rank+1 in that step. Drag the slider.

# %%
ddp_lab.ring_slider(4)

# %% [markdown]
# ### The α–β cost model
#
# A ring all-reduce of S bytes on n ranks takes 2(n−1) steps, each paying a latency α and moving
# S/n bytes at bandwidth β: **t(S) = 2(n−1)·α + 2(n−1)/n · S/β**. Small messages are
# latency-bound (t ≈ constant), large ones bandwidth-bound (t ∝ S). nccl-tests reports
# busbw = S/t · 2(n−1)/n, which approaches β for large S. Measured here with gloo's all-reduce
# (the sizes take turns for 5 rounds, the fastest of each: the machine is shared):


# %%
def all_reduce_times(sizes_bytes, reps=5):
    """The fastest seconds of dist.all_reduce per size (slowest rank), between barriers. The sizes
    take turns, rep by rep: a neighbour's load lands on every size alike, not on one size's reps
    (which would bend the fit); and load only ever adds time, so the fastest rep is the cleanest."""
    tensors, samples = [torch.ones(n // 4) for n in sizes_bytes], [[] for _ in sizes_bytes]
    for _ in range(reps):
        for t, times_of_size in zip(tensors, samples):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times_of_size.append(time.perf_counter() - start)
    out = [min(s) for s in samples]
    worst = torch.tensor(out, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.tolist()


# %%
sizes = [2**k for k in range(10, 23, 2)]  # 1 KiB … 4 MiB
times = labkit.run(all_reduce_times, sizes, world_size=2)[0]
alpha, beta = costmodel.links.fit_alpha_beta(sizes, times, n=2)
print(f"fitted: alpha = {alpha * 1e6:.1f} µs per step, beta = {beta / 1e9:.2f} GB/s (bus bandwidth)")

# %%
busbw = [trace_stats.busbw("all_reduce", s, t, 2) for s, t in zip(sizes, times)]
model_bw = [trace_stats.busbw("all_reduce", s, 2 * alpha + s / beta, 2) for s in sizes]
fig, ax = plt.subplots(figsize=(8, 4))
ax.semilogx(sizes, busbw, "o-", label="measured (gloo, 2 ranks)")
ax.semilogx(sizes, model_bw, "--", label="α–β fit")
ax.axvline(alpha * beta, color="gray", ls=":", label="S = α·β: latency = bandwidth term")
ax.set(xlabel="message size (bytes)", ylabel="busbw (GB/s)", title="all-reduce bus bandwidth")
ax.legend()
plt.show()

# %% [markdown]
# Left of the dotted line the message is too small to fill the link: latency dominates, and
# sending many small tensors wastes time. That is what stages 4 and 5 fix.
#
# **Questions.** Why does the ring send 2(n−1)/n and not 2(n−1) tensors per rank? What would a
# naive all-reduce (everyone sends to rank 0) cost rank 0?
#
# ## 3 · Naive DDP
#
# Three rules keep the replicas identical:
# 1. **same start**: broadcast rank 0's initial weights (here each rank initialises with its own
#    seed, as separate processes would);
# 2. **disjoint data**: rank r takes its own rows of the global batch, no overlap, nothing missed;
# 3. **same gradient**: all-reduce every gradient, then every rank runs the same AdamW step.
#
# SUM or AVG? Two ranks with gradients g0 = [1, 2, 3, 4] and g1 = [5, 6, 7, 8]:


# %%
def sum_and_avg():
    g = torch.tensor([1.0, 2, 3, 4]) if dist.get_rank() == 0 else torch.tensor([5.0, 6, 7, 8])
    dist.all_reduce(g)  # gloo reduces with SUM
    return g.tolist(), (g / dist.get_world_size()).tolist()


# %%
# NBVAL_CHECK_OUTPUT
total, average = labkit.run(sum_and_avg, world_size=2)[0]
print("SUM:", total, "  AVG:", average)

# %% [markdown]
# If each rank's loss is the **mean** over its own rows and the shards are equal, the full-batch
# gradient is the AVG. With unequal shards it is not (7 rows on 2 ranks: 4 and 3). The exact rule
# for any split: each rank **sums** its token losses and divides by the **global** token count;
# then the SUM of the ranks' gradients is the full-batch gradient. The course's one training loop,
# `labkit.loop.train`, does that, so your strategy reduces with SUM.

# %%
# NBVAL_CHECK_OUTPUT
for batch, n in ((8, 2), (7, 2), (6, 4)):
    print(f"{batch} rows on {n} ranks:", [rank_slice(batch, r, n) for r in range(n)])

# %% [markdown]
# **Exercise 2.** Write `my_broadcast_parameters` and `MyDDPNaive`. The check runs
# `loop.train` through `ddp_lab.LabDDP`, which builds the model (seed = rank, as separate processes
# would), calls `MyDDPNaive(model)`, and after each backward `sync_gradients()`.
# Frozen parameters (`requires_grad=False`) get no gradient: skip them. A tied weight is one
# Parameter, which `model.parameters()` lists once: it is reduced once.


# %% nbgrader={"grade": false, "grade_id": "naive-ddp", "locked": false, "schema_version": 3, "solution": true}
def my_broadcast_parameters(model):
    ### BEGIN SOLUTION
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)
    ### END SOLUTION


class MyDDPNaive:
    """Stage 1: one blocking all-reduce per gradient after backward. Leaves out: batching, overlap."""

    def __init__(self, model):
        ### BEGIN SOLUTION
        my_broadcast_parameters(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        ### END SOLUTION

    def sync_gradients(self):
        ### BEGIN SOLUTION
        for p in self.params:
            dist.all_reduce(p.grad)  # SUM: each rank's loss is already / global token count
        ### END SOLUTION


# %% [markdown]
# The check trains 5 AdamW steps on 2 ranks and compares with single-process training on the
# whole global batch (fp32, rtol 1e-5, atol 1e-7): first the step-0 gradients, then the weights.
# Gradients first, because AdamW divides by √v: a gradient N× too large moves the weights almost
# exactly as much, and only the gradient check catches SUM-vs-AVG.

# %%
reference = loop.reference(CFG, 5)
ref_state, ref_grads = reference["state"], reference["grads"]


def check_strategy(strategy, **kwargs):
    results = labkit.run(loop.train, ddp_lab.LabDDP, CFG, 5, ddp=strategy, world_size=2, **kwargs)
    ddp_lab.check_ddp(ref_grads, results, "grads", label="step-0 gradients")
    ddp_lab.check_ddp(ref_state, results, "state", label="weights after 5 steps", verbose_rank=None)
    return results


# %% nbgrader={"grade": true, "grade_id": "naive-ddp-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("naive DDP", lambda: check_strategy(MyDDPNaive))

# %%
naive_impl = exercise.pick("naive DDP", MyDDPNaive, ddp.DDPNaive)
naive_results = exercise.result("naive DDP")  # None unless your check passed

# %% [markdown]
# Two oracles in one launch: PyTorch's own `DistributedDataParallel` on the same data (it
# averages; the loop scales its loss by N so the convention matches), and the lab's classic
# mistakes (`labkit.drills`): forgetting the broadcast, and every rank training on the whole
# batch (overlapping shards, which looks exactly like SUM instead of AVG).


# %%
def oracles_and_mistakes():
    return {
        "torch DDP": loop.train("torch-ddp", CFG, 5, bucket_cap_mb=0.02),
        "no broadcast": loop.train(drills.NoBroadcast, CFG, 1),
        "whole batch on every rank": loop.train(
            "ddp-naive", CFG, 1, hooks=loop.Hooks(shard=drills.whole_batch_on_every_rank)
        ),
    }


runs = labkit.run(oracles_and_mistakes, world_size=2)
torch_results = [r["torch DDP"] for r in runs]

# %%
ddp_lab.check_ddp(ref_state, torch_results, "state", label="torch DDP, weights", verbose_rank=None)
if naive_results is not None:
    print(compare(torch_results[0]["state"], naive_results[0]["state"]).summary(), "— yours vs torch DDP")

# %% [markdown]
# And what the check says about the two mistakes:

# %%
state_after_1 = loop.reference(CFG, 1)["state"]
for name, key, ref in (
    ("no broadcast", "state", state_after_1),
    ("whole batch on every rank", "grads", ref_grads),
):
    try:
        ddp_lab.check_ddp(ref, [r[name] for r in runs], key, verbose_rank=None)
    except AssertionError as err:
        print(f"--- {name}: {err}\n")

# %% [markdown]
# **Questions.** Why would a rank that skipped the broadcast still pass the gradient check at
# step 0 on rank 0? Which of the three rules does `shard_batch` (the loop's sampler) enforce?
#
# ## 4 · Flat: one all-reduce instead of one per tensor
#
# Naive DDP issues one all-reduce per parameter tensor, and section 2 showed that small messages
# are latency-bound. Copy all gradients into one flat buffer, all-reduce it once, copy back.
#
# **Exercise 3.** Write `MyDDPFlat.sync_gradients`.


# %% nbgrader={"grade": false, "grade_id": "flat-ddp", "locked": false, "schema_version": 3, "solution": true}
class MyDDPFlat:
    """Stage 2: one all-reduce over a flat copy of all gradients. Leaves out: overlap; the buffer
    costs another 4P bytes."""

    def __init__(self, model):
        ddp.broadcast_parameters(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.flat = torch.zeros(sum(p.numel() for p in self.params))

    def sync_gradients(self):
        ### BEGIN SOLUTION
        torch.cat([p.grad.reshape(-1) for p in self.params], out=self.flat)
        dist.all_reduce(self.flat)
        offset = 0
        for p in self.params:
            p.grad.copy_(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "flat-ddp-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("flat DDP", lambda: check_strategy(MyDDPFlat))

# %%
flat_impl = exercise.pick("flat DDP", MyDDPFlat, ddp.DDPFlat)
flat_results = exercise.result("flat DDP")  # None unless your check passed

# %% [markdown]
# The tracer counted every collective on every rank. Per step (5 steps; the broadcasts happen
# once, at start-up):

# %%
# NBVAL_CHECK_OUTPUT
trainable = len([p for p in loop.build_model(CFG).parameters() if p.requires_grad])
for name, results in (("naive", naive_results), ("flat", flat_results)):
    if results is None:
        results = labkit.run(loop.train, f"ddp-{name}", CFG, 5)
    count, nbytes = trace_stats.collective_counts(results.traces[0])["all_reduce"]
    assert_match(f"{name}: all-reduces per step", trainable if name == "naive" else 1, count / 5, unit="")
    print(f"   {fmt_bytes(nbytes / 5)} all-reduced per step either way")

# %% [markdown]
# ## 5 · Overlapped and bucketed
#
# Flat DDP waits for the whole backward before communicating. But the last layers' gradients are
# ready first, while backward is still computing the first layers'. So: group parameters into
# **buckets** of about `bucket_cap_mb`, in reverse order (backward's order); when every gradient of
# a bucket has been accumulated (`param.register_post_accumulate_grad_hook`), copy the bucket into
# its buffer and launch an **async** all-reduce; before the optimizer step, wait for all of them.
# Launch buckets strictly in order: every rank must issue the same collectives in the same order.
#
# **Exercise 4.** Write the hook and `sync_gradients` of `MyDDPBucketed`.


# %% nbgrader={"grade": false, "grade_id": "bucketed-ddp", "locked": false, "schema_version": 3, "solution": true}
class MyDDPBucketed:
    """Stage 3: async all-reduce per bucket, launched from backward hooks. Leaves out: unused
    parameters (see ddp.DDPBucketed), grads as views of the buckets, no_sync (section 6)."""

    def __init__(self, model, bucket_cap_mb=0.02):
        ddp.broadcast_parameters(model)
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.buckets, size = [[]], 0
        for p in params:
            if self.buckets[-1] and size + 4 * p.numel() > bucket_cap_mb * 2**20:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += 4 * p.numel()
        self.buffers = [torch.zeros(sum(p.numel() for p in b)) for b in self.buckets]
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.ready, self.works = [set() for _ in self.buckets], []
        for p in params:
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def grad_ready(self, param):
        ### BEGIN SOLUTION
        self.ready[self.bucket_of[param]].add(param)
        while len(self.works) < len(self.buckets) and len(self.ready[len(self.works)]) == len(
            self.buckets[len(self.works)]
        ):
            index = len(self.works)
            torch.cat([p.grad.reshape(-1) for p in self.buckets[index]], out=self.buffers[index])
            self.works.append(dist.all_reduce(self.buffers[index], async_op=True))
        ### END SOLUTION

    def sync_gradients(self):
        ### BEGIN SOLUTION
        for work, bucket, buffer in zip(self.works, self.buckets, self.buffers):
            work.wait()
            offset = 0
            for p in bucket:
                p.grad.copy_(buffer[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.ready, self.works = [set() for _ in self.buckets], []
        ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "bucketed-ddp-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("bucketed DDP", lambda: check_strategy(MyDDPBucketed))

# %%
bucketed_impl = exercise.pick("bucketed DDP", MyDDPBucketed, ddp.DDPBucketed)
bucketed_results = exercise.result("bucketed DDP")  # None unless your check passed

# %% [markdown]
# Did communication start before backward ended? In every step, compare each bucket's launch
# with the end of that step's backward span on rank 0:


# %%
# NBVAL_CHECK_OUTPUT
def launched_during_backward(trace):
    backward = [(s["start"], s["end"]) for s in trace["spans"] if s["name"] == "backward"]
    launches = [e["start"] for e in trace["events"] if e["op"] == "all_reduce"]
    return sum(any(lo <= t <= hi for lo, hi in backward) for t in launches), len(launches)


results = bucketed_results or labkit.run(loop.train, "ddp-bucketed", CFG, 5, bucket_cap_mb=0.02)
early, total_events = launched_during_backward(results.traces[0])
print(f"{early} of {total_events} bucket all-reduces started before their step's backward ended")

# %% [markdown]
# Now the experiment on real ranks: your bucketed DDP and torch's DDP with the **same**
# `bucket_cap_mb`, 4 steps each, in one launch. The timeline shows your last step (orange:
# compute, hatched: waiting; blue: all-reduces); the table gives the median step time (steps
# 2–4), the all-reduces per step and the overlap % measured by the tracer. On this 2-core
# machine the communication thread competes with compute, so look at *when* communication
# happens more than at the step time. (torch's DDP waits for its buckets in C++ at the end of
# backward, where the tracer cannot see it blocked: its overlap % is an upper bound.)


# %%
def bucket_experiment(strategy, bucket_mb, steps=4):
    out = {}
    for name, variant, options in (
        ("yours", ddp_lab.LabDDP, dict(ddp=strategy)),
        ("torch DDP", "torch-ddp", {}),
    ):
        start = time.perf_counter()
        out[name] = loop.train(variant, CFG, steps, bucket_cap_mb=bucket_mb, **options)
        out[name]["window"] = (start, time.perf_counter())
        del out[name]["state"], out[name]["grads"]
    return out


def run_experiment(world_size, bucket_mb):
    return labkit.run(bucket_experiment, bucketed_impl, bucket_mb, world_size=world_size)


# %%
def steps_of(results, name):
    """Rank 0's step spans of one variant, and the trace window from its 2nd to its last step."""
    start, end = (t - results.traces[0]["t0"] for t in results[0][name]["window"])
    steps = [s for s in trace_stats.steps(results.traces[0]) if start <= s[0] <= end]
    return steps, (steps[1][0], steps[-1][1])


def draw_experiment(results):
    trace = results.traces[0]
    for name in ("yours", "torch DDP"):
        steps, (lo, hi) = steps_of(results, name)
        count = sum(lo <= e["start"] <= hi and e["op"] == "all_reduce" for e in trace["events"])
        overlap = trace_stats.overlap_stats(trace, t_range=(lo, hi))["overlap_pct"] or 0
        print(
            f"{name:>10}: median step {1e3 * max(r[name]['median_step_s'] for r in results):6.1f} ms, "
            f"{count / (len(steps) - 1):.0f} all-reduces per step, overlap {overlap:.0f}% (rank 0)"
        )
    last = steps_of(results, "yours")[0][-1]
    shift = trace["t0"] - min(t["t0"] for t in results.traces)  # the chart's time axis
    lo, hi = ((t + shift) * 1e3 for t in last)
    timeline.plot_timeline(
        results.traces,
        title=f"your bucketed DDP, last step, {len(results)} ranks",
        t_range=(lo - 0.5, hi + 0.5),
    )


# %%
ddp_lab.experiment_controls(run_experiment, draw_experiment)

# %% [markdown]
# **Questions.** What happens to the number of all-reduces and to the overlap when the bucket is
# bigger than all gradients together? When it is smaller than the smallest tensor? Why does the
# first bucket to be launched hold the *last* layers?
#
# ## 6 · Gradient accumulation
#
# A global batch too big for memory is processed as K micro-batches per rank, accumulating into
# `.grad`. Communicating after every micro-batch would cost K all-reduces per step; only the last
# one is needed. Inside `no_sync()` the bucket hooks do nothing; on the last micro-batch they fire
# with the accumulated gradient. The loss must still be the global-batch mean: every micro-batch's
# **summed** loss divided by the **global** token count, not a mean of means (7 rows on 2 ranks
# with K = 2 gives micro-batches of 2, 2, 2 and 1 rows).
#
# **Exercise 5.** Write one training step with K micro-batches.


# %% nbgrader={"grade": false, "grade_id": "accumulation", "locked": false, "schema_version": 3, "solution": true}
def my_accumulated_step(strategy, model, optimizer, x, y, k, global_tokens):
    """x, y: this rank's shard; strategy: a DDP with no_sync() and sync_gradients()."""
    ### BEGIN SOLUTION
    optimizer.zero_grad(set_to_none=True)
    parts = micro_batches(x, y, k)
    for i, (xi, yi) in enumerate(parts):
        last = i == len(parts) - 1
        with contextlib.nullcontext() if last else strategy.no_sync():
            loss = model(xi, yi, reduction="sum")[1] / global_tokens
            loss.backward()
    strategy.sync_gradients()
    optimizer.step()
    ### END SOLUTION


# %% [markdown]
# Checked against single-process training on the whole 7-row batch: the step-0 gradients at
# rtol 1e-5 / atol 1e-7. The weights after 5 steps get rtol 1e-5 / atol 1e-5: splitting each shard
# again changes the fp32 summation order, and AdamW amplifies that noise on near-zero gradients
# (the check prints the largest difference it found in this run: a few 1e-6). Then the tracer's
# all-reduce count: one per bucket per step, not K per bucket. The check is
# `ddp_lab.accumulation_check`: it runs your step in `ddp_lab.train_accumulated` (the loop's
# model, batches and AdamW, with `ddp.DDPBucketed`), 5 steps of K = 2 on 2 ranks.


# %% nbgrader={"grade": true, "grade_id": "accumulation-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
# Not compared by nbval: the max |diff| depends on the CPU's kernels and thread count.
exercise.check("gradient accumulation", lambda: ddp_lab.accumulation_check(my_accumulated_step))

# %% [markdown]
# ## 7 · Mixed precision: the paper's 2 + 2 + 12, measured
#
# So far every byte was fp32: 4P + 4P + 8P. The ZeRO paper's 16P is a different split of the same
# total. With `MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)` the replica's weights are cast
# to bf16 (forward and backward compute in bf16, so autograd makes bf16 gradients: 2P + 2P) and
# the optimizer steps an **fp32 master copy** (4P), with Adam's moments (8P): the paper's K = 12.
# After the step the masters are cast back into the bf16 replica. Measured at the end of the
# second step's backward (the steady state), fp32 and bf16 side by side:

# %%
from labkit.strategies.precision import MixedPrecision
from labkit.labs import precision_checks

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


def state_after_backward(cfg):
    """Parameter / gradient / optimizer bytes at the end of step 2's backward, on this rank."""
    result = loop.train("ddp-bucketed", cfg, 2, track_memory=True, return_state=False)
    end = [s for s in result["memory"].samples if s.label == "backward end"][-1]
    return {c: end.by_category[c] for c in ("parameters", "gradients", "optimizer")}


# %%
# NBVAL_CHECK_OUTPUT
bills = labkit.run(
    lambda: {tag: state_after_backward(CFG.replace(mp=mp)) for tag, mp in (("fp32", None), ("bf16", BF16))},
    world_size=2,
)[0]
paper = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}  # bytes per parameter: weights, grads, optimizer
for tag, per_param in paper.items():
    for category, k in zip(("parameters", "gradients", "optimizer"), per_param):
        extra = 4 * tensors if category == "optimizer" else 0  # AdamW's step counters
        assert_match(f"{tag} {category} = {k}P", k * P + extra, bills[tag][category], rel_tol=0)

# %%
fig, ax = plt.subplots(figsize=(6, 3))
for i, (category, color) in enumerate(
    (("parameters", "#1f77b4"), ("gradients", "#ff7f0e"), ("optimizer", "#9467bd"))
):
    left = [sum(bills[t][c] for c in ("parameters", "gradients", "optimizer")[:i]) / P for t in bills]
    ax.barh(list(bills), [bills[t][category] / P for t in bills], left=left, label=category, color=color)
ax.set(xlabel="bytes per parameter (measured)", title="One replica: the same 16P, split differently")
ax.legend(loc="lower right", fontsize=8)
plt.show()

# %% [markdown]
# Same total, so mixed precision does not shrink the replica; what it buys is bf16 compute and
# half the bytes on the wire when gradients are reduced in bf16 (ZeRO and FSDP then shard the 12).
#
# Is it still the same training? Not bit for bit: each rank rounds its partial gradient to bf16
# before the sum, single-process training rounds the whole gradient once. So the check is against
# single-process training **with the same casts** (`loop.reference` on a preset with `mp`), with
# tolerances that each say what they catch (`precision_checks.check_same_casts`: 4 ulp on the
# step-0 gradients, the step-0 loss within eps/8, 10% of the training's movement, and step-0
# gradients that differ from fp32 training's, so fp32 passed off as bf16 fails):

# %%
CFG16 = CFG.replace(mp=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
bf16_run = labkit.run(loop.train, "ddp-bucketed", CFG16, world_size=2)[0]
figures = precision_checks.check_same_casts(bf16_run, CFG16, "bf16 DDP, fp32 reduction")
print(precision_checks.describe(figures))

# %% [markdown]
# And on a longer run: fp32 and bf16 loss curves on the course's corpus, 40 steps each.

# %%
curves = labkit.run(
    loop.sweep,
    [dict(cfg=CFG), dict(cfg=CFG16)],
    strategy="ddp-bucketed",
    steps=40,
    return_state=False,
    world_size=2,
)[0]
fp32_loss, bf16_loss = curves[0]["losses"], curves[1]["losses"]
late = statistics.mean(bf16_loss[-10:]) / statistics.mean(fp32_loss[-10:]) - 1
worst = max(abs(a - b) / a for a, b in zip(fp32_loss, bf16_loss))
assert abs(late) < 0.02, f"bf16's last 10 losses average {late:+.1%} off fp32's"
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(fp32_loss, label="fp32")
ax.plot(bf16_loss, "--", label="bf16 compute, fp32 master")
ax.set(xlabel="step", ylabel="loss", title=f"last 10 steps: {late:+.2%}; one step at most {worst:.1%} apart")
ax.legend()
plt.show()

# %% [markdown]
# The curves lie on top of each other, except where one bf16 rounding tips a step (a spike of a
# few percent that the next steps absorb): bf16 changes the noise, not the training.

# %% [markdown]
# fp16 has bf16's precision and far less range: gradients below ~6e-8 flush to zero. Hence
# **dynamic loss scaling**: multiply the loss by S before backward, divide the gradients by S
# before the step; a step whose gradients overflowed (inf or nan) is skipped and S halved, and S
# doubles again after `growth_interval` good steps. Started far too high (2^24), it finds its level:

# %%
FP16 = MixedPrecision(
    param_dtype=torch.float16, reduce_dtype=torch.float32, init_scale=2.0**24, growth_interval=10
)
scaler_report = lambda s: {"skipped": s.mp.scaler.skipped, "scale": s.mp.scaler.scale}
fp16_run = labkit.run(
    loop.train,
    "ddp-bucketed",
    CFG.replace(mp=FP16),
    steps=20,
    hooks=loop.Hooks(report=scaler_report),
    return_state=False,
    world_size=2,
)[0]
assert fp16_run["skipped"] > 0, "no step overflowed at a loss scale of 2^24: is the loss scaled?"
print(f"{fp16_run['skipped']} of 20 steps skipped; the scale settled at 2^{math.log2(fp16_run['scale']):.0f}")
print("losses:", " ".join(f"{x:.2f}" for x in fp16_run["losses"]))

# %% [markdown]
# The first losses barely move: those steps were skipped (the weights did not change, only the
# batch did). **Try it:** `init_scale=1.0` with fp16 trains too on this model; on which models would
# it not? (Hint: how small are the gradients of a deep network's first layers?)
#
# %% [markdown]
# ## 8 · What DP does not solve
#
# DP splits the batch; it does not split the model. The bytes per rank for the parameters,
# gradients and AdamW state should be the same 16P whatever N is. Measured on real ranks:


# %%
def replica_bytes_on_rank():
    # One step of naive DDP, tracked; 4 rows are enough: the batch changes activations, not these
    # three categories. The last sample is the loop's "after step".
    result = loop.train("ddp-naive", CFG.replace(batch_size=4), 1, track_memory=True, return_state=False)
    usage = result["memory"].samples[-1].by_category
    return {c: usage[c] for c in ("parameters", "gradients", "optimizer")}


# %%
# NBVAL_CHECK_OUTPUT
per_n = {n: labkit.run(replica_bytes_on_rank, world_size=n)[0] for n in (1, 2, 4)}
for n, usage in per_n.items():
    assert_match(f"N = {n}: bytes per rank", 16 * P + 4 * tensors, sum(usage.values()), rel_tol=0)

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
bottom = [0] * 3
for category, color in (("parameters", "#1f77b4"), ("gradients", "#ff7f0e"), ("optimizer", "#9467bd")):
    values = [per_n[n][category] / 2**20 for n in per_n]
    ax.bar([str(n) for n in per_n], values, bottom=bottom, label=category, color=color)
    bottom = [b + v for b, v in zip(bottom, values)]
ax.set(xlabel="ranks N", ylabel="MiB per rank", title="DP: memory per rank does not shrink with N")
ax.legend()
plt.show()

# %% [markdown]
# ## Summary
#
# * DP keeps a full replica (16P bytes) on every rank; only the batch is divided.
# * Mixed precision splits those 16P as 2 (bf16 weights) + 2 (bf16 gradients) + 12 (fp32 master,
#   Adam's moments): measured, not just counted; it trains like the same casts on one process,
#   and fp16 needs a dynamic loss scale.
# * A ring all-reduce = reduce-scatter + all-gather, 2(n−1)/n of the data per rank; its time is
#   α per step plus bytes over bandwidth, so small messages waste latency.
# * Correct DP = same start (broadcast), disjoint shards, the gradient of the *global* mean: sum
#   per rank, divide by the global token count, SUM across ranks (or mean + AVG for equal shards).
# * Flat buffers cut P collectives to one; buckets launched from backward hooks overlap
#   communication with the rest of backward; `no_sync` skips communication on all but the last
#   micro-batch.
#
# **Open questions.** Each rank keeps the same AdamW state as every other rank: 8P bytes stored N
# times. Does every rank need all of it to update its parameters? What if each rank updated only
# 1/N of them and then shared the result? That is ZeRO, the next lab (`zero1_lab`).
