"""The FSDP lab's bookkeeping and formulas: which parameter belongs to which unit (as fully_shard
assigns them), how many bytes per-parameter dim-0 sharding costs, and the peak memory a wrap
predicts (checked in fsdp_lab against labkit.observe.memory's measurement).

What it leaves out: activation memory, which no formula here predicts (the lab measures it and
peak_formula takes it as a term); under mixed precision the state counts the shards in their own
dtype (the fp32 masters), which is what the reference keeps (state_formula).

Below the formulas, the lab's experiment plumbing, so that a notebook cell shows the experiment:
rank functions (importable, so labkit.run pickles them by reference) that measure one unit's
bytes (watch_one_unit), the parameters a rank holds (held_bytes), the dtypes a sharding keeps
(two_dtypes) and meta-device init (meta_init); the figures of sections 10 and 14; the knob
widget. The learner's exercises (shard/gather, the unit classes, MyFSDP, ...) stay in the
notebook.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

import labkit
from labkit import loop, strategies
from labkit.comm.collectives import ring_all_gather
from labkit.observe.memory import MemoryTracker
from labkit.strategies.fsdp import FSDP, fully_shard_by_hand, plan_units, wrap_flat_by_hand


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
        mine = [(p, u) for p, u in uses.items() if p not in taken and all(id(m) in inside for m, _ in u)]
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
    padded[: full.shape[0]] = full
    return padded[rank * rows : (rank + 1) * rows].clone()


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
    parts = {
        "shards 16P/N": 16 * total / world_size,
        "root (gathered)": 4 * sizes[0],
        "largest unit": 4 * largest,
        "prefetch": 4 * largest * min(prefetch, max(len(sizes) - 2, 0)),
        "grad temporaries": 2 * 4 * largest,
        "activations": activation_bytes,
    }
    return sum(parts.values()), parts


def state_formula(model, world_size, units="block", rank=0):
    """Parameter / gradient / optimizer bytes on `rank` after a backward under the reference FSDP,
    with or without a MixedPrecision policy: the shard, in the parameter's own dtype (fp32), IS the
    master (parameters 4P/N); the reduce-scatter moves reduce_dtype, but its piece lands cast to the
    shard's dtype (gradients 4P/N, as FSDP2 does); AdamW's two moments 8P/N plus a 4-byte step per
    tensor. Parameters and gradients are padded per parameter (the collectives need equal pieces);
    the moments are not: the optimizer steps the DTensor, whose local tensor is this rank's real
    rows (torch.chunk's split, as under fully_shard), so a rank past the end of an indivisible dim 0
    holds fewer. The policy changes the wire and the gathered unit, not this."""
    padded = sum(unit_sizes(model, units, world_size))
    size = next(model.parameters()).element_size()
    trained = [p for p in model.parameters() if p.requires_grad]
    real = sum(_real_numel(p, world_size, rank) for p in trained)
    return {
        "parameters": size * padded / world_size,
        "gradients": size * padded / world_size,
        "optimizer": 2 * size * real + 4 * len(trained),
    }


def _real_numel(param, world_size, rank):
    """Elements of `param` on `rank` under torch.chunk's dim-0 split (no padding); 0-dim: rank 0."""
    if param.dim() == 0:
        return 1 if rank == 0 else 0
    dim0 = param.shape[0]
    rows = rows_per_rank(dim0, world_size)
    start = min(rank * rows, dim0)
    return (min(start + rows, dim0) - start) * (param.numel() // max(dim0, 1))


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
    return [
        sum(
            ev["nbytes"]
            for ev in trace["events"]
            if any(op in ev["op"] for op in ops) and s["start"] <= ev["start"] <= s["end"]
        )
        for s in steps
    ]


class MarkedAfterPrefetch(FSDP):
    """The reference FSDP plus one memory sample right after each unit's pre-forward hook, i.e.
    after its own gather AND the prefetches it issued (the unshard / reshard samples fall on
    either side of that moment, where a prefetched unit is not always in flight yet)."""

    def __init__(self, model, cfg, **options):
        super().__init__(model, cfg, **options)
        for unit in self.units[1:]:
            unit.module.register_forward_pre_hook(
                lambda m, args, label=unit.label: self.observe("mark", f"after prefetch {label}")
            )


def gathered_after_prefetch(record):
    """The most all-gather bytes (gathered or in flight) at any 'after prefetch' sample of a run
    of MarkedAfterPrefetch (loop.train's memory record)."""
    return max(
        s.by_category.get("all_gather", 0) for s in record.samples if s.label.startswith("after prefetch")
    )


# ---------------------------------------------------------------- the lab's experiments
# Rank functions (run with labkit.run), the figures and the knob widget of fsdp_lab.


def watch_one_unit(make_unit, cfg):
    """Rank function: this rank's tracked bytes (every category) after `make_unit(block)` shards
    block 0 of cfg's model, after `unit.unshard()` and after `unit.reshard()`, as
    [sharded, unsharded, resharded]. Leaves out: forward and backward (the unit never computes),
    the other blocks and the root; counts CPU storages only."""
    block = loop.build_model(cfg).blocks[0]
    with MemoryTracker(device="cpu") as tracker:
        unit = make_unit(block)
        tracker.mark("sharded")
        unit.unshard()
        tracker.mark("unsharded")
        unit.reshard()
        tracker.mark("resharded")
    return [s.total for s in tracker.samples if s.label in ("sharded", "unsharded", "resharded")]


def held_bytes(strategy, cfg, freeze=None):
    """Rank function: bytes of the parameters this rank holds between steps under `strategy`
    ("fsdp": its sharded parameters; otherwise, e.g. "fsdp-flat", everything strategy.parameters()
    gives), and of the frozen ones among them, after freezing the parameter named `freeze`.
    Returns (held, frozen). Leaves out: gradients, optimizer state and anything gathered (no step
    runs); 4 bytes an element (the preset's fp32)."""
    net = loop.build_model(cfg)
    if freeze:
        net.get_parameter(freeze).requires_grad_(False)
    s = strategies.build(strategy, net, cfg)
    held = s.sharded_parameters() if strategy == "fsdp" else list(s.parameters())
    frozen = [p for p in held if not p.requires_grad]
    # fsdp's shards are DTensors (global shape): what this rank holds is its padded local rows.
    padded = {id(fp.sharded): fp.padded for g in getattr(s, "units", []) for fp in getattr(g, "params", [])}
    size = lambda p: 4 * padded.get(id(p), p).numel()  # noqa: E731
    return sum(size(p) for p in held), sum(size(p) for p in frozen)


class TwoDtypes(nn.Module):
    """A bf16 lookup table next to an fp32 projection (seeded): one model, two parameter dtypes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(10, 6).to(torch.bfloat16)
        self.proj = nn.Linear(6, 3)

    def forward(self, idx):
        return self.proj(self.table(idx).float())


def two_dtypes(flat):
    """Rank function: TwoDtypes sharded flat (FSDP1's wrap_flat_by_hand, one root unit) or per parameter
    (fully_shard_by_hand), one forward and backward; the sorted parameter dtypes after it, or the
    TypeError's text where the sharding refuses the model. Leaves out: the optimizer step and
    whether the values are right (the lab's other sections check those)."""
    net = TwoDtypes()
    try:
        sharded = wrap_flat_by_hand(net, units="root") if flat else fully_shard_by_hand(net)
    except TypeError as exc:
        return f"TypeError: {exc}"
    sharded(torch.arange(8).view(2, 4)).sum().backward()
    return sorted({str(p.dtype) for p in net.parameters()})


def meta_init(cfg):
    """Rank function: cfg's model built for real on rank 0 and on the meta device (no memory)
    elsewhere, wrapped flat per block with sync_from_rank0 (FSDP1's sync_module_states); returns
    every rank's full state dict. Leaves out: FSDP2's way (shard a meta model, initialise each
    shard in place) and any training step."""
    if dist.get_rank() == 0:
        net = loop.build_model(cfg)
    else:
        with torch.device("meta"):
            net = loop.build_model(cfg)
    return wrap_flat_by_hand(net, units="block", sync_from_rank0=True).full_state_dict()


def plot_wraps(measured, runs):
    """Section 10's four bar charts, one bar per wrap: the largest unsharded group, collectives per
    step, the peak (from `measured`, {wrap: {"peak", "collectives", "largest"}}) and the median step
    time (from the sweep's `runs`, in the same order). Measures nothing itself."""
    import matplotlib.pyplot as plt

    plans = list(measured)
    fig, axes = plt.subplots(1, 4, figsize=(14, 3))
    for ax, (title, values) in zip(
        axes,
        [
            ("largest unsharded group (KiB)", [measured[u]["largest"] / 1024 for u in plans]),
            ("collectives per step", [measured[u]["collectives"] for u in plans]),
            ("peak (MiB)", [measured[u]["peak"] / 2**20 for u in plans]),
            ("median step (ms)", [r["median_step_s"] * 1e3 for r in runs]),
        ],
    ):
        ax.bar(plans, values)
        ax.set_title(title, fontsize=10)
    plt.tight_layout()
    plt.show()


def plot_peak_by_category(runs, title):
    """Bars of rank 0's bytes by category at the peak, side by side for each run of `runs`
    ({tag: a sweep result with "peak_by_category"}), in MiB. Measures nothing itself; the
    categories are the first run's."""
    import matplotlib.pyplot as plt

    categories = list(next(iter(runs.values()))["peak_by_category"])
    fig, ax = plt.subplots(figsize=(9, 3))
    for i, (tag, run) in enumerate(runs.items()):
        ax.bar(
            [j + 0.4 * i for j in range(len(categories))],
            [run["peak_by_category"][c] / 2**20 for c in categories],
            width=0.4,
            label=tag,
        )
    ax.set_xticks([j + 0.2 for j in range(len(categories))], categories, fontsize=8)
    ax.set(ylabel="MiB at the peak, rank 0", title=title)
    ax.legend()
    plt.show()


def knob_experiment(cfg, reshard_after_forward=True, prefetch=1, units="block", world_size=2):
    """Two steps of the reference "fsdp" on `world_size` ranks with the three knobs, memory
    tracked; draws the ranks' timeline and rank 0's memory, returns the labkit.run result.
    Leaves out: any check (sections 8-10 measure each knob); the clock is this run's."""
    import matplotlib.pyplot as plt
    from labkit.observe.memory_plot import plot_memory_timeline
    from labkit.observe.timeline import plot_timeline

    result = labkit.run(
        loop.train,
        "fsdp",
        cfg.replace(units=units),
        2,
        track_memory=True,
        return_state=False,
        reshard_after_forward=reshard_after_forward,
        prefetch=prefetch,
        world_size=world_size,
    )
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(12, 7))
    plot_timeline(
        result.traces, ax=ax_t, title=f"raf={reshard_after_forward}, prefetch={prefetch}, units={units}"
    )
    plot_memory_timeline([result[0]["memory"]], ax=ax_m)
    plt.show()
    return result


def knob_widget(cfg, world_size=2):
    """The knob widget (live notebooks only: call it where labkit.exercise.widgets_enabled()):
    reshard_after_forward, prefetch depth and wrap; each change re-runs knob_experiment on
    `world_size` ranks and redraws. Displays the widget and runs the defaults once."""
    import ipywidgets as widgets
    from IPython.display import display

    from labkit.exercise import draw_into

    controls = dict(
        reshard_after_forward=widgets.Checkbox(value=True, description="reshard_after_forward"),
        prefetch=widgets.IntSlider(value=1, min=0, max=2, description="prefetch"),
        units=widgets.Dropdown(options=["root", "block", "linear"], value="block", description="wrap"),
    )
    busy = widgets.HTML()
    out = widgets.Output()

    def rerun(_change=None):
        busy.value = f"running on {world_size} ranks..."
        draw_into(
            out, knob_experiment, cfg, world_size=world_size, **{k: c.value for k, c in controls.items()}
        )
        busy.value = "done"

    for control in controls.values():
        control.observe(rerun, names="value")
    display(widgets.VBox([widgets.HBox(list(controls.values())), busy, out]))
    rerun()
