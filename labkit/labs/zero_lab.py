"""The ZeRO lab's communication count: bytes a rank sent, read from its trace (labkit.observe)."""


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
