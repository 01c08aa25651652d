"""The check of a mixed-precision run against single-process training with the same casts.

A 16-bit run cannot be bit-equal to its single-process reference: each rank rounds its partial
gradient to 16 bits before the sum, the reference rounds the whole-batch gradient once (bf16 keeps
8 significant bits, eps = 2^-7), and AdamW turns a flipped near-zero gradient into a full-size
update. So the comparison is of what is comparable, by tolerances derived from eps:
  - step-0 gradients (the same weights, one backward; the verdict that matters), two bounds:
    (a) each tensor within grad_ulps ulp of the 16-bit dtype, i.e. grad_ulps * eps * the tensor's
    largest gradient: a gross error in any one tensor. GRAD_ULPS = 4 where every rank computes
    whole rows with whole weights (ddp, zero, fsdp, hsdp, pp: the forward is the one-process
    forward, only the gradient's sum is split): each rank's partial gradient is rounded once
    (<= 0.5 ulp of a partial, and partials can exceed their sum). Measured <= 1.1 ulp at 2 ranks.
    SPLIT_GRAD_ULPS = 32 where a layer's own sums are split (tp, sp, fsdp-tp: the row-parallel
    partial sums are rounded to bf16 and added in bf16, in forward and backward; cp: attention's
    softmax by pieces), and the LayerNorm gradients, sums over every token of terms that cancel
    to ~1% of the other gradients' size, collect those roundings: measured 15 ulp (tp) and 6 (cp)
    at 2 ranks on the CLI's model; ulysses: attention whole heads (0 ulp at 1 rank), but every
    weight's gradient summed over a rank's contiguous positions of each row, the early and the
    late half's partials cancelling: 13.0 ulp (blocks.1.ln1.bias) at 2 ranks on the CLI's model,
    as cp in its "contiguous" layout (13.3; zigzag mixes early and late: 6). A mistake in the reduction is off by a part of the gradient,
    not by rounding: one rank's gradient dropped or one bucket left unreduced is about
    0.5 * |g| = 64 ulp, SUM-for-AVG 128; tests/test_bf16_check.py plants both and sees them fail.
    (b) all the gradients as one vector, ||g - g_ref|| / ||g_ref||, within GRAD_NORM_EPS = 1 eps
    (0.78% for bf16), the same bound for every strategy: a systematic error spread over the
    model that (a) misses. (a) measures each tensor against its own largest gradient, so a
    tensor 10% off is only 12.8 ulp, under 32; a rank whose share of every gradient is 10% off
    (its loss scaled by 0.9, planted in tests/test_bf16_strategies.py) passed (a) on tp and
    fsdp-tp (12.9 ulp). Rounding is independent per element, a few roundings of at most 0.5 ulp
    of the element in the run and in the reference, so norm-wise it is a few tenths of eps
    whatever the strategy splits: the LayerNorm gradients that need (a)'s 32 ulp are ~1% of the norm. Measured
    on step 0 (max over the presets "dp" (batch 8) and "toy" / "zero" / "fsdp" / "moe", the CLI's
    model; bf16 with fp32 and with bf16 reduction, fp16; 1, 2, 3, 4 ranks, 8 for the 3-D ones;
    0 at 1 rank except cp), genuine runs vs the planted bug (one rank's gradient x 0.9) at the
    world size tests/test_bf16_strategies.py checks (2 ranks, rank 0's result, the one the CLI
    checks; 8 for the 3-D ones, every rank; "moe" for ep), in eps:
        ddp-naive, ddp-flat 0.40 | 6.6;  ddp-bucketed 0.42 | 6.6;  zero1 0.40 | 6.6;
        zero2 0.44 | 6.6;  fsdp 0.43 | 6.6;  fsdp-flat 0.40 | 6.6;  hsdp 0.43 | 6.6;
        tp 0.34 | 3.2 (5.1 on the CLI's model);  fsdp-tp 0.44 | 3.2 (5.1);  sp 0.44 | 6.5;
        cp 0.50 | 6.5;  ulysses 0.31 | 6.8;  pp 0.47 | 12.8 and pp-zero1 0.43 | 12.8 (the last
        rank is the last stage: every stage's gradient is scaled);  ep 0.30 | 6.5;  zero1-tp-pp,
        fsdp-tp-pp 0.33 | 1.7 on ranks 0, 2, 4, 6 (6.3 on the odd ones: the tensor-parallel rank
        that was planted holds the replicated gradients it scaled);  torch's (no plant):
        torch-fsdp, torch-hsdp 0.40, torch-tp 0.34, torch-sp 0.33, torch-fsdp-tp 0.42, torch-pp
        0.40 (bf16, bf16 reduction).
    So 1 eps is >= 2x every genuine figure (0.27 to 0.50 eps) and every plant is >= 1.7x over it
    (at 4 ranks too, where the planted rank holds a quarter: 1.7 eps fsdp-tp (dp 2 x tp 2), 2.3
    tp, 3.1 to 3.6 the data-parallel ones, sp, cp, 6.3 pp-zero1, 12.8 pp); one rank of R whose
    share is off by d moves the norm by about d / R: caught from d ~ 1% * R;
  - the run computes in 16 bits: its step-0 gradients are not fp32 training's (a run that
    skipped the casts has fp32's gradients up to fp32 rounding, 1e-5 of the bf16-vs-fp32
    difference; a casting run differs from them by about that difference: the bound is 1% of it);
  - the step-0 loss within eps / 8 relative (the same weights; only the forward's rounding
    differs, averaged over every token; measured <= 4e-6 relative);
  - the weights after training within 10% of how far training moved them: a sanity bound (a run
    that does not train, or trains something else), not a tight one: after step 0, Adam's
    update lr * m / sqrt(v) is about lr * sign(g) for every weight, so a gradient that bf16's
    rounding moves across zero moves its weight by 2 * lr; later losses and weights drift
    chaotically (at a loss spike 0.6% on rounding alone), so they are not compared tightly
    (and Adam is blind to a gradient's scale: a rank 10% off moves them about as much);
  - the trained weights are fp32 (the masters).
"""

