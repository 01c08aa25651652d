"""labkit.comm.collectives against torch.distributed's own collectives, on real gloo ranks.

One labkit.run launch per world size checks many sizes × dtypes × ops, so the whole file stays
well under a minute. Tolerances for floats (another summation order than gloo's):
float64 rtol 1e-12, float32 rtol 1e-5 / atol 1e-5·n, float16 rtol 2e-3 / atol 2e-3·n, bfloat16
rtol 2e-2 / atol 5e-2·n (half sums are rounded after every ring step); integers match exactly.
"""

import threading
import time

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.comm import collectives as C, flat as F

SIZES = [0, 1, 7, 1000]
BIG = 2**20 + 3
TOLERANCE = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 5e-2),
    torch.float16: (2e-3, 2e-3),
}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32]
FORBIDDEN = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
]


def _same(got, want, n, where):
    if got.dtype != want.dtype or got.shape != want.shape:
        return [f"{where}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"]
    if got.dtype in TOLERANCE:
        rtol, atol = TOLERANCE[got.dtype]
        ok = torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol * n)
    else:
        ok = torch.equal(got, want)
    if ok:
        return []
    return [f"{where}: max |diff| {(got.double() - want.double()).abs().max().item():.3g}"]


def _data(numel, dtype, rank):
    gen = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=gen, dtype=dtype)


def _reference_sum(x):
    """The backend's all-reduce, computed before our collectives run."""
    ref = x.clone()
    dist.all_reduce(ref)
    return ref


