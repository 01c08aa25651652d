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
# # 05 · Tensor parallelism by hand, and FSDP x TP
#
# DDP, ZeRO, FSDP and HSDP all split the **batch**: each rank runs the whole layer on its own
# samples, and sharding only decides where the weights wait between uses. When one layer's
# matmuls are too big or too slow for one GPU, **tensor parallelism** (TP, Megatron-LM's) splits
# the **layer itself**: every rank of a TP group sees the same batch and computes a slice of each
# matmul. You write it in four exercises, on real gloo ranks, each checked element-wise against
# one process and against PyTorch's own TP (`parallelize_module`): the two conjugate
# communication operations, column- and row-parallel Linear layers, a TP MLP and attention block,
# and FSDP x TP on a 2 x 2 mesh. Then you measure what TP saves (memory per rank), what it costs
# (two all-reduces per block in each direction), and why TP stays inside a node. Every run is on
# gloo CPU ranks (`backend="gloo"`), also on a machine with GPUs: the lab's meshes are CPU meshes.

# %%
import labkit  # first (it needs no torch): the ranks' forkserver imports torch on another core meanwhile
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from labkit import exercise
from labkit.checks import assert_match
from labkit.comm.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from labkit.costmodel import links
from labkit.labs import tp_checks, tp_lab
from labkit.launch.topology import NodeLink
from labkit.units import fmt_bytes

# %% [markdown]
# ## 1. Two ways to split a Linear, and the two operations that glue them
#
# A Linear computes Y = X Wᵀ (W has shape out x in). Split W's **rows** (output features) over
# t ranks and each rank computes its own columns of Y from the whole X: **column-parallel**.
# Split W's **columns** (input features) and each rank needs only its slice of X, and produces
# a **partial sum** of the whole Y: **row-parallel**. Column then row is the Megatron pattern:
# the column layer's output columns are exactly the row layer's input slices, so nothing moves in
# between. Two operations glue them, each the other's transpose:
#
# - **f** in front of the column layer: forward the identity (every rank has the whole X);
#   backward an **all-reduce** of dL/dX (each rank's column block contributed a part of it);
# - **g** after the row layer: forward an **all-reduce** (sum the partial Ys); backward the
#   identity (every rank already holds the whole dL/dY).
#
# **Exercise 1:** f and g as `torch.autograd.Function`s on labkit's `ring_all_reduce(tensor,
# op="sum", group=group)`, which reduces **in place**. `backward` returns one gradient per
# input of `forward`: None for the group. Reduce over `group` (the tp group), never the default
# group: the check runs on 4 ranks whose tp groups are {0, 2} and {1, 3}. It also reads the
# collectives each of f and g ran from labkit's tracer: one `ring_all_reduce` in f's backward
# and one in g's forward. torch.distributed's own `dist.all_reduce` bypasses the course's traced
# ring and its simulated link (sections 5 and 7 count and price the ring), so the check refuses it.


# %% nbgrader={"grade": false, "grade_id": "conjugates", "locked": false, "schema_version": 3, "solution": true}
class MyCopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        return x.view_as(x)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        grad = grad.contiguous().clone()  # in place on a copy: autograd may hold grad elsewhere
        ring_all_reduce(grad, op="sum", group=ctx.group)
        return grad, None
        ### END SOLUTION


class MyReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        out = x.contiguous().clone()  # never reduce the caller's tensor
        ring_all_reduce(out, op="sum", group=group)
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        return grad, None
        ### END SOLUTION


def my_f(x, group):
    return MyCopyToTP.apply(x, group)


def my_g(x, group):
    return MyReduceFromTP.apply(x, group)


# %% [markdown]
# The check runs f and g on 4 ranks, as a ("tp", "dp") mesh whose tp groups {0, 2} and {1, 3}
# are not the world (rank 1 is rank 0 of its group), on integer data (exact sums), then in a
# column -> GELU -> row MLP built from torch's own local shards, against one process and against
# torch's `parallelize_module(ColwiseParallel, RowwiseParallel)` on the same tp mesh.

# %% nbgrader={"grade": true, "grade_id": "conjugates-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("conjugates f and g", lambda: tp_checks.check_conjugates(my_f, my_g))

