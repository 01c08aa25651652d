"""What a checkpoint of the hand-written FSDP holds, independent of files: the sharded tensors of a
strategy, how a world size cuts them, how shards join back, and the structure a load must match.

Both FSDPs shard along dim 0 the torch.chunk way: rows_per_rank = ceil(rows / N), rank r holds
rows [r * rows_per_rank, (r + 1) * rows_per_rank), zero-padded, so every rank holds the same
shape. For the per-parameter reference ("fsdp", FSDP2's model) a sharded tensor is one
parameter (key: its first state_dict name, global shape: the parameter's); for the flat one
("fsdp-flat", FSDP1's) it is a unit's flat buffer (key "unit <label>", global shape (numel,)).
The structure (`describe`) records which of the two a checkpoint holds, so one is never loaded
into the other as if it were the same; the full format (whole tensors under the model's own
state_dict keys) is the same for both, and loads into either.

joined() turns a checkpoint's files (rank files or one full file) into whole tensors per entry.

What it leaves out: re-planning units (the units must be the same to load a sharded checkpoint),
resharding along another dimension than 0.
"""

import json
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from labkit.strategies.checkpoint.files import CheckpointError

PER_PARAMETER, FLAT = "per-parameter", "flat"
ADAM = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state, sharded like its parameter


class Entry(NamedTuple):
    """One sharded tensor of a strategy, as a checkpoint stores it."""

    key: str  # its name in a checkpoint file
    label: str  # the unit that holds it
    shard: torch.Tensor  # this rank's rows: the nn.Parameter the optimizer holds
    shape: tuple  # the global (unpadded) shape
    params: list  # [[every state_dict name, shape]] of the model parameters it holds


def layout(strategy: Any) -> str:
    return FLAT if hasattr(strategy, "flat_shards") else PER_PARAMETER


def check_strategy(strategy: Any) -> None:
    """Only the hand-written FSDP's (and fsdp-flat's) sharded tensors are this format's: anything
    else is refused here, before a file is written or read, rather than saved or loaded wrong."""
    units: Any = getattr(strategy, "units", None)
    hand_written = isinstance(units, (list, tuple)) and (
        layout(strategy) == FLAT or all(hasattr(u, "params") and hasattr(u, "group") for u in units)
    )
    if not hand_written:
        torch_made = type(strategy).__name__.startswith("Torch")
        raise TypeError(
            f"labkit's checkpoints take the hand-written FSDP ('fsdp', 'fsdp-flat'), got a "
            f"{type(strategy).__name__}"
            + (
                " (torch's own fully_shard: its parameters are DTensors, not this format's rows)"
                if torch_made
                else ""
            )
            + "; torch.distributed.checkpoint saves any model (dcp_round_trip, or "
            "get_model_state_dict / dcp.save)"
        )
    if any(getattr(u, "replicate_group", None) is not None for u in units):
        # The format is one shard group spanning the world: rank r's file holds rows r/N. Under
        # HSDP a rank's shard is 1/ranks_per_node of a parameter and each node holds a copy, so
        # neither the saver's cut nor the loader's fits; refused before any file is touched.
        raise NotImplementedError(
            f"labkit's checkpoints do not handle HSDP ({type(strategy).__name__}, a 2-D mesh): "
            f"the format cuts each parameter into one shard per rank of the world, while HSDP "
            f"shards it within a node and replicates it across nodes; neither saving nor loading "
            f"(an fsdp checkpoint into hsdp included) is supported. Save it with "
            f"torch.distributed.checkpoint (get_model_state_dict / dcp.save), or train 'fsdp'"
        )
    if any(getattr(p, "tp", None) is not None for u in strategy.units for p in getattr(u, "params", ())):
        raise NotImplementedError(
            f"labkit's checkpoints do not handle FSDP x TP ({type(strategy).__name__}): its shards "
            f"are pieces of tensor-parallel pieces, which this format's dim-0 rows cannot describe; "
            f"save it with torch.distributed.checkpoint (get_model_state_dict / dcp.save)"
        )
    if layout(strategy) != FLAT and any(dist.get_world_size(u.group) != dist.get_world_size() for u in units):
        raise NotImplementedError(
            f"labkit's checkpoints need every unit sharded over the whole world ({type(strategy).__name__} "
            f"shards over a group of {dist.get_world_size(units[0].group)} of "
            f"{dist.get_world_size()} ranks): rank r's file holds rank r's rows of a world-wide "
            f"cut. Save it with torch.distributed.checkpoint (get_model_state_dict / dcp.save)"
        )


