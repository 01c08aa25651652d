"""One parameter of labkit.strategies.fsdp (FSDP2's FSDPParam, by hand): its dim-0 shard, the
unsharded parameter autograd uses, and the storage trick that frees the latter between uses.

    p = FSDPParam(param, slots, names, rank, world_size)
    p.padded       # (rows_per_rank, *param.shape[1:]): this rank's rows, zero padding (collectives)
    p.sharded      # nn.Parameter, a DTensor (Shard(0) on the mesh; HSDP: Replicate(), Shard(0)) of
                   # the global shape whose local tensor is p.padded[:p.valid] (fully_shard's way)
    p.unsharded    # nn.Parameter of param.shape whose storage is 0 bytes unless the unit is gathered

Sharding (torch.chunk's split, padded): rows_per_rank = ceil(dim0 / N); rank k holds rows
[k * rows_per_rank, (k + 1) * rows_per_rank) of the parameter padded with zero rows to
N * rows_per_rank, so every rank's shard has the same shape (an all-gather needs equal pieces).
A 0-dim parameter is sharded as a 1-element vector (its DTensor has shape (1,); fully_shard
refuses scalars). The module holds p.sharded between uses, so torch's own tools (clip_grad_norm_,
get_model_state_dict, torch.distributed.checkpoint, optimizers) see the whole model, as they do
under fully_shard; the hand-written collectives work on p.padded, which the DTensor's local rows
view (an optimizer step on the DTensor writes into it; padding stays zero).

The storage trick: the unsharded parameter is a view of one padded buffer (N * rows_per_rank rows)
whose storage is resized to 0 bytes on reshard and back on unshard. The tensor objects never
change, so what autograd saved for backward (the weight a Linear saved) stays valid, costs nothing
while resharded, and sees the data again once the pre-backward all-gather refills the storage.
Copying into it bumps the tensors' version counter, which autograd would read as "modified in
place after being saved": the copy runs under _unsafe_preserve_version_counter, as FSDP2's does.

Also here: the
batched all-gather layout shared by unshard, full state and full gradients (one buffer per unit,
rank-major: chunk k holds every parameter's k-th shard).
FSDP x TP (TPLayout, tp_layout): a tensor-parallel DTensor parameter (Shard(d) or Replicate() on
"tp"; other placements raise) is sharded as its TP-local tensor (the unsharded parameter is that
local tensor), its shard a DTensor on the 2-D ("dp", "tp") mesh with fully_shard's placements,
which describe it exactly (DTensor.full_tensor() gives the whole tensor).
CPU offload (offload.py, offload= a CPUOffloadPolicy): the padded shard (and so the DTensor's local
rows, the optimizer's parameter) is a host copy; the unsharded buffer stays on the device, which
`device` names (the parameter's device when it was sharded).
What it leaves out: sharding along another dim, unpadded collectives, loading whole
tensors into an FSDP x TP parameter (fully_shard.py raises NotImplementedError).
"""

import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.strategies.comm_choice import Collectives, Ring
from labkit.strategies.fsdp.offload import CPUOffloadPolicy, to_host

ALIGN = 16  # bytes: pieces of a mixed-dtype (byte) buffer start aligned, so .view(dtype) works


def free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def alloc_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


