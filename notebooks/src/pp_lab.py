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
# # 06 · Pipeline parallelism by hand, and choosing a layout
#
# Data parallelism (DDP, ZeRO, FSDP, HSDP) splits the batch; tensor parallelism splits each
# layer. **Pipeline parallelism** (PP) splits the model **by depth**: stage 0 holds the first
# layers, stage 1 the next, and so on; a micro-batch's activations flow forward from stage to
# stage and their gradients flow back, point to point. You write it in ten exercises. Four run
# on real gloo ranks, each checked element-wise (float64, 1e-12) against one process and against
# PyTorch's own `torch.distributed.pipelining` schedules: the stage split with send / recv, GPipe,
# 1F1B and interleaved 1F1B. Then you measure what each schedule costs (the bubble, the activations
# a stage holds, the bytes it sends) against the formulas, and see what crosses the slow link when
# PP spans the nodes. Exercises 5 to 8 write the cost model's pieces (the layouts' memory and
# traffic, the bubble, FSDP or ZeRO-1 under a pipeline, the activations) that answer the question
# the FSDP material leaves open: when FSDP, and when ZeRO-1 x TP x PP? The last two split the
# backward in two (exercise 9) and write the zero-bubble schedule ZB-H1 (exercise 10).

# %%
import labkit  # first (it needs no torch): the ranks' forkserver imports torch on another core meanwhile
import torch
import torch.distributed as dist
import torch.nn as nn

from labkit import exercise, loop
from labkit.checks import assert_match, compare
from labkit.labs import pp_checks, pp_choice, pp_lab, tp_lab
from labkit.launch.topology import NodeLink
from labkit.strategies.pp import Action, predicted_bubble
from labkit.strategies.pp import orders as pp_orders
from labkit.units import fmt_bytes

# %% [markdown]
# ## 1. Stages, and what moves between them
#
# The lab's model is an `nn.Sequential` of 8 layers, each Linear then Tanh, with odd widths
# (`pp_lab.WIDTHS`, float64; the fourth Linear has no bias). A pipeline of p stages gives stage
# r a contiguous run of the children, as even as can be: the first n % p stages take one more
# (7 layers on 4 stages: 2, 2, 2, 1). Stage r lives on rank r **of the pipeline group** (on a
# 2 x 2 mesh of ("dp", "pp") the group is not the world).

# %%
model = pp_lab.make_model()
print(model)  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# labkit's scaffolding, `pp_lab.Stage` (what a schedule drives on each rank):
#
# - `stage.index`, `stage.n`, `stage.is_first`, `stage.is_last`, `stage.module`;
# - `stage.forward(mb, inp)` runs the stage on micro-batch `mb` and returns its output;
#   `stage.backward(mb, out, grad)` runs its backward (on the last stage `out` is the loss and
#   `grad` None). Both record the slot, so the lab can replay the order and count what is held;
# - `stage.send(tensor, to_stage, mb)` posts a send and returns; `stage.recv(from_stage, mb)`
#   waits for the matching message and returns a new tensor. A recv that waits longer than
#   `pp_lab.P2P_TIMEOUT` seconds raises (a deadlock), saying what it waited for. (gloo's own
#   `dist.send` blocks until the receiver posts its recv: two neighbours that both send first
#   wait forever. torch's schedules post `isend` / `irecv` and wait later, as `stage.send` does.)
#
# **Exercise 1.** `my_stage_module(model, group)`: this rank's stage, an `nn.Sequential` of the
# model's **own** children (not copies: `model.named_parameters()` must still name what trains).
# `my_forward_step(stage, mb, x, target, loss_fn)`: the first stage runs on `x`, the others on
# the activation they receive (it must `requires_grad_()`, or there is no gradient to send
# back); the last stage returns `(inp, loss_fn(out, target))`, the others send `out` on and
# return `(inp, out)`. `my_backward_step(stage, mb, inp, out)`: receive the output's gradient
# (not on the last stage), run the backward, send `inp.grad` back (not on the first).


# %% nbgrader={"grade": false, "grade_id": "stages", "locked": false, "schema_version": 3, "solution": true}
def my_stage_module(model, group):
    ### BEGIN SOLUTION
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    base, extra = divmod(len(model), p)
    start = rank * base + min(rank, extra)
    end = start + base + (1 if rank < extra else 0)
    return nn.Sequential(*[model[i] for i in range(start, end)])
    ### END SOLUTION


def my_forward_step(stage, mb, x, target, loss_fn):
    ### BEGIN SOLUTION
    inp = x if stage.is_first else stage.recv(stage.index - 1, mb).requires_grad_()
    out = stage.forward(mb, inp)
    if stage.is_last:
        return inp, loss_fn(out, target)
    stage.send(out, stage.index + 1, mb)
    return inp, out
    ### END SOLUTION


def my_backward_step(stage, mb, inp, out):
    ### BEGIN SOLUTION
    grad = None if stage.is_last else stage.recv(stage.index + 1, mb)
    stage.backward(mb, out, grad)
    if not stage.is_first:
        stage.send(inp.grad, stage.index - 1, mb)
    ### END SOLUTION


# %% [markdown]
# The check splits the lab's 8 layers and 7 layers over 4 ranks (one pipeline) and over the
# pipeline groups of a 2 x 2 ("dp", "pp") mesh, then sends one micro-batch forward and back
# through 4 stages, and through each pipeline of the 2 x 2 mesh (each dp replica on its half of
# the batch): every stage's gradients against one process and against torch's `ScheduleGPipe`.

# %% nbgrader={"grade": true, "grade_id": "stages-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("stages", lambda: pp_checks.check_stages(my_stage_module, my_forward_step, my_backward_step))

# %%
fwd_step, bwd_step = exercise.pick(
    "stages", (my_forward_step, my_backward_step), (pp_lab.forward_step, pp_lab.backward_step)
)

# %% [markdown]
# ## 2. GPipe
#
# One micro-batch through p stages keeps p - 1 of them idle at any moment. Split the batch into
# m micro-batches and the stages work on different ones at once. **GPipe** runs every
# micro-batch's forward, then every backward **in the same order** (micro-batch 0's first: its
# gradient is the first to come back from the last stage; torch's `ScheduleGPipe` does the
# same). The gradients accumulate in `.grad` over the
# micro-batches (backward adds), and the step's loss is the **sum** of the micro-batches' losses,
# as torch's schedules with `scale_grads=False`: each micro-batch's loss is already its own mean.
#
# **Exercise 2.** `my_gpipe(stage, xs, targets, loss_fn)`: xs and targets are the m
# micro-batches (x is used on the first stage, target on the last); use `fwd_step` / `bwd_step`
# (yours, or labkit's until yours pass). Keep each micro-batch's `(inp, out)` until its
# backward, then drop it. Return the last stage's losses (`out.detach()`, one per micro-batch;
# an empty list elsewhere).


# %% nbgrader={"grade": false, "grade_id": "gpipe", "locked": false, "schema_version": 3, "solution": true}
def my_gpipe(stage, xs, targets, loss_fn):
    ### BEGIN SOLUTION
    held, losses = {}, []
    for i in range(len(xs)):
        held[i] = fwd_step(stage, i, xs[i], targets[i], loss_fn)
    for i in range(len(xs)):
        inp, out = held.pop(i)
        if stage.is_last:
            losses.append(out.detach())
        bwd_step(stage, i, inp, out)
    return losses
    ### END SOLUTION


# %% [markdown]
# The check runs yours on 4 ranks (m = 4) and on 2 (m = 6): the order of each rank's slots, the
# gradients against one process and `ScheduleGPipe`, the losses, and the activations held (all m
# micro-batches' before the first backward, each freed once its backward ran; none after the
# step).

