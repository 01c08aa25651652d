"""The checks of pp_lab's choice exercises 6-8, each against labkit's cost model (pp_choice's
references: layout_step's bubble, data-parallel bytes and activations), with one hint per
mistake they recognise. Exercise 5's check (the layouts' formulas) is pp_checks.check_formulas.
Pure arithmetic: no launch."""

from __future__ import annotations

from typing import Callable

from labkit.checks import NOT_IMPLEMENTED, attempt, fail
from labkit.labs import pp_choice


def _close(a: object, b: float) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and abs(a - b) <= 1e-9 * max(abs(b), 1e-12)


def _value(got: object, what: str) -> None:
    if got == NOT_IMPLEMENTED:
        raise NotImplementedError(NOT_IMPLEMENTED)
    if isinstance(got, str):
        fail(f"{what}: {got}", "see the error above")


# ---------------------------------------------------------------- 6. the bubble
def check_bubble(my_bubble: Callable) -> None:
    for p, v, m in ((4, 1, 8), (4, 2, 8), (8, 4, 16), (16, 4, 32), (2, 1, 1)):
        got, want = attempt(my_bubble, p, v, m), pp_choice.bubble(p, v, m)
        _value(got, f"my_bubble({p}, {v}, {m})")
        if _close(got, want):
            continue
        if _close(got, (p - 1) / (m + p - 1)):
            hint = "interleaving gives each rank v m slots of 1/v the work: (p - 1) / (v m + p - 1)"
        elif _close(got, (p - 1) / (v * m)):
            hint = "the bubble is a share of the whole step, idle over idle + busy: (p - 1) / (v m + p - 1)"
        elif _close(got, (p - 1) / m):
            hint = "a share of the whole step, with v m busy slots: (p - 1) / (v m + p - 1)"
        else:
            hint = "p - 1 idle slots out of v m + p - 1 per rank"
        fail(f"my_bubble(p={p}, v={v}, m={m}) = {got!r}, expected {want:.6g}", hint)
    print("the bubble: (p - 1) / (v m + p - 1), layout_step's on 5 (p, v, m)")


# ---------------------------------------------------------------- 7. FSDP vs ZeRO-1 under PP
DP_CASES = ((1, True), (3, True), (3, False), (0, True))


def check_dp_bytes(my_dp_bytes: Callable) -> None:
    piece, k = 1e9, 16
    for m in (1, 8):
        for zero, reshard in DP_CASES:
            got = attempt(my_dp_bytes, zero, reshard, piece, k, m)
            want = pp_choice.dp_bytes(zero, reshard, piece, k, m)
            what = f"my_dp_bytes(zero={zero}, reshard={reshard}, piece=1e9, k={k}, m={m})"
            _value(got, what)
            if not isinstance(got, dict) or set(got) != set(want):
                fail(
                    f"{what} = {got!r}", f"a dict with the keys {sorted(want)} (bytes sent per rank per step)"
                )
            for op, w in want.items():
                if _close(got[op], w):
                    continue
                zero1 = attempt(my_dp_bytes, 1, True, piece, k, m)
                grads_ok = isinstance(zero1, dict) and _close(
                    zero1.get("reduce_scatter"), 4 * piece * (k - 1) / k
                )
                shown = f"{got[op]:.4g} B" if isinstance(got[op], (int, float)) else repr(got[op])
                fail(
                    f"{what}[{op!r}] = {shown}, expected {w:.4g} B",
                    _dp_hint(op, got[op], w, zero, reshard, m, grads_ok),
                )
    print("data-parallel bytes per step: ZeRO-1 gathers once, FSDP with reshard 2m times, without once")


def _dp_hint(
    op: str, got: float, want: float, zero: int, reshard: bool, m: int, grads_ok: bool = False
) -> str:
    """The hint for a wrong byte count; grads_ok: the learner's ZeRO-1 reduce-scatter is right, so
    the gradients' fp32 bytes are (an all-reduce at half is then the ring's missing factor 2)."""
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        return f"a number of bytes per rank per step, got {type(got).__name__}"
    ratio = got / want if want else float("inf")
    if op == "all_reduce" and grads_ok and _close(ratio, 0.5):
        return "a ring all-reduce sends 2(k-1)/k of the tensor: a reduce-scatter and an all-gather"
    if op == "all_reduce" and _close(ratio, 0.25):
        return "two factors of 2 short: gradients in fp32 (4 B) and a ring all-reduce's 2(k-1)/k"
    if op == "all_gather" and zero == 3 and reshard and (_close(ratio, 1 / m) or _close(ratio, 0.5)):
        return "with reshard every micro-batch all-gathers each unit in forward AND again in backward: 2 m per step"
    if op == "all_gather" and zero == 1 and ratio > 1:
        return "ZeRO-1 keeps whole bf16 parameters: one all-gather per step, after the optimizer step"
    if op == "all_gather" and zero == 3 and not reshard and ratio > 1:
        return "without reshard the gathered parameters stay for every micro-batch: one all-gather per step"
    if op in ("reduce_scatter", "all_reduce") and _close(ratio, 0.5):
        return "gradients travel in fp32 (4 B per parameter), Megatron-LM's and torchtitan's default"
    if op == "all_gather" and _close(ratio, 2.0):
        return "parameters are all-gathered in bf16: 2 B per parameter"
    return "(k-1)/k of the whole tensor per reduce-scatter or all-gather, 2(k-1)/k per all-reduce"


