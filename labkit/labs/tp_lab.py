"""Tensor-parallel lab helpers: the lab's transformer block, the exercises' references (the
conjugate operations f / g, column- and row-parallel Linear, the TP MLP and attention blocks, the
dp sharding of FSDP x TP), torch's plan for the same block (the oracle), the scaffolding that
trains FSDP x TP by hand on a ("dp", "tp") mesh, and the rank functions and figure of the
measurements.

    block = make_block()                                  # LN -> attention -> LN -> MLP, residuals
    tp = tp_block(block, group, TPMLP, TPAttention)       # Megatron-style: 1 all-reduce fwd, 1 bwd per sub-block
    torch_tp_block(make_block(), mesh["tp"])              # torch's parallelize_module with PLAN

The block's attention has separate q, k, v projections (as torch's TP tutorial's Llama), so each
is split by heads with torch.chunk along dim 0: rank r of tp keeps heads [r*h/tp, (r+1)*h/tp).
Its forward views the projections as (B, T, -1, head_dim): the same module runs under torch's
parallelize_module, where the projections' outputs are local (use_local_output=True).
Left out: sequence parallelism, fused qkv, dropout, uneven head counts (heads % tp != 0).
The checks are tp_checks/ (one module per exercise).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from typing import TYPE_CHECKING

from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter
from labkit.strategies.tp import copy_to_tp, reduce_from_tp

if TYPE_CHECKING:  # matplotlib is imported by the figure helper only
    from matplotlib.figure import Figure

D, HEADS, HIDDEN = 16, 4, 64  # the checks' block; the measurements' is MEASURE
MEASURE = dict(d=64, heads=4, hidden=256, batch=16, seq=32)  # tokens >> d: TP's all-reduces dominate
PLAN = {
    "attn.q": "colwise",
    "attn.k": "colwise",
    "attn.v": "colwise",
    "attn.o": "rowwise",
    "mlp.fc1": "colwise",
    "mlp.fc2": "rowwise",
}


# ---------------------------------------------------------------- the model
class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    """Causal self-attention, q / k / v / o projections; heads inferred from the q projection's
    width (view(..., -1, head_dim)), so a column-parallel q (local output) gives the local heads."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.n_heads, self.head_dim = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    """A pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, d: int = D, heads: int = HEADS, hidden: int = HIDDEN):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = (
            nn.LayerNorm(d),
            Attention(d, heads),
            nn.LayerNorm(d),
            MLP(d, hidden),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def make_block(seed: int = 0, d: int = D, heads: int = HEADS, hidden: int = HIDDEN) -> Block:
    torch.manual_seed(seed)
    return Block(d, heads, hidden)


def batch(step: int, rows: int = 4, seq: int = 5, d: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of a step: the whole batch (a dp replica takes its rows)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, seq, d, generator=g), torch.randn(rows, seq, d, generator=g)


def tp_dim(name: str) -> int | None:
    """The dim a parameter of the block is split along under PLAN: 0 (colwise weight and bias),
    1 (rowwise weight), None (replicated: LayerNorms, rowwise biases)."""
    module, _, attr = name.rpartition(".")
    style = PLAN.get(module)
    if style == "colwise":
        return 0
    return 1 if style == "rowwise" and attr == "weight" else None


def tp_piece(full: torch.Tensor, name: str, rank: int, tp: int) -> torch.Tensor:
    """rank's TP-local piece of the full parameter `name` (torch.chunk's)."""
    dim = tp_dim(name)
    return full if dim is None else torch.chunk(full, tp, dim=dim)[rank]


# ---------------------------------------------------------------- exercise 1: f and g
def f_op(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Exercise 1's reference f (labkit.strategies.tp.copy_to_tp): identity forward, all-reduce backward."""
    return copy_to_tp(x, group)


def g_op(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Exercise 1's reference g (labkit.strategies.tp.reduce_from_tp): all-reduce forward, identity backward."""
    return reduce_from_tp(x, group)


# ---------------------------------------------------------------- exercise 2: the parallel linears
class ColumnParallelLinear(nn.Module):
    """Exercise 2's reference: this rank's torch.chunk of the weight's rows (output features) and
    of the bias; forward F.linear(f(x)) (f left out when copy_input=False: the caller applied it)."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup, copy_input: bool = True, f=f_op):
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.copy_input, self.f = group, copy_input, f
        self.weight = nn.Parameter(torch.chunk(full.weight.detach(), tp, dim=0)[rank].clone())
        self.bias = (
            None if full.bias is None else nn.Parameter(torch.chunk(full.bias.detach(), tp)[rank].clone())
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = self.f(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Exercise 2's reference: this rank's torch.chunk of the weight's columns (input features),
    the whole bias; forward g(F.linear(x_local)) + bias (the bias once, after the sum)."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup, g=g_op):
        super().__init__()
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.g = group, g
        self.weight = nn.Parameter(torch.chunk(full.weight.detach(), tp, dim=1)[rank].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.g(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


# ---------------------------------------------------------------- exercise 3: the blocks
class TPMLP(nn.Module):
    """Exercise 3's reference: fc1 column-parallel (f inside), GELU on the local columns, fc2
    row-parallel (g inside): one all-reduce forward (g), one backward (f)."""

    def __init__(self, mlp: MLP, group: dist.ProcessGroup, col=ColumnParallelLinear, row=RowParallelLinear):
        super().__init__()
        self.fc1, self.fc2 = col(mlp.fc1, group), row(mlp.fc2, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TPAttention(nn.Module):
    """Exercise 3's reference: f once on the input, q / k / v column-parallel without their own f
    (this rank's heads), attention on the local heads, o row-parallel (g inside)."""

    def __init__(
        self,
        attn: Attention,
        group: dist.ProcessGroup,
        col=ColumnParallelLinear,
        row=RowParallelLinear,
        f=f_op,
    ):
        super().__init__()
        self.group, self.f, self.head_dim = group, f, attn.head_dim
        self.local_heads = attn.n_heads // dist.get_world_size(group)
        self.q, self.k, self.v = (col(p, group, copy_input=False) for p in (attn.q, attn.k, attn.v))
        self.o = row(attn.o, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        x = self.f(x, self.group)  # once: dL/dx is summed in ONE all-reduce for q, k and v
        q, k, v = (
            p(x).view(B, T, self.local_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, self.local_heads * self.head_dim))


def tp_block(block: Block, group: dist.ProcessGroup, mlp_cls=TPMLP, attn_cls=TPAttention) -> Block:
    """`block` with its attention and MLP replaced by mlp_cls(block.mlp, group) and
    attn_cls(block.attn, group), in place (the LayerNorms stay replicated); returns it."""
    block.attn, block.mlp = attn_cls(block.attn, group), mlp_cls(block.mlp, group)
    return block


def torch_tp_block(block: Block, tp_mesh) -> Block:
    """The oracle: torch's parallelize_module with ColwiseParallel / RowwiseParallel per PLAN."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return parallelize_module(block, tp_mesh, {k: styles[v]() for k, v in PLAN.items()})


# ---------------------------------------------------------------- exercise 4: FSDP x TP
def shard_over_dp(local: torch.Tensor, mesh) -> torch.Tensor:
    """Exercise 4's reference: this rank's dim-0 shard (torch.chunk rows, zero-padded to equal
    pieces) of a TP-local tensor, over the mesh's "dp" dimension; a new tensor."""
    group = mesh.get_group("dp")
    n, r = dist.get_world_size(group), dist.get_rank(group)
    rows = -(-local.shape[0] // n)
    padded = local.new_zeros((rows * n, *local.shape[1:]))
    padded[: local.shape[0]] = local
    return padded[r * rows : (r + 1) * rows].clone()


def gather_over_dp(shard: torch.Tensor, dim0: int, mesh) -> torch.Tensor:
    """Exercise 4's reference: the dp replicas' shards all-gathered into the TP-local tensor."""
    group = mesh.get_group("dp")
    out = shard.new_empty((shard.shape[0] * dist.get_world_size(group), *shard.shape[1:]))
    ring_all_gather(out, shard.contiguous(), group=group)
    return out[:dim0]


def reduce_grad_over_dp(grad: torch.Tensor, mesh) -> torch.Tensor:
    """Exercise 4's reference: this rank's shard of the AVERAGE over "dp" of a TP-local gradient
    (each replica's loss is the mean over its own rows, as under fully_shard)."""
    group = mesh.get_group("dp")
    n = dist.get_world_size(group)
    rows = -(-grad.shape[0] // n)
    padded = grad.new_zeros((rows * n, *grad.shape[1:]))
    padded[: grad.shape[0]] = grad
    out = grad.new_empty((rows, *grad.shape[1:]))
    ring_reduce_scatter(out, padded, op="avg", group=group)
    return out


class FSDPxTP:
    """FSDP x TP by hand, the whole model one unit (the lab's scaffolding around exercise 4): a
    TP block's TP-local parameters flattened into one vector (FSDP's flat parameter), sharded
    over "dp" with `shard`; forward gathers it (over "dp") first; after backward the flat
    gradient goes through `reduce_grad` into the shard's gradient and the gathered parameters
    are freed; SGD on the shard. One all-gather and one reduce-scatter per step.
    Leaves out: units, prefetch and overlap, mixed precision, optimizers with state."""

    def __init__(
        self,
        model: nn.Module,
        mesh,
        lr: float,
        shard=shard_over_dp,
        gather=gather_over_dp,
        reduce_grad=reduce_grad_over_dp,
    ):
        self.model, self.mesh, self.gather, self.reduce_grad = model, mesh, gather, reduce_grad
        self.names, self.params = zip(*model.named_parameters())
        self.shapes = [p.shape for p in self.params]
        self.sizes = [p.numel() for p in self.params]
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = nn.Parameter(shard(flat, mesh))
        self.optimizer = torch.optim.SGD([self.shard], lr=lr)
        self.reshard()

    def _gathered(self) -> list[torch.Tensor]:
        flat = self.gather(self.shard.detach(), sum(self.sizes), self.mesh)
        return [piece.view(shape) for piece, shape in zip(flat.split(self.sizes), self.shapes)]

    def unshard(self) -> None:
        for p, full in zip(self.params, self._gathered()):
            p.data = full

    def reshard(self) -> None:
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.unshard()
        return self.model(x)

    def after_backward(self) -> None:
        self.shard.grad = self.reduce_grad(torch.cat([p.grad.reshape(-1) for p in self.params]), self.mesh)
        for p in self.params:
            p.grad = None
        self.reshard()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def local_state(self) -> dict[str, torch.Tensor]:
        """{name: TP-local parameter}, gathered over "dp"."""
        return {n: t.clone() for n, t in zip(self.names, self._gathered())}


def full_state(local: dict[str, torch.Tensor], tp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """The whole parameters from every tp rank's TP-local ones (all-gathered along their tp_dim;
    even splits only), with torch's all_gather: a read-out, not part of the algorithm."""
    tp = dist.get_world_size(tp_group)
    out = {}
    for name, t in local.items():
        dim = tp_dim(name)
        if dim is None:
            out[name] = t.clone()
            continue
        pieces = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(pieces, t.contiguous(), group=tp_group)
        out[name] = torch.cat(pieces, dim=dim)
    return out


def train_fsdp_tp(
    mesh_dims: tuple[str, str] = ("dp", "tp"),
    steps: int = 3,
    lr: float = 0.1,
    dp_fns: tuple = (shard_over_dp, gather_over_dp, reduce_grad_over_dp),
    blocks: tuple = (TPMLP, TPAttention),
    size: dict | None = None,
) -> dict:
    """Rank function (4 ranks): FSDP x TP by hand on init_device_mesh("cpu", (2, 2),
    mesh_dim_names=mesh_dims), each dp replica on its rows of the whole batch, `steps` SGD steps;
    dp_fns: exercise 4's (shard, gather, reduce_grad); blocks: exercise 3's (TP MLP, TP attention)
    classes. Returns {"loss": per step, "state": the whole parameters after training, "windows":
    each step's (start, end) on the trace clock}. size: MEASURE-like dict for a bigger block."""
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.comm import collectives
    from labkit.observe import tracing

    collectives.DIRECT_MAX_BYTES = 0  # rings everywhere: the byte formulas are the ring's
    size = size or dict(d=D, heads=HEADS, hidden=HIDDEN, batch=4, seq=5)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=mesh_dims)
    tp_group, dp_rank = mesh.get_group("tp"), mesh.get_local_rank("dp")
    model = tp_block(make_block(0, size["d"], size["heads"], size["hidden"]), tp_group, *blocks)
    fsdp = FSDPxTP(model, mesh, lr, *dp_fns)
    rows = size["batch"] // 2
    out = {"loss": [], "windows": []}
    for step in range(steps):
        x, y = batch(step, size["batch"], size["seq"], size["d"])
        x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
        dist.barrier()
        start = tracing.clock()
        loss = F.mse_loss(fsdp(x), y)
        loss.backward()
        fsdp.after_backward()
        fsdp.step()
        out["windows"].append((start, tracing.clock()))
        out["loss"].append(loss.item())
    out["state"] = full_state(fsdp.local_state(), tp_group)
    return out


def train_torch_fsdp_tp(steps: int = 3, lr: float = 0.1) -> dict:
    """Rank function (4 ranks): the oracle, torch's parallelize_module on mesh["tp"] +
    fully_shard(mesh=mesh["dp"]), the same batches and steps as train_fsdp_tp."""
    import logging

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # full_tensor() of a 2-D sharded DTensor warns (stderr) that it takes two all-gathers: torch's
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = torch_tp_block(make_block(0), mesh["tp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dp_rank, out = mesh.get_local_rank("dp"), {"loss": []}
    for step in range(steps):
        x, y = batch(step)
        x, y = x[2 * dp_rank : 2 * dp_rank + 2], y[2 * dp_rank : 2 * dp_rank + 2]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["loss"].append(loss.item())
    out["state"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return out


def train_one_process(steps: int = 3, lr: float = 0.1, size: dict | None = None) -> dict:
    """The same training in one process, on the whole batch (each step's loss: the mean of the
    two dp replicas' losses, which are means over equal halves); size as train_fsdp_tp's."""
    size = size or dict(d=D, heads=HEADS, hidden=HIDDEN, batch=4, seq=5)
    model = make_block(0, size["d"], size["heads"], size["hidden"])
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = {"loss": []}
    for step in range(steps):
        x, y = batch(step, size["batch"], size["seq"], size["d"])
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["loss"].append(loss.item())
    out["state"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


# ---------------------------------------------------------------- measurements
def saved_bytes(fn, *args, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn(*args) runs (the
    activation memory a forward keeps), leaving out the storages of `exclude` (the parameters)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def measure_step(size: dict = MEASURE, mlp_cls=TPMLP, attn_cls=TPAttention) -> dict:
    """Rank function (2 ranks, one tp group): one forward and backward of the TP block of `size`
    (tp_block with mlp_cls and attn_cls) on one batch, every collective a ring. Returns {"windows": {"attention forward",
    "MLP forward", "backward": (start, end) on the trace clock}, "weights": bytes of this rank's
    block weights (the six matrices), "replicated": bytes of its LayerNorms and rowwise biases,
    "mlp_saved": bytes the MLP saved for backward}."""
    from labkit.comm import collectives
    from labkit.observe import tracing

    collectives.DIRECT_MAX_BYTES = 0
    group = dist.group.WORLD
    block = tp_block(make_block(0, size["d"], size["heads"], size["hidden"]), group, mlp_cls, attn_cls)
    x = batch(0, size["batch"], size["seq"], size["d"])[0].requires_grad_()
    windows = {}

    def window(name, fn, *args):
        dist.barrier()
        start = tracing.clock()
        with tracing.span(name):
            value = fn(*args)
        windows[name] = (start, tracing.clock())
        return value

    h = x + window("attention forward", block.attn, block.ln1(x))
    out = h + window("MLP forward", block.mlp, block.ln2(h))
    window("backward", out.square().mean().backward)
    params = dict(block.named_parameters())
    weights = sum(
        p.numel() * 4 for n, p in params.items() if n.endswith("weight") and n.rpartition(".")[0] in PLAN
    )
    mlp_in = block.ln2(h).detach().requires_grad_()
    return {
        "windows": windows,
        "weights": weights,
        "replicated": sum(p.numel() * 4 for p in params.values()) - weights,
        "mlp_saved": saved_bytes(block.mlp, mlp_in, exclude=block.mlp.parameters()),
    }


def all_reduces(trace: dict, window: tuple[float, float]) -> list[dict]:
    """The ring all-reduces of a trace that started inside `window`."""
    return [
        e for e in trace["events"] if e["op"] == "ring_all_reduce" and window[0] <= e["start"] < window[1]
    ]


def tp_allreduce_bytes(tokens: int, d: int, dtype_bytes: int = 4) -> int:
    """The bytes TP all-reduces per transformer layer per step (the tensors, summed): attention
    and MLP each one all-reduce of the (tokens, d) activations in forward (g) and one of their
    gradient in backward (f), 4 in all."""
    return 4 * tokens * d * dtype_bytes


def ring_sent(tensor_bytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `tensor_bytes` over n ranks: 2(n-1)/n of it."""
    return 2 * (n - 1) / n * tensor_bytes


def fsdp_tp_node_bytes(results, label: str, kind: str = "inter", rank: int | None = None) -> float:
    """Bytes per step sent across nodes ("inter") or within ("intra"), or "inter_messages", by
    every rank together (or by `rank`), from the tracer over train_fsdp_tp's step windows
    (results: labkit.run's of two_layouts, a dict of labels per rank)."""
    from labkit.observe import trace_stats

    total = sum(
        trace_stats.node_bytes(trace, t_range=w)[kind]
        for r, (trace, out) in enumerate(zip(results.traces, results))
        if rank is None or r == rank
        for w in out[label]["windows"]
    )
    return total / len(results[0][label]["windows"])


def link_seconds(results, label: str, link) -> float:
    """The slow link's cost per step of `label` by the link model: the busiest rank's traced
    cross-node bytes / bandwidth + its messages x latency (what labkit's link charges)."""
    return max(
        fsdp_tp_node_bytes(results, label, rank=r) / link.bandwidth_Bps
        + fsdp_tp_node_bytes(results, label, "inter_messages", rank=r) * link.latency_s
        for r in range(len(results))
    )


def two_layouts(**kwargs) -> dict:
    """Rank function (4 ranks as 2 nodes x 2): train_fsdp_tp with TP inside the node (mesh
    ("dp", "tp"): tp groups {0, 1}, {2, 3}) and TP across nodes (("tp", "dp"): {0, 2}, {1, 3})."""
    return {
        "TP in node": train_fsdp_tp(("dp", "tp"), **kwargs),
        "TP across nodes": train_fsdp_tp(("tp", "dp"), **kwargs),
    }


def check_layouts_train_as_one_process(results, steps: int, size: dict, atol: float = 1e-5) -> float:
    """Raise AssertionError unless every rank's whole parameters after two_layouts' training, in
    both layouts, equal one process's on the whole batch (train_one_process, same size and steps),
    and the replicas' mean loss equals its loss each step. Returns the largest difference.
    fp32 over a bigger block: other summation orders than one process, hence atol 1e-5."""
    one = train_one_process(steps, size=size)
    worst = 0.0
    for label in results[0]:
        for rank, res in enumerate(results):
            for name, want in one["state"].items():
                diff = (res[label]["state"][name] - want).abs().max().item()
                worst = max(worst, diff)
                if diff > atol:
                    raise AssertionError(
                        f"{label}, rank {rank}: {name} after {steps} steps differs from one process by {diff:.3g}"
                    )
        for step, want in enumerate(one["loss"]):
            mean = sum(r[label]["loss"][step] for r in results) / len(results)
            if abs(mean - want) > atol:
                raise AssertionError(f"{label}, step {step}: mean loss {mean:.6g}, one process {want:.6g}")
    return worst


def plot_tp_step(results, title: str = "one TP step on 2 ranks: forward, then backward") -> Figure:
    """The ranks' timeline of measure_step (compute spans and the ring all-reduces), zoomed to
    its windows (from the attention's forward to the end of backward). Shows the figure once;
    returns it."""
    from labkit.observe import timeline
    from labkit.observe.style import show_own

    offsets = dict(zip((t["rank"] for t in results.traces), timeline._rank_offsets(results.traces)))
    ends = [
        (
            (w["attention forward"][0] + offsets[t["rank"]]) * 1e3,
            (w["backward"][1] + offsets[t["rank"]]) * 1e3,
        )
        for t, w in zip(results.traces, (r["windows"] for r in results))
    ]
    lo, hi = min(a for a, _ in ends), max(b for _, b in ends)
    pad = 0.02 * (hi - lo)
    return show_own(timeline.plot_timeline(results.traces, title=title, t_range=(lo - pad, hi + pad)))


def plot_layout_bytes(across: dict[str, float], within: dict[str, float]) -> Figure:
    """Bars of the bytes per step (every rank together) sent across and within nodes, per mesh
    layout, in KiB. Shows the figure once; returns it."""
    import matplotlib.pyplot as plt

    from labkit.observe.style import show_own, use_course_style

    use_course_style()
    labels, width = list(across), 0.38
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for shift, values, name, color in (
        (-width / 2, across, "across nodes (slow link)", "#d62728"),
        (width / 2, within, "within a node", "#1f77b4"),
    ):
        bars = ax.bar(
            [i + shift for i in range(len(labels))],
            [values[k] / 2**10 for k in labels],
            width,
            label=name,
            color=color,
        )
        ax.bar_label(bars, fmt="%.0f KiB", fontsize=11)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("KiB per step")
    ax.set_ylim(0, 1.25 * max(max(across.values()), max(within.values())) / 2**10)
    ax.set_title("FSDP x TP on 2 nodes x 2: bytes per step, every rank together")
    ax.legend(frameon=False, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return show_own(fig)
