"""Data parallelism by hand, in the order the lab builds it: DDPNaive -> DDPFlat -> DDPBucketed.

Every rank holds a full replica of the model. After backward each rank holds the gradient of its
own share of the batch; a SUM all-reduce turns it into the gradient of the whole batch, provided
each rank's loss is (sum of its token losses) / (global number of tokens). With equal shards and
a per-rank *mean* loss, use reduce_op="avg" instead (SUM, then divide by world_size), as torch's DDP does.

All three share one interface (what a learner's class in dp_lab implements too):
    ddp = DDPBucketed(model, bucket_cap_mb=1)   # broadcasts rank 0's weights
    with ddp.no_sync(): loss.backward()         # accumulation micro-batches: no communication
    loss.backward(); ddp.sync_gradients()       # after the last micro-batch, before opt.step()
and, built with `from_preset(model, cfg)` (which adds the preset's optimizer), the interface of
labkit.strategies that labkit.loop.train drives: after_backward() is sync_gradients(), step() and
zero_grad() run the optimizer. Buffers take the parameters' dtype and device (float64 stays exact).

Hard cases:
- frozen parameters (requires_grad=False) get no gradient and are never communicated;
- a tied weight (TinyGPT's embedding = LM head) is one Parameter, so it is reduced once;
- a parameter without a gradient in a step raises, unless find_unused_parameters=True: then the
  ranks all-reduce a "used" flag per parameter (one small extra collective, as torch's DDP does);
  a parameter used on some ranks gets zeros from the others, one used on no rank keeps
  grad None, so AdamW skips it exactly as single-process training does.

What it leaves out: gradients as views of the bucket buffers (torch's gradient_as_bucket_view:
we copy in and out, costing 4P bytes and two memcpys), bucket rebuilding from the observed
backward order, a smaller first bucket, comm hooks / compression, static_graph, buffers' syncing
(broadcast_buffers), process subgroups. comm="torch" (default) all-reduces with dist.all_reduce,
comm="ring" with labkit.comm's (labkit.strategies.comm_choice). Mixed precision (mp_policy=labkit.strategies.precision.MixedPrecision):
the replica computes in param_dtype, gradients are reduced in reduce_dtype straight into the fp32
masters' gradients, and the optimizer steps the masters (labkit.strategies.precision).
"""

from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from labkit.strategies import KeepsReduced, Strategy, SyncSwitch, check_reduce_op
from labkit.strategies.comm_choice import choose
from labkit.strategies.precision import MasterWeights, check_policy


def broadcast_parameters(model: torch.nn.Module, src: int = 0) -> None:
    """Make every rank start from rank `src`'s weights (and buffers): replicas must be identical,
    otherwise the same averaged gradient moves different models."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor, src=src)


def flat_views(
    flat: torch.Tensor, params: Sequence[torch.Tensor]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(param, view of `flat` shaped like param) for params laid out back to back in `flat`."""
    offset = 0
    for p in params:
        yield p, flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters that get gradients, each once (model.parameters() deduplicates tied weights)."""
    return [p for p in model.parameters() if p.requires_grad]


def _grad(p: torch.Tensor) -> torch.Tensor:
    """p.grad, there by now: backward's, or the zeros _missing_gradients() put in its place."""
    assert p.grad is not None
    return p.grad


