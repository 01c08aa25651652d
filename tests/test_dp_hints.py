"""dp_lab's exercise checks on mistakes written as edits of the notebook's own solution text
(issue 30): which check fails and with which hint."""

import contextlib
import os
import re

import pytest
import torch
import torch.distributed as dist

import labkit
from conftest import ROOT
from labkit import loop
from labkit.data import micro_batches
from labkit.labs import ddp_lab
from labkit.strategies import ddp

CFG = loop.PRESETS["dp"].replace(batch_size=8)  # dp_lab's


def _solution(grade_id, changes=()):
    source = open(os.path.join(ROOT, "notebooks", "src", "dp_lab.py")).read()
    ns = dict(
        __name__="dp_lab_solution",
        torch=torch,
        dist=dist,
        ddp=ddp,
        contextlib=contextlib,
        micro_batches=micro_batches,
    )
    for cell in re.split(r"^# %%", source, flags=re.M):
        header, body = cell.split("\n", 1) if "\n" in cell else (cell, "")
        if f'"grade_id": "{grade_id}"' in header and '"solution": true' in header:
            for old, new in changes:
                assert body.count(old) == 1, old
                body = body.replace(old, new)
            exec(compile(body, "dp_lab.py", "exec"), ns)
    return ns


def check_strategy(cls):  # the notebook's check_strategy, first half (it raises before the compare)
    return labkit.run(loop.train, ddp_lab.LabDDP, CFG, 5, ddp=cls, world_size=2)


def test_bucketed_solution_runs():
    results = check_strategy(_solution("bucketed-ddp")["MyDDPBucketed"])
    ddp_lab.check_ddp(loop.reference(CFG, 5)["grads"], results, "grads")


def test_bucketed_ready_never_cleared_says_state_carried_over():
    cls = _solution(
        "bucketed-ddp",
        [
            (
                "offset += p.numel()\n        self.ready, self.works = [set() for _ in self.buckets], []",
                "offset += p.numel()\n        self.works = []",
            )
        ],
    )["MyDDPBucketed"]
    with pytest.raises(labkit.RankError) as err:
        check_strategy(cls)
    text = str(err.value)
    assert "step 1's backward raised AttributeError" in text
    assert "state carried over from the previous step: self.ready" in text


def test_accumulation_zero_grad_inside_the_loop_says_gradients_wiped(capsys):
    step = _solution("accumulation")["my_accumulated_step"]
    ddp_lab.accumulation_check(step)  # the solution passes
    assert "step-0 gradients: ok on all 2 ranks" in capsys.readouterr().out
    wiped = _solution(
        "accumulation",
        [
            (
                "            loss = model(",
                "            optimizer.zero_grad(set_to_none=True)\n            loss = model(",
            )
        ],
    )["my_accumulated_step"]
    with pytest.raises(AssertionError) as err:
        ddp_lab.accumulation_check(wiped)
    text = str(err.value)
    assert "step-0 gradients" in text.splitlines()[0]  # the gradient check fails first
    assert "exactly what the LAST micro-batch alone gives (checked)" in text
    assert "earlier micro-batches' gradients were wiped: zero_grad() inside the micro-batch loop" in text


def test_accumulation_other_mistake_keeps_the_generic_hint():
    """A mean of means (each micro-batch's loss divided by its own tokens) is not the wiped case."""
    means = _solution("accumulation", [("/ global_tokens", "/ yi.numel()")])["my_accumulated_step"]
    with pytest.raises(AssertionError) as err:
        ddp_lab.accumulation_check(means)
    assert "were wiped" not in str(err.value)


# ---------------------------------------------------------------- fsdp_lab exercise 1 (issue 30)


def _fsdp_solution(changes=()):
    from labkit.comm.collectives import ring_all_gather

    source = open(os.path.join(ROOT, "notebooks", "src", "fsdp_lab.py")).read()
    ns = dict(__name__="fsdp_lab_solution", torch=torch, dist=dist, ring_all_gather=ring_all_gather)
    for cell in re.split(r"^# %%", source, flags=re.M):
        header, body = cell.split("\n", 1) if "\n" in cell else (cell, "")
        if '"grade_id": "shard-param"' in header and '"solution": true' in header:
            for old, new in changes:
                assert body.count(old) == 1, old
                body = body.replace(old, new)
            exec(compile(body, "fsdp_lab.py", "exec"), ns)
    return ns["shard_dim0"], ns["gather_dim0"]


def test_shard_dim0_floor_says_ceil():
    from labkit.labs import fsdp_checks

    fsdp_checks.check_shard(*_fsdp_solution())
    floor = _fsdp_solution([("rows = -(-full.shape[0] // world_size)", "rows = full.shape[0] // world_size")])
    with pytest.raises(AssertionError) as err:
        fsdp_checks.check_shard(*floor)
    text = str(err.value)
    assert text.startswith("shard_dim0 on 3 ranks, tensor of shape") and "raised RuntimeError" in text
    assert "R = rows // N (floor)" in text and "R = ceil(rows / N)" in text
