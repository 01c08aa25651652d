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
# # 03 · FSDP by hand: shard every parameter, gather a unit, free it again
#
# ZeRO-2 sharded the gradients and the Adam state; every rank still held all the weights.
# FSDP shards **the weights too**: each rank keeps 1/N of every parameter, its gradient and its
# optimizer state, and a unit's full weights exist only while that unit computes.
# You write FSDP the way PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) does it, one
# parameter at a time, in six exercises, on real gloo ranks; then you measure
# every byte it saves on a model whose memory is its state (sections 7-12), what mixed precision,
# CPU offload and activation checkpointing do to the rest of the bill (13-14), and checkpoints, the common
# mistakes and the real APIs (15-18).

# %%
import labkit  # first (it needs no torch): the ranks' forkserver imports torch on another core meanwhile
import torch
import torch.distributed as dist
import torch.nn as nn

from labkit import exercise, loop, strategies
from labkit.checks import assert_match, compare
from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter
from labkit import drills
from labkit.labs import fsdp_checks, fsdp_checks_hooks, fsdp_checks_loop, fsdp_lab
from labkit.labs.fsdp_lab import assign_params, peak_formula, unit_sizes
from labkit.models import num_params
from labkit.observe.memory_plot import plot_memory_timeline
from labkit.observe.timeline import plot_timeline
from labkit.observe.trace_stats import overlap_stats
from labkit.strategies.fsdp import collective_counts as fsdp_counts, fully_shard_by_hand, plan_units
from labkit.units import fmt_bytes

# %%
CFG = loop.PRESETS["fsdp"]  # the model, batch, seed and AdamW of every run below
COUNTS = loop.Hooks(report=fsdp_counts)  # runs that report their all-gathers / reduce-scatters
model = loop.build_model(CFG)
P, N = num_params(model), 2
sizes = unit_sizes(model, CFG.units)
print(
    f"TinyGPT: {P:,} parameters in {len(sizes) - 1} blocks + the root; numel per unit (root first): {sizes}"
)  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## 1. Shard one parameter
#
# FSDP2 cuts **every parameter along dim 0**: with R = ⌈rows / N⌉, rank r keeps rows
# [rR, (r+1)R), and the last ranks' shards are padded with zero rows so that every rank holds the
# same shape (that is what lets one all-gather of equal pieces rebuild the tensor). The worked
# example: 8 parameters on 2 ranks, rank 0 holds w0..w3, rank 1 w4..w7; an **all-gather** gives
# every rank w0..w7, and after backward a **reduce-scatter** leaves rank r the sum of every rank's
# gradient over its own rows. **Exercise 1:** `shard_dim0` (pad, keep this rank's rows) and
# `gather_dim0` (all-gather the shards with `ring_all_gather`, drop the padding). R is the
# ceiling, `-(-rows // N)`: 6 rows on 3 ranks are 2 per rank (`rows // N + 1` would give 3).


