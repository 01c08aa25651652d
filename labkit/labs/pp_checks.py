"""Checks for pp_lab's exercises: each runs the learner's code on gloo ranks and compares every
stage's gradients element-wise (float64, atol 1e-12) with one process on the same global batch
AND with torch.distributed.pipelining's schedule (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, scale_grads=False), then checks what the lesson is about: the slot
order each rank recorded, the activations it held (live micro-batches at each slot's start and
after the step), the messages it sent.

    check_stages(stage_module, forward_step, backward_step)   the split (4 ranks, one pipeline
                       and a 2 x 2 ("dp", "pp") mesh) and one micro-batch through 4 stages
    check_gpipe(gpipe)                      p = 4, m = 4 and p = 2, m = 6
    check_1f1b(one_f_one_b)                 p = 4, m = 6 and p = 2, m = 4
    check_interleaved(chunk_indices, order, interleaved)    p = 2 and 4, v = 2, m = 4
    check_backward_split(b, w)              B and W of one stage against its backward (no ranks)
    check_zb_h1(order)                      the ZB-H1 order (no ranks): p = 2, 3, 4, m = p .. 3p

Each raises one AssertionError naming the rank and case, with a "hint:" for the mistake it
recognises. A deadlock is a PipeTimeout on some rank after `timeout` seconds (the schedule's
messages are tagged, so nothing is mixed up: it waits), reported with what it waited for. A
learner's error raised on some ranks only (the last stage's, while its neighbours wait for its
message) ends the check at once, showing the rank that raised (tp_checks.shared's agreement after
each case: the check does not wait out the timeout). What the learner's functions return is
validated before the check uses it (None, a list where a module or a tuple belongs). 1F1B also
runs with m < p (m = 2 on 4 ranks: the warm-up capped at m), against one process only (torch's
schedules and labkit's refuse m < p).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from labkit.checks import NOT_IMPLEMENTED
from labkit.checks import fail as _fail
from labkit.labs import pp_lab
from labkit.labs.tp_checks import shared
from labkit.strategies.pp import schedule as pp_schedule

ATOL = 1e-12
TIMEOUT = 15.0  # the checks' P2P timeout: their models are tiny, a message takes milliseconds


def _run(fn, *args, world_size=4):
    # tp_checks' launch: a rank whose learner code raised while its peers wait for it (CheckRaised)
    # leaves at once, and its error (with the learner's line) is what the kernel shows
    return shared._run(fn, *args, world_size=world_size)


def _attempt(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        return NOT_IMPLEMENTED
    except pp_lab.PipeTimeout as exc:
        return f"deadlock: {exc}"
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"


def _try(thunk):
    """shared._try, a deadlock a plain string: every rank times out, nobody is to blame first."""
    value = shared._try(thunk)
    if isinstance(value, shared.Raised) and isinstance(value.exc, pp_lab.PipeTimeout):
        return f"deadlock: {value.exc}"
    return value


def _cases(cases, label="", hint_of=None):
    """Run the (name, thunk) cases in order on every rank; stop after the first one that fails on
    any rank (its messages may still be in flight). {name: value or error string}. A rank whose
    thunk raised while the others wait for its messages ends the launch at once (shared._agree):
    "label, name, rank r: its error", hint_of(error)."""
    # the ranks agree on a group of their own: after a timeout gloo closes the timed-out group's
    # connections ("Application timeout caused pair closure"), so the world is unusable then
    ctrl = dist.new_group(backend="gloo")
    out = {}
    for name, thunk in cases:
        value = _try(thunk)
        out[name] = value
        where = f"{label}, {name}, rank {dist.get_rank()}".lstrip(", ")
        if not shared._agree(value, where=where, hint=hint_of, group=ctrl):
            out["broken"] = True
            break
    return out


def _not_implemented(results):
    if any(v == NOT_IMPLEMENTED for r in results for v in r.values() if isinstance(v, str)):
        raise NotImplementedError(NOT_IMPLEMENTED)


def _first_error(results, names):
    """(case, rank, message) of the first failing case, preferring a rank's own error over a
    neighbour's timeout (the error is the cause, the timeouts its consequence)."""
    for name in names:
        errors = [(r, res[name]) for r, res in enumerate(results) if isinstance(res.get(name), str)]
        if errors:
            # a rank's own error is the cause, then a wait that timed out (it says what it waited
            # for), last a wait cut off because another rank gave up
            own = [e for e in errors if not e[1].startswith("deadlock")]
            timed_out = [e for e in errors if "never" in e[1]]
            rank, msg = (own or timed_out or errors)[0]
            return name, rank, msg
        if any(name not in res for res in results):
            return None
    return None


def _diff(a, b):
    if b is None:
        return "no gradient"
    return f"max |diff| {(a - b).abs().max().item():.3g}" if a.shape == b.shape else f"shape {tuple(b.shape)}"


def _close(a, b):
    return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=ATOL)


def _ratio(got, one):
    """c when every gradient is c times one process's (within ATOL), else None."""
    name = next((n for n in got if isinstance(got[n], torch.Tensor) and one[n].abs().max() > 1e-6), None)
    if name is None:
        return None
    ref = one[name]
    c = float((got[name] * ref).sum() / (ref * ref).sum())
    if all(isinstance(g, torch.Tensor) and _close(one[n] * c, g) for n, g in got.items()):
        return c
    return None


