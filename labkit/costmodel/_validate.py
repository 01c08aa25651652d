"""Argument checks for the cost model's public entry points: a nonsense input (a negative
parameter count, stage 7, a fractional rank count, mfu above 1) is refused with what is allowed,
never answered with numbers."""

from __future__ import annotations

import math
from numbers import Integral, Real


def count(name: str, value: object, minimum: int = 1) -> int:
    """An integer >= minimum (a bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def amount(name: str, value: object, zero_ok: bool = False) -> float:
    """A finite real number > 0 (>= 0 with zero_ok)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        raise ValueError(f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {value!r}")
    return v


def fraction(name: str, value: object) -> float:
    """A number in (0, 1]."""
    v = amount(name, value)
    if v > 1:
        raise ValueError(f"{name} is a fraction of peak, in (0, 1], got {value!r}")
    return v


def stage(value: object) -> int:
    """A ZeRO stage 0-3 (a strategy's name is not a stage: STAGE maps names to stages)."""
    if isinstance(value, str):
        raise TypeError(
            f"stage is a ZeRO stage 0, 1, 2 or 3, got {value!r} (costmodel.STAGE[{value!r}] maps a name)"
        )
    s = count("stage", value, minimum=0)
    if s > 3:
        raise ValueError(f"stage is a ZeRO stage 0, 1, 2 or 3, got {value!r}")
    return s


def instance(name: str, value: object, kinds: type | tuple[type, ...]) -> None:
    """`value` is one of `kinds` (a Link where a Hardware belongs is refused by name)."""
    if not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
        raise TypeError(f"{name} must be a {names}, got {value!r}")