def _like(params):
    """dtype and device for a buffer holding `params` end to end (one dtype: a copy would round)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise TypeError(f"one flat buffer cannot hold parameters of dtypes {sorted(map(str, dtypes))}")
    first = params[0] if params else torch.empty(0)
    return dict(dtype=first.dtype, device=first.device)


class _DDPBase(KeepsReduced, SyncSwitch, Strategy):
    """What the three stages share: the replica's trainable parameters, the start-up broadcast,
    the no_sync() switch, the handling of parameters without a gradient, and the loop interface."""

    model: torch.nn.Module
    optimizer: Any = None  # set by from_preset; sync_gradients() alone does not need one

    @classmethod
    def from_preset(cls, model, cfg, **options):
        options.setdefault("find_unused_parameters", cfg.has_unused_parameters)
        ddp = cls(model, **options)
        ddp.optimizer = cfg.make_optimizer(ddp.mp.masters if ddp.mp is not None else ddp.params)
        return ddp

    def sync_gradients(self) -> None:
        raise NotImplementedError  # each stage's own

    def after_backward(self):
        self.sync_gradients()

    def step(self):
        if self.mp is not None:
            self.mp.step(self.optimizer)  # unscale (fp16), step the fp32 masters, cast back
        else:
            self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)
        if self.mp is not None:  # the optimizer holds the masters: the 16-bit grads are ours
            for p in self.params:
                p.grad = None
            for master in self.mp.masters:  # the paper counts the fp32 copy as optimizer state
                self.observe("tag", "optimizer", master)

    def scale_loss(self, loss):
        return self.mp.scale_loss(loss) if self.mp is not None else loss

    def full_state_dict(self):
        return self.mp.state_dict(self.model) if self.mp is not None else super().full_state_dict()

    def full_grad_dict(self):
        if self.mp is None:
            return super().full_grad_dict()
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {
            names[id(p)]: m.grad.detach().clone()
            for p, m in zip(self.mp.params, self.mp.masters)
            if m.grad is not None
        }

    def _target(self, p):
        """Where the reduced gradient of p goes: p.grad, or (mixed precision) its fp32 master's."""
        return p.grad if self.mp is None else self.mp.master_grad(p)

    def _buffer_like(self, params):
        like = _like(params)
        if self.mp is not None:  # gradients are reduced in reduce_dtype
            like["dtype"] = self.mp.policy.reduce_dtype
        return like

    def __init__(
        self, model, reduce_op="sum", all_reduce=None, find_unused_parameters=False, mp_policy=None, comm=None
    ):
        check_reduce_op(reduce_op, f"{type(self).__name__}: reduce_op")
        mp_policy = check_policy(mp_policy, type(self).__name__)
        if comm is not None and all_reduce is not None:
            raise TypeError(f"{type(self).__name__}: pass comm= or all_reduce=, not both")
        self.model, self.reduce_op = model, reduce_op
        # comm="torch" (default: dist.all_reduce) or "ring" (labkit's); all_reduce: any other
        # all-reduce with dist.all_reduce's signature (labkit.comm.hierarchical's).
        self.comm = choose("torch" if comm is None else comm, type(self).__name__)
        self.all_reduce = all_reduce or self.comm.all_reduce
        self.find_unused_parameters = find_unused_parameters
        self.world_size = dist.get_world_size()
        self.params = trainable_parameters(model)
        self.names = {p: n for n, p in model.named_parameters()}
        self.broadcast()
        # Mixed precision (labkit.strategies.precision): the replica computes in param_dtype, the
        # optimizer steps fp32 masters made after the broadcast (so they are rank 0's too).
        self.mp = MasterWeights.of_module(model, mp_policy, self.params) if mp_policy else None

    def broadcast(self):
        """Start every replica from rank 0's weights (a method, so a lab drill can leave it out)."""
        broadcast_parameters(self.model)

    def _missing_gradients(self):
        """Parameters without a gradient now; zero-filled so every rank reduces the same tensors."""
        missing = [p for p in self.params if p.grad is None]
        if missing and not self.find_unused_parameters:
            names = ", ".join(self.names[p] for p in missing)
            raise RuntimeError(
                f"no gradient for {names} in this step; pass "
                f"find_unused_parameters=True so the ranks agree on what to reduce"
            )
        for p in missing:
            p.grad = torch.zeros_like(p)
        return missing

    def _drop_globally_unused(self, locally_missing):
        """One all-reduce of per-parameter 'used' flags; unused on every rank -> grad back to None."""
        if not self.find_unused_parameters:
            return
        used = torch.ones(len(self.params), device=self.params[0].device)
        index = {p: i for i, p in enumerate(self.params)}
        for p in locally_missing:
            used[index[p]] = 0
        dist.all_reduce(used)
        for p, count in zip(self.params, used.tolist()):
            if count == 0:
                p.grad = None
                if self.mp is not None:
                    self.mp.master_of[id(p)].grad = None

    def _finish(self, grad):
        if self.reduce_op == "avg":
            grad.div_(self.world_size)


