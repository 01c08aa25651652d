"""Checks for fsdp_lab's exercises 3 and 4, the learner's unit hooked into the module and into
autograd: the forward hooks (the block computing is gathered, the others not, each resharded
after its forward, the root kept) and the backward (re-gather, then one reduce-scatter (SUM) into
each shard's .grad), on the toy preset's hard cases. Same house style as fsdp_checks: the ranks
report what they saw, the kernel names rank, parameter, index, expected vs got, and a hint.

Left out: timing and overlap (noisy on 2 shared cores).
"""
import torch.distributed as dist

from labkit import loop
from labkit.checks import compare
from labkit.data import shard_batch
from labkit.labs.fsdp_checks import _bytes, _fail, _same, expected_shard
from labkit.labs.fsdp_lab import assign_params
from labkit.strategies.fsdp import plan_units


# ---------------------------------------------------------------- 3. forward hooks
FORWARD_CFG = loop.PRESETS["dp"]   # a 2-block TinyGPT, 7 rows: fast on 2 ranks


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
    for block in blocks:   # registered after the learner's hooks: they run after them
        block.register_forward_pre_hook(lambda m, a: seen["during"].append(_gathered(built)))
        block.register_forward_hook(lambda m, a, o: seen["after"].append(_gathered(built)))
    try:
        logits = model(x, y)[0]
    except (RuntimeError, IndexError) as exc:   # a module computing with its shards
        return {"error": str(exc).splitlines()[0]}
    seen["end"] = _gathered(built)
    seen["logits"], seen["want"] = logits.detach(), plain(x, y)[0].detach()
    return seen


def check_forward(unit_cls, world_size=2):
    """Exercise 3: the block being computed is gathered, the others are not, each block is
    resharded after its forward, the root stays gathered, and the logits are the unsharded model's."""
    import labkit
    results = labkit.run(forward_outputs, unit_cls, world_size=world_size)
    for rank, seen in enumerate(results):
        if "error" in seen:
            msg = seen["error"]
            shapes = any(w in msg for w in ("shape", "size", "index out of range"))
            hint = ("a block computed with its shards: pre_forward must unshard" if shapes and "storage" not in msg
                    else "the forward touched a freed storage: unshard must resize_ it back before copying"
                    if "storage" in msg else "")
            _fail(f"rank {rank}: the forward raised: {msg}", "", hint)
        for i, (during, after) in enumerate(zip(seen["during"], seen["after"])):
            if not during[i]:
                _fail(f"rank {rank}: block {i} computed with its weights not gathered", "",
                      "pre_forward must unshard the unit (self.unshard())")
            if any(during[j] for j in range(len(during) - 1) if j != i):
                _fail(f"rank {rank}: during block {i}'s forward other blocks are gathered: {during[:-1]}", "",
                      "reshard_after_forward: each block frees its full weights in post_forward")
            if after[i]:
                _fail(f"rank {rank}: block {i} still gathered after its forward", "",
                      "post_forward must reshard when self.reshard_after_forward")
        if not seen["end"][-1]:
            _fail(f"rank {rank}: the root was resharded by the end of the forward", "",
                  "the root keeps reshard_after_forward=False: its weights are needed again at once")
        report = compare(seen["want"], seen["logits"], rank=rank, names=["logits"], atol=1e-6)
        if not report.ok:
            _fail(f"rank {rank}: the logits differ from the unsharded model's", report.first_problem(),
                  "the gathered weights are wrong (exercise 2's check) or the module kept its shards")
    return True


# ---------------------------------------------------------------- 4. backward
BACKWARD_CFG = loop.PRESETS["toy"]   # frozen, tied across units, unused on step 0, called twice, 7 rows
BACKWARD_STEPS = (0, 1)              # step 0 leaves `extra` unused, step 1 uses it


def _names(model):
    by_id = {id(m): n for n, m in model.named_modules()}
    return lambda uses: f"{by_id[id(uses[0][0])]}.{uses[0][1]}".lstrip(".")


