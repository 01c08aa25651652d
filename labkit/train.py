"""Train the course's model with a hand-written strategy, on a laptop or a cluster.

    torchrun --nproc-per-node=N -m labkit.train --strategy {ddp,zero1,zero2,fsdp} [options]
    python -m labkit.train --world-size 2 --strategy fsdp          # labkit.run launches the ranks

The strategies are the labs' reference solutions (labkit.strategies), run by one loop: the same
model, global batches and loss normalisation for all four, so their results compare element-wise
with each other and with single-process training (`--check`). NCCL on GPUs, gloo on CPU.

`--out DIR` writes DIR/run.pt: per-rank traces (timeline), memory records, step times and losses.
A notebook draws it with the same functions as the labs:

    run = labkit.train.load_run("DIR/run.pt")
    labkit.plot_timeline(run["traces"]); labkit.plot_memory_timeline(run["memory"])

Left out: learning-rate schedules, evaluation, mixed precision, checkpoints (fsdp_lab has those).
"""
import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


def _model(config, seed, device):
    # The labs' builder: the same TinyGPT (and seed) as their single-process reference.
    from labkit.strategies.ddp_run import build_model
    return build_model("gpt", seed, config).to(device)


def _optimizer(params, lr):
    from labkit.models import make_optimizer
    from labkit.strategies.ddp_run import LAB_EPS
    return make_optimizer(params, lr=lr, eps=LAB_EPS)


def _wrap(strategy, model, lr, bucket_cap_mb):
    """(module to call, backward scale, step function, full-state function) for a strategy.

    The loss on each rank is (sum of its token losses) / (global token count): a SUM of the
    ranks' gradients is then the global-mean gradient. ZeRO and FSDP reduce with AVG, so their
    loss is scaled by world_size (exact for powers of two)."""
    from labkit.strategies.ddp import DDPBucketed
    from labkit.strategies.fsdp import fully_shard_by_hand
    from labkit.strategies.zero import ZeRO1, ZeRO2
    n = dist.get_world_size()
    state = lambda: {k: v.detach().clone() for k, v in model.state_dict().items()}  # noqa: E731
    if strategy == "ddp":
        ddp = DDPBucketed(model, bucket_cap_mb=bucket_cap_mb, op="sum")
        opt = _optimizer([p for p in model.parameters() if p.requires_grad], lr)

        def step():
            ddp.sync_gradients()
            opt.step()
        return model, 1, step, lambda: opt.zero_grad(set_to_none=True), state
    if strategy in ("zero1", "zero2"):
        zero = (ZeRO1 if strategy == "zero1" else ZeRO2)(model, lr=lr, eps=1e-6)
        return model, n, zero.step, zero.zero_grad, state
    if strategy == "fsdp":
        fsdp = fully_shard_by_hand(model, units="block", spans=True)
        opt = _optimizer(fsdp.parameters(), lr)
        return fsdp, n, opt.step, lambda: opt.zero_grad(set_to_none=True), fsdp.full_state_dict
    raise ValueError(f"--strategy must be one of {STRATEGIES}, got {strategy!r}")


def train_rank(strategy, steps=5, config=None, batch_size=8, lr=1e-2, seed=0,
               bucket_cap_mb=0.25, track_memory=False):
    """Rank function: returns {"losses", "step_s", "state"} (state: full, on CPU)."""
    import labkit
    from labkit.data import shard_batch
    from labkit.strategies.ddp_run import global_batch
    from labkit.tracing import span
    config = dict(config or {})
    device = labkit.device()
    rank, n = dist.get_rank(), dist.get_world_size()
    model = _model(config, seed, device)
    module, scale, step_fn, zero_grad, full_state = _wrap(strategy, model, lr, bucket_cap_mb)
    tracker = None
    if track_memory:
        from labkit.memory import MemoryTracker
        tracker = MemoryTracker(model=model)
    losses, step_s = [], []
    with tracker if tracker is not None else contextlib.nullcontext():
        for step in range(steps):
            x, y = global_batch(step, "gpt", batch_size, seed, config)
            x, y = (t.to(device) for t in shard_batch(x, y, rank, n))
            start = time.perf_counter()
            with span("step"):
                zero_grad()
                with span("forward"):
                    loss = module(x, y, reduction="sum")[1] / (batch_size * y.shape[1])
                with span("backward"):
                    (loss * scale).backward()
                with span("update"):
                    step_fn()
                local = loss.detach()
                dist.all_reduce(local)
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - start)
            losses.append(local.item())
    return {"losses": losses, "step_s": step_s,
            "state": {k: v.cpu() for k, v in full_state().items()}}


def reference(steps=5, config=None, batch_size=8, lr=1e-2, seed=0):
    """Single-process training on the whole global batch: what every strategy must reproduce
    (the labs' own reference, on this configuration)."""
    from labkit.strategies.ddp_run import train_reference
    losses, state, _ = train_reference(steps, batch_size=batch_size, lr=lr, seed=seed,
                                       gpt_config=dict(config or {}))
    return losses, state


def load_run(path):
    """A run written by `--out`: {"args", "traces", "memory", "step_s", "losses"}."""
    return torch.load(path, weights_only=False)


def _parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m labkit.train", description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", choices=STRATEGIES, default="fsdp")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--bucket-cap-mb", type=float, default=0.25)
    ap.add_argument("--world-size", type=int, default=2, help="without torchrun: ranks to launch")
    ap.add_argument("--memory", action="store_true", help="record per-rank memory (slower)")
    ap.add_argument("--check", action="store_true",
                    help="compare with single-process training element-wise (exit 1 on mismatch)")
    ap.add_argument("--out", help="directory for run.pt (traces, memory, step times)")
    return ap.parse_args(argv)


def main(argv=None):
    import labkit
    from labkit.checks import compare
    a = _parse(argv)
    config = dict(seq_len=a.seq_len, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads)
    results = labkit.run(train_rank, a.strategy, a.steps, config, a.batch_size, a.lr,
                         world_size=a.world_size, timeout=600, bucket_cap_mb=a.bucket_cap_mb,
                         track_memory=a.memory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        return 0
    first = results[0]
    med = statistics.median(first["step_s"][1:] or first["step_s"])
    print(f"{a.strategy}: {results.world_size} ranks ({results.backend}), {a.steps} steps, "
          f"median step {med * 1e3:.1f} ms, losses " + " ".join(f"{x:.4f}" for x in first["losses"]))
    ok = True
    if a.check:
        ref_losses, ref_state = reference(a.steps, config, a.batch_size, a.lr)
        # Looser than the labs' 1e-7: on this larger default model a few weights whose gradient
        # is rounding noise (~1e-9) get Adam-normalised into 1e-6 differences, whichever
        # strategy sums the ranks' gradients (the labs pick a configuration where that is ~1e-7).
        report = compare(ref_state, first["state"], rtol=1e-5, atol=1e-5,
                         label=f"{a.strategy} vs single-process")
        print(report)
        ok = report.ok
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        torch.save({"args": vars(a), "traces": results.traces, "memory": results.memory,
                    "step_s": [r["step_s"] for r in results],
                    "losses": first["losses"], "state": first["state"]},
                   os.path.join(a.out, "run.pt"))
        print(f"wrote {os.path.join(a.out, 'run.pt')}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
