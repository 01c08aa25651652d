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
# # 08 · Mixture of experts by hand: routing, the all-to-all, expert parallelism × DP
#
# A mixture-of-experts (MoE) layer replaces a transformer's MLP by E MLPs, the **experts**, and a
# **router** that sends each token to k of them. The model holds E times the MLP's parameters but
# each token pays for k: Mixtral, DeepSeek-V3, Llama 4 and Qwen3-MoE are built this way. Split
# over ranks, the experts are **expert parallelism** (EP): each rank holds E/ep experts, and the
# tokens travel to their experts' ranks and back with an **all-to-all**.
#
# Four exercises, each checked on real gloo ranks against one process:
#
# 1. the router: softmax, top-k, the gates, and Switch Transformer's load-balancing loss;
# 2. the dispatch plan: each assignment's rank and slot, the capacity, what is dropped;
# 3. the all-to-all pair that sends rows to their experts' ranks and back (uneven splits), with
#    its backward;
# 4. the expert-parallel layer on a 2 x 2 ("dp", "ep") mesh, and its gradient sync.
#
# Then what it costs, measured in this run: the all-to-all's bytes against their formula, the
# tokens per expert before and after the aux loss has trained, the tokens a capacity drops, the
# memory per rank; and at scale, from the cost model, EP × DP for a Mixtral-8x7B-like and a
# DeepSeek-V3-like configuration against plain FSDP. Float64 throughout.

# %%
import labkit  # first (it needs no torch): the ranks' forkserver imports torch on another core meanwhile
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit import exercise
from labkit.checks import assert_match
from labkit.comm import all_to_all_single
from labkit.comm.all_to_all import wire_bytes
from labkit.costmodel import H100
from labkit.costmodel.links import DGX_H100_IB400, collective_time
from labkit.labs import moe_checks, moe_lab
from labkit.units import fmt_bytes

# %% [markdown]
# ## 1. The router
#
# The router is a linear map from a token's d features to E logits. For each token:
# `probs = softmax(logits)` over the **experts**; its k most probable experts, `topk_idx`; their
# probabilities **renormalised** to sum to 1, the `gates`. The layer's output for the token is
# Σ_j gate_j · expert_{idx_j}(x): a weighted average of k experts.
#
# Left alone, a router collapses onto a few experts (they get better, so they get chosen more).
# Switch Transformer's **load-balancing loss** pushes back: aux = E · Σ_e f_e · P_e, where f_e is
# the fraction of the N·k assignments that went to expert e (a count: no gradient) and P_e the
# mean over the tokens of probs[:, e] (differentiable). Uniform routing scores 1; everything on
# one expert scores E.
#
# **Exercise 1:** `my_route(logits, top_k) -> (probs, topk_idx, gates)` (logits (N, E); the
# others (N, E), (N, k), (N, k)); `my_aux_loss(probs, topk_idx, n_experts)`, a 0-d tensor.
# (`torch.topk`, `torch.bincount(..., minlength=E)`.)


# %% nbgrader={"grade": false, "grade_id": "router", "locked": false, "schema_version": 3, "solution": true}
def my_route(logits, top_k):
    ### BEGIN SOLUTION
    probs = torch.softmax(logits, dim=-1)
    top, idx = probs.topk(top_k, dim=-1)
    return probs, idx, top / top.sum(-1, keepdim=True)
    ### END SOLUTION


def my_aux_loss(probs, topk_idx, n_experts):
    ### BEGIN SOLUTION
    f = torch.bincount(topk_idx.reshape(-1), minlength=n_experts).to(probs.dtype) / topk_idx.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()
    ### END SOLUTION


# %% [markdown]
# The check, in this process: three shapes of logits (the top-k compared as sets, whatever their
# order), the gates' gradient; the aux loss and its gradient on four routings, none of them
# balanced (a balanced one scores 1 whatever P): first as many tokens as experts (where an axis
# mixed up still gives a number), last one where no token picks the last expert (so the counts'
# length shows).

