"""HSDP lab helpers: the lab's preset, the rank function that trains several strategies in one
launch and marks each one's window on the trace clock, what the kernel reads back (the slowest
rank's step time, the bytes that crossed nodes per step), and the step-time model.

    out = labkit.run(train_windows, runs(), CFG, world_size=4, nodes=2)
    step_time(out, "hsdp"), node_bytes_per_step(out, "hsdp")

The preset: TinyGPT with d_model 256 in 4 blocks (3.2 M parameters, 12.7 MB in fp32) on few
tokens (4 rows of 8). What crosses the network scales with the parameters, compute with the
tokens, so on the simulated inter-node link (labkit.launch.topology's default, 125 MB/s)
communication dominates FSDP's step: the regime FSDP runs in on a cluster. Every collective runs
as a ring (DIRECT_MAX_BYTES = 0 in the ranks), so the byte counts follow the ring's formulas.
Left out: the learner's exercises' checks (hsdp_checks.py).
"""
import contextlib

from labkit import loop
from labkit.launch import topology
from labkit.observe import trace_stats

CFG = loop.PRESETS["fsdp"].replace(gpt=dict(d_model=256, n_heads=4, n_layers=4), batch_size=4,
                                   seq_len=8)


def runs(*labels):
    """{label: (strategy, options)} of the lab's comparison, hand-written collectives only
    (torch's are not throttled): DDP on labkit's ring all-reduce, FSDP, HSDP."""
    from labkit.comm.collectives import ring_all_reduce
    from labkit.comm.hierarchical import hierarchical_all_reduce
    every = {"ddp": ("ddp-bucketed", {"all_reduce": ring_all_reduce}),
             "ddp-hier": ("ddp-bucketed", {"all_reduce": hierarchical_all_reduce}),
             "fsdp": ("fsdp", {}), "hsdp": ("hsdp", {})}
    return {k: every[k] for k in labels or ("ddp", "fsdp", "hsdp")}


def train_windows(runs, cfg, steps=3, warmup=1, **common):
    """Rank function: loop.train for each {label: (strategy, options)} in turn, no spans, every
    collective a ring; per label the result plus "window", its (start, end) on this rank's trace
    clock, and "steps_run" (warm-up included: their bytes are in the window too). An option
    inter_node=NodeLink(...) runs that label on another inter-node link (topology.inter_node)."""
    from labkit.comm import collectives
    from labkit.observe import tracing
    collectives.DIRECT_MAX_BYTES = 0
    out = {}
    for label, (strategy, options) in runs.items():
        options = dict(options)
        link = options.pop("inter_node", None)
        start = tracing.clock()
        with topology.inter_node(link) if link is not None else contextlib.nullcontext():
            result = loop.train(strategy, cfg, steps, warmup=warmup, spans=False,
                                **{"return_state": False, **common, **options})
        result["window"] = (start, tracing.clock())
        result["steps_run"] = steps + warmup
        out[label] = result
    return out


def step_time(results, label):
    """The slowest rank's median step time of `label` (a step ends when every rank is done)."""
    return max(r[label]["median_step_s"] for r in results)


def node_bytes_per_step(results, label, kind="inter", rank=None):
    """Bytes sent across nodes ("inter") or within ("intra") per step of `label` (or
    "inter_messages", how many messages crossed), by every rank together (or by `rank`), from the
    tracer: labkit's collectives only."""
    total = 0
    for r, (trace, out) in enumerate(zip(results.traces, results)):
        if rank is None or r == rank:
            total += trace_stats.node_bytes(trace, t_range=out[label]["window"])[kind]
    return total / results[0][label]["steps_run"]


def comm_busy_per_step(results, label, rank):
    """Seconds per step that rank's collectives were in flight (the union of their intervals):
    its communication thread's busy time, waiting for peers included."""
    trace, window = results.traces[rank], results[rank][label]["window"]
    spans = [(e["start"], e["end"]) for e in trace["events"]
             if window[0] <= e["start"] < window[1] and e["kind"] == "collective"]
    return trace_stats.total(trace_stats.union(spans)) / results[rank][label]["steps_run"]


def predicted_step(results, label, free_label, link):
    """The step-time model, calibrated in the run: `free_label` is `label` run on a free
    inter-node link in the same launch, `label` on `link`. Communication overlaps compute (the next unit's all-gather and the
    last unit's reduction run while a unit computes), so a step takes the longer of the two:
    the step measured on the free link, or the slowest rank's communication there plus what its
    cross-node traffic (bytes and messages, as `slow`'s tracer counted them) costs on `link`."""
    comm = []
    for r in range(len(results)):
        cross = node_bytes_per_step(results, label, rank=r)
        messages = node_bytes_per_step(results, label, "inter_messages", rank=r)
        comm.append(comm_busy_per_step(results, free_label, r) + cross / link.bandwidth_Bps
                    + messages * link.latency_s)
    return max(step_time(results, free_label), max(comm))
