"""pp_lab's checks against more learner mistakes (issue 44): a group confused with the world, a
rank that raises while its neighbours wait (the check ends at once and shows that rank), wrong
values whose deviation is named (a loss scaled twice, bytes counted in fp32, a collective over n
instead of dp), a learner's function that returns the wrong kind of value (a hint, not an error
inside labkit), activations kept after their backward, and a 1F1B warm-up not capped at m.
Each asserts the check that fails first and its hint."""

import time

import pytest
import torch.distributed as dist
import torch.nn as nn

from labkit.labs import pp_checks as PC, pp_choice, pp_lab as P

FAST = 3.0  # the P2P timeout where a test waits for nothing
SLOW = 60.0  # the P2P timeout where the check must NOT wait it out: a rank's error ends it at once
STOPPED_WITHIN_S = 45.0  # well under SLOW: the agreement's 5 s, the launch and the report, under load


# ---------------------------------------------------------------- 1. the split, one micro-batch
def split_world_size(model, group):
    rank, p = dist.get_rank(group), dist.get_world_size()  # the world's size, not the group's
    return nn.Sequential(*[model[i] for i in range(*P.stage_range(len(model), p, rank))])


def split_world(model, group):
    rank, p = dist.get_rank(), dist.get_world_size()  # the world, not the pipeline group
    return nn.Sequential(*[model[i] for i in range(*P.stage_range(len(model), p, rank))])


def split_no_return(model, group):
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    nn.Sequential(*[model[i] for i in range(*P.stage_range(len(model), p, rank))])


def split_list(model, group):
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    return [model[i] for i in range(*P.stage_range(len(model), p, rank))]


def fwd_no_return(stage, mb, x, target, loss_fn):
    P.forward_step(stage, mb, x, target, loss_fn)


def fwd_returns_out(stage, mb, x, target, loss_fn):
    return P.forward_step(stage, mb, x, target, loss_fn)[1]


def fwd_last_sends_too(stage, mb, x, target, loss_fn):
    inp = x if stage.is_first else stage.recv(stage.index - 1, mb).requires_grad_()
    out = stage.forward(mb, inp)
    stage.send(out, stage.index + 1, mb)  # the last stage too: it has no next stage
    if stage.is_last:
        return inp, loss_fn(out, target)
    return inp, out


def bwd_last_receives_too(stage, mb, inp, out):
    grad = stage.recv(stage.index + 1, mb)  # the last stage too: nobody sends it a gradient
    stage.backward(mb, out, grad)
    if not stage.is_first:
        stage.send(inp.grad, stage.index - 1, mb)


STAGE_MISTAKES = [
    (
        (split_world_size, P.forward_step, P.backward_step),
        "the split",
        r"dist.get_world_size\(group\) \(2 here\)",
    ),
    ((split_world, P.forward_step, P.backward_step), "the split", "counts the WORLD's 4 ranks"),
    ((split_no_return, P.forward_step, P.backward_step), "returned NoneType", "without `return` gives None"),
    ((split_list, P.forward_step, P.backward_step), "returned list", r"nn.Sequential\(\*children\)"),
    (
        (P.stage_module, fwd_no_return, P.backward_step),
        "forward_step returned NoneType",
        "returns \\(inp, out\\)",
    ),
    ((P.stage_module, fwd_returns_out, P.backward_step), "forward_step returned Tensor", "the PAIR"),
]


@pytest.mark.parametrize(
    "fns, what, hint",
    STAGE_MISTAKES,
    ids=lambda v: getattr(v[0], "__name__", "") if isinstance(v, tuple) else None,
)
def test_stage_mistakes_are_named(fns, what, hint):
    with pytest.raises(AssertionError, match=hint) as err:
        PC.check_stages(*fns, timeout=FAST)
    assert what in str(err.value)


@pytest.mark.parametrize(
    "fns, rank, hint",
    [
        ((P.stage_module, fwd_last_sends_too, P.backward_step), 3, "talks to its neighbours only"),
        ((P.stage_module, P.forward_step, bwd_last_receives_too), 3, "talks to its neighbours only"),
    ],
    ids=["last_sends_forward", "last_receives_a_gradient"],
)
def test_a_rank_that_raises_ends_the_stage_check_at_once(fns, rank, hint):
    start = time.monotonic()
    with pytest.raises(AssertionError, match=hint) as err:
        PC.check_stages(*fns, timeout=SLOW)
    assert time.monotonic() - start < STOPPED_WITHIN_S  # not the 60 s P2P timeout
    text = str(err.value)
    assert f"rank {rank}:" in text and "Connection closed" not in text, text


# ---------------------------------------------------------------- 2. GPipe
def gpipe_loss_scaled_twice(stage, xs, targets, loss_fn):
    m = len(xs)
    return P.gpipe(stage, xs, targets, lambda out, t: loss_fn(out, t) / m / m)


