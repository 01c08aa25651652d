"""The loop strategies "tp", "sp" and "fsdp-tp": Megatron's tensor parallelism on TinyGPT by hand
(gpt.py's plan through parallelize_by_hand), alone, with sequence parallelism ("sp": gpt.py's SP
plan, otherwise "tp"), or under fully_shard_by_hand over "dp".

    loop.train("tp", cfg)              # 2 ranks: tp=2 (default tp: every rank)
    loop.train("sp", cfg)              # 2 ranks: tp=2, the LayerNorms on half the sequence each
    loop.train("fsdp-tp", cfg)         # 4 ranks: ("dp", "tp") = 2 x 2 (default tp=2)

The ranks form a ("dp", "tp") DeviceMesh of (world_size / tp, tp) (or mesh=, a 2-D mesh with
those dim names). The tp ranks of one dp coordinate hold one replica split by heads and MLP
columns and read the same rows: data_rank() / data_world_size() are the "dp" coordinates, so
loop.train splits the batch over "dp" only and counts each replica's loss once.
"tp" with dp > 1 (tp < world size) reduces every gradient's local tensor over "dp" after the
last backward (data parallelism by hand, comm=: labkit's ring by default); "fsdp-tp" shards every unit (each block,
then the root) over "dp" with fully_shard_by_hand: the TP-local tensors along dim 0, the
replicated ones (embeddings, LayerNorms) whole-tensor along dim 0, every gradient reduce-scattered
over "dp" only.
Both split TinyGPT with gpt.parallelize_gpt: each block's fused qkv rows are permuted into
[q_0; k_0; v_0; q_1; ...] first (as torch-tp / torch-fsdp-tp do), so every parameter is a DTensor
with exact placements (Shard(0) / Shard(1) / Replicate() on "tp"; fully_shard's 2-D ones under
"fsdp-tp"), the same as the oracle's: DTensor.full_tensor() and get_model_state_dict(full_state_dict
=True) read the qkv in that head-grouped order on ours as on the oracle (tests/
test_tp_strategies.py; torch.distributed.checkpoint saves these same DTensors).
full_state_dict / full_grad_dict put the qkv rows back in [q; k; v] order (the one-process model's).
Mixed precision (mp_policy=MixedPrecision): "tp" / "sp" compute in param_dtype with fp32 masters
(precision.WithMasters, DTensor masters of the same placements), the dp all-reduce in
reduce_dtype; "fsdp-tp" passes the policy to FSDP (gathered in param_dtype, reduce-scattered in
reduce_dtype). The TP collectives inside forward and backward run in param_dtype, as Megatron's do.
What it leaves out: pipeline parallelism,
meshes of other dim names or more dimensions, clip_grad_norm_ over a whole TinyGPT: its
replicated parameters are plain tensors under "tp" (DTensors on mesh["dp"] under "fsdp-tp"), the
split ones DTensors on mesh["tp"] (the 2-D mesh), and torch's norm refuses to mix them (checked:
the same errors with torch-tp and torch-fsdp-tp; the all-split model of tests/test_tp.py clips
like torch on 2 ranks and on 2 x 2).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.preset import Preset
from labkit.strategies import Strategy, check_reduce_op
from labkit.strategies.comm_choice import choose
from labkit.strategies.fsdp.fully_shard import FSDP
from labkit.strategies.precision import WithMasters, check_policy
from labkit.strategies.tp.gpt import check_gpt, original_order, parallelize_gpt
from labkit.strategies.mesh import device_mesh

__all__ = ["FSDPTP", "SP", "TP", "full", "tp_dims"]

DIMS = ("dp", "tp")


def tp_dims(tp: int | None, mesh: DeviceMesh | None, default_tp: int) -> tuple[tuple[str, int | None], ...]:
    """The ("dp", "tp") axes for strategies.mesh.device_mesh: tp (its default without a mesh),
    dp the rest of the world."""
    return (("dp", None), ("tp", default_tp if tp is None and mesh is None else tp))


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor (a DTensor's full_tensor(), a collective over its mesh), detached, a copy."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


class _DataCoordinates:
    """data_rank / data_world_size: the "dp" coordinates of self.mesh."""

    mesh: DeviceMesh

    def data_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    def data_world_size(self) -> int:
        return self.mesh["dp"].size()


class _WholeReplica(_DataCoordinates, WithMasters, Strategy):
    """What "tp" and "torch-tp" share: the optimizer's step and zero_grad (on fp32 masters under
    mp_policy: WithMasters), and the full dicts read through the DTensors (full_tensor()), the
    qkv rows put back in [q; k; v] order."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        # Every parameter read from the parameter itself (its fp32 master under a policy), never
        # from the state dict's entry: SP's state dict gives qkv whole in [q; k; v] order but in
        # the compute dtype; the parameters are head-grouped, put back in order below.
        params = dict(self.model.named_parameters(remove_duplicate=False))
        whole = {}
        for key, value in self.model.state_dict(keep_vars=True).items():
            if key in params:
                value = params[key] if self.mp is None else self.mp.full_value(params[key])
            whole[key] = full(value)
        return original_order(whole, self.model, self.mesh["tp"].size())

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        whole = {n: full(g) for n, g in self.trained_grads().items()}
        return original_order(whole, self.model, self.mesh["tp"].size())