def backward_outputs(unit_cls):
    """Rank function: per step, each trainable shard's .grad after one forward + backward, and
    whether any unit was still gathered after the backward."""
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = BACKWARD_CFG
    model = loop.build_model(cfg)
    name_of = _names(model)
    _, built = wrap_units(model, unit_cls, cfg.units)
    shards = {name_of(uses): s for u in built for s, (_, uses) in zip(u.shards, u.slots) if s.requires_grad}
    out = []
    for step in BACKWARD_STEPS:
        for s in shards.values():
            s.grad = None
        x, y = loop.global_batch(cfg, step)
        mx, my = shard_batch(x, y, rank, n)
        try:
            (loop.summed_loss(model, cfg, mx, my, step) / y.numel()).backward()
        except RuntimeError as exc:
            return {"error": str(exc).splitlines()[0], "step": step}
        out.append({"grads": {k: None if s.grad is None else s.grad.detach().clone() for k, s in shards.items()},
                    "gathered": _gathered(built)})
    return {"steps": out}


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
        return (f"param.grad has the shard's shape {tuple(want.shape)}: reduce-scatter the padded "
                f"gradients and keep rank {rank}'s piece")
    if _same(got, want / n):
        return (f"1/{n} of the gradient: AVG where the loop SUMs (its loss is already divided by the "
                f"GLOBAL token count); reduce with op='sum'")
    if _same(got, want * n):
        return f"{n}x the gradient: the loss or the gradient was multiplied by the world size"
    if _same(got, local):
        return "this rank's own local gradient, not reduced: reduce-scatter it with the other ranks'"
    for k, other in others.items():
        if _same(got, other):
            return f"wrong shard index: rank {rank} got rank {k}'s piece; rank r keeps row r of the (N, ...) layout"
    return ""


def check_backward(unit_cls, world_size=2):
    """Exercise 4: after one backward every trainable shard's .grad is its piece of the
    reduce-scattered (SUM) gradient, on the toy's hard cases; every unit resharded."""
    import labkit
    results = labkit.run(backward_outputs, unit_cls, world_size=world_size)
    for rank, seen in enumerate(results):
        if "error" in seen:
            msg = seen["error"]
            hint = ("forgetting to refill storage: autograd saved the unsharded weights in forward and "
                    "reshard freed them; pre_backward must unshard (refill the SAME storage) before the "
                    "unit's backward" if "storage" in msg or "size 0" in msg or "numel" in msg else "")
            _fail(f"rank {rank}: the backward of step {seen['step']} raised: {msg}", "", hint)
        for step, got in zip(BACKWARD_STEPS, seen["steps"]):
            want_full = _global_grads(BACKWARD_CFG, step)
            local_full = _global_grads(BACKWARD_CFG, step, rank, world_size)
            for name, grad in got["grads"].items():
                if name not in want_full:
                    if grad is not None and grad.any():
                        _fail(f"rank {rank}, step {step}: '{name}' is unused this step but its shard got a gradient", "")
                    continue
                want = expected_shard(want_full[name], rank, world_size)
                if grad is None:
                    _fail(f"rank {rank}, step {step}: the shard of '{name}' has no .grad after backward", "",
                          "post-backward never reduce-scattered: count the unit's accumulated gradients "
                          "(register_post_accumulate_grad_hook) and reduce when all are in")
                report = compare(want, grad, names=[f"{name} (shard .grad)"], rank=rank, world_size=world_size)
                if not report.ok:
                    others = {k: expected_shard(want_full[name], k, world_size) for k in range(world_size) if k != rank}
                    _fail(f"rank {rank}, step {step}: wrong gradient shard", report.first_problem(),
                          _grad_hint(grad, want, expected_shard(local_full[name], rank, world_size),
                                     name, rank, world_size, others))
            if any(got["gathered"]):
                _fail(f"rank {rank}, step {step}: units still gathered after the backward: {got['gathered']}", "",
                      "reshard once the unit's gradients are reduce-scattered")
    return True