# %% nbgrader={"grade": true, "grade_id": "gpipe-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("GPipe", lambda: pp_checks.check_gpipe(my_gpipe))

# %%
gpipe = exercise.pick("GPipe", my_gpipe, pp_lab.gpipe)

# %% [markdown]
# ## 3. 1F1B
#
# GPipe holds every micro-batch's activations until the backwards start: m of them. **1F1B**
# (PipeDream-flush, Megatron's default) starts each micro-batch's backward as soon as it can:
# stage r runs a **warm-up** of p - r - 1 forwards, **capped at m** (min(p - r - 1, m): with fewer
# micro-batches than stages there are only m to run), then a **steady state** of one forward
# (micro-batch i + warm-up) and one backward (micro-batch i), then a **cool-down** of the
# remaining backwards. A stage then holds at most min(m, p - r) micro-batches. The order must respect
# what each slot waits for: the backward of micro-batch i on stage r needs its gradient from
# stage r + 1, which has it only once that micro-batch went forward through every later stage
# and back. (On gloo's blocking `dist.send`, the steady state's activation sent forward and the
# neighbour's gradient sent back would wait on each other: the classic 1F1B deadlock, which
# Megatron and torch avoid by posting both sends and receives together. `stage.send` posts and
# returns, so here only a real cycle in the order deadlocks.)
#
# **Exercise 3.** `my_1f1b(stage, xs, targets, loss_fn)`, same contract as `my_gpipe`
# (`stage.n` is p, `stage.index` is r).


# %% nbgrader={"grade": false, "grade_id": "1f1b", "locked": false, "schema_version": 3, "solution": true}
def my_1f1b(stage, xs, targets, loss_fn):
    ### BEGIN SOLUTION
    m = len(xs)
    warmup = min(stage.n - stage.index - 1, m)
    held, losses = {}, []

    def backward(i):
        inp, out = held.pop(i)
        if stage.is_last:
            losses.append(out.detach())
        bwd_step(stage, i, inp, out)

    for i in range(warmup):
        held[i] = fwd_step(stage, i, xs[i], targets[i], loss_fn)
    for i in range(m - warmup):
        f = i + warmup
        held[f] = fwd_step(stage, f, xs[f], targets[f], loss_fn)
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    return losses
    ### END SOLUTION


# %% [markdown]
# The check: 4 ranks with m = 6 (a steady state on every rank) and m = 2 (fewer micro-batches
# than stages: the warm-up capped at m; compared with one process only, as torch's
# `Schedule1F1B` refuses m < p), and 2 ranks with m = 4; the order, the gradients against one
# process and `Schedule1F1B`, at most min(m, p - r) micro-batches held on rank r, each freed once
# its backward ran. A deadlocking order fails after `pp_checks.TIMEOUT` seconds with what each
# rank waited for; an error on one rank ends the check at once, showing that rank.

# %% nbgrader={"grade": true, "grade_id": "1f1b-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("1F1B", lambda: pp_checks.check_1f1b(my_1f1b))

# %%
one_f_one_b = exercise.pick("1F1B", my_1f1b, pp_lab.one_f_one_b)

# %% [markdown]
# ## 4. Interleaved 1F1B
#
# The bubble comes from the p - 1 slots it takes to fill and drain the pipeline. Megatron's
# **interleaved** schedule cuts the model into v x p smaller chunks and gives rank r the chunks
# r, r + p, ..., r + (v - 1)p (**round-robin**: a micro-batch visits every rank v times). A
# slot is then 1/v as long, and filling takes p - 1 short slots: the bubble falls from
# (p - 1) / (m + p - 1) to (p - 1) / (v·m + p - 1), by the factor (v·m + p - 1) / (m + p - 1),
# which nears v only when m is much larger than p. The price: v·p - 1 stage boundaries instead
# of p - 1, each carrying every micro-batch both ways. Section 5 measures both factors.
#
# The order on rank r, with units k = 0 .. v·m - 1 (micro-batches in groups of p, chunk by
# chunk): unit k is micro-batch (k // (p·v))·p + k % p on chunk (k // p) % v; backwards run the
# same units with the chunks **reversed** (v - 1 - chunk). The warm-up is
# (p - r - 1)·2 + (v - 1)·p forwards (capped at v·m), or all v·m of them when m = p (Megatron's
# rule); then one forward and one backward at a time; then the remaining backwards.
#
# **Exercise 4.** `my_chunks(p, v, rank)`: the stage indices rank holds; `my_interleaved_order(p,
# v, m, rank)`: the list of `("F" | "B", micro-batch, chunk)` with chunk in 0 .. v - 1 (the k-th
# of this rank's stages); `my_interleaved(stages, xs, targets, loss_fn)`: run that order over
# this rank's stages (a list, chunk k is `stages[k]`; p is `stages[0].n // len(stages)`, the rank
# `stages[0].index`).


# %% nbgrader={"grade": false, "grade_id": "interleaved", "locked": false, "schema_version": 3, "solution": true}
def my_chunks(p, v, rank):
    ### BEGIN SOLUTION
    return [rank + k * p for k in range(v)]
    ### END SOLUTION


def my_interleaved_order(p, v, m, rank):
    ### BEGIN SOLUTION
    total = m * v

    def unit(k, backward):
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - chunk) if backward else chunk

    warmup = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [("F", *unit(k, False)) for k in range(warmup)]
    for b in range(total - warmup):
        order += [("F", *unit(warmup + b, False)), ("B", *unit(b, True))]
    return order + [("B", *unit(b, True)) for b in range(total - warmup, total)]
    ### END SOLUTION


def my_interleaved(stages, xs, targets, loss_fn):
    ### BEGIN SOLUTION
    p, rank = stages[0].n // len(stages), stages[0].index
    held, losses = {}, []
    for kind, mb, k in interleaved_order(p, len(stages), len(xs), rank):
        if kind == "F":
            held[mb, k] = fwd_step(stages[k], mb, xs[mb], targets[mb], loss_fn)
        else:
            inp, out = held.pop((mb, k))
            if stages[k].is_last:
                losses.append(out.detach())
            bwd_step(stages[k], mb, inp, out)
    return losses
    ### END SOLUTION


# %% [markdown]
# `my_interleaved` runs `interleaved_order`: yours when the order's check passes, else labkit's
# (the cell after the check sets it; until then it is yours).

# %%
interleaved_order = my_interleaved_order

# %% [markdown]
# The check: your chunks and order for p = 2 and 4, v = 2, m = 4 and 8, then your schedule on 2
# and 4 ranks (v = 2, m = 4) against one process and torch's `ScheduleInterleaved1F1B`.

# %% nbgrader={"grade": true, "grade_id": "interleaved-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check(
    "interleaved 1F1B",
    lambda: pp_checks.check_interleaved(my_chunks, my_interleaved_order, my_interleaved),
)

# %%
interleaved_order = exercise.pick("interleaved 1F1B", my_interleaved_order, pp_lab.interleaved_order)
interleaved = exercise.pick("interleaved 1F1B", my_interleaved, pp_lab.interleaved)

# %% [markdown]
# ## 5. What each schedule costs, measured
#
# One launch runs the three schedules (yours, or labkit's) on 4 ranks with m = 8 micro-batches
# of 2 rows (m = 2p), and records each rank's slots, the activations it held at the start of
# each slot, and every message.

# %%
P_RANKS, M, ROWS = 4, 8, 16
runs = {"GPipe": (gpipe, 1), "1F1B": (one_f_one_b, 1), "interleaved 1F1B, v = 2": (interleaved, 2)}
measured = labkit.run(
    pp_lab.measure_schedules, runs, M, ROWS, world_size=P_RANKS, backend="gloo", timeout=300
)
replays = {name: pp_lab.replay([r[name]["slots"] for r in measured], P_RANKS) for name in runs}

