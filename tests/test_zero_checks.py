"""The zero1_lab's checks (labkit.labs.zero_checks, zero_stage_checks): the lab's solutions pass,
and each typical mistake, written out here, fails with its hint."""
import pytest
import torch
import torch.distributed as dist

from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter
from labkit.labs.zero_checks import check_flat_partition, check_sharded_optimizer
from labkit.labs.zero_stage_checks import check_zero1, check_zero2
from labkit.strategies import Strategy
from labkit.strategies.zero import ShardedOptimizer, ZeRO1, ZeRO2


# ---------------------------------------------------------------- the lab's solutions (as in the notebook)
class LabFlatPartition:
    def __init__(self, params, world_size):
        unique = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)
        self.params, self.world_size = list(unique.values()), world_size
        self.measure()

    def measure(self):
        world_size = self.world_size
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.params))]
        self.numel = sum(self.numels)
        self.chunk = -(-self.numel // world_size)
        self.padded_numel = self.chunk * world_size

    def rank_range(self, rank):
        start = min(rank * self.chunk, self.numel)
        return start, min(start + self.chunk, self.numel)

    def chunk_slice(self, rank):
        return slice(rank * self.chunk, (rank + 1) * self.chunk)

    def views(self, flat):
        return [flat[o:o + n].view_as(p) for p, o, n in zip(self.params, self.offsets, self.numels)]

    def segments(self, rank):
        start, end = self.rank_range(rank)
        out = []
        for i, (o, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(o, start), min(o + n, end)
            if lo < hi:
                out.append((i, lo, hi))
        return out

    def flatten(self, tensors):
        flat = torch.zeros(self.padded_numel, dtype=self.params[0].dtype, device=self.params[0].device)
        for view, t in zip(self.views(flat), tensors):
            if t is not None:
                view.copy_(t)
        return flat


class LabShardedOptimizer:
    def __init__(self, params, optimizer_cls, **kwargs):
        groups = list(params)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.partition = LabFlatPartition([p for g in groups for p in g["params"]], self.world_size)
        with torch.no_grad():
            self.flat_param = self.partition.flatten([p.detach() for p in self.partition.params])
            for p, view in zip(self.partition.params, self.partition.views(self.flat_param)):
                p.data = view
        group_of = {id(p): k for k, g in enumerate(groups) for p in g["params"]}
        inner = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
        self.pieces = []
        for i, lo, hi in self.partition.segments(self.rank):
            p = self.partition.params[i]
            piece = self.flat_param[lo:hi].detach().requires_grad_()
            self.pieces.append((p, lo - self.partition.offsets[i], piece))
            inner[group_of[id(p)]]["params"].append(piece)
        self.optim = optimizer_cls(inner, **kwargs)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    def attach_grads(self):
        for p, start, piece in self.pieces:
            piece.grad = None if p.grad is None else p.grad.reshape(-1)[start:start + piece.numel()]

    def all_gather(self):
        ring_all_gather(self.flat_param, self.flat_param[self.partition.chunk_slice(self.rank)])

    def step(self):
        self.attach_grads()
        self.optim.step()
        self.all_gather()

    def zero_grad(self, set_to_none=True):
        for p in self.partition.params:
            p.grad = None


class LabZeRO1(Strategy):
    reduce_op = "sum"
    sharded = LabShardedOptimizer

    def __init__(self, model, cfg):
        self.model = model
        self.optimizer = self.sharded([p for p in model.parameters() if p.requires_grad],
                                      cfg.optimizer, **cfg.optimizer_kwargs)
        self.partition, self.rank = self.optimizer.partition, self.optimizer.rank
        self.flat_grad = torch.zeros_like(self.optimizer.flat_param)
        self.got_grad = set()
        for p in self.partition.params:
            p.register_post_accumulate_grad_hook(lambda p: self.got_grad.add(id(p)))

    def zero_grad(self):
        self.flat_grad.zero_()
        self.got_grad.clear()
        for p, view in zip(self.partition.params, self.partition.views(self.flat_grad)):
            p.grad = view

    def reduce(self):
        shard = self.flat_grad[self.partition.chunk_slice(self.rank)]
        ring_reduce_scatter(shard, self.flat_grad, op=self.reduce_op)

    def step(self):
        self.reduce()
        for p in self.partition.params:
            if id(p) not in self.got_grad:
                p.grad = None
        self.optimizer.step()


class LabZeRO2(Strategy):
    reduce_op = "sum"

    def __init__(self, model, cfg, bucket_cap_mb=0.25):
        self.model = model
        self.optimizer = ShardedOptimizer([p for p in model.parameters() if p.requires_grad],
                                          cfg.optimizer, bucket_cap_mb=bucket_cap_mb, **cfg.optimizer_kwargs)
        self.layout = self.optimizer.layout
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.layout.buckets) for p in bucket.params}
        self.index = {id(p): i for i, p in enumerate(self.layout.params)}
        self.grad_shard = self.layout.empty(self.layout.shard_numel)
        for p in self.layout.params:
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def zero_grad(self):
        self.observe("tag", "gradients", self.grad_shard)
        for p in self.layout.params:
            p.grad = None
        self.ready = [set() for _ in self.layout.buckets]
        self.launched, self.in_flight, self.got_grad = 0, [], set()

    def grad_ready(self, p):
        self.got_grad.add(self.index[id(p)])
        self.ready[self.bucket_of[id(p)]].add(id(p))
        buckets = self.layout.buckets
        while self.launched < len(buckets) and len(self.ready[self.launched]) == len(buckets[self.launched].params):
            self.launch(self.launched)

    def launch(self, b):
        if len(self.in_flight) == 2:
            self.in_flight.pop(0)[0].wait()
        bucket = self.layout.buckets[b]
        send = bucket.flatten([p.grad for p in bucket.params])
        self.observe("tag", "gradients", send)
        for p in bucket.params:
            p.grad = None
        out = self.grad_shard[self.layout.shard_slice(b)]
        self.in_flight.append((ring_reduce_scatter(out, send, op=self.reduce_op, async_op=True), send))
        self.launched = b + 1

    def after_backward(self):
        while self.launched < len(self.layout.buckets):
            self.launch(self.launched)
        while self.in_flight:
            self.in_flight.pop(0)[0].wait()

    def step(self):
        self.optimizer.attach_grads(self.grad_shard, has_grad=self.got_grad)
        self.optimizer.local_step()
        self.optimizer.all_gather_params()


