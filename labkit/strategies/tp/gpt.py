"""Megatron-LM's tensor parallelism on the course's TinyGPT (labkit.models): every block's attention
heads and MLP split over the "tp" ranks, the rest replicated.

    parallelize_gpt(model, mesh["tp"])              # in place, by hand (parallelize_by_hand)
    parallelize_gpt(model, mesh["tp"], by="torch")  # the same plan through torch's parallelize_module

Per block: attn.qkv "colwise" on its head-grouped rows, attn.proj "rowwise", mlp.0 (fc) "colwise",
mlp.2 (proj) "rowwise". The fused qkv weight is [q; k; v]; its rows (and bias) are first permuted
into [q_0; k_0; v_0; q_1; k_1; v_1; ...] (qkv_order: q_t the rows of heads [t * H / tp, (t + 1) *
H / tp)), so the plain colwise split (torch.chunk's t-th rows, Shard(0)) hands rank t its heads'
q, k and v whole. Both paths do this, so the parameter is the same DTensor either way: its global
tensor is the head-grouped one, and whatever torch's tools read of it (DTensor.full_tensor(),
get_model_state_dict, torch.distributed.checkpoint) is in that order, exact under "tp" (Shard(0))
and under FSDP x TP (fully_shard's (_StridedShard(0, split_factor=tp), Shard(0))). AdamW is
elementwise, so training the permuted rows is training the original ones; the strategies'
full_state_dict / full_grad_dict put the rows back ([q; k; v], original_order), so they equal
one-process training. A one-process ([q; k; v]) state dict loaded into a parallelized model needs
its qkv entries permuted first (tensor[qkv_order(rows, tp)]), on ours as on torch's oracle.
Each block therefore runs two all-reduces forward (after attn.proj and mlp.2: reduce_from_tp) and
two backward (the gradients of the attention's and the MLP's input: copy_to_tp), each of batch x
seq x d_model elements. The attention computes its H / tp local heads (the class becomes
TPCausalSelfAttention, whose forward reads the local head count). Embeddings, LayerNorms and the
LM head (tied to the token embedding) stay whole on every rank: every tp rank sees the same batch,
so their gradients are the same on every tp rank without any communication.
Sequence parallelism (sequence_parallel=True, the strategies "sp" / "torch-sp"): gpt_plan's
styles become "colwise_sp" / "rowwise_sp" and each block's ln1 / ln2 "sequence" (torch's
ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1)),
SequenceParallel()): between blocks the residual stream is this rank's 1/tp of the sequence, each
block's two all-reduces become a reduce-scatter and an all-gather forward (and backward). The
embeddings' output enters block 0 through split_to_sp and the last block's leaves for ln_f / the LM
head through unsplit_from_sp (torch: PrepareModuleInput Replicate() -> Shard(1) on "blocks.0",
Shard(1) -> Replicate() on "ln_f"), so the embeddings, ln_f and the head stay replicated.
Under SP, model.state_dict() gives the qkv entries whole, in [q; k; v] order (plain_qkv_state_dict):
a one-process TinyGPT loads it strictly and computes the same loss.
What it leaves out: a vocabulary-parallel embedding / LM head, grouped-query attention, the
embeddings and final LayerNorm on the sequence piece (Megatron's SP shards those too).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from labkit.models import CausalSelfAttention, TinyGPT
from labkit.strategies.comm_choice import choose
from labkit.strategies.tp.parallelize import parallelize_by_hand
from labkit.strategies.tp.sequence import split_to_sp, unsplit_from_sp

__all__ = [
    "TPCausalSelfAttention",
    "check_gpt",
    "gpt_plan",
    "localize_heads",
    "original_order",
    "parallelize_gpt",
    "permute_qkv",
    "plain_qkv_state_dict",
    "qkv_names",
    "qkv_order",
    "unpermute_qkv",
]

BY = ("hand", "torch")


class _TPAttention:
    """CausalSelfAttention's forward on this rank's heads: qkv gives [q_t, k_t, v_t] (H / tp heads
    each), proj (rowwise) takes their concatenation and sums over the ranks."""

    # CausalSelfAttention's (the class this is mixed into), and _tp_heads set by localize_heads
    n_heads: int
    _tp_heads: int
    qkv: nn.Linear
    proj: nn.Linear
    causal_mask: torch.Tensor

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        channels = h.shape[-1]
        head_dim = channels // self.n_heads
        heads = self._tp_heads
        qkv = self.qkv(h)  # under SP: every position (h is this rank's piece of the sequence)
        batch, time = qkv.shape[:2]
        q, k, v = qkv.split(heads * head_dim, dim=2)
        q, k, v = (t.view(batch, time, heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~self.causal_mask[:time, :time], float("-inf"))
        out = F.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, time, heads * head_dim))


class TPCausalSelfAttention(_TPAttention, CausalSelfAttention):
    pass


def check_gpt(model: nn.Module, tp: int, where: str) -> None:
    """Raise unless `model` is a TinyGPT whose heads split evenly over `tp` ranks."""
    if not isinstance(model, TinyGPT):
        raise TypeError(
            f"{where}: tensor parallelism here splits TinyGPT's heads and MLP (labkit.models); "
            f"got a {type(model).__name__} (Preset(model='gpt'))"
        )
    heads = model.config.n_heads
    if heads % tp:
        raise ValueError(
            f"{where}: n_heads={heads} is not divisible by tp={tp}: each rank must hold whole heads"
        )


def _blocks(model: nn.Module) -> Any:
    """TinyGPT's blocks (an nn.ModuleList; check_gpt has checked the model's class)."""
    return model.blocks


def qkv_names(model: nn.Module) -> list[str]:
    """The fused [q; k; v] Linears' module names, one per block."""
    return [f"blocks.{i}.attn.qkv" for i in range(len(_blocks(model)))]