# %% nbgrader={"grade": true, "grade_id": "router-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("router", lambda: moe_checks.check_router(my_route, my_aux_loss))

# %%
route, aux_loss = exercise.pick(
    "router", (my_route, my_aux_loss), (moe_lab.route, moe_lab.load_balancing_loss)
)

# %% [markdown]
# ## 2. The dispatch plan
#
# Expert e has a buffer of **capacity** C slots per batch: C = ⌈factor · N · k / E⌉, its even share
# of the N·k assignments times a capacity factor (1.0, 1.25, ...; GShard, Switch). The assignments
# fill the slots in **token order** (token 0's choices, then token 1's ...): an assignment's slot
# is how many earlier assignments went to the same expert, and it is **kept** while slot < C.
# A dropped assignment contributes nothing (the residual around the layer carries the token).
# With expert parallelism over ep ranks, rank r holds the contiguous block of experts
# [r·E/ep, (r+1)·E/ep): an assignment's **destination rank** is e // (E/ep).
#
# **Exercise 2:** `my_capacity(n_tokens, n_experts, top_k, capacity_factor)`, an int;
# `my_dispatch_plan(topk_idx, n_experts, capacity, ep) -> (dest_rank, slot, kept)`, each shaped
# like topk_idx (kept a bool tensor; capacity None means dropless: every assignment kept).


# %% nbgrader={"grade": false, "grade_id": "dispatch", "locked": false, "schema_version": 3, "solution": true}
def my_capacity(n_tokens, n_experts, top_k, capacity_factor):
    ### BEGIN SOLUTION
    import math

    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)
    ### END SOLUTION


def my_dispatch_plan(topk_idx, n_experts, capacity, ep):
    ### BEGIN SOLUTION
    flat = topk_idx.reshape(-1)
    onehot = F.one_hot(flat, n_experts)
    slot = ((onehot.cumsum(0) - 1) * onehot).sum(-1).reshape(topk_idx.shape)
    kept = torch.ones_like(slot, dtype=torch.bool) if capacity is None else slot < capacity
    return topk_idx // (n_experts // ep), slot, kept
    ### END SOLUTION


# %% [markdown]
# The check: capacities with whole and fractional shares (one that rounding to nearest takes up,
# others it takes down), then 12 tokens routed top-2 to E = 6 experts on 3 ranks (so e // ep and
# e % ep both differ from e // (E/ep)), expert 1 popular, with capacities 3, 5 and None: each
# assignment's rank, slot and kept (its values and its dtype).

# %% nbgrader={"grade": true, "grade_id": "dispatch-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("dispatch", lambda: moe_checks.check_dispatch(my_capacity, my_dispatch_plan))

# %%
capacity, dispatch_plan = exercise.pick(
    "dispatch", (my_capacity, my_dispatch_plan), (moe_lab.capacity, moe_lab.dispatch_plan)
)

# %% [markdown]
# ## 3. The all-to-all pair
#
# `all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)` (labkit's,
# torch's signature): this rank's input rows are cut into blocks of `input_split_sizes[j]` rows,
# block j going to group rank j; its output holds, in rank order, the `output_split_sizes[i]`
# rows group rank i sent it. The splits may be uneven and may be 0; rank i's
# input_split_sizes[j] must equal rank j's output_split_sizes[i].
#
# **Exercise 3:**
# - `MyAllToAll`, a `torch.autograd.Function`: forward(ctx, x, output_split_sizes,
#   input_split_sizes, group) returns the sum(output_split_sizes) rows received; its backward
#   sends each gradient row back to where its row came from;
# - `my_dispatch(x, dest, group) -> (received, plan)`: rows x (n, d), dest (n,) a group rank per
#   row. Sort the rows by destination (stable: `torch.argsort(dest, stable=True)`), count them per
#   rank (send), learn from the peers how many each sends this rank (recv: an all-to-all of the
#   counts, `moe_lab.exchange_counts(send, group)`), one all-to-all of the rows. The plan is what
#   the way back needs, e.g. (order, send, recv);
# - `my_combine(y, plan, group)`: the rows a rank computed for what it received, sent back, and put
#   back in the order `my_dispatch` was given them.