def _check_rank(cases):
    """Runs on every rank; returns a list of mismatch descriptions (empty = all good)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    refs = {case: _reference_sum(_data(*case, rank)) for case in cases}
    # Our collectives must not call the backend's: every collective now raises.
    originals = {name: getattr(dist, name) for name in FORBIDDEN}
    for name in FORBIDDEN:
        setattr(
            dist,
            name,
            lambda *a, _name=name, **k: (_ for _ in ()).throw(
                AssertionError(f"labkit.comm.collectives called dist.{_name}")
            ),
        )
    try:
        return [msg for case in cases for msg in _check_case(*case, refs[case], rank, n)]
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _check_case(numel, dtype, ref_sum, rank, n):
    errors, x, tag = [], _data(numel, dtype, rank), f"n={n} numel={numel} {dtype}"
    ops = ["sum", dist.ReduceOp.AVG] if dtype.is_floating_point else [dist.ReduceOp.SUM]
    start, end, padded = C.shard_range(numel, rank, n)
    for op in ops:
        avg = op in ("avg", dist.ReduceOp.AVG)
        want = (ref_sum.double() / n).to(dtype) if avg else ref_sum
        for fn in (C.ring_all_reduce, C.naive_all_reduce):
            got = x.clone()
            fn(got, op)
            errors += _same(got, want, n, f"{fn.__name__} {op} {tag}")
        got = x.clone()
        C.ring_all_reduce(got, op, async_op=True).wait()
        errors += _same(got, want, n, f"async ring_all_reduce {op} {tag}")
        shard = F.reduce_scatter_padded(x, op)
        errors += _same(shard[: end - start], want[start:end], n, f"reduce_scatter_padded {op} {tag}")
        errors += _same(F.all_gather_padded(shard, numel), want, n, f"all_gather_padded {op} {tag}")
        if numel % n == 0:  # the torch-shaped forms need divisible sizes
            out = torch.empty(numel // n, dtype=dtype)
            C.ring_reduce_scatter(out, x, op)
            errors += _same(out, want[start:end], n, f"ring_reduce_scatter {op} {tag}")
    if numel % n == 0:
        full = torch.empty(numel, dtype=dtype)
        C.ring_all_gather(full, x[start:end].clone(), async_op=True).wait()
        want = torch.cat(
            [_data(numel, dtype, r)[r * (numel // n) : (r + 1) * (numel // n)] for r in range(n)]
        )
        errors += _same(full, want, n, f"ring_all_gather {tag}")
    return errors


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_matches_torch_distributed(world_size):
    dtypes = DTYPES + ([torch.float16] if world_size == 3 else [])
    cases = [(numel, dtype) for numel in SIZES for dtype in dtypes]
    if world_size in (2, 3):  # the big size for a few dtypes only, to keep the file fast
        cases += [(BIG, torch.float32), (BIG, torch.int64)]
    results = labkit.run(_check_rank, cases, world_size=world_size, timeout=120.0)
    assert all(errors == [] for errors in results), [e for errs in results for e in errs][:20]


# ---------------------------------------------------------------- direct exchange vs ring

ALGORITHMS = {"direct": C._crosscheck.INLINE_CAP_BYTES, "ring": 0}  # DIRECT_MAX_BYTES for each


def _every_op(x, op, numel):
    """Every collective on x (rank's data); returns the results (fresh tensors)."""
    out = {}
    t = x.clone()
    C.ring_all_reduce(t, op)
    out["all_reduce"] = t
    strided = torch.zeros(numel, 2, dtype=x.dtype)[:, 1]  # not contiguous: padded copy / scratch
    strided.copy_(x)
    C.ring_all_reduce(strided, op, async_op=True).wait()
    out["all_reduce strided async"] = strided.clone()
    shard = F.reduce_scatter_padded(x, op)
    out["reduce_scatter_padded"] = shard
    out["all_gather_padded"] = F.all_gather_padded(shard, numel)
    return out


def _direct_vs_ring_rank(cases):
    """Both algorithms on the same data: results must agree to the bit, and match the backend."""
    rank, n = dist.get_rank(), dist.get_world_size()
    refs = {case: _reference_sum(_data(*case, rank)) for case in cases}
    errors, saved = [], C.DIRECT_MAX_BYTES
    ran = {"direct": 0}
    original = C._direct.all_reduce

    def counted(*args):
        ran["direct"] += 1
        return original(*args)

    C._direct.all_reduce = counted
    try:
        for numel, dtype in cases:
            x = _data(numel, dtype, rank)
            ops = ["sum", "avg"] if dtype.is_floating_point else ["sum"]
            for op in ops:
                got = {}
                for label, limit in ALGORITHMS.items():
                    C.DIRECT_MAX_BYTES = limit
                    got[label] = _every_op(x, op, numel)
                tag = f"n={n} numel={numel} {dtype} {op}"
                for what, ring in got["ring"].items():
                    if not torch.equal(got["direct"][what], ring):
                        errors.append(f"{what} {tag}: direct and ring differ in the bits")
                want = (refs[(numel, dtype)].double() / n).to(dtype) if op == "avg" else refs[(numel, dtype)]
                errors += _same(got["direct"]["all_reduce"], want, n, f"direct all_reduce {tag}")
                start, end, _ = C.shard_range(numel, rank, n)
                errors += _same(
                    got["direct"]["reduce_scatter_padded"][: end - start],
                    want[start:end],
                    n,
                    f"direct reduce_scatter_padded {tag}",
                )
    finally:
        C.DIRECT_MAX_BYTES = saved
        C._direct.all_reduce = original
    if n > 1 and ran["direct"] == 0:
        errors.append("the direct exchange never ran")
    return errors


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_direct_exchange_gives_the_rings_bits(world_size):
    # Sizes: empty, smaller than n, not divisible by 2, 3 or 4, and a direct message near the cap.
    sizes = [0, 1, 7, 1001, 4099]
    cases = [
        (numel, dtype)
        for numel in sizes
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64)
    ]
    cases.append(((C._crosscheck.INLINE_CAP_BYTES >> 2) - 3, torch.float32))
    results = labkit.run(_direct_vs_ring_rank, cases, world_size=world_size, timeout=180.0)
    assert all(errors == [] for errors in results), [e for errs in results for e in errs][:20]


