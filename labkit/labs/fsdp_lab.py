"""The FSDP lab's formulas: how fully_shard_by_hand cuts a model into units, and the peak memory
that cut predicts (checked in fsdp_lab against labkit.observe.memory's measurement)."""
from labkit.strategies.fsdp import plan_units


def unit_sizes(model, units="block"):
    """numel per unit, root first (the tied embedding counted once), as fully_shard_by_hand cuts."""
    unit_modules = plan_units(model, units)
    inner = {id(p) for m in unit_modules for p in m.parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    sizes = [sum(p.numel() for p in trainable if id(p) not in inner)]
    sizes += [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in unit_modules]
    return sizes


def peak_formula(model, world_size, units="block", prefetch=1, activation_bytes=0):
    """M_peak ≈ (4+4+8)P/N shards + root + largest unit + prefetch buffers + that unit's gradient
    temporaries (the unsharded grads and the padded reduce-scatter input) + activations, fp32.
    The root counts whole because it stays gathered from the first forward to its backward."""
    sizes = unit_sizes(model, units)
    total = sum(sizes)
    pad = -(-total // world_size) * world_size
    largest = max(sizes[1:] or [0])
    parts = {"shards 16P/N": 16 * pad / world_size, "root (gathered)": 4 * sizes[0],
             "largest unit": 4 * largest, "prefetch": 4 * largest * min(prefetch, len(sizes) - 2),
             "grad temporaries": 2 * 4 * largest, "activations": activation_bytes}
    return sum(parts.values()), parts
