"""The zero1_lab's checks (labkit.labs.zero_checks, zero_stage_checks): the notebook's own
solution cells pass, and each typical mistake, written as a small edit of that solution (or a
subclass of it), fails with its hint."""

import os
import re

import pytest
import torch
import torch.distributed as dist

import labkit

from conftest import ROOT
from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter
from labkit.labs.zero_checks import (
    check_flat_partition,
    check_memory_answers,
    check_reduce_scatter_answers,
    check_sharded_optimizer,
)
from labkit.labs.zero_stage_checks import check_zero1, check_zero2
from labkit.strategies import Strategy, zero
from labkit.strategies.zero import ShardedOptimizer, ZeRO1, ZeRO2

EXERCISES = (
    "flat-partition",
    "sharded-optimizer",
    "zero1-step",
    "zero2-hooks",
    "memory-answers",
    "reduce-scatter-answers",
)
# what the notebook's cells between the exercises name them (labkit.exercise.pick, once passed)
PICKED = {
    "flat-partition": ("partition_impl", "MyFlatPartition"),
    "sharded-optimizer": ("sharded_impl", "MyShardedOptimizer"),
}


def _solution(changes=()):
    """The notebook's solution cells, executed in one namespace (sent to the ranks by value).
    changes: (grade_id, old, new) edits of one cell's text, each made exactly once: a learner's
    mistake, with every class built on that cell built on the mistake too."""
    source = open(os.path.join(ROOT, "notebooks", "src", "zero1_lab.py")).read()
    ns = dict(
        __name__="zero1_lab_solution",
        torch=torch,
        dist=dist,
        Strategy=Strategy,
        zero=zero,
        ring_all_gather=ring_all_gather,
        ring_reduce_scatter=ring_reduce_scatter,
    )
    for cell in re.split(r"^# %%", source, flags=re.M):
        header, body = cell.split("\n", 1) if "\n" in cell else (cell, "")
        grade_id = next((g for g in EXERCISES if f'"grade_id": "{g}"' in header), None)
        if grade_id is None or '"solution": true' not in header:
            continue
        for where, old, new in changes:
            if where == grade_id:
                assert body.count(old) == 1, (grade_id, old)
                body = body.replace(old, new)
        exec(compile(body, "zero1_lab.py", "exec"), ns)
        if grade_id in PICKED:
            name, cls = PICKED[grade_id]
            ns[name] = ns[cls]
    return ns


S = _solution()


def mistake(grade_id, old, new, name):
    return _solution([(grade_id, old, new)])[name]


def fails(check, cls, match, **kwargs):
    with pytest.raises(AssertionError) as info:
        check(cls, **kwargs)
    assert re.search(match, str(info.value), re.S), str(info.value)
    return str(info.value)


# ---------------------------------------------------------------- exercise 1: the flat partition
PARTITION_MISTAKES = {
    "tied tensor": ("unique.setdefault(id(p), p)", "unique[len(unique)] = p"),  # counted twice
    "into the padding": (
        "start = min(rank * self.chunk, self.numel)\n        return start, min(start + self.chunk, self.numel)",
        "return rank * self.chunk, (rank + 1) * self.chunk",
    ),
    "ceil(numel / world_size)": (
        "self.chunk = -(-self.numel // world_size)  # ceil\n"
        "        self.padded_numel = self.chunk * world_size",
        "self.chunk = self.numel // world_size\n        self.padded_numel = self.numel",
    ),
    "is a copy": (".view_as(p) for p, o, n", ".view_as(p).clone() for p, o, n"),
}


def test_partition_solution_passes_and_mistakes_get_their_hints():
    assert check_flat_partition(S["MyFlatPartition"])
    for words, (old, new) in PARTITION_MISTAKES.items():
        with pytest.raises(AssertionError, match="expected") as info:
            check_flat_partition(mistake("flat-partition", old, new, "MyFlatPartition"))
        assert words in str(info.value), (words, str(info.value))


# ---------------------------------------------------------------- exercise 2a: the sharded optimizer
ALL_GATHER = "ring_all_gather(self.flat_param, self.flat_param[self.partition.chunk_slice(self.rank)])"
ATTACH = "piece.grad = None if p.grad is None else p.grad.reshape(-1)[start : start + piece.numel()]"
# an unused parameter gets a zero gradient, not None
ZEROS_FOR_NONE = "piece.grad = (torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)[start : start + piece.numel()]"


class OptimizerStepsPadding(S["MyShardedOptimizer"]):  # padding from torch.empty, handed to the optimizer
    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        numel, chunk = self.partition.numel, self.partition.chunk
        with torch.no_grad():
            self.flat_param[numel:] = 1.0  # what torch.empty may hold
        lo = max(numel, self.rank * chunk)
        if lo < (self.rank + 1) * chunk:
            self.pad = self.flat_param[lo : (self.rank + 1) * chunk].detach().requires_grad_()
            self.pad.grad = torch.zeros_like(self.pad)
            self.optim.param_groups[0]["params"].append(self.pad)


