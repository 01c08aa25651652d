"""labkit.comm.all_to_all_single against dist.all_to_all_single on real gloo ranks.

One launch per world size (2 and 4) checks even, uneven, empty and large (past the first message)
splits in several dtypes and shapes, a subgroup, async_op, the autograd form's backward, the
trace's wire bytes against the formula (4 ranks: 2 simulated nodes, the bytes across them too),
and the refusals: torch's local ones (both refuse) and
the cross-rank ones torch cannot make (split sizes that disagree, another collective at the same
point), after which the group still works.
"""

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.comm import all_to_all as A
from labkit.comm import collectives as C
from labkit.comm._crosscheck import CollectiveMismatchError


def _matrix(n, seed, low=0, high=5):
    """M[i][j]: rows rank i sends rank j (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n, n), generator=gen).tolist()


def _input(rows, shape, dtype, rank, seed):
    gen = torch.Generator().manual_seed(100 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(rows, *shape, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (rows, *shape), generator=gen, dtype=dtype)


def _one(rank, n, case, group=None):
    """(ours, torch's) outputs for one case on this rank."""
    kind, shape, dtype, seed = case
    if kind == "even":
        send = recv = None
        rows_in = rows_out = 3 * n
    else:
        m = _matrix(n, seed) if kind == "uneven" else [[0] * n for _ in range(n)]
        if kind == "large":  # 300 rows of 4 KiB: each message past DIRECT_MAX_BYTES
            m = [[300 + i + j for j in range(n)] for i in range(n)]
        send, recv = m[rank], [m[i][rank] for i in range(n)]
        rows_in, rows_out = sum(send), sum(recv)
    x = _input(rows_in, shape, dtype, rank, seed)
    ours = torch.full((rows_out, *shape), 7, dtype=dtype)
    theirs = torch.full((rows_out, *shape), 7, dtype=dtype)
    dist.all_to_all_single(theirs, x.clone(), recv, send, group=group)
    handle = labkit.comm.all_to_all_single(ours, x, recv, send, group=group, async_op=seed % 2 == 1)
    if handle is not None:
        handle.wait()
    return ours, theirs, send, x


CASES = [
    ("even", (), torch.float32, 1),
    ("even", (3, 2), torch.float64, 2),
    ("even", (5,), torch.int64, 3),
    ("uneven", (4,), torch.float32, 4),
    ("uneven", (), torch.float64, 5),
    ("uneven", (2, 3), torch.int32, 6),
    ("empty", (4,), torch.float32, 7),
    ("large", (1024,), torch.float32, 8),
]


def _equal_rank(world_size):
    from labkit.observe import tracing

    rank, n = dist.get_rank(), dist.get_world_size()
    bad = []
    for case in CASES:
        ours, theirs, _, _ = _one(rank, n, case)
        if not torch.equal(ours, theirs):
            bad.append(f"{case}: differs from dist.all_to_all_single")
    # A subgroup (not the world, not starting at 0): ranks 1.. of the world.
    sub = dist.new_group(list(range(1, n)))
    if rank >= 1 and n - 1 >= 1:
        for case in CASES[3:5]:
            ours, theirs, _, _ = _one(rank - 1, n - 1, case, group=sub)
            if not torch.equal(ours, theirs):
                bad.append(f"subgroup {case}: differs")
    # Autograd: the backward is the all-to-all with the splits swapped.
    m = _matrix(n, 11, 0, 4)
    send, recv = m[rank], [m[i][rank] for i in range(n)]
    x = _input(sum(send), (3,), torch.float64, rank, 12).requires_grad_()
    y = A.all_to_all_autograd(x, recv, send)
    c = _input(sum(recv), (3,), torch.float64, rank, 13)
    (y * c).sum().backward()
    want = torch.empty_like(x)
    dist.all_to_all_single(want, c, send, recv)
    if not torch.equal(x.grad, want):
        bad.append("autograd: x.grad is not the swapped all-to-all of the output's gradient")
    # The trace: the bytes this rank sent, against the formula (no inter-node link: all intra).
    events = tracing._recorder.events if tracing._recorder is not None else []
    a2a = [e for e in events if e["op"] == "all_to_all_single"]
    _, _, send, x = _one(rank, n, ("uneven", (4,), torch.float32, 4))
    got = [e for e in tracing._recorder.events if e["op"] == "all_to_all_single"][len(a2a)]
    want_bytes = A.wire_bytes(send, rank, 4 * 4)
    if got.get("intra_bytes", 0) + got.get("inter_bytes", 0) != want_bytes or got["nbytes"] != x.numel() * 4:
        bad.append(f"trace: {got} against {want_bytes} wire bytes")
    # Priced on the two-level network: what went to the other node's ranks, header and rows.
    topo = labkit.topology()
    first = A.wire_bytes([0] * n, rank, 0) // (n - 1)
    far = [j for j in range(n) if topo.node_of(j) != topo.node]
    if got.get("inter_bytes", 0) != sum(first + 16 * send[j] for j in far):
        bad.append(f"trace: {got.get('inter_bytes')} bytes across nodes, to ranks {far}")
    return bad


def _refusal_rank():
    rank, n = dist.get_rank(), dist.get_world_size()
    x, out = torch.zeros(2 * n, 3), torch.zeros(2 * n, 3)
    local = {
        "wrong sum": dict(input_split_sizes=[1] * n),
        "wrong length": dict(input_split_sizes=[2 * n]),
        "not divisible": dict(input=torch.zeros(2 * n + 1, 3)),
    }
    bad = []
    for name, change in local.items():
        args = {**dict(output=out, input=x), **change}
        for who, fn in (("ours", labkit.comm.all_to_all_single), ("torch", dist.all_to_all_single)):
            try:
                fn(**args)
                bad.append(f"{name}: {who} accepted it")
            except (ValueError, RuntimeError, TypeError):
                pass
    for name, args in {
        "dtype": (out.double(), x),
        "non-contiguous": (out, torch.zeros(3, 2 * n).t()),
        "0-d": (torch.zeros(()), torch.zeros(())),
        "rows": (torch.zeros(2 * n, 4), x),
        "bool sizes": (out, x, [True] * n),
        "negative": (out, x, None, [-1, 2 * n + 1] + [0] * (n - 2)),
    }.items():
        try:
            labkit.comm.all_to_all_single(*args)
            bad.append(f"{name}: accepted")
        except (ValueError, TypeError):
            pass
    # Across ranks: rank 0 sends rank 1 one row more than rank 1 expects.
    send, recv = [2] * n, [2] * n
    if rank == 0:
        send = [1, 3] + [2] * (n - 2)
    try:
        labkit.comm.all_to_all_single(torch.zeros(sum(recv)), torch.zeros(sum(send)), recv, send)
        bad.append("disagreeing splits accepted")
    except CollectiveMismatchError as e:
        if "rank 0 sends rank 1 3 rows" not in str(e) or "expects 2" not in str(e):
            bad.append(f"disagreeing splits: {e}")
    # Rows of another size on rank 0: every rank raises, naming each rank's.
    try:
        cols = 3 if rank == 0 else 2
        labkit.comm.all_to_all_single(torch.zeros(n, cols), torch.zeros(n, cols))
        bad.append("rows of different sizes accepted")
    except CollectiveMismatchError as e:
        if "rank 0: 3" not in str(e) or "rank 1: 2" not in str(e):
            bad.append(f"rows: {e}")
    # Another collective at the same point: every rank raises.
    try:
        if rank == 0:
            C.ring_all_reduce(torch.ones(4))
        else:
            labkit.comm.all_to_all_single(torch.zeros(n), torch.zeros(n))
        bad.append("an all-reduce met by an all-to-all passed")
    except CollectiveMismatchError as e:
        if "all_to_all_single" not in str(e) or "ring_all_reduce" not in str(e):
            bad.append(f"another collective: {e}")
    # And the group still works.
    out = torch.zeros(n)
    labkit.comm.all_to_all_single(out, torch.full((n,), float(rank)))
    if out.tolist() != [float(i) for i in range(n)]:
        bad.append(f"after the errors: {out.tolist()}")
    return bad


@pytest.mark.parametrize("world_size", [2, 4])
def test_equals_gloo_all_to_all_single(world_size):
    # 4 ranks as 2 simulated nodes: the messages to the other node pay the link and count as inter.
    nodes = world_size // 2
    results = labkit.run(_equal_rank, world_size, world_size=world_size, nodes=nodes, timeout=180.0)
    assert all(r == [] for r in results), results


def test_refusals_local_and_across_ranks():
    results = labkit.run(_refusal_rank, world_size=3, timeout=120.0)
    assert all(r == [] for r in results), results


def test_one_process_is_a_copy():
    out = torch.zeros(4, 2)
    labkit.comm.all_to_all_single(out, torch.arange(8.0).view(4, 2))
    assert out.flatten().tolist() == list(range(8))
    with pytest.raises(ValueError, match="sum to 3"):
        labkit.comm.all_to_all_single(out, torch.zeros(4, 2), None, [3])
