"""ShardedOptimizer: any torch optimizer, its state kept for this rank's 1/N of the parameters.

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)     # or param groups:
    opt = ShardedOptimizer([{"params": decay, "weight_decay": 0.1},
                            {"params": no_decay, "weight_decay": 0.0}], torch.optim.SGD,
                           lr=0.1, momentum=0.9)
    loss.backward(); all_reduce the grads (DDP); opt.step(); opt.zero_grad()

A drop-in for torch's ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs), with its
contract: the gradients it reads are already the same on every rank. What differs is the
partition: torch gives whole tensors to ranks (uneven: labkit.strategies.zero.per_tensor_owners);
here the parameters are one flat, padded buffer (labkit.strategies.zero.FlatLayout) split into N
equal chunks, and every parameter becomes a view of that buffer, so the all-gather of the updated
chunks writes straight into the model.

Exactness: the wrapped optimizer itself runs, over one segment per parameter piece inside this
rank's chunk (views of the flat buffer). SGD, Adam, AdamW are elementwise, so this is single-process
arithmetic on those elements; per-parameter segments (not one flat shard) keep the per-parameter
step counter and the "grad is None -> skip the parameter, no weight decay" rule. Padding is never
an optimizer element, so weight decay cannot touch it.

What it leaves out: optimizers that are not elementwise (LAMB/LARS's per-tensor norms, Shampoo:
their segment would see a piece of a tensor), adding param groups after construction,
state_dict resharding (a state dict loads on the same rank of the same world size), torch's
overlap_with_ddp and parameters_as_bucket_view options.
"""
import torch
import torch.distributed as dist

from labkit.comm.collectives import ring_all_gather
from labkit.observe.tracing import span


