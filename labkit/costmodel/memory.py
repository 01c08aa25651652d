"""Per-rank memory of model states, the ZeRO paper's formulas: the one definition that
costmodel's step_time, layout_step and the labs' references (labkit.labs.pp_choice) all call.
Left out: allocator fragmentation, temporary buffers (layout_step adds FSDP's unsharded ones)."""

from __future__ import annotations

from labkit.costmodel import _validate as check


def memory_per_rank(model_params, n, stage, precision="mixed", K=None, activations=0.0, grad_bytes=None):
    """Bytes per rank by category, the ZeRO paper's model-state formulas.

    mixed: 2 (bf16 params) + 2 (bf16 grads) + K (fp32 master + Adam m, v: K = 12) bytes/param;
    fp32: 4 + 4 + 8 (Adam m, v). Stage 1 shards the optimizer, 2 also gradients, 3 also params.
    Activations are passed through as given (the paper's table has none). grad_bytes overrides
    the gradient's bytes per parameter (Megatron-LM's fp32 main gradients: 4).
    """
    check.amount("model_params", model_params)
    check.count("n", n)
    stage = check.stage(stage)
    check.amount("activations", activations, zero_ok=True)
    if K is not None:
        check.amount("K", K, zero_ok=True)
    if precision == "mixed":
        p_bytes, g_bytes, o_bytes = 2, 2, 12 if K is None else K
    elif precision == "fp32":
        p_bytes, g_bytes, o_bytes = 4, 4, 8 if K is None else K
    else:
        raise ValueError(f"precision is 'mixed' or 'fp32', got {precision!r}")
    if grad_bytes is not None:
        g_bytes = check.count("grad_bytes", grad_bytes)
    psi = float(model_params)
    return {
        "parameters": p_bytes * psi / (n if stage >= 3 else 1),
        "gradients": g_bytes * psi / (n if stage >= 2 else 1),
        "optimizer": o_bytes * psi / (n if stage >= 1 else 1),
        "activations": float(activations),
    }