# %% nbgrader={"grade": false, "grade_id": "shard-param", "locked": false, "schema_version": 3, "solution": true}
def shard_dim0(full, rank, world_size):
    ### BEGIN SOLUTION
    rows = -(-full.shape[0] // world_size)  # ceil: every rank the same number of rows
    padded = full.new_zeros((rows * world_size, *full.shape[1:]))
    padded[: full.shape[0]] = full
    return padded[rank * rows : (rank + 1) * rows].clone()
    ### END SOLUTION


def gather_dim0(shard, dim0):
    ### BEGIN SOLUTION
    out = shard.new_empty((shard.shape[0] * dist.get_world_size(), *shard.shape[1:]))
    ring_all_gather(out, shard)  # rank r's rows land at rows [rR, (r+1)R)
    return out[:dim0]  # the padding goes
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "shard-param-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
# 3 ranks: a 7x3 tensor (2 padding rows), 8 elements, 2 rows (rank 2 holds only padding), 6 rows.
exercise.check("shard one parameter", lambda: fsdp_checks.check_shard(shard_dim0, gather_dim0))

# %% [markdown]
# The worked example on 2 ranks, with your functions (labkit's until yours pass): each rank
# shards w0..w7, gathers them back, and reduce-scatters gradient g_r = (r + 1) everywhere.

# %%
shard_fn, gather_fn = exercise.pick(
    "shard one parameter", (shard_dim0, gather_dim0), (fsdp_lab.shard_rows, fsdp_lab.gather_rows)
)


def worked_example():
    rank, n = dist.get_rank(), dist.get_world_size()
    shard = shard_fn(torch.arange(8.0), rank, n)
    grad_shard = torch.empty(4)
    ring_reduce_scatter(grad_shard, torch.full((8,), 1.0 + rank), op="sum")
    return shard.tolist(), gather_fn(shard, 8).tolist(), grad_shard.tolist()


for rank, (shard, full, grad) in enumerate(labkit.run(worked_example, world_size=2)):
    print(f"rank {rank}: shard {shard}, gathered {full}, summed grad shard {grad}")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# **Summary.** A parameter's shard is R rows (padding included) on every rank; all-gather then
# slice rebuilds it, reduce-scatter gives each rank the sum over its rows. *Question:* a 7-row
# weight on 4 ranks: how many padding rows, and on which rank?

# %% [markdown]
# ## 2. One unit: unshard, reshard
#
# A **unit** (one `fully_shard` call: a block, or the root) gathers all its parameters with
# **one** all-gather: copy the unit's shards into one send buffer, all-gather into one receive
# buffer (row r of it, viewed as (N, shard elements), is rank r's send buffer), then copy each
# parameter's rows out into its **unsharded parameter**. Two tricks make freeing cheap and safe:
#
# * The unsharded parameter is an `nn.Parameter` created once; **reshard frees its storage**,
#   `full.untyped_storage().resize_(0)`, and unshard **refills the same storage**
#   (`resize_` back, then copy). The tensor object survives with zero bytes. Autograd keeps
#   references to the tensors it saved in forward (a Linear saves its weight), so those stay
#   valid and cost nothing until the pre-backward unshard refills them.
# * The copy goes through `full.data`, a tensor on the same storage with its own version
#   counter: writing into `full` itself would bump the version autograd recorded when it saved
#   the weight, and backward would refuse it as "modified by an inplace operation".
#
# **Exercise 2:** `MyUnit(slots)`, where `slots` (from `assign_params`, as `fully_shard` assigns
# parameters) lists each parameter with every (module, attribute) holding it. Shard each one into
# an `nn.Parameter` (the module holds it between steps: `use`), keep an empty unsharded twin, and
# write `start_unshard` (issue the batched all-gather, `async_op=True`, handle in `self.handle`),
# `unshard` (wait, copy out, let the module use the unsharded parameters) and `reshard`. The
# check counts the all-gathers of one unshard in labkit's tracer (one per unit; torch's own
# `dist.all_gather` bypasses the tracer and is refused) and that the handle is waited for.


# %% nbgrader={"grade": false, "grade_id": "unit", "locked": false, "schema_version": 3, "solution": true}
class MyUnit:
    """One unit's parameters, sharded in place; one batched all-gather. Leaves out: hooks."""

    def __init__(self, slots):
        self.slots, self.rank, self.n = slots, dist.get_rank(), dist.get_world_size()
        self.shards, self.unsharded, self.handle = [], [], None
        ### BEGIN SOLUTION
        for p, _ in slots:
            self.shards.append(nn.Parameter(shard_dim0(p.detach(), self.rank, self.n), p.requires_grad))
            full = nn.Parameter(torch.empty_like(p), p.requires_grad)
            full.untyped_storage().resize_(0)  # no bytes until unshard
            self.unsharded.append(full)
        ### END SOLUTION
        self.use(self.shards)

    def use(self, tensors):
        for (_, uses), t in zip(self.slots, tensors):
            for module, name in uses:
                module._parameters[name] = t

    def start_unshard(self):
        if self.handle is not None or self.unsharded[0].untyped_storage().nbytes() > 0:
            return  # in flight, or gathered already
        ### BEGIN SOLUTION
        self.send = torch.cat([s.detach().reshape(-1) for s in self.shards])
        self.recv = self.send.new_empty(self.n * self.send.numel())
        self.handle = ring_all_gather(self.recv, self.send, async_op=True)
        ### END SOLUTION

    def unshard(self):
        self.start_unshard()
        if self.handle is not None:
            ### BEGIN SOLUTION
            self.handle.wait()
            rows, offset = self.recv.view(self.n, -1), 0
            for shard, full in zip(self.shards, self.unsharded):
                k = shard.numel()
                full.untyped_storage().resize_(full.numel() * full.element_size())
                full.data.copy_(rows[:, offset : offset + k].reshape(-1, *shard.shape[1:])[: full.shape[0]])
                offset += k
            self.handle = self.send = self.recv = None
            ### END SOLUTION
        self.use(self.unsharded)

    def reshard(self):
        ### BEGIN SOLUTION
        for full in self.unsharded:
            full.untyped_storage().resize_(0)
        self.use(self.shards)
        ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "unit-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
# 2 ranks, Linear(5, 7) + LayerNorm(7): the shards, the bytes after each call, the values, and a
# tensor taken at the first unshard (as autograd saves it) seen again after reshard + unshard,
# with a backward through it.
exercise.check("one unit", lambda: fsdp_checks.check_unit(MyUnit))

# %% [markdown]
# Now watch it in the memory tracker: one block of the lab's model, sharded on 2 ranks; its full
# weights appear at unshard and disappear at reshard (your unit, or labkit's `fully_shard_by_hand`
# until yours passes). `fsdp_lab.watch_one_unit` reads the tracker's total after sharding, after
# `unshard()` and after `reshard()`.

# %%
make_unit = exercise.pick("one unit", lambda m: MyUnit(assign_params(m, [])[-1]), fully_shard_by_hand)
sharded_b, unsharded_b, resharded_b = labkit.run(fsdp_lab.watch_one_unit, make_unit, CFG, world_size=2)[0]
block_numel = sizes[1]
assert_match("unshard adds the block's full weights, 4 x numel", 4 * block_numel, unsharded_b - sharded_b)
assert_match("reshard frees them all", sharded_b, resharded_b)
block_params = len(list(model.blocks[0].parameters()))
assert block_params == 12, f"a block holds {block_params} parameters (the question below says 12)"

# %% [markdown]
# **Summary.** A unit is one all-gather; its unsharded parameters are tensors whose storage
# comes and goes, so the objects autograd holds stay the same. *Question:* why does
# `start_unshard` copy the shards into a new send buffer instead of all-gathering each
# parameter separately (count the messages for a block of 12 parameters)?

# %% [markdown]
# ## 3. The forward hooks
#
# `fully_shard` hooks the unit's module: a **pre-forward hook** unshards (the module now computes
# with the full weights), a **post-forward hook** reshards if `reshard_after_forward`. The root
# unit (the model itself, holding the embedding, the final LayerNorm and the tied LM head) is
# never resharded after forward: its weights are needed again right away by the backward.
# **Exercise 3:** `hook`, `pre_forward`, `post_forward`.


# %% nbgrader={"grade": false, "grade_id": "forward-hooks", "locked": false, "schema_version": 3, "solution": true}
class HookedUnit(MyUnit):
    """Unshard before the module's forward, reshard after it. Leaves out: backward."""

    reshard_after_forward = True

    def hook(self, module):
        ### BEGIN SOLUTION
        module.register_forward_pre_hook(self.pre_forward)
        module.register_forward_hook(self.post_forward)
        ### END SOLUTION

    def pre_forward(self, module, args):
        ### BEGIN SOLUTION
        self.unshard()
        ### END SOLUTION

    def post_forward(self, module, args, output):
        ### BEGIN SOLUTION
        if self.reshard_after_forward:
            self.reshard()
        ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "forward-hooks-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
# A 2-block TinyGPT on 2 ranks: which units are gathered during and after each block, and the logits.
exercise.check("forward hooks", lambda: fsdp_checks_hooks.check_forward(HookedUnit), needs=["one unit"])

# %% [markdown]
# **Summary.** Two hooks per unit turn "shard everything" into "gather one unit at a time".
# *Question:* after the forward, which tensors does autograd hold for block 0's backward, and how
# many bytes do they cost right now?

# %% [markdown]
# ## 4. The backward
#
# * **Pre-backward:** a hook on the unit's forward outputs (`tensor.register_hook`) fires when
#   their gradient arrives, i.e. just before the unit's backward runs: unshard there, and the
#   storage autograd saved is full again.
# * **Post-backward:** autograd accumulates each unsharded parameter's gradient into its `.grad`;
#   `register_post_accumulate_grad_hook` fires after that. **Count** them: when all the unit's
#   trainable parameters are in, lay the gradients out like the all-gather (each padded to R·N rows,
#   viewed as (N, shard elements), concatenated along dim 1), one reduce-scatter, and each shard's
#   `.grad` is its row of the result (added, if a micro-batch already left one). Then reshard, in
#   `reduce_grads` itself (the check looks right after each call).
# * The reduction is a **SUM**: the loop divides each rank's summed token loss by the global
#   token count, so the ranks' gradients add up to the global-batch gradient for any split.
# * A parameter unused in a step never accumulates: `queue_callback` runs a function at the end
#   of the backward, which reduces whatever arrived (the toy preset has such a step).
#
# **Exercise 4:** `post_forward` (register the pre-backward hook), `pre_backward`,
# `post_accumulate`, `reduce_grads`.


# %% nbgrader={"grade": false, "grade_id": "backward", "locked": false, "schema_version": 3, "solution": true}
class TrainingUnit(HookedUnit):
    """Re-gather before the unit's backward, reduce-scatter its gradients after it."""

    def __init__(self, slots):
        super().__init__(slots)
        self.trainable = [f for f in self.unsharded if f.requires_grad]
        for full in self.trainable:
            full.register_post_accumulate_grad_hook(self.post_accumulate)
        self.ready, self.queued = 0, False

    def post_forward(self, module, args, output):
        super().post_forward(module, args, output)
        ### BEGIN SOLUTION
        for t in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self.pre_backward)
        ### END SOLUTION

    def pre_backward(self, grad):
        ### BEGIN SOLUTION
        self.unshard()  # refills the storage autograd saved
        ### END SOLUTION
        if not self.queued:  # once per backward: reduce what arrived
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)

    def post_accumulate(self, full):
        ### BEGIN SOLUTION
        self.ready += 1
        if self.ready == len(self.trainable):
            self.reduce_grads()
        ### END SOLUTION

    def end_of_backward(self):
        if self.ready:
            self.reduce_grads()
        self.queued = False
        self.reshard()

    def reduce_grads(self):
        ### BEGIN SOLUTION
        parts = []
        for shard, full in zip(self.shards, self.unsharded):
            g = full.grad if full.grad is not None else torch.zeros_like(full)
            padded = g.new_zeros((shard.shape[0] * self.n, *g.shape[1:]))
            padded[: g.shape[0]] = g
            parts.append(padded.view(self.n, -1))
        send = torch.cat(parts, dim=1)
        out = send.new_empty(send.shape[1])
        ring_reduce_scatter(out, send.view(-1), op="sum")
        offset = 0
        for shard, full in zip(self.shards, self.unsharded):
            piece = out[offset : offset + shard.numel()].view_as(shard)
            offset += shard.numel()
            if shard.requires_grad and full.grad is not None:
                shard.grad = piece.clone() if shard.grad is None else shard.grad + piece
            full.grad = None
        self.ready = 0
        self.reshard()
        ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "backward-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
# The toy preset on 2 ranks, one Linear per unit: a frozen weight, a weight tied across two units
# (the root takes it), a layer called twice, one unused on step 0, 7 rows; then a 2-block TinyGPT
# (a block's backward still needs its weights after its first gradients arrive); then two
# micro-batches' backwards before one step. Each shard's .grad against the whole batch's
# gradient, cut the same way.
exercise.check(
    "backward", lambda: fsdp_checks_hooks.check_backward(TrainingUnit), needs=["one unit", "forward hooks"]
)

# %% [markdown]
# **Summary.** The backward mirrors the forward: gather before, reduce-scatter and free after;
# autograd's own bookkeeping (saved tensors, accumulation hooks, the end-of-backward callback)
# does the timing. *Question:* the toy's `shared` layer runs twice in one forward; how many
# all-gathers does its unit issue per step, and how many reduce-scatters?

# %% [markdown]
# ## 5. Your FSDP on the course's loop
#
# `MyFSDP` puts the units together: plan the units (`plan_units`, the preset's wrap), give
# each its parameters (`assign_params`: innermost units first, the root last), hook them, and
# build the optimizer **after** sharding, over the shards. It is a `labkit.strategies` strategy,
# so `loop.train` runs it. **Exercise 5:** `full_state_dict` (every rank: whole tensors under the
# original keys) and `full_grad_dict` (every shard's `.grad`, gathered). The check trains 5 AdamW
# steps on 2 ranks and compares with single-process training (step-0 gradients, then weights)
# and with PyTorch's `fully_shard` on the same units, then the toy preset.


