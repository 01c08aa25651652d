"""pp_lab's closing section, the choice between layouts: the references of the learner's
formulas (per-rank memory and bytes sent of DDP, FSDP, HSDP, ZeRO-1 x TP x PP and FSDP x TP; the
bubble; the data-parallel bytes of FSDP and ZeRO-1 under PP; the activations of a rank), each a
call into labkit's one cost model (labkit.costmodel: memory_per_rank, layout_step, search), the
selection table's verdicts from costmodel.search, and the small layouts measured on 8 ranks
(2 simulated nodes x 4): their cross-node bytes in the model's order (check_order), each rank's
counted FLOPs against the cost model's (rank_flops, check_flops; the CPU seconds shown, not
compared: check_overhead), and the 3-D layouts' recorded pipeline orders replayed to the model's
bubble (pipeline_logs, replayed_bubble, check_bubbles). The exercises' checks are
pp_choice_checks.py.

    c = Config(params=70e9, layers=80, d=8192, n=1024, tokens=4 * 2**20, tp=8, pp=4)
    memory_per_rank("FSDP", c), comm_per_rank("FSDP", c)   # bytes (exercise 5's references)
    choices()                                              # situation -> fastest, ties, verdict

Conventions of the formulas (exercise 5, the ZeRO paper's): model states only (2 B bf16
parameters, 2 B bf16 gradients, 12 B fp32 master weights and Adam's two moments per parameter);
bytes each rank SENDS per step on rings (all-reduce 2(k-1)/k of the tensor, all-gather and
reduce-scatter (k-1)/k of the whole), bf16 (2 B). TP stays inside a node (tp <= gpus_per_node);
HSDP shards inside the node (its group the node's g ranks) and all-reduces the shards across.
The table is layout_step's step times (compute, bubble, exposed communication priced per rail,
memory with activations, the global batch, how ZeRO-2 and FSDP accumulate gradients over m > 1
micro-batches, HSDP sharded over a node's data-parallel ranks: labkit/costmodel/layout.py says
what it leaves out), read with the model's error (published.error_band: its largest miss on the
published rows it did not calibrate on). choose() ties every family whose best layout is within
that error of the fastest and picks the verdict among them by TIE_BREAK (fewer parallel axes,
fewer bytes across nodes, fewer data-parallel collectives, more memory headroom); check_table
raises unless the ties and the verdict follow from the rows, check_pieces runs the learner's
exercise 6-8 functions on them. pp_lab's summary names each situation's fastest family and
verdict (SUMMARY, BEHIND); check_summary raises if the run no longer gives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit import costmodel
from labkit.costmodel import layout as cl
from labkit.costmodel.layout import Transformer
from labkit.costmodel import published
from labkit.costmodel.published import META_H100

LAYOUTS = ("DDP", "FSDP", "HSDP", "ZeRO-1 x TP x PP", "FSDP x TP")
WORD = 2  # bf16


@dataclass(frozen=True)
class Config:
    """A training configuration: the model (params, layers, d), the cluster (n ranks, g per
    node), the tokens of one step (the global batch) and the TP / PP degrees of the 3-D layouts."""

    params: float
    layers: int
    d: int
    n: int
    tokens: float
    tp: int = 1
    pp: int = 1
    g: int = 8

    def __post_init__(self):
        if self.n % (self.tp * self.pp) or self.tp > self.g or self.n % self.g:
            raise ValueError(f"{self}: n must be a multiple of g and of tp * pp, and tp <= g (TP in a node)")


def ring(k: int, kind: str) -> float:
    """The fraction of the whole tensor each of k ranks sends in a ring collective."""
    return (
        {"all_reduce": 2 * (k - 1) / k, "all_gather": (k - 1) / k, "reduce_scatter": (k - 1) / k}[kind]
        if k > 1
        else 0.0
    )


def memory_per_rank(layout: str, c: Config) -> float:
    """Bytes of model states per rank (the reference of the learner's formula): a call to the cost
    model's one memory formula (costmodel.memory_per_rank) on what each rank's group shards: DDP
    nothing (stage 0); FSDP the whole model over n (stage 3); HSDP over the node's g; FSDP x TP
    the TP piece P / tp over the n / tp replicas; ZeRO-1 x TP x PP the piece P / (tp pp), only
    its optimizer state over the dp = n / (tp pp) replicas (stage 1)."""
    P, n = c.params, c.n
    shards = {
        "DDP": (P, n, 0),
        "FSDP": (P, n, 3),
        "HSDP": (P, c.g, 3),
        "FSDP x TP": (P / c.tp, n // c.tp, 3),
        "ZeRO-1 x TP x PP": (P / (c.tp * c.pp), n // (c.tp * c.pp), 1),
    }
    if layout not in shards:
        raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")
    return sum(costmodel.memory_per_rank(*shards[layout]).values())


def comm_per_rank(layout: str, c: Config) -> dict[str, float]:
    """Bytes each rank sends per step, {"intra": within its node, "inter": across nodes} (the
    reference of the learner's formula; its total is intra + inter). On one node (n = g)
    everything is intra."""
    out = _comm(layout, c)
    if c.n == c.g:
        return {"intra": out["intra"] + out["inter"], "inter": 0.0}
    return out


def _comm(layout: str, c: Config) -> dict[str, float]:
    n, S = c.n, WORD * c.params
    if layout == "DDP":
        return {"intra": 0.0, "inter": ring(n, "all_reduce") * S}
    if layout == "FSDP":  # all-gather in forward, again in backward, reduce-scatter of the gradients
        return {"intra": 0.0, "inter": 3 * ring(n, "all_gather") * S}
    if layout == "HSDP":
        r = n // c.g
        return {"intra": 3 * ring(c.g, "all_gather") * S, "inter": ring(r, "all_reduce") * S / c.g}
    dp = n // (c.tp * c.pp) if layout == "ZeRO-1 x TP x PP" else n // c.tp
    tokens = c.tokens / dp  # one replica's tokens per step
    layers = c.layers // (c.pp if layout == "ZeRO-1 x TP x PP" else 1)
    tp_bytes = 4 * layers * ring(c.tp, "all_reduce") * tokens * c.d * WORD
    if layout == "FSDP x TP":
        return {"intra": tp_bytes, "inter": 3 * ring(dp, "all_gather") * S / c.tp}
    if layout == "ZeRO-1 x TP x PP":
        # ZeRO-1: reduce-scatter the gradients, all-gather the updated parameters over dp; PP: each
        # stage's output activations forward and its input's gradients back, once per token
        pp_bytes = 2 * tokens * c.d * WORD / c.tp if c.pp > 1 else 0.0
        dp_bytes = 2 * ring(dp, "all_gather") * S / (c.tp * c.pp)
        return {"intra": tp_bytes, "inter": dp_bytes + pp_bytes}
    raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")


# the lab's real configurations (8 GPUs per node, H100 80 GB, 400 Gb/s per GPU across nodes)
REAL = {
    "7B on 64 GPUs": Config(params=7e9, layers=32, d=4096, n=64, tokens=2**20, tp=2, pp=2),
    "70B on 1,024 GPUs": Config(params=70e9, layers=80, d=8192, n=1024, tokens=4 * 2**20, tp=8, pp=4),
}
# the selection table's four rows: the situation, and a configuration that is in it
TABLE = {
    "only the optimizer state is short (7B, one node)": Config(7e9, 32, 4096, 8, 2**19),
    "the model does not fit, a few nodes (30B, 2 nodes)": Config(30e9, 60, 6656, 16, 2**20, tp=8),
    "very large model across many nodes (70B, 128 nodes)": REAL["70B on 1,024 GPUs"],
    "medium model, post-training (13B, 8 nodes)": Config(13e9, 40, 5120, 64, 2**19, tp=4, pp=2),
}

# ---------------------------------------------------------------- the 8-rank measurement
SMALL_RUNS = {  # label -> (labkit strategy, options): 8 ranks, 2 simulated nodes x 4
    "DDP": ("ddp-bucketed", {"comm": "ring"}),
    "FSDP": ("fsdp", {}),
    "HSDP": ("hsdp", {}),
    # the 3-D layouts, dp 2 x pp 2 x tp 2: tp fastest, then pp, so dp is the axis across nodes;
    # m = 4 micro-batches of one row (1F1B), so the bubble (p-1)/(m+p-1) tells m from p
    "ZeRO-1 x TP x PP": ("zero1-tp-pp", {"comm": "ring", "pp": 2, "tp": 2, "n_microbatches": 4}),
    "FSDP x TP x PP": ("fsdp-tp-pp", {"comm": "ring", "pp": 2, "tp": 2, "n_microbatches": 4}),
    "FSDP x TP": ("fsdp-tp", {"tp": 4}),
}


def small_config(params: int) -> Config:
    """The 8-rank measurement's configuration for the formulas (tokens do not matter for the
    measured layouts' cross-node bytes: only TP's, which stays in the node)."""
    return Config(params=params, layers=2, d=64, n=8, tokens=64, tp=4, g=4)


THREE_D = {"ZeRO-1 x TP x PP": (2, 2), "FSDP x TP x PP": (2, 2)}  # label -> (tp, pp) of the 8-rank run
TP_SPLIT = ("attn.qkv.", "attn.proj.weight", "mlp.0.", "mlp.2.weight")  # TinyGPT's Megatron plan


def predicted_inter(layout: str, model, word: int = 4) -> float:
    """The busiest rank's bytes across nodes per step in the 8-rank run (fp32: word 4). The flat
    layouts by comm_per_rank; the 3-D ones (dp across the two nodes, pp and tp inside) by the
    data-parallel collectives of each rank's piece (dp_bytes: one reduce-scatter and one all-gather
    per step, ZeRO-1 and FSDP without reshard alike), the piece counted from the model: the
    tensor-parallel weights / tp, the replicated ones (norms, row-parallel biases, the embeddings on
    the first stage, the final norm on the last) whole. Left out: FSDP's padding of odd rows."""
    params = sum(p.numel() for p in model.parameters())
    if layout not in THREE_D:
        return comm_per_rank(layout, small_config(params))["inter"] * word / WORD
    tp, pp = THREE_D[layout]
    blocks = len(model.blocks)
    pieces = [0.0] * pp
    for name, p in model.named_parameters():
        stage = (
            int(name.split(".")[1]) * pp // blocks
            if name.startswith("blocks.")
            else (0 if "emb" in name else pp - 1)
        )
        pieces[stage] += p.numel() / (tp if any(k in name for k in TP_SPLIT) else 1)
    out = dp_bytes(1, True, max(pieces), 2, 1)  # fp32 gradients (4 B), bf16 parameters (2 B) ...
    return (out["reduce_scatter"] / 4 + out["all_gather"] / 2) * word  # ... here both `word` B


