"""Our ring collectives vs the backend's own, side by side in one run (nccl-tests style figures).

    .venv/bin/python benchmarks/collectives.py                 # 2 and 4 ranks, 64 KiB … 64 MiB
    .venv/bin/python benchmarks/collectives.py --json          # the same figures as JSON
    .venv/bin/python benchmarks/collectives.py --world-sizes 2 --sizes 16M 64M --piece-bytes 4M

For each size the variants are interleaved (ours, backend, ours, ...) and the median time is
quoted: on a shared 2-core machine the noise between runs can be 2×. A rep's time is the slowest
rank's, between two barriers. S = bytes of the full buffer (all-reduce: the tensor; reduce-scatter:
the input; all-gather: the output); algbw = S / t; busbw = algbw · 2(n-1)/n for all-reduce and
algbw · (n-1)/n for reduce-scatter / all-gather (nccl-tests' definitions).

Ours picks its algorithm by size (labkit.comm.collectives.DIRECT_MAX_BYTES): the direct exchange
for small messages, the ring above; each row says which ran ("algorithm"). --direct-max-bytes 0
forces the ring everywhere (to compare the two algorithms at one size).

The cross-rank check (labkit.comm._crosscheck: every rank sends a descriptor of its call to every
other rank) is timed three ways at 64 KiB and 16 MiB: an all-reduce with it and without it
(verify=False), and the check alone (header only, as before a ring). At 64 KiB the direct
exchange carries the header in its data message, so with and without cost the same there.

JSON: "rows" (one per op, world size and size), plus flat keys "<op>_<size>_n<N>_ratio" (e.g.
"all_gather_64KiB_n2_ratio") for every row and "<op>_<size>_ratio" for the 2-rank rows (e.g.
"all_reduce_1MiB_ratio"): ours / backend, medians.

Left out: latency sweeps below 64 KiB, dtypes other than float32, CUDA-event timing on NCCL.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import labkit
from labkit.checks import load_line, load_report
from labkit.comm import _crosscheck, _dispatch, _ring, collectives as C
from labkit.strategies.comm_choice import torch_all_gather, torch_reduce_scatter

OPS = ("all_reduce", "reduce_scatter", "all_gather", "naive_all_reduce")
DEFAULT_SIZES = ["64K", "256K", "1M", "4M", "16M", "64M"]
CHECK_SIZES = {"64K": 40, "16M": 10}  # size -> reps for the cross-rank check's cost


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.upper().rstrip("IB")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def variants(op, n, numel, dev, verify):
    """{label: zero-arg callable} for one op: ours first, then the backend's."""
    if op in ("all_reduce", "naive_all_reduce"):
        t = torch.ones(numel, device=dev)
        ours = C.ring_all_reduce if op == "all_reduce" else C.naive_all_reduce
        return {"ours": lambda: ours(t, verify=verify), "backend": lambda: dist.all_reduce(t)}
    chunk = numel // n
    full, shard = torch.ones(chunk * n, device=dev), torch.ones(chunk, device=dev)
    if op == "reduce_scatter":
        return {
            "ours": lambda: C.ring_reduce_scatter(shard, full, verify=verify),
            "backend": lambda: torch_reduce_scatter()(shard, full),
        }
    return {
        "ours": lambda: C.ring_all_gather(full, shard, verify=verify),
        "backend": lambda: torch_all_gather()(full, shard),
    }


