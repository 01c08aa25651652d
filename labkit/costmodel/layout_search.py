"""The layouts of n GPUs that fit and the global batch allows, fastest first, by layout_step.

    rows = search(LLAMA3_405B, 8192, META_H100, seq_len=8192, global_batch_tokens=16 * 2**20)
    rows[0]["layout"], rows[0]["step_s"]

A free search over tp in {1, 2, 4, 8} (inside a node, dividing the heads), every pp that divides
what is left (at most one layer per stage), virtual stages v, cp, the ZeRO stage or FSDP with or
without reshard, HSDP (FSDP sharded over a node's data-parallel ranks, replicated across nodes),
how ZeRO-2 and FSDP accumulate gradients over m > 1 micro-batches (reduce-scatter
each, or hold them unsharded to the last: layout.py's docstring; at m = 1 the two are one layout,
priced once; ZeRO-2 holding is ZeRO-1's price, searched as zero 1 unless the space leaves zero 1
out), recomputation and the micro-batch; `space` narrows any of them (e.g. what a
framework of a given year could run: {"zero": (0,), "recompute": ("full",)}), and `allowed`, a
predicate on each priced row, applies a system's own rules (e.g. Megatron-LM 2021's interleaved
schedule: costmodel.published.megatron_2021_allows).
Degrees layout_step refuses (layout.refusal: tp beyond a node or not dividing the heads, tp and
the key/value heads not dividing one another, cp not cutting the sequence into 2 cp chunks, pp x v
above the layers) are pruned before pricing, and so are those the global batch does not allow;
an empty answer says why (Rows.why: each kind of refusal, counted).
Left out: layouts whose degrees do not divide n exactly, uneven micro-batches, pp x v above
the layer count.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable

from labkit.costmodel import _validate as check
from labkit.costmodel.layout import (
    REFUSALS,
    SCHEDULES,
    Cluster,
    Transformer,
    _knobs,
    check_accumulate,
    check_recompute,
    check_reduce_dtype,
    check_reshard,
    layout_step,
    refusal,
)

DEFAULT_SPACE = {
    "tp": (1, 2, 4, 8),
    "pp": None,  # None: every divisor of what tp x cp leave
    "cp": (1, 2, 4, 8, 16),
    "v": (1, 2, 3, 4, 6, 8),
    "zero": (0, 1, 2, 3),
    "reshard": (True, False),  # FSDP (zero 3) only
    "shard": ("all", "node"),
    "schedule": (
        "1f1b",
    ),  # add "zb-h1", "zbv" to price the zero-bubble schedules too  # FSDP (zero 3) only: over the whole dp x cp group, or HSDP (a node's ranks)
    "recompute": ("none", 0.25, 0.5, "full"),
    "micro_batch": (1, 2, 4, 8, 16),
    "reduce_dtype": ("fp32",),
    "accumulate": ("reduce_each", "hold"),  # ZeRO-2 and FSDP only, with m > 1 micro-batches
}


_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def _is_prime(k: int) -> bool:
    """Miller-Rabin on the first 13 primes as bases: exact below 3.3e24, and beyond it no composite
    is known to pass them all."""
    if k < 2:
        return False
    for p in _SMALL_PRIMES:
        if k % p == 0:
            return k == p
    d, r = k - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _SMALL_PRIMES:
        x = pow(a, d, k)
        if x in (1, k - 1):
            continue
        for _ in range(r - 1):
            x = x * x % k
            if x == k - 1:
                break
        else:
            return False
    return True


def _factor(k: int) -> int:
    """A nontrivial factor of the odd composite k (Pollard's rho, Brent's cycle search)."""
    for c in itertools.count(1):
        y, m, g, r, q = 2, 128, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % k
            i = 0
            while i < r and g == 1:
                ys = y
                for _ in range(min(m, r - i)):
                    y = (y * y + c) % k
                    q = q * abs(x - y) % k
                g = math.gcd(q, k)
                i += m
            r *= 2
        if g == k:  # the batched gcd overshot: step back one at a time
            g = 1
            while g == 1:
                ys = (ys * ys + c) % k
                g = math.gcd(abs(x - ys), k)
        if g != k:
            return g
    raise AssertionError("unreachable")


def _prime_factors(k: int) -> Counter:
    """k's prime factorisation, {prime: exponent}: trial division below 1,000, then Pollard's rho
    on what is left (milliseconds up to 10^18 and beyond, a prime k included; only a product of two
    primes of 15 digits or more would take seconds)."""
    out: Counter = Counter()
    for p in itertools.chain((2,), range(3, 1000, 2)):
        while k % p == 0:
            out[p] += 1
            k //= p
    stack = [k] if k > 1 else []
    while stack:
        f = stack.pop()
        if _is_prime(f):
            out[f] += 1
        else:
            d = _factor(f)
            stack += [d, f // d]
    return out


def _divisors(k: int) -> list[int]:
    """Every divisor of k >= 1, ascending, from its prime factorisation (not a loop to k: a search
    over a billion GPUs answers at once)."""
    check.count("k", k)
    divisors = [1]
    for p, e in _prime_factors(k).items():
        divisors = [d * p**i for d in divisors for i in range(e + 1)]
    return sorted(divisors)


def _stage_counts(k: int, layers: int) -> list[int]:
    """The pipeline degrees of k GPUs: k's divisors up to the layer count (a layer per stage at
    least), ascending -- a scan to `layers` for any model of up to 4,096 layers (whatever k is),
    else from k's factorisation."""
    if layers <= 4096:
        return [d for d in range(1, min(k, layers) + 1) if k % d == 0]
    return [d for d in _divisors(k) if d <= layers]


