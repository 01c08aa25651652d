"""Checks for the collectives the labs write by hand: the ring reduce-scatter and all-gather
(dp_lab) and FSDP's unshard / reduce_grad (fsdp_lab).

Each check tests every half on its own input (a wrong reduce-scatter cannot hide behind a right
all-gather, or the other way round), then their composition. The ranks only compute and return
tensors; the kernel compares them with values it computes itself, so a mistake is reported once
(naming every rank that made it), with expected and got, their shapes, and the likely mistake.

Inputs are small integers, so every sum is exact in any order and a value can be traced back to
the rank and chunk it came from. Left out: timing, and asynchronous (async_op) variants.
"""

from itertools import combinations

import torch
import torch.distributed as dist

from labkit.checks import compare
from labkit.comm.collectives import shard_range

NOT_IMPLEMENTED = "not implemented yet"


def _attempt(fn, *args):
    """fn(*args) as a detached tensor, or NOT_IMPLEMENTED: a learner who wrote one half still
    gets the other half checked. Other errors propagate (a rank stuck in a collective must not
    wait for a peer that swallowed its error)."""
    try:
        return torch.as_tensor(fn(*args)).detach().clone()
    except NotImplementedError:
        return NOT_IMPLEMENTED


def _ring_inputs(rank, n):
    """(x, shard) of `rank`: its all-reduce input (6 per chunk) and its all-gather shard."""
    gen = torch.Generator().manual_seed(1000 * n + rank)
    x = torch.randint(-40, 41, (6 * n,), generator=gen).float()
    return x, torch.arange(5.0) + 10 * rank + 1  # shard r holds 10r+1 .. 10r+5


class _DryWork:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _p2p_schedule(fn, *args):
    """(sends, recvs): the peers of every point-to-point call fn makes, recorded without sending
    anything (a recv gets zeros: a ring's schedule does not depend on the values), or None when fn
    does not finish that way. Collectives fn calls run for real (every rank calls them alike)."""
    from torch.distributed import distributed_c10d as c10d

    sends, recvs = [], []

    def send(tensor, dst=None, *a, **k):
        sends.append(int(dst))
        return _DryWork()

    def recv(tensor, src=None, *a, **k):
        recvs.append(int(src))
        tensor.zero_()
        return _DryWork()

    def blocking_send(tensor, dst=None, *a, **k):
        send(tensor, dst)

    def blocking_recv(tensor, src=None, *a, **k):
        recv(tensor, src)
        return int(src)

    patched = {"isend": send, "irecv": recv, "send": blocking_send, "recv": blocking_recv}
    saved = {name: (getattr(dist, name), getattr(c10d, name)) for name in patched}
    try:
        for name, f in patched.items():
            setattr(dist, name, f)
            setattr(c10d, name, f)
        fn(*args)
    except Exception:
        return None
    finally:
        for name, (a, b) in saved.items():
            setattr(dist, name, a)
            setattr(c10d, name, b)
    return sends, recvs


def p2p_mismatch(schedules):
    """'' when every rank's receives from each peer match that peer's sends to it (as counts), else
    what does not match, naming the ranks (schedules[rank] = (sends, recvs) from _p2p_schedule)."""
    n = len(schedules)
    lines = []
    for rank, (_, recvs) in enumerate(schedules):
        for src in range(n):
            want, sent = recvs.count(src), schedules[src][0].count(rank)
            if want != sent:
                goes = sorted(set(schedules[src][0]))
                lines.append(
                    f"rank {rank} receives {want} message(s) from rank {src}, which sends it {sent} "
                    f"(rank {src} sends to rank{'s' if len(goes) != 1 else ''} "
                    f"{', '.join(map(str, goes)) or 'nobody'})"
                )
    if not lines:
        return ""
    return (
        f"send/recv pairs do not match on {n} ranks (seen before sending anything: on {n} ranks "
        f"this would wait forever): "
        + "; ".join(lines[:4])
        + ("; ..." if len(lines) > 4 else "")
        + ". Each rank must receive from the rank that sends to it: send to (rank + 1) % n, "
        "receive from (rank - 1) % n"
        + (" (on 2 ranks both are the other rank, which is why 2 ranks passed)" if n > 2 else "")
    )


def _matched(fn, *args):
    """'' when fn's sends and receives pair up across the ranks (or cannot be recorded), else
    p2p_mismatch's message. Every rank calls it: one all_gather_object."""
    schedule = _p2p_schedule(fn, *(a.clone() for a in args))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, schedule)
    if any(s is None for s in every):
        return ""  # not recordable on some rank: the real run says what is wrong
    return p2p_mismatch(every)


SKIPPED = "not run: a half above fails"