# %% nbgrader={"grade": false, "grade_id": "my-fsdp", "locked": false, "schema_version": 3, "solution": true}
class MyFSDP(strategies.Strategy):
    """Per-parameter FSDP on labkit.loop. Leaves out: prefetch, mixed precision, meta init."""

    Unit = TrainingUnit

    def __init__(self, model, cfg, reshard_after_forward=True, **options):
        self.model, modules = model, plan_units(model, cfg.units)
        self.units = [self.Unit(slots) for slots in assign_params(model, modules)]  # root last
        for unit, module in zip(self.units, modules + [model]):
            unit.reshard_after_forward = reshard_after_forward and module is not model
            unit.hook(module)
        self.dim0 = {s: f.shape[0] for u in self.units for s, f in zip(u.shards, u.unsharded)}
        self.optimizer = cfg.make_optimizer([s for s in self.dim0 if s.requires_grad])

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def step(self):
        self.optimizer.step()

    def full_state_dict(self):
        ### BEGIN SOLUTION
        for unit in self.units:
            unit.unshard()
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for unit in self.units:
            unit.reshard()
        return state
        ### END SOLUTION

    def full_grad_dict(self):
        ### BEGIN SOLUTION
        return {
            name: gather_dim0(p.grad, self.dim0[p])
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }
        ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "my-fsdp-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check(
    "my FSDP",
    lambda: fsdp_checks_loop.check_training(MyFSDP, CFG),
    needs=["one unit", "forward hooks", "backward"],
)

# %% [markdown]
# The same 5 steps, from the check's run when yours passed (or labkit's reference): the largest
# difference from single-process training, and the tied embedding, one parameter under both keys.

# %%
ref_run = loop.reference(CFG, 5)
checked = exercise.result("my FSDP")
hand = checked and [rank_runs[0] for rank_runs in checked]
hand = hand or labkit.run(loop.train, "fsdp", CFG, 5, world_size=N)
worst = max((hand[0]["state"][k] - ref_run["state"][k]).abs().max().item() for k in ref_run["state"])
print(f"largest difference from single-process after 5 steps: {worst:.1g}")
state = hand[0]["state"]
assert set(state) == set(model.state_dict()), "state-dict keys changed by sharding"
assert torch.equal(state["tok_emb.weight"], state["lm_head.weight"]), "the tied weights diverged"
print("same keys as before sharding; embedding == LM head after 5 steps")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# **Summary.** Your code: shard, gather, free, hooks, reduce-scatter. Sharding changes
# where bytes live, not the arithmetic (up to summation order). *Question:* `fully_shard`
# averages (its reduce-scatter divides by N) and the check still passes against it; what does
# `labkit.loop` do for a strategy with `reduce_op = "avg"`, and why is that exact here?

# %% [markdown]
# ## 6. Keep the weights, or gather ahead
#
# Two knobs trade memory for communication and time:
#
# * `reshard_after_forward=False` keeps each block gathered from its forward to its backward:
#   one all-gather per block per step instead of two (ZeRO-2-like for the weights).
# * **Prefetch** (FSDP2's `set_modules_to_forward_prefetch` / `..._backward_prefetch`): right
#   after unit i is unsharded, start the all-gathers of the next d units (the previous ones in
#   backward), so they travel while unit i computes; a **limit on the gathers in flight** bounds
#   the memory this holds. A gather started for a unit that then does not run (the toy's
#   `extra`) would hold last step's weights: drop it before the optimizer changes the shards.
#
# **Exercise 6:** `prefetch_after(unit, order)`: for the next `prefetch` units in `order`,
# `start_unshard()` while fewer than `max_inflight` units have a gather in flight.


# %% nbgrader={"grade": false, "grade_id": "prefetch", "locked": false, "schema_version": 3, "solution": true}
class PrefetchingUnit(TrainingUnit):
    def pre_forward(self, module, args):
        super().pre_forward(module, args)
        self.fsdp.prefetch_after(self, self.fsdp.units[:-1])  # blocks, forward order

    def pre_backward(self, grad):
        super().pre_backward(grad)
        self.fsdp.prefetch_after(self, self.fsdp.units[-2::-1])  # blocks, backward order


class PrefetchingFSDP(MyFSDP):
    Unit = PrefetchingUnit

    def __init__(self, model, cfg, prefetch=1, max_inflight=2, **options):
        super().__init__(model, cfg, **options)
        self.prefetch, self.max_inflight = prefetch, max_inflight
        for unit in self.units:
            unit.fsdp = self

    def prefetch_after(self, unit, order):
        ### BEGIN SOLUTION
        if unit not in order:
            return
        i = order.index(unit)
        for later in order[i + 1 : i + 1 + self.prefetch]:
            if sum(u.handle is not None for u in self.units) < self.max_inflight:
                later.start_unshard()
        ### END SOLUTION

    def step(self):
        for unit in self.units:  # a gather for a unit that never ran
            if unit.handle is not None:
                unit.unshard()
                unit.reshard()
        super().step()


# %% nbgrader={"grade": true, "grade_id": "prefetch-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
# A 4-block TinyGPT, 2 steps: reshard_after_forward=False (gathers per step, blocks kept), then
# prefetch 2 with at most 1 and 2 gathers in flight; the weights must still equal single-process.
exercise.check(
    "reshard and prefetch",
    lambda: fsdp_checks_loop.check_prefetch(PrefetchingFSDP),
    needs=["one unit", "forward hooks", "backward", "my FSDP"],
)

# %% [markdown]
# **Summary.** Your FSDP is complete: per-parameter shards, one batched all-gather and one
# batched reduce-scatter per unit, hooks for the timing, and two knobs. Everything below measures
# it at work, on labkit's reference (`labkit.strategies.fsdp`, the same design with
# `fully_shard`'s API: `fully_shard_by_hand(block)` for each block, then the model), which your
# checks have shown equals yours step for step.

# %% [markdown]
# ## 7. Memory, measured: FSDP vs DDP at N = 4
#
# Claim: this preset's memory is its state. With the hand-written DDP (1 MiB buckets) every
# rank holds 4P of weights, 4P of gradients and 8P of Adam state, and that is most of its peak;
# FSDP divides all three by N, so between steps a rank holds 16P/N (plus padding), and its peak
# adds only what is gathered at once. Both measured by the same tracker on 4 ranks.

# %%
N4 = 4
mem4 = labkit.run(
    loop.sweep,
    [dict(strategy="ddp-bucketed", bucket_cap_mb=1), dict(strategy="fsdp")],
    cfg=CFG,
    steps=2,
    track_memory=True,
    return_state=False,
    world_size=N4,
)
ddp_mem, fsdp_mem = mem4[0]
share = fsdp_lab.state_bytes(ddp_mem["peak_by_category"]) / ddp_mem["peak"]
fsdp_lab.assert_bound("DDP: parameters + gradients + optimizer, share of its peak", share, at_least=0.7)
fsdp_lab.assert_bound("FSDP's peak / DDP's peak at N = 4", fsdp_mem["peak"] / ddp_mem["peak"], at_most=0.40)

# %%
padded4 = sum(unit_sizes(model, CFG.units, N4))  # every parameter's rows padded
counters = 4 * sum(1 for p in model.parameters() if p.requires_grad)  # AdamW's 4-byte step per tensor
ddp_state = fsdp_lab.sample_at(ddp_mem["memory"], "backward end")  # step 2: Adam's state exists
for category, k, extra in (("parameters", 4, 0), ("gradients", 4, 0), ("optimizer", 8, counters)):
    assert_match(
        f"DDP {category}: {k}P{' + step counters' if extra else ''}", k * P + extra, ddp_state[category]
    )
steady = fsdp_lab.state_bytes(fsdp_mem["memory"].samples[-1].by_category)
assert_match("FSDP between steps: 16P/N (padded) + step counters", 16 * padded4 / N4 + counters, steady)
# 16P/N is FSDP's line only (top); DDP's grey "other" (bottom) is its 1 MiB flat bucket buffers,
# which the tracker cannot file under one parameter's gradient.
plot_memory_timeline(
    [fsdp_mem["memory"], ddp_mem["memory"]],
    theory={"16P/N": [16 * padded4 / N4, None]},
    title="rank 0, N = 4: FSDP's saw-tooth (top) under DDP's plateau (bottom)",
)
# %% [markdown]
# On GPUs (NCCL ranks) the next cell also prints what `torch.cuda.memory_allocated()` counts
# beyond the formula's tensors: the caching allocator's rounding and library workspaces (cuBLAS's);
# on CPU the tracker's bytes are all there is, and it prints nothing.

# %%
gpu = fsdp_mem["memory"]
if gpu.device_samples:  # CUDA only: the allocator's own figures next to the tracker's
    at, (allocated, reserved) = gpu.samples[-1].by_category, gpu.device_samples[-1]
    print(
        f"rank 0 on its GPU: the formula's tensors {fmt_bytes(fsdp_lab.state_bytes(at))}, "
        f"+ allocator rounding {fmt_bytes(at['allocator'])} + workspaces {fmt_bytes(at['workspace'])} "
        f"(cuBLAS): memory_allocated {fmt_bytes(allocated)}, reserved {fmt_bytes(reserved)}"
    )

# %% [markdown]
# The peak: **M_peak ≈ 16P/N + root + largest unit + prefetch buffer + its gradient
# temporaries + activations**. Activations do not depend on sharding: take them from the
# measurement; the rest is the formula's (`fsdp_lab.peak_formula`).