def check_space(space: dict | None) -> dict:
    """DEFAULT_SPACE with `space`'s entries over it, each a collection of allowed values (pp also
    None: every divisor); an unknown dimension, a lone value, an empty entry or a value no layout
    can take (micro_batch 0, zero 5, recompute "some") raises, naming it."""
    if space is None:
        space = {}
    if not isinstance(space, dict):
        raise TypeError(f"space is a dict of search dimensions {tuple(DEFAULT_SPACE)}, got {space!r}")
    unknown = sorted(set(space) - set(DEFAULT_SPACE), key=str)
    if unknown:
        raise ValueError(f"unknown search dimensions {unknown}; the space has {tuple(DEFAULT_SPACE)}")
    out = dict(DEFAULT_SPACE)
    for key, values in space.items():
        if values is None and key == "pp":
            out[key] = None
            continue
        name = f"space[{key!r}]"
        if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
            raise TypeError(f"{name} is a collection of values (a tuple, a range), got {values!r}")
        values = tuple(dict.fromkeys(values))  # in order, each once
        if not values:
            raise ValueError(f"{name} is empty: no layout to search")
        for x in values:
            _check_value(key, f"{name} entry", x)
        out[key] = values
    return out


def _check_value(key: str, name: str, x: object) -> None:
    if key in ("tp", "pp", "cp", "v", "micro_batch"):
        check.count(name, x)
    elif key == "zero":
        if check.count(name, x, minimum=0) > 3:
            raise ValueError(f"{name} must be a ZeRO stage 0, 1, 2 or 3, got {x!r}")
    elif key == "reshard":
        check_reshard(name, x)
    elif key == "schedule":
        if x not in SCHEDULES:
            raise ValueError(f"{name} is one of {SCHEDULES}, got {x!r}")
    elif key == "shard":
        if x not in ("all", "node"):
            raise ValueError(
                f"{name} is 'all' (FSDP over the data-parallel group) or 'node' (HSDP), got {x!r}"
            )
    elif key == "recompute":
        check_recompute(name, x)
    elif key == "reduce_dtype":
        check_reduce_dtype(name, x)
    elif key == "accumulate":
        check_accumulate(name, x)


def _accumulations(zero: int, m: int, space: dict) -> tuple:
    """How a candidate of ZeRO stage `zero` with m micro-batches may accumulate its gradients:
    DDP and ZeRO-1 hold them (their only way, normalise's default: None); at m = 1 both ways are one
    layout (the space's first, priced once); ZeRO-2 holding is ZeRO-1's price, so it is left to
    zero 1 when the space has it."""
    if zero < 2:
        return (None,)
    if m == 1:
        return space["accumulate"][:1]
    if zero == 2 and 1 in space["zero"]:
        return tuple(a for a in space["accumulate"] if a != "hold")
    return space["accumulate"]


