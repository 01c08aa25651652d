"""PyTorch's own pipeline parallelism behind the labkit.strategies interface: "torch-pp", the
oracle of "pp" (torch.distributed.pipelining: PipelineStage per model chunk, ScheduleGPipe /
Schedule1F1B / ScheduleInterleaved1F1B), on the same split of TinyGPT (gpt_sequential cut by
stage.split_sequential, chunks r, r+p, ... on rank r, as torch's interleaved schedule expects).
The zero-bubble names map to torch's zero-bubble classes, whose orders are schedule.py's (the
tests compare them action by action): "zb-h1" -> ScheduleInterleavedZeroBubble over one stage per
rank (torch's ZB1P; with one local stage it defers rank r's W by r, the paper's ZB-H1), "zbv" ->
ScheduleZBVZeroBubble (chunks r and 2p-1-r on rank r, torch's "v" placement). torch splits the
backward with stage_backward_input / stage_backward_weight (W starts from the gradients B kept at
the weight nodes' inputs, no second walk of the graph: pipeline_by_hand's W walks it again).

scale_grads=False, so the gradients are sums over the micro-batches, as the loop counts them.
torch's stages do not know about tied weights: the embedding / head weight's two gradients
(first and last stage) are summed as pipeline_by_hand does (PipelineByHand.sum_tied_grads,
torch's isend / irecv), this step's alone (summing_tied: 2 G after two steps without zero_grad).
The pipeline_by_hand object here only holds the split and that sum; torch runs the schedule.
TorchScheduled is that step, shared with three_d's TorchFSDPTPPP (fully_shard inside each stage):
the batch checked against the micro-batches (torch's split of a batch that does not divide would
leave the stages waiting), the schedule inside the tied sum, the last stage's loss shared. What it
leaves out: dp (torch-pp is one pipeline over every rank), mixed precision, torch's
ScheduleDualPipeV (no schedule of ours to compare it with).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.preset import Preset
from labkit.strategies import LossFn, MicroBatches, Watch, unwatched
from labkit.strategies.pp import schedule as sched
from labkit.strategies.pp.gpt import gpt_sequential
from labkit.strategies.pp.runtime import pipeline_by_hand
from labkit.strategies.pp.strategy import Pipelined, check_options

__all__ = ["TorchPP", "TorchScheduled", "torch_schedule"]


def torch_schedule(
    chunks: Sequence[nn.Module],
    *,
    schedule: str,
    n_microbatches: int,
    loss_fn: Any,
    group: Any = None,
    virtual_stages: int = 1,
) -> tuple[Any, list[int]]:
    """torch's schedule over this rank's chunks of `chunks` (all p*v of them, in order):
    (schedule object, this rank's chunk ids, in the schedule's placement). scale_grads=False:
    summed gradients. "zb-h1": ScheduleInterleavedZeroBubble over the one stage; "zbv":
    ScheduleZBVZeroBubble over chunks rank and 2p-1-rank."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    sched.check(schedule, p, n_microbatches, virtual_stages)
    ids = sched.chunks_of(rank, p, virtual_stages, schedule)
    params = [q for c in chunks for q in c.parameters()]
    device = params[0].device if params else torch.device("cpu")
    stages: list[Any] = [PipelineStage(chunks[c], c, len(chunks), device, group=group) for c in ids]
    if schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False), ids
    if schedule == "zb-h1":  # a list of stages, even of one: torch's ZB1P is a multi-stage schedule
        return ScheduleInterleavedZeroBubble(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False), ids
    if schedule == "zbv":
        return ScheduleZBVZeroBubble(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False), ids
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False), ids


class TorchScheduled(Pipelined):
    """What the strategies that run torch's schedule share ("torch-pp"; three_d's
    TorchFSDPTPPP, torch's fully_shard inside each stage): self.pipeline (pipeline_by_hand,
    comm="torch") holds the split and the tied weights' sum, torch's schedule runs the step.
    A subclass sets self.model, self.group and self.pipeline, then calls use_torch_schedule()
    (after whatever wraps the chunks in place: fully_shard)."""

    where = "torch-pp"

    def use_torch_schedule(self) -> None:
        """torch's schedule (pipeline's schedule name, n_microbatches, virtual_stages) over
        self.pipeline's chunks on self.group; this step's loss function goes in at each step."""
        name = self.pipeline.schedule_name
        self._loss_fn: Any = None  # set by every forward_backward (the loop's loss of that step)
        self.schedule, ids = torch_schedule(
            self.pipeline.chunks,
            schedule=name,
            n_microbatches=self.pipeline.n_microbatches,
            loss_fn=self._step_loss,
            group=self.group,
            virtual_stages=self.pipeline.virtual_stages,
        )
        self.first, self.last = 0 in ids, self.pipeline.n_chunks - 1 in ids

    def _step_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(out, y)

    def forward_backward(
        self, batch: MicroBatches, loss_fn: LossFn, *, scale: float = 1, watch: Watch = unwatched
    ) -> torch.Tensor:
        x, y = self.rows(batch)
        tail = self.tail_loss(loss_fn)
        recorded: list[torch.Tensor] = []

        def scaled(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # torch's schedule calls backward on what this returns: the fp16 loss scale goes in
            # here (scale_loss), or the masters' unscale would divide unscaled gradients by it.
            loss = tail(out, target) * scale
            recorded.append(loss.detach().clone())
            return self.scale_loss(loss)

        self._loss_fn = scaled
        if x.shape[0] % self.pipeline.n_microbatches:  # torch's split would hang the ranks' p2p
            raise ValueError(
                f"{self.where}: a batch of {x.shape[0]} rows does not split into "
                f"n_microbatches={self.pipeline.n_microbatches} equal micro-batches"
            )
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = dict(target=y, losses=losses) if self.last else {}
        with watch("forward"), self.pipeline.summing_tied():  # this step's tied gradients summed
            self.schedule.step(*args, **kwargs)
        # The micro-batches' losses, unscaled: the last m recorded (torch's stage runs the loss once
        # more, on garbage, in its first step's shape inference).
        real = recorded[-self.pipeline.n_microbatches :]
        total = torch.stack([loss.to(torch.float64) for loss in real]).sum() / scale if self.last else None
        return self.share_loss(total, y.device)


class TorchPP(TorchScheduled):
    """The loop strategy "torch-pp": torch's schedule (option schedule=, as "pp") over every rank."""

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        virtual_stages: int = 1,
        reduce_op: str = "sum",
        mp_policy: object = None,
    ) -> None:
        check_options("torch-pp", cfg, reduce_op, mp_policy)
        self.model, self.reduce_op, self.group = model, reduce_op, None
        m = dist.get_world_size() if n_microbatches is None else n_microbatches
        self.pipeline = pipeline_by_hand(
            gpt_sequential(model),
            schedule=schedule,
            n_microbatches=m,
            virtual_stages=virtual_stages,
            comm="torch",
        )
        self.use_torch_schedule()
        self.optimizer = self.optimizer_for(cfg, self.pipeline.parameters(), mp_policy, "torch-pp")
        self.guard_state_dict()

    def after_backward(self) -> None:
        self.into_masters()  # one replica: the 16-bit gradients (tied ones summed) into the masters

    def data_rank(self) -> int:
        return 0

    def data_world_size(self) -> int:
        return 1