# ---------------------------------------------------------------- exercise 1: the flat partition
class PartitionNoDedup(LabFlatPartition):      # a tied tensor counted twice
    def __init__(self, params, world_size):
        super().__init__(params, world_size)
        self.params = [p for p in params if p.requires_grad]
        self.measure()


class PartitionIntoPadding(LabFlatPartition):  # the last rank's range runs into the padding
    def rank_range(self, rank):
        return rank * self.chunk, (rank + 1) * self.chunk


class PartitionFloorChunk(LabFlatPartition):   # chunk = numel // N: the padding forgotten
    def __init__(self, params, world_size):
        super().__init__(params, world_size)
        self.chunk = self.numel // world_size
        self.padded_numel = self.numel


class PartitionCopies(LabFlatPartition):       # views that are copies
    def views(self, flat):
        return [v.clone() for v in super().views(flat)]


def test_partition_solution_passes_and_mistakes_get_their_hints():
    assert check_flat_partition(LabFlatPartition)
    for cls, words in ((PartitionNoDedup, "tied tensor"), (PartitionIntoPadding, "into the padding"),
                       (PartitionFloorChunk, "ceil(numel / world_size)"), (PartitionCopies, "is a copy")):
        with pytest.raises(AssertionError, match="expected") as info:
            check_flat_partition(cls)
        assert words in str(info.value), (cls.__name__, str(info.value))


# ---------------------------------------------------------------- exercise 2a: the sharded optimizer
class OptimizerNoAllGather(LabShardedOptimizer):
    def all_gather(self):
        pass


class OptimizerZerosForNone(LabShardedOptimizer):   # an unused parameter gets a zero gradient, not None
    def attach_grads(self):
        for p, start, piece in self.pieces:
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            piece.grad = grad.reshape(-1)[start:start + piece.numel()]


class OptimizerStepsPadding(LabShardedOptimizer):  # padding from torch.empty, handed to the optimizer
    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        numel, chunk = self.partition.numel, self.partition.chunk
        with torch.no_grad():
            self.flat_param[numel:] = 1.0             # what torch.empty may hold
        lo = max(numel, self.rank * chunk)
        if lo < (self.rank + 1) * chunk:
            self.pad = self.flat_param[lo:(self.rank + 1) * chunk].detach().requires_grad_()
            self.pad.grad = torch.zeros_like(self.pad)
            self.optim.param_groups[0]["params"].append(self.pad)


