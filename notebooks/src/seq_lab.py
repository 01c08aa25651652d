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
# # 07 · Long sequences by hand: sequence parallelism and context parallelism (ring attention)
#
# Tensor parallelism (tp_lab) splits the weights, but every activation outside its matmuls stays
# whole on every rank: the norms, the residuals, and attention's T x T scores. With long
# contexts those dominate. Two answers, and you write both on real gloo ranks:
#
# - **Sequence parallelism** (SP, Megatron's): inside a TP block the norm runs on 1/tp of the
#   sequence, and TP's all-reduce becomes a reduce-scatter plus an all-gather along the sequence:
#   the same bytes, the norm's activations divided by tp. Checked against one process and against
#   torch's `SequenceParallel` / `ColwiseParallel(input_layouts=Shard(1))` /
#   `RowwiseParallel(output_layouts=Shard(1))`.
# - **Context parallelism** (CP): every rank holds 1/cp of the sequence, passes K/V round a
#   **ring**, and merges the partial softmaxes exactly with their log-sum-exp; a **zigzag**
#   assignment of the chunks balances causal attention's work. Checked against one process's
#   `scaled_dot_product_attention` (torch's own `context_parallel` has no CPU implementation:
#   "aten._scaled_dot_product_flash_attention_for_cpu does not have a sharding strategy").
# - **Ulysses** (DeepSpeed's): the same pieces of the sequence, but around attention an
#   **all-to-all** trades them for whole sequences of a share of the heads; section 7.
#
# Five exercises, then what each saves and costs, measured in this run and checked against its
# formula. Everything is float64 so a check can ask for equality within 1e-10.

# %%
import labkit  # first (it needs no torch): the ranks' forkserver imports torch on another core meanwhile
import torch
import torch.distributed as dist

from labkit import exercise, loop
from labkit.checks import assert_match, compare
from labkit.comm.all_to_all import all_to_all_autograd, wire_bytes
from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter
from labkit.costmodel import GPT_175B, H100, memory_per_rank
from labkit.labs import seq_checks, seq_lab
from labkit.strategies.cp import attention_flops, block_flops, imbalance, n_chunks, ring_schedule
from labkit.strategies.ulysses import layer_bytes
from labkit.units import fmt_bytes

# %% [markdown]
# ## 1. SP's conjugate pair
#
# In tp_lab, the block's input x (B, T, d) is whole on every rank; f (identity forward,
# all-reduce backward) goes in front of the column-parallel fc1, g (all-reduce forward) after
# the row-parallel fc2. With SP the block's input is **this rank's piece of the sequence**,
# (B, T/n, d), and the norm runs on it. Then:
#
# - **gather** in front of fc1: forward an **all-gather along the sequence** (fc1 needs every
#   token); backward a **reduce-scatter** of the gradient (every rank's fc1 used this rank's
#   tokens: sum the contributions, keep this rank's piece);
# - **scatter** after fc2: forward a **reduce-scatter** (sum the partial outputs, keep this
#   rank's piece of the sequence); backward an **all-gather** of the gradient.
#
# An all-reduce is a reduce-scatter then an all-gather, so SP sends what TP sends; it only moves
# the all-gather to the other side of the norm.
#
# **Exercise 1:** the two as `torch.autograd.Function`s on labkit's collectives:
# `ring_all_gather(out, x, group=group)` and `ring_reduce_scatter(out, x, op="sum",
# group=group)` both work along **dim 0** (concatenate / split the first dimension), and the
# sequence is dim 1: move it first (`x.transpose(0, 1).contiguous()`), then back. `backward`
# returns one gradient per input of `forward`: None for the group.