def _mixed_algorithms_rank():
    """Mismatches where one rank's call takes the direct exchange and another's the ring."""
    rank = dist.get_rank()
    caught = {}
    big = C._crosscheck.INLINE_CAP_BYTES // 4 + 1  # one element over the cap: ring
    for label, call in {
        "small-vs-big": lambda: C.ring_all_reduce(torch.ones(8 if rank == 0 else big)),
        "gather-vs-big-reduce": lambda: (
            C.ring_all_gather(torch.empty(16), torch.ones(8))
            if rank == 0
            else C.ring_reduce_scatter(torch.empty(big), torch.ones(2 * big))
        ),
    }.items():
        try:
            call()
            caught[label] = "no error"
        except C.CollectiveMismatchError as exc:
            caught[label] = str(exc)
    saved = C.DIRECT_MAX_BYTES
    C.DIRECT_MAX_BYTES = saved if rank == 0 else 0  # same call, different algorithms
    try:
        C.ring_all_reduce(torch.ones(8))
        caught["threshold"] = "no error"
    except C.CollectiveMismatchError as exc:
        caught["threshold"] = str(exc)
    finally:
        C.DIRECT_MAX_BYTES = saved
    after = torch.ones(10)  # the ranks are still in step
    C.ring_all_reduce(after)
    caught["after"] = after.tolist() == [2.0] * 10
    return caught


def test_mismatch_between_direct_and_ring_calls_raises_on_every_rank():
    results = labkit.run(_mixed_algorithms_rank, world_size=2, timeout=60.0)
    big = C._crosscheck.INLINE_CAP_BYTES // 4 + 1
    for rank, caught in enumerate(results):
        small_big, gather_reduce = caught["small-vs-big"], caught["gather-vs-big-reduce"]
        assert "rank 0 called ring_all_reduce(op=SUM, torch.float32, 8 elements)" in small_big
        assert f"rank 1 called ring_all_reduce(op=SUM, torch.float32, {big} elements)" in small_big
        assert "rank 0 called ring_all_gather(torch.float32, 8 elements in, 16 out)" in gather_reduce
        assert "rank 1 called ring_reduce_scatter(op=SUM" in gather_reduce
        assert "DIRECT_MAX_BYTES" in caught["threshold"] and f"rank {rank}" in caught["threshold"]
        assert caught["after"] is True


def _bad_input_rank():
    rank, n = dist.get_rank(), dist.get_world_size()
    caught = {}

    def expect(kind, label, fn):
        try:
            fn()
        except kind as exc:
            caught[label] = str(exc)
        else:
            caught[label] = "no error"

    full = torch.zeros(12)
    expect(ValueError, "noncontiguous", lambda: C.ring_reduce_scatter(torch.zeros(12, 2)[:, 0][:6], full))
    expect(TypeError, "dtype", lambda: C.ring_reduce_scatter(torch.zeros(6, dtype=torch.int64), full))
    expect(ValueError, "size", lambda: C.ring_reduce_scatter(torch.zeros(5), full))
    expect(ValueError, "ag_size", lambda: C.ring_all_gather(torch.zeros(12), torch.zeros(5)))
    expect(TypeError, "avg_int", lambda: C.ring_all_reduce(torch.zeros(4, dtype=torch.int64), "avg"))
    expect(ValueError, "op", lambda: C.ring_all_reduce(torch.zeros(4), "max"))
    # Sizes differing across ranks: every rank must get the same clear error, sync and async.
    mine = torch.ones(1000 + (rank == n - 1))
    expect(ValueError, "mismatch", lambda: C.ring_all_reduce(mine))
    expect(ValueError, "mismatch_async", lambda: C.ring_all_reduce(mine, async_op=True).wait())
    expect(
        ValueError,
        "mismatch_dtype",
        lambda: C.ring_all_reduce(torch.ones(8, dtype=torch.float64 if rank == 0 else torch.float32)),
    )
    # ... and the ranks are still in step afterwards.
    after = torch.ones(10)
    C.ring_all_reduce(after)
    caught["after"] = after.tolist() == [float(n)] * 10
    return caught