def ring_outputs(reduce_scatter, all_gather):
    """Rank function: the learner's reduce-scatter, all-gather and their composition. Each half's
    sends and receives are first recorded without sending (_matched): a receive from the wrong
    neighbour is named at once instead of deadlocking until the launch's timeout."""
    x, shard = _ring_inputs(dist.get_rank(), dist.get_world_size())
    rs = _matched(reduce_scatter, x) or _attempt(reduce_scatter, x.clone())
    ag = _matched(all_gather, shard) or _attempt(all_gather, shard.clone())
    if isinstance(rs, str) and NOT_IMPLEMENTED not in rs or isinstance(ag, str) and NOT_IMPLEMENTED not in ag:
        both = SKIPPED
    elif isinstance(rs, str) or isinstance(ag, str):
        both = NOT_IMPLEMENTED
    else:
        both = _attempt(lambda t: all_gather(reduce_scatter(t)), x.clone())
    return {"reduce-scatter": rs, "all-gather": ag, "all-reduce": both}


def _where_from(got, pieces):
    """The label of the first piece `got` equals, or None."""
    return next((label for label, t in pieces if t.shape == got.shape and torch.equal(got, t)), None)


def _rs_hint(got, rank, xs):
    n = len(xs)
    chunks = [x.chunk(n) for x in xs]
    if got.numel() == xs[0].numel():
        return "returned a whole tensor: the reduce-scatter returns one chunk, x.numel() / n elements"
    pieces = [
        ((c, ranks), sum(chunks[r][c] for r in ranks))
        for size in range(n, 0, -1)
        for ranks in combinations(range(n), size)
        for c in range(n)
    ]
    found = _where_from(got, pieces)
    total = sum(chunks[r][rank] for r in range(n))
    if found is None:
        if got.shape == total.shape and torch.allclose(got, total / n):
            return (
                f"got the sum divided by n = {n}: this collective SUMs (the DDP strategy "
                f"decides about averaging)"
            )
        return ""
    chunk, ranks = found
    if len(ranks) == n:
        return (
            f"got chunk {chunk} of the sum; rank {rank} must end with chunk {rank}: the chunk "
            f"index is off by {(chunk - rank) % n} (step k sends chunk (rank-k-1) % n)"
        )
    if ranks == (rank,):
        return "got this rank's own chunk, unsummed: what arrives from rank-1 is never added in"
    if chunk != rank:
        return (
            f"got chunk {chunk} summed over ranks {list(ranks)} only, a partial sum: after "
            f"n-1 steps the complete chunk on rank {rank} is chunk {rank} (return that one)"
        )
    return (
        f"got chunk {rank} summed over ranks {list(ranks)} only: the loop must run n-1 = "
        f"{n - 1} steps, each adding what arrives into the chunk that is sent next"
    )


def _ag_hint(got, shards):
    n, size = len(shards), shards[0].numel()
    if got.numel() != n * size:
        return ""
    parts = []
    for position, piece in enumerate(got.split(size)):
        owner = _where_from(piece, [(r, s) for r, s in enumerate(shards)])
        if owner != position:
            parts.append(
                f"position {position} holds "
                + (f"rank {owner}'s shard" if owner is not None else "none of the shards (never received)")
            )
    return "; ".join(parts) + ": each rank's shard goes to its own position, in rank order" if parts else ""


def _diagnose(label, name, expected, outputs, hint_of):
    """One message for a half across ranks: '' if every rank got `expected[rank]`."""
    failed = [
        r
        for r, got in enumerate(outputs)
        if isinstance(got, str) or not compare(expected[r], got, rtol=0, atol=0, names=[name]).ok
    ]
    if not failed:
        return ""
    r, got = failed[0], outputs[failed[0]]
    who = f"ranks {', '.join(map(str, failed))}" if len(failed) > 1 else f"rank {r}"
    if isinstance(got, str):
        return f"{label}: {got} ({who})"
    report = compare(expected[r], got, rtol=0, atol=0, names=[name], rank=r, world_size=len(outputs))
    hint = hint_of(got, r)
    lines = report.first_problem().splitlines()
    if hint:  # it knows the inputs: more specific than compare's guess from the numbers alone
        lines = [line for line in lines if not line.startswith("hint:")] + [f"hint: {hint}"]
    return f"{label}: FAILED on {who} (shown: rank {r})" + "".join("\n  " + l for l in lines)


