"""fsdp_lab's exercise checks (labkit.labs.fsdp_checks, fsdp_checks_hooks, fsdp_checks_loop): the notebook's own
solution passes each one, and each typical mistake, written as a small change to that solution,
fails with the hint meant for it (padding left in, wrong shard index, SUM for AVG, forgetting to
refill the storage, ...)."""

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import ROOT
from labkit import loop, strategies
from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter
from labkit.labs import fsdp_checks as fc
from labkit.labs import fsdp_checks_hooks as fh
from labkit.labs import fsdp_checks_loop as fl
from labkit.labs.fsdp_lab import assign_params
from labkit.strategies.fsdp import plan_units

EXERCISES = (
    "shard-param",
    "unit",
    "forward-hooks",
    "backward",
    "my-fsdp",
    "prefetch",
    "seed-exercise",
    "choose-wrap",
)


def _solution(changes=()):
    """The notebook's solution cells, executed in one namespace (not an importable module, so
    labkit.run's cloudpickle sends the classes by value). changes: (grade_id, old, new) edits of
    one cell's text, each made exactly once: a learner's mistake, with every class built on that
    cell rebuilt on the mistake too."""
    source = open(os.path.join(ROOT, "notebooks", "src", "fsdp_lab.py")).read()
    cells = re.split(r"^# %%", source, flags=re.M)
    ns = dict(
        __name__="fsdp_lab_solution",
        torch=torch,
        dist=dist,
        nn=nn,
        strategies=strategies,
        ring_all_gather=ring_all_gather,
        ring_reduce_scatter=ring_reduce_scatter,
        plan_units=plan_units,
        assign_params=assign_params,
    )
    for cell in cells:
        header, body = cell.split("\n", 1) if "\n" in cell else (cell, "")
        for grade_id, old, new in changes:
            if f'"grade_id": "{grade_id}"' in header:
                assert body.count(old) == 1, (grade_id, old)
                body = body.replace(old, new)
        if any(f'"grade_id": "{g}"' in header for g in EXERCISES) and '"solution": true' in header:
            exec(compile(body, "fsdp_lab.py", "exec"), ns)
    return ns


S = _solution()


def fails(check, *args, match):
    with pytest.raises(AssertionError) as info:
        check(*args)
    assert re.search(match, str(info.value), re.S), str(info.value)
    return str(info.value)


# ---------------------------------------------------------------- 1. shard / gather
def test_shard_solution_passes():
    assert fc.check_shard(S["shard_dim0"], S["gather_dim0"])


def chunk_unpadded(full, rank, n):
    return torch.chunk(full, n)[rank].clone() if rank < len(torch.chunk(full, n)) else full[:0].clone()


def other_rank(full, rank, n):
    return S["shard_dim0"](full, (rank + 1) % n, n)


def garbage_padding(full, rank, n):
    shard = S["shard_dim0"](full, rank, n)
    real = max(0, min(shard.shape[0], full.shape[0] - rank * shard.shape[0]))
    shard[real:] = 7.0
    return shard


def gather_padded(shard, dim0):
    out = shard.new_empty((shard.shape[0] * dist.get_world_size(), *shard.shape[1:]))
    ring_all_gather(out, shard)
    return out


@pytest.mark.parametrize(
    "shard_fn, gather_fn, hint",
    [
        (chunk_unpadded, None, r"padding missing: every rank's shard has R = ceil\(7 / 3\) = 3 rows"),
        (other_rank, None, r"wrong shard index: rank 0 holds rank 1's rows"),
        (garbage_padding, None, r"padding rows are not zeros"),
        (None, gather_padded, r"padding left in: the all-gather gives 9 rows; keep the first 7"),
    ],
    ids=["no padding", "wrong index", "garbage padding", "padding left in"],
)
def test_shard_mistakes(shard_fn, gather_fn, hint):
    message = fails(fc.check_shard, shard_fn or S["shard_dim0"], gather_fn or S["gather_dim0"], match=hint)
    assert "rank" in message and ("expected" in message or "shapes differ" in message)


def test_shard_not_written_is_not_implemented():
    def todo(*args):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        fc.check_shard(todo, todo)


# ---------------------------------------------------------------- 2. one unit
def test_unit_solution_passes():
    assert fc.check_unit(S["MyUnit"])


class NeverFrees(S["MyUnit"]):
    def reshard(self):
        self.use(self.shards)


