"""The FSDP lab's bookkeeping and formulas: which parameter belongs to which unit (as fully_shard
assigns them), how many bytes per-parameter dim-0 sharding costs, and the peak memory a wrap
predicts (checked in fsdp_lab against labkit.observe.memory's measurement).

What it leaves out: activation memory, which no formula here predicts (the lab measures it and
peak_formula takes it as a term); under mixed precision the state counts the shards in their own
dtype (the fp32 masters), which is what the reference keeps (state_formula).
"""
import torch.distributed as dist

from labkit.comm.collectives import ring_all_gather
from labkit.strategies.fsdp import FSDP, plan_units


def assign_params(model, unit_modules):
    """Each unit's parameters, as fully_shard assigns them when called innermost first, the model
    last: a parameter belongs to the first unit (in `unit_modules` order, then the model) that
    contains EVERY module using it, so a weight tied across two units goes to the root.
    Returns one list per unit, the model's last: [(param, [(module, attr), ...]), ...]."""
    uses = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                uses.setdefault(param, []).append((module, attr))
    taken, units = set(), []
    for unit in list(unit_modules) + [model]:
        inside = {id(m) for m in unit.modules()}
        mine = [(p, u) for p, u in uses.items()
                if p not in taken and all(id(m) in inside for m, _ in u)]
        taken.update(p for p, _ in mine)
        units.append(mine)
    return units


def rows_per_rank(dim0, world_size):
    """torch.chunk's rows per rank, ceil(dim0 / N): every rank's shard has this many rows."""
    return -(-dim0 // world_size)


def shard_rows(full, rank, world_size):
    """Rank `rank`'s dim-0 shard of `full`: rows [rank*R, (rank+1)*R) of `full` padded with zero
    rows to R*N (R = rows_per_rank), a new tensor (the lab's exercise 1, reference)."""
    rows = rows_per_rank(full.shape[0], world_size)
    padded = full.new_zeros((rows * world_size, *full.shape[1:]))
    padded[:full.shape[0]] = full
    return padded[rank * rows:(rank + 1) * rows].clone()


def gather_rows(shard, dim0):
    """Every rank's shard all-gathered back into the whole tensor, padding dropped (a collective)."""
    out = shard.new_empty((shard.shape[0] * dist.get_world_size(), *shard.shape[1:]))
    ring_all_gather(out, shard.contiguous())
    return out[:dim0]


def padded_numel(param, world_size):
    """Elements of one parameter once its dim 0 is padded to a multiple of N."""
    if param.dim() == 0:
        return world_size
    return rows_per_rank(param.shape[0], world_size) * world_size * (param.numel() // max(param.shape[0], 1))


def unit_sizes(model, units="block", world_size=None):
    """Trainable numel per unit, root first (the tied embedding counted once), as the units
    `plan_units(model, units)` cut the model; padded per parameter when world_size is given."""
    modules = plan_units(model, units)
    groups = assign_params(model, modules)
    size = (lambda p: p.numel()) if world_size is None else (lambda p: padded_numel(p, world_size))
    per_unit = [sum(size(p) for p, _ in group if p.requires_grad) for group in groups]
    return [per_unit[-1]] + per_unit[:-1]


def peak_formula(model, world_size, units="block", prefetch=1, activation_bytes=0):
    """M_peak ≈ (4+4+8)P/N shards + root + largest unit + prefetch buffers + that unit's gradient
    temporaries (its unsharded grads and the padded reduce-scatter input) + activations, fp32.
    The root counts whole because it stays gathered from the first forward to its backward."""
    sizes = unit_sizes(model, units, world_size)
    total = sum(sizes)
    largest = max(sizes[1:] or [0])
    parts = {"shards 16P/N": 16 * total / world_size, "root (gathered)": 4 * sizes[0],
             "largest unit": 4 * largest, "prefetch": 4 * largest * min(prefetch, max(len(sizes) - 2, 0)),
             "grad temporaries": 2 * 4 * largest, "activations": activation_bytes}
    return sum(parts.values()), parts


def state_formula(model, world_size, units="block"):
    """Parameter / gradient / optimizer bytes per rank after a backward under the reference FSDP,
    with or without a MixedPrecision policy: the shard, in the parameter's own dtype (fp32), IS the
    master (parameters 4P/N); the reduce-scatter moves reduce_dtype, but its piece lands cast to the
    shard's dtype (gradients 4P/N, as FSDP2 does); AdamW's two moments 8P/N plus a 4-byte step per
    tensor. P padded per parameter. The policy changes the wire and the gathered unit, not this."""
    padded = sum(unit_sizes(model, units, world_size))
    size = next(model.parameters()).element_size()
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    return {"parameters": size * padded / world_size, "gradients": size * padded / world_size,
            "optimizer": 2 * size * padded / world_size + 4 * tensors}


def sample_at(record, label, which=-1):
    """by_category of the `which`-th memory sample labelled `label` (loop.train marks "backward end")."""
    return [s for s in record.samples if s.label == label][which].by_category


def seed_exercise(weights_gb, grads_gb, optimizer_gb, world_size, largest_group_gb, prefetch_gb):
    """The FSDP seed's exercise: steady state per rank (every state sharded) and the peak's lower
    bound (steady state + the largest unsharded group + the prefetch buffer), in GB."""
    steady = (weights_gb + grads_gb + optimizer_gb) / world_size
    return {"steady": steady, "peak_lower_bound": steady + largest_group_gb + prefetch_gb}


def assert_bound(label, measured, at_most=None, at_least=None, unit="x"):
    """Print 'label: expected <= B / measured M / match' (or >=) and raise AssertionError on a
    miss: the lab's inequality claims (peak ratios) can fail like its equalities."""
    fmt = (lambda v: f"{v:.3g}") if unit == "x" else (lambda v: f"{v:.4g} {unit}")
    bound = f"<= {fmt(at_most)}" if at_most is not None else f">= {fmt(at_least)}"
    ok = (at_most is None or measured <= at_most) and (at_least is None or measured >= at_least)
    line = f"{label}: expected {bound} / measured {fmt(measured)} / {'match' if ok else 'MISMATCH'}"
    print(line)
    if not ok:
        raise AssertionError(line)


def state_bytes(usage):
    """parameters + gradients + optimizer bytes of one memory sample's by_category."""
    return sum(usage.get(c, 0) for c in ("parameters", "gradients", "optimizer"))


def traffic_per_step(trace, ops=("all_gather", "reduce_scatter")):
    """Bytes of the ring collectives (ops) each 'step' span of one rank's trace started."""
    steps = [s for s in trace["spans"] if s["name"] == "step"]
    return [sum(ev["nbytes"] for ev in trace["events"]
                if any(op in ev["op"] for op in ops) and s["start"] <= ev["start"] <= s["end"])
            for s in steps]


class MarkedAfterPrefetch(FSDP):
    """The reference FSDP plus one memory sample right after each unit's pre-forward hook, i.e.
    after its own gather AND the prefetches it issued (the unshard / reshard samples fall on
    either side of that moment, where a prefetched unit is not always in flight yet)."""

    def __init__(self, model, cfg, **options):
        super().__init__(model, cfg, **options)
        for unit in self.units[1:]:
            unit.module.register_forward_pre_hook(
                lambda m, args, label=unit.label: self.observe("mark", f"after prefetch {label}"))


def gathered_after_prefetch(record):
    """The most all-gather bytes (gathered or in flight) at any 'after prefetch' sample of a run
    of MarkedAfterPrefetch (loop.train's memory record)."""
    return max(s.by_category.get("all_gather", 0) for s in record.samples if s.label.startswith("after prefetch"))