# %%
activations = fsdp_mem["peak_by_category"]["activations"]
predicted, parts = peak_formula(model, N4, CFG.units, prefetch=1, activation_bytes=activations)
print({k: fmt_bytes(v) for k, v in parts.items()})
fsdp_lab.assert_bound(
    "measured peak / formula (expected 0.8-1.25)", fsdp_mem["peak"] / predicted, at_least=0.8
)
fsdp_lab.assert_bound(
    "measured peak / formula (expected 0.8-1.25)", fsdp_mem["peak"] / predicted, at_most=1.25
)

# %% [markdown]
# **The seed's exercise.** A model with 12 GB of weights, 12 GB of gradients and 72 GB of
# optimizer state (fp32 Adam with fp32 master weights) on 8 ranks; its largest unit is 3 GB
# unsharded, and prefetch holds one more such unit (3 GB). Return each rank's steady state and
# the lower bound of its peak, in GB, from the formula just checked against the measurement, as
# a dict of numbers: `{"steady": ..., "peak_lower_bound": ...}`.


# %% nbgrader={"grade": false, "grade_id": "seed-exercise", "locked": false, "schema_version": 3, "solution": true}
def seed_answer():
    ### BEGIN SOLUTION
    steady = (12 + 12 + 72) / 8  # everything sharded
    return {"steady": steady, "peak_lower_bound": steady + 3 + 3}  # + largest unit + prefetch
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "seed-exercise-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("seed exercise", lambda: fsdp_checks_loop.check_seed(seed_answer))

# %% [markdown]
# **Summary.** FSDP's memory is 16P/N plus what is gathered at once plus activations, and the
# formula predicts the measured peak. *Question:* at N = 64, which term of the seed's peak
# dominates, and what would shrink it?

# %% [markdown]
# ## 8. reshard_after_forward: memory or traffic
#
# Claim: resharding after forward costs one more all-gather per block per step (parameter
# traffic: 2 gathers + 1 reduce-scatter = 3P instead of 2P) and saves the gathered blocks
# between forward and backward. Counted by the tracer (every collective each rank issued).

# %%
raf = labkit.run(
    loop.sweep,
    [dict(reshard_after_forward=True), dict(reshard_after_forward=False)],
    strategy="fsdp",
    cfg=CFG,
    steps=2,
    track_memory=True,
    hooks=COUNTS,
    return_state=False,
    world_size=N,
)
blocks = len(sizes) - 1
gathers = fsdp_checks_loop.gathers_per_step(raf.traces[0])
traffic = fsdp_lab.traffic_per_step(raf.traces[0])
padded2 = unit_sizes(model, CFG.units, N)
for i, keep in enumerate((False, True)):
    assert_match(
        f"reshard_after_forward={not keep}: all-gathers per step (root + {1 if keep else 2} per block)",
        1 + (1 if keep else 2) * blocks,
        gathers[2 * i + 1],
        unit="",
    )
    expected = 4 * (padded2[0] + (1 if keep else 2) * sum(padded2[1:]) + sum(padded2))
    assert_match(
        f"  parameter traffic per step (~{2 if keep else 3}P)", expected, traffic[2 * i + 1], rel_tol=0.01
    )

# %%
raf_true, raf_false = raf[0]
fsdp_lab.assert_bound(
    "peak without resharding / with it", raf_false["peak"] / raf_true["peak"], at_least=1.05
)
plot_memory_timeline(
    [raf_true["memory"], raf_false["memory"]], title="rank 0: reshard_after_forward True vs False"
)
# %% [markdown]
# **Summary.** False is ZeRO-2-like for the weights (FSDP1's SHARD_GRAD_OP): all blocks stay
# gathered from forward to backward. *Question:* with 24 blocks, how much more memory does
# False hold at its peak, and when is the saved all-gather worth it?

# %% [markdown]
# ## 9. Prefetch
#
# Claim: issuing unit i+1's all-gather while unit i computes (i−1's in backward) lets
# communication overlap compute, and each level of depth holds one more gathered block. On 2
# shared cores there is little idle compute to hide a gather behind, so look at the timeline
# and the memory, not at the clock.

# %%
# The reference FSDP with one more memory sample right after each block's pre-forward hook
# (its own gather done, the prefetches issued): what is gathered or in flight at that moment.
# One step per depth: every block's pre-forward runs in the first step's forward already.
depths = labkit.run(
    loop.sweep,
    [dict(prefetch=d) for d in (0, 1, 2)],
    strategy=fsdp_lab.MarkedAfterPrefetch,
    cfg=CFG,
    steps=1,
    track_memory=True,
    return_state=False,
    world_size=N,
)
for d, result in zip((0, 1, 2), depths[0]):
    assert_match(
        f"prefetch {d}: gathered or in flight while a block starts = root + {1 + d} block(s)",
        4 * (padded2[0] + (1 + d) * max(padded2[1:])),
        fsdp_lab.gathered_after_prefetch(result["memory"]),
    )
plot_memory_timeline([r["memory"] for r in depths[0]], title="rank 0: prefetch 0 / 1 / 2")
# %%
step_spans = [s for s in depths.traces[0]["spans"] if s["name"] == "step"]  # 1 per depth
for d in (0, 1, 2):
    window = (step_spans[d]["start"], step_spans[d]["end"])
    stats = overlap_stats(depths.traces[0], t_range=window)
    print(
        f"prefetch {d}: {stats['overlap_pct']:.0f}% of the communication ran while rank 0 computed "
        f"(this run's clock, not a promise)"
    )
last = step_spans[-1]
plot_timeline(
    depths.traces,
    title="prefetch=2: gathers issued ahead of each block",
    t_range=(last["start"] * 1e3, last["end"] * 1e3),
    show_inner=True,
)
# %% [markdown]
# **Summary.** Prefetch trades one block of memory per level for overlap; the rate limit
# (`max_inflight`) caps it. *Question:* with 24 blocks, prefetch 2 and a limit of 1 in flight,
# how many blocks are gathered at once during the forward?

# %% [markdown]
# ## 10. Wrap granularity
#
# Claim: the unit is the granule of memory and of communication (measured on 4 ranks). Root
# only: the whole model gathered at once (its peak at least 1.5x the per-block one). From root
# to per-block to per-Linear the collectives per step grow, and the largest unsharded unit and
# the peak shrink.

# %%
plans = ("root", "block", "linear")
wraps = labkit.run(
    loop.sweep,
    [dict(cfg=CFG.replace(units=u), prefetch=0 if u == "root" else 1) for u in plans],
    strategy="fsdp",
    steps=2,
    track_memory=True,
    hooks=COUNTS,
    return_state=False,
    world_size=N4,
    timeout=300,  # three trainings on 4 ranks: minutes on a loaded 2-core machine, not a hang
)
measured = {
    u: {
        "peak": r["peak"],
        "collectives": r["gathers"] + r["reduce_scatters"],
        "largest": 4 * max(unit_sizes(model, u, N4)),
    }
    for u, r in zip(plans, wraps[0])
}
fsdp_lab.assert_bound(
    "root-only peak / per-block peak", measured["root"]["peak"] / measured["block"]["peak"], at_least=1.5
)
for key, order in (("collectives", plans), ("largest", plans[::-1]), ("peak", plans[::-1])):
    values = [measured[u][key] for u in order]
    assert values == sorted(set(values)), f"{key} does not grow in the order {order}: {measured}"
print(
    "root -> block -> per-Linear: more collectives per step, a smaller unsharded group, a smaller peak"
)  # NBVAL_CHECK_OUTPUT

# %%
fsdp_lab.plot_wraps(measured, wraps[0])  # one bar per wrap: largest group, collectives, peak, step time

# %% [markdown]
# **Exercise.** Each collective costs a latency, so among the wraps whose peak fits the memory
# you have, take the one with the fewest collectives. Write `choose_wrap(measured, budget)`:
# `measured` is the dict above (`{wrap: {"peak", "collectives", "largest"}}`, this run's
# numbers), `budget` bytes per rank; return the wrap's name, or None if none fits.


# %% nbgrader={"grade": false, "grade_id": "choose-wrap", "locked": false, "schema_version": 3, "solution": true}
def choose_wrap(measured, budget):
    ### BEGIN SOLUTION
    fits = [w for w, m in measured.items() if m["peak"] <= budget]
    return min(fits, key=lambda w: (measured[w]["collectives"], measured[w]["peak"])) if fits else None
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "choose-wrap-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("choose a wrap", lambda: fsdp_checks_loop.check_choose_wrap(choose_wrap, measured))

# %%
budget = (measured["block"]["peak"] + measured["root"]["peak"]) / 2
chooser = exercise.pick("choose a wrap", choose_wrap, fsdp_checks_loop.best_wrap)
print(
    f"budget halfway between the block and the root-only peak: wrap {chooser(measured, budget)!r}"
)  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# **Summary.** Smaller units, smaller peak, more collectives: the wrap is a memory budget spent
# on latency. *Question:* with the budget halfway between the block and the per-Linear peak,
# what would you change instead of the wrap?

