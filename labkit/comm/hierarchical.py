"""The two-level all-reduce: reduce-scatter inside the node, all-reduce of the shard across nodes,
all-gather inside the node (NCCL's tree/ring over NVLink then the NIC; Horovod's hierarchical
allreduce). Built from labkit.comm.collectives' ring collectives on the groups of a 2-D device
mesh (torch's init_device_mesh: dim 0 across nodes, dim 1 within a node).

    mesh = node_mesh()                         # (nodes, ranks_per_node) from labkit.topology()
    hierarchical_all_reduce(tensor)            # like dist.all_reduce / ring_all_reduce
    DDPBucketed(model, all_reduce=hierarchical_all_reduce)

Why it wins on a two-level network: a flat ring over N = nodes x per ranks crosses the slow link on
every node boundary with 2(N-1)/N of the tensor per rank; here each rank sends only its 1/per shard
across, 2(nodes-1)/nodes of S/per, in parallel with its node's other ranks (one NIC each).

Semantics as ring_all_reduce: in place, any numel (zero-padded to a multiple of ranks_per_node),
non-contiguous tensors, ops "sum" / "avg" (AVG divides by per in the reduce-scatter, then by
nodes in the all-reduce: the average over all N). The three steps run in order on labkit's comm
thread, each traced as its own collective (so a timeline shows which crossed nodes). The sum runs
in another order than a flat ring's: float results differ from it in the last bits.
What it leaves out: a tensor split into pieces that pipeline the three stages, a node-local
reduce to one leader per node (the NIC-per-rank cluster needs none), CUDA streams.
"""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ._dispatch import Group, Op, check_tensor, resolve_op
from .collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter

__all__ = ["hierarchical_all_reduce", "node_mesh", "HierarchicalHandle"]
NAME = "hierarchical_all_reduce"
_meshes: dict[tuple, Any] = {}


def node_mesh(
    device_type: Optional[str] = None, mesh_dim_names: tuple[str, str] = ("replicate", "shard")
) -> Any:
    """The (nodes, ranks_per_node) DeviceMesh of this run's topology (labkit.topology(): labkit.run's
    nodes=, or torchrun's), made once per process; a collective the first time (every rank calls
    it). Dim 0 is across nodes (HSDP's "replicate"), dim 1 within a node ("shard")."""
    from torch.distributed.device_mesh import init_device_mesh
    from labkit.launch.topology import current

    topo = current()
    n = dist.get_world_size()
    per = topo.ranks_per_node if n % topo.ranks_per_node == 0 else n
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    key = (device_type, n // per, per, tuple(mesh_dim_names), id(dist.group.WORLD))
    if key not in _meshes:
        _meshes[key] = init_device_mesh(device_type, (n // per, per), mesh_dim_names=mesh_dim_names)
    return _meshes[key]


def mesh_groups(mesh: Any, name: str = NAME) -> tuple[Any, Any]:
    """(across-nodes group, within-node group) of a 2-D mesh; refuses any other mesh."""
    if getattr(mesh, "ndim", None) != 2:
        raise ValueError(f"{name}: mesh must be a 2-D DeviceMesh (across nodes, within a node), got {mesh!r}")
    return mesh.get_group(0), mesh.get_group(1)


class HierarchicalHandle:
    """The three steps' handles; wait() waits for all (the first error raises) and copies a
    padded result back into the caller's tensor."""

    def __init__(self, handles: list[Any], finish: Optional[Callable[[], Any]] = None) -> None:
        self.handles, self._finish = handles, finish

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self.handles)

    def wait(self, timeout: Optional[float] = None) -> bool:
        error = None
        for h in self.handles:
            try:
                h.wait(timeout)
            except Exception as exc:  # wait for every step, so no buffer is freed mid-flight
                error = error or exc
        if error is not None:
            raise error
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


def hierarchical_all_reduce(
    tensor: torch.Tensor,
    op: Op = "sum",
    group: Group = None,
    async_op: bool = False,
    verify: Optional[bool] = None,
    *,
    mesh: Any = None,
) -> Optional[HierarchicalHandle]:
    """All-reduce `tensor` in place over every rank, in two levels (see the module docstring).
    group: only None (every rank; the levels come from `mesh`, default node_mesh())."""
    check_tensor(tensor, "tensor", NAME)
    op = resolve_op(op, tensor.dtype, NAME)
    if group is not None:
        raise ValueError(f"{NAME}: reduces over every rank of the mesh; pass mesh=, not group=")
    across, within = mesh_groups(mesh if mesh is not None else node_mesh(tensor.device.type))
    per = dist.get_world_size(within)
    numel = tensor.numel()
    chunk = -(-numel // per)
    finish = None
    if tensor.is_contiguous() and numel == chunk * per:
        flat = tensor.view(-1)
    else:  # pad (and make contiguous), copy back once the all-gather has landed
        flat = torch.zeros(chunk * per, dtype=tensor.dtype, device=tensor.device)
        flat[:numel].copy_(tensor.reshape(-1))
        finish = lambda: tensor.copy_(flat[:numel].view_as(tensor))  # noqa: E731
    shard = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)
    # Queued together: the comm thread runs them in this order, each reading what the last wrote.
    handles = [
        ring_reduce_scatter(shard, flat, op=op, group=within, async_op=True, verify=verify),
        ring_all_reduce(shard, op=op, group=across, async_op=True, verify=verify),
        ring_all_gather(flat, shard, group=within, async_op=True, verify=verify),
    ]
    handle = HierarchicalHandle(handles, finish)
    if async_op:
        return handle
    handle.wait()
    return None
