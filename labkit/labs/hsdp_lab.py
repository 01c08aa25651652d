"""HSDP lab helpers: the lab's preset, the rank function that trains several strategies in one
launch, in interleaved rounds, and marks each one's windows on the trace clock, what the kernel reads back (the slowest
rank's step time, the bytes that crossed nodes per step), and the step-time model.

    out = labkit.run(train_windows, runs(), CFG, world_size=4, nodes=2)
    step_time(out, "hsdp"), node_bytes_per_step(out, "hsdp")

The preset: TinyGPT with d_model 256 in 4 blocks (3.2 M parameters, 12.7 MB in fp32) on few
tokens (4 rows of 8). What crosses the network scales with the parameters, compute with the
tokens, so on the simulated inter-node link (labkit.launch.topology's default, 125 MB/s)
communication dominates FSDP's step: the regime FSDP runs in on a cluster. Every collective runs
as a ring (DIRECT_MAX_BYTES = 0 in the ranks), so the byte counts follow the ring's formulas.
The step-time model (model_seconds): a step's compute, its CPU time on a free link (which
another process's load does not inflate), plus the link's price for the busiest rank's traced
bytes and messages; checked against CPU time + the seconds the link held each rank
(measured_seconds), so it validates on a busy machine; predicted_step is the wall-clock form
(the free-link wall step + the price), for a quiet one.
The lab's two figures: plot_flat_vs_hier (the timeline) and plot_node_bytes (bytes per step).
Left out: the learner's exercises' checks (hsdp_checks.py).
"""

import contextlib

from labkit import loop, strategies
from labkit.launch import topology
from labkit.observe import trace_stats

CFG = loop.PRESETS["fsdp"].replace(gpt=dict(d_model=256, n_heads=4, n_layers=4), batch_size=4, seq_len=8)


def runs(*labels):
    """{label: (strategy, options)} of the lab's comparison, hand-written collectives only
    (torch's are not throttled): DDP on labkit's ring all-reduce, FSDP, HSDP."""
    from labkit.comm.hierarchical import hierarchical_all_reduce

    every = {
        "ddp": ("ddp-bucketed", {"comm": "ring"}),
        "ddp-hier": ("ddp-bucketed", {"all_reduce": hierarchical_all_reduce}),
        "fsdp": ("fsdp", {}),
        "hsdp": ("hsdp", {}),
        "fsdp-node": ("fsdp", {"reshard_after_forward": 2}),
    }  # FSDP2's int: the node
    return {k: every[k] for k in labels or ("ddp", "fsdp", "hsdp")}