# %%
f_op, g_op = exercise.pick("conjugates f and g", (my_f, my_g), (tp_lab.f_op, tp_lab.g_op))

# %% [markdown]
# ## 2. Column- and row-parallel Linear
#
# Each layer is built from a whole `nn.Linear` and keeps only its piece, split as torch does
# (`torch.chunk`, so 9 output features on 2 ranks are 5 + 4; rank r of the group keeps piece r,
# r = `dist.get_rank(group)`, its rank in the tp group, which is not `dist.get_rank()` once there
# is more than one group). `f_op(x, group)` and `g_op(x, group)` are exercise 1's f and g: yours
# once they pass, labkit's until then (`exercise.pick` in the cell above chose them).
#
# - `MyColumnParallelLinear(full, group, copy_input=True)`: weight rows and bias entries of its
#   output features; forward `F.linear(f(x), w, b)`, or without f when `copy_input=False` (the
#   caller applied f already: exercise 3);
# - `MyRowParallelLinear(full, group)`: the weight's columns, the **whole** bias; forward
#   `g(F.linear(x_local, w)) + b`, the bias once, after the sum.
#
# **Exercise 2.** Keep the pieces as `nn.Parameter`s `self.weight`, `self.bias` (a copy, so the
# optimizer updates this rank's piece only).


# %% nbgrader={"grade": false, "grade_id": "linears", "locked": false, "schema_version": 3, "solution": true}
class MyColumnParallelLinear(nn.Module):
    def __init__(self, full, group, copy_input=True):
        super().__init__()
        self.group, self.copy_input = group, copy_input
        ### BEGIN SOLUTION
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(torch.chunk(full.weight.detach(), tp, dim=0)[rank].clone())
        bias = full.bias
        self.bias = None if bias is None else nn.Parameter(torch.chunk(bias.detach(), tp)[rank].clone())
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION
        if self.copy_input:
            x = f_op(x, self.group)
        return F.linear(x, self.weight, self.bias)
        ### END SOLUTION