def _grad_hint(got, one, last_only, m):
    """The mistake a wrong gradient shows, by what it equals instead."""
    c = _ratio(got, one)
    rows = pp_lab.ROWS // m
    named = {
        1
        / m
        ** 2: f"the gradients are 1/m² = 1/{m * m} of one process's: the loss was scaled twice (divided by m "
        "in two places). Each micro-batch's loss is already its own mean; the step's loss is their SUM",
        1
        / rows: f"the gradients are 1/{rows} of one process's, 1 / the micro-batch's rows: the loss was divided "
        "by the rows again, but loss_fn's mean already divides by them",
        1
        / (
            m * rows
        ): f"the gradients are 1/(m x rows) = 1/{m * rows} of one process's: the loss was divided by "
        "the global batch's rows, but loss_fn's mean already divides by the micro-batch's and the step SUMS them",
        2.0: "the gradients are twice one process's: each micro-batch's gradient was added twice (its backward "
        "ran twice, or its loss was counted twice)",
    }
    for ratio, hint in named.items():
        if c is not None and ratio != 1 / m and abs(c - ratio) <= 1e-9 * ratio:
            return hint
    if all(_close(one[n] / m, g) for n, g in got.items()):
        return (
            f"the gradients are 1/m = 1/{m} of one process's: the loss was divided by m. Each micro-batch's "
            "loss is already its own mean; the step's loss is their SUM (torch's schedules with "
            "scale_grads=False), so do not scale it again"
        )
    if all(_close(one[n] * m, g) for n, g in got.items()):
        return f"the gradients are m = {m} times one process's: the loss was multiplied by m"
    if last_only is not None and all(_close(last_only[n], g) for n, g in got.items()):
        return (
            "the gradients are the last micro-batch's only: they must ACCUMULATE over the micro-batches "
            "(no zero_grad between them: backward adds into .grad)"
        )
    return "see the order and the messages above; every micro-batch's forward and backward, once each"


def _compare_grads(results, key, one, theirs, label, m, last_only=None, stages_of=None):
    for rank, res in enumerate(results):
        got = res[key]["grads"]
        want_names = sorted(theirs[rank]["grads"]) if theirs is not None else None
        if want_names is not None and sorted(got) != want_names:
            _fail(
                f"{label}, rank {rank}: gradients for {sorted(got)}, expected {want_names}",
                "every parameter of this rank's stage(s) gets a gradient (each stage's backward ran)",
            )
        for ref_name, ref in (
            ("one process", one),
            ("torch's schedule", theirs[rank]["grads"] if theirs else None),
        ):
            if ref is None:
                continue
            for n, g in got.items():
                if not _close(ref[n], g):
                    _fail(
                        f"{label}, rank {rank}: {n}'s gradient differs from {ref_name}'s ({_diff(ref[n], g)})",
                        _grad_hint({k: got[k] for k in got}, one, last_only, m),
                    )


def _one_and_last(m, rows=pp_lab.ROWS, dp_rank=None):
    model = pp_lab.make_model(0)
    x, y = pp_lab.batch(0, rows)
    if dp_rank is not None:
        x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
    one, _ = pp_lab.one_process_grads(model, x, y, m)
    xb, yb = x.chunk(m)[-1], y.chunk(m)[-1]
    model.zero_grad(set_to_none=True)
    pp_lab.loss_fn(model(xb), yb).backward()
    last = {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }
    return one, last


# ---------------------------------------------------------------- 1. the split, one micro-batch
SPLITS = ((8, "the lab's 8 layers"), (7, "7 layers"))


def _split_case(stage_module, children, group):
    widths = pp_lab.WIDTHS[: children + 1]
    model = pp_lab.make_model(0, widths)
    mine = stage_module(model, group)
    if not isinstance(mine, torch.nn.Module):
        raise Returned(f"stage_module returned {type(mine).__name__}, not an nn.Module")
    own = {id(c): i for i, c in enumerate(model)}
    return [own.get(id(c), -1) for c in mine.children()]


class Returned(TypeError):
    """What a learner's function returned is not what the exercise asks for (None, a list...)."""


def _returned_hint(msg):
    """The hint for a learner's function that returned the wrong kind of value."""
    if "stage_module returned NoneType" in msg:
        return "stage_module returns the stage (return nn.Sequential(...)): a function without `return` gives None"
    if "stage_module returned list" in msg or "stage_module returned tuple" in msg:
        return "wrap the children in a module: nn.Sequential(*children) (the stage is an nn.Module)"
    if "forward_step returned NoneType" in msg:
        return "forward_step returns (inp, out): a function without `return` gives None"
    if "forward_step returned" in msg:
        return "forward_step returns the PAIR (inp, out): backward_step needs the input (for its gradient) and the output"
    if "schedule returned NoneType" in msg:
        return "return the list of the last stage's losses (out.detach(), one per micro-batch; [] on the other stages)"
    if "schedule returned" in msg:
        return "return a list of the last stage's losses, one per micro-batch (out.detach()), not their sum or a tensor"
    return "see the error above"


def _one_mb(fwd, bwd):
    """A one-micro-batch schedule from the learner's forward and backward steps, which checks what
    forward_step returned before using it."""

    def one_mb(stage, xs, ys, loss_fn):
        got = fwd(stage, 0, xs[0], ys[0], loss_fn)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            what = (
                type(got).__name__
                if not isinstance(got, (tuple, list))
                else f"a {type(got).__name__} of {len(got)}"
            )
            raise Returned(f"forward_step returned {what}, not (inp, out)")
        inp, out = got
        bwd(stage, 0, inp, out)
        return [out.detach()] if stage.is_last else []

    return one_mb


def _stages_rank(stage_module, fwd, bwd, timeout):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pp = mesh.get_group("pp")

    one_mb = _one_mb(fwd, bwd)
    cases = [
        (f"split {c} on {p}", lambda c=c, g=g: _split_case(stage_module, c, g))
        for c, _ in SPLITS
        for p, g in ((4, None), (2, pp))
    ]
    cases += [
        ("one micro-batch, 4 stages", lambda: pp_lab.run_schedule(one_mb, 1, timeout=timeout)),
        (
            "one micro-batch, 2 x 2 mesh",
            lambda: pp_lab.run_schedule(one_mb, 1, mesh_dims=("dp", "pp"), timeout=timeout),
        ),
    ]
    out = _cases(cases, "the split and one micro-batch", _stage_error_hint)
    out["pp_rank"] = mesh.get_local_rank("pp")
    out["dp_rank"] = mesh.get_local_rank("dp")
    if not out.get("broken"):
        out["torch"] = pp_lab.torch_schedule("gpipe", 1)
    return out


