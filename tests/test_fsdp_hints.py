"""Issue 36, fsdp_lab: each learner mistake fails ITS OWN exercise's check first, with a hint that
names it (and no misleading second hint from the generic comparison): a shard of rows // N + 1
rows, a unit gathered one parameter at a time or with torch's own collective, an all-gather that
is never waited for, its output trimmed as if it held whole parameters, a reduce-scatter that
averages, no reshard after the reduce, prefetching from the start of `order`, the seed
exercise's wrong answers (named without printing the right one), and a wrong group= in the
learner's all-gather or reduce-scatter (a subgroup, a DeviceMesh, a string); and the mistakes
that passed or were named late: a blocking all-gather (no handle), a buffer sized for 2 ranks,
an unsharded .grad kept after the reduce, post_accumulate's count (wrong total, never reset)."""

import re

import pytest
import torch
import torch.distributed as dist

from labkit.comm.collectives import ring_all_gather
from labkit.labs import fsdp_checks as fc
from labkit.labs import fsdp_checks_hooks as fh
from labkit.labs import fsdp_checks_loop as fl
from test_fsdp_checks import S, _reduce_variant, _solution, fails


# ---------------------------------------------------------------- 1. shard
def shard_floor_plus_one(full, rank, n):
    rows = full.shape[0] // n + 1  # = ceil only when n does not divide the rows
    padded = full.new_zeros((rows * n, *full.shape[1:]))
    padded[: full.shape[0]] = full
    return padded[rank * rows : (rank + 1) * rows].clone()


def test_floor_plus_one_is_told_from_ceil():
    message = fails(fc.check_shard, shard_floor_plus_one, S["gather_dim0"], match=r"rows // N \+ 1 = 3 rows")
    assert "(6, 2)" in message.splitlines()[0]


# ---------------------------------------------------------------- 2. one unit
class PerParameterGathers(S["MyUnit"]):
    def start_unshard(self):
        pass

    def unshard(self):
        if self.unsharded[0].untyped_storage().nbytes() == 0:
            for shard, full in zip(self.shards, self.unsharded):
                out = shard.new_empty((shard.shape[0] * self.n, *shard.shape[1:]))
                ring_all_gather(out, shard.detach().contiguous())
                full.untyped_storage().resize_(full.numel() * full.element_size())
                full.data.copy_(out[: full.shape[0]])
        self.use(self.unsharded)


class TorchGather(S["MyUnit"]):
    def start_unshard(self):
        if self.handle is not None or self.unsharded[0].untyped_storage().nbytes() > 0:
            return
        self.send = torch.cat([s.detach().reshape(-1) for s in self.shards])
        self.recv = self.send.new_empty(self.n * self.send.numel())
        self.handle = dist.all_gather_into_tensor(self.recv, self.send, async_op=True)


class TrimsTheFlatNumel(S["MyUnit"]):
    """Reads the gathered buffer as the parameters laid out whole, one after another."""

    def unshard(self):
        self.start_unshard()
        if self.handle is not None:
            self.handle.wait()
            flat, offset = self.recv[: sum(f.numel() for f in self.unsharded)], 0
            for full in self.unsharded:
                full.untyped_storage().resize_(full.numel() * full.element_size())
                full.data.copy_(flat[offset : offset + full.numel()].view_as(full))
                offset += full.numel()
            self.handle = self.send = self.recv = None
        self.use(self.unsharded)


NOT_AWAITED = _solution([("unit", "            self.handle.wait()\n", "")])["MyUnit"]


@pytest.mark.parametrize(
    "cls, first, hint",
    [
        (
            PerParameterGathers,
            r"ran 4 all-gathers for one unit of 4 parameters, expected 1",
            r"one all-gather per unit",
        ),
        (
            TorchGather,
            r"torch.distributed's \['all_gather",
            r"bypass the course's traced ring",
        ),
        (NOT_AWAITED, r"without waiting for the all-gather", r"self.handle.wait\(\) before reading"),
        (TrimsTheFlatNumel, r"wrong full parameters after unshard", r"row r of the all-gather output"),
    ],
    ids=["per-parameter gathers", "torch's all-gather", "handle not awaited", "flat numel trimmed"],
)
def test_unit_mistakes_are_named(cls, first, hint):
    message = fails(fc.check_unit, cls, match=hint)
    assert re.search(first, message.splitlines()[0]), message
    assert "missing all-gather" not in message and message.count("hint:") == 1, message


