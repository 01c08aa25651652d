"""PyTorch's own DDP behind the labkit.strategies interface ("torch-ddp"): the oracle the
hand-written ddp-naive / ddp-flat / ddp-bucketed are checked against; and the refusal every
torch-* strategy built on DistributedDataParallel shares (torch-zero1 too).

What it leaves out: DDP's options other than bucket_cap_mb and find_unused_parameters.
"""

from typing import Any

import torch

from labkit.strategies import Strategy


class TorchDDP(Strategy):
    """torch.nn.parallel.DistributedDataParallel behind the same interface, as the oracle.

    Forward must go through `self.model` (the DDP wrapper; calling the strategy does), which
    averages the gradients (AVG): the loops multiply the per-rank loss by world_size to keep the
    SUM convention. Its options are torch's (bucket_cap_mb, find_unused_parameters) and record
    (a comm hook that makes DDP's all-reduces visible to the tracer); reduce_op can only be "avg"
    and mp_policy a bf16 policy on CUDA (DDP's experimental _MixedPrecision; refused on CPU,
    where its reducer cannot run, and for fp16, which it cannot scale), never trained in fp32
    under a bf16 preset."""

    reduce_op = "avg"
    model: Any  # the DistributedDataParallel wrapper
    optimizer: Any = None

    @classmethod
    def from_preset(cls, model: torch.nn.Module, cfg: Any, **options: Any) -> "TorchDDP":
        options.setdefault("find_unused_parameters", cfg.has_unused_parameters)
        ddp = cls(model, **options)
        ddp.optimizer = cfg.make_optimizer([p for p in model.parameters() if p.requires_grad])
        return ddp

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def replica(self) -> torch.nn.Module:
        return self.module  # self.model is the DDP wrapper

    def __init__(
        self,
        model,
        bucket_cap_mb=25.0,
        find_unused_parameters=False,
        record=True,
        reduce_op="avg",
        mp_policy=None,
    ):
        from torch.nn.parallel import DistributedDataParallel
        from labkit.observe.tracing import ddp_comm_hook_recording

        mixed = refuse_torch_options("torch-ddp", reduce_op, mp_policy)
        if mixed is not None and next(model.parameters()).device.type != "cuda":
            raise NotImplementedError(
                "torch-ddp: torch's DDP mixed precision needs CUDA (its reducer syncs the upcast "
                "gradients with stream events: 'cpu backend doesn't support events'); on CPU use "
                "'ddp-bucketed' (labkit's, with mp_policy) or 'torch-fsdp' (MixedPrecisionPolicy)"
            )
        self.module = model
        self.model = DistributedDataParallel(
            model,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            **({} if mixed is None else {"mixed_precision": mixed}),
        )
        # DDP talks from C++: only a comm hook makes its all-reduces visible. Under a policy DDP's
        # mixed precision takes the one comm hook slot (its upcast hook): not recorded then.
        if record and mixed is None:
            self.model.register_comm_hook(None, ddp_comm_hook_recording)
        self.no_sync = self.model.no_sync  # type: ignore[method-assign]  # DDP's own switch
        self.find_unused_parameters = find_unused_parameters
        self.label = "torch-ddp"  # the name its refusals give (torch-zero1 sets its own)

    def after_backward(self) -> None:
        self.sync_gradients()

    def sync_gradients(self) -> None:
        """DDP's reducer has already waited for its buckets at the end of backward -- except, without
        find_unused_parameters, a bucket holding a parameter that got no gradient: torch never
        reduces it and raises only at the NEXT forward ("Expected to have finished reduction in
        the prior iteration"), after this step has used the bucket's unreduced, per-rank
        gradients. Raised here instead, naming the parameter, as labkit's DDP does."""
        if self.find_unused_parameters:
            return
        missing = [n for n, p in self.module.named_parameters() if p.requires_grad and p.grad is None]
        if missing:
            raise RuntimeError(
                f"{self.label}: no gradient for {', '.join(missing)} in this step: torch's DDP leaves "
                f"that parameter's bucket unreduced (this step would use per-rank gradients) and "
                f"raises at the next forward; pass find_unused_parameters=True"
            )


def refuse_torch_options(name: str, reduce_op: str, mp_policy: Any) -> Any:
    """torch's DDP (torch-ddp, torch-zero1) averages: refuse what it cannot honour instead of
    training something else than asked. A bf16 policy becomes DDP's own (experimental,
    private) `mixed_precision=_MixedPrecision(param_dtype, reduce_dtype)`: fp32 parameters that
    the optimizer steps, cast to param_dtype for forward and backward, gradients reduced in
    reduce_dtype (returned; None without a policy), on CUDA only. fp16 is refused: DDP has no
    loss scaling."""
    if reduce_op != "avg":
        raise ValueError(
            f"{name}: reduce_op must be 'avg' (torch's DDP averages; the loop scales "
            f"the loss for it), got {reduce_op!r}"
        )
    if mp_policy is None:
        return None
    from labkit.strategies.precision import check_policy

    policy = check_policy(mp_policy, name)
    if policy is None or policy.loss_scaling:
        raise NotImplementedError(
            f"{name}: torch's DistributedDataParallel has no loss scaling for fp16, so "
            f"mp_policy={mp_policy!r} cannot be honoured. Use bf16, or 'ddp-bucketed' (labkit's, "
            f"with fp16's dynamic loss scaling)"
        )
    from torch.nn.parallel.distributed import _MixedPrecision

    return _MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
