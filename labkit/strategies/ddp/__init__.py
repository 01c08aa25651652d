"""Data parallelism (DDP), the family's face: every rank a whole replica, gradients all-reduced.

- by_hand.py: the lab's three stages, DDPNaive (one all-reduce per parameter) -> DDPFlat (one flat
  all-reduce after backward) -> DDPBucketed (buckets all-reduced while backward still runs), and
  broadcast_parameters (every replica starts from rank 0's weights);
- torch_ref.py: TorchDDP, torch.nn.parallel.DistributedDataParallel behind the same interface,
  the oracle ("torch-ddp").

What it leaves out: see by_hand.py (gradient_as_bucket_view, bucket rebuilding, comm hooks).
"""

from labkit.strategies.ddp.by_hand import DDPBucketed, DDPFlat, DDPNaive, broadcast_parameters
from labkit.strategies.ddp.torch_ref import TorchDDP

__all__ = ["DDPNaive", "DDPFlat", "DDPBucketed", "TorchDDP", "broadcast_parameters"]