# %% [markdown]
# **The bubble.** Wall clocks on this shared machine say little, so the bubble comes from the
# recorded **order**: `pp_lab.replay` gives every forward and backward slot the same length (a
# chunk of 1/v of a stage: 1/v), starts each slot when its rank is free and its input has
# arrived, and reads each rank's idle share of the makespan (the replay is labkit's strategy's,
# `labkit.strategies.pp.timeline`). The formula, `predicted_bubble`: (p - 1) / (m + p - 1), and
# (p - 1) / (v·m + p - 1) interleaved.

# %%
for name, (_, v) in runs.items():
    bubble, got = predicted_bubble(P_RANKS, M, v), replays[name]["bubble"]
    if any(abs(float(b) - bubble) > 1e-12 for b in got):
        raise AssertionError(f"{name}: replayed bubble per rank {got}, formula (p-1)/(v·m+p-1) = {bubble}")
    print(f"{name:>24}: bubble {got[0]} = {float(got[0]):.1%} on every rank; (p-1)/(v·m+p-1) = {bubble:.1%}")

# %%
fig_schedules = pp_lab.plot_schedules(replays, P_RANKS)  # drawn once, by the helper

# %% [markdown]
# **Activation memory.** A stage keeps each micro-batch's activations (what its layers saved for
# backward: every Linear's input and every Tanh's output, `pp_lab.activation_bytes`) from its
# forward until its backward. GPipe holds all m micro-batches on every stage; 1F1B holds at most
# p - r on stage r. Measured: the distinct storages still alive at the start of each slot, peak
# over the step, in bytes.

# %%
rows_mb = ROWS // M
for name in ("GPipe", "1F1B"):
    for rank, res in enumerate(measured):
        per_mb = pp_lab.activation_bytes(rank, P_RANKS, rows_mb)
        held = M if name == "GPipe" else min(M, P_RANKS - rank)
        peak = max(b for _, b in res[name]["live"])
        assert_match(f"{name}, rank {rank}: {held} micro-batches x {per_mb} B", held * per_mb, peak)
peaks = {name: [max(b for _, b in r[name]["live"]) for r in measured] for name in ("GPipe", "1F1B")}
print("peak activations per rank:", {k: [fmt_bytes(b) for b in v] for k, v in peaks.items()})
print(f"1F1B / GPipe on rank 0: {peaks['1F1B'][0] / peaks['GPipe'][0]:.2f} (p / m = {P_RANKS / M:.2f})")

# %% [markdown]
# **Bytes per step.** Each of the v·p - 1 stage boundaries carries every micro-batch's
# activation forward and its gradient back: 2·m·rows·width·8 B per boundary
# (`pp_lab.p2p_bytes`), whatever the schedule: the order changes when, not what. Interleaving
# multiplies the boundaries. Per rank (`pp_lab.stage_p2p_bytes`), a middle stage sends both ways
# (its output forward, its input's gradient back), the first and last stage one way each; at
# pp = 1 there is no boundary and PP sends nothing. Against the tracer (the sends' payloads, and
# what the wire counter saw leave the ranks; per rank for 1F1B):

# %%
for name, (_, v) in runs.items():
    traced = pp_lab.p2p_traced(measured, name)
    want = pp_lab.p2p_bytes(M, rows_mb, P_RANKS * v)
    assert_match(f"{name}: point-to-point bytes per step", want, traced["bytes"])
    assert_match(f"{name}: bytes on the wire", want, traced["intra"])
    print(f"{name:>24}: {traced['messages']} messages, {fmt_bytes(traced['bytes'])} per step")
# per rank: a middle stage sends both ways (its output forward, its input's gradient back), an end
# stage one way; at pp = 1 there is no boundary, so PP sends nothing (stage_p2p_bytes(0, ..., 1))
for rank in range(P_RANKS):
    want = pp_lab.stage_p2p_bytes(rank, M, rows_mb, P_RANKS)
    assert_match(
        f"1F1B, rank {rank}: bytes it sends per step",
        want,
        pp_lab.p2p_traced(measured, "1F1B", rank)["bytes"],
    )
print(
    f"1F1B per rank: {', '.join(fmt_bytes(pp_lab.p2p_traced(measured, '1F1B', r)['bytes']) for r in range(P_RANKS))} "
    f"(the middle stages both ways); at pp = 1: {pp_lab.stage_p2p_bytes(0, M, rows_mb, 1)} B"
)

# %% [markdown]
# **What interleaving bought, and paid.** Against 1F1B in the same run: the bubble's factor
# (v·m + p - 1) / (m + p - 1) and the messages' (v·p - 1) / (p - 1), from the replay and the
# tracer, checked against the formulas (the cell raises if not):

# %%
V = runs["interleaved 1F1B, v = 2"][1]
bubble_gain = float(replays["1F1B"]["bubble"][0] / replays["interleaved 1F1B, v = 2"]["bubble"][0])
messages = {name: pp_lab.p2p_traced(measured, name)["messages"] for name in runs}
message_cost = messages["interleaved 1F1B, v = 2"] / messages["1F1B"]
assert_match(
    "bubble, 1F1B / interleaved", (V * M + P_RANKS - 1) / (M + P_RANKS - 1), bubble_gain, 1e-12, unit=""
)
assert_match("messages, interleaved / 1F1B", (V * P_RANKS - 1) / (P_RANKS - 1), message_cost, 1e-12, unit="")
print(
    f"p = {P_RANKS}, m = {M}, v = {V}: the bubble divided by {bubble_gain:.2f} (not {V}), "
    f"the messages multiplied by {message_cost:.2f}"
)

# %% [markdown]
# **Summary.** All three schedules give one process's gradients. GPipe and 1F1B have the same
# bubble; 1F1B holds p - r micro-batches instead of m, so m can grow (shrinking the bubble)
# without the activations growing. Interleaving shrinks the bubble by less than v at this m (the
# factor printed above) for more messages (the other factor). What a stage sends is activations,
# not parameters: it grows with the tokens and the width, not with the model's size.

# %% [markdown]
# **The same schedules as labkit's strategy.** labkit's `labkit.strategies.pp` runs these
# schedules for the loop: `orders(schedule, p, m, v)` gives each rank's order of F / B slots,
# and the strategies `"pp"` (TinyGPT split by blocks over every rank) and `"pp-zero1"` (PP x
# ZeRO-1 on a 2 x 2 ("dp", "pp") mesh) train with them. The orders your schedules recorded above
# must be the strategy's, slot for slot; and both strategies, 2 AdamW steps on a small TinyGPT in
# float64 on 4 ranks, must equal `loop.reference` (one process, the same global batch): losses,
# step 0's gradients and the final state, element-wise.

# %%
for name, (kind, v) in {
    "GPipe": ("gpipe", 1),
    "1F1B": ("1f1b", 1),
    "interleaved 1F1B, v = 2": ("interleaved", 2),
}.items():
    for rank, want in enumerate(pp_orders(kind, P_RANKS, M, v)):
        got = [Action(k, s, mb) for k, mb, s in measured[rank][name]["slots"]]
        if got != want:
            raise AssertionError(f"{name}, rank {rank}: recorded {got}, labkit.strategies.pp.orders {want}")
