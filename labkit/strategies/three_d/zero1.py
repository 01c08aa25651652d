"""The loop strategy "zero1-tp-pp": Megatron-LM's layout, ZeRO-1 over "dp", TP inside each pipeline
stage, PP across, on a ("dp", "pp", "tp") mesh (layout.py).

    loop.train("zero1-tp-pp", cfg)                   # 8 ranks: dp 2 x pp 2 x tp 2 (the defaults)
    loop.train("zero1-tp-pp", cfg, pp=4, tp=2, schedule="interleaved", virtual_stages=2, n_microbatches=4)

Each rank holds its stage's parameters, the split layers as tp DTensors (their local tensors its
heads' / columns' pieces), the rest whole. Backward runs the pipeline's schedule (the tied
embedding / head gradient summed over the pipeline by pipeline_by_hand), then ZeRO-1
(zero/stages.ZeRO1) over mesh["dp"] on this rank's LOCAL tensors: one reduce-scatter of them, the
optimizer state for 1/dp of them, one all-gather after the step. ZeRO1 works on plain flat
buffers, so it is given one plain stand-in per parameter (its local tensor's shape); the stand-ins
become views of ZeRO1's flat buffer, and each parameter's local tensor is re-pointed at its
stand-in's view (.data), so the all-gather writes straight into the model, as ZeRO1 does alone.
The gradients do not: a tp parameter's .grad is a DTensor autograd makes, so after backward each
local gradient is copied into ZeRO1's flat gradient (one copy, then freed) before the reduce-scatter.

Mixed precision (mp_policy=MixedPrecision, bf16): ZeRO1 gets the policy (its fp32 master shard,
its flat buffer and gradient in param_dtype, the reduce-scatter in reduce_dtype), each parameter
becomes param_dtype (a DTensor swapped whole for its cast copy, whose local tensor is then pointed
at its stand-in's view); full_state_dict reports the masters, full_grad_dict the fp32 master
gradients.

What it leaves out: (layout.py's), frozen parameters under a policy (refused), gradients accumulated straight into the flat buffer (the copy
above), overlapping the reduce-scatter with the last stage's backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from labkit.preset import Preset
from labkit.strategies import LossFn, MicroBatches, Watch, unwatched
from labkit.strategies.comm_choice import choose
from labkit.strategies.pp.gpt import gpt_sequential
from labkit.strategies.pp.runtime import GRADS_ELSEWHERE, pipeline_by_hand
from labkit.strategies.precision import cast_in_place
from labkit.strategies.three_d.layout import Composed, local, options_of
from labkit.strategies.tp.gpt import parallelize_gpt
from labkit.strategies.tp.strategy import full


class ZeRO1TPPP(Composed):
    """See the module docstring. Degrees: pp (default 2), tp (default 2), dp (default the rest);
    or mesh=, a ("dp", "pp", "tp") DeviceMesh. The pipeline's schedule, n_microbatches (default:
    one per stage), virtual_stages as "pp"'s; comm: the collectives of TP, ZeRO and the pipeline."""

    where = "zero1-tp-pp"

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        mesh: DeviceMesh | None = None,
        reduce_op: str = "sum",
        mp_policy: object = None,
        comm: str = "ring",
        **options: Any,
    ) -> None:
        """options: dp, pp, tp, schedule, n_microbatches, virtual_stages (layout.OPTIONS)."""
        from labkit.strategies.zero.stages import ZeRO1

        o = options_of(self.where, options)
        choose(comm, self.where)
        self.setup(model, cfg, (o["dp"], o["pp"], o["tp"]), mesh, reduce_op, mp_policy)
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.is_floating_point()]
        if self.policy is not None and frozen:
            raise NotImplementedError(
                f"{self.where}: a frozen parameter ({frozen[0]}) under mp_policy is left out: ZeRO-1 here "
                f"holds the trainable parameters only, so nothing would cast it to param_dtype"
            )
        parallelize_gpt(model, self.mesh["tp"], comm=comm)
        m = self.mesh["pp"].size() if o["n_microbatches"] is None else o["n_microbatches"]
        self.pipeline = pipeline_by_hand(
            gpt_sequential(model),
            schedule=o["schedule"],
            n_microbatches=m,
            group=self.group,
            virtual_stages=o["virtual_stages"],
            comm=comm,
        )
        self.chunk_keys(self.pipeline.n_chunks)
        self.params = [p for p in self.pipeline.parameters() if p.requires_grad]
        # One plain stand-in per parameter (its local tensor); ZeRO1 makes them views of its flat
        # buffer, then each parameter's local tensor is pointed at the same view.
        self.standins = nn.ParameterList(nn.Parameter(local(p).detach().clone()) for p in self.params)
        self.zero = ZeRO1(
            self.standins,
            cfg.optimizer,
            params=list(self.standins),
            reduce_op=reduce_op,
            group=self.mesh["dp"].get_group(),
            comm=comm,
            mp_policy=self.policy,
            **cfg.optimizer_kwargs,
        )
        with torch.no_grad():
            for p, s in zip(self.params, self.standins):
                if self.policy is not None:  # a DTensor's dtype is its own, not its local tensor's
                    cast_in_place(p, self.policy.param_dtype)
                local(p).data = s.data
        self.index = {id(s): i for i, s in enumerate(self.zero.layout.params)}
        self.zero.observe = lambda *args: self.observe(*args)  # the loop sets ours later
        self.optimizer = self.zero.optimizer
        for p in self.params:  # pp.clip_grad_norm_ over them refuses, naming s.clip_grad_norm_
            GRADS_ELSEWHERE[p] = "zero1-tp-pp"

    def forward_backward(
        self, batch: MicroBatches, loss_fn: LossFn, *, scale: float = 1, watch: Watch = unwatched
    ) -> torch.Tensor:
        self.zero.resume_accumulation()  # no zero_grad since the last reduce: 2 G (KeepsReduced)
        return super().forward_backward(batch, loss_fn, scale=scale, watch=watch)

    def zero_grad(self) -> None:
        self.zero.zero_grad()
        for p in self.params:
            p.grad = None

    def after_backward(self) -> None:
        """Each local gradient into ZeRO1's flat gradient (the stand-ins' .grad views), then its
        reduce-scatter over "dp"."""
        with torch.no_grad():
            for p, s in zip(self.params, self.standins):
                if p.grad is not None:
                    s.grad.copy_(local(p.grad))  # type: ignore[union-attr]  # zero_grad made it a view
                    self.zero.grad_ready(self.index[id(s)])
                    p.grad = None
        self.zero.after_backward()

    def held_grads(self) -> list[torch.Tensor]:
        return self.zero.held_grads()

    def step(self) -> None:
        self.zero.step()
        for p, s in zip(self.params, self.standins):
            if local(p).data_ptr() != s.data_ptr():
                raise RuntimeError(
                    f"{self.where}: a parameter's local tensor no longer views ZeRO-1's flat buffer (the "
                    f"model was converted or moved after the strategy was built): its step is lost"
                )

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.zero.scale_loss(loss)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor whole; under a policy the parameters are ZeRO-1's fp32 masters (gathered
        over "dp", then put together over "tp")."""
        state = self.model_state()
        if self.policy is not None:
            masters = self.zero.full_state_dict()  # stand-in index -> fp32 local master (a collective)
            index = {id(p): i for i, p in enumerate(self.params)}
            params = dict(self.model.named_parameters(remove_duplicate=False))
            state = {
                k: _whole_of(masters[str(index[id(params[k])])], params[k])
                if k in params and id(params[k]) in index  # this rank's stages' parameters
                else v
                for k, v in state.items()
            }
        whole = {k: full(v) for k, v in state.items() if self.mine(k)}  # tp: a collective
        return self.from_stages(whole, list(state))

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """After step(): the reduced gradients (ZeRO1's, gathered over "dp"), whole over "tp"."""
        reduced = self.zero.full_grad_dict()  # stand-in index -> local gradient
        names = {id(p): n for n, p in self.model.named_parameters()}
        whole = {}
        for i, p in enumerate(self.params):
            g = reduced.get(str(i))
            if g is None or not self.mine(names[id(p)]):
                continue
            whole[names[id(p)]] = full(_whole_of(g, p))  # tp: a collective
        return self.from_stages(whole, self.param_names)


def _whole_of(local_value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`local_value` (a tensor of p's local shape) as p's DTensor (full() puts it together over
    "tp"), or itself for a whole parameter."""
    if isinstance(p, DTensor):
        return DTensor.from_local(
            local_value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return local_value
