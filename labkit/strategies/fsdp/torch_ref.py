"""PyTorch's own FSDP behind the labkit.strategies interface ("torch-fsdp"): the oracle the
hand-written fsdp is checked against, on the same loop, model, data and optimizer.

fully_shard (FSDP2) on the same units as the hand-written FSDP, on a device mesh of all ranks
(gloo on CPU works); parameters become DTensors, gradients are reduce-scattered with AVG, so the
loop scales the loss by the world size (exact for powers of two; for 3 ranks one rounding per
element, far below the fp32 tolerances).

offload_policy= (labkit's CPUOffloadPolicy or torch's) becomes torch's CPUOffloadPolicy
(pin_memory=False on a CPU-only machine: torch pins only with an accelerator).
What it leaves out: FSDP2's mixed precision beyond param_dtype / reduce_dtype; HSDP
meshes are fsdp/hsdp.py's TorchHSDP (mesh=). A unit whose parameter is shared with another unit
(a weight tied across units) is not sharded on its own: fully_shard cannot give one Parameter to
two units, so such modules fall to the root, which is where the hand-written plan puts the shared
parameter too.
"""

import contextlib
from typing import Any, Iterator

import torch.distributed as dist

from labkit.strategies import Strategy
from labkit.strategies.fsdp.plan import innermost_first, own_units, plan_units
from labkit.strategies.fsdp.offload import check_offload
from labkit.strategies.precision import check_policy


def _full(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


class TorchFSDP(Strategy):
    model: Any  # the model fully_shard made FSDP modules of
    optimizer: Any = None

    reduce_op = "avg"

    def __init__(
        self,
        model,
        cfg,
        units=None,
        reshard_after_forward=True,
        mp_policy=None,
        mesh=None,
        reduce_op="avg",
        offload_policy=None,
    ):
        from torch.distributed.device_mesh import init_device_mesh

        if reduce_op != "avg":
            raise ValueError(
                f"torch-fsdp: reduce_op must be 'avg' (fully_shard's; the loop scales "
                f"the loss for it), got {reduce_op!r}"
            )
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not isinstance(mp_policy, MixedPrecisionPolicy):  # torch's own policy is taken as is
            check_policy(mp_policy, type(self).__name__)

        device = next(model.parameters()).device
        if mesh is None:  # a 2-D mesh is HSDP (hsdp.py's TorchHSDP)
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # The units labkit.strategies.fsdp.FSDP wraps by default (like_torch=True): the same list.
        self.units = own_units(model, plan_units(model, cfg.units if units is None else units))
        options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
        if (
            mp_policy is not None
        ):  # labkit's MixedPrecision or torch's MixedPrecisionPolicy: the same two fields
            options["mp_policy"] = (
                mp_policy
                if isinstance(mp_policy, MixedPrecisionPolicy)
                else MixedPrecisionPolicy(
                    param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype
                )
            )
        offload = check_offload(offload_policy, type(self).__name__)
        if offload is not None:
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["offload_policy"] = CPUOffloadPolicy(pin_memory=offload.pin_memory)
        for module in innermost_first(model, self.units):
            fully_shard(module, **options)
        self.model = fully_shard(model, **options)
        self.optimizer = cfg.make_optimizer([p for p in model.parameters() if p.requires_grad])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # FSDP2 then keeps unsharded gradients and reduce-scatters after the step's last backward.
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self) -> dict[str, Any]:
        return {k: _full(v) for k, v in self.model.state_dict().items()}

    def full_grad_dict(self) -> dict[str, Any]:
        return {n: _full(p.grad) for n, p in self.model.named_parameters() if p.grad is not None}