# ---------------------------------------------------------------- 8. activations per rank
# (layout, m): the first has m > p and m / p, p / m and tp all different, so each mistake below
# gives its own number there; later cases bring m < p, interleaving and recomputation
ACT_CASES = (
    ({"tp": 2, "pp": 4, "v": 1, "recompute": "none"}, 32),
    ({"tp": 8, "pp": 16, "v": 1, "recompute": "none"}, 4),
    ({"tp": 4, "pp": 4, "v": 4, "recompute": "none"}, 8),
    ({"tp": 8, "pp": 8, "v": 2, "recompute": "full"}, 16),
    ({"tp": 4, "pp": 8, "v": 1, "recompute": "full"}, 2),
    ({"tp": 2, "pp": 1, "v": 1, "recompute": "none"}, 2),
)

# mistake -> its hint; _activations(..., mistake) computes what it gives
ACT_MISTAKES = {
    "no_sp": "sequence parallelism splits every activation over the tp ranks: 34 s b d / t per layer",
    "m_in_flight": "1F1B holds at most p micro-batches on the first stage: min(p, m), not m",
    "p_in_flight": "with m < p only m micro-batches exist to hold: min(p, m), not p",
    "layers_over_m": "the first stage holds L / p layers (its share of the model), whatever m is",
    "layers_over_pv": "a rank holds v chunks of L / (p v) layers: L / p in all",
    "no_factor": "interleaving holds more on the first stage: times 1 + (p - 1) / (p v)",
    "factor_at_v1": "the interleaving factor 1 + (p - 1) / (p v) is for v > 1; plain 1F1B (v = 1) holds min(p, m)",
    "no_recompute": "full recomputation keeps only each layer's input (2 s b d / t) plus one layer's full set",
    "no_working_layer": "recomputing a layer needs its full set back while it runs: + one layer's 34 s b d / t",
    "input_unsplit": "sequence parallelism splits the kept input too: 2 s b d / t per layer",
}


def _activations(model, layout: dict, seq_len: int, b: int, m: int, mistake: str = "") -> float:
    """Exercise 8's formula, or the number `mistake` (a key of ACT_MISTAKES) gives."""
    t, p, v = layout["tp"], layout["pp"], layout["v"]
    s, d = seq_len, model.d
    full = 34 * s * b * d / (1 if mistake == "no_sp" else t)
    layers = model.layers / {"layers_over_m": m, "layers_over_pv": p * v}.get(mistake, p)
    held = {"m_in_flight": m, "p_in_flight": p}.get(mistake, min(p, m))
    if (v > 1 and mistake != "no_factor") or mistake == "factor_at_v1":
        held *= 1 + (p - 1) / (p * v)
    if layout["recompute"] == "full" and mistake != "no_recompute":
        kept = 2 * s * b * d / (1 if mistake == "input_unsplit" else t)
        return layers * kept * held + (0 if mistake == "no_working_layer" else full)
    return layers * full * held


def check_activations(my_activations: Callable) -> None:
    model = pp_choice.MODELS["70B"]
    for i, (layout, m) in enumerate(ACT_CASES):
        got = attempt(my_activations, model, dict(layout), 4096, 1, m)
        want = pp_choice.activations(model, layout, 4096, 1, m)
        what = f"my_activations(70B, {layout}, seq 4096, micro_batch 1, m={m})"
        _value(got, what)
        if not _close(got, want):
            fail(f"{what} = {got!r}, expected {want:.4g} B", _act_hint(model, layout, m, got, ACT_CASES[:i]))
    print(
        "activations per rank: 34 s b d / t per layer, min(p, m) micro-batches, interleaving and recomputation"
    )


def live_mistakes(model, passed: tuple = ()) -> list[str]:
    """The mistakes of ACT_MISTAKES that give the right number in every case of `passed`: those a
    learner who got that far can still have made."""
    return [
        mistake
        for mistake in ACT_MISTAKES
        if all(
            _close(
                _activations(model, lay, 4096, 1, m, mistake), pp_choice.activations(model, lay, 4096, 1, m)
            )
            for lay, m in passed
        )
    ]


def _act_hint(model, layout: dict, m: int, got: object, passed: tuple = ()) -> str:
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        return f"a number of bytes (a float), got {type(got).__name__}"
    for mistake in live_mistakes(model, passed):
        if _close(got, _activations(model, layout, 4096, 1, m, mistake)):
            return ACT_MISTAKES[mistake]
    return "per layer 34 s b d / t, times the stage's L / p layers, times min(p, m) micro-batches (x 1 + (p-1)/(p v) interleaved, v > 1)"