# %% nbgrader={"grade": false, "grade_id": "a2a", "locked": false, "schema_version": 3, "solution": true}
class MyAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ### BEGIN SOLUTION
        ctx.splits, ctx.group = (output_split_sizes, input_split_sizes), group
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None
        ### END SOLUTION


def my_dispatch(x, dest, group):
    ### BEGIN SOLUTION
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=dist.get_world_size(group)).tolist()
    recv = moe_lab.exchange_counts(send, group)
    return MyAllToAll.apply(x[order], recv, send, group), (order, send, recv)
    ### END SOLUTION


def my_combine(y, plan, group):
    ### BEGIN SOLUTION
    order, send, recv = plan
    back = MyAllToAll.apply(y, send, recv, group)
    return back[torch.argsort(order)]
    ### END SOLUTION


# %% [markdown]
# The check runs on 4 ranks as a 2 x 2 ("dp", "ep") mesh whose ep groups are {0, 1} and {2, 3}
# (a global rank or the world used where the group belongs shows): your Function on uneven
# splits, one of them empty, forward and backward; then your dispatch and combine of 5 rows per
# rank (one rank sends all its rows to group rank 0, none to the last rank), the "experts"
# scaling the rows they receive by (10 + their group rank), values and gradients (a gradient
# stopped by something detached is named where it stops).

# %% nbgrader={"grade": true, "grade_id": "a2a-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check(
    "all-to-all pair", lambda: moe_checks.check_all_to_all(MyAllToAll.apply, my_dispatch, my_combine)
)

# %%
dispatch_op, combine_op = exercise.pick(
    "all-to-all pair", (my_dispatch, my_combine), (moe_lab.dispatch, moe_lab.combine)
)

# %% [markdown]
# ## 4. The expert-parallel layer
#
# `moe_lab.EPLayer(full, ep_group)` is this rank's part of a one-process `moe_lab.MoE`. Its
# parameters: the router whole (`layer.router`, (E, d): logits = x @ layer.router.T), and the
# weights of only the experts [layer.first, layer.first + E/ep): `layer.w1` (E/ep, d, hidden) and
# `layer.w2` (E/ep, hidden, d), local expert i's being `layer.w1[i]`, `layer.w2[i]`.
# `layer.experts(rows, local_index)` runs them for you: `local_index` is a tensor with one local
# index per row (shape (n,), integers, 0 ≤ local_index < E/ep, i.e. the row's expert −
# `layer.first`), and row i goes through local expert `local_index[i]`. Its settings:
# `layer.n_experts`, `layer.top_k`, `layer.capacity_factor` (None: dropless), `layer.ep`,
# `layer.group`. The capacity is counted on this rank's tokens, `len(x)` (GShard's groups: the
# one-process layer is given the same groups; labkit's strategy `"ep"` counts it on the global
# batch instead).
#
# **Exercise 4:**
# - `my_ep_forward(layer, x) -> (y, aux)`: route this rank's tokens x (N, d), plan, send every
#   **kept** assignment's row to its expert's rank with `dispatch_op`, and also which expert it is
#   for (e.g. a second dispatch of the expert indices as a float column), run the experts, send
#   the outputs back with `combine_op`, then y[token] = Σ over its kept assignments of
#   gate · output; aux the aux loss of this rank's tokens;
# - `my_sync_grads(layer, dp_group)` after each rank's backward of its mean loss, on
#   `layer.router.grad`, `layer.w1.grad` and `layer.w2.grad`: the router is replicated on every
#   rank and saw only this rank's tokens; an expert's gradient already holds its ep group's tokens
#   (the all-to-all's backward brought them), and the ranks holding the same experts form
#   `dp_group`. Make every gradient the one of the mean loss over all ranks' tokens
#   (`dist.all_reduce`, and a division).