def timed(fn):
    """Slowest rank's time for one call, between barriers."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def bench_rank(ops, sizes, piece_bytes, verify, budget_s, direct_max):
    _ring.PIECE_BYTES = piece_bytes
    if direct_max is not None:
        C.DIRECT_MAX_BYTES = direct_max
    n, dev = dist.get_world_size(), labkit.device()
    rows = []
    for op in ops:
        for nbytes in sizes:
            numel = nbytes // 4
            fns = variants(op, n, numel, dev, verify)
            times = {label: [] for label in fns}
            for _ in range(3):  # warm-up: connections, buffer cache,
                for fn in fns.values():  # the socket's window (the first cell
                    timed(fn)  # of a run was 2-8x slow with one call)
            reps, spent = 0, 0.0
            while reps < 5 or (reps < 25 and spent < budget_s):
                for label, fn in fns.items():  # interleaved, so drift hits both alike
                    times[label].append(timed(fn))
                spent += sum(ts[-1] for ts in times.values())
                reps += 1
            row = figures(op, n, nbytes, {k: statistics.median(v) for k, v in times.items()}, reps)
            row["algorithm"] = algorithm(op, n, numel)
            rows.append(row)
    check = check_cost(dev) if verify and n > 1 else None
    return rows, check


def algorithm(op, n, numel):
    """Which of ours ran: the direct exchange when one of its messages fits DIRECT_MAX_BYTES."""
    if op == "naive_all_reduce":
        return "naive"
    message = 4 * (numel if op == "all_reduce" else numel // n)
    direct = n > 1 and message <= min(C.DIRECT_MAX_BYTES, _crosscheck.INLINE_CAP_BYTES)
    return "direct" if direct else "ring"


def size_label(nbytes):
    return f"{nbytes >> 20}MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10}KiB"


def ratio_keys(rows):
    """Flat keys: "<op>_<size>_n<N>_ratio" for every row, "<op>_<size>_ratio" for 2 ranks."""
    out = {}
    for row in rows:
        base = f"{row['op']}_{size_label(row['bytes'])}"
        out[f"{base}_n{row['world_size']}_ratio"] = row["ratio_ours_over_backend"]
        if row["world_size"] == 2:
            out[f"{base}_ratio"] = row["ratio_ours_over_backend"]
    return out


def figures(op, n, nbytes, medians, reps):
    factor = 2 * (n - 1) / n if op.endswith("all_reduce") else (n - 1) / n
    row = {"op": op, "world_size": n, "bytes": nbytes, "reps": reps}
    for label, t in medians.items():
        algbw = nbytes / t / 1e9
        row[label] = {"time_ms": t * 1e3, "algbw_GBps": algbw, "busbw_GBps": algbw * factor}
    row["ratio_ours_over_backend"] = medians["ours"] / medians["backend"]
    return row


def check_cost(dev, alone_reps=200):
    """The cross-rank check's cost: {size: {with_ms, without_ms, extra_ms}} on a ring all-reduce
    (interleaved reps, medians), plus alone_ms, the check by itself (no ring after it)."""
    out = {}
    for label, reps in CHECK_SIZES.items():
        t = torch.ones(parse_size(label) // 4, device=dev)
        on, off = [], []
        for _ in range(reps):
            on.append(timed(lambda: C.ring_all_reduce(t, verify=True)))
            off.append(timed(lambda: C.ring_all_reduce(t, verify=False)))
        with_ms, without_ms = statistics.median(on) * 1e3, statistics.median(off) * 1e3
        out[label] = {"with_ms": with_ms, "without_ms": without_ms, "extra_ms": with_ms - without_ms}
    ring = _dispatch.ring_for(None, dist.get_rank(), dist.get_world_size(), dev)
    alone = [
        timed(lambda: _crosscheck.check_same_call(ring, "ring_all_reduce", "sum", torch.float32, 16, 16))
        for _ in range(alone_reps)
    ]
    out["alone_ms"] = statistics.median(alone) * 1e3
    return out


def print_table(rows, check_by_n):
    head = (
        f"{'op':<17}{'n':>2}{'size':>8} | {'ours ms':>8}{'algbw':>7}{'busbw':>7} | "
        f"{'gloo ms':>8}{'algbw':>7}{'busbw':>7} | {'ours/gloo':>9}  ours ran"
    )
    print(head + "\n" + "-" * len(head))
    for row in rows:
        size = row["bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        o, b = row["ours"], row["backend"]
        print(
            f"{row['op']:<17}{row['world_size']:>2}{label:>8} | {o['time_ms']:8.2f}"
            f"{o['algbw_GBps']:7.2f}{o['busbw_GBps']:7.2f} | {b['time_ms']:8.2f}"
            f"{b['algbw_GBps']:7.2f}{b['busbw_GBps']:7.2f} | {row['ratio_ours_over_backend']:8.2f}×"
            f"  {row['algorithm']}"
        )
    print("(GB/s = 1e9 bytes/s; 'gloo' = the backend's own collective; medians of interleaved reps)")
    for n, c in check_by_n.items():
        if c:
            sizes = ", ".join(
                f"{label}B all-reduce {c[label]['with_ms']:.2f} ms with / "
                f"{c[label]['without_ms']:.2f} ms without"
                for label in CHECK_SIZES
            )
            print(f"cross-rank check, {n} ranks: {c['alone_ms']:.3f} ms alone; {sizes} (verify=False)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="e.g. 64K 1M 64M")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS[:3]))
    parser.add_argument(
        "--piece-bytes", default=str(_ring.PIECE_BYTES), help="ring pipelining piece size, e.g. 256K, 1M, 4M"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the cross-rank check")
    parser.add_argument(
        "--direct-max-bytes",
        default=None,
        help="override DIRECT_MAX_BYTES (0: the ring everywhere), e.g. 256K",
    )
    parser.add_argument("--budget-s", type=float, default=0.6, help="time per (op, size) cell")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes]
    direct_max = None if args.direct_max_bytes is None else parse_size(args.direct_max_bytes)
    if direct_max is not None:
        C.DIRECT_MAX_BYTES = direct_max  # for the JSON's direct_max_bytes (the ranks set theirs)
    rows, checks, loads = [], {}, {}
    # labkit.run's notes (e.g. "4 ranks on 2 cores") go to stderr, so --json prints pure JSON.
    for n in args.world_sizes:
        with contextlib.redirect_stdout(sys.stderr):
            result = labkit.run(
                bench_rank,
                args.ops,
                sizes,
                parse_size(args.piece_bytes),
                not args.no_verify,
                args.budget_s,
                direct_max,
                world_size=n,
                timeout=900.0,
            )
        loads[n] = load_report(n)  # read right after the launch: its last minute
        rows += result[0][0]
        checks[n] = result[0][1]
    # "size_check" (64 KiB, with/without) is the old key, kept for scripts that read it.
    size_check = {n: c and {k: c["64K"][k] for k in ("with_ms", "without_ms")} for n, c in checks.items()}
    if args.json:
        print(
            json.dumps(
                {
                    "piece_bytes": parse_size(args.piece_bytes),
                    "direct_max_bytes": _dispatch.direct_limit(C.DIRECT_MAX_BYTES),
                    "rows": rows,
                    "size_check": size_check,
                    "cross_rank_check": checks,
                    "load": loads,
                    **ratio_keys(rows),
                },
                indent=1,
            )
        )
    else:
        print_table(rows, checks)
        for n, load in loads.items():
            print(f"{n} ranks: {load_line(load)}")


if __name__ == "__main__":
    main()
