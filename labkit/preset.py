"""One training configuration (Preset) and the course's presets (PRESETS): the base layer, so the
strategies (layer 3) and the loop (layer 4) check `isinstance(cfg, Preset)` against one class.
labkit.loop re-exports Preset, PRESETS, EPS and OPTIMIZER_KWARGS under its own names.

What it leaves out: building the model and the batches (labkit.loop.build_model, global_batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from labkit.models import ADAMW_DEFAULTS, GPTConfig

__all__ = ["EPS", "OPTIMIZER_KWARGS", "PRESETS", "Preset", "check_preset"]

# One eps for every preset. TinyGPT's attention key bias has a gradient that is zero in exact
# arithmetic (softmax ignores a constant added to a row of scores): in fp32 it is rounding noise
# whose value depends on how the batch was split. AdamW divides a gradient by its own RMS plus
# eps, so with eps=1e-8 that noise becomes full-size updates (~4e-6 apart after 5 steps, torch's
# DDP too); eps=1e-6 is larger than the noise's RMS and keeps those weights within ~1e-7, while
# real gradients (RMS >> 1e-6) train as before.
EPS = ADAMW_DEFAULTS["eps"]  # 1e-6: models.make_optimizer uses the same
OPTIMIZER_KWARGS = dict(ADAMW_DEFAULTS, lr=1e-2)


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model, data, optimizer and length of one training configuration (see PRESETS).

    model: "gpt" (TinyGPT(GPTConfig(seq_len=seq_len, **gpt))) or "toy" (ToyModel(tied=True)).
    extra_every: toy only, ToyModel's `extra` layer is used on steps with step % extra_every == 1
    (0: never), so extra.bias has no gradient in the other steps.
    units: the FSDP units (labkit.strategies.fsdp.plan.plan_units: a name, a class, a predicate).
    mp: a labkit.strategies.precision.MixedPrecision policy (None: everything in `dtype`). The model is built
    in `dtype` (the fp32 masters); strategies and the reference compute in mp.param_dtype.
    activation_checkpointing: gpt only, every block recomputes its forward inside backward
    (labkit.strategies.activation_checkpointing), in the reference too."""

    model: str = "gpt"
    gpt: dict = dataclasses.field(default_factory=dict)
    seq_len: int = 32
    batch_size: int = 8
    seed: int = 0
    optimizer: type = torch.optim.AdamW
    optimizer_kwargs: dict = dataclasses.field(default_factory=lambda: dict(OPTIMIZER_KWARGS))
    steps: int = 5
    dtype: torch.dtype = torch.float32
    extra_every: int = 0
    units: object = "block"
    mp: Any = None  # a labkit.strategies.precision.MixedPrecision (a layer above: not imported here)
    activation_checkpointing: bool = False

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward run in: the mixed-precision policy's, else the model's."""
        return self.mp.param_dtype if self.mp is not None else self.dtype

    @property
    def has_unused_parameters(self) -> bool:
        return self.model == "toy" and self.extra_every > 0

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(seq_len=self.seq_len, **self.gpt)

    def make_optimizer(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        return self.optimizer(params, **self.optimizer_kwargs)

    def replace(self, **changes: Any) -> Preset:
        return dataclasses.replace(self, **changes)


PRESETS = {
    # Every hard case: frozen weight, a weight tied across two units (head / extra), a parameter
    # unused on even steps, odd tensor sizes, 7 rows (uneven on 2 and 3 ranks). FSDP units: each Linear.
    "toy": Preset(model="toy", batch_size=7, extra_every=2, units=torch.nn.Linear),
    # The DDP lab's TinyGPT: small enough for 3 ranks on 2 cores; 7 rows split unevenly.
    "dp": Preset(gpt=dict(d_model=32, n_heads=4, n_layers=2), seq_len=32, batch_size=7),
    # The ZeRO lab's: 0.8 M parameters on 16-token sequences: model state ~77% of DDP's peak at N=4.
    "zero": Preset(gpt=dict(d_model=128, n_heads=4, n_layers=4), seq_len=16, batch_size=8),
    # The FSDP lab's (and its tests'): 0.9 M parameters in 8 blocks on 16-token rows, so model
    # state dominates the peak and a block is 1/8 of it. Measured at N = 4 (loop.train with
    # track_memory, 5 steps, ddp-bucketed with 1 MiB buckets): hand-written DDP's parameters +
    # gradients + optimizer are 0.79 of its 17.5 MiB peak; FSDP's peak (block units) 0.33x DDP's;
    # the root-only wrap's 2.3x the per-block wrap's; fully_shard's within 1% of FSDP's.
    "fsdp": Preset(gpt=dict(d_model=96, n_heads=4, n_layers=8), seq_len=16, batch_size=8),
    # The MoE lab's (labkit.strategies.ep): TinyGPT whose blocks' MLPs are 4 experts, top-2,
    # dropless (gpt capacity_factor=1.0 for drops): 4 ranks on 2 cores in seconds.
    "moe": Preset(
        gpt=dict(d_model=32, n_heads=4, n_layers=2, n_experts=4, top_k=2), seq_len=16, batch_size=8
    ),
    # Benchmarks: large enough that communication and compute both show on a timeline.
    "bench": Preset(gpt=dict(d_model=128, n_heads=4, n_layers=4), seq_len=64, batch_size=16, steps=10),
}


def check_preset(cfg: object, where: str) -> Preset:
    """`cfg` itself if it is a Preset, else a TypeError naming `where` (and PRESETS[cfg] for a name)."""
    if not isinstance(cfg, Preset):
        hint = f" (loop.PRESETS[{cfg!r}]?)" if isinstance(cfg, str) and cfg in PRESETS else ""
        raise TypeError(f"{where}: cfg must be a loop.Preset, got {type(cfg).__name__} {cfg!r}{hint}")
    return cfg
