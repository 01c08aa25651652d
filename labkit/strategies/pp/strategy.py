"""The pipeline strategies for labkit.loop: "pp" (TinyGPT split by blocks over every rank) and
"pp-zero1" (pipeline x ZeRO-1 on a ("dp", "pp") mesh), both on pipeline_by_hand.

    loop.train("pp", cfg, schedule="interleaved", virtual_stages=2, n_microbatches=4)
    loop.train("pp-zero1", cfg, schedule="1f1b")     # 4 ranks: 2 data-parallel x 2 stages
    loop.train("pp", cfg, schedule="zbv", virtual_stages=2, n_microbatches=4)   # zero bubble

The pipeline owns the micro-batch loop: forward_backward gets the loop's micro-batches, joins them
into this step's rows and runs one schedule over n_microbatches equal micro-batches (default:
one per stage). The loop's loss_fn(x, y) calls the strategy's forward (summed_loss: net(x, y,
reduction="sum")[1] / token count); on the last stage that forward is the head's loss on the
logits the stages computed (gpt.gpt_loss), so the loss is counted as the loop counts it. Other
calls of the forward raise: no rank holds the whole model. Every rank of a pipeline returns the
same loss (the last stage's, sent to the others untraced: a report, like the loop's all-reduce).

"pp-zero1" rather than "pp-fsdp": a pipeline runs each stage's forward and backward once per
micro-batch, so FSDP would gather (and free) the stage's parameters every micro-batch, and its
gradients reduce-scattered only once they are final; ZeRO-1 keeps the parameters whole for all
of them and shards only the optimizer state, one reduce-scatter + all-gather per step over
"dp". That is the ZeRO-1 x TP x PP layout of Megatron-LM / DeepSpeed (here without TP).
The tied embedding / head weight lives on the first and the last stage; its two gradients are
summed over the pipeline (pipeline_by_hand), then reduce-scattered over "dp" like every other.

Every rank keeps the whole model object but trains only its stages: model.state_dict() (and so
get_model_state_dict / dcp.save of it) is refused, since it would save the other stages' untrained
copies; full_state_dict() gathers each tensor from the stage that trains it. clip.clip_grad_norm_
clips by the whole pipeline's norm.

Mixed precision (mp_policy=MixedPrecision): the stages compute in param_dtype and send
param_dtype activations and gradients; "pp" steps fp32 masters of its stages' parameters
(precision.WithMasters), "pp-zero1" hands the policy to ZeRO-1 (its fp32 master shards,
gradients reduce-scattered in reduce_dtype). What it leaves out: the toy model (a pipeline splits TinyGPT's blocks), balancing
stages by cost, pipelining across dp replicas (each replica is its own pipeline).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.observe import tracing
from labkit.preset import Preset
from labkit.strategies import LossFn, MicroBatches, Strategy, Watch, check_reduce_op, unwatched
from labkit.strategies.comm_choice import choose
from labkit.strategies.pp.gpt import gpt_loss, gpt_sequential
from labkit.strategies.pp.runtime import GRADS_ELSEWHERE, PipelineByHand, pipeline_by_hand
from labkit.strategies.precision import WithMasters, check_policy
from labkit.strategies.mesh import device_mesh

DIMS = ("dp", "pp")


def check_options(where: str, cfg: Preset, reduce_op: str, mp_policy: object) -> None:
    check_policy(mp_policy, where)
    check_reduce_op(reduce_op, f"{where}: reduce_op")
    if cfg.model != "gpt":
        raise ValueError(f"{where}: splits TinyGPT's blocks into stages (cfg.model='gpt'), got {cfg.model!r}")


class Pipelined(WithMasters, Strategy):
    """What the pipeline strategies share: the split model, the last stage's forward (the loss on
    the logits), the loss shared over the pipeline, the full dicts gathered from each tensor's
    stage, this rank's parameters for the memory tracker. A subclass sets self.model,
    self.group (the pipeline's ranks; None: the world) and self.pipeline."""

    pipeline: PipelineByHand
    group: Any = None
    _tail = False
    _gathering = False

    def guard_state_dict(self) -> None:
        """Refuse model.state_dict() on this rank (and so get_model_state_dict / dcp.save of it):
        the rank trains only its stages, the others' weights in its model are stale copies that
        would be saved as if trained. full_state_dict() (each tensor from its stage) is the way."""

        def refuse(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            if not self._gathering:
                raise RuntimeError(
                    f"{type(self).__name__}: model.state_dict() on rank {dist.get_rank()} would hold "
                    f"untrained copies of the stages other ranks train (each rank steps only its own); "
                    f"call the strategy's full_state_dict() on every rank (each tensor from the stage "
                    f"that trains it), or save this rank's stages' parameters alone"
                )

        self.model.register_state_dict_pre_hook(refuse)

    def model_state(self, keep_vars: bool = False) -> dict[str, Any]:
        """The model's own state_dict, which guard_state_dict refuses to a user: for the
        strategy's own gathering (each entry then taken from the stage that trains it)."""
        self._gathering = True
        try:
            return self.model.state_dict(keep_vars=keep_vars)
        finally:
            self._gathering = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._tail:
            raise RuntimeError(
                f"{type(self).__name__}: the model is split over the pipeline's ranks, so its forward "
                f"runs inside forward_backward (the loop's train_step), stage by stage"
            )
        logits, targets = args
        return logits, gpt_loss(logits, targets, kwargs.get("reduction", "mean"))

    def tail_loss(self, loss_fn: LossFn) -> LossFn:
        """The loop's loss_fn(x, y), applied to the last stage's logits instead of x."""

        def on_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            self._tail = True
            try:
                return loss_fn(logits, y)
            finally:
                self._tail = False

        return on_logits

    @staticmethod
    def rows(batch: MicroBatches) -> tuple[torch.Tensor, torch.Tensor]:
        """The loop's micro-batches as this step's rows (the pipeline cuts its own)."""
        if not isinstance(batch, (list, tuple)) or len(batch) == 0:
            raise ValueError(
                "forward_backward: batch must be a non-empty list of (x, y) micro-batches (one "
                f"step's, on this rank), got {type(batch).__name__} of length "
                f"{len(batch) if hasattr(batch, '__len__') else '?'}: with no micro-batch there "
                "is no backward, so no gradient"
            )
        return torch.cat([x for x, _ in batch]), torch.cat([y for _, y in batch])

    def share_loss(self, total: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The last stage's loss on every rank of the pipeline (untraced: a report)."""
        out = total if total is not None else torch.zeros((), dtype=torch.float64, device=device)
        last = self.pipeline.holder(self.pipeline.n_chunks - 1)  # rank 0 under "zbv"
        with tracing.untraced():
            dist.broadcast(out, src=last, group=self.group)
        return out

    def sharded_parameters(self) -> list[torch.Tensor]:
        """What this rank holds of the model: its stages' parameters."""
        return list(self.pipeline.parameters())

    def owners(self) -> dict[int, int]:
        """{id(tensor): global rank of the first stage holding it} over the model's chunks."""
        owner: dict[int, int] = {}
        for c, chunk in enumerate(self.pipeline.chunks):
            rank = self.pipeline.holder(c)
            for t in [*chunk.parameters(), *chunk.buffers()]:
                owner.setdefault(id(t), rank)
        return owner

    def gathered(self, tensors: dict[str, torch.Tensor], ids: dict[str, int]) -> dict[str, torch.Tensor]:
        """{name: tensor} with each tensor broadcast from its owner stage (a collective over
        the pipeline; every rank passes the same names, in the same order)."""
        owner, out = self.owners(), {}
        with tracing.untraced():
            for name, t in tensors.items():
                if ids[name] not in owner:
                    raise RuntimeError(f"{type(self).__name__}: {name} is in no stage of the pipeline")
                buf = t.detach().clone().contiguous()
                dist.broadcast(buf, src=owner[ids[name]], group=self.group)
                out[name] = buf
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = self.model_state(keep_vars=True)  # the ids say which stage owns each
        self._gathering = True
        try:
            trained = self.trained_state()
        finally:
            self._gathering = False
        return self.gathered(trained, {k: id(v) for k, v in state.items()})

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        grads = self.local_grads()
        params = dict(self.model.named_parameters())
        mine = {id(p) for p in self.pipeline.parameters()}
        dtype = next(iter(grads.values())).dtype  # the masters' (fp32) under a policy
        tensors = {
            n: grads[n] if id(p) in mine else torch.zeros_like(p, dtype=dtype)
            for n, p in params.items()
            if p.requires_grad
        }
        return self.gathered(tensors, {n: id(params[n]) for n in tensors})

    def local_grads(self) -> dict[str, torch.Tensor]:
        """{name: whole gradient} of this rank's stage parameters (the fp32 masters' under a policy)."""
        return self.trained_grads()

    def run_pipeline(self, batch: MicroBatches, loss_fn: LossFn, scale: float, watch: Watch) -> torch.Tensor:
        x, y = self.rows(batch)
        total = self.pipeline.step(
            x,
            y,
            self.tail_loss(loss_fn),
            backward_from=lambda loss: self.scale_loss(loss * scale),
            watch=watch,
        )
        return self.share_loss(total, y.device)


def _gpt_pipeline(
    model: nn.Module,
    group: Any,
    comm: str,
    *,
    schedule: str = "1f1b",
    n_microbatches: int | None = None,
    virtual_stages: int = 1,
) -> PipelineByHand:
    """pipeline_by_hand on gpt_sequential(model) over `group`; n_microbatches None: one per stage."""
    m = dist.get_world_size(group) if n_microbatches is None else n_microbatches
    return pipeline_by_hand(
        gpt_sequential(model),
        schedule=schedule,
        n_microbatches=m,
        group=group,
        virtual_stages=virtual_stages,
        comm=comm,
    )


class PP(Pipelined):
    """The loop strategy "pp": TinyGPT as [embedding, blocks..., head] (gpt_sequential) over every
    rank, schedule "gpipe" | "1f1b" | "interleaved" (virtual_stages chunks per rank) | "zb-h1" |
    "zbv" (virtual_stages=2; the last stage, and so the loss, on rank 0), the preset's optimizer
    over this rank's stages."""

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        virtual_stages: int = 1,
        reduce_op: str = "sum",
        mp_policy: object = None,
        comm: str = "ring",
    ) -> None:
        choose(comm, "pp")
        check_options("pp", cfg, reduce_op, mp_policy)
        self.model, self.reduce_op, self.group = model, reduce_op, None
        self.pipeline = _gpt_pipeline(
            model, None, comm, schedule=schedule, n_microbatches=n_microbatches, virtual_stages=virtual_stages
        )
        self.optimizer = self.optimizer_for(cfg, self.pipeline.parameters(), mp_policy, "pp")
        self.guard_state_dict()

    def forward_backward(
        self, batch: MicroBatches, loss_fn: LossFn, *, scale: float = 1, watch: Watch = unwatched
    ) -> torch.Tensor:
        return self.run_pipeline(batch, loss_fn, scale, watch)

    def data_rank(self) -> int:
        return 0  # every rank is a stage of one replica: each reads the whole batch

    def data_world_size(self) -> int:
        return 1

    def after_backward(self) -> None:
        self.into_masters()  # one replica: the 16-bit gradients (tied ones summed) into the masters


class PPZeRO1(Pipelined):
    """The loop strategy "pp-zero1": one pipeline per mesh["pp"] group (pipeline_by_hand), ZeRO-1
    (labkit.strategies.zero.ZeRO1: the optimizer state sharded, gradients reduce-scattered, the
    parameters all-gathered) over mesh["dp"] on each stage's parameters; the batch split over "dp"."""

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        pp: int = 2,
        mesh: DeviceMesh | None = None,
        reduce_op: str = "sum",
        mp_policy: object = None,
        comm: str = "ring",
        **pipeline_options: Any,
    ) -> None:
        """pipeline_options: "pp"'s schedule=, n_microbatches= (default: one per stage),
        virtual_stages= (an unknown one raises TypeError)."""
        from labkit.strategies.zero.stages import ZeRO1

        unknown = sorted(set(pipeline_options) - {"schedule", "n_microbatches", "virtual_stages"})
        if unknown:
            raise TypeError(
                f"pp-zero1 got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: its own are pp, "
                f"mesh, reduce_op, mp_policy, comm; the pipeline's schedule, n_microbatches, virtual_stages"
            )
        choose(comm, "pp-zero1")
        check_options("pp-zero1", cfg, reduce_op, mp_policy)
        self.mesh = device_mesh(model, "pp-zero1", (("dp", None), ("pp", pp if mesh is None else None)), mesh)
        self.model, self.reduce_op = model, reduce_op
        self.group = self.mesh["pp"].get_group()
        self.pipeline = _gpt_pipeline(model, self.group, comm, **pipeline_options)
        self.zero = ZeRO1(
            model,
            cfg.optimizer,
            params=self.pipeline.parameters(),
            reduce_op=reduce_op,
            group=self.mesh["dp"].get_group(),
            comm=comm,
            mp_policy=mp_policy,
            **cfg.optimizer_kwargs,
        )
        self.zero.observe = lambda *args: self.observe(*args)  # the loop sets ours later
        self.optimizer = self.zero.optimizer
        for p in self.pipeline.parameters():  # pp.clip_grad_norm_ over them refuses, naming s.clip_grad_norm_
            GRADS_ELSEWHERE[p] = "pp-zero1"
        self.guard_state_dict()

    def forward_backward(
        self, batch: MicroBatches, loss_fn: LossFn, *, scale: float = 1, watch: Watch = unwatched
    ) -> torch.Tensor:
        self.zero.resume_accumulation()  # no zero_grad since the last reduce: 2 G (KeepsReduced)
        return self.run_pipeline(batch, loss_fn, scale, watch)

    def data_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    def data_world_size(self) -> int:
        return self.mesh["dp"].size()

    def zero_grad(self) -> None:
        self.zero.zero_grad()

    def after_backward(self) -> None:
        self.zero.after_backward()

    def held_grads(self) -> list[torch.Tensor]:
        return self.zero.held_grads()

    def step(self) -> None:
        self.zero.step()

    def local_grads(self) -> dict[str, torch.Tensor]:
        """This stage's reduced gradients, gathered over "dp" (ZeRO1's, a collective)."""
        return self.zero.full_grad_dict()

    def trained_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters gathered over "dp" (ZeRO1's; its fp32 masters under a policy)."""
        return self.zero.full_state_dict()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.zero.scale_loss(loss)
