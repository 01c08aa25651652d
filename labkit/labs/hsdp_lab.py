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

CFG = loop.PRESETS["fsdp"].replace(gpt=dict(d_model=256, n_heads=4, n_layers=4), batch_size=4, seq_len=8)


def runs(*labels):
    """{label: (strategy, options)} of the lab's comparison, hand-written collectives only
    (torch's are not throttled): DDP on labkit's ring all-reduce, FSDP, HSDP."""
    from labkit.comm.collectives import ring_all_reduce
    from labkit.comm.hierarchical import hierarchical_all_reduce

    every = {
        "ddp": ("ddp-bucketed", {"all_reduce": ring_all_reduce}),
        "ddp-hier": ("ddp-bucketed", {"all_reduce": hierarchical_all_reduce}),
        "fsdp": ("fsdp", {}),
        "hsdp": ("hsdp", {}),
        "fsdp-node": ("fsdp", {"reshard_after_forward": 2}),
    }  # FSDP2's int: the node
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
            result = loop.train(
                strategy,
                cfg,
                steps,
                spans=False,
                hooks=loop.Hooks(warmup=warmup),
                **{"return_state": False, **common, **options},
            )
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


def predicted_step(results, label, free_label, link):
    """The step-time model, calibrated in the run: `free_label` is `label` run on a free
    inter-node link in the same launch, `label` on `link`. Predicted: the free-link step plus
    what the busiest rank's cross-node traffic (its bytes and messages, as the tracer counted
    them on `link`) costs there. Additive, not overlapped: a rank's collectives run one at a time
    on its communication thread, so time on the slow link delays every collective queued behind
    it, and the step waits for the last. Measured on the shared 2-core machine (4 runs, load 4-9):
    within 0.84-1.0 of the measured step for FSDP and 0.95-1.0 for HSDP."""
    cost = max(
        node_bytes_per_step(results, label, rank=r) / link.bandwidth_Bps
        + node_bytes_per_step(results, label, "inter_messages", rank=r) * link.latency_s
        for r in range(len(results))
    )
    return step_time(results, free_label) + cost


# ---------------------------------------------------------------- the exercises' references
# (what a learner's copy falls back to; the lab's solutions are the same algorithm)


def hier_all_reduce(tensor, mesh):
    """Exercise 1's reference: labkit.comm.hierarchical on `mesh` (sum, in place)."""
    from labkit.comm.hierarchical import hierarchical_all_reduce

    hierarchical_all_reduce(tensor, mesh=mesh)


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


class OneUnitHSDP:
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