# %% [markdown]
# ## 11. FSDP1's flat buffer, on the same model
#
# FSDP1 (`FullyShardedDataParallel`, here `fsdp-flat`) flattens each unit's parameters into one
# padded buffer and shards that; FSDP2 (yours, `fsdp`) shards each parameter along dim 0. Both
# issue one all-gather and one reduce-scatter per unit, so the collectives per step are the same
# (measured); what differs is the padding, and what a flat buffer cannot express.

# %%
flat_vs = labkit.run(
    loop.sweep,
    [dict(strategy="fsdp-flat"), dict(strategy="fsdp")],
    cfg=CFG,
    steps=2,
    return_state=False,
    world_size=N4,
)
flat_gathers = fsdp_checks_loop.gathers_per_step(flat_vs.traces[0])
print(f"all-gathers per step: fsdp-flat {flat_gathers[1]}, fsdp {flat_gathers[3]}")  # NBVAL_CHECK_OUTPUT
assert flat_gathers[1] == flat_gathers[3] == 1 + 2 * blocks

# %% [markdown]
# **Padding.** Per parameter, each tensor's rows are padded to a multiple of N; flat, only each
# unit's total. Measured on 4 ranks as the bytes each rank holds beyond 4P/N
# (`fsdp_lab.held_bytes`: the parameters a rank keeps between steps, and the frozen ones among them):

