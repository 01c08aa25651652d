"""Scale by simulation: an alpha-beta communication model plus a compute model.

Predicts step time, exposed communication and per-rank memory for DDP, ZeRO-1, ZeRO-2 and FSDP
(ZeRO-3) from a handful of numbers: link latency and bus bandwidth, peak FLOPs times an
efficiency, and the model's size. Units: seconds, bytes, FLOPs; "GB" always means 1e9 bytes.
The communication half (links, the ring's alpha-beta collective times, the fit of alpha and
beta to measurements) is labkit.costmodel.links; this module is the compute and memory half
and step_time, which combines them.

What the model leaves out (each one a reason it and a real cluster disagree):
- Rings only. NCCL switches to trees for small messages and large rank counts, so the ring's
  latency term 2(n-1)*alpha overstates small-message cost at 1,024 ranks.
- The hierarchical collective adds its NVLink and network phases; NCCL pipelines them, so the
  truth lies between their maximum and their sum (we take the sum: a pessimistic bound).
- Contention: compute and communication never slow each other down (on the course's 2-core
  machine they do, see `disagreements`). No stragglers, no congestion, no NIC-sharing.
- Compute is FLOPs / (peak * mfu): no kernel-size effects, no launch overhead; one mfu for the
  whole model. The optimizer step is memory-bound traffic at `hbm_Bps`.
- Layers are identical; one bucket per layer; no embedding or LM-head special case.
- Memory counts model states (ZeRO paper) plus a simple activation estimate; no allocator
  fragmentation, no temporary buffers beyond FSDP's two unsharded layers.

Published checks (tests/test_costmodel.py): the ZeRO paper's 7.5B / N_d = 64 table is reproduced
exactly (120, 31.4, 16.6, 1.9 GB). For the FSDP paper's GPT-175B on 128-512 A100s (173-186
TFLOPS) the model predicts ~186 hardware TFLOPS, flat in N, with communication hidden -- but the
level is the assumed A100 mfu (0.60) times peak, not a prediction, and the model misses the
paper's batch-1 vs batch-2 gap (it predicts <1%, since nothing but compute is on the
critical path).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.costmodel import _validate as check
from labkit.costmodel import links  # the communication half: Link, collective times, the fit

GB = 1e9  # the ZeRO paper's convention: 120 GB = 120e9 bytes


# --------------------------------------------------------------------------- models, hardware
@dataclass(frozen=True)
class Model:
    """A GPT-style decoder described by the numbers the cost model needs."""

    name: str
    params: float
    layers: int
    d_model: int
    seq_len: int

    def __post_init__(self):
        check.amount("Model.params", self.params)
        for field in ("layers", "d_model", "seq_len"):
            check.count(f"Model.{field}", getattr(self, field))

    def flops_per_token(self, include_attention=True):
        """Training FLOPs per token: 6P, plus 12*L*d*s for attention scores (PaLM's MFU
        convention: the full s x s matrix is counted, no causal halving)."""
        attention = 12 * self.layers * self.d_model * self.seq_len if include_attention else 0
        return 6 * self.params + attention


GPT2_124M = Model("GPT-2 124M", 124e6, 12, 768, 1024)
GPT_1_3B = Model("GPT 1.3B", 1.3e9, 24, 2048, 2048)
# Psi = 7.5e9 is the ZeRO paper's; the shape is illustrative (12*L*d^2 ~ 7.25e9).
GPT_7_5B = Model("GPT 7.5B (ZeRO)", 7.5e9, 64, 3072, 2048)
GPT_13B = Model("GPT 13B", 13e9, 40, 5120, 2048)
GPT_175B = Model("GPT 175B", 175e9, 96, 12288, 2048)
MODELS = {m.name: m for m in (GPT2_124M, GPT_1_3B, GPT_7_5B, GPT_13B, GPT_175B)}


@dataclass(frozen=True)
class Hardware:
    """One accelerator: dense peak, the fraction of it compute reaches (mfu), HBM, capacity."""

    name: str
    peak_flops: float
    mfu: float
    hbm_Bps: float = 2.0e12
    memory_bytes: float = 80e9

    def __post_init__(self):
        check.amount("Hardware.peak_flops", self.peak_flops)
        check.fraction("Hardware.mfu", self.mfu)
        check.amount("Hardware.hbm_Bps", self.hbm_Bps)
        check.amount("Hardware.memory_bytes", self.memory_bytes)

    @classmethod
    def from_measured_step(cls, name, flops_per_step, step_s, mem_Bps=4.7e9, memory_bytes=16e9):
        """Calibrate from a measured compute-only step (e.g. the course's CPU TinyGPT step):
        the measured rate becomes the peak and mfu = 1. mem_Bps: one-thread memcpy, 4.4-5 GiB/s as recorded on the course's 2-core
        CI machine (November 2026)."""
        check.amount("flops_per_step", flops_per_step)
        check.amount("step_s", step_s)
        return cls(name, flops_per_step / step_s, 1.0, mem_Bps, memory_bytes)


# Assumptions, stated: A100 bf16 dense 312 TFLOPS at 60% of peak (large GEMMs reach more, the
# rest of a transformer less); H100 SXM bf16 dense 989 TFLOPS at 45% (typical of public runs).
A100 = Hardware("A100 80GB", 312e12, 0.60, 2.0e12, 80e9)
H100 = Hardware("H100 SXM", 989e12, 0.45, 3.35e12, 80e9)

from labkit.costmodel.memory import memory_per_rank  # noqa: E402  (one definition: layout_step's too)

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}
# Adam step traffic per parameter: fp32 master, m, v read+written (24), grad read, param written.
OPT_BYTES_PER_PARAM = 28


# The ZeRO paper's table (Rajbhandari et al. 2020): GB per rank, Psi = 7.5B, N_d = 64, mixed precision.
ZERO_TABLE_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


def paper_table(params=7.5e9, n=64, precision="mixed"):
    """GB per rank by ZeRO stage 0-3 from memory_per_rank; the defaults reproduce ZERO_TABLE_GB."""
    return {s: round(sum(memory_per_rank(params, n, s, precision).values()) / GB, 1) for s in range(4)}


def activation_bytes(model, tokens_per_rank, checkpointing=False):
    """Korthikanti et al.'s 34*s*b*d bytes per layer (16-bit), without the 5*a*s^2*b score term
    (flash attention stores no score matrix). Checkpointing keeps each layer's input (2*s*b*d)
    plus one layer's full activations during its recompute."""
    check.instance("model", model, Model)
    check.amount("tokens_per_rank", tokens_per_rank)
    per_layer_full = 34 * tokens_per_rank * model.d_model
    if checkpointing:
        return model.layers * 2 * tokens_per_rank * model.d_model + per_layer_full
    return model.layers * per_layer_full


def _pipelined(comm_s, compute_s, layers, overlap):
    """Wall time of a phase where each layer's comm overlaps the neighbouring layer's compute.

    With c, p per layer: c + (L-1)*max(c, p) + p -- one layer's comm (the first all-gather or
    the last gradient bucket) can never hide. Without overlap: comm and compute add up."""
    if not overlap:
        return comm_s + compute_s
    c, p = comm_s / layers, compute_s / layers
    return c + (layers - 1) * max(c, p) + p


@dataclass(frozen=True)
class StepKnobs:
    """The settings of a step that step_time models, each a keyword of step_time (a misspelled one
    is a TypeError): overlap (comm hidden behind compute, per layer), reshard_after_forward (FSDP),
    activation_checkpointing, grad_bytes (per gradient element on the wire), zero_prefetch_params
    (ZeRO's all-gather overlapping the next forward)."""

    overlap: bool = True
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    grad_bytes: int = 2
    zero_prefetch_params: bool = False


def step_time(model, n, strategy, link, hw, global_batch_tokens=None, **knobs):
    """Predict one optimizer step of data-parallel training on n ranks; knobs: StepKnobs' fields.

    Per-rank communication (bf16 params, `grad_bytes` per gradient element):
      ddp          all_reduce(grads) bucketed per layer during backward          2 Psi
      zero1/zero2  reduce_scatter(grads) in backward + all_gather(params) after
                   the optimizer step (exposed, as in DeepSpeed's default; with
                   zero_prefetch_params=True it overlaps the next forward)       2 Psi
      fsdp         all_gather in forward, all_gather + reduce_scatter in backward 3 Psi
                   (2 Psi of it all-gathers unless reshard_after_forward=False)
    global_batch_tokens defaults to one sequence per rank. tflops_per_gpu counts model FLOPs
    (6P + attention); hw_tflops_per_gpu adds the recomputed forward under checkpointing.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check.instance("model", model, Model)
    check.count("n", n)
    check.instance("link", link, (links.Link, links.TwoLevel))
    check.instance("hw", hw, Hardware)
    if global_batch_tokens is not None:
        check.amount("global_batch_tokens", global_batch_tokens)
    k = StepKnobs(**knobs)
    check.count("grad_bytes", k.grad_bytes)
    overlap, reshard_after_forward, grad_bytes = k.overlap, k.reshard_after_forward, k.grad_bytes
    activation_checkpointing, zero_prefetch_params = k.activation_checkpointing, k.zero_prefetch_params
    tokens = (global_batch_tokens or n * model.seq_len) / n
    L, psi = model.layers, model.params
    param_size, grad_size = 2 * psi, grad_bytes * psi

    model_flops = tokens * model.flops_per_token()
    rate = hw.peak_flops * hw.mfu
    forward_s = model_flops / 3 / rate
    backward_s = 2 * model_flops / 3 / rate + (forward_s if activation_checkpointing else 0.0)
    compute_s = forward_s + backward_s

    def per_layer(op, size):  # L calls of size/L: the latency term is paid per bucket
        return L * links.collective_time(op, n, size / L, link)

    comm = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    forward_comm = backward_comm = after_step_comm = 0.0
    if strategy == "ddp":
        backward_comm = comm["all_reduce"] = per_layer("all_reduce", grad_size)
    elif strategy in ("zero1", "zero2"):
        backward_comm = comm["reduce_scatter"] = per_layer("reduce_scatter", grad_size)
        comm["all_gather"] = per_layer("all_gather", param_size)
        if zero_prefetch_params:  # counted in this step's forward: the steady state is the same
            forward_comm = comm["all_gather"]
        else:
            after_step_comm = comm["all_gather"]
    else:
        gather = per_layer("all_gather", param_size)
        comm["reduce_scatter"] = per_layer("reduce_scatter", grad_size)
        comm["all_gather"] = gather * (2 if reshard_after_forward else 1)
        forward_comm = gather
        backward_comm = comm["reduce_scatter"] + (gather if reshard_after_forward else 0.0)

    sharded_optimizer = STAGE[strategy] >= 1
    optimizer_s = OPT_BYTES_PER_PARAM * psi / (n if sharded_optimizer else 1) / hw.hbm_Bps
    step_s = (
        _pipelined(forward_comm, forward_s, L, overlap)
        + _pipelined(backward_comm, backward_s, L, overlap)
        + optimizer_s
        + after_step_comm
    )
    exposed = max(0.0, step_s - compute_s - optimizer_s)

    memory = memory_per_rank(
        psi, n, STAGE[strategy], activations=activation_bytes(model, tokens, activation_checkpointing)
    )
    if strategy == "fsdp":  # the layer being computed plus the one being prefetched, unsharded
        memory["all_gather"] = 2 * param_size / L
    hw_flops = model_flops * (4 / 3 if activation_checkpointing else 1.0)
    return {
        "model": model.name,
        "n": n,
        "strategy": strategy,
        "link": link.name,
        "hw": hw.name,
        "tokens_per_rank": tokens,
        "compute_s": compute_s,
        "optimizer_s": optimizer_s,
        "comm_s": comm,
        "comm_total_s": sum(comm.values()),
        "exposed_comm_s": exposed,
        "step_s": step_s,
        "tokens_per_s": tokens * n / step_s,
        "tflops_per_gpu": model_flops / step_s / 1e12,
        "hw_tflops_per_gpu": hw_flops / step_s / 1e12,
        "memory": memory,
        "memory_total": sum(memory.values()),
        "fits": sum(memory.values()) <= hw.memory_bytes,
    }


def sweep(models, ns, strategies, link, hw, **step_kwargs):
    """step_time for every (model, n, strategy): a list of row dicts, ready for a table or plot."""
    return [step_time(m, n, s, link, hw, **step_kwargs) for m in models for n in ns for s in strategies]


def with_mfu(hw, mfu):
    """The same hardware at another efficiency (for 'what if' questions); mfu in (0, 1]."""
    check.instance("hw", hw, Hardware)
    return replace(hw, mfu=check.fraction("mfu", mfu))


# the layout model (dp x tp x pp x cp with ZeRO / FSDP) and its search: one cost model for the labs
from labkit.costmodel.layout import Cluster, Transformer, layout_step  # noqa: E402, F401
from labkit.costmodel.layout_search import search  # noqa: E402, F401