class TP(_WholeReplica):
    """The loop strategy "tp": parallelize_gpt(model, mesh["tp"]) (parallelize_by_hand on gpt.py's
    plan); the optimizer over the parameters (DTensors for the split layers, plain tensors for the
    rest)."""

    name = "tp"
    sequence_parallel = False

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        tp: int | None = None,
        mesh: DeviceMesh | None = None,
        reduce_op: str = "sum",
        mp_policy: object = None,
        comm: str = "ring",
    ) -> None:
        name = self.name
        check_policy(mp_policy, name)
        self.collectives = choose(comm, name)
        check_reduce_op(reduce_op, f"{name}: reduce_op")
        self.mesh = device_mesh(model, name, tp_dims(tp, mesh, dist.get_world_size()), mesh)
        check_gpt(model, self.mesh["tp"].size(), name)
        self.model, self.reduce_op = model, reduce_op
        parallelize_gpt(model, self.mesh["tp"], comm=comm, sequence_parallel=self.sequence_parallel)
        self.optimizer = self.optimizer_for(
            cfg, [p for p in model.parameters() if p.requires_grad], mp_policy, name
        )

    def after_backward(self) -> None:
        # Data parallelism over "dp" (tp < world size): each replica's gradients summed (the
        # loop's loss convention) or averaged; one tp rank's local pieces with its dp peers'.
        group = self.mesh["dp"].get_group()
        if self.mp is not None:  # in reduce_dtype, into the fp32 masters' gradients
            dp = self.data_world_size() > 1
            self.into_masters(
                lambda g: self.collectives.all_reduce(g, op=self.reduce_op, group=group) if dp else None
            )
            return
        if self.data_world_size() == 1:
            return
        for p in self.model.parameters():
            if p.grad is not None:
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                self.collectives.all_reduce(local, op=self.reduce_op, group=group)

    def sharded_parameters(self) -> list[torch.Tensor]:
        """What this rank holds: the split layers' local tensors and the replicated parameters."""
        return [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]


class SP(TP):
    """The loop strategy "sp": "tp" with Megatron's sequence parallelism (parallelize_gpt(...,
    sequence_parallel=True)): the blocks' LayerNorms on this rank's 1/tp of the sequence, each
    all-reduce a reduce-scatter + all-gather pair along the sequence. Default tp: every rank."""

    name = "sp"
    sequence_parallel = True


class FSDPTP(_DataCoordinates, FSDP):
    """The loop strategy "fsdp-tp": "tp"'s split on mesh["tp"], then FSDP (fully_shard_by_hand on
    the preset's units, then the root) over mesh["dp"]; FSDP's options (prefetch, ...) apply."""

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        tp: int | None = None,
        mesh: DeviceMesh | None = None,
        mp_policy: object = None,
        **options: Any,
    ) -> None:
        for taken in ("group", "like_torch"):
            if taken in options:
                raise TypeError(f"fsdp-tp: takes mesh= (the 2-D one) and tp=, not {taken}=")
        # comm= (FSDP's sharding option) also picks the TP all-reduces' collectives
        comm = choose(options.get("comm", "ring"), "fsdp-tp").name
        mesh2d = device_mesh(model, "fsdp-tp", tp_dims(tp, mesh, 2), mesh)
        check_gpt(model, mesh2d["tp"].size(), "fsdp-tp")
        parallelize_gpt(model, mesh2d["tp"], comm=comm)
        super().__init__(model, cfg, mesh=mesh2d["dp"], mp_policy=mp_policy, **options)
        self.mesh = mesh2d

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """FSDP's (gathered over "dp", then "tp"), the qkv rows in [q; k; v] order."""
        return original_order(super().full_state_dict(), self.model, self.mesh["tp"].size())

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        return original_order(super().full_grad_dict(), self.model, self.mesh["tp"].size())