class MyRowParallelLinear(nn.Module):
    def __init__(self, full, group):
        super().__init__()
        self.group = group
        ### BEGIN SOLUTION
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(torch.chunk(full.weight.detach(), tp, dim=1)[rank].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION
        y = g_op(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias
        ### END SOLUTION


# %% [markdown]
# The check: Linear(8, 12) column -> GELU -> Linear(12, 6) row on the 4 ranks of exercise 1
# (tp groups {0, 2}, {1, 3}) (the pieces, the
# output, the input's and every parameter's gradient), Linear(7, 9) column-parallel alone (5 + 4
# features), and `copy_input=False`; against one process and torch's ColwiseParallel /
# RowwiseParallel.

# %% nbgrader={"grade": true, "grade_id": "linears-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check(
    "parallel linears", lambda: tp_checks.check_linears(MyColumnParallelLinear, MyRowParallelLinear)
)

# %%
ColumnLinear, RowLinear = exercise.pick(
    "parallel linears",
    (MyColumnParallelLinear, MyRowParallelLinear),
    (tp_lab.ColumnParallelLinear, tp_lab.RowParallelLinear),
)

# %% [markdown]
# ## 3. A TP transformer block
#
# The lab's block (`tp_lab.Block`) is pre-LN: x + attn(ln1(x)), then + mlp(ln2(x)). Megatron
# splits both sub-blocks the same way, column then row, so each costs **one all-reduce in
# forward (g) and one in backward (f)**:
#
# - **MLP** (`fc1`, GELU, `fc2`): fc1 column-parallel, the GELU on each rank's own hidden
#   columns (elementwise: no communication), fc2 row-parallel.
# - **Attention** (`q`, `k`, `v`, `o`, `n_heads`, `head_dim`): heads are independent, so split
#   them: q, k and v column-parallel give rank r its n_heads / t heads (torch.chunk of the rows
#   keeps whole heads), attention runs on the local heads, `o` is row-parallel. Apply f **once** to
#   the input, and build q, k, v with `copy_input=False`: three fs would all-reduce dL/dx three
#   times.
#
# The original (`tp_lab.Attention`, `tp_lab.MLP`) is what each rank must reproduce on its
# heads: `q(x)` is (B, T, n_heads · head_dim), head h in columns [h · head_dim, (h+1) · head_dim),
# viewed as `view(B, T, heads, head_dim).transpose(1, 2)`; causal attention; the heads merged back
# by `y.transpose(1, 2).reshape(B, T, heads · head_dim)` into `o`. The MLP's activation is the
# **exact** GELU, `F.gelu(h)` (`nn.GELU()`'s default), not `approximate="tanh"`.
#
# **Exercise 3:** `MyTPMLP(mlp, group)` and `MyTPAttention(attn, group)`, named like the
# original's layers (fc1, fc2; q, k, v, o), with `ColumnLinear` / `RowLinear` (yours, or labkit's
# until yours passes), `f_op`, and `F.scaled_dot_product_attention(q, k, v, is_causal=True)` on
# tensors of shape (B, heads, T, head_dim), heads = n_heads / `dist.get_world_size(group)`.


# %% nbgrader={"grade": false, "grade_id": "blocks", "locked": false, "schema_version": 3, "solution": true}
class MyTPMLP(nn.Module):
    def __init__(self, mlp, group):
        super().__init__()
        ### BEGIN SOLUTION
        self.fc1, self.fc2 = ColumnLinear(mlp.fc1, group), RowLinear(mlp.fc2, group)
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION
        return self.fc2(F.gelu(self.fc1(x)))
        ### END SOLUTION


class MyTPAttention(nn.Module):
    def __init__(self, attn, group):
        super().__init__()
        self.group, self.head_dim = group, attn.head_dim
        ### BEGIN SOLUTION
        self.local_heads = attn.n_heads // dist.get_world_size(group)
        self.q, self.k, self.v = (ColumnLinear(p, group, copy_input=False) for p in (attn.q, attn.k, attn.v))
        self.o = RowLinear(attn.o, group)
        ### END SOLUTION

    def forward(self, x):
        B, T, _ = x.shape
        ### BEGIN SOLUTION
        x = f_op(x, self.group)
        q, k, v = (
            p(x).view(B, T, self.local_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, self.local_heads * self.head_dim))
        ### END SOLUTION


# %% [markdown]
# The check runs on the 4 ranks of exercise 1. It takes the attention and the MLP **apart**
# first, each against the original sub-block in one process: its pieces, output, input gradient
# and parameter gradients, and the all-reduces it ran (labkit's tracer: one in forward, one in
# backward). Then it checks the whole block, `tp_lab.tp_block(block, group, MyTPMLP,
# MyTPAttention)`, against one process and against torch's `parallelize_module` of the same
# block (q, k, v, fc1 ColwiseParallel; o, fc2 RowwiseParallel).

# %% nbgrader={"grade": true, "grade_id": "blocks-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("TP blocks", lambda: tp_checks.check_blocks(MyTPMLP, MyTPAttention))

# %%
TPMLP, TPAttention = exercise.pick("TP blocks", (MyTPMLP, MyTPAttention), (tp_lab.TPMLP, tp_lab.TPAttention))

# %% [markdown]
# ## 4. What TP saves: memory per rank
#
# From here on a bigger block, d = 64 with 4 heads and an MLP of 256, on 16 sequences of 32
# tokens (`tp_lab.MEASURE`), one forward and backward on 2 ranks with your blocks. Each rank
# keeps 1/t of the six weight matrices (4d² in attention, 2·d·4d in the MLP); the LayerNorms and
# the row layers' biases are replicated.

# %%
SIZE = tp_lab.MEASURE
d, H, tokens = SIZE["d"], SIZE["hidden"], SIZE["batch"] * SIZE["seq"]
step = labkit.run(tp_lab.measure_step, SIZE, TPMLP, TPAttention, world_size=2, backend="gloo")
print(
    f"per rank: block weights {fmt_bytes(step[0]['weights'])}, replicated {fmt_bytes(step[0]['replicated'])}; "
    f"the MLP saved {fmt_bytes(step[0]['mlp_saved'])} for backward"
)  # NBVAL_CHECK_OUTPUT

# %%
assert_match(
    "block weights per rank: (4d² + 2·d·4d) x 4 B / 2", (4 * d * d + 2 * d * H) * 4 / 2, step[0]["weights"]
)

# %% [markdown]
# **Activation memory.** What a forward keeps for backward (measured: the distinct tensors
# autograd saved, `tp_lab.saved_bytes`). The MLP saves its input (for fc1's weight gradient),
# fc1's output (GELU's input) and GELU's output (fc2's input). The two hidden ones are split
# over the ranks; the input is **whole on every rank**: TP replicates the activations between
# blocks (what sequence parallelism then splits along the sequence). Measured in one process,
# and per rank above:

# %%
full_mlp = tp_lab.make_block(0, d, SIZE["heads"], H).mlp
x = torch.randn(SIZE["batch"], SIZE["seq"], d, requires_grad=True)
one_process = tp_lab.saved_bytes(full_mlp, x, exclude=full_mlp.parameters())
assert_match("MLP saved, one process: 4 B x tokens x (d + 2 x 4d)", 4 * tokens * (d + 2 * H), one_process)
assert_match(
    "MLP saved per rank, t = 2: 4 B x tokens x (d + 2 x 4d / 2)", 4 * tokens * (d + H), step[0]["mlp_saved"]
)

# %% [markdown]
# ## 5. What TP costs: two all-reduces per block each way
#
# The timeline of that forward and backward on both ranks: every g in forward and every f in
# backward is a blocking all-reduce on the critical path (the next matmul needs its result).
# Read the order and the count of the bars, not their lengths: the times are this shared
# machine's, 2 ranks on 2 busy cores, too noisy to call.

# %%
fig_step = tp_lab.plot_tp_step(step)  # drawn once, by the helper

# %% [markdown]
# The formula: per layer, attention and MLP each all-reduce the (tokens, d) activations once in
# forward and their gradient once in backward: 4 tensors of tokens·d·4 B
# (`tp_lab.tp_allreduce_bytes`), and a ring over t ranks sends 2(t-1)/t of each per rank (1x at
# t = 2). Checked against the tracer (the collectives' 64-byte headers are the only other bytes):

# %%
S = tokens * d * 4
counted = {k: tp_lab.all_reduces(step.traces[0], w) for k, w in step[0]["windows"].items()}
for k, events in counted.items():
    print(f"{k:>17}: {len(events)} all-reduce(s) of {[fmt_bytes(e['nbytes']) for e in events]}")
assert [len(counted[k]) for k in ("attention forward", "MLP forward", "backward")] == [1, 1, 2], counted
events = [e for v in counted.values() for e in v]
assert_match(
    "all-reduced per layer per step", tp_lab.tp_allreduce_bytes(tokens, d), sum(e["nbytes"] for e in events)
)
assert_match(
    "sent per rank (ring, t = 2)",
    4 * tp_lab.ring_sent(S, 2),
    sum(e["intra_bytes"] for e in events),
    rel_tol=0.005,
)

# %% [markdown]
# **Summary.** TP divides the weights (and their gradients and optimizer state) by t, and the
# big hidden activations too; in exchange every layer all-reduces its activations 4 times per
# step, blocking, and those bytes grow with the tokens, not the parameters.

# %% [markdown]
# ## 6. FSDP x TP on 2 x 2
#
# At scale the two combine: a 2-D **device mesh** of dp x tp ranks (torch's
# `init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`). Ranks of one `"tp"` group
# hold different pieces of each layer and see the same batch; ranks of one `"dp"` group hold the
# **same** TP piece and see different rows of the batch. FSDP runs along `"dp"`: it shards each
# TP-local parameter over the dp group, gathers it before forward and reduce-scatters its gradient
# after backward (torch: `parallelize_module(model, mesh["tp"], plan)` then
# `fully_shard(model, mesh=mesh["dp"])`).


# %%
def groups():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = (dist.get_process_group_ranks(mesh.get_group(k)) for k in ("tp", "dp"))
    return f"rank {dist.get_rank()}: tp group {tp}, dp group {dp}"


lines = labkit.run(groups, world_size=4, backend="gloo")
print("\n".join(lines))
assert lines == [
    f"rank {r}: tp group {[r // 2 * 2, r // 2 * 2 + 1]}, dp group {[r % 2, r % 2 + 2]}" for r in range(4)
]

# %% [markdown]
# **Exercise 4**, on the dp group (`mesh.get_group("dp")`, this rank's index in it
# `mesh.get_local_rank("dp")`):
# `my_shard_over_dp(local, mesh)`: this rank's dim-0 shard of a TP-local tensor, R = ⌈rows / dp⌉
# rows (so 6 rows on 2 ranks are 3 each), zero-padded to R·dp: a new tensor of shape
# (R, *local.shape[1:]); `my_gather_over_dp(shard, dim0, mesh)`: the TP-local tensor back, shape
# (dim0, *shard.shape[1:]) (padding dropped); `my_reduce_grad_over_dp(grad, mesh)`: this rank's
# shard of the **average** of `grad` over dp (each replica's loss is the mean over its own rows,
# as under `fully_shard`), shape (R, *grad.shape[1:]). labkit's collectives, one each, with
# `group=mesh.get_group("dp")` (a ProcessGroup, not the mesh): `ring_all_gather(out, shard,
# group=...)`, `ring_reduce_scatter(out, padded, op="avg", group=...)`. The check reads which
# collectives ran: an all-reduce then a slice gives the same values but sends twice the bytes of
# a reduce-scatter, and is refused.


# %% nbgrader={"grade": false, "grade_id": "fsdp-tp", "locked": false, "schema_version": 3, "solution": true}
def my_shard_over_dp(local, mesh):
    ### BEGIN SOLUTION
    n, r = mesh.get_group("dp").size(), mesh.get_local_rank("dp")
    rows = -(-local.shape[0] // n)
    padded = local.new_zeros((rows * n, *local.shape[1:]))
    padded[: local.shape[0]] = local
    return padded[r * rows : (r + 1) * rows].clone()
    ### END SOLUTION


def my_gather_over_dp(shard, dim0, mesh):
    ### BEGIN SOLUTION
    group = mesh.get_group("dp")
    out = shard.new_empty((shard.shape[0] * group.size(), *shard.shape[1:]))
    ring_all_gather(out, shard.contiguous(), group=group)
    return out[:dim0]
    ### END SOLUTION


def my_reduce_grad_over_dp(grad, mesh):
    ### BEGIN SOLUTION
    group = mesh.get_group("dp")
    n = group.size()
    rows = -(-grad.shape[0] // n)
    padded = grad.new_zeros((rows * n, *grad.shape[1:]))
    padded[: grad.shape[0]] = grad
    out = grad.new_empty((rows, *grad.shape[1:]))
    ring_reduce_scatter(out, padded, op="avg", group=group)
    return out
    ### END SOLUTION


# %% [markdown]
# The check runs your three functions on 4 ranks on TP-local tensors of shapes (7, 3), (5,) and
# (6, 2),
# then trains `tp_lab.FSDPxTP` (the TP block's TP-local parameters flattened into one vector,
# FSDP's flat parameter, sharded, gathered and reduce-scattered with yours) for 3 SGD steps on
# the 2 x 2 mesh, each dp replica on its half of the batch: the whole parameters after training
# against one process on the whole batch and against torch's `parallelize_module` +
# `fully_shard(mesh=mesh["dp"])`, element-wise.

# %% nbgrader={"grade": true, "grade_id": "fsdp-tp-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check(
    "FSDP x TP",
    lambda: tp_checks.check_fsdp_tp(my_shard_over_dp, my_gather_over_dp, my_reduce_grad_over_dp),
)

# %%
dp_fns = exercise.pick(
    "FSDP x TP",
    (my_shard_over_dp, my_gather_over_dp, my_reduce_grad_over_dp),
    (tp_lab.shard_over_dp, tp_lab.gather_over_dp, tp_lab.reduce_grad_over_dp),
)

# %% [markdown]
# ## 7. Which dimension crosses the slow link
#
# On a cluster the mesh has a layout: 4 ranks as **2 simulated nodes x 2** (labkit.run(nodes=2):
# a slow link between nodes, labkit's `NodeLink`, its bandwidth and latency printed below; hsdp_lab). With mesh dims `("dp", "tp")` the tp groups are
# {0, 1} and {2, 3}: **TP inside a node**, FSDP across. With `("tp", "dp")` they are {0, 2} and
# {1, 3}: **TP across nodes**. The same FSDP x TP training (your functions and blocks, the bigger
# block of section 4, 2 steps) in both layouts, and the bytes the tracer saw cross nodes:

# %%
LINK = NodeLink()  # labkit.run(nodes=...)'s default inter-node link
print(f"the slow link: {LINK.bandwidth_Bps / 1e6:g} MB/s, {LINK.latency_s * 1e3:g} ms per message")
lay = labkit.run(
    tp_lab.two_layouts,
    steps=2,
    size=SIZE,
    dp_fns=dp_fns,
    blocks=(TPMLP, TPAttention),
    world_size=4,
    nodes=2,
    backend="gloo",
)
across = {k: tp_lab.fsdp_tp_node_bytes(lay, k) for k in lay[0]}
within = {k: tp_lab.fsdp_tp_node_bytes(lay, k, "intra") for k in lay[0]}
for k in lay[0]:
    print(f"{k:>15}: across nodes {fmt_bytes(across[k])}/step, within {fmt_bytes(within[k])}/step")
fig_bytes = tp_lab.plot_layout_bytes(across, within)  # drawn once, by the helper

# %% [markdown]
# Both layouts train the same model on the same batches, so each must end where one process
# does after the same 2 SGD steps on the whole batch, whatever crossed which link. Checked on
# every rank, every parameter, and each step's loss:

# %%
worst = tp_lab.check_layouts_train_as_one_process(lay, steps=2, size=SIZE)
print(f"both layouts, every rank: equal to one process after 2 steps (largest difference {worst:.1g})")

# %% [markdown]
# The formulas, every rank together per step: TP's 4 all-reduces of a dp replica's activations
# (8 sequences x 32 tokens x d x 4 B), each rank sending 1x on 2 ranks: 4 ranks x 4 x S; FSDP's
# one all-gather and one reduce-scatter of the flat TP-local parameter (Pₜ elements), each rank
# sending its shard ⌈Pₜ/2⌉ x 4 B in each: 4 x 2 x shard.

# %%
S_dp = SIZE["batch"] // 2 * SIZE["seq"] * d * 4
P_local = sum(
    tp_lab.tp_piece(p, n, 0, 2).numel()
    for n, p in tp_lab.make_block(0, d, SIZE["heads"], H).named_parameters()
)
tp_bytes, fsdp_bytes = 4 * 4 * tp_lab.ring_sent(S_dp, 2), 4 * 2 * math.ceil(P_local / 2) * 4
for label, crossing, staying in (
    ("TP in node", fsdp_bytes, tp_bytes),
    ("TP across nodes", tp_bytes, fsdp_bytes),
):
    assert_match(f"{label}: across nodes", crossing, across[label], rel_tol=0.005)
    assert_match(f"{label}: within nodes", staying, within[label], rel_tol=0.005)
assert across["TP across nodes"] > 2 * across["TP in node"], across

# %% [markdown]
# What the slow link costs per step, by the link model (the busiest rank's traced cross-node
# bytes / bandwidth + its messages x latency: what labkit's link charges, a number no
# neighbour's load changes). And the kind of time it is: in the TP-across layout it is spent
# inside every layer's forward and backward (the next matmul waits for the all-reduce); FSDP's
# all-gather of the next unit can be issued early and overlap compute (fsdp_lab's prefetch).

# %%
cost = {k: tp_lab.link_seconds(lay, k, LINK) for k in lay[0]}
print(
    ", ".join(f"{k}: {cost[k] * 1e3:.1f} ms per step on the slow link" for k in cost)
    + f"; TP across costs {cost['TP across nodes'] / cost['TP in node']:.1f}x"
)
assert cost["TP across nodes"] > cost["TP in node"], cost

# %% [markdown]
# **Summary.** Put the dimension whose traffic is large, frequent and blocking on the fast link:
# TP's all-reduces inside the node, FSDP's gathers and reduce-scatters (one each per step here,
# prefetchable) across. Swapping the two mesh dimensions sent more than twice the bytes over the
# slow link here (checked above), and the gap grows with the tokens per step.

# %% [markdown]
# ## 8. At scale
#
# The same formula on a real model: a GPT-175B layer (d = 12288) with t = 8 on 8 H100s
# (`labkit.costmodel.links`: NVLink inside a node, 400 Gb/s InfiniBand per GPU across), one
# micro-batch of 2048 tokens in bf16. TP all-reduces 4 x tokens x d x 2 B per layer per
# micro-batch (the formula checked against the tracer in section 5). For comparison, data
# parallelism's gradient all-reduce of the same layer: its 12d² parameters / t in bf16, once per
# step (not per micro-batch), over 16 replicas across nodes, and it can overlap the backward.
# These are the cost model's predictions (ring all-reduces at the links' bus bandwidths).

# %%
d_big, t, mb_tokens = 12288, 8, 2048
tp_layer = tp_lab.tp_allreduce_bytes(mb_tokens, d_big, dtype_bytes=2)
dp_layer = 12 * d_big**2 / t * 2


def ar_time(n, nbytes, link, calls=1):
    return calls * links.collective_time("all_reduce", n, nbytes / calls, link)


rows = [
    ("TP all-reduces, t = 8 in a node (NVLink)", tp_layer, ar_time(t, tp_layer, links.NVLINK_H100, 4)),
    ("TP all-reduces, t = 8 across nodes (IB)", tp_layer, ar_time(t, tp_layer, links.IB_400G, 4)),
    ("DP gradients, 16 replicas across nodes (IB)", dp_layer, ar_time(16, dp_layer, links.IB_400G)),
]
print(f"{'per layer':<46}{'bytes':>10}{'time':>10}")
for name, nbytes, seconds in rows:
    print(f"{name:<46}{nbytes / 1e6:>7.0f} MB{seconds * 1e3:>7.1f} ms")  # NBVAL_CHECK_OUTPUT
print(f"TP across nodes / in a node: {rows[1][2] / rows[0][2]:.1f}x the time for the same bytes")
assert rows[1][2] > rows[0][2] and rows[2][1] > rows[0][1], rows  # the two claims below

# %% [markdown]
# So per layer and micro-batch, TP inside the node pays the first row in blocking all-reduces;
# across nodes the same bytes take the ratio printed above longer, on the critical path of every
# layer (96 of them), every micro-batch. DP's gradient bytes per layer are larger, but paid once
# per step and hidden behind the backward. That is why every large run keeps TP within the NVLink domain (t ≤ 8) and
# puts data parallelism (FSDP, HSDP) across nodes.
#
# **Summary.** Tensor parallelism splits each layer: column-parallel then row-parallel, glued by
# f (identity / all-reduce) and g (all-reduce / identity), one all-reduce per sub-block in each
# direction. It divides weights and the big activations by t, replicates the activations between
# blocks, and pays blocking all-reduces that scale with tokens, so it lives inside a node;
# FSDP shards what TP leaves over the dp dimension of a 2-D mesh. The real APIs:
# `torch.distributed.tensor.parallel.parallelize_module` with `ColwiseParallel` /
# `RowwiseParallel` (and `SequenceParallel`), `fully_shard(mesh=mesh["dp"])`, Megatron-LM's
# `ColumnParallelLinear` / `RowParallelLinear`.
#
# *Exercises:* (1) TP with t = 4 over all 4 ranks of section 7 (2 nodes x 2, no dp): what
# crosses nodes per step, every rank together? Write the formula first. (2) Sequence parallelism replaces each
# all-reduce by a reduce-scatter + all-gather pair over the sequence dimension: why does that
# send the same bytes, and which activation of section 4 does it divide by t? (3) At what tokens
# per micro-batch does TP's per-layer all-reduce volume equal DP's gradient volume for d = 12288,
# t = 8? (4) Why must the number of heads be divisible by t, and what breaks in `MyTPAttention`
# otherwise?