def check_stages(
    stage_module: Callable, forward_step: Callable, backward_step: Callable, timeout: float = TIMEOUT
) -> None:
    results = _run(_stages_rank, stage_module, forward_step, backward_step, timeout)
    _not_implemented(results)
    names = [f"split {c} on {p}" for c, _ in SPLITS for p in (4, 2)]
    for name in names:
        c, p = int(name.split()[1]), int(name.split()[-1])
        for rank, res in enumerate(results):
            got = res.get(name)
            if got is None:
                continue
            index = rank if p == 4 else res["pp_rank"]
            where = f"{name.replace('split', 'the split of')} stages, rank {rank}" + (
                f" (pp group rank {index})" if p == 2 else ""
            )
            if isinstance(got, str):
                hint = (
                    "this rank's stage is dist.get_rank(group) of dist.get_world_size(group): the pipeline "
                    "group, not the world"
                    if "out of range" in got or "index" in got
                    else _stage_error_hint(got)
                )
                _fail(f"{where}: {got}", hint)
            start, end = pp_lab.stage_range(c, p, index)
            want = list(range(start, end))
            if got == want:
                continue
            sizes = [len(range(*pp_lab.stage_range(c, p, i))) for i in range(p)]
            world = len(results)
            if p < world and got in (
                list(range(*pp_lab.stage_range(c, world, index))),
                list(range(*pp_lab.stage_range(c, world, rank))),
            ):
                hint = (
                    f"the split counts the WORLD's {world} ranks: p is the pipeline group's size, "
                    f"dist.get_world_size(group) ({p} here), and the stage dist.get_rank(group) "
                    "(the group is not the world on a 2 x 2 mesh)"
                )
            elif -1 in got:
                hint = (
                    "the stage holds the model's OWN children (model[i]), not copies: the optimizer and "
                    "model.named_parameters() must see the trained weights"
                )
            elif p == 2 and rank != index:
                hint = "the stage index is this rank's place in the pipeline group, dist.get_rank(group), not the global rank"
            elif got == list(range(*pp_lab.stage_range(c, p, p - 1 - index))):
                hint = "the wrong stage order: stage 0 (rank 0 of the group) holds the FIRST layers, where x enters"
            elif len(got) != end - start:
                hint = (
                    f"{c} layers on {p} stages are {sizes} layers: the first n % p stages take one more "
                    "(torch.tensor_split's rule)"
                )
            else:
                hint = "stage r holds a contiguous run of children, in order"
            _fail(f"{where}: children {got}, expected {want}", hint)
    # one micro-batch
    first = _first_error(results, ["one micro-batch, 4 stages", "one micro-batch, 2 x 2 mesh"])
    if first is not None:
        name, rank, msg = first
        _fail(f"{name}, rank {rank}: {msg}", _stage_error_hint(msg))
    one4, _ = _one_and_last(1)
    _compare_grads(results, "one micro-batch, 4 stages", one4, None, "one micro-batch through 4 stages", 1)
    for rank, res in enumerate(results):
        got = res["one micro-batch, 2 x 2 mesh"]["grads"]
        one, _ = _one_and_last(1, dp_rank=res["dp_rank"])
        for n, g in got.items():
            if not _close(one[n], g):
                _fail(
                    f"2 x 2 mesh, rank {rank}: {n}'s gradient differs from one process on its dp half ({_diff(one[n], g)})",
                    "see the 4-stage case",
                )
    torch_grads = [r["torch"] for r in results]
    _compare_grads(
        results, "one micro-batch, 4 stages", one4, torch_grads, "one micro-batch through 4 stages", 1
    )
    _check_held(results, "one micro-batch, 4 stages", "one micro-batch")
    print(
        "the split: the model's own children, stage r of the group the r-th run (7 layers on 4 stages: 2, 2, 2, 1); "
        f"one micro-batch through 4 stages: every gradient equal to one process and to torch's ScheduleGPipe (atol {ATOL:g}), "
        "also in each pipeline of a 2 x 2 mesh"
    )


def _stage_error_hint(msg):
    if "returned" in msg and ("stage_module" in msg or "forward_step" in msg):
        return _returned_hint(msg)
    if "never received" in msg:
        return (
            "a send without its matching recv: each send to stage s is received by s once (the activation "
            "forward, its gradient back), no more"
        )
    if "output gradient" in msg and "never came" in msg:
        return (
            "every stage but the first sends its input's gradient back after its backward: "
            "stage.send(inp.grad, stage.index - 1, mb)"
        )
    if "activation" in msg and "never came" in msg:
        return "every stage but the last sends its output forward: stage.send(out, stage.index + 1, mb)"
    if "NoneType" in msg or "shape None" in msg:
        return (
            "inp.grad is None: the received activation must require grad (recv(...).requires_grad_()) "
            "so that backward fills the gradient to send back"
        )
    if "scalar outputs" in msg:
        return (
            "the last stage's forward step returns the LOSS (loss_fn(out, target)): backward starts from "
            "a scalar, grad None"
        )
    if "sends stage" in msg and "shape" in msg:
        return "activations go to stage.index + 1 (downstream), input gradients to stage.index - 1 (upstream)"
    if "talks to its neighbours" in msg:
        return (
            "activations go to stage.index + 1 (downstream), input gradients to stage.index - 1 (upstream); "
            "the first stage receives no activation and sends no gradient back, the last sends nothing forward"
        )
    if "does not require grad" in msg:
        return "the received activation must require grad: recv(...).requires_grad_()"
    return "see the error above"


def _check_held(results, key, what):
    for rank, res in enumerate(results):
        count, nbytes = res[key]["held_after"]
        if count:
            _fail(
                f"{what}, rank {rank}: after the step it still holds the activations of {count} micro-batch(es) "
                f"({nbytes} B)",
                "activations kept after their backward: drop (pop) each micro-batch's input and output once its "
                "backward has run, so their memory is freed",
            )


# ---------------------------------------------------------------- 2. and 3.: GPipe, 1F1B
LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B"}


def _schedule_rank(schedule, torch_kind, configs, timeout, v=1):
    p = dist.get_world_size()
    cases = [
        (f"m = {m}", lambda m=m: pp_lab.run_schedule(schedule, m, v, timeout=timeout)) for m in configs[p]
    ]
    label = f"{LABELS[torch_kind]}, p = {p}"
    out = _cases(cases, label, lambda msg: _schedule_error_hint(torch_kind, msg, p))
    if not out.get("broken"):
        # torch's schedules refuse m < p: those cases are compared with one process only
        out["torch"] = {f"m = {m}": pp_lab.torch_schedule(torch_kind, m, v) for m in configs[p] if m >= p}
    return out