def test_sharded_optimizer_solution_passes_and_mistakes_get_their_hints():
    assert check_sharded_optimizer(S["MyShardedOptimizer"])
    assert check_sharded_optimizer(ShardedOptimizer)  # the reference the lab falls back to
    with pytest.raises(AssertionError, match="forgot the all-gather") as info:
        check_sharded_optimizer(mistake("sharded-optimizer", ALL_GATHER, "pass", "MyShardedOptimizer"))
    assert "[rank " in str(info.value) and "expected" in str(info.value)
    with pytest.raises(AssertionError, match="NO gradient") as info:
        check_sharded_optimizer(mistake("sharded-optimizer", ATTACH, ZEROS_FOR_NONE, "MyShardedOptimizer"))
    assert "first mismatch: rank" in str(info.value) and "'extra." in str(info.value)
    with pytest.raises(AssertionError, match=r"\(padding\): expected 0, got") as info:
        check_sharded_optimizer(OptimizerStepsPadding, world_size=3)
    assert "weight decay" in str(info.value)


# ---------------------------------------------------------------- exercise 2b: the ZeRO-1 step
REDUCE = "self.flat_grad, op=self.reduce_op"
DECLARED = 'reduce_op = "sum"  # the loop\'s convention'


def test_zero1_solution_passes_and_mistakes_get_their_hints():
    assert check_zero1(S["MyZeRO1"])
    assert check_zero1(ZeRO1)  # the reference the lab falls back to
    # AVG while the loop's convention is SUM: the lab's hint, not compare's "divided twice?"
    text = fails(
        check_zero1, mistake("zero1-step", REDUCE, 'self.flat_grad, op="avg"', "MyZeRO1"), match="too small"
    )
    assert "first mismatch: rank" in text and "SUM" in text
    assert "divided twice" not in text and text.count("hint:") == 1
    # declares "avg" (the loop multiplies the loss by N) and sums
    declared_avg = _solution(
        [("zero1-step", REDUCE, 'self.flat_grad, op="sum"'), ("zero1-step", DECLARED, 'reduce_op = "avg"')]
    )["MyZeRO1"]
    assert "declared 'avg'" in fails(check_zero1, declared_avg, match="too large")
    # zeros, not None, for a parameter unused this step
    fails(
        check_zero1,
        mistake("zero1-step", "                p.grad = None\n", "                pass\n", "MyZeRO1"),
        match="grad = None|gradient is present",
    )


# ---------------------------------------------------------------- exercise 3: ZeRO-2's bucket hooks
IN_ORDER = (
    "while self.launched < len(buckets) and len(self.ready[self.launched]) == len(\n"
    "            buckets[self.launched].params\n"
    "        ):\n"
    "            self.launch(self.launched)"
)
WHEN_COMPLETE = (
    "b = self.bucket_of[id(p)]\n        if len(self.ready[b]) == len(buckets[b].params):\n"
    "            self.launch(b)"
)  # each bucket as soon as it is complete, out of order
FREE = "        for p in bucket.params:\n            p.grad = None\n"
WAIT_ALL = "        while self.in_flight:\n            self.in_flight.pop(0)[0].wait()\n"


class ZeRO2ReversedOrder(S["MyZeRO2"]):  # every bucket launched after backward, last first
    def grad_ready(self, p):
        self.got_grad.add(self.index[id(p)])

    def after_backward(self):
        for b in reversed(range(len(self.layout.buckets))):
            self.launch(b)
        while self.in_flight:
            self.in_flight.pop(0)[0].wait()


class ZeRO2AfterBackward(S["MyZeRO2"]):  # right order, but nothing overlaps backward
    def grad_ready(self, p):
        self.got_grad.add(self.index[id(p)])


def test_zero2_solution_passes_and_mistakes_get_their_hints():
    assert check_zero2(S["MyZeRO2"])
    assert check_zero2(ZeRO2)
    fails(
        check_zero2,
        mistake("zero2-hooks", FREE, "", "MyZeRO2"),  # never frees the bucket's grads
        match="alive at the end of backward.*free each bucket's p.grad",
    )
    fails(check_zero2, ZeRO2ReversedOrder, match="out of order")
    fails(check_zero2, ZeRO2AfterBackward, match="during backward")


def test_zero2_bucket_launched_when_complete_is_named_not_blamed_on_zero1():
    text = fails(
        check_zero2,
        mistake("zero2-hooks", IN_ORDER, WHEN_COMPLETE, "MyZeRO2"),
        match=r"bucket\(s\) never launched.*launch strictly in order",
    )
    assert "flat_grad[chunk_slice" not in text