class NewTensors(S["MyUnit"]):
    """Forgetting to refill the storage: unshard makes fresh unsharded tensors."""

    def unshard(self):
        self.unsharded = [
            nn.Parameter(torch.empty_like(f.data.new_empty(f.shape)), f.requires_grad) for f in self.unsharded
        ]
        for f in self.unsharded:
            f.untyped_storage().resize_(0)
        super().unshard()


class RanksSwapped(S["MyUnit"]):
    def unshard(self):
        super().unshard()
        for f in self.unsharded:
            f.data.copy_(f.data.flip(0))


@pytest.mark.parametrize(
    "cls, hint",
    [
        (NeverFrees, r"after reshard, expected 0 B\nhint: reshard frees the storage"),
        (NewTensors, r"forgetting to refill storage: unshard made NEW tensors"),
        (RanksSwapped, r"rank 0, '0.weight'.*\n.*hint: rank r's rows come from row r"),
    ],
    ids=["never frees", "no refill", "rows swapped"],
)
def test_unit_mistakes(cls, hint):
    fails(fc.check_unit, cls, match=hint)


# The text warns: copy through full.data, or autograd sees the weight it saved change. Under
# no_grad the copy runs, and "one unit" and "forward hooks" passed it; backward then raised
# PyTorch's raw "modified by an inplace operation". Without no_grad the copy itself raises.
@pytest.mark.parametrize(
    "new", ["with torch.no_grad(): full.copy_(", "full.copy_("], ids=["under no_grad", "plain"]
)
def test_unit_copy_into_the_parameter_fails_one_unit(new):
    mine = _solution([("unit", "full.data.copy_(", new)])
    assert fc.check_shard(mine["shard_dim0"], mine["gather_dim0"])  # the check before passes
    message = fails(
        fc.check_unit,
        mine["MyUnit"],
        match=r"hint: unshard wrote into the unsharded "
        r"nn.Parameter itself \(full.copy_\(...\)\).*full.data.copy_",
    )
    assert "rank 0" in message


# ---------------------------------------------------------------- 3. forward hooks
def test_forward_solution_passes():
    assert fh.check_forward(S["HookedUnit"])


class NoReshardAfterForward(S["HookedUnit"]):
    def post_forward(self, module, args, output):
        pass


class NoUnshard(S["HookedUnit"]):
    def pre_forward(self, module, args):
        pass


@pytest.mark.parametrize(
    "cls, hint",
    [
        (NoReshardAfterForward, r"block 0 still gathered after its forward\nhint: post_forward must reshard"),
        (
            NoUnshard,
            r"the forward raised: .*\nhint: a block computed with its shards: pre_forward must unshard",
        ),
    ],
    ids=["no reshard", "no unshard"],
)
def test_forward_mistakes(cls, hint):
    fails(fh.check_forward, cls, match=hint)


SMALL = loop.PRESETS["dp"].replace(batch_size=8)


# ---------------------------------------------------------------- 4. backward
def test_backward_solution_passes():
    assert fh.check_backward(S["TrainingUnit"])


# The reduce-scatter line of the notebook's backward solution, and a learner's wrong versions of it.
_REDUCE = 'ring_reduce_scatter(out, send.view(-1), op="sum")'
_WRONG_REDUCE = {
    "avg": 'ring_reduce_scatter(out, send.view(-1), op="avg")',
    "shift": "total = send.clone(); dist.all_reduce(total); out = total[(self.rank + 1) % self.n]",
    "local": "out = send[self.rank].clone()",
}


def _reduce_variant(mistake):
    """The notebook's TrainingUnit with its reduce-scatter replaced by a mistake."""
    return _solution([("backward", _REDUCE, _WRONG_REDUCE[mistake])])["TrainingUnit"]


class NoRegather(S["TrainingUnit"]):
    def pre_backward(self, grad):
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)


@pytest.mark.parametrize(
    "cls, hint",
    [
        (_reduce_variant("avg"), r"1/2 of the gradient: AVG where the loop SUMs"),
        (_reduce_variant("shift"), r"wrong shard index: rank 0 got rank 1's piece"),
        (_reduce_variant("local"), r"this rank's own local gradient, not reduced"),
        (NoRegather, r"forgetting to refill storage: autograd saved the unsharded weights"),
    ],
    ids=["avg", "wrong shard", "not reduced", "no re-gather"],
)
def test_backward_mistakes(cls, hint):
    message = fails(fh.check_backward, cls, match=hint)
    assert "rank" in message


