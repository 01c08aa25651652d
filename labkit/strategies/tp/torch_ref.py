"""PyTorch's own tensor parallelism behind the labkit.strategies interface, the oracles of "tp",
"sp" and "fsdp-tp": "torch-tp" (parallelize_module with ColwiseParallel / RowwiseParallel on gpt.py's
plan), "torch-sp" (the same with gpt.py's sequence-parallel plan: SequenceParallel and Shard(1)
layouts) and "torch-fsdp-tp" (the same, then fully_shard(mesh["dp"]) on every block and the root).

torch's ColwiseParallel hands rank t torch.chunk's t-th rows of a weight; TinyGPT's fused qkv is
[q; k; v], so gpt.parallelize_gpt(..., by="torch") first permutes its rows (and bias) into
[q_0; k_0; v_0; q_1; ...] (gpt.qkv_order): rank t's chunk is then its heads' q, k, v, exactly as
in the hand-written strategies (which permute the same way), so ours and these hold the same
DTensors. AdamW is elementwise, so training the permuted tensor is training the original one;
full_state_dict / full_grad_dict put the rows back (gpt.original_order). The attention computes
its local heads (gpt.localize_heads), as in the hand-written one. fully_shard averages the
gradients over "dp": reduce_op "avg" (the loop scales the loss by the dp size); torch-tp alone
reduces nothing (tp must be the world size, so "sum" and "avg" are the same).
Mixed precision: torch-tp / torch-sp compute in param_dtype with fp32 masters (the same casts as
"tp" and the reference: precision.WithMasters over torch's DTensors); torch-fsdp-tp passes
fully_shard a MixedPrecisionPolicy(param_dtype, reduce_dtype), as torch-fsdp does.
What it leaves out: dp without fully_shard (torch-tp with tp < world size).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.preset import Preset
from labkit.strategies.tp.gpt import check_gpt, parallelize_gpt
from labkit.strategies.precision import check_policy
from labkit.strategies import check_reduce_op
from labkit.strategies.mesh import device_mesh
from labkit.strategies.tp.strategy import _WholeReplica, tp_dims

__all__ = ["TorchFSDPTP", "TorchSP", "TorchTP"]


class TorchTP(_WholeReplica):
    """The loop strategy "torch-tp": torch's parallelize_module on gpt.py's plan, every rank tp."""

    reduce_op = "sum"
    name = "torch-tp"
    sequence_parallel = False

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        tp: int | None = None,
        mesh: DeviceMesh | None = None,
        reduce_op: str = "sum",
        mp_policy: object = None,
    ) -> None:
        name = self.name
        self.mp_policy = check_policy(mp_policy, name)
        # Nothing is reduced over dp (dp = 1): summing and averaging over one replica are the same.
        check_reduce_op(reduce_op, f"{name}: reduce_op")
        self.reduce_op = reduce_op
        self.mesh = device_mesh(model, name, tp_dims(tp, mesh, dist.get_world_size()), mesh)
        if self.mesh["dp"].size() != 1:
            raise ValueError(
                f"{name}: tp={self.mesh['tp'].size()} on {dist.get_world_size()} ranks leaves "
                f"dp={self.mesh['dp'].size()}; data parallelism with it is torch-fsdp-tp"
            )
        self._build(model, cfg)

    def _build(self, model: nn.Module, cfg: Preset) -> None:
        check_gpt(model, self.mesh["tp"].size(), type(self).__name__)
        self.model, self.tp = model, self.mesh["tp"].size()
        parallelize_gpt(model, self.mesh["tp"], by="torch", sequence_parallel=self.sequence_parallel)
        self._shard()
        trainable = [p for p in model.parameters() if p.requires_grad]
        if self.fully_shards:  # fully_shard keeps fp32 shards: the policy is its MixedPrecisionPolicy
            self.optimizer = cfg.make_optimizer(trainable)
        else:
            self.optimizer = self.optimizer_for(cfg, trainable, self.mp_policy, self.name)

    fully_shards = False

    def _shard(self) -> None:
        pass

    def after_backward(self) -> None:
        self.into_masters()  # no dp reduction (dp = 1): the 16-bit gradients into the fp32 masters


class TorchSP(TorchTP):
    """The loop strategy "torch-sp", the oracle of "sp": torch's parallelize_module on gpt.py's SP
    plan (SequenceParallel() on the blocks' LayerNorms, ColwiseParallel(input_layouts=Shard(1)),
    RowwiseParallel(output_layouts=Shard(1)), PrepareModuleInput at block 0 and ln_f), every rank tp."""

    name = "torch-sp"
    sequence_parallel = True


class TorchFSDPTP(TorchTP):
    """The loop strategy "torch-fsdp-tp": torch-tp's split on mesh["tp"], then torch's fully_shard
    over mesh["dp"] on every block, then the root (default tp=2)."""

    reduce_op = "avg"
    name = "torch-fsdp-tp"

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        tp: int | None = None,
        mesh: DeviceMesh | None = None,
        reduce_op: str = "avg",
        mp_policy: object = None,
    ) -> None:
        self.mp_policy = check_policy(mp_policy, "torch-fsdp-tp")
        if reduce_op != "avg":
            raise ValueError(f"torch-fsdp-tp: reduce_op must be 'avg' (fully_shard's), got {reduce_op!r}")
        self.mesh = device_mesh(model, "torch-fsdp-tp", tp_dims(tp, mesh, 2), mesh)
        self._build(model, cfg)

    fully_shards = True

    def _shard(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = self.mp_policy
        policy = (
            MixedPrecisionPolicy()
            if mp is None
            else MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
        )
        for block in self.model.blocks:
            fully_shard(block, mesh=self.mesh["dp"], mp_policy=policy)
        fully_shard(self.model, mesh=self.mesh["dp"], mp_policy=policy)

    def after_backward(self) -> None:
        pass

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:  # as TorchFSDP's
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