def _expected_order(kind, p, m, rank, v=1):
    """The recorded slots (kind, micro-batch, stage) rank `rank` must show: labkit's strategy's
    order (m >= p), or 1F1B's with its warm-up capped at m (m < p, which labkit refuses)."""
    if m >= p:
        return [(a.kind, a.microbatch, a.chunk) for a in pp_schedule.order(kind, rank, p, m, v)]
    warm = min(p - rank - 1, m) if kind == "1f1b" else m
    out = [("F", i, rank) for i in range(warm)]
    for i in range(m - warm):
        out += [("F", i + warm, rank), ("B", i, rank)]
    return out + [("B", i, rank) for i in range(m - warm, m)]


def _expected_live(slots):
    """The micro-batches a rank holds at the start of each of its slots (those forwarded, not yet
    backwarded; a backward's own micro-batch still held at its start)."""
    held, out = set(), []
    for kind, mb, stage in slots:
        out.append(len(held))
        if kind == "F":
            held.add((stage, mb))
        else:
            held.discard((stage, mb))
    return out


def _check_live(results, name, where):
    """Each micro-batch's activations freed after its backward: at most one more held at a slot's
    start than the order implies (the last backward's locals may live until the next slot)."""
    for rank, res in enumerate(results):
        slots = res[name]["slots"]
        want = _expected_live(slots)
        for k, ((count, nbytes), expected) in enumerate(zip(res[name]["live"], want)):
            slack = 1 if k and slots[k - 1][0] == "B" else 0
            if count > expected + slack:
                _fail(
                    f"{where}, rank {rank}: at the start of slot {k} ({_fmt(slots[k : k + 1])}) it held the "
                    f"activations of {count} micro-batches ({nbytes} B), {expected} expected",
                    "activations kept after their backward: the peak may look the same (and the dict dies at "
                    "return), but a micro-batch's (inp, out) must be dropped once its backward ran: "
                    "held.pop(i), not held[i]",
                )


def _check_schedule(kind, results, p, configs, v=1):
    label = LABELS[kind]
    names = [f"m = {m}" for m in configs[p]]
    first = _first_error(results, names)
    if first is not None:
        name, rank, msg = first
        _fail(f"{label}, p = {p}, {name}, rank {rank}: {msg}", _schedule_error_hint(kind, msg, p))
    for name, m in zip(names, configs[p]):
        where = f"{label}, p = {p}, {name}"
        leads = [next((i for i, s in enumerate(r[name]["slots"]) if s[0] == "B"), 0) for r in results]
        if kind == "1f1b" and p > 2 and len(set(leads)) == 1:
            _fail(
                f"{where}: every rank ran {leads[0]} forwards before its first backward",
                "the warm-up depends on the stage: p - stage.index - 1 forwards (the last stage none), not the same on every rank",
            )
        for rank, res in enumerate(results):
            got, want = res[name]["slots"], _expected_order(kind, p, m, rank, v)
            if got != want:
                _fail(
                    f"{where}, rank {rank}: slots {_fmt(got)}, expected {_fmt(want)}",
                    _order_hint(kind, got, want, p, m, rank, v),
                )
        one, last = _one_and_last(m)
        theirs = [r["torch"][name] for r in results] if m >= p else None
        _compare_grads(results, name, one, theirs, where, m, last)
        losses = sorted(x for r in results for x in r[name]["losses"])
        if theirs is not None:
            want_losses, whose = sorted(x for r in theirs for x in r["losses"]), "torch's"
        else:
            model = pp_lab.make_model(0)
            want_losses, whose = (
                sorted(pp_lab.one_process_grads(model, *pp_lab.batch(0), m)[1]),
                "one process's",
            )
        if len(losses) != len(want_losses) or any(abs(a - b) > ATOL for a, b in zip(losses, want_losses)):
            _fail(
                f"{where}: the last stage returned losses {losses}, {whose} {want_losses}",
                "return one loss per micro-batch (out.detach()) from the last stage, unscaled",
            )
        _check_held(results, name, where)
        _check_live(results, name, where)
        if kind != "interleaved":
            for rank, res in enumerate(results):
                peak = max(c for c, _ in res[name]["live"])
                cap = m if kind == "gpipe" else min(m, p - rank)
                if peak != cap:
                    _fail(
                        f"{where}, rank {rank}: held the activations of {peak} micro-batches at once, expected {cap}",
                        "activations kept after their backward: pop each micro-batch's (input, output) before or "
                        f"when its backward runs; {label} holds {'m' if kind == 'gpipe' else 'at most p - rank'}",
                    )


def _fmt(slots):
    return " ".join(f"{k}{mb}" + (f"/{s}" if s is not None else "") for k, mb, s in slots[:24]) + (
        " ..." if len(slots) > 24 else ""
    )


def _schedule_error_hint(kind, msg, p=None):
    if "schedule returned" in msg:
        return _returned_hint(msg)
    if kind == "1f1b" and "index out of range" in msg:
        return (
            f"the warm-up is capped at m: min(p - rank - 1, m) forwards (with m < p, here m = 2 on p = {p or 4} "
            "stages, the early stages have fewer micro-batches than p - rank - 1)"
        )
    if kind == "1f1b" and "input gradient" in msg and "never received" in msg:
        return (
            "a gradient sent back was never received: the stage before never ran that micro-batch's backward. "
            "After the steady state, the cool-down runs the backwards of the warm-up's micro-batches"
        )
    if "never received" in msg:
        return "a send without its matching recv: every forward and backward step of a micro-batch runs exactly once on every stage"
    if "never came" in msg or "deadlock" in msg:
        if kind == "1f1b":
            return (
                "the order deadlocks: a stage waits for a message its neighbour sends only later. Warm-up "
                "p - rank - 1 forwards, then the forward of micro-batch i + warm-up and the backward of i, "
                "then the cool-down's backwards"
            )
        if kind == "interleaved":
            return (
                "the order deadlocks: backwards run the chunks in reverse (the last chunk of a group first), "
                "and the warm-up is (p - rank - 1) * 2 + (v - 1) * p forwards (every forward when m == p)"
            )
        return "the order deadlocks: every micro-batch's forward on every stage before the backwards start"
    if "KeyError" in msg:
        return "a backward of a micro-batch before its forward (or after its activations were dropped)"
    return _stage_error_hint(msg)


