"""PyTorch's own tensor parallelism behind the labkit.strategies interface, the oracles of "tp"
and "fsdp-tp": "torch-tp" (parallelize_module with ColwiseParallel / RowwiseParallel on gpt.py's
plan) and "torch-fsdp-tp" (the same, then fully_shard(mesh["dp"]) on every block and the root).

torch's ColwiseParallel hands rank t torch.chunk's t-th rows of a weight; TinyGPT's fused qkv is
[q; k; v], so its rows (and bias) are first permuted into [q_0; k_0; v_0; q_1; ...]
(gpt.qkv_order): rank t's chunk is then its heads' q, k, v. AdamW is elementwise, so training the
permuted tensor is training the original one; full_state_dict / full_grad_dict put the rows back
(gpt.unpermute_qkv). The attention computes its local heads (gpt.localize_heads), as in the
hand-written one. fully_shard averages the gradients over "dp": reduce_op "avg" (the loop scales
the loss by the dp size); torch-tp alone reduces nothing (tp must be the world size, so "sum" and
"avg" are the same).
What it leaves out: mixed precision, dp without fully_shard (torch-tp with tp < world size).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.preset import Preset
from labkit.strategies import Strategy
from labkit.strategies.tp.gpt import check_gpt, gpt_plan, localize_heads, qkv_order, unpermute_qkv
from labkit.strategies.tp.strategy import _DataCoordinates, _refuse_mp, full, tp_mesh

__all__ = ["TorchFSDPTP", "TorchTP"]


def _torch_parallelize(model: nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    plan = gpt_plan(model)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, style in plan.items():
            if style == "qkv":
                linear = modules[name]
                order = qkv_order(linear.out_features, tp)
                linear.weight.copy_(linear.weight[order])
                linear.bias.copy_(linear.bias[order])
    styles = {"qkv": ColwiseParallel, "colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {name: styles[style]() for name, style in plan.items()})
    localize_heads(model, tp)


class TorchTP(_DataCoordinates, Strategy):
    """The loop strategy "torch-tp": torch's parallelize_module on gpt.py's plan, every rank tp."""

    reduce_op = "sum"

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        tp: int | None = None,
        mesh: DeviceMesh | None = None,
        reduce_op: str = "sum",
        mp_policy: object = None,
    ) -> None:
        _refuse_mp(mp_policy, "torch-tp")
        # Nothing is reduced over dp (dp = 1): summing and averaging over one replica are the same.
        if reduce_op not in ("sum", "avg"):
            raise ValueError(f"torch-tp: reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
        self.reduce_op = reduce_op
        self.mesh = tp_mesh(model, tp, mesh, "torch-tp", dist.get_world_size())
        if self.mesh["dp"].size() != 1:
            raise ValueError(
                f"torch-tp: tp={self.mesh['tp'].size()} on {dist.get_world_size()} ranks leaves "
                f"dp={self.mesh['dp'].size()}; data parallelism with it is torch-fsdp-tp"
            )
        self._build(model, cfg)

    def _build(self, model: nn.Module, cfg: Preset) -> None:
        check_gpt(model, self.mesh["tp"].size(), type(self).__name__)
        self.model, self.tp = model, self.mesh["tp"].size()
        self.qkv = {n for n, style in gpt_plan(model).items() if style == "qkv"}
        _torch_parallelize(model, self.mesh["tp"])
        self._shard()
        self.optimizer = cfg.make_optimizer([p for p in model.parameters() if p.requires_grad])

    def _shard(self) -> None:
        pass

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _whole(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        value = full(tensor)
        return unpermute_qkv(value, self.tp) if name.rpartition(".")[0] in self.qkv else value

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: self._whole(k, v) for k, v in self.model.state_dict().items()}

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        return {n: self._whole(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None}


class TorchFSDPTP(TorchTP):
    """The loop strategy "torch-fsdp-tp": torch-tp's split on mesh["tp"], then torch's fully_shard
    over mesh["dp"] on every block, then the root (default tp=2)."""

    reduce_op = "avg"

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        tp: int | None = None,
        mesh: DeviceMesh | None = None,
        reduce_op: str = "avg",
        mp_policy: object = None,
    ) -> None:
        _refuse_mp(mp_policy, "torch-fsdp-tp")
        if reduce_op != "avg":
            raise ValueError(f"torch-fsdp-tp: reduce_op must be 'avg' (fully_shard's), got {reduce_op!r}")
        self.mesh = tp_mesh(model, tp, mesh, "torch-fsdp-tp", 2)
        self._build(model, cfg)

    def _shard(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in self.model.blocks:
            fully_shard(block, mesh=self.mesh["dp"])
        fully_shard(self.model, mesh=self.mesh["dp"])

    def no_sync(self):  # noqa: ANN201  (a context manager, as TorchFSDP's)
        import contextlib

        @contextlib.contextmanager
        def off():
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)

        return off()
