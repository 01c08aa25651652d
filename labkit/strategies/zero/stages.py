"""The ZeRO strategies for labkit.loop: ZeRO1 (sharded optimizer state) and ZeRO2 (+ gradients).

    s = ZeRO2(model, torch.optim.AdamW, lr=1e-2, bucket_cap_mb=0.6)    # or loop.train("zero2", cfg)
    s.zero_grad(); loss.backward(); s.after_backward(); s.step()

- ZeRO1: every p.grad is a view of one flat, padded gradient buffer (flat_grad), which backward
  fills locally; after backward one reduce-scatter leaves this rank's chunk of the reduced
  gradient in place (grad_shard, only the chunk this rank steps is reduced); the ShardedOptimizer
  steps that chunk and all-gathers the parameters. Peak: 4P params + 4P gradients + 8P/N AdamW.
- ZeRO2: the layout is cut into buckets (reverse parameter order, about bucket_cap_mb each).
  When a bucket's first gradient arrives its send buffer is made and the bucket's .grad become
  views of it (autograd accumulates straight into it: no copy, no gradient held twice). A
  post-accumulate-grad hook counts each bucket's gradients; when a bucket is complete (and
  every bucket before it has gone: all ranks launch the same collectives in the same order) the
  parameters' .grad are dropped and the buffer is reduce-scattered asynchronously (labkit's comm
  thread) into this rank's slot of the gradient shard, while backward computes the earlier
  layers; its storage is freed as soon as it lands. The step's all-gather moves every bucket's
  chunk in one coalesced collective (labkit.comm.flat.all_gather_coalesced), in place.
  At most `max_in_flight` (default 1) are in flight: a launch first waits for the oldest. The
  comm thread runs collectives one at a time anyway, so a second one would only queue; with one,
  while backward produces gradients in reverse parameter order a rank holds its shard (4P/N)
  plus two buckets - the one backward is filling (its .grad) and the one on the wire (DeepSpeed's
  double buffer) - and at the end of backward the shard plus the last bucket (last_bucket_mb).
  Gradient accumulation: inside no_sync() nothing is launched, .grad accumulates locally (in
  the bucket buffers) and nothing is communicated; the last micro-batch's backward launches.

Both reduce with the loop's convention (reduce_op "sum"; "avg" for a per-rank mean loss), follow
the parameters' dtype and device, and handle frozen (left out), tied (one Parameter) and unused
parameters (no gradient on a step on every rank: zeros are sent, and the optimizer skips it).
The memory tracker sees the flat gradient / the shard and the send buffers as "gradients"
(tagged through the observe hook), and a sample "end of backward" is marked as after_backward
begins. The ring's partial-sum scratch ((N-1)/N of what a collective reduces) lives on the comm
thread, like gloo's and NCCL's internal buffers, which the tracker does not see.

Mixed precision (mp_policy=labkit.strategies.precision.MixedPrecision, ShardedOptimizer keeps the fp32
master shard): the model computes in param_dtype, frozen parameters are cast too (no master);
ZeRO1's flat gradient is in param_dtype (a .grad has its parameter's dtype) and is copied into a
reduce_dtype buffer for the reduce-scatter when the two differ; ZeRO2's send buffers and gradient
shard are in reduce_dtype. The shard then becomes the fp32 master gradient for the step only.
With bf16 everywhere, at the end of backward a rank holds: ZeRO1 2P parameters + 2P gradients +
12P/N optimizer (master 4 + AdamW 8); ZeRO2 2P + (2P/N shard + buckets in flight) + 12P/N.

What it leaves out: reducing on every micro-batch (DeepSpeed's ZeRO-2 does, to keep the gradient
sharded during accumulation too; here accumulation keeps full gradients until the last micro-
batch, as DDP's no_sync); overlapping the all-gather with the next forward; bucket rebuilding from
the observed backward order; parameters used on some ranks only (see labkit.strategies.zero).
"""

import collections
import inspect
from typing import Any, Optional

import torch

from labkit.strategies import KeepsReduced, Strategy, SyncSwitch, check_reduce_op
from labkit.strategies.comm_choice import check_verify, choose
from labkit.strategies.precision import check_policy
from labkit.strategies.zero.optimizer import ShardedOptimizer