# %% nbgrader={"grade": false, "grade_id": "ep", "locked": false, "schema_version": 3, "solution": true}
def my_ep_forward(layer, x):
    ### BEGIN SOLUTION
    probs, idx, gates = route(x @ layer.router.T, layer.top_k)
    cap = None
    if layer.capacity_factor is not None:
        cap = capacity(len(x), layer.n_experts, layer.top_k, layer.capacity_factor)
    dest, _, kept = dispatch_plan(idx, layer.n_experts, cap, layer.ep)
    tok, j = torch.nonzero(kept, as_tuple=True)
    rows, plan = dispatch_op(x[tok], dest[tok, j], layer.group)
    which, _ = dispatch_op(idx[tok, j].to(x.dtype)[:, None], dest[tok, j], layer.group)
    out = combine_op(layer.experts(rows, which[:, 0].long() - layer.first), plan, layer.group)
    y = torch.zeros_like(x).index_add(0, tok, gates[tok, j, None] * out)
    return y, aux_loss(probs, idx, layer.n_experts)
    ### END SOLUTION


def my_sync_grads(layer, dp_group):
    ### BEGIN SOLUTION
    world = dist.get_world_size()
    dist.all_reduce(layer.router.grad)
    layer.router.grad /= world
    for p in (layer.w1, layer.w2):
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= world
    ### END SOLUTION


# %% [markdown]
# The check, on the 2 x 2 mesh (capacity factor 1.0, so some assignments are dropped): every
# rank's output and aux loss, then after one backward of (mean ‖y‖² + 0.1 · aux) and your sync,
# the router's and this rank's experts' gradients, against one process's `MoE` on all four ranks'
# tokens. (When your output keeps every assignment, a second forward at capacity factor 0.25
# tells a capacity counted on more tokens than the rank's from none at all.)

# %% nbgrader={"grade": true, "grade_id": "ep-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check(
    "EP layer",
    lambda: moe_checks.check_ep(my_ep_forward, my_sync_grads),
    needs=["router", "dispatch", "all-to-all pair"],
)

# %%
ep_forward, sync_grads = exercise.pick(
    "EP layer", (my_ep_forward, my_sync_grads), (moe_lab.ep_forward, moe_lab.sync_grads)
)

# %% [markdown]
# ## 5. Measured: the all-to-all's bytes, the memory per rank
#
# One forward and backward of your EP layer on the 2 x 2 mesh (d = 16, hidden 32, E = 4, top-2,
# 48 tokens per rank, dropless), the tracer watching the forward. It makes five all-to-alls:
# dispatch's count exchange and rows, the expert indices' count exchange and column, combine's
# rows. Each sends (ep − 1) first messages of labkit's header and splits plus the rows for the
# other rank (`wire_bytes`); the rows are the payload: 8·d bytes per assignment sent to the other
# rank by dispatch, and per assignment received from it by combine.

# %%
SIZE = moe_lab.MEASURE
d, N, k, E, ep = SIZE["d"], SIZE["tokens"], SIZE["top_k"], SIZE["experts"], 2
run = labkit.run(moe_lab.measure_ep, ep_forward, sync_grads, world_size=4, backend="gloo")
payload = {}
for rank, res in enumerate(run):
    r, send = res["ep_rank"], res["send"]
    peer = 1 - r
    recv_from_peer = run[rank ^ 1]["send"][r]  # what the other rank of the ep group sent here
    calls = [
        wire_bytes([1, 1], r, 8),  # the counts
        wire_bytes(send, r, 8 * d),  # the rows
        wire_bytes([1, 1], r, 8),
        wire_bytes(send, r, 8),  # the expert indices
        wire_bytes([send[r], recv_from_peer] if r == 0 else [recv_from_peer, send[r]], r, 8 * d),
    ]
    traced = moe_lab.a2a_sent(run.traces[rank], res["window"])
    assert len(traced) == 5, f"rank {rank}: {len(traced)} all-to-alls traced, expected 5"
    assert_match(
        f"rank {rank}: all-to-all bytes sent in one forward (wire_bytes)", sum(calls), sum(traced), 0
    )
    payload[rank] = 8 * d * (send[peer] + recv_from_peer)

