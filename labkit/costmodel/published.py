"""Published training runs the layout model is checked against (docs/published_runs.md: the
sources, what each row says, which row calibrates each GPU's matmul efficiency).

Each anchor: the model's shape, the published layout and batch, the published throughput per GPU
and what it counts ("hw": Megatron-LM's FLOPs, the recomputed forward included; "model": model
FLOPs, MFU's convention), and the citation beside it. `calibrate` solves for the one matmul
efficiency that reproduces a row; the clusters below carry the efficiency so found (rounded, and
tests/test_costmodel_layout.py re-derives it), and every other row is a prediction.
Left out: Llama 3's long-context row's exact K/V all-gather overlap (priced as exposed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.costmodel import links
from labkit.costmodel.layout import Cluster, Transformer, layout_step

MEGATRON = (
    'Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using '
    'Megatron-LM", SC 2021 (arXiv 2104.04473), Table 1; micro-batch sizes and virtual stages from '
    "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh"
)
LLAMA3 = 'Llama Team, AI @ Meta, "The Llama 3 Herd of Models", 2024 (arXiv 2407.21783), Table 4'

# Selene: DGX A100 80 GB, one 200 Gb/s HDR NIC per GPU. Meta's 405B cluster: H100 SXM 80 GB (700 W),
# one 400 Gb/s RoCE NIC per GPU. Matmul efficiencies: calibrated on the rows named in CALIBRATED.
SELENE = Cluster("Selene, DGX A100 80GB, 200 Gb/s per GPU", 312e12, 80e9, 2.0e12, links.DGX_A100_IB200, 0.634)
META_H100 = Cluster(
    "Meta H100 80GB, 400 Gb/s RoCE per GPU", 989e12, 80e9, 3.35e12, links.DGX_H100_IB400, 0.755
)


def gpt(params_b: float, heads: int, d: int, layers: int) -> Transformer:
    """Megatron-LM's GPT of Table 1: MLP 4d, vocabulary 51,200, sequence 2,048."""
    return Transformer(f"GPT {params_b}B", layers, d, heads, 4 * d, 51200)


LLAMA3_405B = Transformer("Llama 3 405B", 126, 16384, 128, 53248, 128256, kv_heads=8, gated=True)


@dataclass(frozen=True)
class Anchor:
    """One published row: what ran and what it measured."""

    name: str
    model: Transformer
    layout: dict
    cluster: Cluster
    seq_len: int
    global_batch_tokens: int
    micro_batch: int
    published_tflops: float  # per GPU, as the source prints it
    published_peak_pct: float  # the source's % of peak (Megatron) or BF16 MFU (Llama 3)
    counts: str  # "hw": with the recomputed forward (Megatron-LM); "model": MFU's convention
    knobs: dict
    source: str

    @property
    def n_gpus(self) -> int:
        lay = self.layout
        return lay["dp"] * lay["tp"] * lay["pp"] * lay.get("cp", 1)

    def step(self, cluster: Cluster | None = None) -> dict:
        return layout_step(
            self.model,
            self.layout,
            cluster or self.cluster,
            seq_len=self.seq_len,
            global_batch_tokens=self.global_batch_tokens,
            micro_batch=self.micro_batch,
            **self.knobs,
        )

    @property
    def search_space(self) -> dict:
        """What search may vary for this row: Megatron-LM 2021's options (plain DDP, full
        recomputation, fp16 gradients, no CP; tp, pp, v, the micro-batch free under its own rules,
        megatron_2021_allows) for its rows, everything at the published CP for Llama 3's."""
        if self.counts == "hw":
            return {"zero": (0,), "recompute": ("full",), "cp": (1,), "reduce_dtype": ("fp16",)}
        return {"cp": (self.layout.get("cp", 1),)}

    def search(self) -> list[dict]:
        """costmodel.search over this row's GPUs, batch and search_space (Megatron's rows: under
        megatron_2021_allows too)."""
        from labkit.costmodel.layout_search import search

        layers = self.model.layers
        rules = (lambda row: megatron_2021_allows(row | {"layers": layers})) if self.counts == "hw" else None
        return search(
            self.model,
            self.n_gpus,
            self.cluster,
            seq_len=self.seq_len,
            global_batch_tokens=self.global_batch_tokens,
            space=self.search_space,
            allowed=rules,
            **self.knobs,
        )

    def modelled_tflops(self, cluster: Cluster | None = None) -> float:
        row = self.step(cluster)
        return row["hw_tflops_per_gpu"] if self.counts == "hw" else row["tflops_per_gpu"]