def total_comm(layout: str, c: Config) -> float:
    """Bytes each rank sends per step, in the node and across (the learner's formula's reference)."""
    return sum(comm_per_rank(layout, c).values())


def check_order(
    predicted: dict[str, float], measured_bytes: dict[str, float], link_cost: dict[str, float]
) -> None:
    """Raise unless the measured cross-node bytes put every pair of layouts the model tells apart
    (predicted bytes more than 5% apart) in the model's order, and the slow link's cost of them
    every pair more than 25% apart (the link also charges each message's latency, which the byte
    model leaves out: HSDP's many small messages cost more than the 3-D layouts' few). A pair the
    model ties is not ordered (its measured bytes may differ by padding)."""
    for what, values, tol in (
        ("cross-node bytes", measured_bytes, 0.05),
        ("the link's cost", link_cost, 0.25),
    ):
        for a in predicted:
            for b in predicted:
                if predicted[a] < predicted[b] * (1 - tol) and not values[a] < values[b]:
                    raise AssertionError(
                        f"measured {what}: {a} {values[a]:.4g} >= {b} {values[b]:.4g}, but the cost model puts "
                        f"{a} first ({predicted[a]:.4g} < {predicted[b]:.4g} B)"
                    )


# ---------------------------------------------------------------- the 8-rank run: compute and bubble
SMALL_DEGREES = {  # label -> (dp, tp, pp) of the 8-rank run (SMALL_RUNS)
    "DDP": (8, 1, 1),
    "FSDP": (8, 1, 1),
    "HSDP": (8, 1, 1),
    "ZeRO-1 x TP x PP": (2, 2, 2),
    "FSDP x TP x PP": (2, 2, 2),
    "FSDP x TP": (2, 4, 1),
}


