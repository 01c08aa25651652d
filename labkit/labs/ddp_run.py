"""One training loop for every DDP stage, and the single-process run it must reproduce.

    results = labkit.run(train_ddp, DDPBucketed, steps=5, world_size=2,
                         strategy_kwargs=dict(bucket_cap_mb=0.05))
    losses, state, grads = train_reference(steps=5)          # same model, same global batches
    check_close(state, results[0]["state"], rank=0)

Both sides build the model with `build_model(...)`, draw the GLOBAL batch of step s with
`global_batch(...)`, and normalise the loss by the global number of tokens (elements for the toy
model): rank r sums the loss over its shard and divides by the global count, so the SUM of the
ranks' gradients is exactly the gradient of the global-batch mean, even with uneven shards or K
micro-batches per rank.

What it leaves out: learning-rate schedules, gradient clipping, evaluation, checkpoints.
"""
import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from labkit.observe import tracing
from labkit.data import get_batch, micro_batches, shard_batch
from labkit.models import GPTConfig, TinyGPT, ToyModel, make_optimizer, toy_batch, toy_loss
from labkit.models import train_single_process

LAB_GPT = dict(seq_len=32, d_model=32, n_heads=4, n_layers=2)   # small enough for 2 CPU cores
# AdamW's eps for the equivalence checks. The attention's key bias has a gradient that is zero in
# exact arithmetic (softmax ignores a constant added to a whole row of scores), so in fp32 it is
# rounding noise (~1e-12) whose value depends on how the batch was split. With eps=1e-8 AdamW
# divides that noise by its own RMS and turns it into updates of ~1e-3 lr: after 5 steps the key
# bias differs by ~4e-6 from single-process training (torch's DDP too). eps=1e-6 damps it: max
# diff ~1e-7 on a weight of size ~1.
LAB_EPS = 1e-6


def build_model(model="gpt", seed=0, gpt_config=None):
    """TinyGPT (tied embedding / LM head) or ToyModel (frozen, sometimes-unused, odd sizes)."""
    if model == "toy":
        return ToyModel(seed=seed)
    return TinyGPT(GPTConfig(**{**LAB_GPT, **(gpt_config or {})}), seed=seed)


def global_batch(step, model="gpt", batch_size=8, seed=0, gpt_config=None):
    """The whole batch of `step`, identical on every rank and in the reference."""
    if model == "toy":
        return toy_batch(step, batch_size, seed=seed)
    seq_len = {**LAB_GPT, **(gpt_config or {})}["seq_len"]
    return get_batch(step, batch_size, seq_len, seed=seed)


def summed_loss(net, batch, model="gpt", use_extra=False):
    """Sum (not mean) of the token / element losses of `batch`, and how many terms it summed."""
    x, y = batch
    if model == "toy":
        return toy_loss(net, batch, use_extra=use_extra, reduction="sum"), y.numel()
    return net(x, y, reduction="sum")[1], y.numel()


def _extra(use_extra, step):
    """Toy model only: use its `extra` layer in this step? (a bool, a per-step list, or a callable)"""
    if callable(use_extra):
        return bool(use_extra(step))
    return bool(use_extra[step]) if isinstance(use_extra, (list, tuple)) else bool(use_extra)


def train_reference(steps=5, *, model="gpt", batch_size=8, lr=1e-2, seed=0, gpt_config=None,
                    use_extra=False, eps=LAB_EPS):
    """Single-process training on the whole global batch: (losses, state_dict, first-step grads).

    The grads (of step 0, before the optimizer moves anything) are what catches SUM-vs-AVG:
    AdamW divides by sqrt(v), so a gradient N times too large moves the weights almost the same."""
    def batches(step):   # the flag rides with the batch: train_single_process passes only that
        return (*global_batch(step, model, batch_size, seed, gpt_config), _extra(use_extra, step))

    def loss_fn(net, batch):
        loss, count = summed_loss(net, batch[:2], model, batch[2])
        return loss / count

    net = build_model(model, seed, gpt_config)
    loss_fn(net, batches(0)).backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net = build_model(model, seed, gpt_config)
    optimizer = make_optimizer([p for p in net.parameters() if p.requires_grad], lr, eps=eps)
    losses, state = train_single_process(net, batches, steps, loss_fn=loss_fn, optimizer=optimizer)
    return losses, state, grads


