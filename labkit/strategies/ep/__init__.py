"""Mixture of experts and expert parallelism by hand: the router, the dispatch, the experts split
over an "ep" group with labkit's all-to-all (labkit.comm.all_to_all), the rest data-parallel.

- moe.py: route (softmax, top-k, gates renormalised), load_balancing_loss (Switch Transformer's),
  capacity, dispatch_plan (expert, slot, kept, dropped), kept_counts, Expert, MoE (TinyGPT's MLP
  slot; its aux_loss reaches TinyGPT's loss), moe_mlp (the factory loop.build_model passes);
- layer.py: expert_parallel(moe, ep_group, data_group): the experts split, the tokens sent to
  them and back (EPPlan), the others' experts as Remote placeholders; a2a_bytes (the
  all-to-alls' bytes per rank per layer and step, the formula);
- strategy.py: the loop strategy "ep" (a ("dp", "ep") mesh; experts' gradients summed over "dp",
  every other gradient over the world).

What it leaves out: torch's own expert parallelism as an oracle (none on CPU; the oracle is one
process, and dist.all_to_all_single for the all-to-all), capacity per device, micro-batches,
EP x TP / FSDP, mixed precision.
"""

from labkit.strategies.ep.layer import EPPlan, Remote, a2a_bytes, expert_parallel, owner
from labkit.strategies.ep.moe import (
    DispatchPlan,
    Expert,
    MoE,
    capacity,
    dispatch_plan,
    kept_counts,
    load_balancing_loss,
    moe_mlp,
    route,
)
from labkit.strategies.ep.strategy import EP, moe_layers

__all__ = [
    "EP",
    "DispatchPlan",
    "EPPlan",
    "Expert",
    "MoE",
    "Remote",
    "a2a_bytes",
    "capacity",
    "dispatch_plan",
    "expert_parallel",
    "kept_counts",
    "load_balancing_loss",
    "moe_layers",
    "moe_mlp",
    "owner",
    "route",
]
