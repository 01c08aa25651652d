"""pp_lab's checks: the references pass, and each learner mistake fails the check of the exercise
that holds it, with the hint that names it (4 and 2 gloo ranks; a deadlock fails after the
checks' P2P timeout, here 3 s, never hangs)."""

import copy

import pytest
import torch.distributed as dist
import torch.nn as nn

from labkit.labs import pp_checks as PC, pp_choice, pp_lab as P

FAST = 3.0  # the P2P timeout of these tests: a deadlock is reported after 3 s


# ---------------------------------------------------------------- 1. the split, one micro-batch
def split_copies(model, group):
    return copy.deepcopy(P.stage_module(model, group))


def split_reversed(model, group):
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    start, end = P.stage_range(len(model), p, p - 1 - rank)
    return nn.Sequential(*[model[i] for i in range(start, end)])


def split_floor(model, group):
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    size = len(model) // p
    end = len(model) if rank == p - 1 else (rank + 1) * size
    return nn.Sequential(*[model[i] for i in range(rank * size, end)])


def split_global_rank(model, group):
    rank, p = dist.get_rank(), dist.get_world_size(group)
    start, end = P.stage_range(len(model), p, rank)
    return nn.Sequential(*[model[i] for i in range(start, min(end, len(model)))])


def fwd_no_requires_grad(stage, mb, x, target, loss_fn):
    inp = x if stage.is_first else stage.recv(stage.index - 1, mb)
    out = stage.forward(mb, inp)
    if stage.is_last:
        return inp, loss_fn(out, target)
    stage.send(out, stage.index + 1, mb)
    return inp, out


def fwd_sends_twice(stage, mb, x, target, loss_fn):
    inp, out = P.forward_step(stage, mb, x, target, loss_fn)
    if not stage.is_last:
        stage.send(out, stage.index + 1, mb)  # once more: nobody receives it
    return inp, out


def fwd_no_loss(stage, mb, x, target, loss_fn):
    inp = x if stage.is_first else stage.recv(stage.index - 1, mb).requires_grad_()
    out = stage.forward(mb, inp)
    if not stage.is_last:
        stage.send(out, stage.index + 1, mb)
    return inp, out


def fwd_sends_upstream(stage, mb, x, target, loss_fn):
    inp = x if stage.is_first else stage.recv(stage.index - 1, mb).requires_grad_()
    out = stage.forward(mb, inp)
    if stage.is_last:
        return inp, loss_fn(out, target)
    stage.send(out, stage.index - 1, mb)
    return inp, out


def bwd_no_send_back(stage, mb, inp, out):
    grad = None if stage.is_last else stage.recv(stage.index + 1, mb)
    stage.backward(mb, out, grad)


def bwd_first_sends_too(stage, mb, inp, out):
    grad = None if stage.is_last else stage.recv(stage.index + 1, mb)
    stage.backward(mb, out, grad)
    stage.send(inp.grad, stage.index - 1, mb)


STAGE_MISTAKES = [
    ((split_copies, P.forward_step, P.backward_step), "OWN children"),
    ((split_reversed, P.forward_step, P.backward_step), "the wrong stage order"),
    ((split_floor, P.forward_step, P.backward_step), "the first n % p stages take one more"),
    ((split_global_rank, P.forward_step, P.backward_step), r"dist.get_rank\(group\), not the global rank"),
    ((P.stage_module, fwd_no_requires_grad, P.backward_step), "must require grad"),
    ((P.stage_module, fwd_sends_twice, P.backward_step), "a send without its matching recv"),
    ((P.stage_module, fwd_no_loss, P.backward_step), "returns the LOSS"),
    ((P.stage_module, fwd_sends_upstream, P.backward_step), r"activations go to stage.index \+ 1"),
    ((P.stage_module, P.forward_step, bwd_no_send_back), "sends its input's gradient back"),
    ((P.stage_module, P.forward_step, bwd_first_sends_too), "sends no gradient back"),
]


@pytest.mark.parametrize(
    "fns, hint", STAGE_MISTAKES, ids=lambda v: getattr(v[0], "__name__", "") if isinstance(v, tuple) else None
)
def test_stage_mistakes_are_named(fns, hint):
    with pytest.raises(AssertionError, match=hint):
        PC.check_stages(*fns, timeout=FAST)


# ---------------------------------------------------------------- 2. GPipe
def gpipe_zero_grad_each(stage, xs, targets, loss_fn):
    held = [P.forward_step(stage, i, xs[i], targets[i], loss_fn) for i in range(len(xs))]
    losses = []
    for i in range(len(xs)):
        inp, out = held[i]
        held[i] = None
        stage.module.zero_grad()  # clears the earlier micro-batches' gradients
        if stage.is_last:
            losses.append(out.detach())
        P.backward_step(stage, i, inp, out)
    return losses


def gpipe_scaled_loss(stage, xs, targets, loss_fn):
    def scaled(out, target):
        return loss_fn(out, target) / len(xs)

    return P.gpipe(stage, xs, targets, scaled)