# ZeRO2's defaults, sized on the lab's 0.8 M-parameter TinyGPT (3.1 MiB of fp32 gradients), 4 ranks:
# 7 buckets of whole parameters (cap 0.25 MiB cut it into 21, half of them a few bytes: every
# bucket costs a round's latency); the last bucket (embeddings) small, as nothing overlaps it.
# The trade-off, measured (benchmarks/zero.py prints both rows): buckets small enough to keep
# ZeRO-2's backward peak under ZeRO-1's cost one collective each, about 3 ms on 4 ranks sharing
# 2 cores; one big bucket is about as fast as ZeRO-1 (1.0-1.3x there) but holds the whole
# gradient at once before it is sent, and its peak is above ZeRO-1's.
BUCKET_CAP_MB, LAST_BUCKET_MB = 0.6, 0.1


class ZeRO1(KeepsReduced, Strategy):
    """ZeRO stage 1: optimizer state sharded (ShardedOptimizer), gradients reduce-scattered.

    params: param groups (dicts with per-group options) over the model's parameters; default
    every trainable parameter in one group with optimizer_kwargs. Every rank must pass the same
    model (the loop builds it from one seed; nothing is broadcast)."""

    model: torch.nn.Module
    optimizer: ShardedOptimizer
    bucket_cap_mb: Optional[float] = None  # one bucket: the whole flat buffer
    last_bucket_mb: Optional[float] = None

    @classmethod
    def from_preset(cls, model: torch.nn.Module, cfg: Any, **options: Any) -> "ZeRO1":
        return cls(model, cfg.optimizer, **{**cfg.optimizer_kwargs, **options})

    def __init__(
        self,
        model,
        optimizer_cls=torch.optim.AdamW,
        *,
        params=None,
        reduce_op="sum",
        group=None,
        verify=False,
        comm="ring",
        mp_policy=None,
        **optimizer_kwargs,
    ):
        check_reduce_op(reduce_op, f"{type(self).__name__}: reduce_op")
        mp_policy = check_policy(mp_policy, type(self).__name__)
        check_verify(verify, type(self).__name__)  # (choose() checks it too, after the options)
        _check_optimizer_options(type(self), optimizer_cls, optimizer_kwargs)
        self.model, self.reduce_op, self.group, self.verify = model, reduce_op, group, verify
        # comm: the gradients' reduce-scatter and the parameters' all-gather, labkit's ("ring",
        # default) or torch's ("torch"); verify: the hand-written ones' cross-rank check.
        self.comm = choose(comm, type(self).__name__, verify)
        params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
        # Mixed precision: frozen parameters compute in param_dtype too; their originals are kept
        # for the state dict (they never change).
        frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
        self.mp, self.frozen = mp_policy, {}
        self.optimizer = ShardedOptimizer(
            params,
            optimizer_cls,
            process_group=group,
            verify=verify,
            bucket_cap_mb=self.bucket_cap_mb,
            last_bucket_mb=self.last_bucket_mb,
            mp_policy=mp_policy,
            **optimizer_kwargs,
        )
        if mp_policy is not None:
            for p in frozen:
                self.frozen[id(p)] = p.detach().clone()
                p.data = p.data.to(mp_policy.param_dtype)
        self.optimizer.comm = self.comm  # one choice for the reduce-scatter and the all-gather
        self.optimizer.observe = lambda *args: self.observe(*args)  # the loop sets ours later
        self.layout = self.optimizer.layout
        self.rank, self.world_size = self.optimizer.rank, self.optimizer.world_size
        # .grad has its parameter's dtype; the reduction runs in reduce_dtype (both the layout's
        # dtype without mixed precision).
        self.grad_dtype = self.optimizer.flat_param.dtype
        self.reduce_dtype = mp_policy.reduce_dtype if mp_policy is not None else self.grad_dtype
        self.got_grad: set[int] = set()  # indices (into layout.params) of params backward gave a gradient
        self.hooks = [
            p.register_post_accumulate_grad_hook(lambda _, i=i: self.grad_ready(i))
            for i, p in enumerate(self.layout.params)
        ]
        self.flat_grad: Any = None  # (set up by zero_grad)
        self.grad_shard: Any = None
        self.reduced = False

    def grad_ready(self, index: int) -> None:
        self.got_grad.add(index)

    def zero_grad(self) -> None:
        """Zero the flat gradient (never set_to_none: the .grad views must stay views)."""
        if self.flat_grad is None:
            self.flat_grad = self.observe_tag(self.buffer(self.layout.numel, self.grad_dtype))
        else:
            self.flat_grad.zero_()
        for p, view in zip(self.layout.params, self.layout.views(self.flat_grad)):
            p.grad = view  # autograd accumulates into an existing .grad in place
        if self.reduce_dtype != self.grad_dtype:
            self.grad_shard = None  # a view of last step's reduce_dtype copy: let it go
        self.got_grad.clear()
        self.reduced = False
        self._zero_master_grad()

    def _zero_master_grad(self):
        """Mixed precision: drop last step's fp32 master gradient; the fp32 master shard is
        optimizer state, as the ZeRO paper counts it (K = 12 = master 4 + Adam's moments 8)."""
        if self.mp is not None:
            self.optimizer.drop_master_grad()
            self.observe_tag(self.optimizer.master, "optimizer")

    def buffer(self, numel: int, dtype: torch.dtype, zero: bool = True) -> torch.Tensor:
        """A flat buffer of `numel` elements in `dtype` on the parameters' device."""
        return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=self.layout.device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss)  # fp16: times the loss scale

    def observe_tag(self, tensor: torch.Tensor, category: str = "gradients") -> torch.Tensor:
        self.observe("tag", category, tensor)
        return tensor

    def check_grads_are_views(self) -> None:
        """A .grad replaced behind our back (model.zero_grad() sets it to None, and backward then
        makes a fresh tensor) would be silently missing from the reduce-scatter."""
        for p, view in zip(self.layout.params, self.layout.views(self.flat_grad)):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                raise RuntimeError(
                    "a parameter's .grad is no longer a view of the flat gradient: "
                    "call the strategy's zero_grad(), not model.zero_grad()"
                )

    def reduce_gradients(self) -> None:
        """grad_shard <- this rank's chunk of the reduced flat gradient, in place in flat_grad
        (the ring writes a rank's own chunk only at its last step). Async + wait: the ring runs
        on the comm thread, as ZeRO2's buckets do."""
        if self.reduced:
            return
        self.observe("mark", "end of backward")
        self.check_grads_are_views()
        flat = self.flat_grad
        if self.reduce_dtype != flat.dtype:  # e.g. bf16 gradients reduced in fp32
            flat = self.observe_tag(flat.to(self.reduce_dtype))
        self.grad_shard = flat[self.layout.rank_slice(0, self.rank)]
        self.reduce_scatter(self.grad_shard, flat).wait()
        self.reduced = True
        self.mark_reduced()

    def set_aside_reduced(self) -> Any:
        """A backward after the reduce-scatter (no zero_grad between): this rank's reduced chunk
        set aside, the flat gradient zeroed for the new one (KeepsReduced)."""
        if not self.reduced:
            return None
        aside = self.grad_shard.clone()
        self.flat_grad.zero_()
        self.reduced = False
        return aside

    def add_back_reduced(self, aside: Any) -> None:
        self.grad_shard.add_(aside)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Any:
        """Launch the reduce-scatter of `input` into `output` (this rank's chunk); a handle."""
        return self.comm.reduce_scatter(output, input, op=self.reduce_op, group=self.group, async_op=True)

    def after_backward(self) -> None:
        self.reduce_gradients()

    def step(self) -> None:
        self.reduce_gradients()  # a no-op when after_backward() ran
        if self.mp is not None:  # the fp32 master shard steps; the 16-bit weights are gathered
            self.optimizer.master_step(self.grad_shard, self.got_grad)
            return
        self.optimizer.attach_grads(self.grad_shard, self.got_grad)
        self.optimizer.local_step()
        self.optimizer.all_gather_params()

    def remove_hooks(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def held_grads(self) -> list[torch.Tensor]:
        """After after_backward(): this rank's chunk of the reduced gradient (what step() gives
        the optimizer; the parameters' .grad are not it)."""
        self.reduce_gradients()  # a no-op when after_backward() ran
        return [self.grad_shard]

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """After step(): every rank's reduced gradient chunks gathered (a collective), by name
        (mixed precision: the fp32 master gradient, unscaled)."""
        layout = self.layout
        shard = self.optimizer.master_grad if self.mp is not None else self.grad_shard
        full = self.optimizer.gather_shard(shard)
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {
            names.get(id(p), str(i)): view.clone()
            for i, (p, view) in enumerate(zip(layout.params, layout.views(full)))
            if i in self.got_grad
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Mixed precision: the fp32 masters gathered (a collective; both keys of a tied weight)
        and the frozen parameters' originals; else the model's own state dict."""
        if self.mp is None:
            return super().full_state_dict()
        full = self.optimizer.gather_shard(self.optimizer.master)
        value = {id(p): v for p, v in zip(self.layout.params, self.layout.views(full))}
        value.update(self.frozen)
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for key, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in value:
                state[key] = value[id(p)].detach().clone()
        return state


def _check_optimizer_options(cls, optimizer_cls, options):
    """Options that are neither the strategy's nor the optimizer's: name both lists (the optimizer
    would refuse them too, but say only that it got an unexpected keyword)."""
    try:
        accepted = inspect.signature(optimizer_cls).parameters
    except (TypeError, ValueError):
        return  # no signature to read: ShardedOptimizer's own check still runs
    if any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
        return
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        own = [
            n
            for c in cls.__mro__
            if "__init__" in vars(c) and c is not object
            for n, p in inspect.signature(c.__init__).parameters.items()
            if n not in ("self", "model", "optimizer_cls") and p.kind == p.KEYWORD_ONLY
        ]
        raise TypeError(
            f"{cls.__name__}: unknown option(s) {', '.join(map(repr, unknown))}: not "
            f"{cls.__name__}'s ({', '.join(dict.fromkeys(own))}) nor "
            f"{optimizer_cls.__name__}'s ({', '.join(n for n in accepted if n != 'params')})"
        )


class ZeRO2(SyncSwitch, ZeRO1):
    """ZeRO stage 2: ZeRO1 with the gradient sharded too, reduce-scattered bucket by bucket
    during backward (see the module docstring). Between steps only grad_shard (this rank's chunks
    of every bucket, 4P/N bytes in fp32) is kept."""

    def __init__(
        self,
        model,
        optimizer_cls=torch.optim.AdamW,
        *,
        bucket_cap_mb=BUCKET_CAP_MB,
        last_bucket_mb=LAST_BUCKET_MB,
        max_in_flight=1,
        **options,
    ):
        self.bucket_cap_mb = bucket_cap_mb
        self.last_bucket_mb = last_bucket_mb
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            # 0 would wait for a collective before any was launched: nothing could ever go out.
            raise ValueError(
                f"{type(self).__name__}: max_in_flight must be an int >= 1 (how many bucket "
                f"reduce-scatters may be on the wire at once; default 1), got {max_in_flight!r}"
            )
        self.max_in_flight = max_in_flight
        super().__init__(model, optimizer_cls, **options)
        self.bucket_of = [b for b, bucket in enumerate(self.layout.buckets) for _ in bucket.params]
        # Gradients land in their bucket's send buffer: when a bucket's first gradient arrives its
        # buffer is made and every .grad of the bucket becomes a view of it (autograd then adds
        # into it in place), so the launch copies nothing and no gradient exists twice. Not with
        # a reduce_dtype other than the parameters' (a .grad has its parameter's dtype): then
        # the launch copies (casts) into the send buffer.
        if self.reduce_dtype == self.grad_dtype:
            self.hooks += [
                p.register_hook(lambda _, b=b: self._arm(b))
                for p, b in zip(self.layout.params, self.bucket_of)
            ]
        self._reset()

    def _reset(self):
        self.ready = [0] * len(self.layout.buckets)
        self.launched = 0
        self.in_flight: collections.deque = collections.deque()  # (handle, send buffer), oldest first
        self.armed: dict[int, torch.Tensor] = {}  # bucket -> its send buffer, the .grad's storage

    def _arm(self, b):
        """Bucket b's send buffer, made when its first gradient arrives (a tensor hook runs just
        before autograd accumulates into .grad); a gradient already there is moved into it."""
        if b in self.armed or b < self.launched:
            return
        bucket = self.layout.buckets[b]
        send = self.armed[b] = self.observe_tag(self.buffer(bucket.padded_numel, self.reduce_dtype))
        for p, view in zip(bucket.params, bucket.views(send)):
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view

    def zero_grad(self) -> None:
        for p in self.layout.params:
            p.grad = None  # autograd makes fresh ones; a launched bucket frees its own
        if self.grad_shard is None:
            self.grad_shard = self.observe_tag(self.buffer(self.layout.shard_numel, self.reduce_dtype))
        self.got_grad.clear()
        self.reduced = False
        self._reset()
        self._zero_master_grad()

    def grad_ready(self, index: int) -> None:
        self.got_grad.add(index)
        if not self.syncing:
            return
        self.ready[self.bucket_of[index]] += 1
        # Launch in bucket order only: a bucket ready early waits for its predecessors.
        buckets = self.layout.buckets
        while self.launched < len(buckets) and self.ready[self.launched] == len(
            buckets[self.launched].params
        ):
            self.launch(self.launched)

    def _land_oldest(self):
        """Wait for the oldest reduce-scatter and free its send buffer's memory now (resizing the
        storage: the collective's own job may still hold a reference to the tensor)."""
        handle, send = self.in_flight.popleft()
        handle.wait()  # re-raises a failed collective's error
        send.untyped_storage().resize_(0)

    def _drop_landed(self):
        """Free the send buffers whose reduce-scatter has landed (oldest first: one FIFO queue)."""
        while self.in_flight and self.in_flight[0][0].is_completed():
            self._land_oldest()

    def launch(self, b: int) -> None:
        self._drop_landed()
        while len(self.in_flight) >= self.max_in_flight:  # double buffering: oldest lands first
            self._land_oldest()
        bucket = self.layout.buckets[b]
        send = self.armed.pop(b, None)
        if send is None:  # no gradient arrived through the hooks (or another reduce_dtype)
            send = self.observe_tag(self.buffer(bucket.padded_numel, self.reduce_dtype))
        for p, view in zip(bucket.params, bucket.views(send)):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)  # None: unused in this step (zeros are sent)
            p.grad = None  # the full gradient of this bucket is gone
        handle = self.reduce_scatter(self.grad_shard[self.layout.shard_slice(b)], send)
        self.in_flight.append((handle, send))
        self.launched = b + 1

    def reduce_gradients(self) -> None:
        """Launch what backward did not (buckets with an unused parameter, or all of them after
        a backward outside the hooks), then wait for every bucket."""
        if self.reduced:
            return
        self._drop_landed()
        self.observe("mark", "end of backward")
        while self.launched < len(self.layout.buckets):
            self.launch(self.launched)
        while self.in_flight:
            self._land_oldest()
        self.reduced = True
        self.mark_reduced()

    def set_aside_reduced(self) -> Any:
        """A backward after the reduce-scatters (no zero_grad between): the reduced shard set
        aside, a fresh one for the new gradient's (KeepsReduced)."""
        if not self.reduced:
            return None
        aside, self.grad_shard = (
            self.grad_shard,
            self.observe_tag(self.buffer(self.layout.shard_numel, self.reduce_dtype)),
        )
        self.reduced = False
        self._reset()
        return aside


def backward_grad_bytes(record: Any) -> list[int]:
    """Per step, the gradient bytes alive at the end of backward, from a MemoryTracker record
    (loop.train(..., track_memory=True)["memory"]): the sample marked "end of backward" (ZeRO1/2
    mark it), or else the last "backward end" sample before each "sync start" (any strategy)."""
    marked = [s.by_category["gradients"] for s in record.samples if s.label == "end of backward"]
    if marked:
        return marked
    out, last = [], None
    for s in record.samples:
        if s.label == "backward end":
            last = s
        elif s.label == "sync start" and last is not None:
            out.append(last.by_category["gradients"])
            last = None
    return out
