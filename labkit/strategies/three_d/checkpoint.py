"""Sharded checkpoints of the 3-D strategies' weights, through torch.distributed.checkpoint (DCP).

    save(s, path)                  # every rank: its stage's tensors, each rank its own pieces
    state = load_full(path)        # ONE process, no process group: {key: whole tensor}, the plain
                                   # model's layout ([q; k; v] rows), loads into TinyGPT as it is
    load(s2, path)                 # every rank of another 3-D strategy (the other layout too)

save writes, on every rank, the state dict entries of its own pipeline stage as they are held:
zero1-tp-pp's tp DTensors (and the replicated tensors whole), fsdp-tp-pp's shards (DTensors on
the (dp, tp) plane); DCP writes each piece once (replicas deduplicated) with its offset in the
whole tensor, and rank 0 a small labkit_3d.json (the strategy, tp, the keys). The qkv rows are
held head-grouped for tp ranks (tp/gpt.qkv_order), so the whole tensors DCP sees are in that
order: load_full puts them back ([q; k; v]) with the saved tp; load needs the same tp (the same
row order) and refuses another, naming why. Within that, DCP re-cuts the pieces for the target's
layout: a zero1-tp-pp checkpoint loads into fsdp-tp-pp (other dp / pp degrees too) and back.

What it leaves out: the optimizer state (ZeRO-1's flat segments and FSDP's per-parameter shards
are different cuts of it: a loaded strategy starts with a fresh optimizer, say after a save at the
end of a run), the step and data position (strategies/checkpoint/ keeps those for "fsdp"),
loading into another tp degree (the qkv rows would have to be re-permuted: refused).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from labkit.strategies.three_d.layout import Composed
from labkit.strategies.tp.gpt import unpermute_qkv

META = "labkit_3d.json"


def _stage_state(s: Any) -> dict[str, torch.Tensor]:
    """This rank's stage's state dict entries as the strategy holds them (DTensors or whole)."""
    if not isinstance(s, Composed):
        raise TypeError(
            f"three_d checkpoints take a zero1-tp-pp / fsdp-tp-pp strategy, got {type(s).__name__} "
            f"(the FSDP strategies' checkpoints are labkit.strategies.checkpoint)"
        )
    state = s.model_state()
    return {k: v for k, v in state.items() if s.mine(k)}


def save(s: Any, path: str) -> None:
    """Every rank: write strategy `s`'s weights under directory `path` (a collective)."""
    import torch.distributed.checkpoint as dcp

    state = _stage_state(s)
    dcp.save({"model": state}, checkpoint_id=path)
    if dist.get_rank() == 0:
        meta = {"strategy": s.where, "tp": s.tp, "keys": list(s.shapes), "qkv": "head-grouped"}
        with open(os.path.join(path, META), "w") as f:
            json.dump(meta, f)
    dist.barrier()


def _meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, META)) as f:
        return json.load(f)


def load(s: Any, path: str) -> None:
    """Every rank: the weights saved under `path` into strategy `s`, in place (a collective);
    refused (ValueError, on every rank) if the checkpoint's tp differs from s's."""
    import torch.distributed.checkpoint as dcp

    meta = _meta(path)
    state = _stage_state(s)
    if meta["tp"] != s.tp:
        raise ValueError(
            f"{path} was saved by {meta['strategy']} with tp={meta['tp']}: its qkv rows are grouped by "
            f"head for {meta['tp']} ranks (tp/gpt.qkv_order), this {s.where} holds them grouped for "
            f"tp={s.tp}; re-permuting them is left out (load_full gives the plain model's tensors)"
        )
    dcp.load({"model": state}, checkpoint_id=path)  # into the tensors themselves (their storage)


def load_full(path: str) -> dict[str, torch.Tensor]:
    """One process, no process group: {state dict key: whole tensor} of the plain model."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = _meta(path)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(path, out)
        saved = torch.load(out, weights_only=True)["model"]
    if set(saved) != set(meta["keys"]):
        raise ValueError(f"{path}: holds {sorted(saved)}, its {META} says {meta['keys']}")

    return {
        k: unpermute_qkv(v, meta["tp"]) if k.rpartition(".")[0].endswith("attn.qkv") else v
        for k, v in saved.items()
    }
