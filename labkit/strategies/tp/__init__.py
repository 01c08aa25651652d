"""Tensor parallelism by hand (Megatron-LM's, as torch.distributed.tensor.parallel names it):
layers split across the ranks of a "tp" mesh, every tp rank seeing the same batch.

- conjugate.py: the two conjugate operations written on labkit's hand-written collectives,
  copy_to_tp (Megatron's f: identity forward, all-reduce of the gradient in backward) and
  reduce_from_tp (g: all-reduce forward, identity backward), and gather_from_tp (an all-gather
  of a column-parallel output along its last dim, the gradient's slice back in backward);
- sequence.py: sequence parallelism's conjugates along the sequence: gather_from_sp (all-gather
  forward / reduce-scatter backward), reduce_scatter_to_sp (the transpose), split_to_sp /
  unsplit_from_sp (into and out of the SP region from replicated compute);
- parallelize.py: parallelize_by_hand(module, mesh, plan), a plan of "colwise" / "rowwise" with
  the semantics of torch's ColwiseParallel() / RowwiseParallel() defaults, and SP's "colwise_sp" /
  "rowwise_sp" / "sequence" (ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(
  output_layouts=Shard(1)), SequenceParallel());
- gpt.py: the Megatron plan of the course's TinyGPT (heads and MLP split; embeddings, LayerNorms,
  LM head replicated), parallelize_gpt (the fused qkv's rows permuted into head-grouped order, then
  the plan by hand or through torch's parallelize_module) and its attention on local heads;
- strategy.py: the loop strategies "tp", "sp" (tp + sequence parallelism) and "fsdp-tp" (TP, then fully_shard_by_hand over "dp" of a
  ("dp", "tp") mesh: labkit.strategies.fsdp takes TP parameters, fsdp/param.py's TPLayout);
- torch_ref.py: the oracles "torch-tp" (parallelize_module), "torch-sp" (with SequenceParallel)
  and "torch-fsdp-tp" (+ fully_shard).

What it leaves out: a vocabulary-parallel embedding / LM head, non-default
input / output layouts, mixed precision in the TP strategies, pipeline parallelism.
"""

from labkit.strategies.tp.conjugate import copy_to_tp, gather_from_tp, reduce_from_tp
from labkit.strategies.tp.gpt import check_gpt, gpt_plan, localize_heads, parallelize_gpt
from labkit.strategies.tp.parallelize import STYLES, parallelize_by_hand, tp_group
from labkit.strategies.tp.sequence import gather_from_sp, reduce_scatter_to_sp, split_to_sp, unsplit_from_sp
from labkit.strategies.tp.strategy import FSDPTP, SP, TP
from labkit.strategies.tp.torch_ref import TorchFSDPTP, TorchSP, TorchTP

__all__ = [
    "FSDPTP",
    "SP",
    "STYLES",
    "TP",
    "TorchFSDPTP",
    "TorchSP",
    "TorchTP",
    "check_gpt",
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "gpt_plan",
    "localize_heads",
    "parallelize_by_hand",
    "parallelize_gpt",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "split_to_sp",
    "tp_group",
    "unsplit_from_sp",
]
