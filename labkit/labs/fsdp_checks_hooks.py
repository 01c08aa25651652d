"""Checks for fsdp_lab's exercises 3 and 4, the learner's unit hooked into the module and into
autograd: the forward hooks (the block computing is gathered, the others not, each resharded
after its forward, the root kept) and the backward (re-gather, then one reduce-scatter (SUM) into
each shard's .grad), on the toy preset's hard cases. Same house style as fsdp_checks: the ranks
report what they saw, the kernel names rank, parameter, index, expected vs got, and a hint.

Left out: timing and overlap (noisy on 2 shared cores).
"""

import torch
import torch.distributed as dist

from labkit import loop
from labkit.checks import compare
from labkit.data import shard_batch
from labkit.labs.fsdp_checks import _bytes, _fail, _same, expected_shard, run_ranks
from labkit.labs.fsdp_lab import assign_params
from labkit.strategies.fsdp import plan_units


# ---------------------------------------------------------------- 3. forward hooks
FORWARD_CFG = loop.PRESETS["dp"]  # a 2-block TinyGPT, 7 rows: fast on 2 ranks


def wrap_units(model, unit_cls, units="block"):
    """The learner's units on `model` as MyFSDP builds them: inner units first, the root last
    (kept gathered from its forward to its backward, as fully_shard does for the root)."""
    modules = plan_units(model, units)
    built = [unit_cls(slots) for slots in assign_params(model, modules)]
    for unit, module in zip(built, modules + [model]):
        unit.reshard_after_forward = module is not model
        unit.hook(module)
    return modules, built


def _gathered(built):
    return [_bytes(u.unsharded) > 0 for u in built]


def forward_outputs(unit_cls):
    """Rank function: the learner's hooked units through one forward; which units were
    gathered during and after each block's forward, and the logits."""
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = FORWARD_CFG
    model, plain = loop.build_model(cfg), loop.build_model(cfg)
    x, y = shard_batch(*loop.global_batch(cfg, 0), rank, n)
    blocks, built = wrap_units(model, unit_cls)
    seen = {"during": [], "after": []}
    for block in blocks:  # registered after the learner's hooks: they run after them
        block.register_forward_pre_hook(lambda m, a: seen["during"].append(_gathered(built)))
        block.register_forward_hook(lambda m, a, o: seen["after"].append(_gathered(built)))
    try:
        logits = model(x, y)[0]
    except (RuntimeError, IndexError, TypeError) as exc:  # computing with shards; hooks swapped
        return {"error": str(exc).splitlines()[0]}
    seen["end"] = _gathered(built)
    seen["logits"], seen["want"] = logits.detach(), plain(x, y)[0].detach()
    return seen


def check_forward(unit_cls, world_size=2):
    """Exercise 3: the block being computed is gathered, the others are not, each block is
    resharded after its forward, the root stays gathered, and the logits are the unsharded model's."""
    results = run_ranks("HookedUnit's forward", forward_outputs, unit_cls, world_size=world_size)
    for rank, seen in enumerate(results):
        if "error" in seen:
            msg = seen["error"]
            shapes = any(w in msg for w in ("shape", "size", "index out of range"))
            swapped = "positional argument" in msg and ("pre_forward" in msg or "post_forward" in msg)
            hint = (
                "the hook kinds are swapped: torch calls a forward PRE-hook with (module, args) and "
                "a forward hook with (module, args, output): register_forward_pre_hook("
                "self.pre_forward), register_forward_hook(self.post_forward)"
                if swapped
                else "a block computed with its shards: pre_forward must unshard"
                if shapes and "storage" not in msg
                else "the forward touched a freed storage: unshard must resize_ it back before copying"
                if "storage" in msg
                else ""
            )
            _fail(f"rank {rank}: the forward raised: {msg}", "", hint)
        for i, (during, after) in enumerate(zip(seen["during"], seen["after"])):
            if not during[i]:
                _fail(
                    f"rank {rank}: block {i} computed with its weights not gathered",
                    "",
                    "pre_forward must unshard the unit (self.unshard())",
                )
            if any(during[j] for j in range(len(during) - 1) if j != i):
                _fail(
                    f"rank {rank}: during block {i}'s forward other blocks are gathered: {during[:-1]}",
                    "",
                    "reshard_after_forward: each block frees its full weights in post_forward",
                )
            if after[i]:
                _fail(
                    f"rank {rank}: block {i} still gathered after its forward",
                    "",
                    "post_forward must reshard when self.reshard_after_forward",
                )
        if not seen["end"][-1]:
            _fail(
                f"rank {rank}: the root was resharded by the end of the forward",
                "",
                "the root keeps reshard_after_forward=False: its weights are needed again at once",
            )
        report = compare(seen["want"], seen["logits"], rank=rank, names=["logits"], atol=1e-6)
        if not report.ok:
            _fail(
                f"rank {rank}: the logits differ from the unsharded model's",
                report.first_problem(),
                "the gathered weights are wrong (exercise 2's check) or the module kept its shards",
            )
    return True