def gpt_plan(model: nn.Module, sequence_parallel: bool = False) -> dict[str, str]:
    """{module name: style} of the Megatron split of every block (the module docstring); the qkv
    entries are "colwise" on rows already in qkv_order (permute_qkv). sequence_parallel: the SP
    styles, and the blocks' LayerNorms "sequence"."""
    col, row = ("colwise_sp", "rowwise_sp") if sequence_parallel else ("colwise", "rowwise")
    plan: dict[str, str] = {}
    for i in range(len(_blocks(model))):
        if sequence_parallel:
            plan |= {f"blocks.{i}.ln1": "sequence", f"blocks.{i}.ln2": "sequence"}
        plan |= {
            f"blocks.{i}.attn.qkv": col,
            f"blocks.{i}.attn.proj": row,
            f"blocks.{i}.mlp.0": col,
            f"blocks.{i}.mlp.2": row,
        }
    return plan


def localize_heads(model: nn.Module, tp: int) -> None:
    """Every block's attention computes its n_heads / tp local heads (its class swapped)."""
    for block in _blocks(model):
        block.attn._tp_heads = block.attn.n_heads // tp
        block.attn.__class__ = TPCausalSelfAttention


def qkv_order(rows: int, tp: int) -> torch.Tensor:
    """The row permutation that makes torch.chunk's t-th piece of a [q; k; v] weight [q_t; k_t; v_t]."""
    third = rows // 3
    width = third // tp
    return torch.cat(
        [
            torch.arange(c * third + t * width, c * third + (t + 1) * width)
            for t in range(tp)
            for c in range(3)
        ]
    )


def unpermute_qkv(tensor: torch.Tensor, tp: int) -> torch.Tensor:
    """A whole qkv weight or bias held in qkv_order back in [q; k; v] order."""
    inverse = torch.argsort(qkv_order(tensor.shape[0], tp))
    return tensor[inverse.to(tensor.device)]


