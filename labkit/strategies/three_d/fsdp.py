"""The loop strategy "fsdp-tp-pp": Llama 3's layout, FSDP over "dp" without resharding after forward
inside the pipeline, TP inside each stage, PP across, on a ("dp", "pp", "tp") mesh (layout.py).

    loop.train("fsdp-tp-pp", cfg)                    # 8 ranks: dp 2 x pp 2 x tp 2 (the defaults)

Each rank's pipeline chunks are sharded with fully_shard_by_hand over mesh["dp"]: every block a
unit, then the chunk itself the root (the embedding or the head: what no block took; a chunk of
blocks only keeps its first block in the root), as
torchtitan shards each stage's model; the tp parameters as their local tensors (fsdp/param.py's
TPLayout on the mesh's (dp, tp) plane). Under a pipeline a unit runs forward and backward once per
micro-batch, so, as torch.distributed.pipelining drives fully_shard: every backward but a chunk's
last keeps the unit gathered and reduces nothing (set_requires_gradient_sync(False),
set_reshard_after_backward(False): the unsharded gradients add up), the last reduce-scatters the
sum once and reshards. With reshard_after_forward=False (the default, Llama 3's) each unit is
all-gathered once per step and its gradient reduce-scattered once per step, ZeRO-1's traffic with
the parameters sharded between steps; reshard_after_forward=True gathers the blocks again for every
forward and backward (2m all-gathers per step: why it does not pair with PP). A chunk root stays
gathered after its forward (FSDP2's root rule).
The tied embedding / head weight is sharded on the first and the last stage (one unit each):
after the reduce-scatter the two stages' gradient SHARDS of this step are summed point to point
by the pipeline (pipeline_by_hand's summing_tied, on the shards: 1/dp of what a whole-tensor sum
would send; steps without zero_grad accumulate 2 G, not 3 G), then each stage's optimizer steps
its shard alike.

Mixed precision (mp_policy=MixedPrecision, bf16): every unit gets the policy, as "fsdp-tp"'s FSDP:
the all-gather and the compute in param_dtype, the reduce-scatter in reduce_dtype, the fp32 shards
the masters the optimizer steps (the tied weight's two gradient shards summed in their dtype).

What it leaves out: (layout.py's), the zero-bubble schedules (refused by name: their W would run
the backward-counting hook a second time), pp=1 (the tied weight would sit in two chunk roots of one rank),
prefetching (each unit gathers when it first runs, once per step), the gathered parameters'
bytes in the pipeline record's saved-activation count (pipeline_by_hand excludes its parameters'
storage, and the gathered storage is another).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.preset import Preset
from labkit.strategies.comm_choice import choose
from labkit.strategies.fsdp.fully_shard import full_grad_dict, full_state_dict, fully_shard_by_hand
from labkit.strategies.pp.gpt import gpt_sequential
from labkit.strategies.pp.runtime import pipeline_by_hand
from labkit.strategies.pp.schedule import ZERO_BUBBLE
from labkit.strategies.pp.stage import split_sequential
from labkit.strategies.three_d.layout import Composed, local, options_of
from labkit.strategies.tp.gpt import parallelize_gpt


class FSDPTPPP(Composed):
    """See the module docstring. Degrees and pipeline options as "zero1-tp-pp"'s (pp >= 2);
    reshard_after_forward: the blocks' (default False); comm: TP's, FSDP's and the pipeline's."""

    where = "fsdp-tp-pp"

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
        """options: dp, pp, tp, schedule, n_microbatches, virtual_stages (layout.OPTIONS) and
        reshard_after_forward (the blocks', default False)."""
        o = options_of(self.where, options, {"reshard_after_forward": False})
        if o["schedule"] in ZERO_BUBBLE:
            raise NotImplementedError(
                f"{self.where}: schedule={o['schedule']!r} is left out: a zero-bubble schedule's W walks "
                f"each chunk's graph again after its B, and fsdp-tp-pp counts a chunk's backwards by a "
                f"hook on its output (the last one reduce-scatters), which would fire twice per "
                f"micro-batch; under 'zbv' the tied embedding / head would also be two chunk roots of "
                f"one rank. Use '1f1b' or 'interleaved' here, or zero1-tp-pp / pp-zero1 with {o['schedule']!r}"
            )
        collectives = choose(comm, self.where)
        reshard_after_forward = o["reshard_after_forward"]
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"{self.where}: reshard_after_forward must be True or False, got {reshard_after_forward!r}"
            )
        self.setup(model, cfg, (o["dp"], o["pp"], o["tp"]), mesh, reduce_op, mp_policy)
        p, v = self.mesh["pp"].size(), o["virtual_stages"]
        if p < 2:
            raise ValueError(
                f"{self.where}: pp must be >= 2: with one stage the tied embedding / head weight would "
                f"be in two chunk roots of one rank (use fsdp-tp)"
            )
        parallelize_gpt(model, self.mesh["tp"], comm=comm)
        n_chunks = p * (v if isinstance(v, int) and not isinstance(v, bool) else 1)
        chunks = split_sequential(gpt_sequential(model), n_chunks)
        # Each chunk is one child of the pipeline's model, so the pipeline calls the chunk roots.
        # Built before sharding: it finds the tied embedding / head weight by identity, which
        # fully_shard_by_hand's shards break; reread_parameters() then takes the shards.
        m = p if o["n_microbatches"] is None else o["n_microbatches"]
        self.pipeline = pipeline_by_hand(
            nn.Sequential(*chunks),
            schedule=o["schedule"],
            n_microbatches=m,
            group=self.group,
            virtual_stages=v,
            comm=comm,
        )
        blocks = {id(b) for b in getattr(model, "blocks")}
        self.roots: list[Any] = []
        for chunk in [chunks[c] for c in self.pipeline.chunk_ids]:  # (a pipeline chunk holds one)
            kids = [k for k in chunk if id(k) in blocks]
            # every block its own unit, but a chunk of blocks only leaves its first to the root
            # (a root with no parameter of its own would gather and reduce nothing)
            for child in kids if len(kids) < len(chunk) else kids[1:]:
                self._shard(child, reshard_after_forward)
            self.roots.append(self._shard(chunk, reshard_after_forward))
        for root in self.roots:
            root._fsdp_group.ctx.comm = collectives
            root.register_forward_hook(self._count_backwards)
        self.pipeline.reread_parameters()
        self.chunk_keys(n_chunks)
        self.params = [q for q in self.pipeline.parameters() if q.requires_grad]  # the shards
        self.optimizer = cfg.make_optimizer(self.params)
        self.backwards: dict[int, int] = {}

    def _shard(self, module: nn.Module, reshard_after_forward: bool) -> Any:
        return fully_shard_by_hand(
            module,
            reshard_after_forward=reshard_after_forward,
            mp_policy=self.policy,
            mesh=self.mesh["dp"],
            reduce_op=self.reduce_op,
        )

    # ------------------------------------------------------------ one step

    def _count_backwards(self, root: nn.Module, args: Any, output: Any) -> None:
        """A forward hook on each chunk root (after FSDP's): its output's gradient hook counts the
        chunk's backwards; the last micro-batch's turns reduce-scatter and reshard back on, before
        any gradient of that backward accumulates."""
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad, r=root: self._backward_starts(r))

    def _backward_starts(self, root: Any) -> None:
        n = self.backwards[id(root)] = self.backwards.get(id(root), 0) + 1
        if n == self.pipeline.n_microbatches:
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)

    def run_pipeline(self, batch: Any, loss_fn: Any, scale: float, watch: Any) -> torch.Tensor:
        self.backwards = {}
        for root in self.roots:
            root.set_requires_gradient_sync(False)
            root.set_reshard_after_backward(False)
        return super().run_pipeline(batch, loss_fn, scale, watch)  # the tied shards summed per step

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------ full dicts

    def _by_model_name(self, per_chunk: dict[str, torch.Tensor], root: nn.Module) -> dict[str, torch.Tensor]:
        """Chunk-relative keys ("1.attn.qkv.weight") as the model's ("blocks.0.attn.qkv.weight")."""
        modules = dict(root.named_modules())
        out = {}
        for key, value in per_chunk.items():
            where, _, attr = key.rpartition(".")
            out[f"{self.names[id(modules[where])]}.{attr}"] = value
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        whole: dict[str, torch.Tensor] = {}
        for root in self.roots:  # FSDP's, gathered over "dp" then "tp" (collectives)
            whole.update(self._by_model_name(full_state_dict(root), root))
        return self.from_stages({k: v for k, v in whole.items() if self.mine(k)}, list(self.shapes))

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        whole: dict[str, torch.Tensor] = {}
        for root in self.roots:
            whole.update(self._by_model_name(full_grad_dict(root), root))
        return self.from_stages({k: v for k, v in whole.items() if self.mine(k)}, self.param_names)

    def sharded_parameters(self) -> list[torch.Tensor]:
        return [local(q) for root in self.roots for q in root.parameters()]