def test_bad_input_raises_clear_errors():
    results = labkit.run(_bad_input_rank, world_size=3, timeout=60.0)
    for rank, caught in enumerate(results):
        assert "contiguous" in caught["noncontiguous"]
        assert "torch.int64" in caught["dtype"] and "torch.float32" in caught["dtype"]
        assert "12" in caught["size"] and "15" in caught["size"]
        assert "12" in caught["ag_size"]
        assert "floating-point" in caught["avg_int"]
        assert "'max'" in caught["op"]
        for key in ("mismatch", "mismatch_async"):
            assert "1001" in caught[key] and "1000" in caught[key], caught[key]
            assert f"rank {rank}" in caught[key] and "ring_all_reduce" in caught[key]
        assert "torch.float32" in caught["mismatch_dtype"]
        assert "torch.float64" in caught["mismatch_dtype"]
        assert caught["after"] is True


def _mismatch_rank():
    """Each case: the two ranks make different calls at the same point; every rank must raise."""
    rank = dist.get_rank()
    x = torch.ones(8)
    cases = {
        "op": lambda: C.ring_all_reduce(x.clone(), "sum" if rank == 0 else "avg"),
        "kind": lambda: (
            C.ring_all_reduce(x.clone()) if rank == 0 else C.ring_reduce_scatter(torch.empty(4), x.clone())
        ),
        "gather": lambda: (
            C.ring_all_reduce(x.clone(), async_op=True)
            if rank == 0
            else C.ring_all_gather(torch.empty(16), x.clone(), async_op=True)
        ).wait(),
        "dtype": lambda: C.ring_all_reduce(torch.ones(8, dtype=torch.float64 if rank else torch.float32)),
        "size": lambda: C.ring_reduce_scatter(torch.empty(4 + rank), torch.ones(8 + 2 * rank)),
    }
    caught = {}
    for label, call in cases.items():
        start = time.perf_counter()
        try:
            call()
            message = "no error"
        except C.CollectiveMismatchError as exc:
            message = str(exc)
        caught[label] = (message, time.perf_counter() - start)
    after = torch.ones(10)  # the ranks are still in step
    C.ring_all_reduce(after)
    caught["after"] = after.tolist() == [2.0] * 10
    return caught


def test_mismatched_calls_raise_on_every_rank_naming_each_call():
    # Before the cross-rank check: "op" returned [3,3,3,3,1.5,1.5,1.5,1.5] on both ranks, "kind"
    # and "gather" hung until the timeout. Measured here: each raises in under 0.02 s.
    results = labkit.run(_mismatch_rank, world_size=2, timeout=60.0)
    sum8 = "rank 0 called ring_all_reduce(op=SUM, torch.float32, 8 elements)"
    expected = {
        "op": [sum8, "rank 1 called ring_all_reduce(op=AVG, torch.float32, 8 elements)"],
        "kind": [sum8, "rank 1 called ring_reduce_scatter(op=SUM, torch.float32, 8 elements in, 4 out)"],
        "gather": [sum8, "rank 1 called ring_all_gather(torch.float32, 8 elements in, 16 out)"],
        "dtype": [sum8, "rank 1 called ring_all_reduce(op=SUM, torch.float64, 8 elements)"],
        "size": [
            "rank 0 called ring_reduce_scatter(op=SUM, torch.float32, 8 elements in, 4 out)",
            "rank 1 called ring_reduce_scatter(op=SUM, torch.float32, 10 elements in, 5 out)",
        ],
    }
    for rank, caught in enumerate(results):
        for label, names in expected.items():
            message, elapsed = caught[label]
            assert "collective mismatch" in message and f"rank {rank}" in message, (label, message)
            for name in names:
                assert name in message, (label, message)
            assert elapsed < 10.0, (label, elapsed)  # 2 s asked; slack for a loaded machine
        assert caught["after"] is True


def _uncaught_mismatch_rank():
    C.ring_all_reduce(torch.ones(8), "sum" if dist.get_rank() == 0 else "avg")


def test_mismatch_reaches_the_notebook_as_rank_error():
    with pytest.raises(labkit.RankError) as info:
        labkit.run(_uncaught_mismatch_rank, world_size=2, timeout=60.0)
    text = str(info.value)
    assert "collective mismatch" in text and "op=SUM" in text and "op=AVG" in text, text
    assert not isinstance(info.value, labkit.RankTimeout)


