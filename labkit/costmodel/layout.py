"""One training step of a 4-D layout (dp x tp x pp x cp, ZeRO / FSDP over the data-parallel axis):
compute from FLOPs, the pipeline bubble, TP's and PP's communication on the critical path, the
data-parallel collectives hidden behind compute where they can be, per-rank memory with
activations, and the global batch. `layout_step` prices one layout; `search` (costmodel.search)
ranks them.

    step = layout_step(LLAMA3_405B, {"dp": 64, "tp": 8, "pp": 16}, H100_ROCE,
                       seq_len=8192, global_batch_tokens=16 * 2**20, micro_batch=1)

Conventions, each one a stated assumption:
- FLOPs per token (Narayanan et al. 2021, eq. 3, generalised to GQA and gated MLPs): 6 x the
  layers' matmul parameters + 12 L d s for attention (the full s x s, no causal halving) + 6 d V
  for the logits. Full recomputation repeats the layers' forward (4/3 of their FLOPs), never the
  logits. Time = FLOPs / (peak x matmul_efficiency): one efficiency for the whole step.
- The pipeline: every (chunk, micro-batch) slot costs the same; the step is (v m + p - 1) slots of
  one micro-batch's per-chunk work (compute + TP + PP sends), the bubble (p - 1) / (v m + p - 1).
  With fewer micro-batches than stages (m < p) an interleaved round cannot start its next chunk
  before its first micro-batch has come round all p stages: v p + m - 1 slots (v = 1: m + p - 1,
  the same formula), the bubble 1 - v m / (v p + m - 1). Zero-bubble schedules (layout["schedule"]
  "zb-h1", v = 1; "zbv", v = 2: the backward split into B, input gradients, and W, weight
  gradients, W deferred into the bubble) take their bubble and the first rank's held chunks from
  labkit.strategies.pp.schedule's replayed orders at F = B = W = 1 slot (Qi et al. 2024's
  assumption; zb-h1 at p = 4, m = 8: 1/9 against 1F1B's 3/11).
  The busiest stage holds ceil(L / (p v)) layers per chunk (Llama 3's 126 layers on 16 stages: 8)
  and, the last, the logits (a slot costs the last stage's work per chunk).
- What can run (layout_step refuses the rest, `refusal` says why): tp inside a node, dividing the
  heads, and tp and the key/value heads dividing one another. Above the K/V heads (2 K/V heads on
  tp 8) every rank holds one whole K/V head, a copy (vLLM's and TensorRT-LLM's replication;
  Megatron-core instead asserts num_query_groups % tp == 0): its parameters, their gradients,
  optimizer state and forward/backward FLOPs are the rank's as if tp = kv, max(1, kv / tp) heads,
  never a fraction of one. CP cuts each sequence into 2 cp equal chunks, rank r holding chunks r
  and 2 cp - 1 - r (Llama 3's load balancing, labkit.strategies.cp's "zigzag"): every CP rank does
  the same attention work, as priced here, so 2 cp must divide seq_len.
- Ranks are numbered tp fastest, then cp, dp, pp (Megatron-LM's order); a group whose stride
  reaches a node's g GPUs crosses nodes, and a ring across nodes is spread over the node's g
  NICs (links.collective_time on a TwoLevel whose node holds g / stride of the group's ranks).
- On the critical path: TP's all-reduces (2 in forward, 2 in backward, 2 more in a recomputed
  forward, per layer and micro-batch; with sequence parallelism the same bytes as all-gathers and
  reduce-scatters), PP's sends (each slot sends its activation forward and its gradient back,
  scatter-gathered over tp), CP's all-gather of K and V (forward, and their gradients' reduce-
  scatter in backward; Llama 3's all-gather CP).
- Gradient accumulation over the m micro-batches, layout["accumulate"] (what frameworks run):
  "hold" keeps the stage's unsharded gradients (reduce_dtype bytes per parameter: fp32 by default)
  until the last micro-batch and reduces them once per step; "reduce_each" reduce-scatters every
  micro-batch's gradients into the shard (m reduce-scatters per step) and keeps only the shard.
  ZeRO-0 (DDP's no_sync) and ZeRO-1 (Megatron-LM's distributed optimizer: one fp32 main-gradient
  buffer, reduce-scattered once) only hold. ZeRO-2 reduces each micro-batch by default (DeepSpeed's
  stage 2, whose pipeline engine refuses stages 2 and 3); ZeRO-2 holding is ZeRO-1 (the same bytes
  and memory, priced alike). FSDP holds under a pipeline (torch.distributed.pipelining's FSDP
  stages: set_requires_gradient_sync(False) until the last backward, FSDP2 accumulating the
  unsharded gradients in reduce_dtype; Llama 3, labkit's fsdp-tp-pp) and reduces each micro-batch
  without one (FSDP's default gradient sync, DeepSpeed's stage 3). At m = 1 the two are one.
- HSDP (layout["shard"] = s, fewer than the dp x cp ranks; default: all of them): the states are
  sharded over s consecutive data-parallel ranks (a node's, when s = g / tp) and replicated over
  the dp x cp / s groups; each reduction is a reduce-scatter over the s ranks and an all-reduce of
  the 1 / s shard over the replicas (torch's fully_shard on a 2-D mesh, labkit's "hsdp"), each
  gather an all-gather over the s ranks. ZeRO-1/2 take a shard group too (priced alike).
- Hidden where they can be: the gradients' all-reduce (DDP) or reduce-scatter (ZeRO, FSDP) behind
  the backward whose gradients it reduces: held gradients behind the last micro-batch's (earlier
  ones' are not final), each micro-batch's reduce-scatter ("reduce_each") behind that micro-
  batch's own backward, each paying its last layer's collective exposed; ZeRO-1/2's parameter
  all-gather behind the next step's first forward; FSDP's all-gathers layer by layer behind the
  previous layer's compute -- with reshard=True under PP every micro-batch gathers every unit
  again, in forward and in backward (2 m all-gathers per step; a backward that also reduce-scatters
  hides both in one window), which is why Megatron pairs PP with ZeRO-1 and Llama 3 with FSDP
  without reshard. One layer's collective never hides. Gradients travel in fp32 by default
  (Megatron-LM's and torchtitan's default), reduce_dtype "bf16" or "fp16" halves them (Megatron-LM
  2021 in fp16 without --accumulate-allreduce-grads-in-fp32).
- Memory: 2 B bf16 parameters, gradient bytes of reduce_dtype (fp32 main gradients: 4 B; fp16 ones
  are copied to fp32 before the step: 4 B), 12 B
  fp32 master + Adam moments, per parameter of the rank's tp x pp piece; ZeRO 1 / 2 / 3 shard the
  optimizer / + gradients / + parameters over dp x cp -- the gradients only where nothing holds
  them unsharded (ZeRO-2 and FSDP with "reduce_each", or m = 1). FSDP adds two unsharded layers (reshard)
  or the stage's whole unsharded parameters (no reshard). Activations (Korthikanti et al. 2022):
  per layer and micro-batch s b d (10 + 24 / t) bytes without sequence parallelism, 34 s b d / t
  with it, plus 5 a s^2 b / t without flash attention; full recomputation keeps each layer's input
  (2 s b d, / t with SP) and one layer's full set. The first stage holds min(p, m) micro-batches
  (1F1B), times 1 + (p - 1) / (p v) interleaved (Megatron-LM's estimate).
Left out: the embedding's and logits' memory, stragglers, NCCL's trees, contention between
compute and communication (the m reduce-scatters of "reduce_each" share the data-parallel links
with nothing else, as every collective here), "reduce_each"'s unsharded gradient buckets in flight
during a backward, torch.distributed.pipelining's later reduce-scatter of FSDP's held gradients
(its REDUCE_GRAD runs after the last backward; priced hidden behind it, as Megatron-LM's
overlap_grad_reduce hides ZeRO-1's), kernel-size effects on efficiency, the optimizer's all-gather of fp32,
the replicated K/V heads' gradient all-reduce among their copies (tp > kv heads). The activations'
formula counts K and V at every query head's width (no GQA saving), which already covers a
replicated K/V head: a rank's K is d max(kv, tp) / (tp heads) wide, at most the d / tp counted.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

from labkit.costmodel import _validate as check
from labkit.costmodel import links
from labkit.costmodel.memory import memory_per_rank

OPT_BYTES_PER_PARAM = 28  # Adam's step: fp32 master, m, v read + written, grad read, param written
KNOBS = ("overlap", "sequence_parallel", "flash_attention")
LAYOUT_KEYS = (
    "dp",
    "tp",
    "pp",
    "cp",
    "v",
    "zero",
    "shard",
    "reshard",
    "recompute",
    "reduce_dtype",
    "accumulate",
    "schedule",
)
# the pipeline's schedule: "1f1b" (interleaved when v > 1), or a zero-bubble one (its bubble and
# the activations it holds from the replayed orders of labkit.strategies.pp.schedule)
SCHEDULES = ("1f1b", "zb-h1", "zbv")
ACCUMULATE = ("reduce_each", "hold")  # gradient accumulation over the micro-batches (docstring)
RECOMPUTE = ("none", "full")  # or a fraction in (0, 1]: that share of each stage's layers fully recomputed
HBM_PASSES = 4  # each activation byte written in forward, read in backward, its gradient written and read
REDUCE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# a gradient's bytes in memory at the optimizer step: fp16 gradients (Megatron-LM 2021's loss-scaled
# path) are each copied into an fp32 main gradient before the step (Float16Optimizer's
# _copy_model_grads_to_main_grads), so the step holds 4 B; bf16 main-gradient buffers stay 2 B
GRAD_MEMORY_BYTES = {"fp32": 4, "bf16": 2, "fp16": 4}


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer by its shape: layers, hidden d, heads (kv_heads < heads: GQA), the
    MLP's width ffn (gated: three matrices, SwiGLU), the vocabulary."""

    name: str
    layers: int
    d: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int = 0  # 0: as many as heads
    gated: bool = False

    def __post_init__(self):
        for f in ("layers", "d", "heads", "ffn", "vocab"):
            check.count(f"Transformer.{f}", getattr(self, f))
        check.count("Transformer.kv_heads", self.kv_heads, minimum=0)
        if self.kv_heads and self.heads % self.kv_heads:  # GQA: each K/V head serves a whole group
            raise ValueError(
                f"Transformer.kv_heads ({self.kv_heads}) must divide Transformer.heads ({self.heads}): "
                "each key/value head serves a whole group of query heads (at most one per query head)"
            )

    @property
    def kv(self) -> int:
        """The key/value heads (kv_heads, or heads when 0)."""
        return self.kv_heads or self.heads

    @property
    def layer_params(self) -> float:
        """One layer's matmul parameters (biases and norms left out)."""
        attention = 2 * self.d * self.d + 2 * self.d * self.d * self.kv / self.heads
        return attention + (3 if self.gated else 2) * self.d * self.ffn

    def kv_replicated_params(self, tp: int) -> float:
        """One layer's K and V parameters each of tp ranks holds beyond a 1/tp share: 0 while
        tp <= kv heads; above, every rank holds one whole K/V head (a copy of its group's, as
        vLLM and TensorRT-LLM replicate them), max(1, kv / tp) heads, not kv / tp of one."""
        return 2 * self.d * self.d * (max(1, self.kv / tp) - self.kv / tp) / self.heads

    @property
    def params(self) -> float:
        """Layers plus the embedding (tied with the head when the model says so: not counted twice)."""
        return self.layers * self.layer_params + self.vocab * self.d

    def flops_per_token(self, seq_len: int, recompute: float = 0.0) -> float:
        """Training FLOPs per token: 6 x layer parameters + 12 L d s (attention) + 6 d V (logits);
        recomputing a share r of the layers adds their forward again (1 + r/3 of their part)."""
        layers = self.layers * (6 * self.layer_params + 12 * self.d * seq_len)
        return layers * (1 + recompute / 3) + 6 * self.d * self.vocab


