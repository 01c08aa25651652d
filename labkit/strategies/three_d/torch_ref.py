"""PyTorch's own composition of "fsdp-tp-pp", the oracle: parallelize_module (tp/gpt.parallelize_gpt
by="torch") on mesh["tp"], fully_shard(reshard_after_forward=False) over mesh["dp"] on every block
and chunk root, torch.distributed.pipelining's schedule over mesh["pp"] (pp/torch_ref.torch_schedule,
scale_grads=False), as torchtitan composes them; PipelineStage drives fully_shard's
set_requires_gradient_sync / set_reshard_after_backward itself. Not registered in NAMES: loop.train
takes the class (tests/test_three_d.py). fully_shard averages over "dp" (reduce_op "avg"); the step
is torch-pp's (pp/torch_ref.TorchScheduled: the batch checked against the micro-batches, the tied
embedding / head weight's two gradient shards of THIS step summed by the pipeline_by_hand that
holds the split, point to point, torch's isend / irecv, as fsdp-tp-pp sums them). What it leaves
out: the zero-bubble schedules (refused by name, as fsdp-tp-pp refuses them), ZeRO-1 x TP x PP in torch (ZeroRedundancyOptimizer over DTensor parameters is not run here:
docs/dev/CONTRACTS.md). Mixed precision: labkit's
MixedPrecision as fully_shard's MixedPrecisionPolicy(param_dtype, reduce_dtype) on every unit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.preset import Preset
from labkit.strategies.pp.gpt import gpt_sequential
from labkit.strategies.pp.runtime import pipeline_by_hand
from labkit.strategies.pp.schedule import ZERO_BUBBLE
from labkit.strategies.pp.torch_ref import TorchScheduled
from labkit.strategies.three_d.layout import Composed, local, options_of
from labkit.strategies.tp.gpt import parallelize_gpt
from labkit.strategies.tp.strategy import full


class TorchFSDPTPPP(TorchScheduled, Composed):
    """See the module docstring; options as fsdp-tp-pp's (dp, pp, tp, schedule, n_microbatches,
    virtual_stages). The step is torch-pp's (TorchScheduled.forward_backward: the micro-batch
    check, torch's schedule inside the tied weight's per-step sum, the last stage's loss shared)."""

    where = "torch-fsdp-tp-pp"
    reduce_op = "avg"

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        mesh: DeviceMesh | None = None,
        reduce_op: str = "avg",
        mp_policy: object = None,
        **options: Any,
    ) -> None:
        from torch.distributed.fsdp import fully_shard

        o = options_of(self.where, options)
        if o["schedule"] in ZERO_BUBBLE:
            raise NotImplementedError(
                f"{self.where}: schedule={o['schedule']!r} is left out: fsdp-tp-pp, the strategy this "
                f"one is the oracle of, refuses the zero-bubble schedules, so torch's fully_shard under "
                f"its zero-bubble classes is not checked here (torch-pp runs them without FSDP)"
            )
        if reduce_op != "avg":
            raise ValueError(f"{self.where}: reduce_op must be 'avg' (fully_shard's), got {reduce_op!r}")
        self.setup(model, cfg, (o["dp"], o["pp"], o["tp"]), mesh, reduce_op, mp_policy)
        p, v = self.mesh["pp"].size(), o["virtual_stages"]
        parallelize_gpt(model, self.mesh["tp"], by="torch")
        # The split (and the tied embedding / head weight, found by identity) before fully_shard
        # replaces the chunks' parameters with its shards; reread_parameters() then takes those.
        self.pipeline = pipeline_by_hand(
            gpt_sequential(model),
            schedule=o["schedule"],
            n_microbatches=p if o["n_microbatches"] is None else o["n_microbatches"],
            group=self.group,
            virtual_stages=v,
            comm="torch",
        )
        blocks = {id(b) for b in getattr(model, "blocks")}
        shard: dict[str, Any] = dict(mesh=self.mesh["dp"], reshard_after_forward=False)
        if self.policy is not None:  # labkit's policy as torch's (fsdp/torch_ref.py does the same)
            from torch.distributed.fsdp import MixedPrecisionPolicy

            shard["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.policy.param_dtype, reduce_dtype=self.policy.reduce_dtype
            )
        for chunk in self.pipeline.stages:
            for child in chunk:
                if id(child) in blocks:
                    fully_shard(child, **shard)
            fully_shard(chunk, **shard)
        self.pipeline.reread_parameters()
        self.chunk_keys(p * v)
        self.use_torch_schedule()
        self.params = self.pipeline.parameters()  # the shards
        self.optimizer = cfg.make_optimizer(self.params)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = self.model_state()
        return self.from_stages({k: full(v) for k, v in state.items() if self.mine(k)}, list(self.shapes))

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        named = dict(self.model.named_parameters())
        whole = {n: full(q.grad) for n, q in named.items() if q.grad is not None and self.mine(n)}
        return self.from_stages(whole, self.param_names)

    def sharded_parameters(self) -> list[torch.Tensor]:
        return [local(q) for q in self.params]