BACKWARD_MISTAKES = {
    # a shard's .grad overwritten: right for one backward, wrong for two before a step
    "overwrites": (
        "shard.grad = piece.clone() if shard.grad is None else shard.grad + piece",
        "shard.grad = piece.clone()",
        r"steps \(0, 1\) accumulated before one step: wrong gradient shard.*hint: the "
        r"shard's .grad holds the last backward's piece only: it was overwritten",
    ),
    # reduce + reshard on the first gradient that arrives: the toy's one-Linear units pass,
    # a TinyGPT block's backward then needs weights already freed (was: a raw RankError in
    # "my FSDP", "setStorage ... storage of size 0")
    "reshards early": (
        "if self.ready == len(self.trainable):",
        "if self.ready >= 1:",
        r"the backward \(TinyGPT\) raised: .*hint: the unit resharded before its "
        r"backward was done.*only when ALL the unit's trainable gradients are in",
    ),
    # the reduce-scatter's input laid out per parameter (each padded gradient flattened whole,
    # one after another), not as (N, shard) rows: was "wrong gradient shard" with no hint
    "per-parameter layout": (
        "            parts.append(padded.view(self.n, -1))\n        send = torch.cat(parts, dim=1)\n"
        "        out = send.new_empty(send.shape[1])",
        "            parts.append(padded.view(-1))\n        send = torch.cat(parts)\n"
        "        out = send.new_empty(send.numel() // self.n)",
        r"step 0: wrong gradient shard.*hint: the reduce-scatter's input is laid out per "
        r"parameter .*Lay it out as \(N, shard\) rows",
    ),
}


@pytest.mark.parametrize("name", BACKWARD_MISTAKES)
def test_backward_mistakes_fail_the_backward_check_first(name):
    old, new, hint = BACKWARD_MISTAKES[name]
    mine = _solution([("backward", old, new)])
    assert fh.check_forward(mine["TrainingUnit"])  # the check before passes
    fails(fh.check_backward, mine["TrainingUnit"], match=hint)


def test_a_backward_mistake_is_named_first_by_my_fsdp(monkeypatch, capsys):
    """The cascade: "my FSDP" runs on the learner's units; with exercise 4 wrong it says so
    before its own hints (here a RankError from the freed weights)."""
    from labkit import exercise

    monkeypatch.delenv("LABKIT_EXERCISE", raising=False)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    old, new, _ = BACKWARD_MISTAKES["reshards early"]
    mine = _solution([("backward", old, new)])
    exercise.check("backward", lambda: fh.check_backward(mine["TrainingUnit"]))
    assert "FAIL backward: AssertionError" in capsys.readouterr().err
    exercise.check("my FSDP", lambda: fl.check_training(mine["MyFSDP"], SMALL, steps=2), needs=["backward"])
    out = capsys.readouterr().err
    assert out.startswith("FAIL my FSDP: BuildsOnAFailure: this exercise builds on your 'backward'"), out


# ---------------------------------------------------------------- 5. the strategy on the loop


def test_training_solution_passes():
    runs = fl.check_training(S["MyFSDP"], SMALL, steps=3)
    assert len(runs) == 2 and len(runs[0]) == 3


class OptimizerFirst(S["MyFSDP"]):
    def __init__(self, model, cfg, **options):
        early = cfg.make_optimizer([p for p in model.parameters() if p.requires_grad])
        super().__init__(model, cfg, **options)
        self.optimizer = early


class NoGradDict(S["MyFSDP"]):
    def full_grad_dict(self):
        return {}


@pytest.mark.parametrize(
    "cls, hint",
    [
        (OptimizerFirst, r"no weight moved: the optimizer must be built AFTER sharding"),
        (NoGradDict, r"missing in got: .*\nhint: full_grad_dict gathers each shard's .grad"),
    ],
    ids=["optimizer first", "no grads"],
)
def test_training_mistakes(cls, hint):
    fails(fl.check_training, cls, SMALL, 2, match=hint)


# ---------------------------------------------------------------- 6. reshard / prefetch
def test_prefetch_solution_passes():
    assert fl.check_prefetch(S["PrefetchingFSDP"])


class NoLimit(S["PrefetchingFSDP"]):
    def prefetch_after(self, unit, order):
        if unit in order:
            i = order.index(unit)
            for later in order[i + 1 : i + 1 + self.prefetch]:
                later.start_unshard()