# ---------------------------------------------------------------- 4. backward
BACKWARD_CFG = loop.PRESETS["toy"]  # frozen, tied across units, unused on step 0, called twice, 7 rows
BACKWARD_STEPS = (0, 1)  # step 0 leaves `extra` unused, step 1 uses it


def _names(model):
    by_id = {id(m): n for n, m in model.named_modules()}
    return lambda uses: f"{by_id[id(uses[0][0])]}.{uses[0][1]}".lstrip(".")


GPT_CFG = FORWARD_CFG  # TinyGPT blocks: a block's first gradient arrives while its backward
# still needs the block's other weights (the toy's one-Linear units hide it)
ACCUMULATE = BACKWARD_STEPS  # two micro-batches, two backwards, one step: .grad holds their sum


def _one_backward(model, cfg, step, rank, n):
    x, y = loop.global_batch(cfg, step)
    mx, my = shard_batch(x, y, rank, n)
    (loop.summed_loss(model, cfg, mx, my, step) / y.numel()).backward()


def _shard_grads(shards):
    return {k: None if s.grad is None else s.grad.detach().clone() for k, s in shards.items()}


def _wrapped(cfg, unit_cls):
    model = loop.build_model(cfg)
    name_of = _names(model)
    _, built = wrap_units(model, unit_cls, cfg.units)
    shards = {name_of(uses): s for u in built for s, (_, uses) in zip(u.shards, u.slots) if s.requires_grad}
    layout = [  # each unit's parameters in order: (name, shard shape, full shape), frozen ones too
        [
            (name_of(uses), tuple(s.shape), tuple(f.shape))
            for s, (_, uses), f in zip(u.shards, u.slots, u.unsharded)
        ]
        for u in built
    ]
    return model, built, shards, layout


def per_parameter_layout(layout, want_full, rank, n):
    """The shards a reduce-scatter gives when each unit's input is laid out per parameter (every
    padded gradient flattened whole, one after another) instead of as (N, shard) rows: rank r
    receives the r-th 1/N of that concatenation, cut into the shards' sizes."""
    out = {}
    for unit in layout:
        flat = []
        for name, shard_shape, full_shape in unit:
            g = want_full.get(name)
            padded = torch.zeros((shard_shape[0] * n, *full_shape[1:]))
            if g is not None and tuple(g.shape) == full_shape:
                padded[: full_shape[0]] = g
            flat.append(padded.reshape(-1))
        piece, offset = torch.cat(flat).view(n, -1)[rank], 0
        for name, shard_shape, _ in unit:
            size = torch.Size(shard_shape).numel()
            out[name] = piece[offset : offset + size].view(shard_shape)
            offset += size
    return out


def _watch_reshard(built, kept, late):
    """Record, after each call of a unit's reduce_grads, whether the unit is still gathered (the
    text: reduce-scatter, THEN reshard; the end-of-backward callback would hide a missing one);
    and in `late`, for each reduce that the end-of-backward callback made although every trainable
    gradient of the unit had arrived (post_accumulate's count missed), self.ready minus the number
    of trainable parameters (right values, but the unit stayed gathered to the end)."""
    for unit in built:
        reduce, end, state = unit.reduce_grads, unit.end_of_backward, {"ending": False}

        def watched(*args, _reduce=reduce, _unit=unit, _state=state, **kwargs):
            trainable = [f for f in _unit.unsharded if f.requires_grad]
            if _state["ending"] and trainable and all(f.grad is not None for f in trainable):
                ready = getattr(_unit, "ready", None)
                late.append(ready - len(trainable) if isinstance(ready, int) else None)
            value = _reduce(*args, **kwargs)
            kept.append(_bytes(_unit.unsharded) > 0)
            return value

        def ended(*args, _end=end, _state=state, **kwargs):
            _state["ending"] = True
            try:
                return _end(*args, **kwargs)
            finally:
                _state["ending"] = False

        unit.reduce_grads, unit.end_of_backward = watched, ended