class FSDPParam:
    """One parameter: `slots` lists every (module, attribute) that holds it (a weight tied inside
    one unit has two), `names` its state_dict keys."""

    def __init__(self, param, slots, names, rank, world_size, param_dtype=None, mesh=None, placements=None):
        self.slots, self.names, self.world_size = slots, names, world_size
        # FSDP x TP: a tensor-parallel DTensor (parallelize_by_hand's) is sharded as its TP-local
        # tensor, which is also what the unsharded parameter is (the TP forward computes on it).
        self.group: Any = None  # its FSDPParamGroup (group.py sets it)
        self.original: Any = None  # a weak reference to the parameter it sharded (fully_shard.py)
        self.tp = tp_layout(param, mesh, placements)
        if self.tp is not None:
            param = param.to_local()
            mesh, placements = self.tp.mesh, self.tp.placements
        self.shape = param.shape  # global (unpadded) torch.Size; FSDP x TP: the TP-local one
        self.dim0 = self.shape[0] if self.shape else 1
        self.rest = self.shape[1:]
        self.rows = -(-self.dim0 // world_size)  # rows_per_rank = ceil(dim0 / N)
        self.numel = self.rows * math.prod(self.rest)  # elements of one shard
        rows = param.detach().reshape(self.dim0, *self.rest)
        start = min(rank * self.rows, self.dim0)
        end = min(start + self.rows, self.dim0)
        self.valid = end - start  # this rank's real rows (torch.chunk's split); the rest is padding
        shard = torch.zeros((self.rows, *self.rest), dtype=param.dtype, device=param.device)
        shard[: end - start].copy_(rows[start:end])
        self.device = param.device  # where it computes (and gathers); the shard may be on the host
        self.offload: Optional[CPUOffloadPolicy] = None
        # The padded shard: what the collectives read and write (every rank's the same shape).
        self.padded = shard
        self.mesh, self.placements = mesh, placements
        # What torch's tools see (fully_shard's way): a DTensor of the global shape (a 0-dim
        # parameter as shape (1,)) whose local tensor is this rank's real rows, a view of the
        # padded shard; without a mesh (a bare FSDPParam) the padded shard itself.
        self.sharded = nn.Parameter(self.to_dtensor(shard), requires_grad=param.requires_grad)
        self.requires_grad = param.requires_grad
        self.unsharded_dtype = param_dtype or param.dtype
        self.padded_full = torch.empty(
            (world_size * self.rows, *self.rest), dtype=self.unsharded_dtype, device=param.device
        )
        # A leaf parameter (autograd accumulates its .grad) that views the padded buffer.
        self.unsharded = nn.Parameter(
            self.padded_full[: self.dim0].view(self.shape), requires_grad=param.requires_grad
        )
        free_storage(self.padded_full)
        self.use_sharded()

    def offload_shard(self, policy: CPUOffloadPolicy) -> None:
        """CPU offload: the padded shard (and so the parameter the optimizer steps) moves to a new
        host copy; the unsharded buffer stays on `device`. Right after __init__, before any step."""
        self.offload = policy
        self.padded = to_host(self.padded, policy)
        self.sharded = nn.Parameter(self.to_dtensor(self.padded), requires_grad=self.requires_grad)
        self.use_sharded()

    def to_dtensor(self, padded: torch.Tensor) -> torch.Tensor:
        """A (rows, *rest) padded shard (or gradient) as what the model's parameter is: a DTensor
        of the global shape over this rank's real rows (a view, no copy), or `padded` itself."""
        if self.mesh is None:
            return padded
        from torch.distributed.tensor import DTensor

        shape = self.shape if self.shape else torch.Size([1])
        if self.tp is not None:
            shape = self.tp.shape
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        return DTensor.from_local(
            padded[: self.valid],
            self.mesh,
            self.placements,
            run_check=False,
            shape=shape,
            stride=stride,
        )

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """The plain local rows of `tensor` (a DTensor shaped like the parameter, or a plain one)."""
        to_local = getattr(tensor, "to_local", None)
        return to_local() if to_local is not None else tensor

    def pad(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (the parameter's DTensor, its gradient or optimizer state, or a padded shard)
        as this rank's padded (rows, *rest) shard: a new tensor unless it is one already."""
        local = self.local(tensor)
        if local.shape == (self.rows, *self.rest):
            return local
        padded = local.new_zeros((self.rows, *self.rest))
        padded[: local.shape[0]].copy_(local)
        return padded

    def aliases_padded(self) -> bool:
        """Whether the parameter's local rows still live in the padded shard (False after
        m.double(), m.to(...) or a .data assignment replaced them)."""
        local = self.local(self.sharded)
        if local.dtype != self.padded.dtype or local.device != self.padded.device:
            return False
        if local.numel() == 0:
            return True
        return local.untyped_storage().data_ptr() == self.padded.untyped_storage().data_ptr()

    @property
    def padding_rows(self) -> int:
        return self.world_size * self.rows - self.dim0

    def use_sharded(self) -> None:
        self._set(self.sharded)

    def use_unsharded(self) -> None:
        self._set(self.unsharded)

    def _set(self, tensor):
        # Straight into _parameters: what fully_shard does too (no module __setattr__ hooks).
        for module, attr in self.slots:
            module._parameters[attr] = tensor

    def copy_out(self, pieces: torch.Tensor) -> None:
        """Refill the unsharded storage from the gathered pieces ((N, numel): rank k's shard)."""
        alloc_storage(self.padded_full)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.unsharded):
            self.padded_full.view(self.world_size, self.numel).copy_(pieces)

    def free(self) -> None:
        free_storage(self.padded_full)

    def padded_grad(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """grad (the unsharded parameter's) as (N, numel) pieces in `dtype`: rank k's rows, zero
        rows where the shard is padding."""
        flat = grad.reshape(self.dim0, -1)
        if self.padding_rows or flat.dtype != dtype:
            padded = torch.zeros(
                (self.world_size * self.rows, flat.shape[1]), dtype=dtype, device=grad.device
            )
            padded[: self.dim0].copy_(flat)
            flat = padded
        return flat.reshape(self.world_size, self.numel)

    def full_from(self, pieces: torch.Tensor) -> torch.Tensor:
        """The whole parameter (padding dropped) from (N, numel) gathered pieces; a new tensor."""
        return (
            pieces.reshape(self.world_size * self.rows, *self.rest)[: self.dim0].reshape(self.shape).clone()
        )


class TPLayout:
    """Where an FSDP x TP parameter lives: the 2-D ("dp", "tp") mesh, the 2-D placements of its
    DTensor (torch's fully_shard's over a TP parameter), the TP placements and the global shape."""

    def __init__(
        self,
        mesh: Any,
        placements: tuple[Any, ...],
        tp_mesh: Any,
        tp_placements: tuple[Any, ...],
        shape: torch.Size,
    ) -> None:
        self.mesh, self.placements = mesh, placements
        self.tp_mesh, self.tp_placements, self.shape = tp_mesh, tp_placements, shape

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from this rank's TP-local one (a collective over "tp": DTensor's)."""
        from torch.distributed.tensor import DTensor

        stride = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        dtensor = DTensor.from_local(
            local, self.tp_mesh, self.tp_placements, run_check=False, shape=self.shape, stride=stride
        )
        return dtensor.full_tensor()


def tp_layout(param: torch.Tensor, mesh: Any, placements: Any) -> TPLayout | None:
    """None for a plain parameter; for a tensor-parallel DTensor (on a 1-D "tp" mesh, sharded here
    over the 1-D `mesh`), its TPLayout. Placements of the 2-D DTensor, as fully_shard makes them:
    tp Shard(0) -> (_StridedShard(0, split_factor=tp), Shard(0)) (dp shards the tp piece's rows);
    tp Shard(d > 0) -> (Shard(0), Shard(d)); Replicate() -> (Shard(0), Replicate()). All three are
    exact: the 2-D DTensor's full_tensor() is the TP DTensor's. Any other TP placement raises: a
    _StridedShard one (say, each third of a fused [q; k; v] sharded over "tp") has no exact 2-D
    placement once "dp" cuts its local rows, so its full_tensor() would misplace rows (TinyGPT's
    qkv is permuted into head-grouped rows and sharded Shard(0) instead: tp/gpt.py)."""
    from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(param, DTensor):
        return None
    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    if mesh is None or mesh.ndim != 1 or tp_mesh.ndim != 1:
        raise ValueError(
            f"fully_shard_by_hand: a tensor-parallel parameter ({tp_placements} on {tp_mesh!r}) "
            f"is sharded over a 1-D mesh= (mesh['dp'] of a ('dp', 'tp') mesh), got {mesh!r}"
        )
    root = mesh._get_root_mesh()
    names: tuple[Any, ...] = tuple(root.mesh_dim_names or (None, None))
    dp_name, tp_name = (mesh.mesh_dim_names or (None,))[0], (tp_mesh.mesh_dim_names or (None,))[0]
    same_root = root == tp_mesh._get_root_mesh()
    if root.ndim > 2 and {dp_name, tp_name} <= set(names):
        # a 3-D ("dp", "pp", "tp") mesh (labkit.strategies.three_d): the (dp, tp) plane of this rank.
        # Compared by ranks: torch maps a sub-mesh to its root by equality, so an equal "tp" row
        # of an earlier 3-D mesh (another strategy built in this process) may report that root.
        root = root[dp_name, tp_name]
        names = (dp_name, tp_name)
        same_root = root[tp_name].mesh.tolist() == tp_mesh.mesh.tolist()
    if (
        not same_root
        or root.ndim != 2
        or (mesh.mesh_dim_names or (None,))[0] != names[0]
        or (tp_mesh.mesh_dim_names or (None,))[0] != names[1]
    ):
        raise ValueError(
            f"fully_shard_by_hand: mesh= and the tensor-parallel parameters' mesh must be the two "
            f"dims (dp, tp) of one 2-D DeviceMesh: mesh=mesh2d['dp'] after parallelizing on "
            f"mesh2d['tp']; got {mesh!r} and {tp_mesh!r}"
        )
    (tp,) = tp_placements
    n = tp_mesh.size()
    dp: Placement
    if type(tp) is Shard and tp.dim == 0:
        dp = _StridedShard(0, split_factor=n)
    elif type(tp) is Shard or type(tp) is Replicate:
        dp = Shard(0)
    else:
        raise ValueError(
            f"fully_shard_by_hand: a tensor-parallel placement {tp} is not handled (only Shard(d) "
            f"and Replicate() have an exact placement on the 2-D mesh once 'dp' shards them)"
        )
    return TPLayout(root, (dp, tp), tp_mesh, tp_placements, param.shape)


class Layout:
    """Where each of a list of tensors (numel, dtype) sits in one rank's chunk of a batched buffer.
    One dtype: a buffer of that dtype; several: a byte buffer, pieces 16-byte aligned (FSDP2's
    foreach_all_gather does the same), so a unit may mix dtypes."""

    def __init__(self, entries):
        dtypes = {dtype for _, dtype in entries}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
        self.offsets, offset = [], 0
        for numel, dtype in entries:
            if self.dtype == torch.uint8:
                offset = -(-offset // ALIGN) * ALIGN
                size = numel * dtype.itemsize
            else:
                size = numel
            self.offsets.append((offset, size, dtype, numel))
            offset += size
        if self.dtype == torch.uint8:
            offset = -(-offset // ALIGN) * ALIGN
        self.chunk = offset  # elements (bytes for a byte buffer) per rank

    def piece(self, buffer2d: torch.Tensor, i: int) -> torch.Tensor:
        """Entry i's (N, numel) view of a (N, chunk) buffer, in the entry's own dtype."""
        offset, size, dtype, _ = self.offsets[i]
        view = buffer2d[:, offset : offset + size]
        return view.view(dtype) if self.dtype == torch.uint8 else view


def batched_all_gather(
    layout: "Layout",
    tensors: Sequence[torch.Tensor],
    group: Any,
    device: torch.device,
    async_op: bool,
    observe: Optional[Callable[..., None]] = None,
    comm: Optional[Collectives] = None,
) -> tuple[torch.Tensor, Any]:
    """Copy `tensors` (this rank's pieces, any shape, matching layout) into this rank's chunk of one
    (N, chunk) buffer and all-gather it over `group` (N its size) with `comm`'s all-gather (a
    labkit.strategies.comm_choice.Collectives; None: labkit's ring): (buffer2d, handle or None)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    buffer = torch.empty(world_size * layout.chunk, dtype=layout.dtype, device=device)
    if observe is not None:
        observe("tag", "all_gather", buffer)
    buffer2d = buffer.view(world_size, layout.chunk)
    with torch.no_grad():
        for i, tensor in enumerate(tensors):
            layout.piece(buffer2d, i)[rank].copy_(tensor.reshape(-1))
    comm = comm if comm is not None else Ring()
    handle = comm.all_gather(buffer, buffer2d[rank], group=group, async_op=async_op)
    return buffer2d, handle
