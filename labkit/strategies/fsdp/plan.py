"""Which modules become FSDP units, for any nn.Module (shared by labkit.strategies.fsdp,
flat.py and torch_ref.py's fully_shard, so all three wrap the same units).

What it leaves out: automatic size-based policies (FSDP1's size_based_auto_wrap_policy).
"""

from typing import Any, Sequence, cast

import torch.nn as nn


def plan_units(model: nn.Module, units: Any) -> list[nn.Module]:
    """The modules that become units, for any nn.Module: "root" (none: the model is one unit),
    "block" (each of model.blocks), "linear" (every nn.Linear; LayerNorms and embeddings go to the
    root), a module class or tuple of classes (every submodule of that class), a predicate
    (every submodule m with units(m) true, e.g. `lambda m: isinstance(m, (nn.Linear, nn.Embedding))`),
    or an explicit list of modules. Whatever no unit holds goes to the root."""
    if isinstance(units, str) and units not in NAMED:
        raise ValueError(
            f"units={units!r}: a name must be one of {', '.join(map(repr, NAMED))} "
            f"(or pass a module class such as nn.Linear, a predicate, or a list of "
            f"modules)"
        )
    if units in (None, "root"):
        return []
    if units == "block":
        if not isinstance(getattr(model, "blocks", None), nn.Module):
            raise ValueError(
                f"units='block' wraps each of model.blocks; {type(model).__name__} "
                f"has no blocks: pass a module class, a predicate or a list"
            )
        return list(cast(Sequence[nn.Module], model.blocks))
    if units == "linear":
        units = nn.Linear
    if isinstance(units, type) or (isinstance(units, tuple) and all(isinstance(u, type) for u in units)):
        classes = units
        units = lambda m: isinstance(m, classes)  # noqa: E731
    if callable(units) and not isinstance(units, nn.Module):
        return [m for m in model.modules() if m is not model and units(m)]
    modules = list(units)
    inside = {id(m) for m in model.modules()}
    for m in modules:
        if not isinstance(m, nn.Module) or id(m) not in inside:
            raise ValueError(
                f"units: every listed unit must be a submodule of the model, got {type(m).__name__} {m!r:.60}"
            )
    return modules


NAMED = ("root", "block", "linear")  # the names plan_units knows


def own_units(model: nn.Module, unit_modules: Sequence[nn.Module]) -> list[nn.Module]:
    """unit_modules without those holding a parameter that a module outside them holds too (the
    toy's head and extra share one weight). torch's fully_shard cannot give one Parameter to two
    units (the second call would shard the same weight again and break the tie), so for a like-
    for-like comparison such modules fall to the root, where the shared weight goes anyway."""
    holders: dict[int, Any] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(module)
    keep = []
    for unit in unit_modules:
        inside = set(unit.modules())
        if all(holders[id(p)] <= inside for p in unit.parameters()):
            keep.append(unit)
    return keep


def innermost_first(model: nn.Module, unit_modules: Sequence[nn.Module]) -> list[nn.Module]:
    """unit_modules ordered deepest first (stable), the order fully_shard needs for nested units."""
    depth = {id(m): name.count(".") + 1 for name, m in model.named_modules() if name}
    return sorted(unit_modules, key=lambda m: -depth.get(id(m), 0))