def _order_hint(kind, got, want, p, m, rank, v):
    lead = next((i for i, s in enumerate(got) if s[0] == "B"), len(got))
    want_lead = next((i for i, s in enumerate(want) if s[0] == "B"), len(want))
    fs = sorted(mb for k, mb, _ in got if k == "F")
    if kind == "gpipe":
        if sorted(set(fs)) != list(range(m)) or len(fs) != m:
            return f"a forward for each of the m = {m} micro-batches, once: range(len(xs))"
        if got[:m] == want[:m] and [mb for _, mb, _ in got[m:]] == list(reversed(range(m))):
            return (
                "the backwards in reverse: GPipe (torch's ScheduleGPipe) runs them in the forwards' order, "
                "micro-batch 0 first (its gradient is the first to come back from the last stage)"
            )
        return "GPipe runs every micro-batch's forward first, then every backward (in the same order)"
    if kind == "1f1b":
        if lead == want_lead + 1 or (lead == want_lead - 1 and lead >= 0):
            return f"the warm-up on rank {rank} is p - rank - 1 = {p - rank - 1} forwards (then the steady state starts with one more)"
        if lead == p or lead == min(p - 1, m) + 1:
            return (
                "the warm-up depends on the stage: p - stage.index - 1 forwards, not the same on every rank"
            )
        if len(got) < len(want):
            return (
                "the cool-down: after the steady state, the backwards of the warm-up's micro-batches remain"
            )
        return "warm-up (p - rank - 1 forwards), steady state (forward i + warm-up, backward i), cool-down (the rest of the backwards)"
    chunks_b = [s for k, _, s in got if k == "B"]
    chunks_bw = [s for k, _, s in want if k == "B"]
    if chunks_b and chunks_b[0] != chunks_bw[0]:
        return "backwards run the chunks in REVERSE: the micro-batches' last chunk (highest stage) first"
    if m == p and want_lead == len(want) // 2 and lead != want_lead:
        return (
            f"when m == p (here {m}) Megatron's interleaved warm-up is every forward, v m = {want_lead}, "
            "on every rank: the steady state would have no forward left to pair"
        )
    if lead != want_lead:
        return f"the interleaved warm-up on rank {rank} is (p - rank - 1) * 2 + (v - 1) * p = {want_lead} forwards"
    return (
        "forwards in groups of p micro-batches, chunk by chunk: unit k is micro-batch (k // (p v)) p + k % p "
        "of chunk (k // p) % v"
    )


GPIPE = {4: (4,), 2: (6,)}
ONE_F_ONE_B = {4: (6, 2), 2: (4,)}  # m = 2 < p = 4: the warm-up capped at m
INTERLEAVED = {4: (4,), 2: (4,)}


def check_gpipe(gpipe: Callable, timeout: float = TIMEOUT) -> None:
    _check_schedule_everywhere("gpipe", gpipe, GPIPE, timeout)
    print(
        f"GPipe on 4 ranks (m = 4) and 2 (m = 6): every forward first, gradients equal to one process and to "
        f"torch's ScheduleGPipe (atol {ATOL:g}), m micro-batches' activations held, none after the step"
    )


def check_1f1b(one_f_one_b: Callable, timeout: float = TIMEOUT) -> None:
    _check_schedule_everywhere("1f1b", one_f_one_b, ONE_F_ONE_B, timeout)
    print(
        f"1F1B on 4 ranks (m = 6, and m = 2 < p) and 2 (m = 4): warm-up (capped at m), steady state, cool-down "
        f"in order, gradients equal to one process and to torch's Schedule1F1B (atol {ATOL:g}; m = 2: one process "
        "only, torch refuses m < p), at most min(m, p - rank) micro-batches held, each freed after its backward"
    )


