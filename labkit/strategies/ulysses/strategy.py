"""The loop strategy "ulysses": DeepSpeed-Ulysses sequence parallelism on TinyGPT.

    loop.train("ulysses", cfg)          # every rank: ulysses=world_size (ulysses= to choose)

The ranks form a ("dp", "ulysses") DeviceMesh of (world_size / ulysses, ulysses). The ulysses
ranks of one dp coordinate read the same rows and each runs the model on its contiguous T/n
positions of them (gpt.parallelize_ulysses: attention between two all-to-alls over "ulysses").
Everything else is cp's (the class CP, whose loop side it shares): each rank's loss is its
piece's token losses over the global token count; after the last backward every gradient is
summed over every rank (labkit's ring all-reduce by default, comm=); forward_backward returns the
replica's loss; mixed precision computes in param_dtype (the all-to-alls move 16-bit q, k, v),
fp32 masters step, the all-reduce in reduce_dtype. Activation checkpointing (cfg's) works as it
is, unlike cp's: a block's recompute in backward runs its 4 forward all-to-alls once more, on
every rank in the same order (12 per layer per step instead of 8). Refused, by name: a head count
or seq_len the degree does not divide, reduce_op "avg".
What it leaves out: GQA (TinyGPT has none), Ulysses x TP or x ring attention, ZeRO over the
gradients (DeepSpeed runs Ulysses with ZeRO: here they are all-reduced whole).
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.preset import Preset
from labkit.strategies.comm_choice import choose
from labkit.strategies.cp.strategy import CP
from labkit.strategies.mesh import device_mesh
from labkit.strategies.precision import check_policy
from labkit.strategies.ulysses.gpt import parallelize_ulysses

__all__ = ["Ulysses"]


class Ulysses(CP):
    """The loop strategy "ulysses" (the module docstring): ulysses ranks per replica (default:
    every rank), comm= for the gradients' all-reduce."""

    axis = "ulysses"

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        ulysses: int | None = None,
        reduce_op: str = "sum",
        mp_policy: object = None,
        comm: str = "ring",
    ) -> None:
        check_policy(mp_policy, "ulysses")
        if reduce_op != "sum":
            raise ValueError(
                f"ulysses: reduce_op must be 'sum' (each rank's loss is its tokens' share), got {reduce_op!r}"
            )
        self.collectives = choose(comm, "ulysses")
        world = dist.get_world_size()
        dims = (("dp", None), ("ulysses", world if ulysses is None else ulysses))
        self.mesh: DeviceMesh = device_mesh(model, "ulysses", dims)
        n = self.mesh["ulysses"].size()
        if cfg.seq_len % n:
            raise ValueError(
                f"ulysses: seq_len={cfg.seq_len} does not split over ulysses={n} ranks (each rank "
                f"holds seq_len / ulysses contiguous positions): it needs a multiple of {n}"
            )
        self.model = parallelize_ulysses(model, self.mesh["ulysses"].get_group())
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = self.optimizer_for(cfg, trainable, mp_policy, "ulysses")