def transformer_of(model: Any) -> Transformer:
    """The cost model's Transformer of a TinyGPT (its blocks, width, heads, MLP width, vocabulary)."""
    return Transformer(
        "TinyGPT",
        layers=len(model.blocks),
        d=model.tok_emb.embedding_dim,
        heads=model.blocks[0].attn.n_heads,
        ffn=model.blocks[0].mlp[0].out_features,
        vocab=model.lm_head.out_features,
    )


def rank_flops(layout: str, model: Transformer, rows: int, seq_len: int, stage: int = 0) -> float:
    """The FLOPs one rank computes in a step of the 8-rank run (pipeline stage `stage`), by the cost
    model's count (layout_step's: 6 x the layer's matmul parameters + 12 d s of attention per token
    and layer, 6 d V for the logits): the replica's tokens (rows / dp sequences of seq_len), the
    stage's L / pp layers, their matmuls and heads split over tp, and the LM head whole on the last
    stage: labkit's TinyGPT plan replicates it over tp (no vocabulary-parallel head, which
    layout_step assumes). Left out, as by layout_step: biases, norms, softmax, the optimizer."""
    dp, tp, pp = SMALL_DEGREES[layout]
    if not 0 <= stage < pp:
        raise ValueError(f"{layout}: stage {stage} of {pp}")
    tokens = rows // dp * seq_len
    layer = 6 * model.layer_params + 12 * model.d * seq_len
    head = 6 * model.d * model.vocab if stage == pp - 1 else 0.0
    return tokens * (model.layers // pp * layer / tp + head)


def run_compute(results: Any, labels: Any = None) -> dict[str, dict[str, list]]:
    """From hsdp_lab.train_windows(..., count_flops=True)'s results: per label, per rank, "flops"
    (counted with torch's FLOP formulas in the first step: hsdp_lab._flop_counter), "stage" (its pipeline stage, 0 without
    a pipeline) and "cpu_s" (its process's CPU seconds in the timed step: the least over them)."""
    out: dict[str, dict[str, list]] = {}
    for label in labels or results[0]:
        rows = [r[label] for r in results]
        out[label] = {
            "flops": [float(r["flops"]) for r in rows],
            "stage": [r["pipeline"]["stage"] if "pipeline" in r else 0 for r in rows],
            "cpu_s": [min(t for round_ in r["round_cpu_s"] for t in round_) for r in rows],
        }
    return out


def check_flops(measured: dict[str, dict[str, list]], model: Transformer, rows: int, seq_len: int,
                rel: float = 1e-6) -> dict[str, float]:  # fmt: skip
    """Raise unless every rank's counted FLOPs (run_compute's) equal rank_flops for its layout and
    stage within `rel` (the counter and the formula count the same matmuls: measured equal to the
    FLOP on this model). Returns per label the busiest rank's FLOPs over DDP's, the model's."""
    for label, m in measured.items():
        for rank, (got, stage) in enumerate(zip(m["flops"], m["stage"])):
            want = rank_flops(label, model, rows, seq_len, stage)
            if abs(got - want) > rel * want:
                raise AssertionError(
                    f"{label}, rank {rank} (pipeline stage {stage}): counted {got:.6g} FLOPs in a step, "
                    f"the cost model's count is {want:.6g}"
                )
    ddp = rank_flops("DDP", model, rows, seq_len)
    return {
        label: max(rank_flops(label, model, rows, seq_len, s) for s in range(SMALL_DEGREES[label][2])) / ddp
        for label in measured
    }


def pipeline_logs(results: Any, label: str) -> dict[tuple[int, ...], list[list[tuple[str, int, int]]]]:
    """The recorded orders of `label`'s pipelines (hsdp_lab.pipeline_order, every rank's): per
    pipeline (its global ranks), each stage's [(kind, micro-batch, chunk)] in the order it ran,
    stage 0 first (pp_lab.replay's slot format). Raises if a pipeline misses a stage or its
    ranks disagree on its members."""
    out: dict[tuple[int, ...], dict[int, list]] = {}
    for rank, r in enumerate(results):
        rec = r[label]["pipeline"]
        ranks = tuple(rec["ranks"])
        if ranks[rec["stage"]] != rank:
            raise AssertionError(f"{label}: rank {rank} recorded itself as stage {rec['stage']} of {ranks}")
        out.setdefault(ranks, {})[rec["stage"]] = [(k, mb, c) for k, c, mb in rec["actions"]]
    for ranks, stages in out.items():
        if sorted(stages) != list(range(len(ranks))):
            raise AssertionError(f"{label}: pipeline {ranks} recorded stages {sorted(stages)} only")
    return {ranks: [stages[i] for i in range(len(ranks))] for ranks, stages in out.items()}


def replayed_bubble(logs: list[list[tuple[str, int, int]]], backward: float = 2.0) -> float:
    """The bubble of one pipeline's recorded orders: replayed (labkit.strategies.pp.schedule's
    timeline: a slot starts when its rank is free and its input exists) with a forward of 1 and a
    backward of `backward` (2: its two matmuls per forward one), the idle share of the ranks'
    time up to the last slot. No clock in it: the same under any load."""
    from labkit.strategies.pp import schedule as sched

    orders = [[sched.Action(kind, chunk, mb) for kind, mb, chunk in log] for log in logs]
    return sched.bubble_fraction(orders, backward_slots=backward)


def check_bubbles(replayed: dict[str, dict[tuple[int, ...], float]], predicted: dict[str, float],
                  tol: float = 1e-9) -> None:  # fmt: skip
    """Raise unless every pipeline's replayed bubble (per label, per pipeline's ranks) equals the
    model's (p-1)/(v m+p-1) for that label (`predicted`, costmodel.layout_step's via bubble())."""
    for label, per_pipe in replayed.items():
        for ranks, got in per_pipe.items():
            if abs(got - predicted[label]) > tol:
                raise AssertionError(
                    f"{label}: pipeline {ranks}'s recorded order replays to a bubble of {got:.4f}, the cost "
                    f"model's (p-1)/(v m+p-1) is {predicted[label]:.4f}"
                )


def matmul_rate(n: int = 256, reps: int = 20) -> float:
    """FLOP per CPU second of this process's matmuls on one thread (n x n by n x n, `reps` times):
    what the run's FLOPs would cost a core if the step were only its matmuls."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        start = time.process_time()
        for _ in range(reps):
            a @ b
        return 2 * n**3 * reps / max(time.process_time() - start, 1e-9)
    finally:
        torch.set_num_threads(threads)


def check_overhead(measured: dict[str, dict[str, list]], rate: float, most: float = 0.5) -> dict[str, float]:
    """Per label the share of its busiest rank's step CPU time that its FLOPs explain at `rate`
    (matmul_rate's); raise if it is more than `most` for a label: the lab then says its CPU times
    are not compared with the FLOP model, which holds only while they are mostly overhead."""
    out = {}
    for label, m in measured.items():
        r = max(range(len(m["cpu_s"])), key=m["cpu_s"].__getitem__)
        out[label] = m["flops"][r] / rate / m["cpu_s"][r]
        if out[label] > most:
            raise AssertionError(
                f"{label}: its FLOPs explain {out[label]:.0%} of its busiest rank's CPU time: compute is no "
                f"longer negligible, compare the CPU times with the FLOP model instead"
            )
    return out


# ---------------------------------------------------------------- 6-8: the step model's pieces
def bubble(p: int, v: int, m: int) -> float:
    """The pipeline's idle share of a step, (p - 1) / (v m + p - 1): layout_step's, on a toy model."""
    row = costmodel.layout_step(
        TOY, {"pp": p, "v": v}, META_H100, seq_len=256, global_batch_tokens=256 * m, micro_batch=1
    )
    return row["bubble"]


def dp_bytes(zero: int, reshard: bool, piece: float, k: int, m: int) -> dict[str, float]:
    """Bytes each rank sends per step in the data-parallel collectives over k ranks for its piece
    of `piece` parameters with m micro-batches (fp32 gradients, bf16 parameters) under a pipeline,
    where every layout holds its gradients to the last micro-batch (DDP, ZeRO-1, and FSDP as
    torch.distributed.pipelining drives it: one reduction per step): layout_step's."""
    layout = cl.normalise({"dp": k, "zero": zero, "reshard": reshard, "accumulate": "hold"})
    return cl.dp_bytes_per_step(layout, piece, k, m)


def activations(model: Transformer, layout: dict, seq_len: int, micro_batch: int, m: int) -> float:
    """The first pipeline stage's activation bytes per rank at their peak (sequence parallelism,
    flash attention): layout_step's."""
    return cl.activation_bytes(model, cl.normalise(layout), seq_len, micro_batch, m, cl.Knobs())


TOY = Transformer("toy", 128, 512, 8, 2048, 1000)

# ---------------------------------------------------------------- the selection table, by search
# Llama-shaped models (gated MLPs; the 70B with 8 key/value heads), vocabulary 32,000
MODELS = {
    "7B": Transformer("7B", 32, 4096, 32, 11008, 32000, gated=True),
    "13B": Transformer("13B", 40, 5120, 40, 13824, 32000, gated=True),
    "30B": Transformer("30B", 60, 6656, 52, 17920, 32000, gated=True),
    "70B": Transformer("70B", 80, 8192, 64, 28672, 32000, kv_heads=8, gated=True),
}
SEQ = 4096
# situation -> (model, GPUs, tokens per step); H100 80 GB, 8 per node, 400 Gb/s per GPU across
SITUATIONS = {
    "only the optimizer state is short (7B, one node)": ("7B", 8, 2**19),
    "the model does not fit, a few nodes (30B, 2 nodes)": ("30B", 16, 2**20),
    "very large model across many nodes (70B, 256 nodes)": ("70B", 2048, 4 * 2**20),
    "medium model, post-training (13B, 8 nodes)": ("13B", 64, 2**19),
}


def family(layout: dict) -> str:
    """The name of a searched layout: its data-parallel sharding (none when dp x cp is 1; HSDP:
    FSDP sharded over fewer ranks than the group), then TP, PP and CP if used."""
    group = layout["dp"] * layout.get("cp", 1)
    hsdp = layout["zero"] == 3 and layout.get("shard", group) < group
    dp = "HSDP" if hsdp else {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}[layout["zero"]]
    axes = [x.upper() for x in ("tp", "pp", "cp") if layout.get(x, 1) > 1]
    return " x ".join(([dp] if group > 1 or not axes else []) + axes)


def search(situation: str, space: dict | None = None, top: int | None = None) -> list[dict]:
    """costmodel.search on the situation's model, GPUs and batch (no CP: sequences of 4,096)."""
    name, n, tokens = SITUATIONS[situation]
    space = {"cp": (1,), **(space or {})}
    return costmodel.search(
        MODELS[name], n, META_H100, seq_len=SEQ, global_batch_tokens=tokens, space=space, top=top
    )


def family_best(rows: list[dict]) -> dict[str, dict]:
    """Each family's fastest row among search's `rows` (fastest first), in that order."""
    best: dict[str, dict] = {}
    for row in rows:
        best.setdefault(family(row["layout"]), row)
    return best


# Within the model's error the step times do not order two layouts; what breaks the tie, in order:
TIE_BREAK = (
    "fewer parallel axes",  # tp, pp, cp and HSDP's replicas: each a process group, a code path, collectives
    "fewer bytes across nodes",  # the slow link, where the model leaves out contention and stragglers
    "fewer data-parallel collectives per step",
    "more memory headroom",  # what the allocator, NCCL's buffers and the logits need (priced nowhere)
)


def parallel_axes(layout: dict) -> int:
    """The layout's axes beyond plain data parallelism: tp, pp, cp > 1, and HSDP's replica axis."""
    group = layout["dp"] * layout.get("cp", 1)
    return sum(layout.get(x, 1) > 1 for x in ("tp", "pp", "cp")) + (layout.get("shard", group) < group)


def tie_key(row: dict) -> tuple:
    """TIE_BREAK's criteria of a layout_step row, smaller first."""
    return (parallel_axes(row["layout"]), sum(row["inter_node_bytes"].values()), row["dp_collectives"],
            row["memory_total"])  # fmt: skip


def choose(rows: list[dict], band: float) -> dict:
    """The verdict among search's `rows` (fastest first) with the model's error `band`: the families
    whose best step is within the band of the fastest are a tie; the verdict is the tied family
    best that TIE_BREAK prefers. Returns {"fastest", "verdict", "tied" (family -> row, fastest
    first), "best" (every family's best), "band", "broken_by" (the criterion that set the verdict
    apart from the next tied row, or "no tie"), "rows"}."""
    best = family_best(rows)
    fastest = rows[0]
    tied = {f: r for f, r in best.items() if r["step_s"] <= fastest["step_s"] * (1 + band)}
    ranked = sorted(tied.values(), key=tie_key)
    verdict, broken_by = ranked[0], "no tie"
    if len(ranked) > 1:
        a, b = tie_key(ranked[0]), tie_key(ranked[1])
        broken_by = next((c for c, x, y in zip(TIE_BREAK, a, b) if x != y), "the step time")
    return {"fastest": fastest, "verdict": verdict, "tied": tied, "best": best, "band": band,
            "broken_by": broken_by, "rows": rows}  # fmt: skip


def choices() -> dict[str, dict]:
    """situation -> choose() over search's every fitting layout, with the published rows' error band."""
    band = published.error_band()
    return {s: choose(search(s), band) for s in SITUATIONS}


def verdicts() -> dict[str, dict]:
    """situation -> the verdict's row (choices())."""
    return {s: c["verdict"] for s, c in choices().items()}


# what pp_lab's summary says of each situation: the fastest layout's family, the verdict's, and
# what broke the tie between them (TIE_BREAK's criterion, or "no tie")
SUMMARY = {
    "only the optimizer state is short (7B, one node)": ("ZeRO-1", "ZeRO-1", "more memory headroom"),
    "the model does not fit, a few nodes (30B, 2 nodes)": ("ZeRO-2 x TP x PP", "FSDP", "fewer parallel axes"),
    "very large model across many nodes (70B, 256 nodes)": (
        "ZeRO-2 x TP x PP",
        "ZeRO-2 x TP",
        "more memory headroom",
    ),
    "medium model, post-training (13B, 8 nodes)": ("FSDP", "FSDP", "fewer bytes across nodes"),
}
# what the summary says of single families: situation -> {family: per cent behind the fastest}
BEHIND = {
    "the model does not fit, a few nodes (30B, 2 nodes)": {"FSDP": 8},
    "very large model across many nodes (70B, 256 nodes)": {
        "ZeRO-2 x TP": 3,
        "FSDP x TP": 3,
        "ZeRO-1 x TP x PP": 9,
    },
}
ACCUMULATING = "very large model across many nodes (70B, 256 nodes)"  # its fastest layout accumulates (m = 2)


ACCUMULATION = {  # label -> what accumulation() sets on a layout
    "ZeRO-1": {"zero": 1, "accumulate": "hold"},
    "ZeRO-2, reduce each": {"zero": 2, "accumulate": "reduce_each"},
    "ZeRO-2, hold": {"zero": 2, "accumulate": "hold"},
}


def accumulation(situation: str, row: dict) -> dict[str, dict]:
    """The layout of `row` (a search row of the situation) priced with each of ACCUMULATION's ways
    ({label: layout_step's row}): ZeRO-1 (the unsharded fp32 gradients held, one reduce-scatter per
    step), ZeRO-2 reducing each micro-batch (m reduce-scatters, sharded gradients), ZeRO-2 holding
    (ZeRO-1's price by another name): what sharding the gradients costs over m micro-batches."""
    name, _, tokens = SITUATIONS[situation]
    return {
        label: costmodel.layout_step(MODELS[name], {**row["layout"], **way}, META_H100, seq_len=SEQ,
                                     global_batch_tokens=tokens, micro_batch=row["micro_batch"])
        for label, way in ACCUMULATION.items()
    }  # fmt: skip


def check_summary(choices: dict[str, dict]) -> None:
    """Raise unless the run gives what pp_lab's summary says (SUMMARY): each situation's fastest
    family, its verdict's family and what broke the tie; the verdict a tie with the fastest (or the
    fastest itself); ACCUMULATING's fastest layout reducing each of its m > 1 micro-batches and
    paying for it in time (slower than ZeRO-1's one reduce-scatter), because holding them (ZeRO-1)
    does not fit."""
    for situation, (fastest, verdict, broken_by) in SUMMARY.items():
        c = choices[situation]
        got = (family(c["fastest"]["layout"]), family(c["verdict"]["layout"]), c["broken_by"])
        if got != (fastest, verdict, broken_by):
            raise AssertionError(f"{situation}: the summary says fastest {fastest}, verdict {verdict} ({broken_by}); "
                                 f"the run gives fastest {got[0]}, verdict {got[1]} ({got[2]})")  # fmt: skip
    for situation, behind in BEHIND.items():
        c = choices[situation]
        for fam, pct in behind.items():
            got = round(100 * (c["best"][fam]["step_s"] / c["fastest"]["step_s"] - 1))
            if got != pct or fam not in c["tied"]:
                raise AssertionError(f"{situation}: the summary says {fam} is a tie {pct} % behind the fastest; "
                                     f"the run gives {got} % ({'tied' if fam in c['tied'] else 'not tied'})")  # fmt: skip
    seven = choices["only the optimizer state is short (7B, one node)"]
    untied = {f for f in seven["best"] if f not in seven["tied"]}
    if any(seven["best"][f]["layout"]["dp"] > 1 for f in untied) or seven["verdict"]["dp_collectives"] != 2:
        raise AssertionError(f"7B: the summary says every family with data parallelism ties (not tied: "
                             f"{sorted(untied)}) and the verdict runs 2 collectives per step")  # fmt: skip
    row = choices[ACCUMULATING]["fastest"]
    rows = accumulation(ACCUMULATING, row)
    zero1, each = rows["ZeRO-1"], rows["ZeRO-2, reduce each"]
    if row["m"] < 2 or row["layout"]["accumulate"] != "reduce_each":
        raise AssertionError(f"{ACCUMULATING}: the summary says its fastest layout reduces each of m > 1 "
                             f"micro-batches; it runs m = {row['m']}, {row['layout']['accumulate']}")  # fmt: skip
    if zero1["fits"] or not each["fits"] or not each["step_s"] > zero1["step_s"]:
        raise AssertionError(
            f"{ACCUMULATING}: the summary says holding the gradients (ZeRO-1: {zero1['memory_total'] / 1e9:.0f} GB) "
            f"does not fit and reducing each micro-batch ({each['step_s']:.3f} s) is slower than ZeRO-1's "
            f"{zero1['step_s']:.3f} s"
        )


def check_table(choices: dict[str, dict]) -> None:
    """Raise unless each situation's choice is what its rule says: the fastest and the verdict
    fit and are layout_step's (recomputed), the tied families are exactly those whose best is
    within the band of the fastest, and no tied family's best is ahead of the verdict on TIE_BREAK."""
    for situation, c in choices.items():
        name, n, tokens = SITUATIONS[situation]
        for what in ("fastest", "verdict"):
            row = c[what]
            again = costmodel.layout_step(MODELS[name], row["layout"], META_H100, seq_len=SEQ,
                                          global_batch_tokens=tokens, micro_batch=row["micro_batch"])  # fmt: skip
            if not again["fits"] or abs(again["step_s"] - row["step_s"]) > 1e-9 * row["step_s"]:
                raise AssertionError(
                    f"{situation}: the {what} {row['layout']} does not fit or is not layout_step's step"
                )
        limit = c["fastest"]["step_s"] * (1 + c["band"])
        if any(r["step_s"] < c["fastest"]["step_s"] for r in c["best"].values()):
            raise AssertionError(f"{situation}: a family's best is faster than the fastest")
        tied = {f for f, r in c["best"].items() if r["step_s"] <= limit}
        if tied != set(c["tied"]):
            raise AssertionError(f"{situation}: within {c['band']:.1%} of the fastest are {sorted(tied)}, "
                                 f"the table ties {sorted(c['tied'])}")  # fmt: skip
        ahead = [f for f, r in c["tied"].items() if tie_key(r) < tie_key(c["verdict"])]
        if ahead or c["verdict"]["step_s"] > limit:
            raise AssertionError(f"{situation}: the verdict {family(c['verdict']['layout'])} is not the tie's "
                                 f"first by {TIE_BREAK} (ahead of it: {ahead})")  # fmt: skip


def check_pieces(choices: dict[str, dict], my_bubble: Any, my_dp_bytes: Any, my_activations: Any) -> int:
    """Raise unless the learner's exercise 6-8 functions give what layout_step priced for each
    situation's fastest layout and verdict, wherever the exercise's case holds: the bubble (m >= p,
    or v = 1), the activations (recompute "none" or "full", L divisible by p v) and the data-parallel
    bytes (gradients held to the last micro-batch or m = 1, sharded over the whole group, not
    ZeRO-2: exercise 7's layouts). Returns how many values were compared."""
    compared = 0
    for situation, c in choices.items():
        model = MODELS[SITUATIONS[situation][0]]
        for row in (c["fastest"], c["verdict"]):
            lay, m = row["layout"], row["m"]
            group, p, v = lay["dp"] * lay["cp"], lay["pp"], lay["v"]
            got, want = {}, {}
            if m >= p or v == 1:
                got["bubble"], want["bubble"] = my_bubble(p, v, m), row["bubble"]
            if lay["recompute"] in ("none", "full") and model.layers % (p * v) == 0:
                got["activations"] = my_activations(model, lay, SEQ, row["micro_batch"], m)
                want["activations"] = row["memory_bytes"]["activations"]
            if (lay["accumulate"] == "hold" or m == 1) and lay["shard"] == group and lay["zero"] != 2:
                piece = (
                    model.params / (lay["tp"] * p) + model.layers * model.kv_replicated_params(lay["tp"]) / p
                )
                got["dp_bytes"] = sum(my_dp_bytes(lay["zero"], lay["reshard"], piece, group, m).values())
                want["dp_bytes"] = sum(row["dp_bytes"].values())
            for k, w in want.items():
                if not (isinstance(got[k], (int, float)) and abs(got[k] - w) <= 1e-6 * max(abs(w), 1e-12)):
                    raise AssertionError(
                        f"{situation}, {family(lay)}: your {k} gives {got[k]!r}, layout_step {w!r}"
                    )
                compared += 1
    return compared


SHARDING_COLORS = {"DDP": "#4c72b0", "ZeRO-1": "#55a868", "ZeRO-2": "#8172b2", "FSDP": "#c44e52",
                   "HSDP": "#dd8452", "": "#777777"}  # fmt: skip
AXES_MARKERS = {"": "o", "TP": "s", "PP": "^", "TP x PP": "D"}


def plot_choices(choices: dict[str, dict]) -> Any:
    """One panel per situation: every fitting layout search priced, memory per GPU against step
    time, coloured by its data-parallel sharding, shaped by its TP / PP axes; the HBM line, the
    band of the model's error beside the fastest (shaded: a tie), the fastest and the verdict marked."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from labkit.observe.style import use_course_style

    use_course_style()
    fig = Figure(figsize=(12, 9), layout="constrained")
    for ax, (situation, c) in zip(fig.subplots(2, 2).flat, choices.items()):
        fastest = c["fastest"]["step_s"]
        groups: dict[tuple[str, str], list[dict]] = {}
        for row in c["rows"]:
            name = family(row["layout"]).split(" x ")
            sharding = name[0] if name[0] in SHARDING_COLORS else ""
            groups.setdefault((sharding, " x ".join(x for x in name if x in ("TP", "PP"))), []).append(row)
        for (sharding, axes), rows in sorted(groups.items()):
            ax.scatter([r["step_s"] / fastest for r in rows], [r["memory_total"] / 1e9 for r in rows], s=9,
                       alpha=0.45, color=SHARDING_COLORS[sharding], marker=AXES_MARKERS[axes], lw=0)  # fmt: skip
        ax.axvspan(1.0, 1 + c["band"], color="#999999", alpha=0.2, lw=0)
        ax.axhline(META_H100.memory_bytes / 1e9, color="black", lw=1, ls="--")
        for what, marker, dy in (("fastest", "*", -9), ("verdict", "P", 5)):
            r = c[what]
            x, y = r["step_s"] / fastest, r["memory_total"] / 1e9
            ax.scatter([x], [y], s=170, marker=marker, color="black", zorder=5)
            ax.annotate(f"{what}: {family(r['layout'])}", (x, y), (x + 0.03, y + dy), fontsize=9, zorder=6)
        ax.set_xlim(0.97, min(2.0, max(r["step_s"] for r in c["rows"]) / fastest) + 0.02)
        ax.set_title(situation, fontsize=10)
        ax.set_xlabel("step time / the fastest layout's")
        ax.set_ylabel("memory per GPU (GB)")
    handles = [
        Patch(color=color, label=name or "no data parallelism") for name, color in SHARDING_COLORS.items()
    ]
    handles += [
        Line2D([], [], ls="", marker=m, color="#555555", label=a or "no TP, no PP")
        for a, m in AXES_MARKERS.items()
    ]
    handles += [Patch(color="#999999", alpha=0.2, label="within the model's error: a tie"),
                Line2D([], [], color="black", ls="--", label="HBM (80 GB)")]  # fmt: skip
    fig.legend(handles=handles, loc="outside lower center", ncol=6, fontsize=9)
    return fig