# %% [markdown]
# With a router that spreads the N·k assignments evenly, dispatch sends (ep − 1)/ep of them and
# combine returns as many: 2·(ep − 1)/ep · N·k·d·8 bytes of rows per rank per layer forward (the
# backward sends the same again). This random router is near even: each rank's payload against
# that figure.

# %%
even = 2 * (ep - 1) / ep * N * k * d * 8
for rank in range(4):
    print(f"rank {rank}: payload {fmt_bytes(payload[rank])}, even routing {fmt_bytes(even)}")
    assert_match(f"rank {rank}: payload within 25% of 2(ep-1)/ep·N·k·d·8", even, payload[rank], 0.25)

# %% [markdown]
# **Memory.** Each rank holds the router whole and E/ep of the experts.

# %%
for rank, res in enumerate(run):
    mine, full = res["param_bytes"], res["full_bytes"]
    for name in ("w1", "w2"):
        assert_match(f"rank {rank}: {name} (experts) = 1/ep of the layer's", full[name] / ep, mine[name], 0)
    assert_match(f"rank {rank}: the router, whole", full["router"], mine["router"], 0)

# %% [markdown]
# ## 6. Measured: the imbalance, and what the aux loss does to it
#
# A router started biased towards expert 0 (`moe_lab.skewed_moe`), 256 tokens: the assignments
# per expert before, and after 30 Adam steps of the router on the **aux loss alone** (to isolate
# what it does; in training it is added, times a small coefficient, to the model's loss).
# The busiest expert's load over the even share, before and after:

# %%
moe = moe_lab.skewed_moe()
x = moe_lab.skewed_tokens(256)
before = moe_lab.tokens_per_expert(moe, x)
aux_curve = moe_lab.train_aux(moe, x, steps=30)
after = moe_lab.tokens_per_expert(moe, x)
share = 256 * k / E
cap1 = capacity(256, E, k, 1.0)
print(f"assignments per expert before {before}, after {after} (even share {share:g})")
print(f"aux loss {aux_curve[0]:.3f} -> {aux_curve[-1]:.3f} (1.0 is perfectly even)")
spread = {"before": max(before) / share, "after": max(after) / share}
print(", ".join(f"{k_}: busiest / even = {v:.2f}" for k_, v in spread.items()))
assert sum(before) == sum(after) == 256 * k
assert spread["before"] > 1.5 and spread["after"] < 1.2, spread
assert aux_curve[-1] < aux_curve[0]

# %%
fig_tokens = moe_lab.plot_tokens_per_expert(before, after, cap1)  # drawn once, by the helper

# %% [markdown]
# **Dropped tokens.** The same 512 assignments through capacities of factor 1.0, 1.25, 1.5, 2.0
# and dropless, before and after the aux loss: counted by the dispatch plan, and checked against
# Σ_e max(0, count_e − C).

# %%
drops = {}
for label, model in (("before", moe_lab.skewed_moe()), ("after", moe)):
    _, idx, _ = route(x @ model.router.detach().T, k)
    counts = torch.bincount(idx.reshape(-1), minlength=E).tolist()
    for cf in (1.0, 1.25, 1.5, 2.0, None):
        cap = None if cf is None else capacity(256, E, k, cf)
        _, _, kept = dispatch_plan(idx, E, cap, 1)
        drops[label, cf] = int((~kept).sum())
        assert drops[label, cf] == moe_lab.dropped(counts, cap), (label, cf)
