"""The loop strategy "ep": expert parallelism x data parallelism on a TinyGPT with MoE blocks.

    loop.train("ep", loop.PRESETS["moe"])          # ep = world size: experts split over every rank
    loop.train("ep", cfg, ep=2)                    # 4 ranks: a (dp=2, ep=2) mesh

The ranks form a ("dp", "ep") DeviceMesh of (world / ep, ep) (ep consecutive ranks: one node's).
Every rank reads its own rows (data_rank / data_world_size: the global ones, every rank is a data
rank) and runs the whole model on them, except the experts: each MoE layer keeps E/ep of them
here (layer.expert_parallel over the "ep" group) and sends its tokens to their experts' ranks with
the all-to-all. After the backward:
- every other parameter's gradient (attention, LayerNorms, embeddings, routers) is summed over
  every rank, as in data parallelism;
- an expert's gradient already holds its ep group's tokens (the all-to-all brought them), so it is
  summed only over the "dp" group of its ep coordinate: the ranks holding the same expert.
  With reduce_op "avg" the loop multiplied every loss by the world size, so both sums are divided
  by the world size (the expert's too: averaging it over dp alone would leave it ep times large).
An expert that no token reached anywhere in the batch gets no gradient (None, as in one process,
so AdamW skips it); one that only other replicas' tokens reached gets zeros here before the sum.

Options: ep (default: the world size; divides it and every layer's expert count), reduce_op,
comm ("ring": labkit's all-reduce, or "torch": dist's, for the gradients; the all-to-all is
labkit's), mp_policy (a MixedPrecision: bf16 compute, fp32 masters, precision.WithMasters; each
gradient cast to reduce_dtype, summed over its group, copied into its master's; fp16's loss
scaling is left out). Left out: activation checkpointing,
micro-batches (accum_steps > 1: capacity and the balancing loss are counted over the global
batch at once, as in the reference), EP x TP / FSDP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.preset import Preset
from labkit.strategies import KeepsReduced, LossFn, MicroBatches, Strategy, Watch, check_reduce_op, unwatched
from labkit.strategies.comm_choice import choose
from labkit.strategies.precision import WithMasters, check_policy
from labkit.strategies.ep.layer import expert_parallel
from labkit.strategies.ep.moe import MoE
from labkit.strategies.mesh import device_mesh

__all__ = ["EP", "moe_layers"]

DIMS = ("dp", "ep")


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """{module name: MoE layer} of `model`, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


