"""How fully_shard_by_hand reads mesh= (labkit.strategies.fsdp; HSDP: labkit.strategies.fsdp.hsdp):
the process groups of a torch DeviceMesh. Left out: meshes of more than two dimensions."""


def mesh_groups(mesh, group=None):
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