def _make_strategy(strategy, net, kwargs):
    if isinstance(strategy, str):
        from labkit.strategies import ddp
        strategy = {"naive": ddp.DDPNaive, "flat": ddp.DDPFlat, "bucketed": ddp.DDPBucketed,
                    "torch": ddp.TorchDDP}[strategy]
    return strategy(net, **kwargs)


def train_ddp(strategy="bucketed", steps=5, *, model="gpt", batch_size=8, lr=1e-2, seed=0,
              gpt_config=None, accum_steps=1, use_extra=False, strategy_kwargs=None,
              shard=True, loss_scale=None, eps=LAB_EPS):
    """Rank function: train with `strategy` (a class, or 'naive' / 'flat' / 'bucketed' /
    'torch') for `steps` steps of `accum_steps` micro-batches each.

    Each rank builds the model with seed + rank (as if each process initialised on its own), so
    forgetting the start-up broadcast shows. shard=False (every rank trains on the whole batch)
    and loss_scale (multiplies the loss) exist to reproduce the lab's classic mistakes.
    Returns {"losses": this rank's share of each step's global mean loss (sum over ranks = the
    loss), "state": state_dict after training, "grads": synced grads of step 0, "step_s": wall
    time per step, "median_step_s": median after the first step, "buckets": bucket count}.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    net = build_model(model, seed + rank, gpt_config)
    ddp = _make_strategy(strategy, net, dict(strategy_kwargs or {}))
    forward_net = getattr(ddp, "model", net)   # torch's DDP: forward through its wrapper
    # torch's DDP averages; our loss convention needs SUM: multiply by N (exact for N = 2, 4).
    scale = loss_scale if loss_scale is not None else (
        world_size if getattr(ddp, "op", "sum") == "avg" else 1)
    optimizer = make_optimizer([p for p in net.parameters() if p.requires_grad], lr, eps=eps)
    no_sync = getattr(ddp, "no_sync", contextlib.nullcontext)
    losses, step_s, grads = [], [], None
    for step in range(steps):
        x, y = global_batch(step, model, batch_size, seed, gpt_config)
        mine = shard_batch(x, y, rank, world_size) if shard else (x, y)
        extra = _extra(use_extra, step)
        start = time.perf_counter()
        with tracing.span("step"):
            optimizer.zero_grad(set_to_none=True)
            parts = micro_batches(*mine, accum_steps) if accum_steps > 1 else [mine]
            step_loss = 0.0
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                with (contextlib.nullcontext() if last else no_sync()):
                    with tracing.span("forward"):
                        loss, _ = summed_loss(forward_net, part, model, extra)
                        loss = loss / y.numel()        # the GLOBAL count: exact for any shards
                    with tracing.span("backward"):
                        (loss * scale).backward()
                step_loss += loss.item()
            with tracing.span("sync"):
                ddp.sync_gradients()
            if step == 0:
                grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
            with tracing.span("optimizer"):
                optimizer.step()
        step_s.append(time.perf_counter() - start)
        losses.append(step_loss)
    hooks = getattr(ddp, "remove_hooks", None)
    if hooks:
        hooks()
    return {"losses": losses, "grads": grads, "step_s": step_s,
            "median_step_s": statistics.median(step_s[1:] or step_s),
            "buckets": len(getattr(ddp, "buckets", [])) or None,
            "state": {n: t.detach().clone() for n, t in net.state_dict().items()}}


def global_losses(results):
    """Per-step global mean loss: the sum of the ranks' shares."""
    return [sum(parts) for parts in zip(*(r["losses"] for r in results))]
