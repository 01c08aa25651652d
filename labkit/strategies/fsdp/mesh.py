"""How fully_shard_by_hand reads mesh= (labkit.strategies.fsdp; HSDP: labkit.strategies.fsdp.hsdp):
the process groups of a torch DeviceMesh. Left out: meshes of more than two dimensions."""

from typing import Any


def mesh_groups(mesh: Any, group: Any = None) -> tuple[Any, Any]:
    """(shard group, replicate group or None) of fully_shard_by_hand's mesh= / group=.
    A 1-D mesh shards over its one dimension (FSDP); a 2-D one is HSDP, as torch's fully_shard:
    dim 0 replicates, dim 1 shards."""
    if mesh is None:
        return group, None
    if group is not None:
        raise ValueError("fully_shard_by_hand: pass mesh= or group=, not both")
    ndim = getattr(mesh, "ndim", None)
    if ndim == 1:
        return mesh.get_group(), None
    if ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)
    raise ValueError(
        f"fully_shard_by_hand: mesh must be a 1-D (FSDP) or 2-D (replicate, shard: "
        f"HSDP) DeviceMesh, got {mesh!r}"
    )


_meshes: dict[
    tuple, tuple
] = {}  # id(process group) -> (group, its 1-D DeviceMesh): made once per group and device


def dtensor_mesh(mesh: Any, group: Any, device_type: str) -> tuple[Any, tuple]:
    """(DeviceMesh, placements) of the DTensors a unit's parameters become: mesh= as given (1-D:
    Shard(0); 2-D, HSDP: Replicate(), Shard(0), as fully_shard's), else a 1-D mesh over `group`
    (None: the default group), made from the existing group (no new process group)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    if mesh is not None:
        return mesh, ((Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0)))
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    key = (id(group), device_type)
    held = _meshes.get(key)
    if held is None or held[0] is not group:
        held = _meshes[key] = (group, DeviceMesh.from_group(group, device_type))
    return held[1], (Shard(0),)