def gpipe_keeps_activations(stage, xs, targets, loss_fn):
    held = {i: P.forward_step(stage, i, xs[i], targets[i], loss_fn) for i in range(len(xs))}
    losses = []
    for i in range(len(xs)):
        inp, out = held[i]  # not popped: kept until the step ends, and after
        if stage.is_last:
            losses.append(out.detach())
        P.backward_step(stage, i, inp, out)
    stage.kept = held
    return losses


def gpipe_one_at_a_time(stage, xs, targets, loss_fn):
    losses = []
    for i in range(len(xs)):
        inp, out = P.forward_step(stage, i, xs[i], targets[i], loss_fn)
        if stage.is_last:
            losses.append(out.detach())
        P.backward_step(stage, i, inp, out)
    return losses


def gpipe_off_by_one(stage, xs, targets, loss_fn):
    return P.gpipe(stage, xs[:-1], targets[:-1], loss_fn)


# ---------------------------------------------------------------- 3. 1F1B
def _one_f_one_b(warmup_of, steady_backward_first=False, cooldown=True, pop=True):
    def schedule(stage, xs, targets, loss_fn):
        m = len(xs)
        warmup = min(warmup_of(stage), m)
        held, losses = {}, []

        def backward(i):
            inp, out = held.pop(i) if pop else held[i]
            if stage.is_last:
                losses.append(out.detach())
            P.backward_step(stage, i, inp, out)

        for i in range(warmup):
            held[i] = P.forward_step(stage, i, xs[i], targets[i], loss_fn)
        for i in range(m - warmup):
            if steady_backward_first:
                backward(i)
            held[i + warmup] = P.forward_step(stage, i + warmup, xs[i + warmup], targets[i + warmup], loss_fn)
            if not steady_backward_first:
                backward(i)
        if cooldown:
            for i in range(m - warmup, m):
                backward(i)
        stage.kept = held
        return losses

    return schedule


warmup_one_too_many = _one_f_one_b(lambda s: s.n - s.index)
warmup_same_everywhere = _one_f_one_b(lambda s: s.n - 1)
steady_backward_first = _one_f_one_b(lambda s: s.n - s.index - 1, steady_backward_first=True)
no_cooldown = _one_f_one_b(lambda s: s.n - s.index - 1, cooldown=False)
one_f_one_b_keeps = _one_f_one_b(lambda s: s.n - s.index - 1, pop=False)


def order_deadlocks(stage, xs, targets, loss_fn):
    if not stage.is_last:  # waits for a gradient before anything went forward: every rank waits
        stage.recv(stage.index + 1, 0)
    return P.one_f_one_b(stage, xs, targets, loss_fn)


SCHEDULE_MISTAKES = [
    (PC.check_gpipe, gpipe_zero_grad_each, "ACCUMULATE"),
    (PC.check_gpipe, gpipe_scaled_loss, "the loss was divided by m"),
    (PC.check_gpipe, gpipe_keeps_activations, "activations kept after their backward"),
    (PC.check_gpipe, gpipe_one_at_a_time, "GPipe runs every micro-batch's forward first"),
    (PC.check_gpipe, gpipe_off_by_one, "a forward for each of the m"),
    (PC.check_1f1b, warmup_one_too_many, "the warm-up on rank"),
    (PC.check_1f1b, warmup_same_everywhere, "the warm-up depends on the stage"),
    (PC.check_1f1b, steady_backward_first, "a backward of a micro-batch before its forward"),
    (PC.check_1f1b, no_cooldown, "the cool-down"),
    (PC.check_1f1b, one_f_one_b_keeps, "activations kept after their backward"),
    (PC.check_1f1b, order_deadlocks, "the order deadlocks"),
]


@pytest.mark.parametrize(
    "check, schedule, hint", SCHEDULE_MISTAKES, ids=lambda v: getattr(v, "__name__", None)
)
def test_schedule_mistakes_are_named(check, schedule, hint):
    with pytest.raises(AssertionError, match=hint):
        check(schedule, timeout=FAST)


# ---------------------------------------------------------------- 4. interleaved
def chunks_off_by_one(p, v, rank):
    return [rank + 1 + k * p for k in range(v)]


def chunks_contiguous(p, v, rank):
    return [rank * v + k for k in range(v)]


def order_backward_not_reversed(p, v, m, rank):
    return [(k, mb, c if k == "F" else v - 1 - c) for k, mb, c in P.interleaved_order(p, v, m, rank)]


def order_short_warmup(p, v, m, rank):
    # the warm-up without the (v - 1) p forwards of the other chunks: one steady pair in the middle
    total, order = m * v, P.interleaved_order(p, v, m, rank)
    fs = [u for u in order if u[0] == "F"]
    bs = [u for u in order if u[0] == "B"]
    warm = min((p - rank - 1) * 2, total)
    out = fs[:warm]
    for i in range(total - warm):
        out += [fs[warm + i], bs[i]]
    return out + bs[total - warm :]