TINY = loop.PRESETS["dp"].replace(dtype=torch.float64, batch_size=8)
trained = labkit.run(
    loop.sweep, [dict(strategy="pp"), dict(strategy="pp-zero1")], cfg=TINY, steps=2, spans=False, world_size=4
)
one = loop.reference(TINY, 2)
for rank, got in enumerate(trained):
    for name, res in zip(("pp", "pp-zero1"), got):
        for part in ("grads", "state"):
            compare(
                one[part], res[part], label=f"{name} rank {rank} {part}", rtol=0, atol=1e-12
            ).raise_if_failed()
        if max(abs(a - b) for a, b in zip(one["losses"], res["losses"])) > 1e-12:
            raise AssertionError(f"{name} rank {rank}: losses {res['losses']}, one process {one['losses']}")
print("recorded orders = labkit.strategies.pp.orders on every rank, for the three schedules")
print(
    '"pp" and "pp-zero1" on 4 ranks: losses, gradients and state equal to one process (float64, atol 1e-12)'
)

# %% [markdown]
# ## 6. Across the slow link: PP, TP or FSDP
#
# On 2 simulated nodes x 2 ranks (labkit.run(nodes=2): the ranks of a node talk at this machine's
# speed, what crosses between the nodes goes through the simulated link `NodeLink()`, whose
# bandwidth and latency the cell prints), which dimension should cross? tp_lab's transformer
# block (`pp_lab.CROSS`, printed), two layouts from tp_lab (FSDP x TP with TP across the nodes,
# and with FSDP across: one block each), and PP x DP with the pipeline across the nodes: two
# blocks, one per stage, each dp replica (in the node) its half of the batch in 2 micro-batches
# through 1F1B, the gradients averaged over dp. The bytes are the tracer's.

# %%
SIZE = pp_lab.CROSS
LINK = NodeLink()  # labkit.run(nodes=...)'s default inter-node link
print(
    f"the block: {SIZE}; the link between the nodes: {LINK.bandwidth_Bps / 1e9:g} GB/s, {LINK.latency_s * 1e6:g} us a message"
)
pp_cross = labkit.run(
    pp_lab.pp_across_nodes, one_f_one_b, SIZE, world_size=4, nodes=2, backend="gloo", timeout=300
)
lay = labkit.run(tp_lab.two_layouts, steps=2, size=SIZE, world_size=4, nodes=2, backend="gloo", timeout=300)
tokens_d = SIZE["batch"] * SIZE["seq"] * SIZE["d"]
crossing = {
    "PP across (DP in node)": pp_lab.node_bytes_per_step(pp_cross),
    "TP across (FSDP in node)": tp_lab.fsdp_tp_node_bytes(lay, "TP across nodes"),
    "FSDP across (TP in node)": tp_lab.fsdp_tp_node_bytes(lay, "TP in node"),
}
for k, b in crossing.items():
    print(
        f"{k:>25}: {fmt_bytes(b)} across nodes per step ({'2 blocks' if k.startswith('PP') else '1 block'}, measured)"
    )

# %% [markdown]
# The formulas: PP sends each dp replica's activations across once forward and their gradient
# once back, 2 x tokens x d x 4 B per step in all (both pipelines, fp32), **whatever the
# depth**; TP all-reduces the activations 4 times per block (tp_lab's section 7 checks those
# bytes); FSDP gathers and reduce-scatters the parameters (grows with the model). Checked here
# for PP, and the order: PP's two blocks cross fewer bytes than FSDP's or TP's single block.

# %%
assert_match(
    "PP across: 2 x tokens x d x 4 B", 2 * tokens_d * 4, crossing["PP across (DP in node)"], rel_tol=0.005
)
assert (
    crossing["PP across (DP in node)"]
    < crossing["FSDP across (TP in node)"]
    < crossing["TP across (FSDP in node)"]
), crossing
print(
    f"measured: PP's 2 blocks cross {fmt_bytes(crossing['PP across (DP in node)'])} per step, FSDP's 1 block "
    f"{fmt_bytes(crossing['FSDP across (TP in node)'])}, TP's 1 block {fmt_bytes(crossing['TP across (FSDP in node)'])}"
)

# %% [markdown]
# **Summary.** PP's traffic is the smallest, point to point between two neighbours, and does not
# grow with the number of layers: that is why large runs put the pipeline across nodes (or
# across racks), TP inside the node and data parallelism around both.

# %% [markdown]
# ## 7. The choice: FSDP, or ZeRO-1 x TP x PP?
#
# Five layouts of n ranks, g per node, a model of P parameters (L layers of width d) and a step
# of `tokens` tokens. Per rank, model states only, in mixed precision with Adam (the ZeRO
# paper's 2 + 2 + 12 = 16 B per parameter: bf16 weights, bf16 gradients, fp32 master and two
# moments); the bytes each rank **sends** per step on rings (all-reduce 2(k-1)/k of the tensor,
# all-gather and reduce-scatter (k-1)/k), in bf16 (2 B):
#
# - **DDP**: everything replicated; an all-reduce of the gradients over n.
# - **FSDP**: everything sharded over n; an all-gather in forward, one in backward, a
#   reduce-scatter of the gradients.
# - **HSDP**: FSDP inside the node (shards over g), and an all-reduce of each shard over the
#   n / g nodes.
# - **ZeRO-1 x TP x PP**: each rank holds P / (tp·pp) (its TP piece of its stage's layers), the
#   optimizer state of it sharded over the dp = n / (tp·pp) replicas; a reduce-scatter of the
#   gradients and an all-gather of the parameters over dp; TP's 4 all-reduces per layer of the
#   replica's activations (tokens / dp x d) on its L / pp layers; PP's activation forward and
#   gradient back of its TP piece (tokens / dp x d / tp each).
# - **FSDP x TP**: each rank's TP piece P / tp, everything sharded over dp = n / tp; FSDP's three
#   collectives of P / tp over dp, TP's 4 all-reduces on all L layers.
#
# **Exercise 5.** `my_memory(layout, c)` and `my_comm(layout, c)` for a `pp_choice.Config` `c`
# (fields params, layers, d, n, tokens, tp, pp, g): bytes per rank, and bytes sent per rank per
# step (everything, in the node and across).


# %% nbgrader={"grade": false, "grade_id": "choice", "locked": false, "schema_version": 3, "solution": true}
def my_memory(layout, c):
    ### BEGIN SOLUTION
    P, n = c.params, c.n
    return {
        "DDP": 16 * P,
        "FSDP": 16 * P / n,
        "HSDP": 16 * P / c.g,
        "ZeRO-1 x TP x PP": 4 * P / (c.tp * c.pp) + 12 * P / n,
        "FSDP x TP": 16 * P / n,
    }[layout]
    ### END SOLUTION