def diagnose_ring(results):
    """Messages for the halves that failed, from `ring_outputs` on every rank ([] when right)."""
    n = len(results)
    xs, shards = zip(*(_ring_inputs(r, n) for r in range(n)))
    total = sum(xs)
    halves = [
        ("reduce-scatter", "reduce_scatter(x)", total.chunk(n), lambda got, r: _rs_hint(got, r, xs)),
        ("all-gather", "all_gather(shard)", [torch.cat(shards)] * n, lambda got, r: _ag_hint(got, shards)),
        (
            "all-reduce",
            "all_gather(reduce_scatter(x))",
            [total] * n,
            lambda got, r: (
                "each half passed alone: does reduce_scatter modify or return a view of its input, "
                "or all_gather keep state between calls?"
            ),
        ),
    ]
    out = []
    for key, name, expected, hint_of in halves:
        message = _diagnose(f"{key} on {n} ranks", name, expected, [r[key] for r in results], hint_of)
        if message and key == "all-reduce" and out:
            message = message.split("\n")[0] + " (follows from the half above)"
        if message:
            out.append(message)
    return out


def check_ring(reduce_scatter, all_gather, world_sizes=(2, 4)):
    """dp_lab exercise 1: both halves alone, then composed, on each world size."""
    import labkit

    for n in world_sizes:
        problems = diagnose_ring(labkit.run(ring_outputs, reduce_scatter, all_gather, world_size=n))
        _conclude(problems, ("reduce-scatter", "all-gather", "all-reduce"), f"{n} ranks")
    return True


def _conclude(problems, halves, where):
    """Raise one exception for all of `problems` (NotImplementedError when each is an unfinished
    half, so the lab says "not implemented yet"), or print that every half passed."""
    passed = [h for h in halves if not any(p.startswith(h) for p in problems)]
    if problems and all(NOT_IMPLEMENTED in p for p in problems):
        if passed:  # "not implemented yet" alone would hide that these halves are right
            print(f"{where}: {', '.join(passed)} ok")
        raise NotImplementedError("; ".join(problems))
    if problems:
        raise AssertionError("\n".join(problems))
    print(f"{where}: {', '.join(h + ' ok' for h in halves)}")


# ---------------------------------------------------------------- FSDP: unshard / reduce_grad


def unshard_outputs(unshard, reduce_grad, numel):
    """Rank function: unshard of this rank's padded shard of arange(numel), and reduce_grad of
    arange(numel) * (rank + 1)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    start, end, padded = shard_range(numel, rank, n)
    everything = torch.arange(float(numel))
    shard = torch.zeros(padded // n)
    shard[: end - start] = everything[start:end]
    return {
        "unshard": _attempt(unshard, shard, numel),
        "reduce_grad": _attempt(reduce_grad, everything * (rank + 1)),
    }


def _unshard_hint(got, rank, numel, n):
    start, end, padded = shard_range(numel, rank, n)
    if got.numel() == padded // n:
        return (
            f"got one shard's worth ({padded // n} elements): all-gather every rank's shard "
            f"into a buffer of {padded} (padded) elements, then cut it to numel"
        )
    if got.numel() > numel and torch.equal(got[:numel], torch.arange(float(numel))):
        return (
            f"the first {numel} elements are right, then {got.numel() - numel} of padding: "
            f"return the gathered buffer cut to numel, full[:numel]"
        )
    return ""


def _reduce_grad_hint(got, rank, numel, n):
    start, end, padded = shard_range(numel, rank, n)
    chunk, full = padded // n, torch.zeros(padded)
    full[:numel] = torch.arange(float(numel)) * (n + 1) / 2
    if got.numel() == end - start < chunk:
        return (
            f"the shard has {chunk} elements on every rank, padding included: keep the "
            f"padded chunk (the optimizer state is sized by it)"
        )
    owner = _where_from(got, [(k, full[k * chunk : (k + 1) * chunk]) for k in range(n)])
    if owner is not None and owner != rank:
        return f"got rank {owner}'s chunk: rank {rank} keeps chunk {rank} (shard_range)"
    own = full[rank * chunk : (rank + 1) * chunk] * 2 * (rank + 1) / (n + 1)
    if got.numel() == chunk and torch.allclose(got, own):
        return "got this rank's own gradient, unreduced: reduce-scatter the padded gradient"
    return ""


def diagnose_unshard(results, numel):
    """Messages for the functions that failed, from `unshard_outputs` on every rank."""
    n = len(results)
    chunk = shard_range(numel, 0, n)[2] // n
    grad = torch.zeros(chunk * n)
    grad[:numel] = torch.arange(float(numel)) * (n + 1) / 2  # AVG of rank+1 = (n+1)/2
    problems = [
        _diagnose(
            f"unshard on {n} ranks",
            "unshard(shard, numel)",
            [torch.arange(float(numel))] * n,
            [r["unshard"] for r in results],
            lambda got, r: _unshard_hint(got, r, numel, n),
        ),
        _diagnose(
            f"reduce_grad (AVG) on {n} ranks",
            "reduce_grad(flat_grad)",
            grad.split(chunk),
            [r["reduce_grad"] for r in results],
            lambda got, r: _reduce_grad_hint(got, r, numel, n),
        ),
    ]
    return [p for p in problems if p]