@dataclass(frozen=True)
class Cluster:
    """GPUs (dense bf16 peak, HBM bytes and bandwidth), their links (NVLink in a node of g, one NIC
    per GPU across), and the fraction of peak the matmuls reach (calibrated: costmodel.published)."""

    name: str
    peak_flops: float
    memory_bytes: float
    hbm_Bps: float
    net: links.TwoLevel
    matmul_efficiency: float

    def __post_init__(self):
        for f in ("peak_flops", "memory_bytes", "hbm_Bps"):
            check.amount(f"Cluster.{f}", getattr(self, f))
        check.instance("Cluster.net", self.net, links.TwoLevel)
        check.fraction("Cluster.matmul_efficiency", self.matmul_efficiency)


def check_recompute(name: str, r: object) -> None:
    """A recompute setting is "none", "full" or a fraction in (0, 1] (normalise's and search's check)."""
    if r not in RECOMPUTE and (
        isinstance(r, (str, bool)) or not isinstance(r, (int, float)) or not 0 < r <= 1
    ):
        raise ValueError(f"{name} is one of {RECOMPUTE} or a fraction in (0, 1], got {r!r}")


def check_reduce_dtype(name: str, dtype: object) -> None:
    if not isinstance(dtype, str) or dtype not in REDUCE_BYTES:
        raise ValueError(f"{name} is one of {tuple(REDUCE_BYTES)}, got {dtype!r}")