def _overlap_rank():
    n = dist.get_world_size()
    a, b, c = torch.ones(5000), torch.arange(4000.0), torch.full((3000,), 2.0)
    handles = [C.ring_all_reduce(a, async_op=True), C.naive_all_reduce(b, async_op=True)]
    shard, h = F.reduce_scatter_padded(c, "avg", async_op=True)
    busy = torch.randn(200, 200) @ torch.randn(200, 200)  # compute while they run
    for handle in handles + [h]:
        handle.wait()
    param = torch.nn.Parameter(torch.ones(6))  # like dist.*, no autograd "in-place on leaf" error
    C.ring_all_reduce(param)
    return (
        param.detach().eq(n).all().item()
        and a.eq(n).all().item()
        and b.eq(torch.arange(4000.0) * n).all().item()
        and shard.eq(2.0).all().item()
        and busy.shape == (200, 200)
    )


def test_async_ops_overlap_and_complete_in_order():
    assert all(labkit.run(_overlap_rank, world_size=4, timeout=60.0))


def test_shard_range_pads_like_fsdp():
    assert C.shard_range(10, 0, 4) == (0, 3, 12)
    assert C.shard_range(10, 3, 4) == (9, 10, 12)
    assert C.shard_range(2, 3, 4) == (2, 2, 4)  # an all-padding shard
    assert C.shard_range(0, 1, 3) == (0, 0, 0)
    with pytest.raises(ValueError):
        C.shard_range(10, 4, 4)


def test_single_process_without_group_and_clean_shutdown():
    t = torch.arange(5.0)
    C.ring_all_reduce(t, "avg")  # no process group: a world of one
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert F.all_gather_padded(F.reduce_scatter_padded(t), 5).tolist() == t.tolist()
    C.shutdown()
    assert not any(th.name == "labkit-comm" for th in threading.enumerate())


def _coalesced_rank(direct_max):
    """all_gather_coalesced against one ring_all_gather per pair: in place (each input a rank's
    chunk of its output, as ZeRO-2's buckets) and out of place, sizes 0, 1, 5, 1000, both paths."""
    rank, n = dist.get_rank(), dist.get_world_size()
    C.DIRECT_MAX_BYTES = direct_max
    sizes, problems = [3, 0, 1, 5, 1000], []
    for dtype in (torch.float32, torch.float64, torch.int64):
        flats = [torch.zeros(n * s, dtype=dtype) for s in sizes]
        for s, flat in zip(sizes, flats):
            flat[rank * s : (rank + 1) * s] = torch.arange(s, dtype=dtype) + 1000 * rank
        want = [f.clone() for f in flats]
        for w, s in zip(want, sizes):
            C.ring_all_gather(w, w[rank * s : (rank + 1) * s].clone())
        F.all_gather_coalesced(flats, [f[rank * s : (rank + 1) * s] for f, s in zip(flats, sizes)])
        outs = [torch.empty(n * s, dtype=dtype) for s in sizes]
        F.all_gather_coalesced(
            outs, [w[rank * s : (rank + 1) * s].clone() for w, s in zip(want, sizes)], async_op=True
        ).wait()
        problems += [
            f"{dtype} size {s}"
            for s, f, o, w in zip(sizes, flats, outs, want)
            if not (torch.equal(f, w) and torch.equal(o, w))
        ]
    try:  # one rank gathers one element more: every rank raises, naming both calls
        F.all_gather_coalesced([torch.empty(n * (4 + rank))], [torch.ones(4 + rank)])
        problems.append("no mismatch error")
    except C.CollectiveMismatchError as exc:
        if "all_gather_coalesced" not in str(exc):
            problems.append(str(exc))
    return problems


@pytest.mark.parametrize("world_size", [2, 3])
# one direct message; several (the 1000-element pair then a ring of its own); the rings only
@pytest.mark.parametrize("direct_max", [C.DIRECT_MAX_BYTES, 24, 0])
def test_all_gather_coalesced_equals_one_all_gather_per_pair(world_size, direct_max):
    assert labkit.run(_coalesced_rank, direct_max, world_size=world_size, timeout=120) == [[]] * world_size
