"""Numbers from a rank's trace (see labkit.observe.tracing for the record format): busbw, op counts,
overlap of communication with compute, step times.

Conventions: "compute" is the union of spans of kind "compute" except spans named "step" (those
mark steps, they are not work), minus the intervals the rank's threads were blocked on a
collective. "Communication" is the union of collective events, from issue to completion.
Left out: per-thread accounting (two compute threads count once), and GPU-side times.
"""

# nccl-tests "bus bandwidth" factors: busbw = algbw * factor(n), algbw = bytes / seconds.
# Bytes convention (as nccl-tests): all-reduce counts the tensor; reduce-scatter and all-gather count
# the FULL tensor (world_size x the shard), so their busbw is comparable with all-reduce's.
_BUSBW_FACTORS = (
    ("all_reduce", lambda n: 2 * (n - 1) / n),
    ("reduce_scatter", lambda n: (n - 1) / n),
    ("all_gather", lambda n: (n - 1) / n),
    ("all_to_all", lambda n: (n - 1) / n),
    ("barrier", lambda n: 0.0),
)


def busbw(op, nbytes, seconds, world_size):
    """Bus bandwidth in GB/s (1e9 bytes) by nccl-tests' definitions.

    all-reduce: S/t * 2(n-1)/n; reduce-scatter, all-gather: S/t * (n-1)/n with S the full tensor;
    broadcast, reduce, send, recv: S/t. Op names match by substring ("ring_all_reduce" works)."""
    if seconds <= 0 or world_size < 1:
        return 0.0
    factor = 1.0
    for key, rule in _BUSBW_FACTORS:
        if key in op:
            factor = rule(world_size)
            break
    return nbytes / seconds / 1e9 * factor


def collective_counts(traces):
    """{op: (count, total_bytes)} over one trace, or summed over a list of traces (all ranks)."""
    if isinstance(traces, dict):
        traces = [traces]
    counts = {}
    for trace in traces:
        if trace is None:
            continue
        for ev in trace["events"]:
            count, total = counts.get(ev["op"], (0, 0))
            counts[ev["op"]] = (count + 1, total + ev["nbytes"])
    return dict(sorted(counts.items()))


# ---------------------------------------------------------------- interval arithmetic


def union(intervals):
    """Sorted, disjoint union of (start, end) intervals."""
    merged = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total(intervals):
    return sum(end - start for start, end in union(intervals))


def intersect(a, b):
    """Intersection of two interval sets (each is made disjoint first)."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b):
    """a minus b, as disjoint intervals."""
    out = []
    b = union(b)
    for start, end in union(a):
        cursor = start
        for b_start, b_end in b:
            if b_end <= cursor or b_start >= end:
                continue
            if b_start > cursor:
                out.append((cursor, b_start))
            cursor = max(cursor, b_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def _clip(intervals, t_range):
    if t_range is None:
        return list(intervals)
    lo, hi = t_range
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


# ---------------------------------------------------------------- per-rank figures


def compute_spans(trace):
    """The spans that count as compute (kind "compute", not the "step" markers)."""
    return [sp for sp in trace["spans"] if sp["kind"] == "compute" and sp["name"] != "step"]


def blocked_intervals(trace):
    return [tuple(b) for ev in trace["events"] for b in ev["blocked"]]


def overlap_stats(trace, t_range=None):
    """How much of this rank's communication ran while it computed.

    Returns {"overlap_pct": |comm ∩ compute| / |comm| * 100 (None without communication),
    "exposed_s": |comm| - |comm ∩ compute| (communication not hidden behind compute),
    "comm_s", "compute_s", "blocked_s"}; compute excludes blocked time (see module docstring).
    t_range=(lo, hi) restricts everything to that window, e.g. to skip a warm-up step."""
    comm = union(_clip([(ev["start"], ev["end"]) for ev in trace["events"]], t_range))
    blocked = union(_clip(blocked_intervals(trace), t_range))
    compute = subtract(_clip([(sp["start"], sp["end"]) for sp in compute_spans(trace)], t_range), blocked)
    comm_s = total(comm)
    overlap_s = total(intersect(comm, compute))
    return {
        "overlap_pct": 100.0 * overlap_s / comm_s if comm_s > 0 else None,
        "exposed_s": comm_s - overlap_s,
        "comm_s": comm_s,
        "compute_s": total(compute),
        "blocked_s": total(blocked),
    }


def steps(trace):
    """[(start, end), ...] of the spans named "step", in time order (a lab marks them with
    `with tracing.span("step"): ...`)."""
    return sorted((sp["start"], sp["end"]) for sp in trace["spans"] if sp["name"] == "step")


def node_bytes(traces, t_range=None):
    """{"intra": bytes, "inter": bytes, "inter_messages": count} this rank's hand-written
    collectives sent within its node and across nodes (labkit.launch.topology), and how many
    messages crossed, over one trace or summed over a list of traces;
    t_range=(start, end) keeps the collectives that started inside it. torch.distributed's own
    collectives carry no such count (gloo sends them) and add nothing."""
    if isinstance(traces, dict):
        traces = [traces]
    out = {"intra": 0, "inter": 0, "inter_messages": 0}
    for trace in traces:
        for ev in trace["events"] if trace else ():
            if t_range is not None and not t_range[0] <= ev["start"] < t_range[1]:
                continue
            out["intra"] += ev.get("intra_bytes", 0)
            out["inter"] += ev.get("inter_bytes", 0)
            out["inter_messages"] += ev.get("inter_messages", 0)
    return out