print(f"{'factor':>9} {'capacity':>9} {'dropped before':>15} {'dropped after':>14}")
for cf in (1.0, 1.25, 1.5, 2.0, None):
    cap = "-" if cf is None else capacity(256, E, k, cf)
    print(f"{cf or 'dropless':>9} {cap:>9} {drops['before', cf]:>15} {drops['after', cf]:>14}")
assert all(drops["after", cf] <= drops["before", cf] for cf in (1.0, 1.25, 1.5, 2.0))

# %% [markdown]
# ## 7. At scale: EP × DP against FSDP
#
# Two published configurations (the figures recorded in `moe_lab.MOE_MODELS` with their source).
# Their experts are SwiGLU MLPs of 3·d·hidden parameters: the routed experts' count from the
# shapes, the rest from the published total, and the parameters a token uses (the rest whole, k
# of E experts) against the published active count:

# %%
for name, m in moe_lab.MOE_MODELS.items():
    experts, rest = moe_lab.split_params(m)
    print(
        f"{name}: {m['total'] / 1e9:.1f}B = {experts / 1e9:.1f}B in {m['moe_layers']} x {m['experts']} "
        f"experts + {rest / 1e9:.1f}B; top-{m['top_k']}  ({m['source']})"
    )
    assert_match(f"  {name}: active parameters", m["active"], moe_lab.active_params(m), 0.03, unit="")

# %% [markdown]
# **The all-to-all inside a node and across nodes.** One dispatch of 4096 tokens per rank, k
# copies of d bf16 features each, on H100 nodes of 8 (NVLink inside, 400 Gb/s per GPU across:
# the cost model's `DGX_H100_IB400`), `moe_lab.a2a_time`: inside a node every byte goes over
# NVLink; across nodes the share for other nodes goes over the NIC.

# %%
link = DGX_H100_IB400
a2a = {}
for name, m in moe_lab.MOE_MODELS.items():
    S = 4096 * m["top_k"] * m["d_model"] * moe_lab.BYTES
    for n in (8, 16, 64):
        a2a[name, n] = moe_lab.a2a_time(n, S, link)
    print(
        f"{name}: {fmt_bytes(S)} per rank; "
        + ", ".join(f"ep {n}: {a2a[name, n] * 1e3:.2f} ms" for n in (8, 16, 64))
    )
    inside = (8 - 1) * link.intra.alpha_s + 7 / 8 * S / link.intra.busbw_Bps
    assert_match(
        f"  {name}: ep 8, one node = (n-1)α + (n-1)/n·S/busbw(NVLink)", inside, a2a[name, 8], 1e-12, unit="s"
    )
    assert a2a[name, 16] > 3 * a2a[name, 8], "leaving the node should cost several times more"

# %% [markdown]
# **EP × FSDP against FSDP.** On n ranks, plain FSDP shards everything over n and all-gathers it
# (forward, backward) and reduce-scatters its gradient every step: 3·(n − 1)/n·2 bytes per
# parameter per rank, whatever the batch. EP × FSDP splits the experts over ep and FSDP's the rest
# over dp = n/ep, so it gathers fewer parameters, but adds four all-to-alls per MoE layer (dispatch
# and combine, forward and backward) of every token's k copies: bytes that grow with the tokens.
# Below some tokens per rank per step EP sends less (`moe_lab.crossover_tokens`, checked against
# the two step totals there). Mixtral on 64 GPUs with EP 8 (a node); DeepSeek-V3 on 2048 GPUs
# with EP 64, as it was trained (16 PP stages there; none here).

