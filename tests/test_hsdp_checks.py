"""hsdp_lab's checks: the references pass, and each learner mistake fails with the hint that
names it (4 ranks as 2 simulated nodes x 2)."""

import pytest

from labkit.comm.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from labkit.labs import hsdp_checks as HC, hsdp_lab as H
from labkit.labs.fsdp_lab import shard_rows


def _pad(t, per):
    rows = -(-t.shape[0] // per)
    out = t.new_zeros((rows * per, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out, rows


def hier_flat(t, mesh):
    ring_all_reduce(t)


def hier_no_cross(t, mesh):
    flat, rows = _pad(t, 2)
    shard = flat.new_empty(rows)
    ring_reduce_scatter(shard, flat, group=mesh.get_group("shard"))
    ring_all_gather(flat, shard, group=mesh.get_group("shard"))
    t.copy_(flat[: t.numel()])


def hier_no_gather(t, mesh):
    flat, rows = _pad(t, 2)
    shard = flat.new_empty(rows)
    ring_reduce_scatter(shard, flat, group=mesh.get_group("shard"))
    ring_all_reduce(shard, group=mesh.get_group("replicate"))
    flat.view(2, -1)[mesh.get_local_rank("shard")].copy_(shard)
    t.copy_(flat[: t.numel()])


def hier_avg(t, mesh):
    H.hier_all_reduce(t, mesh)
    t.div_(4)


def hier_swapped(t, mesh):  # right sum, the slow way: reduce-scatter across nodes, all-reduce within
    flat, rows = _pad(t, 2)
    shard = flat.new_empty(rows)
    ring_reduce_scatter(shard, flat, group=mesh.get_group("replicate"))
    ring_all_reduce(shard, group=mesh.get_group("shard"))
    ring_all_gather(flat, shard, group=mesh.get_group("replicate"))
    t.copy_(flat[: t.numel()])


def hier_unpadded(t, mesh):
    shard = t.new_empty(t.numel() // 2)
    ring_reduce_scatter(shard, t, group=mesh.get_group("shard"))


def not_written(*args):
    raise NotImplementedError


@pytest.mark.parametrize(
    "fn, hint",
    [
        (hier_no_cross, "only your node's ranks"),
        (hier_no_gather, "all-gather it within the node"),
        (hier_avg, "an average"),
        (hier_swapped, "swapped groups"),
        (hier_unpadded, "pad to a multiple"),
        (hier_flat, "one flat all-reduce over all 4 ranks"),
    ],
)
def test_hier_mistakes_are_named(fn, hint):
    with pytest.raises(AssertionError, match=hint):
        HC.check_hier(fn)


def test_references_pass():
    HC.check_hier(H.hier_all_reduce)
    HC.check_shard_gather(H.shard_for_node, H.gather_in_node)
    HC.check_grad_path(H.reduce_grad_shard)
    HC.check_choice(H.choose_shard_size)


def test_not_implemented_is_reported_as_such():
    with pytest.raises(NotImplementedError):
        HC.check_hier(not_written)
    with pytest.raises(NotImplementedError):
        HC.check_choice(not_written)


def shard_world(full, mesh):
    import torch.distributed as dist

    return shard_rows(full, dist.get_rank(), 4)


def shard_global_rank(full, mesh):
    import torch.distributed as dist

    return shard_rows(full, dist.get_rank(), 2)


def shard_swapped(full, mesh):
    return shard_rows(full, 1 - mesh.get_local_rank("shard"), 2)


def gather_world(shard, dim0, mesh):  # every rank's shards: the other node's too (crosses)
    out = shard.new_empty((shard.shape[0] * 4, *shard.shape[1:]))
    ring_all_gather(out, shard.contiguous())
    return out.view(2, -1, *shard.shape[1:])[0].reshape(-1, *shard.shape[1:])[:dim0]


def gather_padded(shard, dim0, mesh):
    return H.gather_in_node(shard, shard.shape[0] * 2, mesh)


@pytest.mark.parametrize(
    "shard, gather, hint",
    [
        (shard_world, H.gather_in_node, "sharded over all 4 ranks"),
        (shard_global_rank, H.gather_in_node, "global rank"),
        (shard_swapped, H.gather_in_node, "rank r of the node keeps rows"),
        (H.shard_for_node, gather_padded, "drop the padding"),
        (H.shard_for_node, gather_world, "crossed|across nodes"),
    ],
)
def test_shard_gather_mistakes_are_named(shard, gather, hint):
    with pytest.raises(AssertionError, match=hint):
        HC.check_shard_gather(shard, gather)


def grad_node_only(grad, mesh):
    flat, rows = _pad(grad, 2)
    out = grad.new_empty((rows, *grad.shape[1:]))
    ring_reduce_scatter(out, flat, group=mesh.get_group("shard"))
    return out


def grad_avg(grad, mesh):
    return H.reduce_grad_shard(grad, mesh) / 4


def grad_unpadded(grad, mesh):
    return H.reduce_grad_shard(grad, mesh)[: grad.shape[0] // 2]


@pytest.mark.parametrize(
    "fn, hint",
    [
        (grad_node_only, "only your node's gradients"),
        (grad_avg, "SUM, not AVG"),
        (grad_unpadded, "ceil\\(rows / 2\\) rows"),
    ],
)
def test_grad_path_mistakes_are_named(fn, hint):
    with pytest.raises(AssertionError, match=hint):
        HC.check_grad_path(fn)


@pytest.mark.parametrize(
    "choose, hint",
    [
        (lambda rows, b: min(rows, key=lambda r: r["state_bytes"])["shard"], "least memory"),
        (lambda rows, b: 1, "keep only the rows"),
        (
            lambda rows, b: max(r["shard"] for r in rows if r["state_bytes"] <= b) if b < 30e6 else 1,
            "keep only the rows",
        ),
    ],
)
def test_choice_mistakes_are_named(choose, hint):
    with pytest.raises(AssertionError, match=hint):
        HC.check_choice(choose)


# ---------------------------------------------------------------- issue 30: returns, and the order


def hier_returns_its_tensor(t, mesh):  # a right answer that also returns the tensor
    H.hier_all_reduce(t, mesh)
    return t


def hier_returns_a_copy(t, mesh):  # the sum in a new tensor; the one passed in never written
    out = t.clone()
    H.hier_all_reduce(out, mesh)
    return out


def hier_whole_across_first(t, mesh):  # right sum: the whole tensor across nodes, then in the node
    ring_all_reduce(t, group=mesh.get_group("replicate"))
    flat, rows = _pad(t.reshape(-1), 2)
    shard = flat.new_empty(rows)
    ring_reduce_scatter(shard, flat, group=mesh.get_group("shard"))
    ring_all_gather(flat, shard, group=mesh.get_group("shard"))
    t.copy_(flat[: t.numel()])


def test_hier_accepts_a_returned_tensor(capsys):
    HC.check_hier(hier_returns_its_tensor)
    assert "two-level all-reduce: sums right on all 4 ranks" in capsys.readouterr().out


def test_hier_returned_copy_says_in_place():
    with pytest.raises(AssertionError, match="IN PLACE") as err:
        HC.check_hier(hier_returns_a_copy)
    assert str(err.value).startswith("rank 0, 1001 elements: the returned tensor holds the sum")


def test_hier_whole_tensor_across_first_names_the_order():
    with pytest.raises(AssertionError) as err:
        HC.check_hier(hier_whole_across_first)
    text = str(err.value)
    assert text.startswith("the sum is right, but a rank sent 1048") and "bytes across nodes" in text
    assert "the WHOLE tensor across nodes" in text and "before the in-node reduce-scatter" in text
    assert "swapped groups" not in text


# ---------------------------------------------------------------- issue 36: each mistake its own hint
# (classes 2-4): the check that fails FIRST, and the hint that names the mistake


def _first_failure(check, *fns):
    with pytest.raises(AssertionError) as err:
        check(*fns)
    return str(err.value)


def hier_torch_flat(t, mesh):  # right sum, torch's own collective: invisible to the tracer and link
    import torch.distributed as dist

    dist.all_reduce(t)


def hier_torch_two_level(t, mesh):  # a correct two-level all-reduce, written with torch's collectives
    import torch.distributed as dist

    flat, rows = _pad(t, 2)
    shard = flat.new_empty(rows)
    dist.reduce_scatter_tensor(shard, flat, group=mesh.get_group("shard"))
    dist.all_reduce(shard, group=mesh.get_group("replicate"))
    dist.all_gather_into_tensor(flat, shard, group=mesh.get_group("shard"))
    t.copy_(flat[: t.numel()])


def _hier_with_group(within):
    def fn(t, mesh):
        flat, rows = _pad(t, 2)
        shard = flat.new_empty(rows)
        ring_reduce_scatter(shard, flat, group=within(mesh))
        ring_all_reduce(shard, group=mesh.get_group("replicate"))
        ring_all_gather(flat, shard, group=mesh.get_group("shard"))
        t.copy_(flat[: t.numel()])

    return fn


def hier_gather_across(t, mesh):  # the last step over the wrong group: the other node's same rows
    flat, rows = _pad(t, 2)
    shard = flat.new_empty(rows)
    ring_reduce_scatter(shard, flat, group=mesh.get_group("shard"))
    ring_all_reduce(shard, group=mesh.get_group("replicate"))
    ring_all_gather(flat, shard, group=mesh.get_group("replicate"))
    t.copy_(flat[: t.numel()])


def hier_world_reduce_scatter(t, mesh):  # group= left out: the world's 4 ranks, buffers for 2
    flat, rows = _pad(t, 2)
    shard = flat.new_empty(rows)
    ring_reduce_scatter(shard, flat)


@pytest.mark.parametrize(
    "fn, starts, hint",
    [
        (hier_torch_flat, "1001 elements: the values are right, but it called torch", "use labkit's ring_"),
        (
            hier_torch_two_level,
            "1001 elements: the values are right, but it called torch",
            "use labkit's ring_",
        ),
        (_hier_with_group(lambda m: m), "rank 0, 1001 elements: raised ValueError", "not the DeviceMesh"),
        (_hier_with_group(lambda m: m["shard"]), "rank 0, 1001 elements: raised", "not the DeviceMesh"),
        (_hier_with_group(lambda m: "shard"), "rank 0, 1001 elements: raised", "not a name"),
        (hier_world_reduce_scatter, "rank 0, 1001 elements: raised", "no group=: the world's 4 ranks"),
        (hier_flat, "the sum is right, but a rank sent ", "one flat all-reduce over all 4 ranks"),
        (hier_gather_across, "rank 0, 1001 elements: wrong sum", "the all-gather ran across nodes"),
    ],
)
def test_hier_issue36_mistakes_fail_first_with_their_hint(fn, starts, hint):
    text = _first_failure(HC.check_hier, fn)
    assert text.startswith(starts), text
    assert hint in text.split("\nhint: ")[1], text
    assert "pad to a multiple" not in text


def test_hier_torch_refusal_says_why():
    text = _first_failure(HC.check_hier, hier_torch_two_level)
    assert "dist.all_reduce" in text and "bypass the course's tracer" in text and "0 ms" in text


def gather_torch(shard, dim0, mesh):
    import torch.distributed as dist

    out = shard.new_empty((shard.shape[0] * 2, *shard.shape[1:]))
    dist.all_gather_into_tensor(out, shard.contiguous(), group=mesh.get_group("shard"))
    return out[:dim0]


def gather_mesh_group(shard, dim0, mesh):
    out = shard.new_empty((shard.shape[0] * 2, *shard.shape[1:]))
    ring_all_gather(out, shard.contiguous(), group=mesh)
    return out[:dim0]


@pytest.mark.parametrize(
    "gather, starts, hint",
    [
        (
            gather_torch,
            "gather, a (7, 3) tensor: the values are right, but it called torch",
            "ring_all_gather",
        ),
        (
            gather_mesh_group,
            "rank 0 (node 0, local rank 0), a (7, 3) tensor: gather raised",
            "not the DeviceMesh",
        ),
    ],
)
def test_shard_gather_issue36_mistakes(gather, starts, hint):
    text = _first_failure(HC.check_shard_gather, H.shard_for_node, gather)
    assert text.startswith(starts), text
    assert hint in text.split("\nhint: ")[1], text


def grad_whole_across_first(grad, mesh):  # right values: the whole gradient crosses, then in-node
    g = grad.clone()
    ring_all_reduce(g, group=mesh.get_group("replicate"))
    flat, rows = _pad(g, 2)
    out = g.new_empty((rows, *g.shape[1:]))
    ring_reduce_scatter(out, flat, group=mesh.get_group("shard"))
    return out


def grad_flat(grad, mesh):  # right values: one flat all-reduce, then this rank's rows
    g = grad.clone()
    ring_all_reduce(g)
    return shard_rows(g, mesh.get_local_rank("shard"), 2)


def grad_gather_too(grad, mesh):  # right values: the shard, gathered in the node, then sliced again
    out = H.reduce_grad_shard(grad, mesh)
    whole = out.new_empty((out.shape[0] * 2, *out.shape[1:]))
    ring_all_gather(whole, out, group=mesh.get_group("shard"))
    return whole.view(2, *out.shape)[mesh.get_local_rank("shard")].clone()


def grad_torch(grad, mesh):
    import torch.distributed as dist

    flat, rows = _pad(grad, 2)
    out = grad.new_empty((rows, *grad.shape[1:]))
    dist.reduce_scatter_tensor(out, flat, group=mesh.get_group("shard"))
    dist.all_reduce(out, group=mesh.get_group("replicate"))
    return out


def grad_mesh_group(grad, mesh):
    flat, rows = _pad(grad, 2)
    out = grad.new_empty((rows, *grad.shape[1:]))
    ring_reduce_scatter(out, flat, group=mesh)
    return out


@pytest.mark.parametrize(
    "fn, starts, hint",
    [
        (grad_whole_across_first, "the values are right, but too many bytes crossed", "2.0x too many bytes"),
        (
            grad_flat,
            "the values are right, but too many bytes crossed",
            "one flat all-reduce over all 4 ranks, then a slice: 4.0x the bytes",
        ),
        (grad_gather_too, "the values are right, but 2.0x the bytes moved within", "no all-gather"),
        (
            grad_torch,
            "a (512, 256) gradient: the values are right, but it called torch",
            "ring_reduce_scatter",
        ),
        (grad_mesh_group, "rank 0, a (7, 3) gradient: raised", "not the DeviceMesh"),
    ],
)
def test_grad_path_issue36_mistakes(fn, starts, hint):
    text = _first_failure(HC.check_grad_path, fn)
    assert text.startswith(starts), text
    assert hint in text.split("\nhint: ")[1], text


def _fits(rows, b, op=lambda s, b: s <= b):
    return [r for r in rows if op(r["state_bytes"], b)]


def choose_first_fit(rows, b):
    return _fits(rows, b)[0]["shard"]


def choose_strict(rows, b):
    return min(_fits(rows, b, lambda s, b: s < b), key=lambda r: r["step_s"])["shard"]


def choose_slowest(rows, b):
    return max(_fits(rows, b), key=lambda r: r["step_s"])["shard"]


def choose_fastest_overall(rows, b):
    return min(rows, key=lambda r: r["step_s"])["shard"]


def choose_none_when_empty(rows, b):
    fits = _fits(rows, b)
    return min(fits, key=lambda r: r["step_s"])["shard"] if fits else None


def choose_wrong_key(rows, b):
    return min((r for r in rows if r["state"] <= b), key=lambda r: r["step_s"])["shard"]


def choose_the_row(rows, b):
    return min(_fits(rows, b), key=lambda r: r["step_s"])


@pytest.mark.parametrize(
    "choose, starts, hint",
    [
        (choose_first_fit, "budget 100 MB: chose shard size 1", "the first row that fits is not the fastest"),
        (choose_strict, "budget 32 MB: chose shard size 8", "<=, not <"),
        (choose_slowest, "budget 40 MB: chose shard size 4", "the slowest row that fits"),
        (choose_fastest_overall, "budget 20 MB: chose shard size 2", "shard 2 needs 32 MB per rank"),
        (choose_none_when_empty, "budget 5 MB: no row fits, and it returned None", "raise ValueError"),
        (choose_wrong_key, "budget 40 MB: raised KeyError", "keys 'shard', 'step_s', 'state_bytes'"),
        (choose_the_row, "budget 40 MB: chose shard size {", "not the row"),
        (
            lambda rows, b: min(rows, key=lambda r: r["state_bytes"])["shard"],
            "budget 40 MB: chose shard size 8",
            "least memory",
        ),
    ],
)
def test_choice_issue36_mistakes(choose, starts, hint):
    text = _first_failure(HC.check_choice, choose)
    assert text.startswith(starts), text
    assert hint in text.split("\nhint: ")[1], text
    assert "keep only the rows" not in text or "needs 32 MB" in text