# ---------------------------------------------------------------- 4. backward
NO_RESHARD_AFTER_REDUCE = _solution(
    [("backward", "        self.ready = 0\n        self.reshard()\n", "        self.ready = 0\n")]
)["TrainingUnit"]


def test_reduce_scatter_with_avg_has_one_hint():
    message = fails(fh.check_backward, _reduce_variant("avg"), match=r"AVG where the loop SUMs")
    assert "divided twice" not in message and message.count("hint:") == 1, message


def test_no_reshard_after_the_reduce_is_named():
    fails(
        fh.check_backward,
        NO_RESHARD_AFTER_REDUCE,
        match=r"still gathered after its reduce_grads.*reshard right after the reduce-scatter",
    )


# ---------------------------------------------------------------- 6. prefetch
class PrefetchFromTheStart(S["PrefetchingFSDP"]):
    def prefetch_after(self, unit, order):
        for later in order[: self.prefetch]:
            if sum(u.handle is not None for u in self.units) < self.max_inflight:
                later.start_unshard()


def test_prefetch_from_the_start_of_order_is_named():
    message = fails(fl.check_prefetch, PrefetchFromTheStart, match=r"prefetch the units AFTER this one")
    assert "gathered a second time" not in message, message


# ---------------------------------------------------------------- the seed exercise
@pytest.mark.parametrize(
    "answer, hint",
    [
        ({"steady": 96, "peak_lower_bound": 102}, "not divided by N"),
        ({"steady": 12, "peak_lower_bound": 15}, "one term left out"),
        ({"steady": 12, "peak_lower_bound": 6}, "the steady state left out"),
        ({"steady": 1.5 + 84, "peak_lower_bound": 91.5}, "some states left whole"),
    ],
    ids=["not sharded", "prefetch left out", "steady left out", "only weights sharded"],
)
def test_seed_mistakes_are_named_without_the_answer(answer, hint):
    message = fails(fl.check_seed, lambda: answer, match=hint)
    assert "18" not in message and "expected" not in message, message  # the answer is 12 and 18 GB
    if answer["steady"] != 12:
        assert "12" not in message.replace(f"{answer['steady']:g}", ""), message


# ---------------------------------------------------------------- a wrong group= (exercises 1, 2, 4)
# Each fails before any message is sent (one short launch each), with the ring's or torch's words
# ("pad the input", "Group ... is not registered"): the check names the group instead.
MESH = (
    "__import__('torch.distributed.device_mesh').distributed.device_mesh.init_device_mesh('cpu', (self.n,))"
)
GATHER, UNIT_GATHER = "ring_all_gather(out, shard)", "ring_all_gather(self.recv, self.send, async_op=True)"
REDUCE = 'ring_reduce_scatter(out, send.view(-1), op="sum")'


@pytest.mark.parametrize(
    "check, grade_id, old, group, first, hint",
    [
        (
            fc.check_shard,
            "shard-param",
            GATHER,
            "dist.new_group([0, 1])",
            r"gather_dim0 on 3 ranks: rank 0 raised ValueError: ring_all_gather: .* = 2 × 9",
            r"subgroup of 2 ranks, not the world's 3 ranks.*leave group= out",
        ),
        (fc.check_shard, "shard-param", GATHER, "'world'", r"Group world is not registered", r"not a name"),
        (fc.check_unit, "unit", UNIT_GATHER, MESH, r"MyUnit's unshard .*DeviceMesh", r"not a DeviceMesh"),
        (
            fh.check_backward,
            "backward",
            REDUCE,
            "dist.new_group([0])",
            r"TrainingUnit's backward on 2 ranks: .*ring_reduce_scatter: .* = 1 × ",
            r"subgroup of 1 rank, not the world's 2 ranks",
        ),
        (
            fh.check_backward,
            "backward",
            REDUCE,
            MESH,
            r"TrainingUnit's backward .*DeviceMesh",
            r"not a DeviceMesh",
        ),
    ],
    ids=[
        "gather, subgroup",
        "gather, string",
        "unit, DeviceMesh",
        "reduce-scatter, subgroup",
        "reduce-scatter, DeviceMesh",
    ],
)
def test_wrong_group_is_named(check, grade_id, old, group, first, hint):
    ns = _solution([(grade_id, old, f"{old[:-1]}, group={group})")])
    learner = {
        "shard-param": ("shard_dim0", "gather_dim0"),
        "unit": ("MyUnit",),
        "backward": ("TrainingUnit",),
    }
    message = fails(check, *(ns[k] for k in learner[grade_id]), match=hint)
    assert re.search(first, message.splitlines()[0]), message
    assert "pad" not in message and message.count("hint:") == 1, message  # not the ring's size advice