# %%
flat_held, _ = labkit.run(fsdp_lab.held_bytes, "fsdp-flat", CFG, world_size=N4)[0]
held_by_rank = labkit.run(fsdp_lab.held_bytes, "fsdp", CFG, world_size=N4)  # (held, frozen) per rank
param_held = held_by_rank[0][0]
assert_match(
    "fsdp: padding bytes per rank (rows padded per parameter)",
    4 * (padded4 - P) / N4,
    param_held - 4 * P / N4,
)
flat_pad = sum(-(-u // N4) * N4 - u for u in sizes)
assert_match(
    "fsdp-flat: padding bytes per rank (one pad per unit)", 4 * flat_pad / N4, flat_held - 4 * P / N4
)

# %% [markdown]
# **Freezing one parameter.** A flat buffer has one `requires_grad`: a frozen parameter stays
# outside it, whole on every rank (the old reference's choice; FSDP1 refuses a flat parameter
# mixing frozen and trainable tensors unless `use_orig_params=True`). Per-parameter sharding shards it like any other.

# %%
frozen_name = (
    "blocks.0.mlp.0.weight"
    if "blocks.0.mlp.0.weight" in dict(model.named_parameters())
    else next(n for n, p in model.named_parameters() if n.startswith("blocks.0") and p.dim() == 2)
)
frozen_numel = model.get_parameter(frozen_name).numel()
_, flat_frozen = labkit.run(fsdp_lab.held_bytes, "fsdp-flat", CFG, frozen_name, world_size=N4)[0]
_, param_frozen = labkit.run(fsdp_lab.held_bytes, "fsdp", CFG, frozen_name, world_size=N4)[0]
assert_match(f"fsdp-flat: frozen {frozen_name} held whole", 4 * frozen_numel, flat_frozen)
assert_match(f"fsdp: frozen {frozen_name} sharded, 1/N", 4 * frozen_numel / N4, param_frozen)

# %% [markdown]
# **A different dtype per parameter.** A bf16 lookup table next to an fp32 projection
# (`fsdp_lab.TwoDtypes`), sharded flat and per parameter, one backward: one flat buffer has one
# dtype, per-parameter shards keep each its own.

# %%
print("fsdp-flat:", labkit.run(fsdp_lab.two_dtypes, True, world_size=N)[0])  # NBVAL_CHECK_OUTPUT
print("fsdp:     ", labkit.run(fsdp_lab.two_dtypes, False, world_size=N)[0])  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# **Initialization without ever holding the model** (kept from labkit's flat reference, FSDP1's
# `sync_module_states`): ranks other than 0 build the model on the **meta** device (shapes, no
# memory); rank 0 builds it for real and broadcasts one unit at a time, each rank keeping its
# chunk. The result must equal single-process init. (FSDP2 instead shards a meta model and
# initialises each rank's shards in place.)

# %%
meta_states = labkit.run(fsdp_lab.meta_init, CFG, world_size=N)  # every rank's full state dict
print(
    "meta-device init equals single-process init on every rank:",
    all(compare(model.state_dict(), s, rtol=0, atol=0).ok for s in meta_states),
)  # NBVAL_CHECK_OUTPUT
assert all(compare(model.state_dict(), s, rtol=0, atol=0).ok for s in meta_states)

# %% [markdown]
# **Summary.** Same collectives, different bookkeeping: a flat buffer pads once per unit but
# forces one dtype and one `requires_grad` per unit; per-parameter shards pad every tensor and
# let each parameter be itself (frozen, another dtype, a DTensor for tensor parallelism).
# *Question:* why does per-parameter sharding make a sharded state dict trivial to write?

# %% [markdown]
# ## 12. Gradient accumulation
#
# Claim: with K micro-batches per step the gradients stay sharded: every micro-batch's backward
# reduce-scatters each unit into the shards' `.grad` (they add up), and every micro-batch gathers
# every unit again: K × (1 + 2 per block) all-gathers and K × (1 + blocks) reduce-scatters per
# update, and the update equals single-process training on the whole batch.

# %%
K = 4
accumulated = labkit.run(loop.train, "fsdp", CFG, 1, accum_steps=K, hooks=COUNTS, world_size=N)[0]
assert_match(f"all-gathers per update, K = {K}", K * (1 + 2 * blocks), accumulated["gathers"], unit="")
assert_match(
    f"reduce-scatters per update, K = {K}", K * (1 + blocks), accumulated["reduce_scatters"], unit=""
)
report = compare(loop.reference(CFG, 1)["grads"], accumulated["grads"], rank=0, world_size=N)
print("accumulated step-0 gradients vs single-process:", report.summary())  # NBVAL_CHECK_OUTPUT
report.raise_if_failed()

# %% [markdown]
# **Summary.** Accumulation multiplies the collectives by K, not the memory. *Question:* FSDP2's
# `set_requires_gradient_sync(False)` keeps unsharded gradients between micro-batches instead;
# what does that save, and what does it cost per rank?

# %% [markdown]
# ## 13. Mixed precision
#
# Claim: `MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)` (FSDP2's `MixedPrecisionPolicy`)
# changes what travels, not what a rank keeps. The fp32 shard **is** the master copy the optimizer
# steps; each unit all-gathers its shards cast to bf16 and computes in bf16; the reduce-scatter
# runs in bf16 and its piece lands cast back to the shard's dtype. So the state stays 16P/N, all
# fp32: parameters 4P/N, gradients 4P/N, AdamW 8P/N (`fsdp_lab.state_formula`), while every
# all-gather and reduce-scatter moves half the bytes. One run on 4 ranks: bf16 tracked (2 steps),
# then bf16 for the equivalence check; fp32's side is section 7's FSDP run (`fsdp_mem`: the same
# preset, 4 ranks, 2 steps, tracked and traced).

# %%
from labkit.labs import precision_checks
from labkit.strategies.precision import MixedPrecision

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
CFG_BF16 = CFG.replace(mp=BF16)
mp_runs = labkit.run(
    loop.sweep,
    [dict(cfg=CFG_BF16, track_memory=True, return_state=False), dict(cfg=CFG_BF16, steps=CFG.steps)],
    strategy="fsdp",
    steps=2,
    world_size=N4,
)
bf16_mp, bf16_trained = mp_runs[0]
fp32_mp = fsdp_mem  # section 7: "fsdp" on CFG, 4 ranks, 2 steps, memory tracked

# %% [markdown]
# The state at the end of step 2's backward, by category, against the formula, fp32 and bf16:

# %%
expected_state = fsdp_lab.state_formula(model, N4, CFG.units)
for tag, run in (("fp32", fp32_mp), ("bf16", bf16_mp)):
    at_end = fsdp_lab.sample_at(run["memory"], "backward end")
    for category, k in zip(expected_state, ("4P/N", "4P/N", "8P/N + steps")):
        assert_match(f"{tag} {category} = {k}", expected_state[category], at_end[category], rel_tol=0)

# %% [markdown]
# The wire, from the tracer: bytes of step 2, bf16 (step span 2 of this sweep) over fp32 (span 4
# of section 7's sweep: DDP's 2 steps, then FSDP's).

# %%
for op in ("all_gather", "reduce_scatter"):
    bf16_step = fsdp_lab.traffic_per_step(mp_runs.traces[0], ops=(op,))[1]
    fp32_step = fsdp_lab.traffic_per_step(mem4.traces[0], ops=(op,))[3]
    assert_match(f"{op} bytes per step, bf16 / fp32", 0.5, bf16_step / fp32_step, rel_tol=0.001, unit="")

# %% [markdown]
# Same training? Not bit for bit against fp32: each rank rounds its partial gradient to bf16 before
# the sum. So the check is against single-process training **with the same casts** (fp32 master,
# bf16 compute: `loop.reference` on the preset with `mp`), with tolerances that each say what they
# catch (`precision_checks.check_same_casts`: 4 ulp on the step-0 gradients, 10% of the training's
# movement, the step-0 loss within eps/8, and step-0 gradients that differ from fp32 training's):

# %%
figures = precision_checks.check_same_casts(bf16_trained, CFG_BF16, "bf16 FSDP, N = 4")
print(precision_checks.describe(figures))

# %% [markdown]
# And against PyTorch's `fully_shard(..., mp_policy=MixedPrecisionPolicy(bf16, bf16))` on the same
# units and data: the same casts in the same places, so on 2 ranks it is bit-equal.

# %%
mine_mp, torch_mp = labkit.run(
    loop.sweep, [dict(strategy="fsdp"), dict(strategy="torch-fsdp")], cfg=CFG_BF16, steps=3, world_size=N
)[0]
report = compare(torch_mp["state"], mine_mp["state"], rtol=0, atol=0)
print(
    "bf16 FSDP vs fully_shard(mp_policy), 3 steps:",
    report.summary(),
    "| losses equal:",
    mine_mp["losses"] == torch_mp["losses"],
)  # NBVAL_CHECK_OUTPUT
report.raise_if_failed()
assert mine_mp["losses"] == torch_mp["losses"]

# %% [markdown]
# **Summary.** Under FSDP the ZeRO paper's 2P + 2P + 12P is still 16P/N per rank, because the
# sharded master is the parameter: bf16 halves the all-gathers' and reduce-scatters' bytes, not
# the state. *Question:* FSDP2 lets `reduce_dtype=fp32` with
# `param_dtype=bf16`; which of the two ratios measured above changes, and what does it buy?

# %% [markdown]
# ## 13b. CPU offload: the state on the host
#
# Claim: `offload_policy=CPUOffloadPolicy()` (FSDP2's option, by hand in
# `labkit.strategies.fsdp.offload`) moves the whole 16P/N (shards, gradient shards, AdamW's
# state) to the host, and the optimizer steps there. What crosses the host link each step: a
# unit's shards before each of its all-gathers ("h2d": twice per block, once for the root) and its
# gradient shards when its reduce-scatter lands ("d2h"), both traced. Here the "device" is the CPU
# too, so the tracker keeps a separate **host pool** for the offloaded tensors. Two runs of one step
# on N ranks.

# %%
from labkit.observe.memory_record import CATEGORIES
from labkit.observe.trace_stats import collective_counts
from labkit.strategies.fsdp import CPUOffloadPolicy
from labkit.strategies.fsdp.offload import offload_report

OFFLOAD = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # pinning needs a GPU
off_runs = labkit.run(
    loop.sweep,
    [dict(offload_policy=OFFLOAD, hooks=loop.Hooks(report=offload_report)), dict()],
    strategy="fsdp",
    cfg=CFG,
    steps=1,
    track_memory=True,
    return_state=False,
    world_size=N,
)
offloaded, on_device = off_runs[0]
formula = offloaded["offload"]  # offload_formula: bytes per step and held on the host

# %% [markdown]
# The traced moves of rank 0 in that step, against the formula (each unit's padded shards per
# gather, each gradient shard once):

# %%
traced = collective_counts(off_runs.traces[0])
for op in ("h2d", "d2h"):
    assert_match(f"{op} bytes in one step (formula)", formula[op], traced[op][1], rel_tol=0)

# %% [markdown]
# The pools after the step: the host holds exactly the formula's shards + gradients + AdamW
# state, and the device pool's tensors drop by that much.

# %%
after = [[s for s in r["memory"].samples if s.label == "after step"][-1] for r in (offloaded, on_device)]
held = [sum(s.by_category.get(c, 0) for c in CATEGORIES) for s in after]  # tensors only
assert_match(
    "host pool = shards + grads + AdamW state (formula, ~16P/N)",
    formula["host"],
    sum(after[0].host.values()),
    rel_tol=0,
)
assert_match("device pool drop = the host pool", formula["host"], held[1] - held[0], rel_tol=0)

# %% [markdown]
# What it costs at scale: the formula's bytes at a stated host-link bandwidth
# (`labkit.costmodel.links.PCIE_GEN5_X16`, PCIe 5.0 x16's 63 GB/s each way). A 7B-parameter
# model, fp32 shards, block units, on 8 GPUs: h2d 2 x 4P/N per step, d2h 4P/N.

# %%
from labkit.costmodel.links import PCIE_GEN5_X16, host_copy_time

P7, N8 = 7e9, 8
h2d, d2h = 2 * 4 * P7 / N8, 4 * P7 / N8
print(
    f"per GPU per step: h2d {fmt_bytes(h2d)} in {host_copy_time(h2d):.2f} s, "
    f"d2h {fmt_bytes(d2h)} in {host_copy_time(d2h):.2f} s at {PCIE_GEN5_X16.busbw_Bps / 1e9:.0f} GB/s"
)  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# **Summary.** Offload trades device memory (all of 16P/N) for host-link traffic (3 x 4P/N per
# step) and a CPU optimizer step; equal to `fully_shard(offload_policy=CPUOffloadPolicy())` and to
# one process (tests/test_offload.py). *Question:* with bf16 all-gathers, which of the two moves
# could shrink, and why do FSDP2 and this one still copy the fp32 shards?

# %% [markdown]
# ## 14. Activation checkpointing
#
# FSDP shards the state, not the activations: every block's saved tensors live from its forward to
# its backward. **Checkpointing** a block (`torch.utils.checkpoint`, non-reentrant:
# `Preset.activation_checkpointing=True`) keeps only its input and runs its forward again inside
# its backward. One run on 4 ranks: plain and checkpointed, with reshard_after_forward True
# (memory-tracked) and False (traced, not tracked: its claims are counts and bits), then both
# once more, untracked, for the clock.

# %%
CKPT = CFG.replace(activation_checkpointing=True)
ckpt_configs = [
    dict(cfg=c, reshard_after_forward=raf, track_memory=raf) for raf in (True, False) for c in (CFG, CKPT)
]
ckpt_runs = labkit.run(
    loop.sweep,
    ckpt_configs
    + [
        dict(cfg=c, track_memory=False, return_state=False, steps=3, hooks=loop.Hooks(warmup=1), spans=False)
        for c in (CFG, CKPT)
    ],
    strategy="fsdp",
    steps=2,
    track_memory=True,
    world_size=N4,
    timeout=300,  # six trainings on 4 ranks: minutes on a loaded 2-core machine, not a hang
)
plain, ckpt, plain_keep, ckpt_keep = ckpt_runs[0][:4]

# %% [markdown]
# Claim: at the peak, the activations shrink from every block's to the blocks' inputs plus one
# block's recomputed activations (the recompute runs in a "recompute" phase, so the tracker counts
# it as activations).

# %%
act_ratio = ckpt["peak_by_category"]["activations"] / plain["peak_by_category"]["activations"]
fsdp_lab.assert_bound("activation bytes at the peak, checkpointed / plain", act_ratio, at_most=0.5)
fsdp_lab.plot_peak_by_category({"plain": plain, "checkpointed": ckpt}, title="N = 4: by category at the peak")

# %% [markdown]
# The cost is compute: each block's forward runs again inside its backward. Its time is measured
# on the memory-tracked runs above (so slower, but the same work): the checkpointed backward
# minus the plain one is the recompute, printed next to the plain forward. They need not agree:
# the forward includes its all-gathers, which the recompute does not repeat, and on a model this
# small each op's fixed cost weighs more than its arithmetic. Then the median step time of the
# untracked pair (a warm-up step, then 2 timed steps each). Both are this run's clock on shared
# cores: printed, not a claim. What the lab claims about the recompute is what no load changes,
# checked below it: the recompute gathers nothing of its own.

# %%
from labkit.observe.trace_stats import steps as step_windows

windows = step_windows(ckpt_runs.traces[0])  # the 4 traced runs, 2 steps each (the last 2 untraced)


def phase_s(run, name):  # rank 0's seconds in phase `name` of traced run `run`'s second step
    lo, hi = windows[2 * run + 1]
    return sum(
        s["end"] - s["start"]
        for s in ckpt_runs.traces[0]["spans"]
        if s["name"] == name and lo <= s["start"] <= hi
    )


forward_s, plain_step_s = phase_s(0, "forward"), windows[1][1] - windows[1][0]
recompute_s = phase_s(1, "backward") - phase_s(0, "backward")
print(
    f"traced, reshard_after_forward=True: plain forward {forward_s * 1e3:.0f} ms of a "
    f"{plain_step_s * 1e3:.0f} ms step; the checkpointed backward is {recompute_s * 1e3:.0f} ms longer "
    f"({recompute_s / forward_s:.2f} forwards, by this run's clock)"
)

# %%
import statistics

timed = ckpt_runs[0][4:]
plain_s, ckpt_s = (statistics.median(run["step_s"]) for run in timed)
print(
    f"median step: plain {plain_s * 1e3:.0f} ms, checkpointed {ckpt_s * 1e3:.0f} ms, ratio {ckpt_s / plain_s:.2f}"
)

# %% [markdown]
# Claim: the recompute needs **no** all-gather of its own. It runs inside the block's backward,
# after the pre-backward hook has gathered the block's weights; so the counts per step are the plain
# run's, with and without reshard_after_forward (sweep order: plain, checkpointed, each 2 steps).

# %%
ckpt_gathers = fsdp_checks_loop.gathers_per_step(ckpt_runs.traces[0])
for i, raf_flag in enumerate((True, False)):
    plain_count, ckpt_count = ckpt_gathers[4 * i + 1], ckpt_gathers[4 * i + 3]
    assert_match(
        f"reshard_after_forward={raf_flag}: all-gathers per step, checkpointed vs plain ({plain_count})",
        plain_count,
        ckpt_count,
        unit="",
    )

# %% [markdown]
# Claim: it is the same arithmetic (the same ops on the same inputs in the same order), so
# training is **bit-equal** with and without checkpointing:

# %%
same = all(torch.equal(plain["state"][k], ckpt["state"][k]) for k in plain["state"])
same_keep = all(torch.equal(plain_keep["state"][k], ckpt_keep["state"][k]) for k in plain["state"])
print(
    "bit-equal with and without checkpointing (raf True, False):",
    same,
    same_keep,
    "| losses equal:",
    plain["losses"] == ckpt["losses"],
)  # NBVAL_CHECK_OUTPUT
assert same and same_keep and plain["losses"] == ckpt["losses"]

# %% [markdown]
# The peak formula of section 7 gains its activation term: M_peak ≈ 16P/N + root + largest unit +
# prefetch + gradient temporaries + **activations** (measured at the peak, as there). It must still
# predict both peaks. Claim: on this model the sharded state is the largest term with and
# without checkpointing (a small batch per rank), and checkpointing cuts the activations' share.

# %%
for tag, run in (("plain", plain), ("checkpointed", ckpt)):
    predicted, terms = peak_formula(
        model, N4, CFG.units, prefetch=1, activation_bytes=run["peak_by_category"]["activations"]
    )
    fsdp_lab.assert_bound(f"{tag}: measured peak / formula", run["peak"] / predicted, at_least=0.8)
    fsdp_lab.assert_bound(f"{tag}: measured peak / formula", run["peak"] / predicted, at_most=1.25)
    top = max(terms, key=terms.get)
    print(
        f"  {tag}: largest term {top!r} ({terms[top] / predicted:.0%}), "
        f"activations {terms['activations'] / predicted:.0%} of the formula"
    )
    assert top == "shards 16P/N", f"{tag}: the largest term is {top}, not the sharded state"
print(f"per rank: {CFG.batch_size // N4} rows of {CFG.seq_len} tokens (batch {CFG.batch_size} on {N4} ranks)")

# %% [markdown]
# **Summary.** Checkpointing trades compute, each block's forward run again inside its backward
# (what that cost here is the clock's, printed above, not a claim), for the activations: the
# activation term at the peak drops to at most half (checked), with the same all-gathers and
# bit-equal training. On this model (the rows and tokens per rank printed above) the sharded
# state is the largest term either way; the plain activations grow with the rows and the sequence, the state does not, so at
# large batches or long sequences they are the term to attack first. *Question:* which activation term does checkpointing
# leave, and how does it grow with the number of blocks?

# %% [markdown]
# ## 15. Checkpoints, with nothing lost
#
# Each rank writes its shards + AdamW state + step + RNG; rank 0 writes a COMPLETE marker after
# everyone's file is on disk. Four ranks save at steps 2 and 4, the save at 4 "crashes" before its
# marker; two ranks resume from the latest complete one and must continue with the losses of the
# uninterrupted run of section 5.

# %%
import os
from labkit.labs.checkpoint_runs import scratch_dir, train_resumable
from labkit.strategies.checkpoint import is_complete, latest_complete

ckpt_root = scratch_dir("fsdp_ckpt")  # this kernel's, emptied now, removed when the kernel stops
labkit.run(train_resumable, 4, ckpt_root, save_every=2, crash_save_at=4, world_size=4, timeout=300)
print(
    "step 4 complete?",
    is_complete(os.path.join(ckpt_root, "step_000004")),
    "| latest complete:",
    os.path.basename(latest_complete(ckpt_root)),
)  # NBVAL_CHECK_OUTPUT

# %%
resumed = labkit.run(train_resumable, 5, ckpt_root, resume_from="latest", world_size=2)[0]
for step, loss in enumerate(resumed["losses"], start=resumed["start"]):
    assert_match(
        f"step {step} loss, 4 -> 2 ranks vs uninterrupted",
        hand[0]["losses"][step],
        loss,
        rel_tol=1e-5,
        unit="",
    )

# %% [markdown]
# ## 16. Debug drills
#
# The common-errors table, made runnable. Each mistake below runs for 2 steps on 2 ranks; the
# symptom shows in the course's own tools, and the last column is the shortest check that finds it.
#
# | mistake | symptom | shortest check |
# |---|---|---|
# | optimizer created before sharding | nothing trains: the optimizer holds the old, now unused parameters | largest weight change after a step == 0 |
# | each rank's loss averaged over its own tokens, then SUMmed | every gradient N× too large (AdamW's update divides by the gradient's own scale); the weights still drift | equivalence check vs single-process |
# | root-only wrap | one all-gather of the whole model per step; the whole model gathered at the peak | collective counts per step; gathered bytes at the peak vs 4P |
# | missing reshard | the memory never drops between units; gathered weights stay after the step | parameter bytes between steps vs 4P/N |
# | overlapping samplers | every rank trains on the same rows; the loss still goes down | equivalence check vs single-process |
#
# Each mistake is a small subclass of the reference FSDP or a wrong sampler, in
# `labkit.drills` (read it: each is a few lines, and it holds no exercise's answer); the loop is
# the same one as above.

# %%
drill_runs = labkit.run(
    loop.sweep,
    [dict(strategy=drills.OptimizerBeforeSharding), dict(strategy=drills.OwnMeanLossSummed)],
    cfg=CFG,
    steps=2,
    world_size=N,
)
early, summed = drill_runs[0]
initial = loop.build_model(CFG).state_dict()
moved = max((early["state"][k] - initial[k]).abs().max().item() for k in initial)
print(f"optimizer before sharding: largest weight change after 2 steps = {moved}")  # NBVAL_CHECK_OUTPUT
assert moved == 0, "the drill's optimizer moved a weight: it holds the shards after all"
two_reference = loop.reference(CFG, 2)
summed_report = compare(two_reference["grads"], summed["grads"], rank=0, world_size=N)
assert not summed_report.ok, "the per-rank mean loss, summed, passed the equivalence check"
drills.show(
    "own-mean loss, summed",
    "step-0 gradients vs single-process: "
    + summed_report.summary()
    + "\n"
    + summed_report.first_problem().splitlines()[-1],
)  # NBVAL_CHECK_OUTPUT
ref_g = torch.cat([two_reference["grads"][k].flatten() for k in two_reference["grads"]])
summed_g = torch.cat([summed["grads"][k].flatten() for k in two_reference["grads"]])
assert_match(
    "own-mean loss, summed: gradient / single-process's (N)",
    N,
    (summed_g @ ref_g / (ref_g @ ref_g)).item(),
    rel_tol=1e-3,
    unit="",
)
assert not compare(two_reference["state"], summed["state"], rank=0).ok, (
    "the N x gradient left the weights equal"
)

# %% [markdown]
# **Root-only wrap.** `fully_shard` on the model alone: the whole model is one unit, so each
# step is one all-gather and one reduce-scatter of everything, and the gathered weights at the
# peak are the whole model's, 4P bytes (padded).

# %%
root_only = wraps[0][0]
print(
    f"root-only: {root_only['gathers']:.0f} all-gather and {root_only['reduce_scatters']:.0f} "
    "reduce-scatter per step"
)  # NBVAL_CHECK_OUTPUT
assert root_only["gathers"] == 1 and root_only["reduce_scatters"] == 1, root_only
assert_match(
    "root-only (section 10, 4 ranks): gathered at the peak = the whole model, 4P (padded)",
    4 * padded4,
    root_only["peak_by_category"]["all_gather"],
)

# %% [markdown]
# **Missing reshard.** Nothing frees a unit's gathered weights (`drills.NeverReshards`): the
# memory never drops between units, and after the step every rank still holds the whole model
# next to its shards.

# %%
no_reshard = labkit.run(
    loop.train,
    drills.NeverReshards,
    CFG,
    2,
    track_memory=True,
    hooks=COUNTS,
    return_state=False,
    world_size=N,
)
after = no_reshard[0]["memory"].samples[-1].by_category
held = after.get("parameters", 0) + after.get("all_gather", 0)
assert_match(
    "missing reshard: shards 4P/N + every unit gathered 4P", 4 * sum(padded2) / N + 4 * sum(padded2), held
)
plot_memory_timeline(
    [no_reshard[0]["memory"]],
    theory={"16P/N": 16 * sum(padded2) / N},
    title="missing reshard, rank 0: the gathered weights only grow",
)
# %% [markdown]
# **Overlapping samplers.** Every rank reads the same rows (rank 0's share of the batch, what a
# DataLoader without a DistributedSampler gives each rank): the loss goes down, nothing crashes,
# and the equivalence check with single-process training on the global batch fails.

# %%
overlap = labkit.run(
    loop.train, "fsdp", CFG, 2, hooks=loop.Hooks(shard=drills.same_rows_on_every_rank), world_size=N
)
report = compare(two_reference["state"], overlap[0]["state"], rank=0)
assert not report.ok, "overlapping samplers passed the equivalence check"
drills.show("overlapping samplers", "weights after 2 steps vs single-process: " + report.summary())
print("losses:", [round(loss, 3) for loss in overlap[0]["losses"]], "(they look fine)")
assert overlap[0]["losses"][-1] < overlap[0]["losses"][0], "the overlapping samplers' loss did not go down"

# %% [markdown]
# **Summary.** Each mistake leaves a measurable trace: weights that never move, a gradient N×
# too large, a count of collectives per step, gathered bytes that stay, a failed equivalence
# check. Check those first, before reading code. *Questions:* with nothing resharded, which
# weights does the second step's forward compute with? If every rank trained on the whole
# global batch instead of the same half, would the equivalence check catch it?

# %% [markdown]
# ## 17. Inter-tensor vs intra-tensor sharding
#
# ZeRO-3 in DeepSpeed's original form gives whole tensors to owner ranks; FSDP cuts every
# tensor into N equal pieces. Bytes per rank on our model, N = 4:


# %%
def owner_partition(tensor_sizes, n):
    loads = [0] * n
    for size in sorted(tensor_sizes, reverse=True):  # greedy: biggest tensor to the lightest rank
        loads[loads.index(min(loads))] += 4 * size
    return loads


inter = owner_partition([p.numel() for p in model.parameters()], N4)
intra = [held for held, _ in held_by_rank]  # measured in section 11: every rank's shard bytes
print(
    "inter-tensor bytes per rank:", inter, f"imbalance {max(inter) / min(inter):.2f}x"
)  # NBVAL_CHECK_OUTPUT
print(
    "intra-tensor bytes per rank (measured):", intra, f"imbalance {max(intra) / min(intra):.2f}x"
)  # NBVAL_CHECK_OUTPUT
assert intra == [4 * padded4 // N4] * N4, "a rank's shard bytes are not R rows of every parameter"

# %% [markdown]
# ## Try it: the knobs on real ranks
#
# Change reshard_after_forward, prefetch depth and wrap granularity; each change re-runs two
# short steps on 2 ranks and redraws the timeline and the memory.

# %%
if exercise.widgets_enabled():
    fsdp_lab.knob_widget(CFG, world_size=N)  # each change: fsdp_lab.knob_experiment, 2 steps on N ranks
else:
    print("knob widget: runs in a live notebook (static run: sections 8-10 measured the knobs)")

# %% [markdown]
# ## 18. The knobs, in the real APIs
#
# | hand-written knob | FSDP2 `fully_shard` | FSDP1 | DeepSpeed | Megatron-core |
# |---|---|---|---|---|
# | shard params + grads + optimizer, reshard after forward | `reshard_after_forward=True` | `ShardingStrategy.FULL_SHARD` | ZeRO stage 3 | `data_parallel_sharding_strategy="optim_grads_params"` |
# | keep params gathered until backward (ZeRO-2-like) | `reshard_after_forward=False` | `SHARD_GRAD_OP` | ZeRO stage 2 (params never sharded) | `"optim_grads"` |
# | reshard to a smaller group after forward | `reshard_after_forward=8` (an int: intra-node) | `_HYBRID_SHARD_ZERO2` | ZeRO++ hpZ | — |
# | shard only the optimizer state | — | — | ZeRO stage 1 | `"optim"` |
# | no sharding (DDP) | — | `NO_SHARD` | stage 0 | `"no_shard"` |
# | the units (`fully_shard_by_hand` calls) | which modules get `fully_shard` | `auto_wrap_policy` | `stage3_param_persistence_threshold`, module granularity | per-layer FSDP units |
# | per-parameter dim-0 shards | DTensor `Shard(0)` parameters | flat buffer (`FlatParameter`) | flat partitions | flat buffer |
# | `prefetch=` depth | `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` (default: implicit, through CUDA streams) | `forward_prefetch`, `backward_prefetch=BACKWARD_PRE` | `stage3_prefetch_bucket_size` | overlap flags |
# | `max_inflight` rate limiter | (bounded by its all-gather streams) | `limit_all_gathers=True` | `stage3_max_live_parameters` | — |
# | `unshard()` / `reshard()` by hand | `FSDPModule.unshard(async_op=True)` / `reshard()` | `summon_full_params` | `GatheredParameters` | — |
# | a unit's gradient sync per micro-batch | `set_requires_gradient_sync(False)` | `no_sync()` | `gradient_accumulation_steps` | `no_sync` |
# | `reduce_op="avg"` | `set_gradient_divide_factor` | — | — | — |
# | mixed precision | `MixedPrecisionPolicy(param_dtype, reduce_dtype)` | `MixedPrecision` | `bf16` / `fp16` blocks | `--bf16` |

# %% [markdown]
# ## At scale
#
# The same formulas at 64–512 GPUs, from `labkit.costmodel`. First the ZeRO paper's table
# (7.5 B parameters, N = 64), then the FSDP paper's GPT-175B throughput band, then where the
# model disagrees with gloo timings recorded earlier (`costmodel.plot.GLOO_64MIB_TIMES_S`: the
# course's 2-core CI machine, November 2026, not this run).

# %%
from labkit import costmodel
from labkit.costmodel import plot as costmodel_plot

table = {stage: round(sum(v.values()) / 1e9, 1) for stage, v in costmodel_plot.zero_table().items()}
print("GB per rank:", table)  # NBVAL_CHECK_OUTPUT
for stage, paper in zip(("ddp", "zero1", "zero2", "fsdp"), costmodel.ZERO_TABLE_GB.values()):
    assert_match(
        f"{stage}: ZeRO paper (expected) vs labkit.costmodel", paper * 1e9, table[stage] * 1e9, rel_tol=0.05
    )

# %%
for row in costmodel_plot.fsdp_paper_check():
    lo, hi = costmodel_plot.FSDP_175B_TFLOPS_BAND
    where = "inside" if lo <= row["hw_tflops"] <= hi else "above" if row["hw_tflops"] > hi else "below"
    print(
        f"N={row['n']:4d} batch={row['batch']}: {row['hw_tflops']:.0f} TFLOPS/GPU, {where} the paper's "
        f"{lo:.0f}-{hi:.0f} (an ideal model: no stragglers, no slow kernels), fits={row['fits']}"
    )
print("recorded: gloo at 64 MiB on the course's 2-core CI machine, November 2026 (not this run)")
for what, model_value, recorded, why in costmodel_plot.disagreements():
    print(f"{what:45s} model {model_value:8.2f}  recorded {recorded:8.2f}  ({why})")

# %%
if exercise.widgets_enabled():
    display(costmodel_plot.what_if_widget(strategy="fsdp"))
else:
    print("what-if widget: runs in a live notebook (static run: the numbers above)")

# %% [markdown]
# **Summary.** The formulas you checked on 4 CPU ranks (16P/N, the peak with its activation term,
# 3P of traffic, halved on the wire by bf16) are the ones that size a 175 B model on 512 GPUs;
# what the cost model cannot see is gloo's slow collectives and 4 ranks sharing 2 cores.
# *Exercises:* (1) rerun section 13 with `reduce_dtype=torch.float32`: predict both traffic ratios
# first. (2) Checkpoint every other block only: pass `loop.train` a subclass of
# `labkit.strategies.fsdp.FSDP` whose `__init__` calls `activation_checkpointing.checkpoint_blocks(
# model, model.blocks[::2])` before `super().__init__`. Predict the activation bytes at the peak
# relative to the two measured in section 14, then measure them.