def my_comm(layout, c):
    ### BEGIN SOLUTION
    n, S = c.n, 2 * c.params

    def ring(k, all_reduce=False):
        return (2 if all_reduce else 1) * (k - 1) / k

    if layout == "DDP":
        return ring(n, True) * S
    if layout == "FSDP":
        return 3 * ring(n) * S
    if layout == "HSDP":
        return 3 * ring(c.g) * S + ring(n // c.g, True) * S / c.g
    pp = c.pp if layout == "ZeRO-1 x TP x PP" else 1
    dp = n // (c.tp * pp)
    tp_bytes = 4 * (c.layers // pp) * ring(c.tp, True) * c.tokens / dp * c.d * 2
    if layout == "FSDP x TP":
        return tp_bytes + 3 * ring(dp) * S / c.tp
    pp_bytes = 2 * c.tokens / dp * c.d * 2 / c.tp if pp > 1 else 0
    return tp_bytes + pp_bytes + 2 * ring(dp) * S / (c.tp * pp)
    ### END SOLUTION


# %% [markdown]
# The check compares yours with labkit's (`pp_choice.memory_per_rank`, built on the cost
# model's `costmodel.memory_per_rank`, and `pp_choice.comm_per_rank`) on every layout for
# several configurations, one node and many, with and without PP.

# %% nbgrader={"grade": true, "grade_id": "choice-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("layout formulas", lambda: pp_checks.check_formulas(my_memory, my_comm))

# %%
memory_f, comm_f = exercise.pick(
    "layout formulas", (my_memory, my_comm), (pp_choice.memory_per_rank, pp_choice.total_comm)
)

# %% [markdown]
# Your formulas on the two real configurations: model states per rank (they decide what fits)
# and the bytes each rank sends per step. Bytes are not yet time: what a layout costs depends on
# which link carries them, what hides behind compute, the pipeline's bubble and the activations.
# Exercises 6 to 8 build those pieces of labkit's step model (`costmodel.layout_step`).

# %%
from labkit import costmodel  # noqa: E402
from labkit.costmodel.published import META_H100  # noqa: E402
from labkit.labs import pp_choice_checks  # noqa: E402

for name, c in pp_choice.REAL.items():
    print(f"{name} (tp = {c.tp}, pp = {c.pp}, {c.tokens / 2**20:g} M tokens per step):")
    for layout in pp_choice.LAYOUTS:
        print(
            f"   {layout:>17}: {memory_f(layout, c) / 1e9:7.1f} GB of model states per rank, "
            f"sends {comm_f(layout, c) / 1e9:6.1f} GB per step"
        )  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# **Exercise 6: the bubble.** A pipeline of p stages runs m >= p micro-batches; interleaved, each
# rank holds v chunks, so it has v m slots of work, each 1/v of a stage's. How much of the step is a
# rank idle? `my_bubble(p, v, m)`: the idle share of the whole step (idle over idle + busy). (With
# m < p an interleaved round waits for its first micro-batch to come round all p stages, which
# `layout_step` prices: v p + m - 1 slots. Your formula need only hold for m >= p, or v = 1.)


# %% nbgrader={"grade": false, "grade_id": "bubble", "locked": false, "schema_version": 3, "solution": true}
def my_bubble(p, v, m):
    ### BEGIN SOLUTION
    return (p - 1) / (v * m + p - 1)
    ### END SOLUTION


# %% [markdown]
# The check compares yours with `costmodel.layout_step`'s bubble for five (p, v, m), each with
# m >= p or v = 1.

# %% nbgrader={"grade": true, "grade_id": "bubble-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("the bubble", lambda: pp_choice_checks.check_bubble(my_bubble))

# %% [markdown]
# **Exercise 7: FSDP or ZeRO-1 under a pipeline.** The data-parallel axis around a pipeline
# still shards something. ZeRO-1 reduce-scatters the gradients once per step and all-gathers the
# updated bf16 parameters once, after the optimizer step. FSDP frees the gathered parameters after
# each unit's forward (reshard) and gathers them again for its backward -- and a pipeline runs m
# micro-batches through every unit, each with its own forward and backward. FSDP without reshard
# (Llama 3's choice) keeps them gathered for all m. The gradients, under a pipeline, every layout
# here holds until the last micro-batch and reduces once per step: DDP and ZeRO-1 in their
# unsharded buffer, FSDP as `torch.distributed.pipelining` drives it (its gradient sync off until the
# last backward). `my_dp_bytes(zero, reshard, piece, k, m)`: the
# bytes each rank sends per step over k data-parallel ranks for its `piece` parameters, a dict
# {"all_reduce", "reduce_scatter", "all_gather"}; zero is 0 (DDP), 1 (ZeRO-1) or 3 (FSDP);
# gradients in fp32 (4 B, Megatron-LM's and torchtitan's default), parameters in bf16 (2 B).


# %% nbgrader={"grade": false, "grade_id": "dp-bytes", "locked": false, "schema_version": 3, "solution": true}
def my_dp_bytes(zero, reshard, piece, k, m):
    ### BEGIN SOLUTION
    ring = (k - 1) / k
    grads = 4 * piece
    if zero == 0:
        return {"all_reduce": 2 * ring * grads, "reduce_scatter": 0.0, "all_gather": 0.0}
    gathers = 2 * m if zero == 3 and reshard else 1
    return {"all_reduce": 0.0, "reduce_scatter": ring * grads, "all_gather": gathers * ring * 2 * piece}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "dp-bytes-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("data-parallel bytes under PP", lambda: pp_choice_checks.check_dp_bytes(my_dp_bytes))

# %% [markdown]
# What those bytes cost, by `costmodel.layout_step` (H100s, 400 Gb/s per GPU across nodes, a ring
# across nodes spread over the node's 8 NICs): 70B on 2,048 GPUs as tp 8 x pp 4 x dp 64, m = 16
# micro-batches. The gathers hide behind compute layer by layer where they can; with reshard, 2m
# of them per step do not all fit behind it. Your bytes are printed beside the model's exposed time.

# %%
dp_fn = exercise.pick("data-parallel bytes under PP", my_dp_bytes, pp_choice.dp_bytes)
SEVENTY = pp_choice.MODELS["70B"]
base = {"dp": 64, "tp": 8, "pp": 4, "v": 1}
for label, extra in (
    ("ZeRO-1", {"zero": 1}),
    ("FSDP, reshard", {"zero": 3}),
    ("FSDP, no reshard", {"zero": 3, "reshard": False}),
):
    row = costmodel.layout_step(SEVENTY, {**base, **extra}, META_H100, seq_len=4096,
                                global_batch_tokens=4 * 2**20, micro_batch=1)  # fmt: skip
    sent = dp_fn(extra["zero"], extra.get("reshard", True), SEVENTY.params / 32, 64, row["m"])
    exposed = row["exposed_comm_s"]["param_gather"] + row["exposed_comm_s"]["grad_reduce"]
    print(
        f"{label:>17}: sends {sum(sent.values()) / 1e9:6.1f} GB per step over dp, {exposed * 1e3:6.0f} ms of it exposed, "
        f"step {row['step_s']:.2f} s"
    )  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# **Exercise 8: the activations of a rank.** Per layer and micro-batch of b sequences of s tokens,
# a transformer keeps about 34 s b d bytes for its backward (Korthikanti et al. 2022, bf16, flash
# attention: no s x s scores); sequence parallelism splits all of it over the tp ranks. 1F1B's
# first stage holds the activations of min(p, m) micro-batches for its L / p layers. Interleaved
# (v > 1), the rank holds v chunks of L / (p v) layers, still L / p layers in all, and more
# micro-batches in flight: times 1 + (p - 1) / (p v) (for v > 1 only; v = 1 is plain 1F1B). Full
# recomputation keeps only each layer's input, 2 s b d / t (split by sequence parallelism too),
# plus one layer's full set while it recomputes. `my_activations(model, layout, seq_len,
# micro_batch, m)`: the first stage's bytes per rank at their peak (`model.layers`, `model.d`;
# `layout` has "tp", "pp", "v", "recompute" ("none" or "full"); every case's L divides by p v).


# %% nbgrader={"grade": false, "grade_id": "activations", "locked": false, "schema_version": 3, "solution": true}
def my_activations(model, layout, seq_len, micro_batch, m):
    ### BEGIN SOLUTION
    t, p, v = layout["tp"], layout["pp"], layout["v"]
    s, b, d = seq_len, micro_batch, model.d
    full = 34 * s * b * d / t
    layers = model.layers // p
    in_flight = min(p, m) * ((1 + (p - 1) / (p * v)) if v > 1 else 1)
    if layout["recompute"] == "full":
        return layers * 2 * s * b * d / t * in_flight + full
    return layers * full * in_flight
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "activations-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("activations per rank", lambda: pp_choice_checks.check_activations(my_activations))

# %% [markdown]
# **Measured on 8 ranks.** The model's order, tried on real ranks: labkit's DDP, FSDP, HSDP and
# FSDP x TP (tp = 4 in the node) train TinyGPT (d = 64, 2 layers) for a warm-up step and a timed step on 2 simulated
# nodes x 4 ranks (on a free link: the bytes are what counts); the tracer counts what the
# busiest rank sent across nodes. The cost model's formula, at the same size (fp32), must put
# them in the measured order, and so must the slow link's cost of the measured traffic (its
# bytes / bandwidth + messages x latency). The lab raises if not. With them the two 3-D layouts,
# labkit's `"zero1-tp-pp"` (Megatron-LM's: ZeRO-1 over dp) and `"fsdp-tp-pp"` (Llama 3's: FSDP
# over dp without reshard), as dp 2 x pp 2 x tp 2 (1F1B, m = 4): tp and pp inside each node, dp across, so only
# the data-parallel collectives of each rank's piece cross (their prediction counts that piece from
# the model: the TP-split weights / 2, the norms and embeddings whole). The model ties the two (the
# same bytes: one reduce-scatter, one all-gather per step); a tie is not ordered.

# %%
from labkit.labs import hsdp_lab  # noqa: E402

CFG8 = loop.PRESETS["fsdp"].replace(gpt=dict(d_model=64, n_heads=4, n_layers=2), batch_size=8, seq_len=8)
eight = labkit.run(
    hsdp_lab.train_windows,
    pp_choice.SMALL_RUNS,
    CFG8,
    1,
    warmup=1,
    count_flops=True,
    world_size=8,
    nodes=2,
    inter_node=hsdp_lab.FREE_LINK,
    backend="gloo",
    timeout=600,
)
busiest = {
    k: max(hsdp_lab.node_bytes_per_step(eight, k, rank=r) for r in range(8)) for k in pp_choice.SMALL_RUNS
}
link_cost = {k: hsdp_lab.link_cost(eight, k, LINK) for k in pp_choice.SMALL_RUNS}
predicted = {k: pp_choice.predicted_inter(k, loop.build_model(CFG8)) for k in pp_choice.SMALL_RUNS}
for k in pp_choice.SMALL_RUNS:
    print(
        f"{k:>10}: busiest rank sent {fmt_bytes(busiest[k])} across nodes (model: {fmt_bytes(predicted[k])}), "
        f"{link_cost[k] * 1e3:.1f} ms on the default link"
    )
order = sorted(predicted, key=predicted.get)
pp_choice.check_order(predicted, busiest, link_cost)
print("the model's order, cheapest across nodes first:", " < ".join(order))

# %% [markdown]
# **Compute and the bubble, from the same run.** Each rank counted the floating-point operations
# of every matmul and attention of its warm-up step (torch's FLOP formulas, those
# `FlopCounterMode` adds up); `pp_choice.check_flops` raises unless each rank's count equals the
# cost model's
# (`rank_flops`: layout_step's 6 x the layer's parameters + 12 d s of attention per token, split
# over tp, L / pp layers per stage, the LM head whole on the last stage, as labkit's TinyGPT
# plan replicates it). Per rank the layouts do about the same work: every one splits the same
# tokens' FLOPs over 8 ranks; what does not split (the head, on every tp rank of the last stage)
# makes the busiest rank of FSDP x TP and of the 3-D layouts do more than a DDP rank.
# The timed step's CPU time (the process's, every thread) is shown, not compared: at d = 64 on a
# few tokens it is per-op dispatch, FSDP's hooks and labkit's collectives, written in Python,
# which a GPU step model does not price; `check_overhead` raises if the FLOPs, at this core's
# matmul rate (`matmul_rate`), explain more than half of any busiest rank's CPU time, where the
# text would stop holding. The bubble: every pipeline's recorded order of forward and backward
# actions (`hsdp_lab.pipeline_order`, the order its last step ran) replayed by labkit's timeline
# (a forward takes 1, a backward 2; again with 1: the bubble does not depend on it) must equal
# the cost model's (p - 1) / (v m + p - 1) for p = 2, m = 4, v = 1 (`check_bubbles`). Neither
# FLOPs nor an order depends on a clock: the checks hold under any load.

# %%
TINY = pp_choice.transformer_of(loop.build_model(CFG8))
compute = pp_choice.run_compute(eight)
flop_ratio = pp_choice.check_flops(compute, TINY, CFG8.batch_size, CFG8.seq_len)
explained = pp_choice.check_overhead(compute, pp_choice.matmul_rate())
pipelined = [k for k in pp_choice.SMALL_RUNS if "pipeline" in eight[0][k]]
logs = {k: pp_choice.pipeline_logs(eight, k) for k in pipelined}
bubbles = {k: {r: pp_choice.replayed_bubble(lg) for r, lg in logs[k].items()} for k in pipelined}
same = {k: {r: pp_choice.replayed_bubble(lg, backward=1.0) for r, lg in logs[k].items()} for k in pipelined}
model_bubble = {
    k: pp_choice.bubble(opts["pp"], opts.get("virtual_stages", 1), opts["n_microbatches"])
    for k, (_, opts) in pp_choice.SMALL_RUNS.items()
    if k in pipelined
}
pp_choice.check_bubbles(bubbles, model_bubble)
pp_choice.check_bubbles(same, model_bubble)
cpu_ddp = max(compute["DDP"]["cpu_s"])
print(
    f"{'layout':>17} | busiest rank: CPU ms/step, / DDP's | FLOPs / DDP's: counted, model | bubble: replayed, model"
)
for k, c in compute.items():
    busiest = max(c["flops"])
    bub = f"{max(bubbles[k].values()):.3f}, {model_bubble[k]:.3f}" if k in bubbles else "-"
    print(
        f"{k:>17} | {max(c['cpu_s']) * 1e3:17.1f}, {max(c['cpu_s']) / cpu_ddp:5.2f}x | "
        f"{busiest / max(compute['DDP']['flops']):22.3f}, {flop_ratio[k]:.3f} | {bub:>17}"
    )
print(
    f"the FLOPs explain at most {max(explained.values()):.0%} of a busiest rank's CPU time (at this core's matmul rate)"
)

# %% [markdown]
# **The selection table.** Four situations; in each, `costmodel.search` prices every layout of
# the GPUs (tp in {1, 2, 4, 8} inside the node, every pp, v, the ZeRO stage, FSDP with or without
# reshard, HSDP sharded over a node's data-parallel ranks, how ZeRO-2 and FSDP accumulate gradients
# -- below --, recomputation, the micro-batch) with `layout_step`, the links priced per rail, memory
# with activations, and the global batch: a layout must give every data-parallel rank whole
# micro-batches. It keeps those that fit in 80 GB.
#
# A model is not a stopwatch. On the published runs it did not calibrate on, its step times are
# off by up to `published.error_band()` (docs/published_runs.md): two layouts closer than that
# are a **tie**, and the model cannot say which is faster. So the table prints the best layout of
# each family tied with the fastest, names the others, and picks among the tied by stated rules
# (`pp_choice.TIE_BREAK`, in order): fewer parallel axes (each one a process group, a code path and
# collectives on the critical path), fewer bytes across nodes (the slow link, where the model
# leaves out contention and stragglers), fewer data-parallel collectives per step, more memory
# headroom (for what the model does not price: the allocator, NCCL's buffers). `check_table` raises
# unless the ties and the verdict follow from the rows, and `check_pieces` recomputes the fastest
# layout's and the verdict's bubble, activations and (where the gradients are held, exercise 7's
# case) data-parallel bytes with **your** exercise 6-8 functions (labkit's, for any whose check
# has not passed).

# %%
from labkit.costmodel import published  # noqa: E402

choices = pp_choice.choices()
band = published.error_band()
print(f"the model's error on runs it did not calibrate on: up to {band:.1%} of a step; closer layouts tie")
for situation, c in choices.items():
    print(f"\n{situation}")
    for fam, r in c["tied"].items():
        lay = r["layout"]
        print(
            f"   {fam:>18}: {r['step_s'] / c['fastest']['step_s']:5.3f}x the fastest, {r['memory_total'] / 1e9:3.0f} GB, "
            f"{sum(r['inter_node_bytes'].values()) / 1e9:5.1f} GB across nodes, {pp_choice.parallel_axes(lay)} axes "
            f"(dp {lay['dp']}, tp {lay['tp']}, pp {lay['pp']}, v {lay['v']}, m {r['m']})"
            f"{'  <- verdict' if r is c['verdict'] else ''}"
        )  # NBVAL_CHECK_OUTPUT
    others = [f for f in c["best"] if f not in c["tied"]]
    v = c["verdict"]
    print(
        f"   {len(c['tied'])} families tie; {len(others)} more fit, each over {band:.0%} behind ({', '.join(others)})\n"
        f"   -> {pp_choice.family(v['layout'])}, broken by {c['broken_by']}: step {v['step_s']:.2f} s, MFU {v['mfu']:.0%}"
    )  # NBVAL_CHECK_OUTPUT
pp_choice.check_table(choices)
pieces = (
    exercise.pick("the bubble", my_bubble, pp_choice.bubble),
    exercise.pick("data-parallel bytes under PP", my_dp_bytes, pp_choice.dp_bytes),
    exercise.pick("activations per rank", my_activations, pp_choice.activations),
)
print(
    f"\nyour exercise 6-8 functions agree with layout_step on {pp_choice.check_pieces(choices, *pieces)} values"
)

# %% [markdown]
# Every searched layout as a point: how far behind the fastest it is, and what it costs in memory.
# The grey band is the model's error, and everything in it ties with the fastest (the star); the
# cross is the verdict the rules pick among them.

# %%
pp_choice.plot_choices(choices)

# %% [markdown]
# **Gradient accumulation is not free.** With m > 1 micro-batches per step, a layout that shards
# the gradients must choose how to add them up. Either it reduce-scatters every micro-batch's
# gradients into its shard (`accumulate="reduce_each"`: DeepSpeed's ZeRO-2, FSDP's default): m
# reduce-scatters per step, each hidden behind its own micro-batch's backward as far as that lasts.
# Or it holds the stage's unsharded fp32 gradients until the last micro-batch and reduces them once
# (`"hold"`: ZeRO-1's traffic and ZeRO-1's gradient memory; Megatron-LM's distributed optimizer,
# FSDP under `torch.distributed.pipelining`, Llama 3). ZeRO-2 that holds is ZeRO-1 under another
# name. The search tries both. Here is the 70B situation's fastest layout (ZeRO-2 x TP x PP, m = 2)
# priced three ways. The summary below names each verdict, and `pp_choice.check_summary` raises if
# the run stops giving them.

# %%
situation = pp_choice.ACCUMULATING
for label, row in pp_choice.accumulation(situation, choices[situation]["fastest"]).items():
    print(
        f"{label:>19}: reduce-scatters {row['dp_bytes']['reduce_scatter'] / 1e9:5.1f} GB per step "
        f"({row['exposed_comm_s']['grad_reduce'] * 1e3:3.0f} ms exposed), gradients {row['memory_bytes']['gradients'] / 1e9:5.1f} GB, "
        f"step {row['step_s']:.3f} s, {row['memory_total'] / 1e9:.0f} GB per GPU{'' if row['fits'] else ': does not fit'}"
    )  # NBVAL_CHECK_OUTPUT
pp_choice.check_summary(choices)

# %% [markdown]
# **Summary.** Read the table, not a rule of thumb, and read it with its error. In every
# situation several families land within the model's error of the fastest, so the step time alone
# does not decide; the rules do, and they favour the simpler layout. On one node, when only the
# optimizer state is short (7B), ZeRO-1 is the fastest and the verdict: every family with data
# parallelism ties with it (TP and PP alone are slower than the error), and of the three without a
# parallel axis it has the fewest collectives (one reduce-scatter, one
# all-gather per step); FSDP without reshard does the same with less headroom. When the model's
# states do not fit on a few nodes (30B on 2), ZeRO-2 x TP x PP is the fastest, its data-parallel
# and tensor-parallel ranks inside a node and only the pipeline's sends crossing, but FSDP alone is
# within the error (8 % behind), with no parallel axis at all: the verdict. At scale the global
# batch decides. 4 M tokens over 2,048 GPUs is 2,048 tokens per GPU, half a sequence, so data
# parallelism alone cannot use them: TP (or PP, or CP) must split each sequence's work. ZeRO-2 x TP x PP
# with m = 2 is the fastest; it pays for its sharded gradients with a second reduce-scatter per step
# (above), because holding them (ZeRO-1) does not fit. ZeRO-2 x TP and FSDP x TP, 3 % behind with
# one axis fewer, tie with it, and so does ZeRO-1 x TP x PP (9 % behind): the model cannot tell
# Megatron's layout from torchtitan's here. For post-training (13B on 64 GPUs), FSDP with one
# micro-batch per step is the fastest and the verdict. FSDP's reshard costs 2m all-gathers per step
# under PP (exercise 7), so ZeRO-1/2 or FSDP without reshard (Llama 3's choice: gradients held,
# ZeRO-1's bytes) go with the pipeline. An interleaved pipeline needs m >= p micro-batches, else
# each round waits for its first micro-batch to come round the p stages. The cost model was checked
# against Megatron-LM's and Llama 3's published runs (docs/published_runs.md): the largest miss
# is the error band the ties use.
# The real APIs: `torch.distributed.pipelining` (`pipeline`, `PipelineStage`, `ScheduleGPipe`,
# `Schedule1F1B`, `ScheduleInterleaved1F1B`), Megatron-LM's `--pipeline-model-parallel-size` and
# `--virtual-pipeline-model-parallel-size`, torchtitan's FSDP x TP x PP.
#
# *Exercises:* (1) With m = 8 and p = 4, how large must v be for the interleaved bubble to fall
# under 5 %? What does it cost in messages? (2) Why does 1F1B not change the bubble, only the
# memory? (3) The zero-bubble schedules split each backward into its input-gradient and
# weight-gradient halves: which half must run in order, and which can fill the bubble? (4) Double
# the 70B situation's tokens per step: which verdict changes, and why?

# %% [markdown]
# ## 8. Zero bubble: the backward in two halves
#
# A backward computes two things: the gradient of the stage's **input**, which the previous stage
# waits for (it is on the critical path), and the gradient of the stage's **weights**, which
# nobody needs before the optimizer step. The zero-bubble schedules (Qi et al., "Zero Bubble
# Pipeline Parallelism", ICLR 2024) split them: **B** computes the input's gradient and sends it
# back at once; **W** computes the weights' gradient later, wherever the rank would otherwise
# idle. Count one slot for each of F, B and W (a whole backward is then 2). In 1F1B's cool-down,
# rank r idles while the gradients of its last micro-batches come back through the later stages.
# **ZB-H1** keeps 1F1B's warm-up (p - rank - 1 forwards) and steady state (a forward, then a B),
# but rank r runs each W r backwards late, W(k) right after B(k + r), and its r deferred W's after
# its last B, in that idle time. A micro-batch's activations now stay until its W (the weights'
# gradient needs the layers' saved inputs), so rank r holds (p - r) + r = p of them at most:
# 1F1B's peak (rank 0's), now on every rank. The bubble shrinks from 3 (p - 1) slots per rank to
# p - 1.
#
# **Exercise 9: the backward in two halves, on one stage.** `my_backward_input(out, grad, inp)`
# (B): the gradient of the stage's input alone, returned (the runtime sends it back at once), with
# no weight's `.grad` touched and the graph kept for W. `my_backward_weight(out, grad, params)` (W):
# the weights' gradients, added to their `.grad` as `backward` adds them (micro-batches sum up),
# the input's left alone. Both restrict autograd to some leaves: `torch.autograd.grad(outputs,
# inputs, grad_outputs, retain_graph=...)` returns the gradients of `inputs` only;
# `torch.autograd.backward(tensors, grad_tensors, inputs=[...])` accumulates into their `.grad`
# only. The check runs both on a small stage with a frozen weight, twice, against one `backward`.


# %% nbgrader={"grade": false, "grade_id": "backward-split", "locked": false, "schema_version": 3, "solution": true}
def my_backward_input(out, grad, inp):
    ### BEGIN SOLUTION
    (grad_inp,) = torch.autograd.grad(out, inp, grad, retain_graph=True)
    return grad_inp
    ### END SOLUTION


def my_backward_weight(out, grad, params):
    ### BEGIN SOLUTION
    torch.autograd.backward(out, grad, inputs=list(params))
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "backward-split-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check(
    "the backward in two", lambda: pp_checks.check_backward_split(my_backward_input, my_backward_weight)
)

# %% [markdown]
# **Exercise 10.** `my_zb_h1_order(p, m, rank)`: the ZB-H1 order on `rank` (one stage per rank) as
# a list of `("F" | "B" | "W", micro-batch)`. For p = 2, m = 4, rank 1 (the last stage) it is
# F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3.


# %% nbgrader={"grade": false, "grade_id": "zb-h1", "locked": false, "schema_version": 3, "solution": true}
def my_zb_h1_order(p, m, rank):
    ### BEGIN SOLUTION
    warmup = min(p - rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    weights = 0  # the W's run so far: W(k - rank) follows B(k)
    for k in range(m):
        if warmup + k < m:
            order.append(("F", warmup + k))
        order.append(("B", k))
        if k >= rank:
            order.append(("W", weights))
            weights += 1
    return order + [("W", i) for i in range(weights, m)]
    ### END SOLUTION


# %% [markdown]
# The check: your order on every rank of six pipelines (p = 2 to 4, m = p to 3p) against
# labkit's (`labkit.strategies.pp.order("zb-h1", ...)`, itself equal, action by action, to
# torch's `ScheduleInterleavedZeroBubble` over one stage per rank), with a hint for the usual
# mistakes.

# %% nbgrader={"grade": true, "grade_id": "zb-h1-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("ZB-H1", lambda: pp_checks.check_zb_h1(my_zb_h1_order))

# %%
zb_h1_order = exercise.pick("ZB-H1", my_zb_h1_order, pp_lab.zb_h1_order)

# %% [markdown]
# **What the split buys.** The same replay as section 5, p = 4, m = 8, every slot one unit and
# 1F1B's whole backward two (`backward_slots=2`: it does B and W at once), so both schedules are
# priced on the same footing. The activations a rank holds at most, in micro-batches
# (`live_peak`: from F to B for 1F1B, from F to W for ZB-H1):

# %%
from labkit.strategies.pp import live_peak
from labkit.strategies.pp.schedule import bubble_fraction

ZB_P, ZB_M = 4, 8
classic = [[(a.kind, a.microbatch, a.chunk) for a in o] for o in pp_orders("1f1b", ZB_P, ZB_M)]
split = [[(kind, mb, rank) for kind, mb in zb_h1_order(ZB_P, ZB_M, rank)] for rank in range(ZB_P)]
zb_replays = {"1F1B": pp_lab.replay(classic, ZB_P, backward_slots=2), "ZB-H1": pp_lab.replay(split, ZB_P)}
bubble_1f1b, bubble_zb = (float(zb_replays[name]["bubble"][0]) for name in ("1F1B", "ZB-H1"))
held = {
    name: [live_peak([Action(kind, s, mb) for kind, mb, s in log]) for log in logs]
    for name, logs in (("1F1B", classic), ("ZB-H1", split))
}
bubble_zbv = bubble_fraction(pp_orders("zbv", ZB_P, ZB_M, 2))
# the text's counts: 3 (p - 1) idle slots per rank for 1F1B, p - 1 for ZB-H1, among 3 m busy ones;
# ZB-V's V (2 chunks per rank, each slot half a stage's work) at 1 / 17
for name, got, idle, busy in (
    ("1F1B", bubble_1f1b, 3 * (ZB_P - 1), 3 * ZB_M),
    ("ZB-H1", bubble_zb, ZB_P - 1, 3 * ZB_M),
):
    if abs(got - idle / (idle + busy)) > 1e-12:
        raise AssertionError(
            f"{name}: replayed bubble {got:.4f}, the text's {idle} idle of {idle + busy} slots"
        )
if abs(bubble_zbv - 1 / 17) > 1e-12:
    raise AssertionError(f"ZB-V's replayed bubble {bubble_zbv:.4f}, the text says 1/17")
print(
    f"p = {ZB_P}, m = {ZB_M}, F = B = W = 1 slot: bubble 1F1B {bubble_1f1b:.1%}, ZB-H1 {bubble_zb:.1%} "
    f"({bubble_zb / bubble_1f1b:.2f} of 1F1B's), ZB-V {bubble_zbv:.1%}; micro-batches held per rank: "
    f"1F1B {held['1F1B']}, ZB-H1 {held['ZB-H1']}"
)  # NBVAL_CHECK_OUTPUT

# %%
fig_zero_bubble = pp_lab.plot_schedules(zb_replays, ZB_P)  # drawn once, by the helper

# %% [markdown]
# The green W's fill the cool-down where 1F1B's ranks wait; what is left is p - 1 idle slots
# on each rank while the pipeline fills. labkit's strategy runs it (`loop.train("pp", cfg, schedule="zb-h1")`): B is
# `torch.autograd.backward(out, grad, inputs=[input], retain_graph=True)`, whose result is sent
# back at once, and W later `torch.autograd.backward(out, grad, inputs=the stage's weights)`,
# which walks the stage's graph a second time (torch's `stage_backward_weight` keeps what B
# computed at the weights' inputs instead). **ZB-V** (`schedule="zbv"`, torch's
# `ScheduleZBVZeroBubble`) gives each rank two chunks in a V, r and 2p - 1 - r, so the last chunk
# is back on rank 0, and at F = B = W leaves a bubble of 1/17 here. Both, on 2 ranks, against one
# process (float64):

# %%
ZB_CFG = loop.PRESETS["dp"].replace(dtype=torch.float64, batch_size=8)
zb_runs = [
    dict(strategy="pp", schedule="zb-h1", n_microbatches=4),
    dict(strategy="pp", schedule="zbv", virtual_stages=2, n_microbatches=4),
]
zb_trained = labkit.run(loop.sweep, zb_runs, cfg=ZB_CFG, steps=2, spans=False, world_size=2)
zb_one = loop.reference(ZB_CFG, 2)
for rank, got in enumerate(zb_trained):
    for run, res in zip(zb_runs, got):
        for part in ("grads", "state"):
            compare(
                zb_one[part], res[part], label=f"{run['schedule']} rank {rank} {part}", rtol=0, atol=1e-12
            ).raise_if_failed()
print(
    '"pp" with schedule "zb-h1" and "zbv" on 2 ranks: gradients and state equal to one process (float64, atol 1e-12)'
)