def check_reshard(name: str, reshard: object) -> None:
    if not isinstance(reshard, bool):
        raise TypeError(f"{name} is True or False, got {reshard!r}")


def check_accumulate(name: str, accumulate: object) -> None:
    if not isinstance(accumulate, str) or accumulate not in ACCUMULATE:
        raise ValueError(f"{name} is one of {ACCUMULATE}, got {accumulate!r}")


def default_accumulate(zero: int, pp: int) -> str:
    """How a ZeRO stage accumulates gradients over micro-batches in the framework it stands for:
    ZeRO-0/1 hold them (DDP's no_sync; Megatron-LM's distributed optimizer), ZeRO-2 reduces each
    micro-batch (DeepSpeed's stage 2), FSDP holds under a pipeline (torch.distributed.pipelining,
    Llama 3, labkit's fsdp-tp-pp) and reduces each micro-batch without one (FSDP's default sync)."""
    if zero < 2:
        return "hold"
    if zero == 2:
        return "reduce_each"
    return "hold" if pp > 1 else "reduce_each"


# what layout_step refuses on the degrees alone, by kind (search counts its refusals by these)
REFUSALS = {
    "tp_node": "tp above a node's GPUs",
    "tp_heads": "tp not dividing the heads",
    "tp_kv": "tp and the key/value heads not dividing one another",
    "cp_seq": "seq_len not cut into 2 x cp equal chunks",
    "pp_layers": "pp x v above the layers",
}