def _schedules(pp: int, space: dict) -> list[tuple[int, str]]:
    """The (v, schedule) pairs of a candidate with pp stages: 1F1B at every v of the space
    (interleaved when v > 1), zb-h1 at v = 1, zbv at v = 2, where the space has them."""
    if pp == 1:
        return [(1, "1f1b")]
    out = [(v, "1f1b") for v in space["v"]] if "1f1b" in space["schedule"] else []
    return out + [({"zb-h1": 1, "zbv": 2}[s], s) for s in space["schedule"] if s != "1f1b"]


def _shards(zero: int, group: int, per_node: int, space: dict, refused: Counter) -> list[int]:
    """The shard-group sizes of a candidate: the whole data-parallel group, and for FSDP (zero 3)
    with "node" in the space HSDP's, the group's ranks inside one node (per_node = g / tp), when
    that is fewer than the group and divides it; an HSDP it cannot make is counted in `refused`."""
    out = [group] if "all" in space["shard"] or zero != 3 else []
    if zero == 3 and "node" in space["shard"]:
        if 1 < per_node < group and group % per_node == 0:
            out.append(per_node)
        elif not out:  # counted where it leaves the candidate no shard group at all
            refused[
                "HSDP refused: a node's ranks of the data-parallel group are not a proper divisor of it"
            ] += 1
    return out


class Rows(list):
    """search's answer: its rows, fastest first, and `refused`, the candidates left out by why
    ({reason: count}: layout_step's refusals and the batch's, pruned before pricing, then those
    that exceed HBM or `allowed` refuses). Empty, `why` says why and rows[0] raises with it."""

    def __init__(self, rows: Iterable = (), refused: dict | None = None, why: str = ""):
        super().__init__(rows)
        self.refused = dict(refused or {})
        self.why = why

    def __getitem__(self, i):  # type: ignore[override]
        if not self and isinstance(i, int):
            raise IndexError(f"search found no layout: {self.why}")
        return super().__getitem__(i)

    def __repr__(self) -> str:
        return f"Rows([], why={self.why!r})" if not self else super().__repr__()