# ---------------------------------------------------------------- caught late, silently, or vaguely
# Before: a blocking all-gather crashed the check's ranks (SIGSEGV: the module read freed storage);
# the buffer sized for 2 ranks was a raw RankError; the kept .grad had no hint; the two counting
# mistakes passed (right values, every unit gathered until the end of the backward).
@pytest.mark.parametrize(
    "check, grade_id, old, new, first, hint",
    [
        (
            fc.check_unit,
            "unit",
            UNIT_GATHER,
            "ring_all_gather(self.recv, self.send)",
            r"start_unshard all-gathered but left self.handle None",
            r"without async_op=True .* returns None",
        ),
        (
            fc.check_shard,
            "shard-param",
            "shard.shape[0] * dist.get_world_size()",
            "shard.shape[0] * 2",
            r"gather_dim0 on 3 ranks: .*output has 18 elements",
            r"N x its input \(N = dist.get_world_size\(\) = 3 here\); yours is 2 x",
        ),
        (
            fh.check_backward,
            "backward",
            "            full.grad = None\n",
            "",
            r"rank 0, step 1: wrong gradient shard",
            r"kept its .grad after the reduce-scatter.*full.grad = None",
        ),
        (
            fh.check_backward,
            "backward",
            "if self.ready == len(self.trainable):",
            "if self.ready == len(self.unsharded):",
            r"reduce_grads calls came from the end-of-backward callback",
            r"counts to the wrong total.*len\(self.trainable\)",
        ),
        (
            fh.check_backward,
            "backward",
            "        self.ready = 0\n        self.reshard()\n",
            "        self.reshard()\n",
            r"reduce_grads calls came from the end-of-backward callback",
            r"self.ready is never reset",
        ),
    ],
    ids=[
        "blocking all-gather",
        "gather sized for 2",
        "unsharded grad kept",
        "count: wrong total",
        "count: not reset",
    ],
)
def test_late_or_vague_mistakes_are_named(check, grade_id, old, new, first, hint):
    ns = _solution([(grade_id, old, new)])
    learner = {
        "shard-param": ("shard_dim0", "gather_dim0"),
        "unit": ("MyUnit",),
        "backward": ("TrainingUnit",),
    }
    message = fails(check, *(ns[k] for k in learner[grade_id]), match=hint)
    assert re.search(first, message.splitlines()[0]), message
    assert message.count("hint:") == 1, message


# ---------------------------------------------------------------- issue 44: the last two
def gather_trimmed_flat(shard, dim0):
    out = shard.new_empty((shard.shape[0] * dist.get_world_size(), *shard.shape[1:]))
    ring_all_gather(out, shard)
    return out.reshape(-1)[: dim0 * shard[0].numel()]  # trimmed by the flat size: the rows are lost


class PerParameterHandles(S["MyUnit"]):
    """One async all-gather per parameter, their handles kept in a list."""

    def start_unshard(self):
        if self.handle is not None or self.unsharded[0].untyped_storage().nbytes() > 0:
            return
        self.recvs = [s.new_empty((s.shape[0] * self.n, *s.shape[1:])) for s in self.shards]
        self.handle = [
            ring_all_gather(r, s.detach().contiguous(), async_op=True)
            for r, s in zip(self.recvs, self.shards)
        ]

    def unshard(self):
        self.start_unshard()
        if self.handle is not None:
            for h in self.handle:
                h.wait()
            for r, full in zip(self.recvs, self.unsharded):
                full.untyped_storage().resize_(full.numel() * full.element_size())
                full.data.copy_(r[: full.shape[0]])
            self.handle = None
        self.use(self.unsharded)


def test_gather_trimmed_by_its_flat_size_is_named():
    message = fails(
        fc.check_shard, S["shard_dim0"], gather_trimmed_flat, match=r"keep its first dim0 = 7 ROWS"
    )
    assert "gather_dim0" in message.splitlines()[0] and "missing all-gather" not in message, message


def test_one_gather_per_parameter_with_a_list_of_handles_is_named():
    message = fails(
        fc.check_unit, PerParameterHandles, match="one all-gather per unit, not one per parameter"
    )
    assert "self.handle a list of 4" in message.splitlines()[0] and "AttributeError" not in message, message