import torch

from labkit import loop


GRAD_ULPS = 4  # step-0 gradients: the bound in ulp of the 16-bit dtype (the docstring says why)
SPLIT_GRAD_ULPS = 32  # ... for the strategies that split a layer's sums over ranks
GRAD_NORM_EPS = 1  # step-0 gradients as one vector: ||g - g_ref|| / ||g_ref|| in eps (every strategy)
SPLITS_LAYERS = ("tp", "sp", "cp", "ulysses", "fsdp-tp", "torch-tp", "torch-sp", "torch-fsdp-tp")


def grad_ulps_for(strategy: str, world_size: int = 2) -> int:
    """The step-0 gradient bound (a) for a strategy name (labkit.strategies.NAMES) on `world_size`
    ranks. A whole-rows strategy's error is the R partials' roundings (each <= 0.5 ulp of a partial,
    and partials can exceed their sum): GRAD_ULPS at 2 ranks, GRAD_ULPS x (R - 1) beyond (measured
    on the CLI's model at 4 ranks: 6.5 ulp on a LayerNorm bias under ddp-bucketed, zero2, fsdp,
    hsdp, pp, pp-zero1, which a fixed 4 called a mismatch); bound (b), norm-wise and fixed, is
    what catches a rank's share off at any R."""
    if strategy in SPLITS_LAYERS or "-tp" in strategy:
        return SPLIT_GRAD_ULPS
    return GRAD_ULPS * max(1, world_size - 1)


def _norm_diff(a, b, keys):
    return sum(((a[k].double() - b[k].double()) ** 2).sum().item() for k in keys) ** 0.5


def grad_norm_error(grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor]) -> float:
    """||g - g_ref|| / ||g_ref||, every tensor of ref_grads ({name: gradient}) as one vector: the
    statistic of GRAD_NORM_EPS (in units of 1, not eps). grads must hold every name of ref_grads."""
    keys = list(ref_grads)
    norm = sum((ref_grads[k].double() ** 2).sum().item() for k in keys) ** 0.5
    return _norm_diff(grads, ref_grads, keys) / norm if norm > 0 else 0.0


