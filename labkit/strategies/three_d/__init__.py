"""Three-dimensional parallelism: data x pipeline x tensor parallelism on one ("dp", "pp", "tp")
mesh, built from the families' own pieces (pp/ pipeline_by_hand, tp/ parallelize_gpt, zero/ ZeRO1,
fsdp/ fully_shard_by_hand).

- layout.py: the 3-D mesh and its checks, TinyGPT split into tensor-parallel stages, the full
  dicts gathered from the stage holding each tensor (Composed, the strategies' base);
- zero1.py: "zero1-tp-pp", Megatron-LM's (ZeRO-1 over "dp");
- fsdp.py: "fsdp-tp-pp", Llama 3's (FSDP over "dp", not resharded after forward, each unit
  gathered and reduced once per step inside the pipeline);
- checkpoint.py: their weights through torch.distributed.checkpoint: save (8 ranks), load_full
  (one process, the plain model's layout), load (into either layout, same tp);
- torch_ref.py: TorchFSDPTPPP, torch's fully_shard + parallelize_module + pipelining (the oracle,
  not in NAMES: tests/test_three_d.py trains the class).
"""

from labkit.strategies.three_d.checkpoint import load, load_full, save
from labkit.strategies.three_d.fsdp import FSDPTPPP
from labkit.strategies.three_d.layout import DIMS, Composed
from labkit.strategies.three_d.torch_ref import TorchFSDPTPPP
from labkit.strategies.three_d.zero1 import ZeRO1TPPP

__all__ = [
    "DIMS",
    "FSDPTPPP",
    "Composed",
    "TorchFSDPTPPP",
    "ZeRO1TPPP",
    "load",
    "load_full",
    "save",
]