def _as_ints(value):
    """A list of ints from a list, tuple, range or 1-D integer tensor; None for anything else."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point():
        value = value.tolist()
    if isinstance(value, (list, tuple, range)) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        return list(value)
    return None


def _as_units(value):
    """[(kind, micro-batch, chunk)] from any list / tuple of 3-item sequences; None otherwise."""
    if not isinstance(value, (list, tuple)):
        return None
    if not all(isinstance(u, (list, tuple)) and len(u) == 3 for u in value):
        return None
    return [tuple(u) for u in value]


def _shown(value):
    text = repr(value)
    return type(value).__name__ + (f" {text[:60]}" if value is not None else "")


def _check_schedule_everywhere(kind, schedule, configs, timeout, v=1):
    for p in (4, 2):
        results = _run(_schedule_rank, schedule, kind, configs, timeout, v, world_size=p)
        _not_implemented(results)
        _check_schedule(kind, results, p, configs, v)


def check_interleaved(
    chunk_indices: Callable, order: Callable, interleaved: Callable, timeout: float = TIMEOUT
) -> None:
    got = {}
    for p in (2, 4):
        for rank in range(p):
            got[p, rank] = _attempt(chunk_indices, p, 2, rank)
    if any(v == NOT_IMPLEMENTED for v in got.values()):
        raise NotImplementedError(NOT_IMPLEMENTED)
    for (p, rank), mine in got.items():
        want = pp_lab.chunk_indices(p, 2, rank)
        where = f"chunks of rank {rank} with p = {p}, v = 2"
        if isinstance(mine, str):
            _fail(f"{where}: {mine}", "see the error above")
        mine = _as_ints(mine)
        if mine is None:
            _fail(
                f"{where}: returned {type(got[p, rank]).__name__}",
                "return the list of this rank's stage indices (ints): [rank + k * p for k in range(v)]",
            )
        if mine != want:
            if mine == [rank * 2 + k for k in range(2)]:
                hint = "round-robin, not contiguous: rank r holds chunks r, r + p, ... (so a micro-batch visits every rank v times)"
            elif (
                isinstance(mine, list)
                and mine == [(c + 1) % (2 * p) for c in want]
                or mine == [c + 1 for c in want]
            ):
                hint = "the interleaved chunk assignment is off by one: rank r holds chunk r (0-based), then r + p"
            else:
                hint = "rank r holds chunks r + k p for k = 0 .. v - 1"
            _fail(f"chunks of rank {rank} with p = {p}, v = 2: {mine}, expected {want}", hint)
    for p in (2, 4):
        for m in (4, 8):
            for rank in range(p):
                mine = _attempt(order, p, 2, m, rank)
                if mine == NOT_IMPLEMENTED:
                    raise NotImplementedError(NOT_IMPLEMENTED)
                want = pp_lab.interleaved_order(p, 2, m, rank)
                if isinstance(mine, str):
                    _fail(f"the order, p = {p}, m = {m}, rank {rank}: {mine}", "see the error above")
                units = _as_units(mine)
                if units is None:
                    _fail(
                        f"the order, p = {p}, m = {m}, rank {rank}: returned {_shown(mine)}",
                        'return a list of ("F" or "B", micro-batch, chunk) tuples, chunk k in 0 .. v - 1',
                    )
                mine = units
                if mine != want:
                    stages = {rank + k * p for k in range(2)}
                    if (
                        sorted(mine) != sorted(want)
                        and {c for _, _, c in mine} <= stages
                        and rank + p in {c for _, _, c in mine}
                    ):
                        _fail(
                            f"the order, p = {p}, v = 2, m = {m}, rank {rank}: {_fmt(mine)}",
                            "the third item is the chunk k in 0 .. v - 1 (stages[k]), not the stage index rank + k p",
                        )
                    mine_s = [(k, mb, rank + c * p) for k, mb, c in mine]
                    want_s = [(k, mb, rank + c * p) for k, mb, c in want]
                    _fail(
                        f"the order, p = {p}, v = 2, m = {m}, rank {rank}: {_fmt(mine_s)}, expected {_fmt(want_s)}",
                        _order_hint("interleaved", mine_s, want_s, p, m, rank, 2),
                    )
    _check_schedule_everywhere("interleaved", interleaved, INTERLEAVED, timeout, v=2)
    print(
        f"interleaved 1F1B, v = 2: round-robin chunks, Megatron's order on 2 and 4 ranks, gradients equal to one "
        f"process and to torch's ScheduleInterleaved1F1B (atol {ATOL:g})"
    )


# ---------------------------------------------------------------- 9. the ZB-H1 order
ZB_H1 = [(4, 8), (2, 4), (3, 5), (4, 4), (2, 2), (4, 12)]  # (p, m): a steady state, m = p, m = 3p


def _as_pairs(value):
    """[(kind, micro-batch)] from a list / tuple of 2-item sequences (or Actions); None otherwise."""
    if not isinstance(value, (list, tuple)):
        return None
    out = []
    for u in value:
        if isinstance(u, pp_schedule.Action):
            u = (u.kind, u.microbatch)
        if not isinstance(u, (list, tuple)) or len(u) != 2:
            return None
        out.append(tuple(u))
    return out


def _zb_h1_hint(got, want, p, m, rank):
    """The hint for a wrong ZB-H1 order on `rank`: the first typical mistake it shows."""
    kinds = [k for k, _ in got]
    if "W" not in kinds:
        return (
            'split every backward: a "B" (the input\'s gradient, which the previous stage waits for) and a '
            '"W" (the weights\' gradient, which nobody waits for) per micro-batch'
        )
    for i, (kind, mb) in enumerate(got):
        if kind == "W" and ("B", mb) not in got[:i]:
            return (
                f"W({mb}) before its B({mb}): W needs the gradient of the stage's output, which B receives "
                f"from the next stage; a W runs after its own B"
            )

    def lead(order):  # the forwards before the first B: the warm-up, and the steady state's first F
        return next((i for i, (k, _) in enumerate(order) if k != "F"), len(order))

    if lead(got) != lead(want):
        return (
            f"the warm-up is 1F1B's: p - rank - 1 = {min(p - rank - 1, m)} forwards on rank {rank} (capped at m), "
            f"then the steady state's forward before the first B"
        )
    if sorted(got) != sorted(want):
        return f"one F, one B and one W for each of the m = {m} micro-batches, each once"
    eager = all(i > 0 and got[i - 1] == ("B", mb) for i, (k, mb) in enumerate(got) if k == "W")
    if rank > 0 and eager:
        return (
            f"W not deferred: with every W right after its own B, rank {rank} still idles in the cool-down "
            f"waiting for gradients. ZB-H1 defers rank r's W by r backwards (W(k) after B(k + r)); the r "
            f"W's left run after the last B, into what was the bubble"
        )
    if kinds[-m:] == ["W"] * m and rank < p - 1:
        return (
            "every W at the end: each micro-batch's activations then stay until its W (m of them, not p); "
            "ZB-H1 defers only r W's on rank r, so every rank holds at most p (1F1B's peak)"
        )
    return (
        "1F1B's warm-up, then per step forward(k + warm-up), B(k), and a W once rank r has r B's in hand "
        "(W(k - r) after B(k)); the r deferred W's after the last B"
    )


def check_zb_h1(order: Callable) -> None:
    """Exercise 9: order(p, m, rank), the ZB-H1 order on rank, against
    labkit.strategies.pp.schedule.order("zb-h1", ...) for every (p, m) of ZB_H1 and rank, each
    order's replay deadlock-free (it is then the same order)."""
    got = {(p, m, rank): _attempt(order, p, m, rank) for p, m in ZB_H1 for rank in range(p)}
    if any(v == NOT_IMPLEMENTED for v in got.values()):
        raise NotImplementedError(NOT_IMPLEMENTED)
    for (p, m, rank), mine in got.items():
        where = f"the ZB-H1 order, p = {p}, m = {m}, rank {rank}"
        if isinstance(mine, str):
            _fail(f"{where}: {mine}", "see the error above")
        pairs = _as_pairs(mine)
        if pairs is None:
            _fail(
                f"{where}: returned {_shown(mine)}",
                'return a list of ("F" | "B" | "W", micro-batch) tuples'
                + (": a function without `return` gives None" if mine is None else ""),
            )
        want = pp_lab.zb_h1_order(p, m, rank)
        if pairs != want:
            _fail(
                f"{where}: {' '.join(f'{k}{mb}' for k, mb in pairs)}\n    expected {' '.join(f'{k}{mb}' for k, mb in want)}",
                _zb_h1_hint(pairs, want, p, m, rank),
            )
    print(
        f"ZB-H1: your order is labkit's (and torch's ScheduleInterleavedZeroBubble's, one stage per rank) on every "
        f"rank of {len(ZB_H1)} pipelines, p = 2 to 4, m = p to 3p"
    )