def gpipe_loss_over_rows(stage, xs, targets, loss_fn):
    return P.gpipe(stage, xs, targets, lambda out, t: loss_fn(out, t) / out.shape[0])


def gpipe_backward_twice(stage, xs, targets, loss_fn):
    return P.gpipe(stage, xs, targets, lambda out, t: 2 * loss_fn(out, t))


def gpipe_backward_reversed(stage, xs, targets, loss_fn):
    held = {i: P.forward_step(stage, i, xs[i], targets[i], loss_fn) for i in range(len(xs))}
    losses = []
    for i in reversed(range(len(xs))):
        inp, out = held.pop(i)
        if stage.is_last:
            losses.append(out.detach())
        P.backward_step(stage, i, inp, out)
    return losses


def gpipe_reads_without_pop(stage, xs, targets, loss_fn):
    held = {i: P.forward_step(stage, i, xs[i], targets[i], loss_fn) for i in range(len(xs))}
    losses = []
    for i in range(len(xs)):
        inp, out = held[i]  # read, never dropped: the dict dies at return, the peak is the same
        if stage.is_last:
            losses.append(out.detach())
        P.backward_step(stage, i, inp, out)
    return losses


def gpipe_returns_none(stage, xs, targets, loss_fn):
    P.gpipe(stage, xs, targets, loss_fn)


def gpipe_returns_sum(stage, xs, targets, loss_fn):
    losses = P.gpipe(stage, xs, targets, loss_fn)
    return sum(losses) if losses else []


def gpipe_backward_args_swapped(stage, xs, targets, loss_fn):
    held = {i: P.forward_step(stage, i, xs[i], targets[i], loss_fn) for i in range(len(xs))}
    losses = []
    for i in range(len(xs)):
        inp, out = held.pop(i)
        if stage.is_last:
            losses.append(out.detach())
        P.backward_step(stage, i, out, inp)  # (out, inp): the last stage's backward from its input
    return losses


# ---------------------------------------------------------------- 3. 1F1B
def one_f_one_b_uncapped(stage, xs, targets, loss_fn):
    m = len(xs)
    warmup = stage.n - stage.index - 1  # not capped at m: m = 2 < p = 4 has fewer micro-batches
    held, losses = {}, []

    def backward(i):
        inp, out = held.pop(i)
        if stage.is_last:
            losses.append(out.detach())
        P.backward_step(stage, i, inp, out)

    for i in range(warmup):
        held[i] = P.forward_step(stage, i, xs[i], targets[i], loss_fn)
    for i in range(m - warmup):
        held[i + warmup] = P.forward_step(stage, i + warmup, xs[i + warmup], targets[i + warmup], loss_fn)
        backward(i)
    for i in range(max(m - warmup, 0), m):
        backward(i)
    return losses


def one_f_one_b_reads_without_pop(stage, xs, targets, loss_fn):
    m = len(xs)
    warmup = min(stage.n - stage.index - 1, m)
    held, losses = {}, []

    def backward(i):
        inp, out = held[i]  # never dropped
        if stage.is_last:
            losses.append(out.detach())
        P.backward_step(stage, i, inp, out)

    for i in range(warmup):
        held[i] = P.forward_step(stage, i, xs[i], targets[i], loss_fn)
    for i in range(m - warmup):
        held[i + warmup] = P.forward_step(stage, i + warmup, xs[i + warmup], targets[i + warmup], loss_fn)
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    return losses


def one_f_one_b_returns_none(stage, xs, targets, loss_fn):
    P.one_f_one_b(stage, xs, targets, loss_fn)


SCHEDULE_MISTAKES = [
    (PC.check_gpipe, gpipe_loss_scaled_twice, "differs from one process", "scaled twice"),
    (PC.check_gpipe, gpipe_loss_over_rows, "differs from one process", "divided by the rows again"),
    (PC.check_gpipe, gpipe_backward_twice, "differs from one process", "twice one process's"),
    (PC.check_gpipe, gpipe_backward_reversed, "slots", "the backwards in reverse"),
    (PC.check_gpipe, gpipe_reads_without_pop, "at the start of slot", r"held.pop\(i\), not held\[i\]"),
    (
        PC.check_gpipe,
        gpipe_returns_none,
        "the schedule returned NoneType",
        "return the list of the last stage's losses",
    ),
    (PC.check_gpipe, gpipe_returns_sum, "the schedule returned Tensor", "not their sum"),
    (PC.check_1f1b, one_f_one_b_uncapped, "m = 2, rank 0", r"capped at m: min\(p - rank - 1, m\)"),
    (PC.check_1f1b, one_f_one_b_reads_without_pop, "micro-batches", "activations kept after their backward"),
    (PC.check_1f1b, one_f_one_b_returns_none, "the schedule returned NoneType", "return the list"),
]