def train_windows(runs, cfg, steps=3, warmup=1, rounds=1, count_flops=False, **common):
    """Rank function: loop.train for each {label: (strategy, options)}, no spans, every
    collective a ring, in `rounds` interleaved rounds (A B C, then C B A, ...: every label is
    measured at each moment of a changing load, not one label while the machine was quiet and the
    next while it was busy). Per label the first round's result plus "windows", each round's
    (start, end) on this rank's trace clock, "steps_run" (every round's, warm-up included: their
    bytes are in the windows too), "round_step_s", each round's timed step times (wall), and per
    timed step "round_cpu_s", the process's CPU time (every thread: compute, the copies and sums
    of its collectives), and "round_held_s", the seconds the inter-node link held it (the
    first timed step's marks start where the last warm-up step ended; with warmup=0 the first
    step's CPU time includes building the model). An option
    inter_node=NodeLink(...) runs that label on another inter-node link (topology.inter_node).
    A pipelined strategy's label also gets "pipeline" (pipeline_order: the order of forward and
    backward actions its last step ran, and where the rank sits in the pipeline); with
    count_flops=True (warmup >= 1, so no timed step runs under the counter) "flops", the
    floating-point operations counted (torch's FLOP formulas, _flop_counter) in the first round's
    first step (matmuls and attention: what the cost model prices as compute)."""
    from labkit.comm import collectives
    from labkit.observe import tracing

    if count_flops and warmup < 1:
        raise ValueError(
            "train_windows: count_flops needs warmup >= 1 (the counter slows the step it counts)"
        )
    collectives.DIRECT_MAX_BYTES = 0
    out: dict = {}
    labels = list(runs)
    for round_ in range(rounds):
        for label in labels if round_ % 2 == 0 else labels[::-1]:
            options = dict(runs[label][1])
            link = options.pop("inter_node", None)
            counter = _flop_counter() if count_flops and round_ == 0 else None
            flops: list[int] = []

            def after_step(s, n, marks=None):
                if counter is not None and n == 1:  # the first (warm-up) step counted: stop counting
                    counter.__exit__(None, None, None)
                    flops.append(counter.total)
                marks.append(_marks())

            marks = [_marks()]  # (CPU, link-held) seconds before the first step, then after each
            started: list[bool] = []

            def shard(x, y, rank, world_size, counter=counter, started=started):
                if counter is not None and not started:  # the first step begins: count from here
                    counter.__enter__()
                    started.append(True)
                return loop.shard_batch(x, y, rank, world_size)

            hooks = loop.Hooks(
                shard=shard,
                warmup=warmup,
                after_step=lambda s, n, marks=marks: after_step(s, n, marks),
                report=pipeline_order,
            )
            start = tracing.clock()
            with topology.inter_node(link) if link is not None else contextlib.nullcontext():
                result = loop.train(
                    runs[label][0],
                    cfg,
                    steps,
                    spans=False,
                    hooks=hooks,
                    **{"return_state": False, **common, **options},
                )
            first = out.setdefault(
                label,
                {
                    **result,
                    "windows": [],
                    "steps_run": 0,
                    "round_step_s": [],
                    "round_cpu_s": [],
                    "round_held_s": [],
                },
            )
            if flops:
                first["flops"] = flops[0]
            first["windows"].append((start, tracing.clock()))
            first["steps_run"] += steps + warmup
            first["round_step_s"].append(result["step_s"])
            timed = list(zip(marks[warmup:], marks[warmup + 1 :]))  # the timed steps only
            first["round_cpu_s"].append([b[0] - a[0] for a, b in timed])
            first["round_held_s"].append([b[1] - a[1] for a, b in timed])
    return out