def refusal(
    model: Transformer, cluster: Cluster, seq_len: int, tp: int = 1, cp: int = 1, pp: int = 1, v: int = 1
) -> tuple[str, str] | None:
    """Why layout_step refuses these degrees, as (kind, message) (kind: a key of REFUSALS), or None.

    tp stays inside a node and divides the heads; tp and the key/value heads divide one another
    (tp <= kv: kv / tp whole heads per rank; tp > kv: each head replicated on tp / kv ranks, every
    rank's query heads in one group -- a tp between, 4 ranks on 6 K/V heads, would cut a head);
    cp > 1 cuts each sequence into 2 cp equal chunks, rank r holding chunks r and 2 cp - 1 - r
    (Llama 3's load-balanced CP, labkit.strategies.cp's "zigzag": the model prices every CP rank
    the same attention work, which a causal mask gives only so), so 2 cp divides seq_len -- and
    no rank is left with less than one token; pp x v chunks hold a layer each at least."""
    g = cluster.net.gpus_per_node
    if tp > g:
        return "tp_node", f"tp ({tp}) must stay inside a node of {g} GPUs"
    if model.heads % tp:
        return "tp_heads", f"tp ({tp}) must divide the heads ({model.heads})"
    if model.kv % tp and tp % model.kv:
        return "tp_kv", (
            f"tp ({tp}) and the key/value heads ({model.kv}) must divide one another: each rank holds "
            f"whole K/V heads (kv / tp) or one head replicated on tp / kv ranks"
        )
    if cp > 1 and seq_len % (2 * cp):
        return "cp_seq", (
            f"cp ({cp}) must cut seq_len ({seq_len}) into 2 x cp = {2 * cp} equal chunks (load-balanced "
            f"CP: rank r holds chunks r and 2 cp - 1 - r); seq_len must be a multiple of {2 * cp}"
        )
    if pp * v > model.layers:
        return "pp_layers", f"pp x v ({pp * v}) is more chunks than layers ({model.layers})"
    return None


