"""Activation checkpointing by hand: keep a block's input, not its activations, and run the block's
forward again inside backward when its gradient is needed (torch.utils.checkpoint, non-reentrant).

    checkpoint_blocks(model)                 # every model.blocks[i]; any list of modules works
    loop.PRESETS["fsdp"].replace(activation_checkpointing=True)   # what the labs use

It trades compute for memory: about one more forward per step (each block's, once), and the
activations alive at the peak shrink from every block's to the block inputs plus ONE block's
recomputed activations. It composes with every strategy because it only changes the module's
forward: under FSDP the recompute runs inside the unit's backward, after the pre-backward hook has
gathered the unit's weights, so it needs no all-gather of its own when the checkpointed module is
the FSDP unit (benchmarks/precision.py counts them).

Memory accounting: the recomputed activations are allocated inside backward; the recompute runs
in a "recompute" phase of labkit's memory tracker, so they are counted as activations, not as
backward temporaries.
What it leaves out: selective checkpointing (saving the cheap-to-keep, expensive-to-recompute
ops, e.g. attention outputs), offloading activations to CPU, checkpointing a module that is called
more than once per forward (the recompute is per call, which works, but is not measured here).
"""

from typing import Iterable, Optional, cast

import torch
from torch.utils.checkpoint import checkpoint

from labkit.observe.memory import phase_everywhere


def _in_backward():
    return torch._C._current_graph_task_id() != -1


def checkpoint_module(module: torch.nn.Module) -> torch.nn.Module:
    """Make module's forward checkpointed (its state_dict keys and parameters stay the same)."""
    if getattr(module, "_labkit_checkpointed", False):
        return module
    forward = module.forward  # the bound forward of the module's class

    def run(*args, **kwargs):
        if _in_backward():
            with phase_everywhere("recompute"):
                return forward(*args, **kwargs)
        return forward(*args, **kwargs)

    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
    setattr(module, "_labkit_checkpointed", True)  # (nn.Module's typing takes tensors and modules)
    return module


def checkpoint_blocks(
    model: torch.nn.Module, modules: Optional[Iterable[torch.nn.Module]] = None
) -> torch.nn.Module:
    """Checkpoint each of `modules` (default: model.blocks, one transformer block each)."""
    for module in cast(Iterable[torch.nn.Module], model.blocks) if modules is None else modules:
        checkpoint_module(module)
    return model