class EP(KeepsReduced, WithMasters, Strategy):
    """The loop strategy "ep" (the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: Preset,
        ep: int | None = None,
        reduce_op: str = "sum",
        mp_policy: object = None,
        comm: str = "ring",
    ) -> None:
        policy = check_policy(mp_policy, "ep")
        if policy is not None and policy.param_dtype == torch.float16:
            raise NotImplementedError(
                "ep: fp16 is left out (its loss scaling would have to skip a step on every rank at once); "
                "bf16 needs none"
            )
        check_reduce_op(reduce_op, "ep: reduce_op")
        if cfg.activation_checkpointing:
            raise NotImplementedError(
                "ep: activation checkpointing is left out (the recompute would re-route)"
            )
        self.collectives = choose(comm, "ep")
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError(
                "ep: the model has no MoE layer to split (a TinyGPT with n_experts > 0: loop.PRESETS['moe'])"
            )
        world = dist.get_world_size()
        ep = world if ep is None else ep
        self.mesh: DeviceMesh = device_mesh(model, "ep", (("dp", None), ("ep", ep)))
        uneven = {n: m.n_experts for n, m in self.layers.items() if m.n_experts % ep}
        if uneven:
            raise ValueError(f"ep: ep={ep} must divide every layer's expert count, not {uneven}")
        for name, layer in self.layers.items():
            frozen = {tuple(p.requires_grad for p in x.parameters()) for x in layer.experts}
            if len(frozen) > 1:
                raise ValueError(f"ep: the experts of {name} must be frozen alike (every expert, or none)")
        self.ep_group, self.dp_group = self.mesh["ep"].get_group(), self.mesh["dp"].get_group()
        for layer in self.layers.values():
            expert_parallel(layer, self.ep_group, None)
        self.model, self.reduce_op = model, reduce_op
        self.optimizer = self.optimizer_for(
            cfg, [p for p in model.parameters() if p.requires_grad], mp_policy, "ep"
        )

    def forward_backward(
        self, batch: MicroBatches, loss_fn: LossFn, *, scale: float = 1, watch: Watch = unwatched
    ) -> torch.Tensor:
        if len(batch) > 1:
            raise NotImplementedError(
                f"ep: {len(batch)} micro-batches: capacity and the load-balancing loss are counted "
                f"over the global batch at once (the reference's), so accum_steps must be 1"
            )
        return super().forward_backward(batch, loss_fn, scale=scale, watch=watch)

    def _experts(self) -> list[tuple[MoE, int, nn.Module]]:
        """(layer, expert, module) of the experts this rank holds."""
        return [(m, e, m.experts[e]) for m in self.layers.values() for e in m.ep.local]

    def after_backward(self) -> None:
        world = dist.get_world_size()
        expert_params: set[nn.Parameter] = set()
        for layer, e, module in self._experts():
            used = _used(layer, e)
            for p in module.parameters():
                expert_params.add(p)
                if not p.requires_grad or not used:
                    continue  # no token reached it anywhere: no gradient, as in one process
                if p.grad is None:  # only other replicas' tokens reached it
                    p.grad = torch.zeros_like(p)
                grad = self._reducible(p)
                self.collectives.all_reduce(grad, op="sum", group=self.dp_group)
                if self.reduce_op == "avg":
                    grad.div_(world)
                self._into_master(p, grad)
        for p in self.model.parameters():
            if p not in expert_params and p.grad is not None:
                grad = self._reducible(p)
                self.collectives.all_reduce(grad, op=self.reduce_op)
                self._into_master(p, grad)
        self.mark_reduced()  # a later backward without zero_grad adds to these (KeepsReduced)

    def _reducible(self, p: torch.Tensor) -> torch.Tensor:
        """p's gradient as it is summed: itself, or under a policy a reduce_dtype copy."""
        assert p.grad is not None
        return p.grad if self.mp is None else p.grad.to(self.mp.policy.reduce_dtype)

    def _into_master(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        if self.mp is not None:  # the summed gradient is the fp32 master's
            self.mp.master_grad(p).copy_(grad)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._whole(self.trained_state(), grads=False)

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        grads = self.trained_grads() if self.mp is not None else None
        return self._whole(
            {n: grads.get(n) if grads is not None else p.grad for n, p in self.model.named_parameters()},
            grads=True,
        )

    def _whole(self, tensors: dict[str, Any], grads: bool) -> dict[str, torch.Tensor]:
        """tensors (this rank's, by name) plus every other expert's, from the ep rank holding it
        (a broadcast over "ep" per tensor); with grads, an expert's only when it has one: it is
        trainable and some token reached it (the same answer on every rank)."""
        prefixes = tuple(f"{name}.experts." for name in self.layers)
        out = {
            n: t.detach().clone() for n, t in tensors.items() if t is not None and not n.startswith(prefixes)
        }
        members = dist.get_process_group_ranks(self.ep_group)
        for name, layer in self.layers.items():
            template = dict(layer.experts[layer.ep.local[0]].named_parameters())
            for e in range(layer.n_experts):
                for key, p in template.items():
                    if grads and not (p.requires_grad and _used(layer, e)):
                        continue
                    full = f"{name}.experts.{e}.{key}"
                    dtype = p.dtype if self.mp is None else self.mp.full_value(p).dtype  # the masters'
                    t = (
                        tensors[full].detach().clone()
                        if e in layer.ep.local
                        else torch.empty(p.shape, dtype=dtype, device=p.device)
                    )
                    dist.broadcast(t, src=members[e // layer.ep.per], group=self.ep_group)
                    out[full] = t
        return out


def _used(layer: MoE, expert: int) -> bool:
    """Some token of the last forward's global batch was kept for `expert` (so it has a gradient)."""
    return layer.kept_per_expert is not None and int(layer.kept_per_expert[expert]) > 0