# Megatron-LM 2021 (commit 6985e58, the one examples/sc21/README.md names): full recomputation
# (--activations-checkpoint-method uniform), no sequence parallelism, no flash attention, plain DDP
# (the distributed optimizer came later); CONFIG.sh trains in --fp16 without
# --accumulate-allreduce-grads-in-fp32, so gradients are all-reduced in fp16. run_table_1.sh's
# --DDP-impl: torch up to 18B (its buckets overlap the last micro-batch's backward), local from 39B
# (training.train_step calls allreduce_gradients after the whole forward-backward: not overlapped).
_MEGATRON_KNOBS = {"sequence_parallel": False, "flash_attention": False}


def _megatron(row: tuple) -> Anchor:
    params_b, heads, d, layers, tp, pp, gpus, batch, mbs, v, tflops, pct = row
    dp = gpus // (tp * pp)
    layout = {"dp": dp, "tp": tp, "pp": pp, "v": v, "zero": 0, "recompute": "full", "reduce_dtype": "fp16"}
    knobs = _MEGATRON_KNOBS | {"overlap": params_b < 30}  # DDP-impl torch below 39B, local from it
    return Anchor(
        f"Megatron {params_b}B", gpt(params_b, heads, d, layers), layout, SELENE, 2048,
        batch * 2048, mbs, tflops, pct, "hw", knobs, MEGATRON,
    )  # fmt: skip


