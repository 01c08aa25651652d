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
        (hier_flat, "swapped groups or a flat all-reduce"),
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