def check_same_casts(
    got, cfg, label="run", ref=None, fp32_ref=None, grad_ulps=GRAD_ULPS, grad_norm_eps=GRAD_NORM_EPS
):
    """Raise AssertionError naming the first failed tolerance; return the measured figures.

    got: one rank's loop.train result on preset `cfg` (cfg.mp set); ref / fp32_ref: loop.reference
    of cfg and of cfg without mp (computed when not given)."""
    if cfg.mp is None:
        raise ValueError("check_same_casts needs a preset with a MixedPrecision policy (cfg.mp)")
    ref = ref if ref is not None else loop.reference(cfg, len(got["losses"]))
    fp32_ref = fp32_ref if fp32_ref is not None else loop.reference(cfg.replace(mp=None), len(got["losses"]))
    init = loop.build_model(cfg).state_dict()
    keys = [k for k in ref["state"] if ref["state"][k].is_floating_point()]
    eps = torch.finfo(cfg.mp.param_dtype).eps
    wrong = [k for k in keys if got["state"][k].dtype != init[k].dtype]
    if wrong:
        raise AssertionError(
            f"{label}: {wrong[0]} is {got['state'][wrong[0]].dtype}, the master "
            f"weights are {init[wrong[0]].dtype}"
        )
    worst, worst_name = 0.0, None
    for name, g in (ref["grads"] or {}).items():
        if name not in (got["grads"] or {}):
            raise AssertionError(f"{label}: no step-0 gradient for {name} (the reference has one)")
        err = (got["grads"][name].double() - g.double()).abs().max().item()
        unit = eps * g.abs().max().item() + 1e-30
        if err / unit > worst:
            worst, worst_name = err / unit, name
        if err > grad_ulps * unit + 1e-12:
            raise AssertionError(
                f"{label}: step-0 gradient of {name} is {err:.2e} from the reference, "
                f"{err / unit:.0f} ulp of {cfg.mp.param_dtype} (the bound is {grad_ulps} ulp, "
                f"{grad_ulps * unit:.2e}): check the reduction (SUM vs AVG, every bucket, every "
                f"rank's gradient) and where the 16-bit gradient is cast"
            )
    grads = list((ref["grads"] or {}).keys())
    if grads and fp32_ref.get("grads"):
        cast_noise = _norm_diff(ref["grads"], fp32_ref["grads"], grads)
        from_fp32 = _norm_diff(got["grads"], fp32_ref["grads"], grads)
        if from_fp32 < 0.01 * cast_noise:
            raise AssertionError(
                f"{label}: step-0 gradients {from_fp32:.1e} from fp32 training's, where the "
                f"{cfg.mp.param_dtype} casts alone move them {cast_noise:.1e}: the run does not "
                f"compute in {cfg.mp.param_dtype}"
            )
    rel = grad_norm_error(got["grads"], ref["grads"]) if grads else 0.0
    if rel > grad_norm_eps * eps:
        raise AssertionError(
            f"{label}: step-0 gradients, all {len(grads)} tensors as one vector, are {rel:.2e} "
            f"from the reference relative to its norm, {rel / eps:.1f} eps of {cfg.mp.param_dtype} "
            f"(the bound is {grad_norm_eps} eps, {grad_norm_eps * eps:.1e}; rounding alone: <= 0.5): "
            f"a systematic error over many gradients, e.g. one rank's share scaled: check every "
            f"rank's gradient (its loss scale, its weight in the reduction: SUM vs AVG) and where "
            f"the 16-bit gradient is cast"
        )
    diff = _norm_diff(got["state"], ref["state"], keys)
    moved = _norm_diff(ref["state"], init, keys)
    no_casts = _norm_diff(fp32_ref["state"], ref["state"], keys)
    if diff > 0.1 * moved:
        raise AssertionError(
            f"{label}: weights {diff:.2e} from the same-cast reference; training moved "
            f"them {moved:.2e} (the bound is 10% of that)"
        )
    a, b = got["losses"][0], ref["losses"][0]
    if abs(a - b) > eps / 8 * abs(b):
        raise AssertionError(
            f"{label}: loss at step 0 is {a:.6f}, the reference's {b:.6f} (the bound is eps/8 "
            f"= {eps / 8:.1e} relative)"
        )
    return {
        "grad_ulps": worst,
        "grad_bound": grad_ulps,
        "grad_ulps_at": worst_name,
        "grad_norm_eps": rel / eps,
        "grad_norm_bound": grad_norm_eps,
        "loss0_rel": abs(a - b) / abs(b),
        "weights_diff": diff,
        "moved": moved,
        "fp32_diff": no_casts,
        "steps": len(got["losses"]),
        "weights": sum(ref["state"][k].numel() for k in keys),
    }


def describe(figures):
    """check_same_casts' figures as a sentence that says what is measured and in what unit."""
    return (
        f"after {figures['steps']} steps, distance = sqrt(sum of (w - w_ref)^2) over all "
        f"{figures['weights']:,} weights, in the weights' own units: {figures['weights_diff']:.1e} "
        f"from the same-cast reference, {figures['fp32_diff']:.1e} between that reference and "
        f"fp32 training (training moved the weights {figures['moved']:.1e} from their start)"
    )
