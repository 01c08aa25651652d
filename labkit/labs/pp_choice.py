"""pp_lab's closing section, the choice between layouts: per-rank memory and per-step
communication of DDP, FSDP, HSDP, ZeRO-1 x TP x PP and FSDP x TP (the references of the
learner's formulas), the ranking by labkit's cost model (labkit.costmodel: its memory
convention, 16 B per parameter in mixed precision with Adam; its links: NVLink in a node, 400 Gb/s
InfiniBand across), the small layouts measured on 8 ranks (2 simulated nodes x 4), and the
check of the formulas.

    c = Config(params=70e9, layers=80, d=8192, n=1024, tokens=4 * 2**20, tp=8, pp=4)
    memory_per_rank("FSDP", c), comm_per_rank("FSDP", c)   # bytes
    rank_layouts(c)                                        # fitting layouts, cheapest first

Conventions (the ZeRO paper's): model states only (2 B bf16 parameters, 2 B bf16 gradients, 12 B
fp32 master weights and Adam's two moments per parameter); activations left out (they depend on
micro-batching and checkpointing: see pp_lab's measurements). Communication: bytes each rank
SENDS per step on rings (all-reduce 2(k-1)/k of the tensor, all-gather and reduce-scatter
(k-1)/k of the whole), bf16 (2 B) parameters, gradients and activations. TP stays inside a node
(tp <= gpus_per_node); DP, FSDP and PP go across nodes; HSDP shards inside the node (its group
the node's g ranks) and all-reduces the shards across.
Left out: the embedding and head, optimizer-step and compute time, overlap, NCCL's trees.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit import costmodel
from labkit.costmodel import links

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
    """Bytes of model states per rank (the reference of the learner's formula), by the cost
    model's ZeRO formulas (costmodel.memory_per_rank) on what each rank's group shards: DDP
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


def comm_seconds(comm: dict[str, float], two_level: links.TwoLevel = links.DGX_H100_IB400) -> float:
    """The cost model's time for a rank's step communication: intra bytes at NVLink's bus
    bandwidth plus inter bytes at the network's (no latency, no overlap: a ranking, not a step time)."""
    return comm["intra"] / two_level.intra.busbw_Bps + comm["inter"] / two_level.inter.busbw_Bps


def rank_layouts(
    c: Config, hbm: float = costmodel.H100.memory_bytes, memory=memory_per_rank, comm=comm_per_rank
) -> list[dict]:
    """Every layout with its memory, whether it fits in hbm bytes, its communication and time;
    those that fit first, cheapest communication first."""
    rows = []
    for layout in LAYOUTS:
        mem, bytes_ = memory(layout, c), comm(layout, c)
        rows.append(
            {
                "layout": layout,
                "memory": mem,
                "fits": mem <= hbm,
                "comm": bytes_,
                "seconds": comm_seconds(bytes_),
            }
        )
    return sorted(rows, key=lambda r: (not r["fits"], r["seconds"]))


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
    "FSDP x TP": ("fsdp-tp", {"tp": 4}),
}


def small_config(params: int) -> Config:
    """The 8-rank measurement's configuration for the formulas (tokens do not matter for the
    measured layouts' cross-node bytes: only TP's, which stays in the node)."""
    return Config(params=params, layers=2, d=64, n=8, tokens=64, tp=4, g=4)


def predicted_inter(layout: str, params: int, word: int = 4) -> float:
    """The busiest rank's bytes across nodes per step in the 8-rank run (fp32: word 4)."""
    return comm_per_rank(layout, small_config(params))["inter"] * word / WORD


def total_comm(layout: str, c: Config) -> float:
    """Bytes each rank sends per step, in the node and across (the learner's formula's reference)."""
    return sum(comm_per_rank(layout, c).values())


# the usual selection table: the situation -> the layouts its verdict may be
USUAL = {
    "only the optimizer state is short (7B, one node)": ("ZeRO-1 x TP x PP",),  # tp = pp = 1: ZeRO-1
    "the model does not fit, a few nodes (30B, 2 nodes)": ("FSDP", "HSDP"),
    "very large model across many nodes (70B, 128 nodes)": ("ZeRO-1 x TP x PP",),
    "medium model, post-training (13B, 8 nodes)": ("FSDP", "HSDP"),
}


def check_order(order: list[str], measured_bytes: dict[str, float], link_cost: dict[str, float]) -> None:
    """Raise unless the measured cross-node bytes and the slow link's cost of them both rank the
    layouts in `order` (the model's, cheapest first)."""
    for what, values in (("cross-node bytes", measured_bytes), ("the link's cost", link_cost)):
        got = sorted(values, key=values.get)
        if got != list(order):
            raise AssertionError(
                f"measured {what} order the layouts {' < '.join(got)}, the cost model {' < '.join(order)}: "
                f"{ {k: values[k] for k in got} }"
            )


def check_table(verdicts: dict[str, str]) -> None:
    """Raise unless the cost model's pick in each situation is the usual table's."""
    for situation, layout in verdicts.items():
        if layout not in USUAL[situation]:
            raise AssertionError(
                f"{situation}: the cost model picks {layout}, the usual table {USUAL[situation]}"
            )
