"""ZeRO by hand, in the order the lab builds it: FlatPartition -> ZeRO1 -> ZeRO2.

Every rank keeps the whole model for forward and backward. What it stops keeping whole:
- ZeRO1 (the ZeRO paper's P_os): Adam's state (m, v, step) exists only for this rank's 1/N chunk
  of the flat parameters; a step is reduce-scatter(AVG) of the gradient -> AdamW on the chunk ->
  all-gather of the updated chunks;
- ZeRO2 (P_os+g): also the gradient; after the reduce-scatter only this rank's chunk survives.
Communication per step is a reduce-scatter plus an all-gather, which moves exactly what DDP's
all-reduce moves (a ring all-reduce IS a reduce-scatter followed by an all-gather).

Layout: FlatPartition puts the trainable parameters end to end in one flat buffer, padded with
zeros to N * ceil(numel / N) (labkit.comm.collectives.shard_range's convention), and every parameter
becomes a view of it, so the all-gather writes straight into the model.

Exactness: the local step is torch.optim.AdamW itself, run over one segment per parameter that
intersects the chunk (views of the flat buffer). AdamW is elementwise, so this is the reference's
arithmetic on those elements; per-parameter segments (not one flat shard) keep AdamW's per-
parameter step counter and its "grad is None -> skip, no weight decay" rule. Padding is never an
optimizer element, so weight decay cannot touch it.

What it leaves out: mixed precision (params are fp32, so "the fp32 master of the shard" is the
rank's slice of the parameter buffer itself); overlapping the reduce-scatter with backward
(DeepSpeed's stage 2 reduces buckets as backward produces them - here the full gradient exists
until step(), so ZeRO2 lowers the steady state, not the backward peak); ZeRO-3 (parameters stay
whole: see the FSDP lab); data-dependent unused parameters (every rank must leave the same
parameters without a gradient - DDP's find_unused_parameters flag exchange is not repeated here).
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter, shard_range
from labkit.models import make_optimizer
from labkit.strategies import Strategy
from labkit.observe.tracing import span


class FlatPartition:
    """The trainable parameters (each once: tied weights are one Parameter) laid end to end.

    Parameter i occupies flat elements [offsets[i], offsets[i] + numels[i]). The buffer is padded
    to `padded_numel = world_size * chunk` with chunk = ceil(numel / world_size), so every rank's
    chunk has the same size (what reduce_scatter_tensor / all_gather_into_tensor require); rank k
    owns padded elements [k * chunk, (k + 1) * chunk), of which `rank_range(k)` are real.
    """

    def __init__(self, params, world_size):
        unique = {}
        for p in params:
            if p.requires_grad:   # frozen parameters stay replicated and untouched
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        if len({p.dtype for p in self.params}) > 1:
            raise TypeError("FlatPartition needs one dtype for all trainable parameters")
        self.world_size = world_size
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        _, _, self.padded_numel = shard_range(self.numel, 0, world_size)
        self.chunk = self.padded_numel // world_size

    def rank_range(self, rank):
        """[start, end) of the real (unpadded) flat elements rank `rank` owns."""
        start, end, _ = shard_range(self.numel, rank, self.world_size)
        return start, end

    def chunk_slice(self, rank):
        """Rank `rank`'s chunk in the padded buffer (its tail may be padding)."""
        return slice(rank * self.chunk, (rank + 1) * self.chunk)

    def padding(self, rank):
        start, end = self.rank_range(rank)
        return self.chunk - (end - start)

    def flatten(self, tensors):
        """A new padded flat buffer holding `tensors` (shaped like the params) end to end;
        a None (a parameter without gradient) leaves zeros."""
        like = self.params[0]
        flat = torch.zeros(self.padded_numel, dtype=like.dtype, device=like.device)
        for view, t in zip(self.views(flat), tensors):
            if t is not None:
                view.copy_(t)
        return flat

    def views(self, flat):
        """Views of `flat` shaped like each parameter (no copy)."""
        return [flat[o:o + n].view_as(p) for p, o, n in zip(self.params, self.offsets, self.numels)]

    def segments(self, rank):
        """(param index, flat start, flat end) for every parameter piece inside rank's chunk."""
        start, end = self.rank_range(rank)
        out = []
        for i, (o, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(o, start), min(o + n, end)
            if lo < hi:
                out.append((i, lo, hi))
        return out


def per_tensor_owners(numels, world_size):
    """Owner-rank partitioning (what torch's ZeroRedundancyOptimizer does): whole tensors, each
    given to the rank holding the fewest elements so far, largest tensors first.
    Returns, per rank, the indices (into numels) of the tensors it owns."""
    owners, load = [[] for _ in range(world_size)], [0] * world_size
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        rank = load.index(min(load))
        owners[rank].append(i)
        load[rank] += numels[i]
    return owners


def per_tensor_partition(numels, world_size):
    """Elements per rank under per_tensor_owners; max / mean is its load imbalance."""
    return [sum(numels[i] for i in owned) for owned in per_tensor_owners(numels, world_size)]


class ZeRO1(Strategy):
    """ZeRO stage 1: optimizer state sharded, gradients and parameters whole on every rank.

        zero = ZeRO1(model, lr=1e-2)          # flattens the params; every rank must pass the same model
        zero.zero_grad(); loss.backward(); zero.step()

    It is also a labkit.strategies interface (from_preset, after_backward, full_state_dict ...):
    backward accumulates locally, so no_sync() and after_backward() have nothing to do.
    reduce_op: "avg" (the lab's, for equal shards and a per-rank mean loss) or "sum" (the loop's).
    optimizer_factory(params) replaces make_optimizer(params, lr, **adamw_overrides).

    Gradients accumulate into one flat buffer (each .grad is a view of it), so the reduce-scatter
    needs no copy; its output is this rank's chunk of that same buffer (the ring reads a rank's
    own chunk only at its last step, when it writes the result there).
    `step_fn(zero)` replaces step()'s body (the notebook's exercise plugs in there).
    """

    def __init__(self, model, lr=1e-2, *, group=None, verify=False, step_fn=None, reduce_op="avg",
                 optimizer_factory=None, **adamw_overrides):
        if reduce_op not in ("sum", "avg"):
            raise ValueError(f"reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
        is_module = isinstance(model, nn.Module)
        params = model.parameters() if is_module else model
        self.model, self.reduce_op = (model if is_module else None), reduce_op
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.partition = FlatPartition(params, self.world_size)
        self.verify, self.step_fn = verify, step_fn
        with torch.no_grad():
            self.flat_param = self.partition.flatten([p.detach() for p in self.partition.params])
            for p, view in zip(self.partition.params, self.partition.views(self.flat_param)):
                p.data = view   # the all-gather now updates the model in place
        self.param_shard = self.flat_param[self.partition.chunk_slice(self.rank)]
        base = self.rank * self.partition.chunk
        # One leaf tensor per parameter piece, sharing memory with flat_param (detach() aliases).
        self.segments = [(i, lo - base, hi - base, self.flat_param[lo:hi].detach().requires_grad_())
                         for i, lo, hi in self.partition.segments(self.rank)]
        pieces = [seg for *_, seg in self.segments]
        self.optimizer = (optimizer_factory(pieces) if optimizer_factory is not None
                          else make_optimizer(pieces, lr=lr, **adamw_overrides))
        self.got_grad = set()   # indices of params whose gradient backward produced this step
        self.hooks = [p.register_post_accumulate_grad_hook(lambda _, i=i: self.got_grad.add(i))
                      for i, p in enumerate(self.partition.params)]
        self.flat_grad = self.grad_shard = None
        self.zero_grad()

    # ------------------------------------------------------------------ gradients
    def _attach_flat_grad(self):
        self.flat_grad = torch.zeros_like(self.flat_param)
        for p, view in zip(self.partition.params, self.partition.views(self.flat_grad)):
            p.grad = view   # autograd accumulates into an existing .grad in place

    def check_grads_are_views(self):
        """A .grad replaced behind our back (model.zero_grad() sets it to None, and backward then
        makes a fresh tensor) would be silently missing from the reduce-scatter."""
        for p, view in zip(self.partition.params, self.partition.views(self.flat_grad)):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                raise RuntimeError("a parameter's .grad is no longer a view of zero.flat_grad: "
                                   "call zero.zero_grad(), not model.zero_grad()")

    def zero_grad(self):
        """Zero the flat gradient (never set_to_none: the .grad views must stay views)."""
        if self.flat_grad is None:
            self._attach_flat_grad()
        else:
            self.flat_grad.zero_()
        self.got_grad.clear()

    # ------------------------------------------------------------------ the three phases
    def reduce_scatter_grads(self):
        """grad_shard <- this rank's chunk of the AVERAGE of every rank's flat gradient."""
        self.check_grads_are_views()
        self.grad_shard = self.flat_grad[self.partition.chunk_slice(self.rank)]
        ring_reduce_scatter(self.grad_shard, self.flat_grad, op=self.reduce_op, group=self.group,
                            verify=self.verify)

    def local_step(self):
        """AdamW on this rank's segments only; a parameter without a gradient is skipped."""
        for i, lo, hi, seg in self.segments:
            seg.grad = self.grad_shard[lo:hi] if i in self.got_grad else None
        with span("optimizer step"):
            self.optimizer.step()

    def all_gather_params(self):
        """Every rank's updated chunk into flat_param, which the model's parameters view."""
        ring_all_gather(self.flat_param, self.param_shard, group=self.group, verify=self.verify)

    def step(self):
        if self.step_fn is not None:
            return self.step_fn(self)
        self.reduce_scatter_grads()
        self.local_step()
        self.all_gather_params()

    def remove_hooks(self):
        for hook in self.hooks:
            hook.remove()

    # ------------------------------------------------------------------ labkit.strategies interface
    @classmethod
    def from_preset(cls, model, cfg, **options):
        options.setdefault("reduce_op", "sum")   # the loop's convention; "avg": it scales the loss
        return cls(model, optimizer_factory=cfg.make_optimizer, **options)

    def full_grad_dict(self):
        """After step(): every rank's reduced gradient chunk gathered (a collective), by name."""
        full = torch.empty(self.partition.padded_numel, dtype=self.flat_param.dtype,
                           device=self.flat_param.device)
        ring_all_gather(full, self.grad_shard, group=self.group, verify=self.verify)
        names = {id(p): n for n, p in self.model.named_parameters()} if self.model else {}
        return {names.get(id(p), str(i)): view.clone()
                for i, (p, view) in enumerate(zip(self.partition.params, self.partition.views(full)))
                if i in self.got_grad}


class ZeRO2(ZeRO1):
    """ZeRO stage 2: ZeRO1 plus sharded gradients. After the reduce-scatter the full flat gradient
    is dropped and only this rank's chunk (4P/N bytes in fp32) lives until the next zero_grad.

    Leaves out: reducing during backward, so the full gradient still exists at the end of
    backward (the backward peak is ZeRO1's; the steady state between steps is not)."""

    def zero_grad(self):
        self.grad_shard = None
        for seg in (s for *_, s in self.segments):
            seg.grad = None
        if self.flat_grad is None:
            self._attach_flat_grad()   # a fresh full buffer only for the coming backward
        else:
            self.flat_grad.zero_()
        self.got_grad.clear()

    def reduce_scatter_grads(self):
        # The result goes to its own buffer: the flat buffer is freed right after.
        self.check_grads_are_views()
        self.grad_shard = torch.empty(self.partition.chunk, dtype=self.flat_param.dtype,
                                      device=self.flat_param.device)
        ring_reduce_scatter(self.grad_shard, self.flat_grad, op=self.reduce_op, group=self.group,
                            verify=self.verify)
        for p in self.partition.params:
            p.grad = None
        self.flat_grad = None