def backward_outputs(unit_cls):
    """Rank function, in the order the kernel judges: the toy, per step, each trainable shard's
    .grad after one forward + backward and whether any unit was still gathered; then TinyGPT's
    step 0; then the toy's two micro-batches accumulated before a step. Stops at the first
    backward that raises (its case and message)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model, built, shards, layout = _wrapped(BACKWARD_CFG, unit_cls)
    out = {"steps": [], "layout": layout, "kept": [], "late": []}
    _watch_reshard(built, out["kept"], out["late"])
    case = "toy"
    try:
        for step in BACKWARD_STEPS:
            case = f"step {step}"
            for s in shards.values():
                s.grad = None
            _one_backward(model, BACKWARD_CFG, step, rank, n)
            out["steps"].append({"grads": _shard_grads(shards), "gathered": _gathered(built)})
        case = "TinyGPT"
        gpt, gpt_built, gpt_shards, out["gpt_layout"] = _wrapped(GPT_CFG, unit_cls)
        _watch_reshard(gpt_built, out["kept"], out["late"])
        _one_backward(gpt, GPT_CFG, 0, rank, n)
        out["gpt"] = {"grads": _shard_grads(gpt_shards), "gathered": _gathered(gpt_built)}
        case = "two micro-batches"
        for s in shards.values():
            s.grad = None
        for step in ACCUMULATE:
            _one_backward(model, BACKWARD_CFG, step, rank, n)
        out["accumulated"] = {"grads": _shard_grads(shards), "gathered": _gathered(built)}
    except RuntimeError as exc:
        out.update(error=str(exc).splitlines()[0], case=case)
    return out


def _global_grads(cfg, step, rank=None, world_size=1):
    """{name: grad} of the whole batch (the loop's convention), or of `rank`'s rows alone."""
    model = loop.build_model(cfg)
    x, y = loop.global_batch(cfg, step)
    count = y.numel()
    if rank is not None:
        x, y = shard_batch(x, y, rank, world_size)
    (loop.summed_loss(model, cfg, x, y, step) / count).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _grad_hint(got, want, local, name, rank, n, others):
    if got.shape != want.shape:
        return (
            f"param.grad has the shard's shape {tuple(want.shape)}: reduce-scatter the padded "
            f"gradients and keep rank {rank}'s piece"
        )
    if _same(got, want / n):
        return (
            f"1/{n} of the gradient: AVG where the loop SUMs (its loss is already divided by the "
            f"GLOBAL token count); reduce with op='sum'"
        )
    if _same(got, want * n):
        return f"{n}x the gradient: the loss or the gradient was multiplied by the world size"
    if _same(got, local):
        return "this rank's own local gradient, not reduced: reduce-scatter it with the other ranks'"
    for k, other in others.items():
        if _same(got, other):
            return f"wrong shard index: rank {rank} got rank {k}'s piece; rank r keeps row r of the (N, ...) layout"
    return ""


INPLACE_HINT = (
    "unshard wrote into the unsharded nn.Parameter itself (full.copy_): that bumps the "
    "version autograd saved in forward; copy through full.data (full.data.copy_(...)), "
    "which autograd does not track"
)


def _error_hint(msg, case):
    if "modified by an inplace operation" in msg or "leaf Variable" in msg:
        return INPLACE_HINT
    if not any(w in msg for w in ("storage", "size 0", "numel")):
        return ""
    if case == "TinyGPT":  # the toy's backward passed: the weights were refilled, then freed early
        return (
            "the unit resharded before its backward was done: a block's first gradients arrive "
            "while its backward still needs the block's other weights; reduce-scatter and reshard "
            "only when ALL the unit's trainable gradients are in (count them in post_accumulate)"
        )
    return (
        "forgetting to refill storage: autograd saved the unsharded weights in forward and "
        "reshard freed them; pre_backward must unshard (refill the SAME storage) before the "
        "unit's backward"
    )


def _judge(rank, world_size, label, got, want_full, local_full, earlier=None, layout=None):
    """One backward's shard gradients vs the whole batch's (want_full), as the learner's units
    should have left them; earlier: ("alone", the last micro-batch's gradients) when accumulating,
    ("before", the previous backward's) otherwise (a .grad left on the unsharded parameter adds them);
    layout: the units' parameters (per_parameter_layout names a flat, per-parameter input)."""
    flat = per_parameter_layout(layout, want_full, rank, world_size) if layout else {}
    kind, grads = earlier or (None, {})
    last_alone, before = (grads if kind == "alone" else None), (grads if kind == "before" else None)
    for name, grad in got["grads"].items():
        if name not in want_full:
            if grad is not None and grad.any():
                _fail(f"rank {rank}, {label}: '{name}' is unused but its shard got a gradient", "")
            continue
        want = expected_shard(want_full[name], rank, world_size)
        if grad is None:
            _fail(
                f"rank {rank}, {label}: the shard of '{name}' has no .grad after backward",
                "",
                "post-backward never reduce-scattered: count the unit's accumulated gradients "
                "(register_post_accumulate_grad_hook) and reduce when all are in",
            )
        report = compare(want, grad, names=[f"{name} (shard .grad)"], rank=rank, world_size=world_size)
        if not report.ok:
            if (
                last_alone is not None
                and name in last_alone
                and _same(grad, expected_shard(last_alone[name], rank, world_size))
            ):
                hint = (
                    "the shard's .grad holds the last backward's piece only: it was overwritten "
                    "(shard.grad = piece); add to a .grad a micro-batch already left "
                    "(shard.grad += piece, or the piece itself if .grad is None)"
                )
            elif (
                before
                and name in before
                and _same(grad, expected_shard(want_full[name] + before[name], rank, world_size))
            ):
                hint = (
                    "this shard got the sum of this backward's gradient and the previous one's: the "
                    "unsharded parameter kept its .grad after the reduce-scatter, and autograd ADDS "
                    "the next backward's gradient to it; set full.grad = None once reduced"
                )
            elif name in flat and _same(grad, flat[name]):
                hint = (
                    "the reduce-scatter's input is laid out per parameter (each padded gradient "
                    "flattened whole, one after another), so rank r receives a slice of the first "
                    "parameters instead of row r of each. Lay it out as (N, shard) rows: view each "
                    "padded gradient as (N, -1), torch.cat(parts, dim=1), then reduce-scatter"
                )
            else:
                others = {
                    k: expected_shard(want_full[name], k, world_size) for k in range(world_size) if k != rank
                }
                hint = _grad_hint(
                    grad,
                    want,
                    expected_shard(local_full[name], rank, world_size),
                    name,
                    rank,
                    world_size,
                    others,
                )
            _fail(f"rank {rank}, {label}: wrong gradient shard", report.first_problem(), hint)
    if any(got["gathered"]):
        _fail(
            f"rank {rank}, {label}: units still gathered after the backward: {got['gathered']}",
            "",
            "reshard once the unit's gradients are reduce-scattered",
        )


def _summed(*grad_dicts):
    out = {}
    for grads in grad_dicts:
        for k, g in grads.items():
            out[k] = out[k] + g if k in out else g.clone()
    return out


def check_backward(unit_cls, world_size=2):
    """Exercise 4: after one backward every trainable shard's .grad is its piece of the
    reduce-scattered (SUM) gradient, on the toy's hard cases and on TinyGPT's blocks; two
    backwards before a step leave the sum of both; every unit resharded."""
    results = run_ranks("TrainingUnit's backward", backward_outputs, unit_cls, world_size=world_size)
    wants = {step: _global_grads(BACKWARD_CFG, step) for step in BACKWARD_STEPS}
    for rank, seen in enumerate(results):
        locals_ = {step: _global_grads(BACKWARD_CFG, step, rank, world_size) for step in BACKWARD_STEPS}
        for i, (step, got) in enumerate(zip(BACKWARD_STEPS, seen["steps"])):
            before = wants[BACKWARD_STEPS[i - 1]] if i else None
            _judge(
                rank,
                world_size,
                f"step {step}",
                got,
                wants[step],
                locals_[step],
                layout=seen["layout"],
                earlier=("before", before) if before else None,
            )
        if "error" in seen:
            msg, case = seen["error"], seen["case"]
            _fail(f"rank {rank}: the backward ({case}) raised: {msg}", "", _error_hint(msg, case))
        if any(seen["kept"]):
            _fail(
                f"rank {rank}: a unit was still gathered after its reduce_grads "
                f"({sum(seen['kept'])} of {len(seen['kept'])} calls)",
                "",
                "reshard right after the reduce-scatter (self.reshard() at the end of reduce_grads): "
                "otherwise every unit's full weights stay until the whole backward ends",
            )
        if seen["late"]:
            extra = seen["late"][0]
            _fail(
                f"rank {rank}: {len(seen['late'])} reduce_grads calls came from the end-of-backward "
                "callback although all of the unit's trainable gradients had arrived (right values, "
                "but each such unit stayed gathered, its full gradients held, until the backward ended)",
                "",
                "self.ready is never reset: set self.ready = 0 in reduce_grads, or the next backward's "
                "count runs past len(self.trainable) without ever equalling it"
                if extra is not None and extra > 0
                else "post_accumulate counts to the wrong total: only the TRAINABLE parameters "
                "accumulate a gradient (a frozen one never does): reduce when self.ready == "
                "len(self.trainable)"
                if extra == 0
                else "post_accumulate must call reduce_grads once all the unit's trainable gradients are in",
            )
        _judge(
            rank,
            world_size,
            "TinyGPT, step 0",
            seen["gpt"],
            _global_grads(GPT_CFG, 0),
            _global_grads(GPT_CFG, 0, rank, world_size),
            layout=seen["gpt_layout"],
        )
        _judge(
            rank,
            world_size,
            f"steps {ACCUMULATE} accumulated before one step",
            seen["accumulated"],
            _summed(*(wants[s] for s in ACCUMULATE)),
            _summed(*(locals_[s] for s in ACCUMULATE)),
            earlier=("alone", wants[ACCUMULATE[-1]]),
            layout=seen["layout"],
        )
    return True