# %% nbgrader={"grade": false, "grade_id": "sp-pair", "locked": false, "schema_version": 3, "solution": true}
class MyGatherSeq(torch.autograd.Function):
    """(B, T/n, d) -> (B, T, d): all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        n = dist.get_world_size(group)
        xt = x.transpose(0, 1).contiguous()
        out = xt.new_empty((n * xt.shape[0], *xt.shape[1:]))
        ring_all_gather(out, xt, group=group)
        return out.transpose(0, 1).contiguous()
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        n = dist.get_world_size(ctx.group)
        gt = grad.transpose(0, 1).contiguous()
        out = gt.new_empty((gt.shape[0] // n, *gt.shape[1:]))
        ring_reduce_scatter(out, gt, op="sum", group=ctx.group)
        return out.transpose(0, 1).contiguous(), None
        ### END SOLUTION


class MyScatterSeq(torch.autograd.Function):
    """(B, T, d) partial sums -> this rank's (B, T/n, d) of their sum; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ctx.group = group
        n = dist.get_world_size(group)
        xt = x.transpose(0, 1).contiguous()
        out = xt.new_empty((xt.shape[0] // n, *xt.shape[1:]))
        ring_reduce_scatter(out, xt, op="sum", group=group)
        return out.transpose(0, 1).contiguous()
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        n = dist.get_world_size(ctx.group)
        gt = grad.transpose(0, 1).contiguous()
        out = gt.new_empty((n * gt.shape[0], *gt.shape[1:]))
        ring_all_gather(out, gt, group=ctx.group)
        return out.transpose(0, 1).contiguous(), None
        ### END SOLUTION


def my_gather_seq(x, group):
    return MyGatherSeq.apply(x, group)


def my_scatter_seq(x, group):
    return MyScatterSeq.apply(x, group)


# %% [markdown]
# The check runs on 4 ranks as a 2 x 2 mesh whose tp groups are {0, 1} and {2, 3} (so a global
# rank used where the group's index belongs shows): both functions on integer data (3 tokens per
# rank), forward and backward; the collectives the tracer saw in each direction; then an SP
# block (norm on the piece, gather, fc1, GELU, fc2, scatter) against one process and against
# torch's `parallelize_module` with `SequenceParallel` on the norm.

# %% nbgrader={"grade": true, "grade_id": "sp-pair-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("SP pair", lambda: seq_checks.check_sp_pair(my_gather_seq, my_scatter_seq))

# %%
gather_op, scatter_op = exercise.pick(
    "SP pair", (my_gather_seq, my_scatter_seq), (seq_lab.gather_seq, seq_lab.scatter_seq)
)

# %% [markdown]
# ## 2. What SP saves, what it costs; what CP saves
#
# One forward and backward of the MLP sub-block (`seq_lab.MLPBlock`: x + fc2(GELU(fc1(LN(x)))),
# d = 16, hidden 32, batch 2) on 2 ranks for three sequence lengths, as TP (norm on the whole
# sequence, f and g) and as TP + SP (your pair); and, for CP, the same sub-block on one process
# and on each rank's half of the sequence. Memory is what autograd saves for backward
# (`seq_lab.saved_bytes`: the distinct storages, parameters left out); bytes are the tracer's.

# %%
SEQS = [16, 32, 64]
B, d, H = seq_lab.SP_SIZE["batch"], seq_lab.SP_SIZE["d"], seq_lab.SP_SIZE["hidden"]
sp = labkit.run(seq_lab.measure_sp_cp, SEQS, gather_op, scatter_op, world_size=2, backend="gloo")
print(f"the sub-block: d = {d}, hidden {H}, batch {B}, on 2 ranks")
print(f"{'T':>4} {'norm TP':>10} {'norm SP':>10} {'block, 1 process':>17} {'block, CP':>10}")
for T in SEQS:
    m = sp[0]
    print(
        f"{T:>4} {fmt_bytes(m['norm_saved']['TP', T]):>10} {fmt_bytes(m['norm_saved']['SP', T]):>10} "
        f"{fmt_bytes(m['block_saved']['one process', T]):>17} {fmt_bytes(m['block_saved']['CP', T]):>10}"
    )

# %% [markdown]
# The formulas, 8-byte elements, n = 2. The LayerNorm saves its input (d per token) and its mean
# and 1/std (1 each): 8·B·T·(d + 2) under TP (the whole sequence on every rank), 8·B·(T/n)·(d + 2)
# under SP. The whole sub-block saves, per token, the norm's d + 2, fc1's input d, GELU's input
# and fc2's input (hidden each): 8·B·T·(2d + 2 + 2·hidden) on one process, and the same of T/n
# tokens per rank under CP: every per-token activation is divided by cp. (Under SP, fc1 here
# saves the gathered input, whole: Megatron saves the piece and gathers it again in backward.)

# %%
m = sp[0]
for T in SEQS:
    one = 8 * B * T * (2 * d + 2 + 2 * H)
    assert_match(f"T = {T}: norm, TP, 8·B·T·(d+2)", 8 * B * T * (d + 2), m["norm_saved"]["TP", T], 0)
    assert_match(f"T = {T}: norm, SP = TP / 2", 8 * B * T * (d + 2) / 2, m["norm_saved"]["SP", T], 0)
    assert_match(
        f"T = {T}: block, one process, 8·B·T·(2d+2+2·hidden)", one, m["block_saved"]["one process", T], 0
    )
    assert_match(f"T = {T}: block, CP = one process / 2", one / 2, m["block_saved"]["CP", T], 0)
assert sp[1]["norm_saved"] == m["norm_saved"] and sp[1]["block_saved"] == m["block_saved"], "rank 1 differs"

# %% [markdown]
# **The bytes.** Per step, TP all-reduces the (B, T, d) activations once forward (g) and once
# backward (f); SP all-gathers and reduce-scatters the same tensor once each way. A ring
# all-reduce makes each rank send 2(n-1)/n of the tensor, a reduce-scatter or all-gather (n-1)/n:
# 2 x 2(n-1)/n·S against 4 x (n-1)/n·S, the same. The tracer counts every byte a rank sent,
# including the 64-byte header of labkit's cross-rank check, one per peer per call (left out of
# the payload below, and checked too).

# %%
n = 2
for T in SEQS:
    S = B * T * d * 8
    sent = {}
    for mode in ("TP", "SP"):
        ops = seq_lab.sent_in(sp.traces[0], sp[0]["windows"][mode, T])
        calls = sum(c for c, _, _ in ops.values())
        payload = sum(s for _, _, s in ops.values()) - seq_checks.HEADER_BYTES * (n - 1) * calls
        formula = sum(seq_lab.ring_share(op, n) * nbytes for op, (_, nbytes, _) in ops.items())
        print(f"T = {T}, {mode}: {', '.join(f'{c} x {op}' for op, (c, _, _) in ops.items())}")
        assert_match(f"  {mode}, sent by rank 0 (payload)", formula, payload, 0)
        sent[mode] = payload
    assert_match(f"T = {T}: SP sends what TP sends, 4·(n-1)/n·S", 4 * (n - 1) / n * S, sent["SP"], 0)
    assert_match(f"T = {T}: TP, 2·2(n-1)/n·S", sent["SP"], sent["TP"], 0)

# %% [markdown]
# **Summary.** SP divides the norm's activations by tp and sends exactly TP's bytes; CP divides
# every per-token activation by cp. What CP must still do is attention, whose every query needs
# every earlier key: the rest of this lab.

# %% [markdown]
# ## 3. Attention in blocks: the exact merge
#
# Attention of queries q over keys k is softmax(q kᵀ / √D) v. Split the keys in two blocks and
# each block gives a **normalized** partial output o_i and the **log-sum-exp** of its scores,
# lse_i = log Σ_j exp(s_ij): `seq_lab.block_attention(q, k, v)` returns both. The attention over
# both blocks follows exactly: lse = log(exp(lse₁) + exp(lse₂)), and
# o = o₁·exp(lse₁ − lse) + o₂·exp(lse₂ − lse) (each partial weighted by its share of the softmax
# mass). Computed naively, exp(lse) overflows once scores pass about 709 (float64): shift by the
# larger one, m = max(lse₁, lse₂), as every log-sum-exp does. An empty partial (o = 0,
# lse = −inf: a running accumulator's start) must leave the other unchanged.
#
# **Exercise 2:** `my_merge(o1, lse1, o2, lse2)` returns (o, lse). o is (B, H, T, D), lse
# (B, H, T): `lse.unsqueeze(-1)` to scale o.


# %% nbgrader={"grade": false, "grade_id": "merge", "locked": false, "schema_version": 3, "solution": true}
def my_merge(o1, lse1, o2, lse2):
    ### BEGIN SOLUTION
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    o = (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / total.unsqueeze(-1)
    return o, m + torch.log(total)
    ### END SOLUTION


# %% [markdown]
# The check merges partials of random blocks, of blocks whose scores are near 2000 (exp
# overflows), and an empty partial with a full one, against `block_attention` over both blocks.

# %% nbgrader={"grade": true, "grade_id": "merge-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("merge", lambda: seq_checks.check_merge(my_merge))

# %%
merge_op = exercise.pick("merge", my_merge, seq_lab.merge)

# %% [markdown]
# ## 4. Ring attention
#
# Rank r of n holds positions [rT/n, (r+1)T/n) of q, k and v, each (B, H, T/n, D) (the
# **contiguous** layout). In n steps every rank sees every rank's K/V once: at step s it holds the
# block of rank j = (r − s) mod n, computes its partial attention with its own q, merges it into
# its running (o, lse), and passes the block on to the next rank while receiving the next one from
# the previous rank. With a **causal** mask: j == r is the diagonal block (masked:
# `block_attention(..., causal=True)`), a block of an earlier rank (j < r) is seen whole, a block of
# a later rank (j > r) is all in the future: skipped (its K/V are still passed on).
#
# **Exercise 3:** `my_ring_attention(q, k, v, causal, group)` returns this rank's (B, H, T/n, D)
# output. Point-to-point, on the **group**: r = `dist.get_rank(group)`, n its size, and the peers'
# **global** ranks `dist.get_global_rank(group, (r ± 1) % n)`. Post the send and the receive
# together, `dist.isend(kv, dst=..., group=group)` and `dist.irecv(buffer, src=..., group=group)`,
# each returning a request to `wait()`: a blocking receive on every rank first deadlocks, and
# receiving into the buffer being sent overwrites it in flight. K and V can travel as one tensor
# (`torch.stack([k, v])`). Merge with `merge_op` (yours, or labkit's until yours passes).
# (labkit's own ring, `labkit.strategies.cp.ring_attention`, sends K/V with its traced
# `labkit.comm.p2p.sendrecv`, which posts the pair and refuses to receive into the buffer being
# sent: the two mistakes this exercise lets you make, and its check watches for.)


# %% nbgrader={"grade": false, "grade_id": "ring", "locked": false, "schema_version": 3, "solution": true}
def my_ring_attention(q, k, v, causal, group):
    ### BEGIN SOLUTION
    r, n = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    kv = torch.stack([k, v]).contiguous()
    o = lse = None
    for s in range(n):
        j = (r - s) % n
        if s < n - 1:
            incoming = torch.empty_like(kv)
            reqs = [dist.isend(kv, dst=nxt, group=group), dist.irecv(incoming, src=prv, group=group)]
        if not causal or j <= r:
            part = seq_lab.block_attention(q, kv[0], kv[1], causal=causal and j == r)
            o, lse = part if o is None else merge_op(o, lse, *part)
        if s < n - 1:
            for req in reqs:
                req.wait()
            kv = incoming
    return o
    ### END SOLUTION


# %% [markdown]
# The check runs your ring on 4 ranks (T = 24: 6 positions each, head_dim 3), causal and not, and
# on the groups {0, 2} and {1, 3} (n = 2, causal), against one process's
# `scaled_dot_product_attention`. It watches every isend / irecv: a wait longer than 20 s is
# reported as a deadlock (and stopped), a buffer received into while it is being sent is named.

# %% nbgrader={"grade": true, "grade_id": "ring-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("ring attention", lambda: seq_checks.check_ring(my_ring_attention), needs=["merge"])

# %%
ring_op = exercise.pick("ring attention", my_ring_attention, seq_lab.ring_attention)

# %% [markdown]
# ## 5. Causal work and the zigzag
#
# With a causal mask and the contiguous layout, rank 0 computes one block (its diagonal) and
# skips the rest, rank n − 1 computes all n: the ranks wait for the slowest, which does
# 2n/(n + 1) times the average (1.60 on the 4 ranks below: section 5's measurement checks it). The fix cuts the sequence into **2n chunks** of T/(2n) and gives rank r
# chunks **r and 2n − 1 − r**, in that order: an early, cheap chunk and a late, expensive one.
#
# **Exercise 4:** `my_zigzag_positions(rank, n, T)`: the global positions rank r holds under
# zigzag (a 1-D tensor of T/n integers); `my_causal_pairs(q_pos, k_pos)`: the number of (query,
# key) pairs causal attention computes between those positions (key ≤ query).


# %% nbgrader={"grade": false, "grade_id": "zigzag", "locked": false, "schema_version": 3, "solution": true}
def my_zigzag_positions(rank, n, T):
    ### BEGIN SOLUTION
    c = T // (2 * n)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in (rank, 2 * n - 1 - rank)])
    ### END SOLUTION


def my_causal_pairs(q_pos, k_pos):
    ### BEGIN SOLUTION
    return int((k_pos[None, :] <= q_pos[:, None]).sum())
    ### END SOLUTION


# %% [markdown]
# The check: every rank's positions for n = 2, 3, 4 and several T, the pair count on blocks
# before, on and after the diagonal, and that your two together give every rank the same causal
# work under zigzag.

# %% nbgrader={"grade": true, "grade_id": "zigzag-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("zigzag", lambda: seq_checks.check_zigzag(my_zigzag_positions, my_causal_pairs))

# %%
zigzag_positions, causal_pairs = exercise.pick(
    "zigzag", (my_zigzag_positions, my_causal_pairs), (seq_lab.zigzag_positions, seq_lab.causal_pairs)
)

# %% [markdown]
# **Measured.** On 4 ranks, T = 24: your ring (contiguous, causal) once, with the tracer
# watching its sends; then labkit's `chunked_ring` in both layouts (your merge, your zigzag
# positions), which splits each step into (query chunk, key chunk) pairs, skips the pairs wholly
# in the future, masks the diagonal ones and computes the rest whole, with torch's
# `FlopCounterMode` counting each step's matmul FLOPs. Every output is compared with one process.

# %%
SIZE = seq_lab.ATTN
Bq, Hq, T, D, cp = SIZE["batch"], SIZE["heads"], SIZE["seq"], SIZE["head_dim"], 4
ring = labkit.run(seq_lab.measure_ring, ring_op, zigzag_positions, merge_op, world_size=cp, backend="gloo")
print(f"{cp} ranks, T = {T}, batch {Bq}, {Hq} heads of {D}")
q, k, v = seq_lab.attn_inputs(0)
want = seq_lab.one_process(q, k, v, causal=True)
for rank, res in enumerate(ring):
    assert torch.allclose(res["ring"], torch.chunk(want, cp, 2)[rank], rtol=0, atol=1e-10), rank
    for layout in ("contiguous", "zigzag"):
        got = res[layout]
        assert torch.allclose(got["out"], want[..., got["positions"], :], rtol=0, atol=1e-10), (rank, layout)
print("every rank's output equals one process's scaled_dot_product_attention (atol 1e-10), both layouts")

# %% [markdown]
# **What the ring sends.** Every rank sends its K/V block on cp − 1 times (the last block
# received is not passed on): per rank (cp − 1)·2·B·H·(T/cp)·D·8 bytes = 2(cp − 1)/cp of one
# whole-sequence K (B·H·T·D·8 bytes), i.e. (cp − 1)/cp of the layer's K and V together, in
# every layer's forward (backward passes them round again). Counted from the tracer's sends:

# %%
K_bytes = Bq * Hq * T * D * 8
for rank, res in enumerate(ring):
    sends = seq_lab.sends_in(ring.traces[rank], res["ring_window"])
    assert_match(
        f"rank {rank}: {len(sends)} sends, 2(cp-1)/cp x K ({fmt_bytes(K_bytes)})",
        2 * (cp - 1) / cp * K_bytes,
        sum(e["nbytes"] for e in sends),
        0,
    )

# %% [markdown]
# **The work.** `chunked_ring` computes every pair of chunks it does not skip whole: 2 matmuls
# of 2·c_q·c_k·D FLOPs per head. Contiguous, rank r computes r + 1 blocks of T/cp; zigzag, every
# rank 2cp + 1 blocks of T/(2cp) (chunk r sees chunks 0..r, chunk 2cp − 1 − r sees 0..2cp − 1 − r):
# the formula of labkit's strategy, `attention_flops` (labkit.strategies.cp). Measured against
# it, and the imbalance (the busiest rank over the mean, cp's `imbalance`):

# %%
work, spread = {}, {}
for layout in ("contiguous", "zigzag"):
    work[layout] = [sum(s["flops"] for s in res[layout]["steps"]) for res in ring]
    formula = attention_flops(T, cp, layout=layout, causal=True, batch=Bq, heads=Hq, head_dim=D)
    for rank in range(cp):
        assert_match(f"{layout}, rank {rank}: FLOPs", formula[rank], work[layout][rank], 0, unit="FLOP")
    spread[layout] = imbalance(work[layout])
print(", ".join(f"{k}: busiest / mean = {v:.2f}" for k, v in spread.items()))
assert_match("contiguous imbalance: 2cp/(cp+1)", 2 * cp / (cp + 1), spread["contiguous"], 1e-12, unit="")
assert_match("zigzag imbalance", 1.0, spread["zigzag"], 1e-12, unit="")

# %% [markdown]
# The causal pairs themselves, from your `causal_pairs` on each layout's positions (the work a
# kernel that skipped masked entries inside a block would do): the same spread, and the same fix.

# %%
pairs = {}
for name, pos_fn in (("contiguous", seq_lab.contiguous_positions), ("zigzag", zigzag_positions)):
    pos = [torch.as_tensor(pos_fn(r, cp, T)) for r in range(cp)]
    pairs[name] = [sum(causal_pairs(pos[r], pos[j]) for j in range(cp)) for r in range(cp)]
    print(f"{name:>10}: causal pairs per rank {pairs[name]}")
c = T // cp
assert pairs["contiguous"] == [r * c * c + c * (c + 1) // 2 for r in range(cp)], pairs
assert len(set(pairs["zigzag"])) == 1 and sum(pairs["zigzag"]) == T * (T + 1) // 2, pairs

# %% [markdown]
# The ring's steps, per rank and layout: each cell is a step, labelled with the rank whose K/V
# it holds, shaded by the FLOPs measured in it; the totals per rank on the right.

# %%
fig_ring = seq_lab.plot_ring_steps(ring)  # drawn once, by the helper

# %% [markdown]
# **The same ring as labkit's strategy.** labkit's `ring_attention` (labkit.strategies.cp, the
# attention of the strategy `"cp"`) ran in the same launch, both layouts, counting what it
# computed. Its step-by-step plan, `ring_schedule`, must be the figure's: at each step the same
# K/V source, and the FLOPs measured in the step those of the blocks it lists. Its outputs must
# equal your ring's and `chunked_ring`'s (with your merge and zigzag), and its count their FLOPs.

# %%
for layout in ("contiguous", "zigzag"):
    plan = ring_schedule(cp, layout=layout, causal=True)
    block = block_flops(Bq, Hq, T // n_chunks(layout, cp), D)  # 4·B·H·c²·D, c the chunk length
    for rank, res in enumerate(ring):
        steps, theirs = res[layout]["steps"], res["strategy", layout]
        assert [s["src"] for s in steps] == [plan[t][rank]["kv_from"] for t in range(cp)], (layout, rank)
        assert [s["flops"] for s in steps] == [block * len(plan[t][rank]["blocks"]) for t in range(cp)]
        assert theirs["flops"] == work[layout][rank], (layout, rank, theirs["flops"])
        assert torch.allclose(theirs["out"], res[layout]["out"], rtol=0, atol=1e-12), (layout, rank)
        if layout == "contiguous":
            assert torch.allclose(theirs["out"], res["ring"], rtol=0, atol=1e-12), rank
print("labkit's ring_attention: your ring's outputs (atol 1e-12), the figure's schedule, the same FLOPs")

# %% [markdown]
# And the strategies built on these pieces train like one process: labkit's `"sp"` (TinyGPT,
# TP + SP on tp = 2, its conjugates `gather_from_sp` / `reduce_scatter_to_sp`, what exercise 1's
# reference calls) and `"cp"` (TinyGPT with `ring_attention`, cp = 2, zigzag), two AdamW steps on
# a small TinyGPT in float64, against `loop.reference` (single-process training on the same
# global batch): losses, step 0's gradients and the final state, element-wise.

# %%
TINY = loop.PRESETS["dp"].replace(
    dtype=torch.float64, gpt={"d_model": 8, "n_heads": 2, "n_layers": 1}, seq_len=8, batch_size=2
)
runs = labkit.run(
    loop.sweep, [dict(strategy="cp"), dict(strategy="sp")], cfg=TINY, steps=2, spans=False, world_size=2
)
one = loop.reference(TINY, 2)
for rank, got in enumerate(runs):
    for name, res in zip(("cp", "sp"), got):
        for part in ("grads", "state"):
            compare(
                one[part], res[part], label=f"{name} rank {rank} {part}", rtol=0, atol=1e-12
            ).raise_if_failed()
        assert max(abs(a - b) for a, b in zip(one["losses"], res["losses"])) <= 1e-12, (name, rank)
print('"cp" and "sp" on 2 ranks: losses, gradients and state equal to one process (float64, atol 1e-12)')

# %% [markdown]
# ## 6. At scale: the longest sequence that fits
#
# Per rank, a GPT-175B (96 layers, d = 12288) in bf16 with Adam, its model states sharded over
# 1024 H100s (ZeRO-3: `memory_per_rank`), 80 GB each; what is left holds the activations, by
# labkit's cost model `activation_bytes` (Korthikanti et al.'s 34·s·b·h bytes per layer for s
# tokens of b sequences at hidden size h, i.e. 34·d bytes per token per layer; no score matrix:
# flash attention). TP splits the 24 of those 34 that live inside its matmuls and
# keeps the 10 of the norms, dropout and residuals whole; SP splits all 34 by tp; CP splits the
# tokens by cp (`seq_lab.activation_share`). `seq_lab.longest_sequence` searches the cost model in
# steps of 1024 tokens; the next cell checks it against the closed form
# T = ⌊(budget − states) / (34·L·d·share) / 1024⌋·1024.

# %%
states = sum(memory_per_rank(GPT_175B.params, 1024, 3).values())
budget = H100.memory_bytes
rows = [(8, 1, False), (8, 1, True), (8, 4, True), (8, 16, True)]
longest = {}
print(
    f"GPT-175B: {GPT_175B.layers} layers, d = {GPT_175B.d_model}, {GPT_175B.params / 1e9:.0f} B parameters "
    f"on 1024 ranks; model states per rank {states / 1e9:.1f} GB of {budget / 1e9:.0f} GB"
)
for tp, cpn, sp_on in rows:
    longest[tp, cpn, sp_on] = seq_lab.longest_sequence(GPT_175B, budget, states, tp, cpn, sp_on)
    label = f"TP {tp}{' + SP' if sp_on else ''}, CP {cpn}"
    print(f"{label:<18} longest sequence {longest[tp, cpn, sp_on]:>9,} tokens")  # NBVAL_CHECK_OUTPUT

# %%
for (tp, cpn, sp_on), got in longest.items():
    share = ((10 + 24 / tp) / 34 if not sp_on else 1 / tp) / cpn
    closed = int((budget - states) / (34 * GPT_175B.layers * GPT_175B.d_model * share) // 1024) * 1024
    assert_match(f"TP {tp}, CP {cpn}, SP {sp_on}: closed form", closed, got, 0, unit="tokens")

# %% [markdown]
# ## 7. Ulysses: trade the sequence for the heads
#
# Outside attention each rank holds T/n positions of **every** head: q, k and v are
# (B, H, T/n, D). Attention needs every position of a head, but the heads never meet. So an
# **all-to-all** trades the pieces: rank j receives from every rank its positions of the heads
# [jH/n, (j+1)H/n), and holds the **whole sequence of H/n heads**, (B, H/n, T, D); attention runs on
# whole sequences, as in one process; a second all-to-all turns the output back to (B, H, T/n, D).
# That is DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
# Enabling Training of Extreme Long Sequence Transformer Models"). On 2 ranks, values that name
# their head and position (100·h + t) show who holds what, before and after labkit's
# `seq_to_heads`:

# %%
shown = labkit.run(seq_lab.ulysses_layout, world_size=2, backend="gloo")
for rank, held in enumerate(shown):
    for when in ("before", "after"):
        h = held[when]
        print(f"rank {rank} {when:>6}: {str(h['shape']):<14} heads {h['heads']}, positions {h['positions']}")
assert shown[1]["after"] == {"shape": (1, 2, 8, 1), "heads": [2, 3], "positions": list(range(8))}, shown[1]

# %% [markdown]
# **Exercise 5:** `my_seq_to_heads(x, group)`, (B, H, T/n, D) → (B, H/n, T, D), and
# `my_heads_to_seq(x, group)`, its inverse. One all-to-all each:
# `all_to_all_autograd(send, group=group)` (labkit.comm.all_to_all: moe_lab's exercise 3, the
# Function you wrote there, with equal splits) cuts `send`'s dim 0 into n equal blocks, block j
# to group rank j, and returns what arrived in the same shape, block i from group rank i; its
# backward is the all-to-all the other way, so gradients reach q, k and v. So: put the
# destination first (`torch.stack(torch.chunk(x, n, dim=...))`: n blocks), send, and lay out what
# arrives along the dim it belongs to (`torch.cat(got.unbind(0), dim=...)`). n =
# `dist.get_world_size(group)`. A head count n does not divide is refused: raise `ValueError`
# naming both, before any message.


# %% nbgrader={"grade": false, "grade_id": "ulysses", "locked": false, "schema_version": 3, "solution": true}
def my_seq_to_heads(x, group):
    ### BEGIN SOLUTION
    n = dist.get_world_size(group)
    if x.shape[1] % n:
        raise ValueError(f"{x.shape[1]} heads do not split over {n} ranks")
    send = torch.stack(torch.chunk(x, n, dim=1))  # (n, B, H/n, T/n, D): head group j for rank j
    got = all_to_all_autograd(send, group=group)  # (n, B, H/n, T/n, D): rank i's positions
    return torch.cat(got.unbind(0), dim=2)
    ### END SOLUTION


def my_heads_to_seq(x, group):
    ### BEGIN SOLUTION
    n = dist.get_world_size(group)
    send = torch.stack(torch.chunk(x, n, dim=2))  # (n, B, H/n, T/n, D): rank j's positions
    got = all_to_all_autograd(send, group=group)  # (n, B, H/n, T/n, D): rank i's heads
    return torch.cat(got.unbind(0), dim=1)
    ### END SOLUTION


# %% [markdown]
# The check runs on 4 ranks: on the groups {0, 2} and {1, 3} (n = 2; the world is not the group,
# and rank 2 is index 1 of its own), then on all 4 (n = 4). B = 3, H = 4, T = 12, D = 5, values
# that name their (b, h, t, d), so a head, a position or a rank out of place shows; then
# `heads_to_seq(seq_to_heads(x)) == x`; then causal attention built from your pair
# (`seq_lab.ulysses_attention`: your pair around torch's `scaled_dot_product_attention`) against
# one process's, forward and dq, dk, dv; the tracer's all-to-alls (one per call, the bytes of
# `layer_bytes`); and 3 heads over 2 ranks, which must be refused.

# %% nbgrader={"grade": true, "grade_id": "ulysses-check", "locked": true, "points": 1, "schema_version": 3, "solution": false}
exercise.check("Ulysses pair", lambda: seq_checks.check_ulysses(my_seq_to_heads, my_heads_to_seq))

# %%
to_heads_op, to_seq_op = exercise.pick(
    "Ulysses pair", (my_seq_to_heads, my_heads_to_seq), (seq_lab.seq_to_heads, seq_lab.heads_to_seq)
)

# %% [markdown]
# **What each sends.** On 4 ranks, one causal attention layer, forward and backward, on the same
# pieces (B = 1, H = 4, T = 16, D = 4, float64) as Ulysses (your pair) and as the ring (labkit's
# `ring_attention`, the strategy `"cp"`'s, whose backward passes K, V and their gradients round
# again), on n = 2 (the groups {0, 2}, {1, 3}) and n = 4 (the world). The bytes each rank sent,
# from the tracer: an all-to-all's minus its per-peer headers (`wire_bytes` of no rows), the
# ring's point-to-point payload. L is one of q, k, v on a rank, B·H·(T/n)·D·8 bytes.

# %%
uly = labkit.run(seq_lab.measure_ulysses, to_heads_op, to_seq_op, world_size=4, backend="gloo")
Bu, Hu, Tu, Du = (seq_lab.ULYSSES[key] for key in ("batch", "heads", "seq", "head_dim"))
sent_u: dict = {}
for rank, res in enumerate(uly):
    for (name, n_u), m in res.items():
        assert m["error"] <= 1e-12, (rank, name, n_u, m["error"])  # output, dq, dk, dv: one process's
        for direction in ("forward", "backward"):
            if name == "ulysses":
                events = seq_lab.sent_by(uly.traces[rank], m[direction], ("all_to_all_single",))
                payload = sum(e["sent"] - wire_bytes([1] * n_u, m["rank"], 0) for e in events)
            else:
                events = seq_lab.sent_by(uly.traces[rank], m[direction], ("p2p_sendrecv",))
                payload = sum(e["sent"] for e in events)
            sent_u[rank, name, n_u, direction] = payload
print("every rank's output, dq, dk, dv equal to one process's (atol 1e-12), both, n = 2 and 4")
print(f"{'n':>2} {'L':>8} {'Ulysses fwd':>12} {'bwd':>8} {'ring fwd':>9} {'bwd':>8}   ring / Ulysses")
for n_u in (2, 4):
    L = Bu * Hu * (Tu // n_u) * Du * 8
    row = [sent_u[0, name, n_u, d] for name in ("ulysses", "ring") for d in ("forward", "backward")]
    assert all(sent_u[r, name, n_u, d] == sent_u[0, name, n_u, d] for r, name, _, d in sent_u), "ranks differ"
    print(
        f"{n_u:>2} {fmt_bytes(L):>8} {fmt_bytes(row[0]):>12} {fmt_bytes(row[1]):>8} {fmt_bytes(row[2]):>9} "
        f"{fmt_bytes(row[3]):>8}   {(row[2] + row[3]) / (row[0] + row[1]):.2f} x"
    )

# %% [markdown]
# The formulas. Ulysses: 4 all-to-alls each way (q, k, v in, the output back; backward their
# gradients), each sending (n − 1)/n of L: 4(n − 1)/n·L per direction, `layer_bytes`' payload,
# under 4 L whatever n. The ring: forward passes the K/V pieces n − 1 times, 2(n − 1)·L;
# backward passes K, V, dK, dV n − 1 times and brings dK, dV home once, (4(n − 1) + 2)·L: per
# rank it grows with n, Ulysses' does not.

# %%
for n_u in (2, 4):  # rank 0's (every rank sent the same: asserted above)
    L = Bu * Hu * (Tu // n_u) * Du * 8
    formula = layer_bytes(Bu, Tu, Hu * Du, n_u, 8, 0)["payload"]
    assert_match(f"n = {n_u}: layer_bytes' payload, 4(n-1)/n·L", 4 * (n_u - 1) / n_u * L, formula, 0)
    for d in ("forward", "backward"):
        assert_match(f"n = {n_u}: Ulysses {d}, layer_bytes'", formula, sent_u[0, "ulysses", n_u, d], 0)
    assert_match(
        f"n = {n_u}: ring forward, 2(n-1)·L", 2 * (n_u - 1) * L, sent_u[0, "ring", n_u, "forward"], 0
    )
    assert_match(
        f"n = {n_u}: ring backward, (4(n-1)+2)·L",
        (4 * (n_u - 1) + 2) * L,
        sent_u[0, "ring", n_u, "backward"],
        0,
    )
ratio = {n_u: sent_u[0, "ring", n_u, "forward"] / sent_u[0, "ulysses", n_u, "forward"] for n_u in (2, 4)}
assert ratio == {2: 1.0, 4: 2.0}, ratio  # 2(n-1)·L / (4(n-1)/n·L) = n/2
print(
    f"verdict: forward, the ring sends {ratio[2]:.2f} x Ulysses' bytes at n = 2 and {ratio[4]:.2f} x at n = 4 "
    "(n/2 x, growing with n): Ulysses wins on bytes when n divides the heads (and the K/V heads); "
    "the ring runs any head count and can hide its sends behind each step's compute"
)

# %% [markdown]
# And the strategy built on the same pair trains like one process: labkit's `"ulysses"`
# (TinyGPT whose attention runs `ulysses_attention`, 2 ranks), two AdamW steps in float64,
# against `loop.reference`.

# %%
uly_runs = labkit.run(loop.sweep, [dict(strategy="ulysses")], cfg=TINY, steps=2, spans=False, world_size=2)
one = loop.reference(TINY, 2)
worst = 0.0
for rank, (res,) in enumerate(uly_runs):
    for part in ("grads", "state"):
        report = compare(one[part], res[part], label=f"ulysses rank {rank} {part}", rtol=0, atol=1e-12)
        report.raise_if_failed()
        worst = max([worst] + [e.max_diff for e in report.entries])
    worst = max([worst] + [abs(a - b) for a, b in zip(one["losses"], res["losses"])])
assert worst <= 1e-12, worst
print(
    f'"ulysses" on 2 ranks against one process (float64): max |difference| {worst:.1e} (losses, gradients, state)'
)

# %% [markdown]
# **Summary.** Long contexts are an activation problem. SP runs the norms (and dropout,
# residuals) on 1/tp of the sequence inside a TP group and sends exactly TP's bytes: the
# all-reduce split into its reduce-scatter and all-gather. CP gives each rank 1/cp of the
# sequence and passes K/V round a ring, merging the partial softmaxes exactly with their
# log-sum-exp; a causal mask makes contiguous chunks uneven (the last rank does 2cp/(cp+1) x
# the mean), and the zigzag assignment evens them out. Ulysses trades the sequence pieces for
# whole sequences of H/n heads with an all-to-all, 4(n-1)/n of the local activations per rank
# and direction, when n divides the heads. The real APIs: torch's `SequenceParallel`,
# `ColwiseParallel(input_layouts=Shard(1))`, `RowwiseParallel(output_layouts=Shard(1))`,
# `torch.distributed.tensor.experimental.context_parallel` (GPU), Megatron-LM's
# `--sequence-parallel` and `--context-parallel-size`, DeepSpeed's `DistributedAttention`
# (deepspeed.sequence.layer, Ulysses).
#
# *Exercises:* (1) In your ring, where would the send of step s overlap the compute of step s on
# a GPU, and what must the buffers look like for it to? (2) Backward of ring attention: which
# tensors must travel round the ring, and in which direction do the dK/dV partials go? (3) With
# SP, fc1 here saved the gathered input: how much would saving the piece and gathering again in
# backward save per layer, and what does it cost? (4) A model with grouped-query attention has 8
# query heads and 2 K/V heads: what must Ulysses do on n = 4 ranks, and what does it cost in
# bytes? (5) Ulysses on n1 ranks inside ring attention on n2 (USP): what does each rank send?