def candidates(
    model: Transformer,
    n_gpus: int,
    cluster: Cluster,
    seq_len: int,
    global_batch_tokens,
    space: dict,
    refused: Counter | None = None,
):
    """Every (layout, micro_batch) the space, the cluster and the global batch allow; `refused`,
    when given, counts what is left out by reason (a (tp, cp) pair, a pp, a micro-batch, a v)."""
    refused = Counter() if refused is None else refused
    seqs = global_batch_tokens / seq_len
    batch = f"(pp, micro_batch) pairs refused: {seqs:g} sequences per step not dp x micro_batch x whole micro-batches"
    for tp, cp in itertools.product(space["tp"], space["cp"]):
        why = refusal(model, cluster, seq_len, tp=tp, cp=cp)
        if why:
            refused[f"(tp, cp) pairs refused: {REFUSALS[why[0]]}"] += 1
            continue
        if n_gpus % (tp * cp):
            refused[f"(tp, cp) pairs refused: tp x cp not dividing {n_gpus} GPUs"] += 1
            continue
        for pp in _stage_counts(n_gpus // (tp * cp), model.layers):
            if space["pp"] is not None and pp not in space["pp"]:
                refused["pp left out by space['pp']"] += 1
                continue
            dp = n_gpus // (tp * cp * pp)
            for mb in space["micro_batch"]:
                if seqs % (dp * mb):
                    refused[batch] += 1
                    continue
                for v, schedule in _schedules(pp, space):
                    if pp * v > model.layers:
                        refused[f"v refused: {REFUSALS['pp_layers']}"] += 1
                        continue
                    m = int(seqs) // (dp * mb)
                    if schedule != "1f1b" and m < pp:
                        refused["zero-bubble schedules refused: fewer micro-batches than stages"] += 1
                        continue
                    for zero in space["zero"]:
                        for shard, reshard, acc, rc, rd in itertools.product(
                            _shards(zero, dp * cp, cluster.net.gpus_per_node // tp, space, refused),
                            space["reshard"] if zero == 3 else (True,),
                            _accumulations(zero, m, space),
                            space["recompute"],
                            space["reduce_dtype"],
                        ):
                            layout = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "v": v, "zero": zero}
                            layout |= {"schedule": schedule} if schedule != "1f1b" else {}
                            layout |= {
                                "shard": shard,
                                "reshard": reshard,
                                "recompute": rc,
                                "reduce_dtype": rd,
                            }
                            yield layout | ({"accumulate": acc} if acc else {}), mb


def search(
    model, n_gpus, cluster, *, seq_len, global_batch_tokens, space=None, top=None, allowed=None, **knobs
) -> Rows:
    """layout_step of every candidate that fits, fastest first (ties: fewer GPUs per model copy,
    then less memory); each row also carries "micro_batch". `space` overrides DEFAULT_SPACE's
    entries (an unknown one raises); `top` keeps the first few; `allowed(row)` (row: layout_step's,
    with "micro_batch"), when given, drops the rows it returns False for; knobs go to layout_step.
    An empty answer is an empty Rows whose `why` counts each reason (its rows[0] raises with it):
    callers that take "none fits" as an answer (labs.pp_choice.family_best) still get an empty list."""
    check.instance("model", model, Transformer)
    check.count("n_gpus", n_gpus)
    check.instance("cluster", cluster, Cluster)
    check.count("seq_len", seq_len)
    check.amount("global_batch_tokens", global_batch_tokens)
    _knobs(knobs)  # a misspelled knob raises even when no layout is left to price
    space = check_space(space)
    if top is not None:
        check.count("top", top)
    if allowed is not None and not callable(allowed):
        raise TypeError(f"allowed is a function of a row (True: keep it), got {allowed!r}")
    rows: list[dict] = []
    refused: Counter[str] = Counter()
    least: float | None = None  # the least memory of a layout that does not fit
    for layout, mb in candidates(model, n_gpus, cluster, seq_len, global_batch_tokens, space, refused):
        row = layout_step(
            model,
            layout,
            cluster,
            seq_len=seq_len,
            global_batch_tokens=global_batch_tokens,
            micro_batch=mb,
            **knobs,
        )
        row |= {"micro_batch": mb}
        if not row["fits"]:
            refused["layouts exceed HBM"] += 1
            least = row["memory_total"] if least is None else min(least, row["memory_total"])
        elif allowed is not None and not allowed(row):
            refused["layouts refused by allowed"] += 1
        else:
            rows.append(row)
    rows.sort(key=lambda r: (r["step_s"], r["layout"]["tp"] * r["layout"]["pp"], r["memory_total"]))
    why = "" if rows else _why(n_gpus, cluster, refused, least)
    return Rows(rows[:top] if top else rows, refused, why)


def _why(n_gpus: int, cluster: Cluster, refused: Counter, least: float | None) -> str:
    """An empty search's reasons, each counted: 'no layout of 8 GPUs fits: 120 exceed HBM (...)'."""
    if not refused:
        return f"no layout of {n_gpus} GPUs to price"
    parts = []
    for reason, n in refused.most_common():  # the commonest reason first
        if reason == "layouts exceed HBM" and least is not None:
            reason += f" (the least needs {least / 1e9:.1f} GB of {cluster.memory_bytes / 1e9:.1f} GB)"
        parts.append(f"{n} {reason}")
    return f"no layout of {n_gpus} GPUs fits: " + "; ".join(parts)


def rank_of(rows: list[dict], layout: dict, micro_batch: int) -> int | None:
    """1-based place of `layout` (its given keys) with `micro_batch` in search's rows; None if absent."""
    for i, r in enumerate(rows, 1):
        if r["micro_batch"] == micro_batch and all(r["layout"][k] == v for k, v in layout.items()):
            return i
    return None