# %%
cases = [("Mixtral-8x7B", 64, 8), ("DeepSeek-V3", 2048, 64)]
for name, n, ep_n in cases:
    m = moe_lab.MOE_MODELS[name]
    t_star = moe_lab.crossover_tokens(m, n, ep_n)
    fsdp_b, ep_b = moe_lab.step_bytes(m, n, 1, t_star), moe_lab.step_bytes(m, n, ep_n, t_star)
    mem = {e: moe_lab.states_per_rank(m, n, e) for e in (1, ep_n)}
    print(
        f"{name}, {n} GPUs: model states per rank FSDP {fmt_bytes(mem[1])}, EP {ep_n} x FSDP "
        f"{n // ep_n} {fmt_bytes(mem[ep_n])}; EP sends fewer bytes below {t_star:,.0f} tokens per rank per step"
    )
    assert_match(f"  {name}: at the crossover both send the same", fsdp_b["total"], ep_b["total"], 1e-9)
    for tokens in (4096, 16384, 262144):
        f, e = moe_lab.step_bytes(m, n, 1, tokens), moe_lab.step_bytes(m, n, ep_n, tokens)
        print(
            f"  {tokens:>7} tokens per rank: FSDP {fmt_bytes(f['total'])}, EP x FSDP {fmt_bytes(e['total'])}"
        )
        assert (e["total"] < f["total"]) == (tokens < t_star)

# %% [markdown]
# Bytes are not time: EP's all-to-all inside a node runs on NVLink while FSDP over n crosses the
# network. The same step's communication in seconds on `DGX_H100_IB400` (FSDP's collectives
# priced by `collective_time`, two-level; the all-to-all by `a2a_time`), Mixtral on 64 GPUs, and
# H100's compute for the step (6 × active parameters × tokens at its assumed MFU) beside it:

# %%
m, n, ep_n = moe_lab.MOE_MODELS["Mixtral-8x7B"], 64, 8
experts, rest = moe_lab.split_params(m)
print(f"{'tokens/rank':>11} {'FSDP comm':>10} {'EP x FSDP comm':>15} {'compute':>9}")
times = {}
for tokens in (4096, 16384, 65536):
    fsdp_t = 3 * collective_time("all_gather", n, m["total"] * moe_lab.BYTES, link)
    dp = n // ep_n
    shard = (rest + experts / ep_n) * moe_lab.BYTES
    ep_t = 3 * collective_time("all_gather", dp, shard, link.inter) + 4 * m["moe_layers"] * moe_lab.a2a_time(
        ep_n, tokens * m["top_k"] * m["d_model"] * moe_lab.BYTES, link
    )
    compute = 6 * m["active"] * tokens / (H100.peak_flops * H100.mfu)
    times[tokens] = (fsdp_t, ep_t, compute)
    print(f"{tokens:>11} {fsdp_t:>9.2f}s {ep_t:>14.2f}s {compute:>8.2f}s")
assert all(t[1] < t[0] for t in times.values()), "EP inside a node should beat FSDP across nodes here"

# %% [markdown]
# (FSDP's reduce-scatter is priced as an all-gather of the same size: the ring moves the same
# bytes. EP's dp groups hold one rank per node, so their collectives run on the network alone:
# `link.inter`.)
#
# **Summary.** A router picks k of E experts per token and renormalises their gates; the aux loss
# E·Σ f_e·P_e pulls the load back towards even, and a capacity drops what overflows. Expert
# parallelism sends every kept assignment to its expert's rank and back with a pair of
# all-to-alls whose bytes grow with the tokens, divides the experts' memory by ep, and reduces an
# expert's gradient only over the ranks that hold it. The real APIs: torch's
# `dist.all_to_all_single`, Megatron-LM's `--expert-model-parallel-size`, DeepSpeed-MoE,
# torchtitan's expert parallelism, and labkit's own strategy `"ep"`.
#
# *Exercises:* (1) With a capacity, the assignments at the end of the batch are the ones dropped:
# what would dropping by gate score instead change? (2) DeepSeek-V3 limits each token to experts
# on at most 4 nodes: what does that do to the bytes that leave a node? (3) Where in your EP
# forward could the all-to-all overlap with compute?
