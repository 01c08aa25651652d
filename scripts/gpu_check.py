"""GPU check on a single-GPU machine (NCCL with one rank; two ranks cannot share one GPU).

    bash scripts/gpu_check.sh        # ≤ 5 minutes; prints one line per check and a summary

1. labkit.run with NCCL at world_size 1 (device, an all_reduce on a CUDA tensor);
2. the hand-written collectives on CUDA tensors;
3. one short training run of each hand-written strategy on CUDA, compared with CPU training;
4. the memory tracker against torch.cuda.max_memory_allocated.
"""

import sys
import time

import torch
import torch.distributed as dist

import labkit

results = []


def report(name, ok, detail=""):
    results.append(ok)
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def nccl_hello():
    t = torch.ones(4, device=labkit.device())
    dist.all_reduce(t)
    return str(labkit.device()), dist.get_backend(), t.sum().item()


def collectives_on_cuda():
    from labkit.comm import collectives as C, flat as F

    dev = labkit.device()
    out = {}
    x = torch.arange(1000003, dtype=torch.float32, device=dev)
    y = x.clone()
    C.ring_all_reduce(y, op="avg")
    out["ring_all_reduce"] = torch.equal(x, y)
    shard = F.reduce_scatter_padded(x.clone())
    out["reduce_scatter_padded"] = torch.equal(shard[: x.numel()], x)
    full = F.all_gather_padded(shard, x.numel())
    out["all_gather_padded"] = torch.equal(full, x)
    h = C.ring_all_reduce(y, async_op=True)
    h.wait()
    out["async handle"] = torch.equal(y, x)
    out["device"] = str(y.device)
    return out


def tracker_vs_cuda():
    from labkit.observe.memory import MemoryTracker
    from labkit.models import TinyGPT, make_optimizer
    from labkit.data import get_batch

    dev = labkit.device()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = TinyGPT().to(dev)
    opt = make_optimizer(model.parameters())
    with MemoryTracker(model=model, optimizer=opt) as mt:
        x, y = (t.to(dev) for t in get_batch(0, 8, 64))
        with mt.phase("forward"):
            loss = model(x, y)[1]
        with mt.phase("backward"):
            loss.backward()
        with mt.phase("step"):
            opt.step()
    torch.cuda.synchronize()
    return {
        "tracker_now": mt.current().total,
        "cuda_now": torch.cuda.memory_allocated() - base,
        "cuda_peak": torch.cuda.max_memory_allocated() - base,
        "tracker_peak": mt.peak().total,
        "reserved": torch.cuda.memory_reserved(),
    }


def main():
    if not torch.cuda.is_available():
        print("no CUDA GPU visible: nothing to check")
        return 2
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    t0 = time.perf_counter()
    dev, backend, total = labkit.run(nccl_hello, world_size=1, backend="nccl")[0]
    report(
        "labkit.run NCCL world_size=1",
        backend == "nccl" and dev == "cuda:0" and total == 4,
        f"{dev} {backend}",
    )
    for name, ok in labkit.run(collectives_on_cuda, world_size=1)[0].items():
        if name != "device":
            report(f"collective {name} on CUDA", ok)
    from labkit.cli import main as train_main

    for strategy in ("ddp", "zero1", "zero2", "fsdp"):
        code = train_main(["--strategy", strategy, "--world-size", "1", "--steps", "3", "--check"])
        report(f"strategy {strategy} on CUDA vs CPU single-process", code == 0)
    m = labkit.run(tracker_vs_cuda, world_size=1)[0]
    # The tracker counts live tensors; torch.cuda also counts the allocator's rounding to 512 B
    # blocks, so they agree within a few KiB, not to the byte.
    ok = abs(m["tracker_now"] - m["cuda_now"]) <= max(64 * 1024, 0.02 * m["cuda_now"])
    report(
        "memory tracker vs torch.cuda.memory_allocated",
        ok,
        f"tracker {m['tracker_now']} B, cuda {m['cuda_now']} B; peak: tracker "
        f"{m['tracker_peak']} B, cuda {m['cuda_peak']} B; reserved {m['reserved']} B",
    )
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed ({time.perf_counter() - t0:.0f} s)")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