class AlwaysReshards(S["PrefetchingFSDP"]):
    def __init__(self, model, cfg, reshard_after_forward=True, **options):
        super().__init__(model, cfg, reshard_after_forward=True, **options)


@pytest.mark.parametrize(
    "cls, hint",
    [
        (NoLimit, r"max_inflight=1: all-gathers in flight .*\nhint: .*never more than 1 in flight"),
        (AlwaysReshards, r"reshard_after_forward=False.*: \[9, 9\] all-gathers per step, expected 5"),
    ],
    ids=["no limit", "always reshards"],
)
def test_prefetch_mistakes(cls, hint):
    fails(fl.check_prefetch, cls, match=hint)


# ---------------------------------------------------------------- the plan exercises
MEASURED = {
    "root": {"peak": 300, "collectives": 2},
    "block": {"peak": 200, "collectives": 10},
    "linear": {"peak": 150, "collectives": 40},
}


def test_choose_wrap():
    assert fl.check_choose_wrap(S["choose_wrap"], MEASURED)
    fails(
        fl.check_choose_wrap,
        lambda m, b: min(m, key=lambda w: m[w]["peak"]),
        MEASURED,
        match=r"of the wraps that fit, take the one with the fewest collectives",
    )
    fails(fl.check_choose_wrap, lambda m, b: "root", MEASURED, match=r"'root' does not fit")


def test_seed_exercise():
    assert fl.check_seed(S["seed_answer"])
    message = fails(
        fl.check_seed,
        lambda: {"steady": 24 / 8, "peak_lower_bound": 9},
        match=r"steady: 3 GB per rank is too small",
    )
    assert "12" not in message, message


@pytest.mark.parametrize(
    "answer, match",
    [  # was: AttributeError from inside the checks module
        (lambda: (12, 18), r"expected a dict with keys 'steady', 'peak_lower_bound'; got tuple"),
        (lambda: {"steady": 12}, r"missing 'peak_lower_bound'"),
        (lambda: {"steady": [12], "peak_lower_bound": 18}, r"'steady': expected a number"),
    ],
    ids=["tuple", "missing key", "a list"],
)
def test_seed_exercise_wrong_format(answer, match):
    fails(fl.check_seed, answer, match=match)


# ---------------------------------------------------------------- the lab's FSDP drills
def test_fsdp_drills_show_their_symptoms():
    import labkit
    from labkit.checks import compare
    from labkit import drills

    cfg = loop.PRESETS["dp"].replace(batch_size=8)
    runs = labkit.run(
        loop.sweep,
        [
            dict(strategy=drills.OptimizerBeforeSharding),
            dict(strategy=drills.OwnMeanLossSummed),
            dict(strategy=drills.NeverReshards, track_memory=True, return_state=False),
        ],
        cfg=cfg,
        steps=2,
        world_size=2,
    )
    early, summed, never = runs[0]
    initial = loop.build_model(cfg).state_dict()
    assert compare(initial, early["state"], rtol=0, atol=0).ok  # nothing trained
    ref = loop.reference(cfg, 2)
    report = compare(ref["grads"], summed["grads"], world_size=2)
    assert not report.ok and "2× too large" in report.first_problem()
    after = never["memory"].samples[-1].by_category
    params = sum(p.numel() for p in loop.build_model(cfg).parameters())
    assert after["all_gather"] >= 4 * params  # every unit still gathered


def test_forward_hooks_registered_with_swapped_kinds_are_named():
    # issue 30: pre_forward registered as the post-hook and the other way round gave a raw
    # TypeError from torch's hook call
    mine = _solution(
        [
            (
                "forward-hooks",
                "module.register_forward_pre_hook(self.pre_forward)\n"
                "        module.register_forward_hook(self.post_forward)",
                "module.register_forward_pre_hook(self.post_forward)\n"
                "        module.register_forward_hook(self.pre_forward)",
            )
        ]
    )
    text = fails(fh.check_forward, mine["HookedUnit"], match="the hook kinds are swapped")
    assert text.startswith("rank 0: the forward raised:") and "positional argument" in text


class StateNeverGathered(S["MyFSDP"]):  # issue 30: was blamed on an "uneven split"
    def full_state_dict(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def test_full_state_dict_of_the_shards_says_never_unsharded():
    text = fails(
        fl.check_training, StateNeverGathered, SMALL, 2, match=r"full_state_dict returned the shards"
    )
    assert text.startswith("weights after 2 AdamW steps differ") and "uneven split" not in text
    assert "exactly its shard's shape" in text