def test_zero2_if_for_while_is_named():
    """grad_ready with `if` launches one bucket per call: on the toy (gradients in bucket order)
    that is enough, on LateFirst one arrival completes three buckets and two stay unlaunched."""
    from labkit.labs import zero_stage_checks

    text = fails(
        check_zero2,
        mistake(
            "zero2-hooks", IN_ORDER, IN_ORDER.replace("while self.launched", "if self.launched", 1), "MyZeRO2"
        ),
        match=r"bucket\(s\) \[\d.*\] were complete when backward ended but never launched.*"
        r"`while` bucket self.launched is complete, not `if`",
    )
    assert text.startswith("rank 0, a model whose gradients arrive out of bucket order"), text
    seen = labkit.run(zero_stage_checks.launched_during_backward, S["MyZeRO2"], world_size=2)[0]
    assert seen == {"pending": [], "buckets": 4}  # the solution launches all four in backward


def test_zero2_step_before_the_reduce_scatters_land():
    text = fails(
        check_zero2,
        mistake("zero2-hooks", WAIT_ALL, "", "MyZeRO2"),
        match=r"never waited for\nhint: after_backward must wait for every bucket",
    )
    assert "look at the optimizer step" not in text


# ---------------------------------------------------------------- section 7: answers as numbers
def _check_cells():
    source = open(os.path.join(ROOT, "notebooks", "src", "zero1_lab.py")).read()
    return [c for c in re.split(r"^# %%", source, flags=re.M) if '"grade": true' in c.split("\n", 1)[0]]


def test_number_answers_pass_and_no_check_cell_shows_them():
    assert check_memory_answers(S["my_memory_answers"])
    assert check_reduce_scatter_answers(S["my_reduce_scatter_answers"])
    for cell in _check_cells():  # the answers were printed in the check cell
        assert not re.search(r"\b(33|22\.5|18\.0|11\.0|5\.5)\b", cell), cell


@pytest.mark.parametrize(
    "answer, match",
    [
        (
            lambda: (33, 22.5, 12, 18),
            r"expected a dict with keys 'zero1', 'zero2', 'zero3', 'zero3_peak'; got tuple",
        ),
        (lambda: {"zero1": 33, "zero2": 22.5}, r"missing 'zero3', 'zero3_peak'"),
        (
            lambda: {"zero1": "33 GB", "zero2": 22.5, "zero3": 12, "zero3_peak": 18},
            r"'zero1': expected a number",
        ),
        (
            lambda: {"zero1": 12 + 12 + 72 / 8, "zero2": 12 + 84 / 8, "zero3": 96, "zero3_peak": 18},
            r"zero3: got 96 GB per rank\nhint: ZeRO-3 shards all three",
        ),
    ],
    ids=["tuple", "missing keys", "a string", "wrong value"],
)
def test_memory_answer_format_and_value_mistakes(answer, match):
    fails(check_memory_answers, answer, match)


@pytest.mark.parametrize(
    "answer, match",
    [
        (lambda: [[11, 22], [33, 44]], r"expected a dict with keys 'sum', 'avg'; got list"),
        (
            lambda: {"sum": [11, 22, 33, 44], "avg": [5.5, 11, 16.5, 22]},
            r"'sum': expected a list of 2 lists of 2 numbers",
        ),
        (
            lambda: {"sum": [[11, 22], [33, 44]], "avg": [[11, 22], [33, 44]]},
            r"avg, rank 0: .*AVG is the SUM divided by N",
        ),
    ],
    ids=["a list", "flat lists", "avg = sum"],
)
def test_reduce_scatter_answer_format_and_value_mistakes(answer, match):
    fails(check_reduce_scatter_answers, answer, match)


def test_reduce_scatter_answer_accepts_tensors():
    import torch as t

    assert check_reduce_scatter_answers(
        lambda: {"sum": t.tensor([[11.0, 22.0], [33.0, 44.0]]), "avg": t.tensor([[5.5, 11.0], [16.5, 22.0]])}
    )


def test_sharded_optimizer_stepping_every_ranks_segments_is_caught_by_its_state():
    # issue 30: the numbers are right, only a bare assert in section 6 caught it
    cls = mistake(
        "sharded-optimizer",
        "for i, lo, hi in self.partition.segments(self.rank):",
        "for i, lo, hi in [s for r in range(self.world_size) for s in self.partition.segments(r)]:",
        "MyShardedOptimizer",
    )
    text = fails(check_sharded_optimizer, cls, r"every rank steps every rank's segments")
    assert text.startswith("rank 0, ") and "the values are right, but this rank holds" in text
    assert "100% of one process's" in text