def megatron_2021_allows(row: dict) -> bool:
    """Megatron-LM 2021's own rules on a searched row (commit 6985e58): whole layers per stage
    (transformer.py asserts layers % pp == 0); the interleaved schedule (v > 1) only with pp > 2
    (arguments.py), a whole number of layers per chunk (--num-layers-per-virtual-pipeline-stage)
    and a number of micro-batches that pp divides (schedules.get_forward_backward_func)."""
    lay, layers = row["layout"], row["layers"]
    p, v = lay["pp"], lay["v"]
    if layers % p:
        return False
    return v == 1 or (p > 2 and (layers // p) % v == 0 and row["m"] % p == 0)


# params (B), heads, hidden, layers, TP, PP, GPUs, batch (sequences), micro-batch, v, TFLOP/s per GPU, % of peak
ANCHORS = {
    a.name: a
    for a in (
        _megatron((1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137, 44)),
        _megatron((3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138, 44)),
        _megatron((7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142, 46)),
        _megatron((18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135, 43)),
        _megatron((39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138, 44)),
        _megatron((76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140, 45)),
        _megatron((145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148, 47)),
        _megatron((310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155, 50)),
        _megatron((529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163, 52)),
        _megatron((1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163, 52)),
        # Llama 3 405B pre-training: FSDP over dp without reshard (the paper: parameters kept after
        # forward, gradients and optimizer state sharded: ZeRO-2), micro-batch 1 sequence, m = batch
        # size / DP; the gradients accumulated in fp32 over the micro-batches (the paper's FP32
        # gradient accumulation, torch.distributed.pipelining's FSDP stages): held unsharded,
        # reduce-scattered once per step. Assumed, the paper does not say: v = 4, half of each
        # stage's layers recomputed (with a quarter, the first stage's 16 micro-batches of
        # activations and the 12.6 GB of held fp32 gradients exceed 80 GB in this model).
        *(
            Anchor(
                f"Llama 3 405B, {gpus:,} GPUs, cp {cp}, seq {seq:,}",
                LLAMA3_405B,
                {
                    "dp": gpus // (8 * cp * 16),
                    "tp": 8,
                    "pp": 16,
                    "cp": cp,
                    "v": 4,
                    "zero": 3,
                    "reshard": False,
                    "accumulate": "hold",
                    "recompute": 0.5,
                },
                META_H100,
                seq,
                16 * 2**20 if seq == 8192 else 128 * 131072,
                1,
                tflops,
                mfu,
                "model",
                {},
                LLAMA3,
            )  # fmt: skip
            for gpus, cp, seq, tflops, mfu in (
                (8192, 1, 8192, 430, 43),
                (16384, 1, 8192, 400, 41),
                (16384, 16, 131072, 380, 38),
            )
        ),
    )
}
CALIBRATED = {"A100": "Megatron 145.6B", "H100": "Llama 3 405B, 8,192 GPUs, cp 1, seq 8,192"}


def calibrate(anchor: Anchor, tol: float = 1e-4) -> float:
    """The matmul efficiency at which the model reproduces `anchor`'s published throughput
    (bisection: the modelled throughput grows with the efficiency)."""
    lo, hi = 0.05, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        got = anchor.modelled_tflops(replace(anchor.cluster, matmul_efficiency=mid))
        lo, hi = (mid, hi) if got < anchor.published_tflops else (lo, mid)
    return (lo + hi) / 2


def table() -> list[dict]:
    """Every anchor: published and modelled TFLOP/s per GPU, their ratio, whether it calibrated."""
    calibrated = set(CALIBRATED.values())
    rows = []
    for name, a in ANCHORS.items():
        step = a.step()
        modelled = step["hw_tflops_per_gpu"] if a.counts == "hw" else step["tflops_per_gpu"]
        rows.append(
            {
                "name": name,
                "gpus": a.n_gpus,
                "layout": {k: a.layout[k] for k in ("dp", "tp", "pp", "cp", "v") if k in a.layout},
                "published_tflops": a.published_tflops,
                "modelled_tflops": modelled,
                "ratio": modelled / a.published_tflops,
                "counts": a.counts,
                "bubble": step["bubble"],
                "memory_gb": step["memory_total"] / 1e9,
                "fits": step["fits"],
                "calibrated": name in calibrated,
            }
        )
    return rows


def error_band(rows: list[dict] | None = None) -> float:
    """The model's error on a step time it was not calibrated on: the largest |modelled step /
    published step - 1| over the predicted rows of `table()` (a row's step ratio is 1 / its
    throughput ratio). Two layouts whose modelled steps are closer than this are a tie."""
    predicted = [r for r in (table() if rows is None else rows) if not r["calibrated"]]
    if not predicted:
        raise ValueError(
            "no predicted row: every published row calibrated the model, nothing measures its error"
        )
    return max(abs(1 / r["ratio"] - 1) for r in predicted)


# Narayanan et al. 2021, Section 5.4's measured comparisons on 64 A100s (8 DGX nodes), each run by
# NVIDIA/Megatron-LM examples/sc21/run_figure_{13,14,15}.sh: micro-batch 1, full recomputation,
# --DDP-impl local, fp16, no interleaving. The paper's finding for each: the order of the layouts,
# fastest first (tp above 8 leaves the node: not in this model's space, left out).
FIGURES = {
    "Figure 13: 162.2B, (tp, pp), peak at tp = 8": (
        Transformer("GPT 162.2B", 32, 20480, 128, 4 * 20480, 51200),
        [{"dp": 1, "tp": t, "pp": 64 // t} for t in (8, 4, 2)],
        (32, 128),
    ),
    "Figure 14: 5.9B, (pp, dp), falls as pp grows": (
        Transformer("GPT 5.9B", 32, 3840, 32, 4 * 3840, 51200),
        [{"dp": 64 // p, "tp": 1, "pp": p} for p in (2, 4, 8, 16, 32)],
        (32, 512),
    ),
    "Figure 15: 5.9B, (tp, dp), falls as tp grows": (
        Transformer("GPT 5.9B", 32, 3840, 32, 4 * 3840, 51200),
        [{"dp": 64 // t, "tp": t, "pp": 1} for t in (2, 4, 8)],
        (128, 512),  # the paper ties the fall to larger batches; at 32 the model has tp 4 3% above tp 2
    ),
}


def figure_throughputs(name: str) -> dict[int, list[float]]:
    """FIGURES[name]: batch (sequences) -> modelled TFLOP/s per GPU of each layout, in the paper's
    order (fastest first: a list that falls agrees with the paper)."""
    model, layouts, batches = FIGURES[name]
    knobs = _MEGATRON_KNOBS | {"overlap": False}
    base = {"zero": 0, "recompute": "full", "reduce_dtype": "fp16"}
    return {
        b: [
            layout_step(model, lay | base, SELENE, seq_len=2048, global_batch_tokens=b * 2048,
                        micro_batch=1, **knobs)["hw_tflops_per_gpu"]
            for lay in layouts
        ]
        for b in batches
    }  # fmt: skip
