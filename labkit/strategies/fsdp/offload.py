"""CPU offload for labkit.strategies.fsdp (FSDP2's offload_policy=CPUOffloadPolicy(), by hand).

    fully_shard_by_hand(block, offload_policy=CPUOffloadPolicy(pin_memory=False))

What lives where, as in torch's fully_shard:
  host (CPU memory)  each parameter's padded shard (the master copy the optimizer reads), its
                     gradient shard (.grad) and the optimizer state: the optimizer built over
                     model.parameters() steps on the host;
  device             the unsharded parameters while a unit is gathered, the all-gather and
                     reduce-scatter buffers, activations.
Moves, each traced as an op of labkit.observe.tracing (world size 1, its bytes this rank's):
  "h2d"  before a unit's all-gather, its shards are copied to the device (one event per gather:
         the unit's padded shard bytes, in the shards' own dtype);
  "d2h"  when a unit's reduce-scatter lands, its gradient shards are copied to the host (one
         event per landing: the padded gradient shard bytes, in the shards' dtype).
The host copies are new storages even when the device IS the CPU (a CPU-only machine): the
memory tracker (labkit.observe.memory) puts them in its "host" pool, so the lesson's two pools stay
apart there too. labkit.costmodel.links.PCIE_GEN5_X16 prices the moves.

pin_memory=True (torch's default) page-locks the host shards so copies can be asynchronous DMA;
it needs an accelerator (torch raises "Cannot access accelerator device" without one, and so does
this: pass CPUOffloadPolicy(pin_memory=False) on a CPU-only machine). torch's own
CPUOffloadPolicy / OffloadPolicy are accepted as well.
Left out: overlap of the copies with compute (FSDP2 issues them on separate CUDA streams; here
they run on the default stream, non_blocking only from pinned memory), offload with
reshard_after_forward=<int>, FSDP x TP parameters, fsdp-flat. Tested (tests/test_offload.py,
scripts/gpu_check.py) on a 1-D mesh in fp32; hsdp and mixed precision pass it through, untested.
"""

from dataclasses import dataclass
from typing import Any, Optional

import torch

from labkit.observe import memory, tracing


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """Shards, gradients and optimizer state on the host (torch.distributed.fsdp.CPUOffloadPolicy's
    name and field): pin_memory page-locks the host shards (needs an accelerator)."""

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy: pin_memory must be a bool, got {self.pin_memory!r}")


def check_offload(policy: Any, who: str) -> Optional[CPUOffloadPolicy]:
    """policy as labkit's CPUOffloadPolicy, or None (no offload): None, labkit's class, or torch's
    OffloadPolicy() (no offload) / CPUOffloadPolicy(pin_memory). Anything else raises."""
    if policy is None or isinstance(policy, CPUOffloadPolicy):
        out = policy
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPU, OffloadPolicy

        if isinstance(policy, TorchCPU):
            out = CPUOffloadPolicy(pin_memory=bool(policy.pin_memory))
        elif type(policy) is OffloadPolicy:
            out = None  # torch's default: nothing offloaded
        else:
            raise TypeError(
                f"{who}: offload_policy must be None, labkit.strategies.fsdp.CPUOffloadPolicy or "
                f"torch's CPUOffloadPolicy / OffloadPolicy, got {type(policy).__name__} {policy!r}"
            )
    if out is not None and out.pin_memory and not torch.cuda.is_available():
        raise RuntimeError(
            f"{who}: CPUOffloadPolicy(pin_memory=True) needs an accelerator (page-locked host "
            f"memory is for DMA to a GPU; torch's fully_shard raises 'Cannot access accelerator "
            f"device' here): pass CPUOffloadPolicy(pin_memory=False) on a CPU-only machine"
        )
    return out


def to_host(tensor: torch.Tensor, policy: CPUOffloadPolicy) -> torch.Tensor:
    """A new host tensor holding `tensor` (always a copy, also from the CPU), in the memory
    tracker's host pool. Untraced: the caller records the move (`moved`)."""
    with memory.host_allocations():
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=policy.pin_memory)
    memory.mark_host(out)
    out.copy_(tensor.detach())
    return out


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor on `device` holding the host `tensor` (a copy even when device is the CPU)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    out.copy_(tensor.detach(), non_blocking=tensor.is_pinned())
    return out


def moved(op: str, nbytes: int) -> Any:
    """A context recording one host<->device move of `nbytes` as `op` ("h2d" / "d2h")."""
    return tracing.record_collective(op, nbytes, 1, label=op)


def _shard_bytes(params: Any) -> int:
    return sum(p.padded.numel() * p.padded.element_size() for p in params)


def offload_formula(units: Any, accum_steps: int = 1, optimizer_state_per_element: int = 2) -> dict[str, int]:
    """What CPU offload moves and holds on one rank, from its units (FSDPParamGroups, e.g. the FSDP
    strategy's `units`), in bytes:
      "h2d"   per step: each unit's padded shards, once per all-gather: twice for a unit
              resharded after forward (forward, then backward), once for the root or a unit
              with reshard_after_forward=False;
      "d2h"   per step: each trainable shard's gradient, once per micro-batch;
      "host"  held on the host after a step: shards + gradient shards + optimizer state
              (optimizer_state_per_element tensors per trainable parameter, AdamW's exp_avg and
              exp_avg_sq, each the size of the shard's REAL rows: the optimizer sees the DTensor,
              whose local rows stop before the padding) + one 4-byte step counter each;
              what the device pool no longer holds.
    Left out: a parameter unused in a step (no gradient moves), optimizers with other state."""
    h2d = sum(_shard_bytes(u.params) * (1 if u.is_root or not u.reshard_after_forward else 2) for u in units)
    trainable = [p for u in units for p in u.params if p.requires_grad]
    grads = _shard_bytes(trainable)
    host = _shard_bytes([p for u in units for p in u.params]) + grads
    real = sum(p.padded[: p.valid].numel() * p.padded.element_size() for p in trainable)
    host += optimizer_state_per_element * real + 4 * len(trainable)
    return {"h2d": h2d, "d2h": grads * accum_steps, "host": host}


def offload_report(strategy: Any) -> dict[str, Any]:
    """loop.Hooks(report=offload_report): {"offload": offload_formula(strategy.units)} (the FSDP
    strategy's units), next to what the run measured."""
    return {"offload": offload_formula(strategy.units)}


__all__ = [
    "CPUOffloadPolicy",
    "check_offload",
    "moved",
    "offload_formula",
    "offload_report",
    "to_device",
    "to_host",
]