def test_sharded_optimizer_solution_passes_and_mistakes_get_their_hints():
    assert check_sharded_optimizer(LabShardedOptimizer)
    assert check_sharded_optimizer(ShardedOptimizer)       # the reference the lab falls back to
    with pytest.raises(AssertionError, match="forgot the all-gather") as info:
        check_sharded_optimizer(OptimizerNoAllGather)
    assert "[rank " in str(info.value) and "expected" in str(info.value)
    with pytest.raises(AssertionError, match="NO gradient") as info:
        check_sharded_optimizer(OptimizerZerosForNone)
    assert "first mismatch: rank" in str(info.value) and "'extra." in str(info.value)
    with pytest.raises(AssertionError, match=r"\(padding\): expected 0, got") as info:
        check_sharded_optimizer(OptimizerStepsPadding, world_size=3)
    assert "weight decay" in str(info.value)


# ---------------------------------------------------------------- exercise 2b: the ZeRO-1 step
class ZeRO1AvgForSum(LabZeRO1):                # AVG, while the loop's convention is SUM
    def reduce(self):
        ring_reduce_scatter(self.flat_grad[self.partition.chunk_slice(self.rank)], self.flat_grad, op="avg")


class ZeRO1SumDeclaredAvg(LabZeRO1):           # declares "avg" (the loop multiplies the loss by N), sums
    reduce_op = "avg"

    def reduce(self):
        ring_reduce_scatter(self.flat_grad[self.partition.chunk_slice(self.rank)], self.flat_grad, op="sum")


class ZeRO1KeepsUnusedGrads(LabZeRO1):         # zeros, not None, for a parameter unused this step
    def step(self):
        self.reduce()
        self.optimizer.step()


def test_zero1_solution_passes_and_mistakes_get_their_hints():
    assert check_zero1(LabZeRO1)
    assert check_zero1(ZeRO1)            # the reference the lab falls back to
    with pytest.raises(AssertionError, match="too small") as info:
        check_zero1(ZeRO1AvgForSum)
    assert "first mismatch: rank" in str(info.value) and "SUM" in str(info.value)
    with pytest.raises(AssertionError, match="too large") as info:
        check_zero1(ZeRO1SumDeclaredAvg)
    assert "declared 'avg'" in str(info.value)
    with pytest.raises(AssertionError, match="grad = None|gradient is present") as info:
        check_zero1(ZeRO1KeepsUnusedGrads)


# ---------------------------------------------------------------- exercise 3: ZeRO-2's bucket hooks
class ZeRO2KeepsGrads(LabZeRO2):               # never frees the bucket's gradient nor the send buffers
    def launch(self, b):
        bucket = self.layout.buckets[b]
        send = bucket.flatten([p.grad for p in bucket.params])
        self.observe("tag", "gradients", send)
        out = self.grad_shard[self.layout.shard_slice(b)]
        self.in_flight.append((ring_reduce_scatter(out, send, op=self.reduce_op, async_op=True), send))
        self.launched = b + 1
        self.kept = getattr(self, "kept", []) + [send]

    def zero_grad(self):
        super().zero_grad()
        self.kept = []


class ZeRO2ReversedOrder(LabZeRO2):            # every bucket launched after backward, last first
    def grad_ready(self, p):
        self.got_grad.add(self.index[id(p)])

    def after_backward(self):
        for b in reversed(range(len(self.layout.buckets))):
            self.launch(b)
        while self.in_flight:
            self.in_flight.pop(0)[0].wait()


class ZeRO2AfterBackward(LabZeRO2):            # right order, but nothing overlaps backward
    def grad_ready(self, p):
        self.got_grad.add(self.index[id(p)])


def test_zero2_solution_passes_and_mistakes_get_their_hints():
    assert check_zero2(LabZeRO2)
    assert check_zero2(ZeRO2)
    with pytest.raises(AssertionError, match="alive at the end of backward") as info:
        check_zero2(ZeRO2KeepsGrads)
    assert "free each bucket's p.grad" in str(info.value)
    with pytest.raises(AssertionError, match="out of order"):
        check_zero2(ZeRO2ReversedOrder)
    with pytest.raises(AssertionError, match="during backward"):
        check_zero2(ZeRO2AfterBackward)