def group_info(group):
    """(rank, world_size) in `group`; outside torch.distributed, a world of one."""
    if group is None and not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class ShardedOptimizer(torch.optim.Optimizer):
    """optimizer_cls over this rank's chunk of the flat parameters, then an all-gather.

    param_groups are the full parameters with their options (edit lr there, as with any torch
    optimizer: they are copied into the local optimizer before each step); `optim` is the local
    optimizer over this rank's segments and `state` its state (only this rank's elements);
    `layout` the FlatLayout, `flat_param` the flat buffer the parameters view.
    bucket_cap_mb, last_bucket_mb: the layout's buckets (ZeRO2's); None, one bucket (shard_range's
    convention).
    gather_cap_mb: with several buckets, the most one coalesced all-gather moves (None: all)."""

    def __init__(self, params, optimizer_cls=None, *, optimizer_class=None, process_group=None,
                 bucket_cap_mb=None, last_bucket_mb=None, gather_cap_mb=None, verify=False,
                 **defaults):
        from labkit.strategies.zero import FlatLayout
        cls = optimizer_cls or optimizer_class
        if cls is None:
            raise TypeError("ShardedOptimizer needs optimizer_cls (e.g. torch.optim.AdamW)")
        super().__init__(params, defaults)   # torch's checks: groups, duplicates, defaults
        self.optimizer_cls, self.group, self.verify = cls, process_group, verify
        self.observe = _unobserved   # a strategy sets its observe hook here (memory tags)
        self.rank, self.world_size = group_info(process_group)
        self.layout = FlatLayout([p for g in self.param_groups for p in g["params"]],
                                 self.world_size, bucket_cap_mb, last_bucket_mb)
        itemsize = torch.empty((), dtype=self.layout.dtype).element_size()
        self.gather_cap_numel = None if gather_cap_mb is None else int(gather_cap_mb * 2**20) // itemsize
        with torch.no_grad():
            self.flat_param = self.layout.flatten([p.detach() for p in self.layout.params])
            for p, view in zip(self.layout.params, self.layout.views(self.flat_param)):
                p.data = view   # the all-gather now updates the model in place
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        # One leaf per parameter piece, sharing memory with flat_param (detach() aliases).
        self.segments = [(i, lo, hi, shard_lo, self.flat_param[lo:hi].detach().requires_grad_())
                         for i, lo, hi, shard_lo in self.layout.segments(self.rank)]
        local = [{**_options(group), "params": []} for group in self.param_groups]
        for i, *_, seg in self.segments:
            local[group_of[id(self.layout.params[i])]]["params"].append(seg)
        self.optim = cls(local)   # a group may be empty on this rank: torch allows it
        self.state = self.optim.state

    # ------------------------------------------------------------------ the three phases
    def attach_grads(self, grad_shard=None, has_grad=None):
        """Give every segment its gradient: a view of p.grad (None -> the parameter is skipped),
        or, with grad_shard (this rank's shard of the reduced flat gradient, layout.shard_numel
        elements), a view of it for the parameters in has_grad (indices into layout.params)."""
        for i, lo, hi, shard_lo, seg in self.segments:
            if grad_shard is not None:
                use = has_grad is None or i in has_grad
                seg.grad = grad_shard[shard_lo:shard_lo + hi - lo] if use else None
                continue
            grad = self.layout.params[i].grad
            start = lo - self.layout.offsets[i]
            seg.grad = None if grad is None else grad.reshape(-1)[start:start + hi - lo]

    def local_step(self):
        """The wrapped optimizer on this rank's segments, with param_groups' current options."""
        for mine, group in zip(self.optim.param_groups, self.param_groups):
            mine.update(_options(group))
        with span("optimizer step"):
            self.optim.step()

    def all_gather_params(self):
        """Every rank's updated chunks into flat_param, which the model's parameters view.

        One bucket: one all-gather straight into flat_param (a rank's chunk is contiguous there).
        Several: each run of at most gather_cap_mb (layout.gather_groups) is one all-gather; a
        run of one bucket is gathered in place, in a longer one a rank's chunks are not
        contiguous, so the run is coalesced: copy this rank's chunks into one send
        buffer, all-gather into a receive buffer laid out rank by rank, copy every rank's chunk
        into place. One collective per run instead of one per bucket (each costs a ring's
        latency), for a receive buffer of at most gather_cap_mb (tagged "all_gather")."""
        layout, flat = self.layout, self.flat_param
        for run in layout.gather_groups(self.gather_cap_numel):
            if len(run) == 1:   # one bucket: its chunks are contiguous, gather in place
                b = run[0]
                ring_all_gather(flat[layout.bucket_slice(b)], flat[layout.rank_slice(b, self.rank)],
                                group=self.group, verify=self.verify)
                continue
            chunks = [layout.buckets[b].chunk for b in run]
            send = layout.empty(sum(chunks), zero=False)
            for piece, b in zip(send.split(chunks), run):
                piece.copy_(flat[layout.rank_slice(b, self.rank)])
            recv = layout.empty(self.world_size * send.numel(), zero=False)
            self.observe("tag", "all_gather", recv)
            ring_all_gather(recv, send, group=self.group, verify=self.verify)
            grid = recv.view(self.world_size, -1)
            for piece, b in zip(grid.split(chunks, dim=1), run):
                flat[layout.bucket_slice(b)].view(self.world_size, -1).copy_(piece)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.attach_grads()
        self.local_step()
        self.all_gather_params()
        return loss

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self):
        """This rank's shard: the local optimizer's state dict and the layout it belongs to."""
        return {"optim": self.optim.state_dict(), "layout": self._layout_key()}

    def load_state_dict(self, state_dict):
        if state_dict["layout"] != self._layout_key():
            raise ValueError(f"this state dict is the shard of {state_dict['layout']}, this "
                             f"optimizer is {self._layout_key()}: resharding is left out")
        self.optim.load_state_dict(state_dict["optim"])
        self.state = self.optim.state
        for mine, group in zip(self.optim.param_groups, self.param_groups):
            group.update(_options(mine))

    def _layout_key(self):
        layout = self.layout
        return {"rank": self.rank, "world_size": self.world_size, "numel": layout.numel,
                "buckets": [b.numel for b in layout.buckets]}


def _unobserved(event, label, tensor=None):
    """The observe hook when no strategy set one (labkit.strategies' interface): nothing."""


def _options(group):
    return {k: v for k, v in group.items() if k != "params"}