def normalise(layout: dict) -> dict:
    """The layout with its defaults filled in; unknown keys and impossible values raise."""
    if not isinstance(layout, dict):
        raise TypeError(f"layout is a dict of {LAYOUT_KEYS}, got {layout!r}")
    unknown = sorted(set(layout) - set(LAYOUT_KEYS))
    if unknown:
        raise ValueError(f"unknown layout keys {unknown}; a layout has {LAYOUT_KEYS}")
    out: dict = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "v": 1, "zero": 0, "reshard": True}
    out |= {"recompute": "none", "reduce_dtype": "fp32"} | layout
    for k in ("dp", "tp", "pp", "cp", "v"):
        check.count(f"layout[{k!r}]", out[k])
    out["zero"] = check.stage(out["zero"])
    check_recompute("layout['recompute']", out["recompute"])
    check_reduce_dtype("layout['reduce_dtype']", out["reduce_dtype"])
    check_reshard("layout['reshard']", out["reshard"])
    if out["v"] > 1 and out["pp"] == 1:
        raise ValueError("virtual stages (v > 1) need a pipeline (pp > 1)")
    group = out["dp"] * out["cp"]
    out.setdefault("shard", group)
    check.count("layout['shard']", out["shard"])
    if group % out["shard"]:
        raise ValueError(
            f"layout['shard'] ({out['shard']}) must divide the data-parallel group dp x cp ({group}): "
            f"each shard group holds the whole model, the rest of the group replicates it"
        )
    if out["zero"] == 0 and out["shard"] != group:
        raise ValueError(
            f"layout['shard'] ({out['shard']}) needs sharded states (zero 1, 2 or 3; zero 3 is HSDP): "
            f"DDP shards nothing"
        )
    out.setdefault("schedule", "1f1b")
    if out["schedule"] not in SCHEDULES:
        raise ValueError(f"layout['schedule'] is one of {SCHEDULES}, got {out['schedule']!r}")
    if out["schedule"] != "1f1b" and (out["pp"] == 1 or out["v"] != {"zb-h1": 1, "zbv": 2}[out["schedule"]]):
        raise ValueError(
            f"layout['schedule'] {out['schedule']!r} needs a pipeline (pp > 1) with v = "
            f"{ {'zb-h1': 1, 'zbv': 2}[out['schedule']] } (zb-h1: one chunk per rank; zbv: two, in a V), "
            f"got pp {out['pp']}, v {out['v']}"
        )
    out.setdefault("accumulate", default_accumulate(out["zero"], out["pp"]))
    check_accumulate("layout['accumulate']", out["accumulate"])
    if out["zero"] < 2 and out["accumulate"] != "hold":
        raise ValueError(
            f"layout['accumulate'] 'reduce_each' needs sharded gradients (zero 2 or 3), got zero "
            f"{out['zero']}: DDP and ZeRO-1 hold the unsharded gradients and reduce them once per step"
        )
    return out


@dataclass(frozen=True)
class Knobs:
    """layout_step's keywords beyond the layout (a misspelled one raises): overlap (data-parallel
    collectives hidden behind compute), sequence_parallel (with TP), flash_attention (no s x s
    scores stored)."""

    overlap: bool = True
    sequence_parallel: bool = True
    flash_attention: bool = True


def _knobs(knobs: dict) -> Knobs:
    unknown = sorted(set(knobs) - {f.name for f in fields(Knobs)})
    if unknown:
        raise TypeError(f"unknown knobs {unknown}; layout_step takes {KNOBS}")
    k = Knobs(**knobs)
    for f in fields(Knobs):
        if not isinstance(getattr(k, f.name), bool):
            raise TypeError(f"{f.name} is True or False, got {getattr(k, f.name)!r}")
    return k


def micro_batches(layout: dict, seq_len: int, global_batch_tokens: float, micro_batch: int) -> int:
    """m, the micro-batches each pipeline runs per step: the global batch is dp x micro_batch x
    seq_len x m tokens (cp splits each sequence, it does not add any). Raises when it does not divide."""
    seqs = global_batch_tokens / seq_len
    m = seqs / (layout["dp"] * micro_batch)
    if seqs != int(seqs) or m != int(m) or m < 1:
        raise ValueError(
            f"the global batch ({global_batch_tokens:g} tokens = {seqs:g} sequences of {seq_len}) is not "
            f"dp ({layout['dp']}) x micro_batch ({micro_batch}) x a whole number of micro-batches"
        )
    return int(m)


def recomputed(layout: dict) -> float:
    """The share of layers whose forward runs twice: "none" 0, "full" 1, or the fraction given."""
    r = layout["recompute"]
    return {"none": 0.0, "full": 1.0}[r] if isinstance(r, str) else float(r)


def layer_activation_bytes(
    model: Transformer, layout: dict, seq_len: int, micro_batch: int, k: Knobs
) -> float:
    """One layer's activations for one micro-batch on one rank, nothing recomputed (Korthikanti et al.)."""
    t, s, b, d = layout["tp"], seq_len / layout["cp"], micro_batch, model.d
    per_layer = s * b * d * (34 / t if k.sequence_parallel else 10 + 24 / t)
    if not k.flash_attention:
        per_layer += 5 * model.heads * s * seq_len * b / t
    return per_layer


def activation_bytes(
    model: Transformer, layout: dict, seq_len: int, micro_batch: int, m: int, k: Knobs
) -> float:
    """The first stage's activations at their peak (the docstring's formula): bytes."""
    t, p, v, r = layout["tp"], layout["pp"], layout["v"], recomputed(layout)
    full = layer_activation_bytes(model, layout, seq_len, micro_batch, k)
    stored = 2 * seq_len / layout["cp"] * micro_batch * model.d / (t if k.sequence_parallel else 1)
    per_layer = (1 - r) * full + r * stored
    if layout.get("schedule", "1f1b") != "1f1b":  # the replayed first rank's peak of held chunks
        held_chunks = zero_bubble(layout["schedule"], p, m, v)[1]
        return math.ceil(model.layers / (p * v)) * per_layer * held_chunks + (full if r > 0 else 0.0)
    layers = math.ceil(model.layers / (p * v)) * v
    in_flight = min(p, m) * (1 + (p - 1) / (p * v) if v > 1 else 1)
    return layers * per_layer * in_flight + (full if r > 0 else 0.0)


