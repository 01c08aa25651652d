"""The ZeRO lab's measurements: bytes a rank sent, read from its trace (labkit.observe), and the
layout sizes that the memory formulas need beside the bytes measured."""


def wire_bytes(trace, in_steps=True):
    """Bytes this rank sent, from its trace: a ring all-reduce of S bytes sends 2(n-1)/n S,
    a reduce-scatter or all-gather of S (full tensor) sends (n-1)/n S. in_steps: count only
    collectives inside the "step" spans (not DDP's start-up broadcast)."""
    windows = [(sp["start"], sp["end"]) for sp in trace["spans"] if sp["name"] == "step"]
    total = 0.0
    for ev in trace["events"]:
        if in_steps and not any(lo <= ev["start"] <= hi for lo, hi in windows):
            continue
        n = ev.get("world_size", trace["world_size"])
        if "all_reduce" in ev["op"]:
            total += ev["nbytes"] * 2 * (n - 1) / n
        elif "reduce_scatter" in ev["op"] or "all_gather" in ev["op"]:
            total += ev["nbytes"] * (n - 1) / n
    return total


def layout_elements(strategy):
    """A loop report hook (loop.Hooks(report=...)) for zero1 / zero2: what the 16P/N formulas leave
    out, in elements: the padded flat buffer, this rank's shard, the last bucket (what may still be
    in flight at the end of backward) and the pieces this rank's AdamW steps (a step counter each)."""
    layout = strategy.layout
    return {
        "flat": layout.numel,
        "shard": layout.shard_numel,
        "last_bucket": layout.buckets[-1].padded_numel,
        "pieces": len(strategy.optimizer.segments),
    }
