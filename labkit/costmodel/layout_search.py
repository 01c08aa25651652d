"""The layouts of n GPUs that fit and the global batch allows, fastest first, by layout_step.

    rows = search(LLAMA3_405B, 8192, META_H100, seq_len=8192, global_batch_tokens=16 * 2**20)
    rows[0]["layout"], rows[0]["step_s"]

A free search over tp in {1, 2, 4, 8} (inside a node, dividing the heads), every pp that divides
what is left (at most one layer per stage), virtual stages v, cp, the ZeRO stage or FSDP with or
without reshard, recomputation and the micro-batch; `space` narrows any of them (e.g. what a
framework of a given year could run: {"zero": (0,), "recompute": ("full",)}), and `allowed`, a
predicate on each priced row, applies a system's own rules (e.g. Megatron-LM 2021's interleaved
schedule: costmodel.published.megatron_2021_allows).
Left out: layouts whose degrees do not divide n exactly, uneven micro-batches, pp x v above
the layer count.
"""

from __future__ import annotations

import itertools

from labkit.costmodel import _validate as check
from labkit.costmodel.layout import Cluster, Transformer, _knobs, layout_step

DEFAULT_SPACE = {
    "tp": (1, 2, 4, 8),
    "pp": None,  # None: every divisor of what tp x cp leave
    "cp": (1, 2, 4, 8, 16),
    "v": (1, 2, 3, 4, 6, 8),
    "zero": (0, 1, 2, 3),
    "reshard": (True, False),  # FSDP (zero 3) only
    "recompute": ("none", 0.25, 0.5, "full"),
    "micro_batch": (1, 2, 4, 8, 16),
    "reduce_dtype": ("fp32",),
}


def _divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


def candidates(
    model: Transformer, n_gpus: int, cluster: Cluster, seq_len: int, global_batch_tokens, space: dict
):
    """Every (layout, micro_batch) the space, the cluster and the global batch allow."""
    g = cluster.net.gpus_per_node
    seqs = global_batch_tokens / seq_len
    for tp, cp in itertools.product(space["tp"], space["cp"]):
        if tp > g or model.heads % tp or n_gpus % (tp * cp) or seq_len % cp:
            continue
        for pp in _divisors(n_gpus // (tp * cp)):
            if pp > model.layers or (space["pp"] is not None and pp not in space["pp"]):
                continue
            dp = n_gpus // (tp * cp * pp)
            for mb in space["micro_batch"]:
                if seqs % (dp * mb):
                    continue
                for v in space["v"] if pp > 1 else (1,):
                    if pp * v > model.layers:
                        continue
                    for zero in space["zero"]:
                        for reshard in space["reshard"] if zero == 3 else (True,):
                            for rc, rd in itertools.product(space["recompute"], space["reduce_dtype"]):
                                layout = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "v": v, "zero": zero}
                                yield layout | {"reshard": reshard, "recompute": rc, "reduce_dtype": rd}, mb


def search(
    model, n_gpus, cluster, *, seq_len, global_batch_tokens, space=None, top=None, allowed=None, **knobs
) -> list[dict]:
    """layout_step of every candidate that fits, fastest first (ties: fewer GPUs per model copy,
    then less memory); each row also carries "micro_batch". `space` overrides DEFAULT_SPACE's
    entries (an unknown one raises); `top` keeps the first few; `allowed(row)` (row: layout_step's,
    with "micro_batch"), when given, drops the rows it returns False for; knobs go to layout_step."""
    check.instance("model", model, Transformer)
    check.count("n_gpus", n_gpus)
    check.instance("cluster", cluster, Cluster)
    check.count("seq_len", seq_len)
    check.amount("global_batch_tokens", global_batch_tokens)
    _knobs(knobs)  # a misspelled knob raises even when no layout is left to price
    space = dict(space or {})
    unknown = sorted(set(space) - set(DEFAULT_SPACE))
    if unknown:
        raise ValueError(f"unknown search dimensions {unknown}; the space has {tuple(DEFAULT_SPACE)}")
    space = DEFAULT_SPACE | {k: None if v is None else tuple(v) for k, v in space.items()}
    if top is not None:
        check.count("top", top)
    rows = []
    for layout, mb in candidates(model, n_gpus, cluster, seq_len, global_batch_tokens, space):
        row = layout_step(
            model,
            layout,
            cluster,
            seq_len=seq_len,
            global_batch_tokens=global_batch_tokens,
            micro_batch=mb,
            **knobs,
        )
        row |= {"micro_batch": mb}
        if row["fits"] and (allowed is None or allowed(row)):
            rows.append(row)
    rows.sort(key=lambda r: (r["step_s"], r["layout"]["tp"] * r["layout"]["pp"], r["memory_total"]))
    return rows[:top] if top else rows


def rank_of(rows: list[dict], layout: dict, micro_batch: int) -> int | None:
    """1-based place of `layout` (its given keys) with `micro_batch` in search's rows; None if absent."""
    for i, r in enumerate(rows, 1):
        if r["micro_batch"] == micro_batch and all(r["layout"][k] == v for k, v in layout.items()):
            return i
    return None