def order_no_full_warmup_when_m_is_p(p, v, m, rank):
    # (p - rank - 1) * 2 + (v - 1) * p forwards of warm-up even when m == p (Megatron: all of them)
    total = m * v

    def unit(k, backward):
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - chunk) if backward else chunk

    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    out = [("F", *unit(k, False)) for k in range(warm)]
    for b in range(total - warm):
        out += [("F", *unit(warm + b, False)), ("B", *unit(b, True))]
    return out + [("B", *unit(b, True)) for b in range(total - warm, total)]


INTERLEAVED_MISTAKES = [
    ((chunks_off_by_one, P.interleaved_order), "off by one"),
    ((chunks_contiguous, P.interleaved_order), "round-robin, not contiguous"),
    ((P.chunk_indices, order_backward_not_reversed), "backwards run the chunks in REVERSE"),
    ((P.chunk_indices, order_short_warmup), "the interleaved warm-up on rank"),
    ((P.chunk_indices, order_no_full_warmup_when_m_is_p), "when m == p"),
]


@pytest.mark.parametrize(
    "fns, hint",
    INTERLEAVED_MISTAKES,
    ids=lambda v: getattr(v[0], "__name__", "") if isinstance(v, tuple) else None,
)
def test_interleaved_mistakes_are_named(fns, hint):
    with pytest.raises(AssertionError, match=hint):
        PC.check_interleaved(*fns, P.interleaved, timeout=FAST)


# ---------------------------------------------------------------- 5. the layouts' formulas
def memory_zero1_all_sharded(layout, c):
    return 16 * c.params / c.n if layout == "ZeRO-1 x TP x PP" else pp_choice.memory_per_rank(layout, c)


def memory_hsdp_over_n(layout, c):
    return 16 * c.params / c.n if layout == "HSDP" else pp_choice.memory_per_rank(layout, c)


def comm_fsdp_two_collectives(layout, c):
    if layout == "FSDP":
        return 2 * (c.n - 1) / c.n * 2 * c.params
    return pp_choice.total_comm(layout, c)


def comm_ddp_half(layout, c):
    return pp_choice.total_comm(layout, c) / (2 if layout == "DDP" else 1)


def comm_no_pp(layout, c):
    total = pp_choice.total_comm(layout, c)
    if layout == "ZeRO-1 x TP x PP" and c.pp > 1:
        total -= 2 * c.tokens / (c.n // (c.tp * c.pp)) * c.d * 2 / c.tp
    return total


FORMULA_MISTAKES = [
    ((memory_zero1_all_sharded, pp_choice.total_comm), "ZeRO-1 shards only the optimizer state"),
    ((memory_hsdp_over_n, pp_choice.total_comm), "HSDP shards inside the node only"),
    ((pp_choice.memory_per_rank, comm_fsdp_two_collectives), "three collectives per step"),
    ((pp_choice.memory_per_rank, comm_ddp_half), r"2\(n-1\)/n"),
    ((pp_choice.memory_per_rank, comm_no_pp), "PP sends each stage's output activation forward"),
]


@pytest.mark.parametrize(
    "fns, hint",
    FORMULA_MISTAKES,
    ids=lambda v: v[0].__name__ + "+" + v[1].__name__ if isinstance(v, tuple) else None,
)
def test_formula_mistakes_are_named(fns, hint):
    with pytest.raises(AssertionError, match=hint):
        PC.check_formulas(*fns)


def test_mistakes_are_at_least_twenty():
    assert (
        len(STAGE_MISTAKES) + len(SCHEDULE_MISTAKES) + len(INTERLEAVED_MISTAKES) + len(FORMULA_MISTAKES) >= 20
    )


# ---------------------------------------------------------------- the references, and unwritten code
def test_references_pass(capsys):
    PC.check_stages(P.stage_module, P.forward_step, P.backward_step)
    PC.check_gpipe(P.gpipe)
    PC.check_1f1b(P.one_f_one_b)
    PC.check_interleaved(P.chunk_indices, P.interleaved_order, P.interleaved)
    PC.check_formulas(pp_choice.memory_per_rank, pp_choice.total_comm)
    out = capsys.readouterr().out
    assert out.count("atol 1e-12") >= 4 and "all 5 layouts right" in out


def not_written(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize(
    "call",
    [
        lambda: PC.check_stages(not_written, not_written, not_written, timeout=FAST),
        lambda: PC.check_stages(P.stage_module, not_written, not_written, timeout=FAST),
        lambda: PC.check_gpipe(not_written, timeout=FAST),
        lambda: PC.check_1f1b(not_written, timeout=FAST),
        lambda: PC.check_interleaved(not_written, not_written, not_written, timeout=FAST),
        lambda: PC.check_formulas(not_written, not_written),
    ],
)
def test_unwritten_code_says_not_implemented(call):
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        call()
