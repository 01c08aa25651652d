"""PyTorch's own ZeRO-1 behind the labkit.strategies interface ("torch-zero1"): the oracle the
hand-written zero1 is checked against, on the same loop, model, data and optimizer.

DistributedDataParallel (AVG all-reduce) + ZeroRedundancyOptimizer, which shards the optimizer by
whole tensors and expects the gradients already identical on every rank (DDP makes them so); its
optimizer is the preset's class and kwargs. It averages, so the loop scales the loss by the world
size (exact for powers of two; for 3 ranks one rounding per element, far below fp32 tolerances).

What it leaves out: ZeroRedundancyOptimizer's overlap_with_ddp.
"""

from typing import Any

import torch

from labkit.strategies import Strategy
from labkit.strategies.ddp.torch_ref import TorchDDP, refuse_torch_options


class TorchZeRO1(Strategy):
    reduce_op = "avg"

    def __init__(
        self,
        model,
        cfg,
        bucket_cap_mb=25.0,
        find_unused_parameters=None,
        record=True,
        reduce_op="avg",
        mp_policy=None,
    ):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        refuse_torch_options("torch-zero1", reduce_op, mp_policy)
        if find_unused_parameters is None:
            find_unused_parameters = cfg.has_unused_parameters
        self.ddp = TorchDDP(
            model,
            bucket_cap_mb=bucket_cap_mb,
            record=record,
            find_unused_parameters=find_unused_parameters,
            mp_policy=mp_policy,
        )
        self.ddp.label = "torch-zero1"
        self.module, self.model = model, self.ddp.model  # forward through DDP's wrapper
        self.zero = ZeroRedundancyOptimizer(
            [p for p in model.parameters() if p.requires_grad],
            optimizer_class=cfg.optimizer,
            **cfg.optimizer_kwargs,
        )
        self.optimizer = self.zero.optim  # this rank's local optimizer: what holds the state

    def no_sync(self) -> Any:  # DDP's context manager
        return self.ddp.no_sync()

    def after_backward(self) -> None:
        self.ddp.after_backward()  # a parameter without a gradient: named, as torch-ddp does

    def step(self) -> None:
        self.zero.step()

    def zero_grad(self) -> None:
        self.zero.zero_grad(set_to_none=True)

    def replica(self) -> torch.nn.Module:
        return self.module  # self.model is the DDP wrapper

    def held_grads(self) -> list[torch.Tensor]:
        """Every parameter's .grad (DDP's whole, averaged ones): the local optimizer steps only
        this rank's partition, but full_grad_dict reports them all, clipped alike."""
        return [p.grad for p in self.module.parameters() if p.grad is not None]
