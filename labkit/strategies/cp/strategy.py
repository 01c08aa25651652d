"""The loop strategy "cp": context parallelism on TinyGPT, every rank a piece of every sequence.

    loop.train("cp", cfg)          # 2 ranks: cp=2, zigzag (cp=, layout= to choose)

The ranks form a ("dp", "cp") DeviceMesh of (world_size / cp, cp). The cp ranks of one dp
coordinate read the same rows (data_rank / data_world_size are the "dp" coordinates) and each
runs the model on its layout piece of them (gpt.parallelize_cp: attention by ring over "cp"). Its
loss is the sum of its piece's token losses over the global token count, so the cp ranks' losses
and gradients add up to the replica's: after the last backward every gradient is summed over all
ranks (cp pieces and dp replicas, labkit's ring all-reduce by default, comm=), and
forward_backward returns the replica's loss (its pieces' summed over "cp"), as the loop counts it.
The parameters stay whole on every rank. Mixed precision (mp_policy=MixedPrecision): the pieces
compute in param_dtype (ring attention's running max and sum too), fp32 masters step
(precision.WithMasters), the gradients' all-reduce in reduce_dtype. What it leaves out: reduce_op "avg",
CP x TP, activation checkpointing inside ring attention (cfg.activation_checkpointing raises).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.observe import tracing
from labkit.preset import Preset
from labkit.strategies import KeepsReduced, LossFn, MicroBatches, Strategy, Watch, unwatched
from labkit.strategies.comm_choice import choose
from labkit.strategies.cp.gpt import parallelize_cp
from labkit.strategies.cp.layout import check_layout, chunk_len
from labkit.strategies.precision import WithMasters, check_policy
from labkit.strategies.mesh import device_mesh

__all__ = ["CP"]

DIMS = ("dp", "cp")


class CP(KeepsReduced, WithMasters, Strategy):
    """The loop strategy "cp" (the module docstring): cp ranks per replica (default: every rank),
    layout "zigzag" (or "contiguous"), comm= for the gradients' all-reduce."""

    # The mesh dim whose ranks hold pieces of one replica's rows (ulysses.Ulysses: "ulysses").
    axis = "cp"

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        cp: int | None = None,
        layout: str = "zigzag",
        reduce_op: str = "sum",
        mp_policy: object = None,
        comm: str = "ring",
    ) -> None:
        check_policy(mp_policy, "cp")
        if reduce_op != "sum":
            raise ValueError(
                f"cp: reduce_op must be 'sum' (each rank's loss is its tokens' share), got {reduce_op!r}"
            )
        if cfg.activation_checkpointing:
            raise NotImplementedError("cp: activation checkpointing is left out")
        self.collectives = choose(comm, "cp")
        self.layout = check_layout(layout, "cp")
        world = dist.get_world_size()
        self.mesh: DeviceMesh = device_mesh(model, "cp", (("dp", None), ("cp", world if cp is None else cp)))
        chunk_len(cfg.seq_len, self.layout, self.mesh["cp"].size(), "cp")  # the rows cut into its chunks
        self.model = parallelize_cp(model, self.mesh["cp"].get_group(), layout)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = self.optimizer_for(cfg, trainable, mp_policy, "cp")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on this rank's piece (cp_forward). Its loss is the piece's: the
        loop's reduction="sum" (summed over "cp" by forward_backward) is the only one accepted with
        targets; a "mean" would be this piece's mean, not the sequence's (refused, not wrong)."""
        has_targets = len(args) > 1 and args[1] is not None or kwargs.get("targets") is not None
        reduction = args[2] if len(args) > 2 else kwargs.get("reduction", "mean")
        if has_targets and reduction != "sum":
            raise ValueError(
                f"{self.axis}: the strategy's forward sees only this rank's piece of every sequence, so a "
                f"reduction={reduction!r} loss would be the piece's, not one process's; use "
                f"reduction='sum' and add it over the {self.axis} ranks (forward_backward does), or evaluate "
                f"a plain TinyGPT loaded with full_state_dict()"
            )
        self.resume_accumulation()
        return self.model(*args, **kwargs)

    def data_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    def data_world_size(self) -> int:
        return self.mesh["dp"].size()

    def forward_backward(
        self, batch: MicroBatches, loss_fn: LossFn, *, scale: float = 1, watch: Watch = unwatched
    ) -> torch.Tensor:
        """Strategy's forward_backward on this rank's pieces, then the replica's loss: the pieces'
        losses summed over the axis ("cp") (not the strategy's traffic: untraced)."""
        total = super().forward_backward(batch, loss_fn, scale=scale, watch=watch)
        with tracing.untraced():
            dist.all_reduce(total, group=self.mesh[self.axis].get_group())
        return total

    def after_backward(self) -> None:
        # Every rank's gradient is its pieces' part of its replica's: summed over every rank.
        if self.mp is not None:  # in reduce_dtype, into the fp32 masters' gradients
            self.into_masters(lambda g: self.collectives.all_reduce(g, op="sum"))
        else:
            for p in self.model.parameters():
                if p.grad is not None:
                    self.collectives.all_reduce(p.grad, op="sum")
        self.mark_reduced()  # a later backward without zero_grad adds to these (KeepsReduced)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.trained_state().items()}

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        return {n: g.detach().clone() for n, g in self.trained_grads().items()}