@functools.lru_cache(maxsize=4096)
def zero_bubble(schedule: str, p: int, m: int, v: int) -> tuple[float, int]:
    """(bubble, chunks held at the first rank's peak) of a zero-bubble schedule, from its orders
    replayed with F = B = W = 1 slot (Qi et al.'s equal-thirds assumption; a chunk slot of
    layout_step is F + B + W). Raises ValueError where the schedule cannot run (m < p)."""
    from labkit.strategies.pp import schedule as sched  # pure data, but its package imports torch

    orders = sched.orders(schedule, p, m, v)
    return sched.bubble_fraction(orders), sched.live_peak(orders[0])


def reduces_per_step(layout: dict, m: int) -> int:
    """The gradient reductions per step: m when ZeRO-2 or FSDP reduce each micro-batch
    (layout["accumulate"] "reduce_each"), else one (the held gradients, after the last)."""
    return m if layout["zero"] >= 2 and layout["accumulate"] == "reduce_each" else 1


def gathers_per_step(layout: dict, m: int) -> int:
    """The parameter all-gathers per step: 2 m when FSDP reshards (every micro-batch gathers each
    unit in forward and again in backward), else one (ZeRO-1/2 after the step, FSDP without
    reshard for all m)."""
    return 2 * m if layout["zero"] == 3 and layout["reshard"] else 1


def dp_bytes_per_step(layout: dict, piece: float, group: int, m: int) -> dict:
    """Bytes each rank sends per step in the data-parallel collectives over `group` ranks, for its
    `piece` parameters, m micro-batches (`layout` normalised): DDP all-reduces the gradients
    (2(k-1)/k); ZeRO-1/2 and FSDP reduce-scatter them and all-gather the bf16 parameters ((k-1)/k
    each) -- once per step, except FSDP with reshard, whose every micro-batch gathers in forward and
    again in backward, and ZeRO-2 / FSDP reducing each micro-batch: m reduce-scatters. Sharded over
    layout["shard"] = s < group ranks (HSDP), the reduce-scatter and all-gather run over the s ranks
    of a shard group and each reduced shard (1/s of the gradients) is all-reduced over the group / s
    replicas."""
    grads = REDUCE_BYTES[layout["reduce_dtype"]] * piece
    if layout["zero"] == 0:
        return {"all_reduce": 2 * (group - 1) / group * grads, "reduce_scatter": 0.0, "all_gather": 0.0}
    s = layout.get("shard", group)
    r = group // s
    gathers = gathers_per_step(layout, m)
    reduces = reduces_per_step(layout, m)
    return {
        "all_reduce": reduces * 2 * (r - 1) / r * grads / s,
        "reduce_scatter": reduces * (s - 1) / s * grads,
        "all_gather": gathers * (s - 1) / s * 2 * piece,
    }