def _flop_counter():
    """A dispatch mode that adds up torch's FLOP count (torch.utils.flop_counter's registry: the
    matmuls and attention, forward and backward) of every op run under it, in `.total`. Not
    FlopCounterMode itself: its first use imports torch._dynamo (about 2 s of CPU in each rank),
    to keep compilation out of its dispatch, and nothing compiles in these ranks."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class FlopCount(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls):
            return False

        def __init__(self):
            super().__init__()
            self.total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            count = flop_registry.get(func._overloadpacket)
            if count is not None:
                self.total += count(*args, **kwargs, out_val=out)
            return out

    return FlopCount()


def pipeline_order(strategy) -> dict:
    """Hooks.report: a pipelined strategy's last step as its pipeline recorded it, {"pipeline":
    {"actions": [(kind, chunk, micro-batch)] in the order run, "stage": this rank's index in its
    pipeline, "ranks": the pipeline's global ranks, "n_stages", "n_microbatches",
    "virtual_stages"}}; {} for a strategy without a pipeline."""
    pipe = getattr(strategy, "pipeline", None)
    if pipe is None or not hasattr(pipe, "record"):
        return {}
    return {
        "pipeline": {
            "actions": [(a.kind, a.chunk, a.microbatch) for a in pipe.record.actions],
            "stage": pipe.rank,
            "ranks": list(pipe.ranks),
            "n_stages": pipe.n_stages,
            "n_microbatches": pipe.n_microbatches,
            "virtual_stages": pipe.virtual_stages,
        }
    }


def _marks():
    """(this process's CPU time, seconds the inter-node link has held it) now: a step's compute
    and what the link held it, neither inflated by other processes on the machine (a rank waiting
    for a core accrues neither; _link.held_s counts its sleeps' lengths, not their late wake-ups)."""
    import time

    from labkit.comm import _link

    return time.process_time(), _link.held_s()


FREE_LINK = topology.NodeLink(bandwidth_Bps=1e10, latency_s=0.0)  # the lab's "no network" link


def time_rounds(calls, rounds=3, free=FREE_LINK):
    """Rank function body: each {label: fn()} timed once per round on this run's inter-node link
    and once on `free` (as label + " free"), in `rounds` interleaved rounds (A B A' B', then
    B' A' B A, ...: every label meets the same moments of a changing load), after one untimed
    warm-up call of each. Every call starts after a barrier. Returns {label: {"s": [seconds per
    round], "windows": [(start, end) per round, on the trace clock], "cpu": [this process's CPU
    seconds per round], "held": [seconds the inter-node link held it per round]}}."""
    import torch.distributed as dist

    from labkit.observe import tracing

    order = [(k, None) for k in calls] + [(k, free) for k in calls]
    for fn in calls.values():
        fn()  # warm-up: buffers, the first messages
    out: dict = {}
    for round_ in range(rounds):
        for label, link in order if round_ % 2 == 0 else order[::-1]:
            with topology.inter_node(link) if link is not None else contextlib.nullcontext():
                dist.barrier()
                start, before = tracing.clock(), _marks()
                calls[label]()
                end, after = tracing.clock(), _marks()
            entry = out.setdefault(
                label if link is None else label + " free", {"s": [], "windows": [], "cpu": [], "held": []}
            )
            entry["s"].append(end - start)
            entry["windows"].append((start, end))
            entry["cpu"].append(after[0] - before[0])
            entry["held"].append(after[1] - before[1])
    return out


def fastest(results, label):
    """time_rounds' time of `label`: per round the slowest rank's (the call ends when every rank
    is done), then the fastest round: load only ever adds time."""
    return min(max(steps) for steps in zip(*(r[label]["s"] for r in results)))


def link_seconds(results, label, link):
    """What `link` charges per call of `label` (time_rounds' results): the busiest rank's traced
    cross-node bytes / bandwidth + messages x latency, averaged over the rounds. No wall clock
    in it: the bytes and messages are the algorithm's, the same in every run."""
    per_rank = []
    for trace, out in zip(results.traces, results):
        crossed = [trace_stats.node_bytes(trace, t_range=w) for w in out[label]["windows"]]
        per_rank.append(
            sum(c["inter"] / link.bandwidth_Bps + c["inter_messages"] * link.latency_s for c in crossed)
            / len(crossed)
        )
    return max(per_rank)


def step_time(results, label):
    """The step time of `label`: a step ends when every rank is done (the slowest rank's time of
    that step), and the step shown is the fastest such step over every round. Load on a shared
    machine only ever adds time, so the minimum over interleaved rounds is the step with the least
    load in it, and every label had the same chances of a quiet moment."""
    per_rank = [[t for round_ in r[label]["round_step_s"] for t in round_] for r in results]
    return min(max(steps) for steps in zip(*per_rank))


def node_bytes_per_step(results, label, kind="inter", rank=None):
    """Bytes sent across nodes ("inter") or within ("intra") per step of `label` (or
    "inter_messages", how many messages crossed), by every rank together (or by `rank`), from the
    tracer over every round's window: labkit's collectives only."""
    total = 0
    for r, (trace, out) in enumerate(zip(results.traces, results)):
        if rank is None or r == rank:
            for window in out[label]["windows"]:
                total += trace_stats.node_bytes(trace, t_range=window)[kind]
    return total / results[0][label]["steps_run"]


def predicted_step(results, label, free_label, link):
    """The step-time model, calibrated in the run: `free_label` is `label` run on a free
    inter-node link in the same launch, `label` on `link`. Predicted: the free-link step plus
    what the busiest rank's cross-node traffic (its bytes and messages, as the tracer counted
    them on `link`) costs there. Additive, not overlapped: a rank's collectives run one at a time
    on its communication thread, so time on the slow link delays every collective queued behind
    it, and the step waits for the last. Both steps are step_time's (the fastest over interleaved
    rounds); the lab checks the model against the measured step with checks.timing_match."""
    cost = max(
        node_bytes_per_step(results, label, rank=r) / link.bandwidth_Bps
        + node_bytes_per_step(results, label, "inter_messages", rank=r) * link.latency_s
        for r in range(len(results))
    )
    return step_time(results, free_label) + cost


def _per_rank_min(results, label, keys):
    """Per rank, the least over every timed step (or call) of the sum of `keys`' seconds."""
    out = []
    for r in results:
        entry = r[label]
        if "round_cpu_s" in entry:  # train_windows: per round, per step
            cols = [[t for round_ in entry[k] for t in round_] for k in keys]
        else:  # time_rounds: per round, one call
            cols = [entry[k] for k in keys]
        out.append(min(sum(v) for v in zip(*cols)))
    return out


def compute_seconds(results, label):
    """The compute of one step (train_windows) or call (time_rounds) of `label`: per rank its
    process's CPU time, the least over the steps (load only ever adds to it), and the busiest
    rank's: the step ends when every rank is done. CPU time, not wall time: a rank waiting for a
    core (another process's load) accrues none, so it is the same on a busy machine as on a
    quiet one, and it is what the rank would take with a core of its own."""
    return max(_per_rank_min(results, label, ("round_cpu_s",) if _steps(results, label) else ("cpu",)))


def _steps(results, label):
    return "round_cpu_s" in results[0][label]


def link_cost(results, label, link):
    """What `link` charges the busiest rank per step (train_windows) or per call (time_rounds)
    of `label`: its traced cross-node bytes / bandwidth + messages x latency. The algorithm's
    bytes, the same in every run."""
    if not _steps(results, label):
        return link_seconds(results, label, link)
    return max(
        node_bytes_per_step(results, label, rank=r) / link.bandwidth_Bps
        + node_bytes_per_step(results, label, "inter_messages", rank=r) * link.latency_s
        for r in range(len(results))
    )


def model_seconds(results, label, free_label, link):
    """The load-free model of a step (or call) of `label` on a cluster, a core per rank: the
    compute measured on the free link (`free_label`, compute_seconds: CPU time) plus what the
    busiest rank's traced bytes and messages cost on `link` (link_cost). Additive: a rank's
    collectives run one at a time on its communication thread, so a slow transfer delays every
    collective behind it."""
    return compute_seconds(results, free_label) + link_cost(results, label, link)


def measured_seconds(results, label):
    """What a step (or call) of `label` on the slow link took each rank, load left out: its CPU
    time plus the seconds the link held it (its sleeps' lengths, labkit.comm._link.held_s), the
    least over the steps per rank, the busiest rank's. Checked against model_seconds, it tests
    that the link adds no compute and holds a rank for what its traced bytes cost, on any
    machine: neither part grows while a rank waits for a core."""
    keys = ("round_cpu_s", "round_held_s") if _steps(results, label) else ("cpu", "held")
    return max(_per_rank_min(results, label, keys))


# ---------------------------------------------------------------- figures


HEADER_BYTES = 1024  # a collective that sent at most this across nodes sent only check headers


def payload_only(traces, min_bytes=HEADER_BYTES):
    """Copies of the traces in which a collective that sent at most `min_bytes` across nodes
    (the cross-rank check's headers, 128 B a call) counts as having sent none across: the
    timeline then hatches only the collectives whose payload crossed."""
    out = []
    for t in traces:
        events = [
            {**ev, "inter_bytes": 0, "inter_messages": 0} if 0 < ev.get("inter_bytes", 0) <= min_bytes else ev
            for ev in t["events"]
        ]
        out.append({**t, "events": events})
    return out


def plot_flat_vs_hier(
    results,
    windows_key: int = 1,
    title: str = "flat ring vs two-level all-reduce",
    labels: tuple[str, ...] | None = None,
    captions: dict[str, str] | None = None,
):
    """The ranks' timeline (labkit.observe.timeline) of a run whose rank function returned
    {name: (seconds, (start, end))} per all-reduce, or time_rounds' {name: {"windows": [...]}}
    (its last round drawn), only `labels` if given (the lab's flat_vs_hier): each name's window
    shaded and labelled above the lanes, collectives that sent a payload across nodes
    cross-hatched (the timeline's mark, from the tracer's inter_bytes; payload_only drops the
    cross-rank checks' headers). captions: {name: the text above its window} instead of its
    slowest rank's wall time (the lab prints what the link held: no wall time to swap two calls
    on a busy machine). Shows the figure once; returns it."""
    import matplotlib.pyplot as plt

    from labkit.observe import timeline
    from labkit.observe.style import show_own

    traces = payload_only(sorted(results.traces, key=lambda t: t["rank"]))
    offsets = timeline._rank_offsets(traces)
    by_rank = {t["rank"]: off for t, off in zip(traces, offsets)}
    spans: dict[str, tuple[float, float]] = {}  # name -> (lo, hi) in ms over every rank
    took: dict[str, float] = {}  # name -> its slowest rank's ms
    for rank, out in enumerate(results):
        for name, value in out.items():
            if labels is not None and name not in labels:
                continue
            window = value["windows"][-1] if isinstance(value, dict) else value[windows_key]
            lo, hi = ((t + by_rank[rank]) * 1e3 for t in window)
            old = spans.get(name, (lo, hi))
            spans[name] = (min(old[0], lo), max(old[1], hi))
            took[name] = max(took.get(name, 0.0), hi - lo)
    lo, hi = min(a for a, _ in spans.values()), max(b for _, b in spans.values())
    pad = 0.02 * (hi - lo)
    n = len(traces)
    height = timeline.TOP_IN + timeline.BOTTOM_IN + timeline.RANK_HEIGHT_IN * n + 0.4
    fig, ax = plt.subplots(figsize=(timeline.FIG_WIDTH_IN, height))
    fig.subplots_adjust(left=0.13, right=0.83, top=1 - (timeline.TOP_IN + 0.4) / height, bottom=1.4 / height)
    timeline.plot_timeline(traces, t_range=(lo - pad, hi + pad), ax=ax)
    ax.set_title(title, pad=26)
    for i, (name, (a, b)) in enumerate(spans.items()):
        ax.axvspan(a, b, color="#000000", alpha=0.04 if i % 2 == 0 else 0.0, zorder=0)
        ax.text(
            (a + b) / 2,
            1.0,
            (captions or {}).get(name, f"{name}: {took[name]:.0f} ms"),
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=12,
        )
    return show_own(fig)


def plot_node_bytes(
    across: dict[str, float], within: dict[str, float], title: str = "bytes per step, every rank together"
):
    """Bars of the bytes per step sent across nodes and within nodes, per label (dicts of the
    same labels, e.g. node_bytes_per_step's), in MiB (as fmt_bytes prints them). Shows the figure once; returns it."""
    import matplotlib.pyplot as plt

    from labkit.observe.style import show_own, use_course_style

    use_course_style()
    labels = list(across)
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.38
    bars = ax.bar(
        [i - width / 2 for i in x],
        [across[k] / 2**20 for k in labels],
        width,
        label="across nodes (slow link)",
        color="#d62728",
    )
    ax.bar(
        [i + width / 2 for i in x],
        [within[k] / 2**20 for k in labels],
        width,
        label="within a node",
        color="#1f77b4",
    )
    ax.bar_label(bars, fmt="%.0f", fontsize=11)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("MiB per step")
    ax.set_title(title)
    ax.legend(frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return show_own(fig)


# ---------------------------------------------------------------- the exercises' references
# (what a learner's copy falls back to; the lab's solutions are the same algorithm)


def hier_all_reduce(tensor, mesh):
    """Exercise 1's reference (sum, in place): labkit.comm.hierarchical's three steps, each run
    to its end before the next starts (as the exercise's solution does), so a timeline draws
    them one after the other: hierarchical_all_reduce queues all three at once, and its events
    would start together."""
    from labkit.comm.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter

    within, across, k = mesh.get_group("shard"), mesh.get_group("replicate"), mesh.size(1)
    chunk = -(-tensor.numel() // k)
    flat = tensor.new_zeros(chunk * k)
    flat[: tensor.numel()] = tensor.reshape(-1)
    shard = flat.new_empty(chunk)
    ring_reduce_scatter(shard, flat, op="sum", group=within)
    ring_all_reduce(shard, op="sum", group=across)
    ring_all_gather(flat, shard, group=within)
    tensor.copy_(flat[: tensor.numel()].view_as(tensor))


def shard_for_node(full, mesh):
    """Exercise 2's reference: this rank's dim-0 shard of `full` over the mesh's "shard" group
    (the ranks of its node), zero-padded rows, a new tensor."""
    from labkit.labs.fsdp_lab import shard_rows

    return shard_rows(full, mesh.get_local_rank("shard"), mesh.size(1))


def gather_in_node(shard, dim0, mesh):
    """Exercise 2's reference: the node's shards all-gathered (within the node), padding dropped."""
    from labkit.comm.collectives import ring_all_gather

    out = shard.new_empty((shard.shape[0] * mesh.size(1), *shard.shape[1:]))
    ring_all_gather(out, shard.contiguous(), group=mesh.get_group("shard"))
    return out[:dim0]


def reduce_grad_shard(grad, mesh):
    """Exercise 3's reference: this rank's shard of the SUM over every rank of `grad` (the whole
    unsharded gradient): reduce-scatter within the node, then all-reduce the shard across nodes."""
    from labkit.comm.collectives import ring_all_reduce, ring_reduce_scatter

    per = mesh.size(1)
    rows = -(-grad.shape[0] // per)
    padded = grad.new_zeros((rows * per, *grad.shape[1:]))
    padded[: grad.shape[0]] = grad
    out = grad.new_empty((rows, *grad.shape[1:]))
    ring_reduce_scatter(out, padded, op="sum", group=mesh.get_group("shard"))
    ring_all_reduce(out, op="sum", group=mesh.get_group("replicate"))
    return out


def choose_shard_size(rows, budget_bytes):
    """Exercise 4's reference: the shard-group size of the fastest measured row whose model state
    per rank fits the budget; rows: [{"shard": s, "step_s": t, "state_bytes": b}, ...]."""
    fits = [r for r in rows if r["state_bytes"] <= budget_bytes]
    if not fits:
        raise ValueError(f"no shard size fits {budget_bytes} bytes per rank")
    return min(fits, key=lambda r: r["step_s"])["shard"]


class OneUnitHSDP(strategies.Strategy):
    """HSDP with the whole model as ONE unit, from the exercises' three functions (the lab's
    scaffolding; a labkit.strategies strategy): every parameter flattened and sharded over the
    node; forward gathers them all within the node; after backward each gradient goes through
    reduce_grad (in-node reduce-scatter, cross-node all-reduce) into its shard, and the full
    parameters are freed. A parameter unused in a step (no .grad on any rank: the same step on
    every rank) keeps no gradient, as in single-process training.
    Leaves out: units and overlap (labkit's "hsdp" has both), no_sync, mixed precision."""

    reduce_op = "sum"

    def __init__(
        self,
        model,
        cfg,
        mesh=None,
        shard=shard_for_node,
        gather=gather_in_node,
        reduce_grad=reduce_grad_shard,
    ):
        import torch
        import torch.nn as nn
        from labkit.comm.hierarchical import node_mesh
        from labkit.strategies import unobserved

        self.model, self.mesh = model, mesh if mesh is not None else node_mesh()
        self.gather, self.reduce_grad, self.observe = gather, reduce_grad, unobserved
        self.params = list(model.parameters())  # a tied weight once
        self.shards = [
            nn.Parameter(shard(p.detach().reshape(-1), self.mesh), p.requires_grad) for p in self.params
        ]
        self.shapes = [p.shape for p in self.params]
        self._empty = torch.empty(0)
        self.reshard()
        self.optimizer = cfg.make_optimizer([s for s in self.shards if s.requires_grad])

    def unshard(self):
        for p, s, shape in zip(self.params, self.shards, self.shapes):
            p.data = self.gather(s.detach(), shape.numel(), self.mesh).view(shape)

    def reshard(self):
        for p in self.params:
            p.data = self._empty.to(p.dtype)

    def __call__(self, *args, **kwargs):
        self.unshard()
        return self.model(*args, **kwargs)

    def after_backward(self):
        for p, s in zip(self.params, self.shards):
            if p.requires_grad and p.grad is not None:
                s.grad = self.reduce_grad(p.grad.reshape(-1), self.mesh)
            p.grad = None
        self.reshard()

    def scale_loss(self, loss):
        return loss

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def step(self):
        self.optimizer.step()

    def full_state_dict(self):
        self.unshard()
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.reshard()
        return state

    def full_grad_dict(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {
            names[id(p)]: self.gather(s.grad, shape.numel(), self.mesh).view(shape)
            for p, s, shape in zip(self.params, self.shards, self.shapes)
            if s.grad is not None
        }
