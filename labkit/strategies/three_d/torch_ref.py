"""PyTorch's own composition of "fsdp-tp-pp", the oracle: parallelize_module (tp/gpt.parallelize_gpt
by="torch") on mesh["tp"], fully_shard(reshard_after_forward=False) over mesh["dp"] on every block
and chunk root, torch.distributed.pipelining's schedule over mesh["pp"] (pp/torch_ref.torch_schedule,
scale_grads=False), as torchtitan composes them; PipelineStage drives fully_shard's
set_requires_gradient_sync / set_reshard_after_backward itself. Not registered in NAMES: loop.train
takes the class (tests/test_three_d.py). fully_shard averages over "dp" (reduce_op "avg"); the tied
embedding / head weight's two gradient shards are summed as fsdp-tp-pp sums them (point to point,
torch's isend / irecv). What it leaves out: ZeRO-1 x TP x PP in torch (ZeroRedundancyOptimizer
over DTensor parameters is not run here: docs/dev/CONTRACTS.md). Mixed precision: labkit's
MixedPrecision as fully_shard's MixedPrecisionPolicy(param_dtype, reduce_dtype) on every unit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.preset import Preset
from labkit.strategies import LossFn, MicroBatches, Watch, unwatched
from labkit.strategies.pp import schedule as sched
from labkit.strategies.pp.gpt import gpt_sequential
from labkit.strategies.pp.stage import split_sequential
from labkit.strategies.pp.torch_ref import torch_schedule
from labkit.strategies.three_d.layout import Composed, local, options_of
from labkit.strategies.tp.gpt import parallelize_gpt
from labkit.strategies.tp.strategy import full


class _Split:
    """What Composed.owner reads of a pipeline: the pp group's global ranks, stages, chunks."""

    def __init__(self, ranks: list[int], n_stages: int, n_chunks: int) -> None:
        self.ranks, self.n_stages, self.n_chunks = ranks, n_stages, n_chunks


class TorchFSDPTPPP(Composed):
    """See the module docstring; options as fsdp-tp-pp's (dp, pp, tp, schedule, n_microbatches,
    virtual_stages)."""

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
        if reduce_op != "avg":
            raise ValueError(f"{self.where}: reduce_op must be 'avg' (fully_shard's), got {reduce_op!r}")
        self.setup(model, cfg, (o["dp"], o["pp"], o["tp"]), mesh, reduce_op, mp_policy)
        p, v = self.mesh["pp"].size(), o["virtual_stages"]
        tied = getattr(model, "lm_head").weight is getattr(model, "tok_emb").weight
        parallelize_gpt(model, self.mesh["tp"], by="torch")
        chunks = split_sequential(gpt_sequential(model), p * v)
        blocks = {id(b) for b in getattr(model, "blocks")}
        ids = sched.chunks_of(self.mesh["pp"].get_local_rank(), p, v)
        shard: dict[str, Any] = dict(mesh=self.mesh["dp"], reshard_after_forward=False)
        if self.policy is not None:  # labkit's policy as torch's (fsdp/torch_ref.py does the same)
            from torch.distributed.fsdp import MixedPrecisionPolicy

            shard["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.policy.param_dtype, reduce_dtype=self.policy.reduce_dtype
            )
        for c in ids:
            for child in chunks[c]:
                if id(child) in blocks:
                    fully_shard(child, **shard)
            fully_shard(chunks[c], **shard)
        m = p if o["n_microbatches"] is None else o["n_microbatches"]
        self.m = m
        self.pipeline: Any = _Split(dist.get_process_group_ranks(self.group), p, p * v)
        self.chunk_keys(p * v)
        self._loss_fn: Any = None
        self.schedule, _ = torch_schedule(
            chunks,
            schedule=o["schedule"],
            n_microbatches=m,
            loss_fn=self._step_loss,
            group=self.group,
            virtual_stages=v,
        )
        self.first, self.last = 0 in ids, p * v - 1 in ids
        self.params = list({id(q): q for c in ids for q in chunks[c].parameters()}.values())
        self.optimizer = cfg.make_optimizer(self.params)
        me, ranks = dist.get_rank(), self.pipeline.ranks
        self.tied = None
        if tied and me in (ranks[0], ranks[-1]):
            module = getattr(model, "tok_emb") if me == ranks[0] else getattr(model, "lm_head")
            self.tied = (module, ranks[-1] if me == ranks[0] else ranks[0])

    def _step_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(out, y)

    def forward_backward(
        self, batch: MicroBatches, loss_fn: LossFn, *, scale: float = 1, watch: Watch = unwatched
    ) -> torch.Tensor:
        x, y = self.rows(batch)
        tail = self.tail_loss(loss_fn)
        self._loss_fn = lambda out, target: tail(out, target) * scale
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = dict(target=y, losses=losses) if self.last else {}
        with watch("forward"):
            self.schedule.step(*args, **kwargs)
        self._sum_tied()
        total = (
            torch.stack([q.detach().to(torch.float64) for q in losses]).sum() / scale if self.last else None
        )
        out = total if total is not None else torch.zeros((), dtype=torch.float64, device=y.device)
        dist.broadcast(out, src=self.pipeline.ranks[-1], group=self.group)
        return out

    def _sum_tied(self) -> None:
        if self.tied is None:
            return
        module, peer = self.tied
        g = local(module.weight.grad)
        with torch.no_grad():
            if dist.get_rank() < peer:
                other = torch.empty_like(g)
                dist.recv(other, src=peer, group=self.group)
                g.add_(other)
                dist.send(g.contiguous(), dst=peer, group=self.group)
            else:
                dist.send(g.contiguous(), dst=peer, group=self.group)
                dist.recv(g, src=peer, group=self.group)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return self.from_stages({k: full(v) for k, v in state.items() if self.mine(k)}, list(self.shapes))

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        named = dict(self.model.named_parameters())
        whole = {n: full(q.grad) for n, q in named.items() if q.grad is not None and self.mine(n)}
        return self.from_stages(whole, self.param_names)
