"""Issue 36, tp_lab: each learner mistake fails ITS OWN exercise's check FIRST, with a hint that
names it. Exercises 1-3 run on 4 ranks as a ("tp", "dp") mesh (tp groups {0, 2} and {1, 3}), so a
tp group is not the world and a rank's place in it is not its global rank: f / g over the default
group, a piece picked by dist.get_rank(), torch's own collectives, and each sub-block's mistakes
(the attention's and the MLP's apart) are named where they are. Each case is one launch."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.comm.collectives import ring_all_gather, ring_all_reduce
from labkit.labs import tp_checks as TC, tp_lab as T


def _fails_with(check, *args, hint, first=None):
    """check(*args) raises AssertionError whose hint contains `hint` (and whose first line
    contains `first`: which check failed)."""
    with pytest.raises(AssertionError) as err:
        check(*args)
    text = str(err.value)
    assert hint in text, text
    if first is not None:
        assert first in text.splitlines()[0], text
    return text


# ---------------------------------------------------------------- 1. f and g
def _summed(t, group=None, op="sum"):
    out = t.contiguous().clone()
    ring_all_reduce(out, op=op, group=group)
    return out


class _FWorld(torch.autograd.Function):  # the all-reduce over the default group
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad), None


class _GWorld(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _summed(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _FTorch(torch.autograd.Function):  # right values, torch's own collective
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class _GTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _FInPlace(torch.autograd.Function):  # all-reduces the gradient it was given, in place
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ring_all_reduce(grad, group=ctx.group)
        return grad, None


def f_world(x, group):
    return _FWorld.apply(x, group)


def g_world(x, group):
    return _GWorld.apply(x, group)


def f_torch(x, group):
    return _FTorch.apply(x, group)


def g_torch(x, group):
    return _GTorch.apply(x, group)


def f_in_place(x, group):
    return _FInPlace.apply(x, group)


@pytest.mark.parametrize(
    "f, g, first, hint",
    [
        (f_world, T.g_op, "f backward", "f's backward all-reduced over the default group"),
        (T.f_op, g_world, "g forward", "g's forward all-reduced over the default group"),
        (f_torch, T.g_op, "f backward", "torch.distributed's own collectives (all_reduce) bypass"),
        (T.f_op, g_torch, "g forward", "torch.distributed's own collectives (all_reduce) bypass"),
        (f_in_place, T.g_op, "f backward", "f's backward all-reduced the gradient it was given in place"),
    ],
)
def test_conjugate_mistakes_on_a_group_that_is_not_the_world(f, g, first, hint):
    _fails_with(TC.check_conjugates, f, g, hint=hint, first=first)


# ---------------------------------------------------------------- 2. the linears
class ColWorldRank(T.ColumnParallelLinear):
    def __init__(self, full, group, copy_input=True):
        super().__init__(full, group, copy_input)
        rank = dist.get_rank()  # the world's rank, not the group's
        self.weight = torch.nn.Parameter(torch.chunk(full.weight.detach(), 2, 0)[rank].clone())
        self.bias = torch.nn.Parameter(torch.chunk(full.bias.detach(), 2)[rank].clone())


class RowWorldRank(T.RowParallelLinear):
    def __init__(self, full, group):
        super().__init__(full, group)
        rank = dist.get_rank() % dist.get_world_size(group)  # right only where groups are contiguous
        self.weight = torch.nn.Parameter(torch.chunk(full.weight.detach(), 2, 1)[rank].clone())


class ColGroupIsWorld(T.ColumnParallelLinear):  # f over the default group inside the layer
    def __init__(self, full, group, copy_input=True):
        super().__init__(full, group, copy_input, f=f_world)


@pytest.mark.parametrize(
    "col, row, first, hint",
    [
        (
            ColWorldRank,
            T.RowParallelLinear,
            "rank 1 (0 of tp group [1, 3]), 0.weight",
            "dist.get_rank() is the rank in the WORLD",
        ),
        (
            T.ColumnParallelLinear,
            RowWorldRank,
            "rank 1 (0 of tp group [1, 3]), 2.weight",
            "dist.get_rank() is the rank in the WORLD",
        ),
        (ColGroupIsWorld, T.RowParallelLinear, "input's gradient", "applies f to its input"),
    ],
)
def test_linear_mistakes_on_a_group_that_is_not_the_world(col, row, first, hint):
    _fails_with(TC.check_linears, col, row, hint=hint, first=first)


# ---------------------------------------------------------------- 3. the blocks, each sub-block apart
class AttnNoMask(T.TPAttention):
    def forward(self, x):
        B, T_, _ = x.shape
        x = self.f(x, self.group)
        q, k, v = (
            p(x).view(B, T_, self.local_heads, self.head_dim).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, T_, -1))


class AttnNoTranspose(T.TPAttention):
    def forward(self, x):
        B, T_, _ = x.shape
        x = self.f(x, self.group)
        q, k, v = (p(x).view(B, self.local_heads, T_, self.head_dim) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T_, -1))


class AttnHeadDimFirst(T.TPAttention):
    def forward(self, x):
        B, T_, _ = x.shape
        x = self.f(x, self.group)
        q, k, v = (
            p(x).view(B, T_, self.head_dim, self.local_heads).permute(0, 3, 1, 2)
            for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T_, -1))


class AttnMergeNoTranspose(T.TPAttention):
    def forward(self, x):
        B, T_, _ = x.shape
        x = self.f(x, self.group)
        q, k, v = (
            p(x).view(B, T_, self.local_heads, self.head_dim).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.reshape(B, T_, -1))


class AttnExtraG(T.TPAttention):
    def forward(self, x):
        return T.g_op(super().forward(x), self.group)


class AttnNoF(T.TPAttention):
    def __init__(self, attn, group):
        super().__init__(attn, group, f=lambda x, group: x)


class AttnOColumn(T.TPAttention):
    def __init__(self, attn, group):
        super().__init__(attn, group)
        self.o = T.ColumnParallelLinear(attn.o, group)


class AttnWorldHeads(T.TPAttention):
    def __init__(self, attn, group):
        super().__init__(attn, group)
        self.local_heads = attn.n_heads // dist.get_world_size()  # the world's size: 4


class AttnTorchCollectives(T.TPAttention):
    def __init__(self, attn, group):
        super().__init__(attn, group, f=f_torch)


class MLPTanh(T.TPMLP):
    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class MLPRelu(T.TPMLP):
    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class MLPSwapped(T.TPMLP):
    def __init__(self, mlp, group):
        super().__init__(mlp, group)
        self.fc1, self.fc2 = T.RowParallelLinear(mlp.fc1, group), T.ColumnParallelLinear(mlp.fc2, group)


class MLPExtraG(T.TPMLP):
    def forward(self, x):
        return T.g_op(super().forward(x), self.fc2.group)


class MLPNoF(T.TPMLP):
    def __init__(self, mlp, group):
        super().__init__(mlp, group)
        self.fc1 = T.ColumnParallelLinear(mlp.fc1, group, copy_input=False)


class MLPWorldRank(torch.nn.Module):
    def __init__(self, mlp, group):
        super().__init__()
        self.fc1, self.fc2 = ColWorldRank(mlp.fc1, group), T.RowParallelLinear(mlp.fc2, group)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize(
    "mlp, attn, first, hint",
    [
        (T.TPMLP, AttnNoMask, "attention: the output differs", "the causal mask is missing"),
        (T.TPMLP, AttnNoTranspose, "attention: the output differs", "not view(B, heads, T, head_dim)"),
        (T.TPMLP, AttnHeadDimFirst, "attention: the output differs", "not (B, T, head_dim, heads)"),
        (T.TPMLP, AttnMergeNoTranspose, "attention: the output differs", "merged back wrong"),
        (T.TPMLP, AttnExtraG, "attention: the output differs", "an extra g"),
        (T.TPMLP, AttnNoF, "attention: the input's gradient", "attention: f is missing"),
        (T.TPMLP, AttnOColumn, "attention: o.weight", "o is row-parallel, yours is column-parallel"),
        (T.TPMLP, AttnWorldHeads, "attention", "n_heads / tp heads"),
        (T.TPMLP, AttnTorchCollectives, "attention, backward", "bypass the course's traced ring"),
        (MLPTanh, T.TPAttention, "MLP: the output differs", "the tanh approximation of GELU"),
        (MLPRelu, T.TPAttention, "MLP: the output differs", "MLP: ReLU"),
        (MLPSwapped, T.TPAttention, "MLP: fc1.weight", "fc1 and fc2 swapped"),
        (MLPExtraG, T.TPAttention, "MLP: the output differs", "an extra g"),
        (MLPNoF, T.TPAttention, "MLP: the input's gradient", "MLP: f is missing"),
        (MLPWorldRank, T.TPAttention, "MLP: fc1.weight", "dist.get_rank() is the rank in the WORLD"),
    ],
)
def test_block_mistakes_are_named_in_their_sub_block(mlp, attn, first, hint):
    _fails_with(TC.check_blocks, mlp, attn, hint=hint, first=first)


# ---------------------------------------------------------------- 4. FSDP x TP
def _padded(t, n, rows=None):
    rows = rows or -(-t.shape[0] // n)
    out = t.new_zeros((rows * n, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out, rows


def shard_floor_plus_one(local, mesh):
    padded, rows = _padded(local, 2, local.shape[0] // 2 + 1)
    r = mesh.get_local_rank("dp")
    return padded[r * rows : (r + 1) * rows].clone()


def reduce_by_all_reduce(grad, mesh):
    padded, rows = _padded(grad, 2)
    ring_all_reduce(padded, op="avg", group=mesh.get_group("dp"))
    r = mesh.get_local_rank("dp")
    return padded[r * rows : (r + 1) * rows].clone()


def gather_mesh_as_group(shard, dim0, mesh):
    out = shard.new_empty((shard.shape[0] * 2, *shard.shape[1:]))
    ring_all_gather(out, shard.contiguous(), group=mesh)
    return out[:dim0]


def reduce_torch(grad, mesh):
    padded, rows = _padded(grad, 2)
    out = grad.new_empty((rows, *grad.shape[1:]))
    dist.reduce_scatter_tensor(out, padded, group=mesh.get_group("dp"))
    return out / 2


REF = (T.shard_over_dp, T.gather_over_dp, T.reduce_grad_over_dp)


@pytest.mark.parametrize(
    "fns, first, hint",
    [
        (
            (shard_floor_plus_one, *REF[1:]),
            "a (6, 2) TP-local tensor: shard",
            "rows // dp + 1 = 4 rows per shard",
        ),
        ((*REF[:2], reduce_by_all_reduce), "reduced: collectives", "an all-reduce, then a slice"),
        ((REF[0], gather_mesh_as_group, REF[2]), "gathered", "not the DeviceMesh"),
        ((*REF[:2], reduce_torch), "reduced: called", "bypass the course's traced ring"),
    ],
)
def test_fsdp_tp_mistakes_are_named(fns, first, hint):
    _fails_with(TC.check_fsdp_tp, *fns, hint=hint, first=first)


def test_slow_collectives_are_not_labelled_0_00_gb_per_s():
    """tp_lab's timeline: a 128 KiB all-reduce over 50 ms was labelled '0.00 GB/s'."""
    from labkit.observe import timeline

    ev = {"op": "ring_all_reduce", "nbytes": 131072, "start": 0.0, "end": 0.05, "world_size": 2}
    text = timeline._bar_label(ev, 1e6, 1.0)
    assert text.endswith("2.62 MB/s") and "GB/s" not in text, text
    fast = dict(ev, end=1e-4)
    assert timeline._bar_label(fast, 1e6, 1.0).endswith("1.31 GB/s")