# ---------------------------------------------------------------- 9. the backward in two halves
def _bw_stage() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A stage with a frozen weight (float64), its input (requires grad) and its output's gradient."""
    gen = torch.Generator().manual_seed(9)
    stage = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    with torch.no_grad():
        for p in stage.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    stage[0].bias.requires_grad_(False)
    inp = torch.randn(4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    return stage, inp, torch.randn(4, 3, generator=gen, dtype=torch.float64)


def _bw_hint(msg: str) -> str:
    if "backward through the graph a second time" in msg or "have already been freed" in msg:
        return "B freed the graph W needs: retain_graph=True in B keeps it (W runs the graph again)"
    if "does not require grad" in msg:
        return "W differentiates the parameters it is given (the trainable ones): inputs=params"
    return "see the error above"


def check_backward_split(backward_input: Callable, backward_weight: Callable) -> None:
    """Exercise 9: backward_input(out, grad, inp) -> inp's gradient, touching no weight's .grad and
    keeping the graph; backward_weight(out, grad, params) adds the weights' gradients to their
    .grad, leaving the input's alone. Together: one backward's gradients (float64, exact), on a
    stage with a frozen weight, twice (W accumulates, as backward does)."""
    stage, inp, grad = _bw_stage()
    params = [p for p in stage.parameters() if p.requires_grad]
    stage(inp).backward(grad)
    want_in = inp.grad.clone()
    want = [p.grad.clone() for p in params]
    stage.zero_grad(set_to_none=True)
    inp.grad = None
    for micro_batch in (1, 2):  # the second W adds to the first's .grad
        inp = inp.detach().clone().requires_grad_(True)  # each micro-batch's input its own tensor
        out = stage(inp)
        got = _attempt(backward_input, out, grad, inp)
        if got == NOT_IMPLEMENTED:
            raise NotImplementedError(NOT_IMPLEMENTED)
        where = f"my_backward_input(out, grad, inp), micro-batch {micro_batch}"
        if isinstance(got, str):
            _fail(f"{where}: {got}", _bw_hint(got))
        if not isinstance(got, torch.Tensor) or got.shape != inp.shape:
            _fail(
                f"{where} returned {_shown(got)}",
                f"return the input's gradient, a tensor of shape {tuple(inp.shape)}",
            )
        if not torch.allclose(got, want_in, rtol=0, atol=1e-12):
            _fail(f"{where}: the input's gradient is off by {float((got - want_in).abs().max()):.3g}",
                  "B is d(out . grad)/d(inp): torch.autograd.grad(out, inp, grad, retain_graph=True)")  # fmt: skip
        touched = [
            i
            for i, p in enumerate(params)
            if p.grad is not None and (micro_batch == 1 or not torch.equal(p.grad, want[i]))
        ]
        if touched:
            _fail(f"{where}: it changed {len(touched)} weight gradient(s)",
                  "B computes the input's gradient only (inputs=[inp], or torch.autograd.grad): the weights' are W's, later")  # fmt: skip
        in_before = None if inp.grad is None else inp.grad.clone()
        done = _attempt(backward_weight, out, grad, params)
        where = f"my_backward_weight(out, grad, params), micro-batch {micro_batch}"
        if done == NOT_IMPLEMENTED:
            raise NotImplementedError(NOT_IMPLEMENTED)
        if isinstance(done, str):
            _fail(f"{where}: {done}", _bw_hint(done))
        if any(p.grad is None for p in params):
            _fail(f"{where}: a weight's .grad is None",
                  "W adds the weights' gradients to their .grad, as backward does (torch.autograd.backward(out, grad, "
                  "inputs=params)); torch.autograd.grad would only return them")  # fmt: skip
        changed_in = (inp.grad is None) != (in_before is None) or (
            inp.grad is not None and not torch.equal(inp.grad, in_before)
        )
        if changed_in:
            _fail(f"{where}: the input's .grad changed",
                  "W computes the weights' gradients only (inputs=params): the input's was B's, already sent")  # fmt: skip
        for p, w in zip(params, want):
            if not torch.allclose(p.grad, micro_batch * w, rtol=0, atol=1e-12):
                ratio = float((p.grad * w).sum() / (w * w).sum())
                hint = ("W accumulates into .grad: micro-batches add up (backward's +=), it does not overwrite"
                        if micro_batch == 2 and abs(ratio - 1) < 1e-6 else
                        "W is d(out . grad)/d(weights): torch.autograd.backward(out, grad, inputs=params)")  # fmt: skip
                _fail(f"{where}: a weight's gradient is {ratio:.3f} x one backward's x {micro_batch}", hint)
    if stage[0].bias.grad is not None:
        _fail(
            "the frozen weight got a gradient",
            "W differentiates the parameters it is given (the trainable ones)",
        )
    print(
        "the backward in two: B's input gradient and W's weight gradients (accumulated over 2 micro-batches) are one backward's, exactly"
    )


# ---------------------------------------------------------------- 5. the layouts' formulas
def _formula_configs():
    from labkit.labs.pp_choice import REAL, TABLE, Config

    extra = {
        "13B on 16 GPUs, tp 2, pp 4": Config(13e9, 40, 5120, 16, 2**19, tp=2, pp=4),
        "3B on 32 GPUs, 4 per node, tp 2": Config(3e9, 24, 2560, 32, 2**18, tp=2, g=4),
    }
    return {**REAL, **TABLE, **extra}


def _rel_close(a, b):
    return isinstance(b, (int, float)) and not isinstance(b, bool) and abs(a - b) <= 1e-9 * max(abs(a), 1.0)


def _memory_hint(layout, got, c):
    from labkit.labs.pp_choice import memory_per_rank

    P, n, tp, pp = c.params, c.n, c.tp, c.pp
    dp = n // (tp * pp)
    if layout == "DDP":
        return "DDP replicates all the model states: 2 + 2 + 12 = 16 B per parameter"
    if layout == "FSDP" and _rel_close(16 * P, got):
        return "FSDP shards parameters, gradients and optimizer state over all n ranks: 16 P / n"
    if layout == "HSDP" and _rel_close(16 * P / n, got):
        return "HSDP shards inside the node only (g ranks) and replicates across nodes: 16 P / g"
    if layout in ("ZeRO-1 x TP x PP", "FSDP x TP") and _rel_close(
        memory_per_rank(layout, c) + (4 * P / (tp * pp) if layout == "ZeRO-1 x TP x PP" else 4 * P / n), got
    ):
        return (
            "the parameters and gradients counted in fp32 (4 + 4 B): in mixed precision they are bf16, "
            "2 + 2 B per parameter; the fp32 master copy is part of the optimizer's 12 B"
        )
    if layout == "ZeRO-1 x TP x PP":
        if _rel_close(16 * P / n, got):
            return (
                "ZeRO-1 shards only the optimizer state (12 B) over dp; the bf16 parameters and gradients "
                "(2 + 2 B) of the rank's TP x PP piece, P / (tp pp), stay whole"
            )
        if _rel_close(16 * P / (tp * pp), got):
            return "ZeRO-1 shards the optimizer state (12 B per parameter) over the dp = n / (tp pp) replicas"
        return f"4 B x P / (tp pp) + 12 B x P / (tp pp dp), dp = {dp}"
    if layout == "FSDP x TP":
        return "each rank's TP piece P / tp, all of its states sharded over dp = n / tp: 16 P / n"
    return "16 B per parameter, divided by what the layout shards it over"


def _comm_hint(layout, got, want, c):
    from labkit.labs.pp_choice import comm_per_rank

    ratio = got / want if want else float("inf")
    parts = comm_per_rank(layout, c)
    if abs(ratio - 2) < 1e-9:
        return (
            "twice the bytes: the collectives' tensors counted in fp32 (4 B); the parameters and gradients "
            "they carry are bf16, 2 B per element (the fp32 master and moments never travel)"
        )
    ring = {k: (k - 1) / k for k in (c.n, c.n // (c.tp * c.pp), c.n // c.tp)}
    for name, dp, calls, share in (
        ("FSDP x TP", c.n // c.tp, 3, 2 * c.params / c.tp),
        ("ZeRO-1 x TP x PP", c.n // (c.tp * c.pp), 2, 2 * c.params / (c.tp * c.pp)),
    ):
        if layout == name and dp != c.n:
            over_n = want + calls * (ring[c.n] - ring[dp]) * share
            if _rel_close(over_n, got):
                return (
                    f"the data-parallel collectives run over dp = n / (tp pp) = {dp} ranks, not over all n = {c.n}: "
                    f"(dp - 1) / dp of the rank's piece, not (n - 1) / n"
                )
    if layout == "DDP" and abs(ratio - 0.5) < 1e-9:
        return "a ring all-reduce sends 2(n-1)/n of the tensor per rank (a reduce-scatter AND an all-gather)"
    if layout == "FSDP" and abs(ratio - 2 / 3) < 1e-9:
        return "FSDP runs three collectives per step: the all-gather in forward, again in backward, and the reduce-scatter"
    if layout == "HSDP" and parts["inter"] and _rel_close(want - parts["inter"], got):
        return "HSDP also all-reduces each rank's shard (2P / g bytes) over the n / g nodes"
    if (
        layout in ("ZeRO-1 x TP x PP", "FSDP x TP")
        and parts["intra"]
        and _rel_close(want - parts["intra"], got)
    ):
        return "TP's 4 all-reduces per layer of the replica's activations (tokens / dp x d x 2 B), 2(tp-1)/tp each"
    if layout == "ZeRO-1 x TP x PP" and c.pp > 1:
        pp_bytes = 2 * c.tokens / (c.n // (c.tp * c.pp)) * c.d * 2 / c.tp
        if _rel_close(want - pp_bytes, got):
            return "PP sends each stage's output activation forward and its input's gradient back: 2 x tokens / dp x d / tp x 2 B"
        return "with PP each rank runs L / pp layers (TP's all-reduces), and holds P / (tp pp) parameters (the dp collectives)"
    return "see the layout's description above: each collective's bytes per rank, summed"


def check_formulas(memory: Callable, comm: Callable) -> None:
    from labkit.labs.pp_choice import LAYOUTS, memory_per_rank, total_comm

    configs = _formula_configs()
    tried = {
        (name, layout): (_attempt(memory, layout, c), _attempt(comm, layout, c))
        for name, c in configs.items()
        for layout in LAYOUTS
    }
    if all(NOT_IMPLEMENTED in v for v in tried.values()):
        raise NotImplementedError(NOT_IMPLEMENTED)
    for (name, layout), (mem, com) in tried.items():
        c = configs[name]
        for what, got, want, hint in (
            ("memory per rank", mem, memory_per_rank(layout, c), _memory_hint),
            ("bytes sent per rank per step", com, total_comm(layout, c), None),
        ):
            if got == NOT_IMPLEMENTED:
                raise NotImplementedError(NOT_IMPLEMENTED)
            if isinstance(got, str):
                _fail(f"{layout}, {name}: {what}: {got}", "see the error above")
            if not isinstance(got, (int, float)) or isinstance(got, bool):
                _fail(
                    f"{layout}, {name}: {what}: returned {_shown(got)}",
                    "return a number of bytes (an int or a float) for every layout"
                    + (": a function without `return` gives None" if got is None else ""),
                )
            if not _rel_close(want, got):
                why = hint(layout, got, c) if hint else _comm_hint(layout, got, want, c)
                _fail(f"{layout}, {name}: {what} {got:.4g} B, expected {want:.4g} B", why)
    print(
        f"memory and communication per rank: all {len(LAYOUTS)} layouts right on {len(configs)} configurations"
    )
