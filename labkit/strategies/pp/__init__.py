"""Pipeline parallelism by hand: the model's layers cut into stages on different ranks, micro-
batches flowing through them on a schedule.

- schedule.py: the schedules as pure data, each rank's order of F(chunk, micro-batch) /
  B(chunk, micro-batch) / W(chunk, micro-batch) ("gpipe", "1f1b", "interleaved"; zero-bubble
  "zb-h1", "zbv": B input gradients, W weight gradients), and the replay of orders that gives
  the timeline, the bubble fraction and the live activations (no ranks needed);
- stage.py: an nn.Sequential's children cut into consecutive chunks (the model's own modules);
- gpt.py: TinyGPT as an nn.Sequential (embedding, blocks, head) and its loss on the logits;
- runtime.py: pipeline_by_hand(model, schedule=, n_microbatches=, group=, virtual_stages=): one
  rank's side, .step(x, target, loss_fn), over labkit.comm.p2p (traced, priced on the simulated
  network), with the per-step record (order run, live activations, bytes);
- clip.py: clip_grad_norm_(parameters, max_norm, ..., group=): torch's, by the whole pipeline's norm;
- strategy.py: the loop strategies "pp" and "pp-zero1" (pipeline x ZeRO-1 on a ("dp", "pp") mesh);
- torch_ref.py: "torch-pp", torch.distributed.pipelining's schedules, the oracle.
"""

from labkit.strategies.pp.clip import clip_grad_norm_
from labkit.strategies.pp.gpt import GPTEmbedding, GPTHead, gpt_loss, gpt_sequential
from labkit.strategies.pp.runtime import PipelineByHand, StepRecord, pipeline_by_hand
from labkit.strategies.pp.schedule import (
    SCHEDULES,
    ZERO_BUBBLE,
    Action,
    B,
    F,
    W,
    Slot,
    bubble_fraction,
    chunks_of,
    live_peak,
    order,
    orders,
    predicted_bubble,
    rank_of,
    timeline,
)
from labkit.strategies.pp.stage import split_sequential
from labkit.strategies.pp.strategy import PP, PPZeRO1
from labkit.strategies.pp.torch_ref import TorchPP, torch_schedule

__all__ = [
    "SCHEDULES",
    "ZERO_BUBBLE",
    "Action",
    "B",
    "F",
    "GPTEmbedding",
    "GPTHead",
    "PP",
    "PPZeRO1",
    "PipelineByHand",
    "Slot",
    "StepRecord",
    "TorchPP",
    "W",
    "bubble_fraction",
    "chunks_of",
    "clip_grad_norm_",
    "gpt_loss",
    "gpt_sequential",
    "live_peak",
    "order",
    "orders",
    "pipeline_by_hand",
    "predicted_bubble",
    "rank_of",
    "split_sequential",
    "timeline",
    "torch_schedule",
]