def _ring(cluster: Cluster, stride: int) -> links.TwoLevel:
    """The links a group of ranks `stride` apart uses: g / stride of it share a node."""
    g = cluster.net.gpus_per_node
    return links.TwoLevel(cluster.net.intra, cluster.net.inter, max(1, g // stride))


def layout_step(model, layout, cluster, *, seq_len, global_batch_tokens, micro_batch, **knobs) -> dict:
    """One optimizer step of `model` in `layout` on `cluster` (see the module docstring).

    Returns step_s, tflops_per_gpu (model FLOPs: 6P + attention + logits), hw_tflops_per_gpu
    (with the recomputed forward: Megatron-LM's convention), mfu, memory_bytes (by category, with
    activations) and memory_total, fits, bubble, m, exposed_comm_s (by kind), compute_s, n_gpus,
    dp_bytes (what a rank sends in each data-parallel collective per step), inter_node_bytes (what
    it sends over its NIC, by axis) and dp_collectives (data-parallel collective calls per step)."""
    check.instance("model", model, Transformer)
    check.instance("cluster", cluster, Cluster)
    lay = normalise(layout)
    k = _knobs(knobs)
    check.count("seq_len", seq_len)
    check.amount("global_batch_tokens", global_batch_tokens)
    check.count("micro_batch", micro_batch)
    dp, t, p, c, v, zero = (lay[x] for x in ("dp", "tp", "pp", "cp", "v", "zero"))
    g = cluster.net.gpus_per_node
    refused = refusal(model, cluster, seq_len, tp=t, cp=c, pp=p, v=v)
    if refused:
        raise ValueError(refused[1])
    m = micro_batches(lay, seq_len, global_batch_tokens, micro_batch)
    n = dp * t * p * c
    recompute = recomputed(lay)
    rate = cluster.peak_flops * cluster.matmul_efficiency

    # compute of one micro-batch on the busiest stage, per chunk
    tokens_mb = micro_batch * seq_len / c  # this rank's tokens of one micro-batch
    layers_chunk = math.ceil(model.layers / (p * v))
    layer_flops = 6 * model.layer_params + 12 * model.d * seq_len
    replicated = model.kv_replicated_params(t)  # K/V parameters beyond 1/t per rank (tp > kv heads)
    rank_layer_flops = layer_flops + 6 * replicated * t  # a replicated head's projection on every rank
    chunk_flops = tokens_mb * layers_chunk * rank_layer_flops * (1 + recompute / 3) / t
    logits_flops = tokens_mb * 6 * model.d * model.vocab / t / v  # the last stage's, per chunk
    # memory-bound work (norms, activations, softmax, dropout): the layer's activation bytes moved
    # HBM_PASSES times over HBM, a recomputed forward once more
    traffic = layer_activation_bytes(model, lay, seq_len, micro_batch, k) * (HBM_PASSES + recompute)
    chunk_s = (chunk_flops + logits_flops) / rate + layers_chunk * traffic / cluster.hbm_Bps

    # critical-path communication of one (chunk, micro-batch) slot
    act = tokens_mb * model.d * 2  # one bf16 activation of the micro-batch
    tp_s = (4 + 2 * recompute) * layers_chunk * links.collective_time("all_reduce", t, act, cluster.net)
    pp_link = cluster.net.inter if t * c * dp >= g else cluster.net.intra
    pp_s = 2 * (pp_link.alpha_s + act / t / pp_link.busbw_Bps) if p > 1 else 0.0
    kv = 2 * act * max(model.kv, t) / model.heads / t  # K and V of this rank's heads (one at least)
    cp_s = (2 + recompute) * layers_chunk * links.collective_time("all_gather", c, kv * c, _ring(cluster, t))
    slot_s = chunk_s + tp_s + pp_s + cp_s
    if lay["schedule"] == "1f1b":
        slots = v * max(m, p) + min(m, p) - 1  # v m + p - 1, or v p + m - 1 when m < p (docstring)
    else:  # the replay's idle share of v m busy chunk slots
        slots = v * m / (1 - zero_bubble(lay["schedule"], p, m, v)[0])
    pipeline_s = slots * slot_s
    bubble = 1 - v * m / slots

    # data-parallel collectives over dp x cp ranks (stride tp), the rank's piece of the model
    piece = model.params / (t * p) + model.layers * replicated / p  # 1/(t p), and replicated K/V heads
    group, ring = dp * c, _ring(cluster, t)
    # HSDP (shard s < group): a shard group is s consecutive data-parallel ranks (stride t), its
    # replicas the group / s ranks s t apart
    s_group, replicas = lay["shard"], dp * c // lay["shard"]
    s_ring, r_ring = _ring(cluster, t), _ring(cluster, t * s_group)
    grad_bytes = REDUCE_BYTES[lay["reduce_dtype"]] * piece
    units = layers_chunk * v  # one collective per layer: the one that never hides
    backward_mb_s = v * chunk_s * (2 + recompute) / (3 + recompute)  # the last micro-batch's backward
    forward_mb_s = v * chunk_s / (3 + recompute)

    def hidden(comm_s: float, window_s: float) -> float:
        if not k.overlap:
            return comm_s
        return max(comm_s / units, comm_s - window_s)

    def per_unit(op: str, size: float, k: int = group, link: links.TwoLevel = ring) -> float:
        # one collective per layer: latency paid per layer
        return units * links.collective_time(op, k, size / units, link)

    exposed = {"grad_reduce": 0.0, "param_gather": 0.0}
    # the backwards that reduce-scatter gradients: the last (held gradients) or every one (docstring)
    reduces = reduces_per_step(lay, m)
    if zero == 0:
        exposed["grad_reduce"] = hidden(per_unit("all_reduce", grad_bytes), backward_mb_s)
    else:
        reduce = per_unit("reduce_scatter", grad_bytes, s_group, s_ring)
        reduce += per_unit("all_reduce", grad_bytes / s_group, replicas, r_ring)
        gather = per_unit("all_gather", 2 * piece, s_group, s_ring)
        if zero < 3 or not lay["reshard"]:  # gathered once: behind the (next step's) first forward
            exposed["grad_reduce"] = reduces * hidden(reduce, backward_mb_s)
            exposed["param_gather"] = hidden(gather, forward_mb_s)
        else:  # every micro-batch gathers every layer again, in forward and in backward; a backward
            # that also reduce-scatters (the last, or each) hides both in one window
            both = hidden(gather + reduce, backward_mb_s)
            grad_part = both * reduce / (gather + reduce) if gather + reduce else 0.0
            exposed["grad_reduce"] = reduces * grad_part
            exposed["param_gather"] = (
                m * hidden(gather, forward_mb_s)
                + (m - reduces) * hidden(gather, backward_mb_s)
                + reduces * (both - grad_part)
            )
    shard = s_group if zero >= 1 else 1
    dp_bytes = dp_bytes_per_step(lay, piece, group, m)
    optimizer_s = OPT_BYTES_PER_PARAM * piece / shard / cluster.hbm_Bps
    exposed_comm = {
        "tp": slots * tp_s,
        "pp": slots * pp_s,
        "cp": slots * cp_s,
        **exposed,
    }
    step_s = pipeline_s + exposed["grad_reduce"] + exposed["param_gather"] + optimizer_s

    # memory of a first-stage rank
    memory = memory_per_rank(
        piece,
        shard,
        zero,
        grad_bytes=GRAD_MEMORY_BYTES[lay["reduce_dtype"]],
        activations=activation_bytes(model, lay, seq_len, micro_batch, m, k),
    )
    if zero >= 2 and lay["accumulate"] == "hold" and m > 1:  # unsharded until the last micro-batch
        memory["gradients"] = GRAD_MEMORY_BYTES[lay["reduce_dtype"]] * piece
    if zero == 3:  # two unsharded layers (the one computed, the one prefetched), or the whole stage
        memory["unsharded"] = (
            2 * (2 * model.layer_params / t + 2 * replicated) if lay["reshard"] else 2 * piece
        )
    # what a rank sends over its NIC per step (the ties' first criterion, labs.pp_choice.verdict)
    across = {"dp": 0.0, "pp": 0.0, "cp": 0.0}
    gathers = gathers_per_step(lay, m)
    if zero == 0:
        across["dp"] = links.inter_node_bytes("all_reduce", group, grad_bytes, ring)
    else:
        across["dp"] = reduces * (
            links.inter_node_bytes("reduce_scatter", s_group, grad_bytes, s_ring)
            + links.inter_node_bytes("all_reduce", replicas, grad_bytes / s_group, r_ring)
        ) + gathers * links.inter_node_bytes("all_gather", s_group, 2 * piece, s_ring)
    if p > 1 and pp_link is cluster.net.inter:  # a middle stage: each slot's activation and gradient
        across["pp"] = 2 * v * m * act / t
    across["cp"] = (
        v
        * m
        * (2 + recompute)
        * layers_chunk
        * links.inter_node_bytes("all_gather", c, kv * c, _ring(cluster, t))
    )
    total_tokens = m * dp * micro_batch * seq_len
    model_flops = total_tokens * model.flops_per_token(seq_len)
    # the hardware's FLOPs also count the replicated K/V heads' projections (tp > kv heads)
    hw_replicated = total_tokens * model.layers * 6 * replicated * t * (1 + recompute / 3)
    hw_flops = total_tokens * model.flops_per_token(seq_len, recompute) + hw_replicated
    return {
        "model": model.name,
        "layout": lay,
        "n_gpus": n,
        "m": m,
        "step_s": step_s,
        "compute_s": v * m * chunk_s,
        "bubble": bubble,
        "bubble_s": (slots - v * m) * slot_s,
        "optimizer_s": optimizer_s,
        "exposed_comm_s": exposed_comm,
        "exposed_comm_total_s": sum(exposed_comm.values()),
        "tflops_per_gpu": model_flops / n / step_s / 1e12,
        "hw_tflops_per_gpu": hw_flops / n / step_s / 1e12,
        "mfu": model_flops / n / step_s / cluster.peak_flops,
        "memory_bytes": memory,
        "memory_total": sum(memory.values()),
        "fits": sum(memory.values()) <= cluster.memory_bytes,
        "tokens_per_step": total_tokens,
        "dp_bytes": dp_bytes,
        "inter_node_bytes": across,
        # data-parallel collective calls per step (per layer unit): DDP's all-reduce; a reduce-
        # scatter per reduction (and HSDP's all-reduce of its shard), an all-gather per gather
        "dp_collectives": 1 if zero == 0 else reduces * (1 + (replicas > 1)) + gathers,
    }
