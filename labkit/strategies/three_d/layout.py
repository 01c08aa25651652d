"""What the 3-D strategies share: the ("dp", "pp", "tp") mesh, their options, TinyGPT split into
tensor-parallel pipeline stages, and the full dicts gathered from the stage that holds each tensor.

Rank order: tp fastest, then pp, then dp (rank = (d * pp + s) * tp + t): the tp ranks of a stage
are consecutive (Megatron puts them in one node, on its fastest links), each pipeline is the ranks
of one (dp, tp) coordinate, each "dp" group the copies of one (pp, tp) piece of the model.

TinyGPT is parallelized whole first (tp/gpt.parallelize_gpt on mesh["tp"]: every block's qkv, proj
and MLP split, no communication), then cut into pipeline chunks (pp/gpt.gpt_sequential: embedding,
blocks, head); every tp rank of a stage runs the same pipeline schedule with its pp peers of the
same tp coordinate, so the tensor-parallel all-reduces of a stage meet in the same order. The
activations sent between stages are whole (a rowwise layer's output is all-reduced): each tp rank
sends its copy to its own peer. The embedding and the head (tied) are replicated over "tp".

Mixed precision (mp_policy=MixedPrecision, bf16): the stages compute in param_dtype and send
param_dtype activations and gradients (the pipeline's headers carry the dtype), fp32 masters are
what the optimizer steps: ZeRO-1's master shards ("zero1-tp-pp", as "pp-zero1"), FSDP's fp32
shards ("fsdp-tp-pp", as "fsdp-tp"); gradients are reduced over "dp" in reduce_dtype.

What it leaves out: fp16 (its loss scaling would need every rank of the mesh, not only the "dp"
group, to agree on a skipped step), sequence parallelism, a stage split by cost, pipelining across
dp replicas.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.observe import tracing
from labkit.preset import Preset
from labkit.strategies import LossFn, MicroBatches, Watch, unwatched
from labkit.strategies.pp.gpt import gpt_sequential
from labkit.strategies.pp.runtime import local
from labkit.strategies.pp.stage import bounds
from labkit.strategies.pp.strategy import Pipelined, check_options
from labkit.strategies.precision import MixedPrecision, check_policy
from labkit.strategies.tp.gpt import check_gpt, original_order
from labkit.strategies.mesh import device_mesh

DIMS = ("dp", "pp", "tp")


# The options both strategies take besides mesh, reduce_op, mp_policy, comm: the degrees (dp None:
# the world size / (pp * tp)) and the pipeline's ("pp"'s: n_microbatches None is one per stage).
OPTIONS = {"dp": None, "pp": 2, "tp": 2, "schedule": "1f1b", "n_microbatches": None, "virtual_stages": 1}


def options_of(where: str, given: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """OPTIONS (and a strategy's `extra` ones) with `given` over the defaults; an unknown one raises
    TypeError naming it and every accepted one."""
    accepted = {**OPTIONS, **(extra or {})}
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise TypeError(
            f"{where} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: it takes mesh, "
            f"reduce_op, mp_policy, comm and {', '.join(accepted)}"
        )
    return {**accepted, **given}


class Composed(Pipelined):
    """The pipeline over mesh["pp"] with TP inside each stage (module docstring); a subclass adds
    the data parallelism over mesh["dp"] and sets self.pipeline. full_state_dict / full_grad_dict:
    every tensor whole, in the one-process model's layout ([q; k; v] rows), from its stage."""

    where = "3-D"
    mesh: DeviceMesh

    def setup(
        self,
        model: nn.Module,
        cfg: Preset,
        degrees: tuple[int | None, int, int],
        mesh: Any,
        reduce_op: str,
        mp_policy: object,
    ) -> None:
        """Checks, the mesh, the plain model's keys and shapes, which chunk holds each key."""
        check_options(self.where, cfg, reduce_op, mp_policy)
        if mp_policy is not None and getattr(mp_policy, "loss_scaling", False):
            raise NotImplementedError(
                f"{self.where}: fp16 is left out of the 3-D strategies (its dynamic loss scaling would need "
                f"every rank of the mesh to agree on a skipped step, not only the 'dp' group); use "
                f"MixedPrecision(param_dtype=torch.bfloat16), or pp-zero1 / fsdp-tp for fp16"
            )
        self.policy: MixedPrecision | None = check_policy(mp_policy, self.where)
        dp, pp, tp = degrees
        self.mesh = device_mesh(model, self.where, (("dp", dp), ("pp", pp), ("tp", tp)), mesh)
        self.tp = self.mesh["tp"].size()
        check_gpt(model, self.tp, self.where)
        self.model, self.reduce_op = model, reduce_op
        self.group = self.mesh["pp"].get_group()
        self.shapes = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.names = {id(m): n for n, m in model.named_modules()}
        self.guard_state_dict()  # model.state_dict() would hold other stages' stale copies

    def chunk_keys(self, n_chunks: int) -> None:
        """self.chunk_of[module name]: the pipeline chunk holding that module (its keys' stage)."""
        seq = gpt_sequential(self.model)
        self.chunk_of: dict[str, int] = {}
        for c, (a, b) in enumerate(bounds(len(seq), n_chunks)):
            for child in list(seq)[a:b]:
                for m in child.modules():
                    if id(m) in self.names:
                        self.chunk_of[self.names[id(m)]] = c

    def owner(self, key: str) -> int:
        """The global rank (in this rank's pipeline) of the stage holding state key `key`."""
        chunk = self.chunk_of[key.rpartition(".")[0]]
        return self.pipeline.holder(chunk)

    def mine(self, key: str) -> bool:
        return self.owner(key) == dist.get_rank()

    def from_stages(self, whole: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
        """{key: whole tensor} on every rank: each broadcast over the pipeline from its stage, whose
        `whole` holds it (qkv rows put back in [q; k; v] order first). Untraced: a report."""
        whole = original_order(whole, self.model, self.tp)
        out = {}
        with tracing.untraced():
            for key in keys:
                shape, dtype = self.shapes[key]
                device = next(self.model.parameters()).device
                if self.mine(key) and key not in whole:
                    raise RuntimeError(
                        f"{self.where}: {key} has no value on its own stage (rank {dist.get_rank()})"
                    )
                buf = (
                    whole[key].contiguous()
                    if self.mine(key)
                    else torch.empty(shape, dtype=dtype, device=device)
                )
                dist.broadcast(buf, src=self.owner(key), group=self.group)
                out[key] = buf
        return out

    def forward_backward(
        self, batch: MicroBatches, loss_fn: LossFn, *, scale: float = 1, watch: Watch = unwatched
    ) -> torch.Tensor:
        return self.run_pipeline(batch, loss_fn, scale, watch)

    def sharded_parameters(self) -> list[torch.Tensor]:
        """What this rank holds of the model: its stages' parameters, DTensors by their local
        tensors (what the memory tracker can count)."""
        return [local(p) for p in self.pipeline.parameters()]

    def data_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    def data_world_size(self) -> int:
        return self.mesh["dp"].size()
