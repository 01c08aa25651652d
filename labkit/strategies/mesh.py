"""One mesh builder for every strategy that splits the world into named axes (in the spirit of
torchtitan's ParallelDims): tp's and fsdp-tp's ("dp", "tp"), pp-zero1's ("dp", "pp"), cp's
("dp", "cp"), ulysses' ("dp", "ulysses"), ep's ("dp", "ep") and the 3-D strategies' ("dp", "pp", "tp").

    mesh = device_mesh(model, "fsdp-tp", (("dp", None), ("tp", 2)))   # dp: the rest of the world
    mesh = device_mesh(model, "zero1-tp-pp", (("dp", 2), ("pp", 2), ("tp", 2)), mesh=given)

The axes are listed outermost first (the last one's ranks are consecutive: Megatron puts TP in
one node). Each degree is an int >= 1, or None for at most one axis: the world size over the
others. One check of the degrees against the world size, one wording for every strategy:
- a degree that is not an int >= 1: "<where>: tp must be an int >= 1 dividing the world size 4";
- degrees whose product does not divide the world: "... does not divide the world size 2: it
  needs world_size >= 4, a multiple of 4";
- degrees (none None) that do not multiply to the world: "... the degrees must multiply to it".
A DeviceMesh passed in is checked instead: its dim names, and any degree given against its size.

What it leaves out: meshes over a subset of the world, and axes that are not contiguous blocks of
ranks (torch's init_device_mesh lays every mesh out row-major over the world).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["device_mesh"]


def _degree(value: object, name: str, where: str, world: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{where}: {name} must be an int >= 1 dividing the world size {world}, got {value!r}"
        )
    return value


def device_mesh(
    model: nn.Module,
    where: str,
    dims: Sequence[tuple[str, int | None]],
    mesh: DeviceMesh | None = None,
) -> DeviceMesh:
    """The mesh of `dims` ((name, degree) pairs, outermost first; one degree may be None: the rest
    of the world) on the model's device, or `mesh` checked against them (see the module doc)."""
    names = tuple(name for name, _ in dims)
    world = dist.get_world_size()
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh) or tuple(mesh.mesh_dim_names or ()) != names:
            raise ValueError(
                f"{where}: mesh must be a {len(names)}-D DeviceMesh with dim names {names}, got {mesh!r}"
            )
        for name, value in dims:
            if value is not None and value != mesh[name].size():
                raise ValueError(
                    f"{where}: {name}={value} but the mesh's {name!r} dim has {mesh[name].size()} ranks"
                )
        return mesh
    rest = [name for name, value in dims if value is None]
    if len(rest) > 1:
        raise ValueError(f"{where}: at most one axis may take the rest of the world, got {rest}")
    given = {name: _degree(value, name, where, world) for name, value in dims if value is not None}
    product = math.prod(given.values())
    said = " x ".join(f"{n}={v}" for n, v in given.items())
    if not rest and product != world:
        raise ValueError(
            f"{where}: {said} = {product} ranks, but the world size is {world}: the degrees must multiply to it"
        )
    if world % product:
        per = f"{said} = {product} ranks per replica" if len(given) > 1 else f"{said} ranks"
        if len(given) == 1:
            ((name, value),) = given.items()
            raise ValueError(
                f"{where}: {name} must be an int >= 1 dividing the world size {world}, got {value!r}: "
                f"it needs world_size >= {product}, a multiple of {product} (or pass {name}=)"
            )
        raise ValueError(
            f"{where}: {per} does not divide the world size {world}: it needs world_size >= "
            f"{product}, a multiple of {product} (or pass {' and '.join(n + '=' for n in given)})"
        )
    shape = tuple(world // product if value is None else value for _, value in dims)
    from torch.distributed.device_mesh import init_device_mesh

    device = next(model.parameters()).device
    return init_device_mesh(device.type, shape, mesh_dim_names=names)