class DDPNaive(_DDPBase):
    """Stage 1: after backward, one blocking all-reduce per parameter.

    Leaves out: batching small tensors into one message (DDPFlat) and overlap with backward
    (DDPBucketed): P tensors cost P latencies, all paid after backward ends."""

    def sync_gradients(self) -> None:
        missing = self._missing_gradients()
        for p in self.params:
            grad = _grad(p) if self.mp is None else _grad(p).to(self.mp.policy.reduce_dtype)
            self.all_reduce(grad)
            self._finish(grad)
            if self.mp is not None:
                self._target(p).copy_(grad)
        self._drop_globally_unused(missing)
        self.mark_reduced()  # a later backward without zero_grad adds to these (KeepsReduced)


class DDPFlat(_DDPBase):
    """Stage 2: copy every gradient into one flat buffer, one all-reduce, copy back.

    One latency instead of P, but still after backward ends, and the buffer costs 4P bytes.
    Leaves out: overlap (DDPBucketed)."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self.flat = torch.zeros(sum(p.numel() for p in self.params), **self._buffer_like(self.params))

    def sync_gradients(self) -> None:
        missing = self._missing_gradients()
        for p, view in flat_views(self.flat, self.params):
            view.copy_(_grad(p))
        self.all_reduce(self.flat)
        self._finish(self.flat)
        for p, view in flat_views(self.flat, self.params):
            self._target(p).copy_(view)
        self._drop_globally_unused(missing)
        self.mark_reduced()  # a later backward without zero_grad adds to these (KeepsReduced)


class DDPBucketed(_DDPBase):
    """Stage 3: buckets of about `bucket_cap_mb` MiB, each all-reduced asynchronously as soon as
    backward has produced all of its gradients (post-accumulate-grad hooks), so communication
    runs while backward computes the remaining layers. sync_gradients() waits for all of them.

    Buckets are filled in reverse parameter order (backward's rough order) and launched strictly
    in bucket order, so every rank issues the same collectives in the same order.
    Leaves out: see the module docstring (no grad-as-bucket-view, no bucket rebuilding)."""

    def __init__(self, model, bucket_cap_mb=25.0, **kwargs):
        super().__init__(model, **kwargs)
        cap = bucket_cap_mb * 2**20
        self.buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in reversed(self.params):
            # A bucket is one buffer, so it also ends where the dtype or device changes.
            if self.buckets[-1] and (
                size + p.numel() * p.element_size() > cap or _like(self.buckets[-1][:1]) != _like([p])
            ):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.buffers = [torch.zeros(sum(p.numel() for p in b), **self._buffer_like(b)) for b in self.buckets]
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.hooks = [p.register_post_accumulate_grad_hook(self.grad_ready) for p in self.params]
        self._reset()

    def _reset(self):
        self.ready: list[set[torch.Tensor]] = [set() for _ in self.buckets]
        self.handles: list[Any] = [None] * len(self.buckets)
        self.launched = 0

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self.syncing:
            return
        index = self.bucket_of[param]
        self.ready[index].add(param)
        # Launch in bucket order only: a bucket that is ready early waits for its predecessors.
        while self.launched < len(self.buckets) and len(self.ready[self.launched]) == len(
            self.buckets[self.launched]
        ):
            self.launch(self.launched)

    def launch(self, index: int) -> None:
        for p, view in flat_views(self.buffers[index], self.buckets[index]):
            view.copy_(_grad(p))
        self.handles[index] = self.all_reduce(self.buffers[index], async_op=True)
        self.launched = index + 1

    def sync_gradients(self) -> None:
        """Launch what backward did not (unused parameters), wait for every bucket, copy back."""
        missing = [p for p in self.params if p.grad is None]
        if self.launched < len(self.buckets):
            missing = self._missing_gradients()
            while self.launched < len(self.buckets):
                self.launch(self.launched)
        for index, handle in enumerate(self.handles):
            handle.wait()
            self._finish(self.buffers[index])
            for p, view in flat_views(self.buffers[index], self.buckets[index]):
                self._target(p).copy_(view)
        self._reset()
        self._drop_globally_unused(missing)
        self.mark_reduced()  # a later backward without zero_grad adds to these (KeepsReduced)

    def remove_hooks(self) -> None:
        for hook in self.hooks:
            hook.remove()