def entries(strategy: Any) -> list[Entry]:
    """The strategy's sharded tensors, root unit first, in a fixed order (a strategy that
    check_strategy accepts: save_sharded / save_full / load check it first)."""
    if layout(strategy) == FLAT:
        return [
            Entry(
                f"unit {u.label}",
                u.label,
                u.shard,
                (u.numel,),
                [[list(names), list(shape)] for names, (_, _, shape) in zip(u.names, u.layout)],
            )
            for u in strategy.units
        ]
    return [
        Entry(p.names[0], u.label, p.sharded, tuple(p.shape), [[list(p.names), list(p.shape)]])
        for u in strategy.units
        for p in u.params
    ]


def replicated(strategy: Any) -> dict[str, torch.Tensor]:
    """{name: parameter} of the parameters no sharded tensor holds: fsdp-flat's frozen ones, whole
    on every rank (the per-parameter FSDP shards every parameter: none)."""
    if layout(strategy) != FLAT:
        return {}
    return {n: p for n, p in strategy.module.named_parameters() if not p.requires_grad}


def _rows(shape):
    # A 0-dim parameter is sharded as a 1-element vector (one row).
    return tuple(shape) if len(shape) else (1,)


def shard_shape(shape: Sequence[int], world_size: int) -> tuple[int, ...]:
    """(rows_per_rank = ceil(rows / N), *shape[1:]): every rank's shard of a tensor of `shape`."""
    rows = _rows(shape)
    return (-(-rows[0] // world_size), *rows[1:])


def cut(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s shard of the whole tensor `full`: its rows, zero-padded to rows_per_rank."""
    full = full.reshape(_rows(full.shape))
    piece = full.new_zeros(shard_shape(full.shape, world_size))
    rows = full[rank * piece.shape[0] : (rank + 1) * piece.shape[0]]
    piece[: rows.shape[0]] = rows
    return piece


def join(pieces: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """The whole tensor of `shape` from every rank's shard, in rank order (padding dropped)."""
    return torch.cat(list(pieces))[: _rows(shape)[0]].reshape(shape)


def whole_from_named(entry: Entry, named: dict[str, torch.Tensor]) -> torch.Tensor:
    """entry's whole tensor from {state_dict name: whole tensor} (a full checkpoint's)."""
    if not entry.params:
        return torch.zeros(entry.shape)
    if len(entry.params) == 1 and tuple(entry.params[0][1]) == tuple(entry.shape):
        return named[entry.params[0][0][0]]
    return torch.cat([named[names[0]].reshape(-1) for names, _ in entry.params])


def named_from_whole(entry: Entry, whole: torch.Tensor) -> dict[str, torch.Tensor]:
    """{first state_dict name: whole tensor} of the parameters entry's whole tensor holds."""
    out, offset = {}, 0
    for names, shape in entry.params:
        numel = int(torch.Size(shape).numel())
        out[names[0]] = whole.reshape(-1)[offset : offset + numel].view(shape)
        offset += numel
    return out


def _from_full(saved, live):
    """{key: {"shard": whole tensor, "exp_avg", "exp_avg_sq", "adam_step"}} from a full file."""
    out = {}
    for e in live:
        # By any of a parameter's names: a tied weight's first name may differ between layouts.
        opt: list[Any] = [
            next((saved["optimizer"][n] for n in names if n in saved["optimizer"]), None)
            for names, _ in e.params
        ]
        have = bool(opt) and all(o is not None for o in opt)
        out[e.key] = {
            "shard": whole_from_named(e, saved["model"]),
            "adam_step": opt[0]["step"] if have else None,
        }
        for k in ADAM:
            named: dict[str, Any] = {names[0]: o[k] for (names, _), o in zip(e.params, opt)} if have else {}
            out[e.key][k] = whole_from_named(e, named) if have else None
    return out


def joined(
    path: str, manifest: dict[str, Any], payloads: dict[str, Any], live: Sequence[Entry]
) -> dict[str, dict[str, Any]]:
    """{key: {"shard": whole tensor, "exp_avg", "exp_avg_sq", "adam_step"}} for the live entries,
    from a sharded checkpoint's rank files (each shard's shape and offset checked) or a full one."""
    if manifest["full"]:
        return _from_full(payloads["full.pt"], live)
    world_size = manifest["world_size"]
    files = [payloads[f"rank{r}.pt"] for r in range(world_size)]
    out: dict[str, dict[str, Any]] = {}
    for e in live:
        expected = shard_shape(e.shape, world_size)
        pieces = [f["tensors"].get(e.key) for f in files]
        for r, piece in enumerate(pieces):
            got = None if piece is None else (tuple(piece["shard"].shape), piece["offset"])
            if got != (expected, r * expected[0]):
                raise CheckpointError(
                    f"{path}: file rank{r}.pt: {e.key!r} has (shape, row offset) "
                    f"{got}; rank {r} of a {world_size}-rank save holds "
                    f"{(expected, r * expected[0])}"
                )
        out[e.key] = {"adam_step": pieces[0]["adam_step"]}
        for k in ("shard",) + ADAM:
            have = [p[k] for p in pieces]
            out[e.key][k] = join(have, e.shape) if all(t is not None for t in have) else None
    return out


def describe(strategy: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The world-size-independent structure a checkpoint must match: the layout, per unit its label,
    element count and parameters (every name of each, shape) in order (fsdp-flat's replicated frozen
    parameters as a unit "(replicated)"); the optimizer's class and hyperparameters.
    JSON-normalised, so a saved copy compares equal to a fresh one."""
    units: dict[str, dict[str, Any]] = {}
    for e in entries(strategy):
        unit = units.setdefault(e.label, {"label": e.label, "numel": 0, "params": []})
        unit["numel"] += int(torch.Size(e.shape).numel())
        unit["params"] += e.params
    hyper = [
        {k: v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")}
        for g in opt.param_groups
    ]
    kept = [[[n], list(p.shape)] for n, p in replicated(strategy).items()]
    if kept:
        units["(replicated)"] = {"label": "(replicated)", "numel": 0, "params": kept}
    return json.loads(
        json.dumps(
            {
                "layout": layout(strategy),
                "units": list(units.values()),
                "optimizer": {"class": type(opt).__name__, "param_groups": hyper},
            }
        )
    )


def _names(names, limit=6):
    names = sorted(names)
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def structure_differences(saved: dict[str, Any], live: dict[str, Any], full: bool = False) -> list[str]:
    """What differs between a checkpoint's structure and the live one, as readable lines. A full
    checkpoint (whole tensors by name) needs only the same parameter names and shapes: neither the
    layout nor the units matter to it."""
    out = []
    if full:

        def flat(structure):
            return {
                **structure,
                "layout": live["layout"],
                "units": [
                    {
                        "label": "(any)",
                        "numel": 0,
                        "params": [
                            [[n], shape]
                            for u in structure["units"]
                            for names, shape in u["params"]
                            for n in names
                        ],
                    }
                ],
            }

        saved, live = flat(saved), flat(live)
    s_layout, l_layout = saved.get("layout", FLAT), live.get("layout", FLAT)
    if s_layout != l_layout:
        out.append(
            f"the checkpoint holds {s_layout} shards (strategy "
            f"{'fsdp-flat' if s_layout == FLAT else 'fsdp'}), the model is sharded {l_layout}: "
            f"load it with that strategy, or save and load the full format"
        )
    s_labels = [u["label"] for u in saved["units"]]
    l_labels = [u["label"] for u in live["units"]]
    if s_labels != l_labels:
        out.append(f"model has {len(l_labels)} units {l_labels}, checkpoint has {len(s_labels)} {s_labels}")

    def params(structure):
        return {
            name: (unit["label"], shape)
            for unit in structure["units"]
            for names, shape in unit["params"]
            for name in names
        }

    s_params, l_params = params(saved), params(live)
    if l_params.keys() - s_params.keys():
        out.append(
            f"missing keys (in the model, not in the checkpoint): {_names(l_params.keys() - s_params.keys())}"
        )
    if s_params.keys() - l_params.keys():
        out.append(
            f"unexpected keys (in the checkpoint, not in the model): {_names(s_params.keys() - l_params.keys())}"
        )
    for name in sorted(s_params.keys() & l_params.keys()):
        (s_unit, s_shape), (l_unit, l_shape) = s_params[name], l_params[name]
        if s_shape != l_shape:
            out.append(f"{name}: shape {tuple(l_shape)} in the model, {tuple(s_shape)} in the checkpoint")
        elif s_unit != l_unit:
            out.append(f"{name}: in unit {l_unit!r} in the model, {s_unit!r} in the checkpoint")
    if not out and not full:  # same names and shapes: the order within units must still agree
        for s_unit, l_unit in zip(saved["units"], live["units"]):
            if s_unit != l_unit:
                out.append(
                    f"unit {l_unit['label']!r}: {l_unit['numel']} elements in the model, "
                    f"{s_unit['numel']} in the checkpoint, or its parameters in another order"
                )
    if saved["optimizer"] != live["optimizer"]:
        out.append(f"optimizer: {live['optimizer']} here, {saved['optimizer']} in the checkpoint")
    return out