@pytest.mark.parametrize(
    "check, schedule, what, hint", SCHEDULE_MISTAKES, ids=lambda v: getattr(v, "__name__", None)
)
def test_schedule_mistakes_are_named(check, schedule, what, hint):
    with pytest.raises(AssertionError, match=hint) as err:
        check(schedule, timeout=FAST)
    assert what in str(err.value)


def test_a_rank_that_raises_ends_the_schedule_check_at_once():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="scalar outputs") as err:
        PC.check_gpipe(gpipe_backward_args_swapped, timeout=SLOW)
    assert time.monotonic() - start < STOPPED_WITHIN_S
    text = str(err.value)
    assert (
        "GPipe, p = 4, m = 4, rank 3" in text
        and "hint: the last stage's forward step returns the LOSS" in text
    ), text


# ---------------------------------------------------------------- 4. interleaved (one process: the first part)
def chunks_none(p, v, rank):
    [rank + k * p for k in range(v)]


def order_none(p, v, m, rank):
    P.interleaved_order(p, v, m, rank)


def order_stage_index(p, v, m, rank):
    return [(k, mb, rank + c * p) for k, mb, c in P.interleaved_order(p, v, m, rank)]


INTERLEAVED_MISTAKES = [
    (
        (chunks_none, P.interleaved_order),
        "returned NoneType",
        r"return the list of this rank's stage indices",
    ),
    ((P.chunk_indices, order_none), "returned NoneType", r'return a list of \("F" or "B"'),
    ((P.chunk_indices, order_stage_index), "the order, p = 2", "not the stage index"),
]


@pytest.mark.parametrize(
    "fns, what, hint", INTERLEAVED_MISTAKES, ids=lambda v: v[1].__name__ if isinstance(v, tuple) else None
)
def test_interleaved_mistakes_are_named(fns, what, hint):
    with pytest.raises(AssertionError, match=hint) as err:
        PC.check_interleaved(*fns, P.interleaved, timeout=FAST)
    assert what in str(err.value)


def test_interleaved_accepts_tuples_and_tensors():
    import torch

    # a tuple of ints, or a 1-D integer tensor, is the same list of chunks: not a mistake. The
    # order's check runs next; a wrong order there shows the chunks were accepted
    with pytest.raises(AssertionError, match="not the stage index"):
        PC.check_interleaved(
            lambda p, v, r: tuple(P.chunk_indices(p, v, r)), order_stage_index, P.interleaved
        )
    with pytest.raises(AssertionError, match="not the stage index"):
        PC.check_interleaved(
            lambda p, v, r: torch.tensor(P.chunk_indices(p, v, r)), order_stage_index, P.interleaved
        )


# ---------------------------------------------------------------- 5. the formulas (one process)
def comm_fp32(layout, c):
    return 2 * pp_choice.total_comm(layout, c) if layout == "FSDP" else pp_choice.total_comm(layout, c)


def comm_dp_over_n(layout, c):
    """The data-parallel collectives of FSDP x TP and ZeRO-1 x TP x PP over all n ranks, not dp."""
    want = pp_choice.total_comm(layout, c)
    if layout not in ("FSDP x TP", "ZeRO-1 x TP x PP"):
        return want
    pp = c.pp if layout == "ZeRO-1 x TP x PP" else 1
    dp, calls = c.n // (c.tp * pp), (3 if layout == "FSDP x TP" else 2)
    return want + calls * ((c.n - 1) / c.n - (dp - 1) / dp) * 2 * c.params / (c.tp * pp)


def memory_fp32_weights(layout, c):
    if layout == "ZeRO-1 x TP x PP":
        return 8 * c.params / (c.tp * c.pp) + 12 * c.params / c.n
    return pp_choice.memory_per_rank(layout, c)


def memory_none(layout, c):
    return None


FORMULA_MISTAKES = [
    ((pp_choice.memory_per_rank, comm_fp32), "FSDP", "counted in fp32"),
    ((pp_choice.memory_per_rank, comm_dp_over_n), "x TP", "not over all n"),
    ((memory_fp32_weights, pp_choice.total_comm), "ZeRO-1 x TP x PP", r"counted in fp32 \(4 \+ 4 B\)"),
    ((memory_none, pp_choice.total_comm), "returned NoneType", "without `return` gives None"),
]


@pytest.mark.parametrize("fns, what, hint", FORMULA_MISTAKES)
def test_formula_mistakes_are_named(fns, what, hint):
    with pytest.raises(AssertionError, match=hint) as err:
        PC.check_formulas(*fns)
    assert what in str(err.value)
