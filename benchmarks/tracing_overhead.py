"""What recording a timeline costs: a hand-written-DDP training step with and without labkit.observe.tracing.

    .venv/bin/python benchmarks/tracing_overhead.py [--steps 40] [--world-size 2] [--json]

Each rank runs a TinyGPT step (labkit.models; a small MLP if that module is missing) the way the
labs do: spans for forward / backward / optimizer and one synchronous all_reduce per parameter
tensor, the recorder's worst case (many small collectives per step). Traced and untraced steps
alternate within one run (untraced = inside recording.paused(), which also removes the
torch.distributed patches) and the ratio of median step times is printed. Target: <= 1.10.

Left out: GPU runs (NCCL, where steps are shorter and the ratio could be higher), the cost of
plotting, and the launch itself. On a shared 2-core machine step times are noisy: compare the
medians, not single steps.
"""

import argparse
import json
import statistics
import time


def _model_and_batch():
    import torch

    try:
        from labkit.models import GPTConfig, TinyGPT

        model = TinyGPT(GPTConfig(), seed=0)
        x = torch.randint(0, model.config.vocab_size, (8, model.config.seq_len))
        return model, lambda: model(x, x)[1], "TinyGPT"
    except ImportError:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        x = torch.randn(32, 256)
        return model, lambda: model(x).square().mean(), "MLP 8x256"


SPANS_PER_STEP = 4  # step, forward, backward, optimizer


def _step(model, loss_fn, optimizer, world_size):
    import torch.distributed as dist
    from labkit.observe import tracing

    with tracing.span("step"):
        with tracing.span("forward"):
            loss = loss_fn()
        with tracing.span("backward"):
            loss.backward()
        for p in model.parameters():  # one collective per tensor: many events per step
            dist.all_reduce(p.grad)
            p.grad /= world_size
        with tracing.span("optimizer"):
            optimizer.step()
            optimizer.zero_grad()


def _rank_main(steps, warmup):
    import contextlib

    import torch
    import torch.distributed as dist
    from labkit.observe import recording

    torch.set_num_threads(1)
    model, loss_fn, name = _model_and_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    world_size = dist.get_world_size()
    times = {True: [], False: []}
    for i in range(warmup + 2 * steps):
        traced = i % 2 == 0
        dist.barrier()  # both ranks start the step together, whatever the last one cost
        with contextlib.nullcontext() if traced else recording.paused():
            start = time.perf_counter()
            _step(model, loss_fn, optimizer, world_size)
            elapsed = time.perf_counter() - start
        if i >= warmup:
            times[traced].append(elapsed)
    n_params = sum(1 for _ in model.parameters())
    return {"model": name, "tensors": n_params, "traced": times[True], "plain": times[False]}


def _per_event_cost(n=20000):
    """Microseconds the recorder adds per collective event and per span, in this process."""
    from labkit.observe import recording, tracing

    recording.worker_begin(0, 1)
    try:
        start = time.perf_counter()
        for _ in range(n):
            with tracing.record_collective("all_reduce", 1024, 2):
                pass
        per_event = (time.perf_counter() - start) / n * 1e6
        start = time.perf_counter()
        for _ in range(n):
            with tracing.span("forward"):
                pass
        per_span = (time.perf_counter() - start) / n * 1e6
    finally:
        recording.worker_end()
    return per_event, per_span


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="traced steps (as many untraced)")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    import labkit

    results = labkit.run(_rank_main, args.steps, args.warmup, world_size=args.world_size, timeout=600)
    from labkit.checks import load_line, load_report

    load = load_report(args.world_size)  # read right after the launch: its last minute
    rank0 = results[0]
    traced = statistics.median(rank0["traced"])
    plain = statistics.median(rank0["plain"])
    events_per_step = len(results.traces[0]["events"]) / (args.steps + args.warmup // 2)
    per_event_us, per_span_us = _per_event_cost()
    report = {
        "model": rank0["model"],
        "world_size": args.world_size,
        "steps": args.steps,
        "median_step_ms_traced": traced * 1e3,
        "median_step_ms_plain": plain * 1e3,
        "ratio": traced / plain,
        "events_per_step": events_per_step,
        "recorder_us_per_event": per_event_us,
        "recorder_us_per_span": per_span_us,
        "target_ratio": 1.10,
        "load": load,
    }
    # The ratio of medians is within the machine's noise; this bound is not: recorder work per step.
    report["estimated_overhead_pct"] = (
        100 * (events_per_step * per_event_us + SPANS_PER_STEP * per_span_us) * 1e-6 / plain
    )
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"{report['model']}, {args.world_size} ranks, {args.steps} traced + {args.steps} plain steps "
        f"(interleaved), {events_per_step:.0f} collectives per step"
    )
    print(
        f"median step: traced {traced * 1e3:.2f} ms, plain {plain * 1e3:.2f} ms "
        f"-> ratio {report['ratio']:.3f} (target <= 1.10"
        + ("; too noisy to call)" if load["too_noisy_to_call"] else ")")
    )
    print(load_line(load))
    print(
        f"recorder cost in-process: {per_event_us:.1f} us per collective, {per_span_us:.1f} us per span "
        f"-> about {report['estimated_overhead_pct']:.2f}% of a plain step"
    )


if __name__ == "__main__":
    main()