def permute_qkv(model: nn.Module, tp: int) -> None:
    """Every block's qkv weight and bias rows into qkv_order, in place (on the whole, unsplit
    tensors, before parallelizing)."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in qkv_names(model):
            linear = modules[name]
            order = qkv_order(linear.out_features, tp).to(linear.weight.device)
            for param in (linear.weight, linear.bias):
                if param is not None:
                    param.copy_(param[order])


def original_order(tensors: dict[str, torch.Tensor], model: nn.Module, tp: int) -> dict[str, torch.Tensor]:
    """{state_dict key or parameter name: whole tensor} with the qkv entries back in [q; k; v]
    order (the others as they are)."""
    qkv = set(qkv_names(model))
    return {k: unpermute_qkv(v, tp) if k.rpartition(".")[0] in qkv else v for k, v in tensors.items()}


def _sp_boundaries_by_hand(model: nn.Module, mesh: DeviceMesh, comm: str) -> None:
    """split_to_sp in front of block 0, unsplit_from_sp in front of ln_f (forward pre-hooks)."""
    group, collectives = mesh.get_group(), choose(comm, "parallelize_gpt")

    def enter(module: nn.Module, args: tuple) -> tuple:
        return (split_to_sp(args[0], group, collectives), *args[1:])

    def leave(module: nn.Module, args: tuple) -> tuple:
        return (unsplit_from_sp(args[0], group, collectives), *args[1:])

    _blocks(model)[0].register_forward_pre_hook(enter)
    final_norm: nn.Module = getattr(model, "ln_f")
    final_norm.register_forward_pre_hook(leave)


def _torch_styles(model: nn.Module, plan: dict[str, str], sequence_parallel: bool) -> dict[str, Any]:
    """torch's ParallelStyle for every entry of `plan` (+ SP's two PrepareModuleInput)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_sp": lambda: ColwiseParallel(input_layouts=Shard(1)),
        "rowwise_sp": lambda: RowwiseParallel(output_layouts=Shard(1)),
        "sequence": SequenceParallel,
    }
    out: dict[str, Any] = {name: styles[style]() for name, style in plan.items()}
    if sequence_parallel:
        out["blocks.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        out["ln_f"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return out


def parallelize_gpt(
    model: nn.Module,
    mesh: DeviceMesh,
    by: str = "hand",
    comm: str = "ring",
    sequence_parallel: bool = False,
) -> nn.Module:
    """In place, on the 1-D tp `mesh`: the qkv rows into qkv_order, gpt_plan through
    parallelize_by_hand (by="hand") or torch's parallelize_module with ColwiseParallel() /
    RowwiseParallel() (by="torch"), the attention on its local heads; returns `model`. comm: the
    hand-written split's collectives ("ring" or "torch", labkit.strategies.comm_choice).
    sequence_parallel: Megatron's SP on top (the module docstring; torch's SequenceParallel and
    Shard(1) layouts under by="torch")."""
    if by not in BY:
        raise ValueError(f"parallelize_gpt: by must be one of {BY}, got {by!r}")
    tp = mesh.size()
    check_gpt(model, tp, "parallelize_gpt")
    if any(isinstance(block.attn, TPCausalSelfAttention) for block in _blocks(model)):
        raise ValueError("parallelize_gpt: the model is already parallelized")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(
            f"parallelize_gpt: sequence_parallel must be True or False, got {sequence_parallel!r}"
        )
    plan = gpt_plan(model, sequence_parallel)
    permute_qkv(model, tp)
    if by == "hand":
        parallelize_by_hand(model, mesh, plan, comm=comm)
        if sequence_parallel:
            _sp_boundaries_by_hand(model, mesh, comm)
    else:
        from torch.distributed.tensor.parallel import parallelize_module

        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        parallelize_module(model, mesh, _torch_styles(model, plan, sequence_parallel))
        # torch 2.13's SequenceParallel re-registers a LayerNorm's parameters as new nn.Parameters
        # (requires_grad=True): a frozen weight would train (tests/contract's frozen promise).
        for n, p in model.named_parameters():
            if n in frozen:
                p.requires_grad_(False)
    localize_heads(model, tp)
    if sequence_parallel:
        plain_qkv_state_dict(model, tp)
    return model


def plain_qkv_state_dict(model: nn.Module, tp: int) -> None:
    """model.state_dict() gives every qkv weight / bias whole and in [q; k; v] order (a plain
    tensor, gathered: a collective, every rank at once), so a one-process TinyGPT loads it
    strictly and computes the same loss; load_state_dict takes such a tensor (a DTensor too:
    read as [q; k; v], what set_model_state_dict distributes) and puts it back in qkv_order, split
    like the parameter (a head-grouped state dict of a "tp" model is not one to load here). The parameters themselves stay the
    head-grouped DTensors (the optimizer's, torch's tools read those)."""
    qkv = set(qkv_names(model))
    setattr(model, "_plain_qkv_state_dict", True)

    def keys(prefix: str) -> list[tuple[str, str, str]]:
        return [(f"{prefix}{name}.{kind}", name, kind) for name in sorted(qkv) for kind in ("weight", "bias")]

    def plain(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for key, _, _ in keys(prefix):
            if key in state:
                value = state[key]
                whole = value.full_tensor() if hasattr(value, "full_tensor") else value
                state[key] = unpermute_qkv(whole.detach(), tp)

    def load(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        from torch.distributed.tensor import distribute_tensor

        modules = dict(module.named_modules())
        for key, name, kind in keys(prefix):
            value, param = state.get(key), getattr(modules[name], kind, None)
            if not isinstance(value, torch.Tensor) or param is None:
                continue
            if hasattr(value, "full_tensor"):
                # Every state dict of this model holds [q; k; v]; a DTensor here is torch's
                # set_model_state_dict(full_state_dict=True) distributing such a whole tensor as
                # if it were in qkv_order: gathered back and reordered.
                value = value.full_tensor()
            rows = value.to(param.device, param.dtype)[qkv_order(value.shape[0], tp).to(param.device)]
            state[key] = distribute_tensor(rows, param.device_mesh, param.placements, src_data_rank=None)

    model.register_state_dict_post_hook(plain)
    model.register_load_state_dict_pre_hook(load)
