"""Comparisons that explain themselves, in the spirit of makemore's `cmp()`.

`compare(expected, got)` lines up tensors by name and reports, per tensor, whether it is exact,
allclose, and the max abs difference; for the first mismatch it gives the rank, the name, the
index and both values, and a hint when the numbers look like a classic mistake (SUM instead of
AVG, divided twice, never updated, wrong sign, padding left in, shards in the wrong order).

What it leaves out: the hints are guesses from the numbers alone; a hint that does not fit your
code is just a coincidence. Complex and sparse tensors are not supported.
"""

import math
import os
from collections.abc import Mapping
from typing import NoReturn

import torch
import torch.nn as nn

from labkit.units import fmt_bytes

_FACTORS = range(2, 9)  # multiples tried for the "N x too large / too small" hints


def _flatten(obj, prefix: str = "") -> dict:
    """name -> tensor for a tensor, Module (named_parameters), mapping or sequence, nested."""
    if isinstance(obj, torch.Tensor):
        return {prefix or "tensor": obj}
    if isinstance(obj, nn.Module):
        return {prefix + name: p for name, p in obj.named_parameters()}
    if isinstance(obj, Mapping):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(obj, (int, float, bool)):
        return {prefix or "value": torch.tensor(obj)}
    else:
        raise TypeError(f"cannot compare a {type(obj).__name__}")
    flat = {}
    for key, value in items:
        key = str(key)
        sep = "" if not prefix or key.startswith("[") else "."
        flat.update(_flatten(value, prefix + sep + key))
    return flat


def _named(obj, names) -> dict:
    flat = _flatten(obj)
    if names is None:
        return flat
    if len(names) != len(flat):
        raise ValueError(f"{len(names)} names for {len(flat)} tensors")
    return dict(zip(names, flat.values()))


def _is_multiple(got, expected, factor, rtol, atol) -> bool:
    return bool(expected.abs().max() > atol) and torch.allclose(got, expected * factor, rtol=rtol, atol=atol)


_NOT_UPDATED = "not updated: did the optimizer step run / were gradients synchronized?"


def _hint(exp, got, world_size, rtol, atol) -> str:
    """The most likely classic mistake behind a mismatch of same-shape tensors, or ''."""
    if not torch.isfinite(got).all() and torch.isfinite(exp).all():
        return (
            "got contains NaN/inf: a division by zero (empty shard? zero token count?) or a diverged update"
        )
    if not got.any() and exp.any():
        return "got is all zeros: " + _NOT_UPDATED
    if _is_multiple(got, exp, -1, rtol, atol):
        return (
            "got == -expected: the sign is flipped (subtracted instead of added, "
            "or ascent instead of descent)?"
        )
    factors = sorted(_FACTORS, key=lambda f: f != world_size)  # try world_size first
    for n in factors:
        if _is_multiple(got, exp, n, rtol, atol):
            if n == world_size:
                return f"the sum is {n}× too large: did you forget to divide by world_size (SUM vs AVG)?"
            return f"got is {n}× expected: summed {n} contributions without averaging (SUM vs AVG)?"
        if _is_multiple(got, exp, 1 / n, rtol, atol):
            return f"{n}× too small: divided twice (by world_size before AND after the reduction)?"
    if exp.numel() > 1 and torch.equal(got.flatten().sort().values, exp.flatten().sort().values):
        return (
            "same values in a different order: shards concatenated in the wrong rank order, or a transpose?"
        )
    return ""


def _shape_hint(exp, got, world_size) -> str:
    """The likely mistake behind a shape mismatch (the mismatch itself is stated elsewhere)."""
    ne, ng = exp.numel(), got.numel()
    if ng == ne:
        return "the same number of elements: a missing view/reshape or transpose?"
    if world_size and ng * world_size == ne:
        return f"got 1/{world_size} of the elements, one rank's shard: missing all-gather?"
    if world_size and ng == ne * world_size:
        return (
            f"got {world_size}× the elements: the whole tensor instead of one rank's chunk "
            f"(missing reduce-scatter, or a wrong slice)?"
        )
    if ng > ne:
        return f"{ng - ne} extra element(s): padding not removed?"
    return f"{ne - ng} element(s) missing: shard sizes computed wrongly (uneven split)?"


SMALL = 16  # tensors up to this many elements are shown whole in a mismatch


def _small_values(exp, got) -> str:
    """Both tensors in full when they are small: a learner sees the pattern (padding, order)."""
    if max(exp.numel(), got.numel()) > SMALL:
        return ""

    def show(t):
        return "[" + ", ".join(f"{v:.4g}" for v in t.flatten().tolist()) + "]"

    return f"\n    expected {tuple(exp.shape)}: {show(exp)}\n    got      {tuple(got.shape)}: {show(got)}"


class Entry:
    """The comparison of one named tensor; `problem` is '' when it passed."""

    def __init__(self, name, exp, got, *, rank, world_size, rtol, atol):
        self.name, self.rank = name, rank
        exp, got = exp.detach().cpu(), got.detach().cpu()  # ranks may hand over CUDA tensors
        self.shape, self.got_shape = tuple(exp.shape), tuple(got.shape)
        self.exact = self.shape == self.got_shape and exp.dtype == got.dtype and torch.equal(exp, got)
        self.close, self.max_diff, self.problem, self.hint = self.exact, 0.0, "", ""
        where = f"rank {rank}, " if rank is not None else ""
        if self.shape != self.got_shape:
            self.close, self.max_diff = False, math.inf
            self.problem = (
                f"first mismatch: {where}'{name}': shapes differ: expected "
                f"{self.shape}, got {self.got_shape}" + _small_values(exp, got)
            )
            self.hint = _shape_hint(exp, got, world_size)
            return
        e, g = exp.double(), got.double()
        if e.numel():
            diff = (e - g).abs()
            self.max_diff = diff.nan_to_num(nan=math.inf).max().item()
        ok = torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
        self.close = bool(ok.all())
        if self.close:
            return
        bad = (~ok).flatten().nonzero()
        flat = int(bad[0])
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape))
        self.problem = (
            f"first mismatch: {where}'{name}' of shape {self.shape} at flat index "
            f"{flat}, index {index}: expected {e.flatten()[flat].item():.6g}, "
            f"got {g.flatten()[flat].item():.6g} "
            f"({len(bad)} of {e.numel()} elements differ)" + _small_values(e, g)
        )
        self.hint = _hint(e, g, world_size, rtol, atol)

    @property
    def ok(self) -> bool:
        return self.close


class Report:
    """Result of `compare`: `ok`, `entries` (one per tensor), printable one line per tensor."""

    def __init__(self, entries, *, label="", rank=None, missing=(), unexpected=()):
        self.entries, self.label, self.rank = entries, label, rank
        self.missing, self.unexpected = list(missing), list(unexpected)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.unexpected and all(e.ok for e in self.entries)

    def failures(self):
        return [e for e in self.entries if not e.ok]

    def summary(self) -> str:
        who = f"[rank {self.rank}] " if self.rank is not None else ""
        what = f"{self.label}: " if self.label else ""
        n_bad = len(self.failures()) + len(self.missing) + len(self.unexpected)
        n_all = len(self.entries) + len(self.unexpected)
        status = "ok" if self.ok else f"FAILED ({n_bad} of {n_all} differ)"
        return f"{who}{what}{status}, {len(self.entries)} tensor(s) compared"

    def __str__(self) -> str:
        return self.summary() + "\n" + self.details()

    def details(self) -> str:
        """The report without its summary line: the table, the first mismatch and its hint."""
        width = max([len(e.name) for e in self.entries] + [4])
        lines = [f"  {'name':<{width}}  {'shape':<14} exact  close  max|diff|"]
        for e in self.entries:
            shape = str(e.shape) if e.shape == e.got_shape else f"{e.shape}!={e.got_shape}"
            lines.append(
                f"  {e.name:<{width}}  {shape:<14} {str(e.exact):<6} {str(e.close):<6} {e.max_diff:.3g}"
            )
        first = next(iter(self.failures()), None)
        if first is not None:
            lines.append(f"  {first.problem}")
            if first.hint:
                lines.append(f"  hint: {first.hint}")
        if self.missing:
            lines.append(f"  missing in got: {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(f"  not in expected: {', '.join(self.unexpected)}")
        return "\n".join(lines)

    __repr__ = __str__

    def first_problem(self) -> str:
        """Just the first mismatch and its hint (or what is missing): '' when ok."""
        lines = self.details().splitlines()
        return "\n".join(line[2:] for line in lines[1 + len(self.entries) :])

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise AssertionError("\n" + str(self))


def compare(
    expected, got, *, rtol=1e-5, atol=1e-7, names=None, rank=None, world_size=None, label=""
) -> Report:
    """Compare tensors / lists / dicts (state_dicts, nested) / nn.Modules (named_parameters).

    Tensors are matched by name (dicts, modules) or position (lists); `names` renames them in
    order. `rank` and `world_size` make the report name the rank and test SUM-vs-AVG.
    """
    exp_named, got_named = _named(expected, names), _named(got, names)
    entries = [
        Entry(name, exp_named[name], got_named[name], rank=rank, world_size=world_size, rtol=rtol, atol=atol)
        for name in exp_named
        if name in got_named
    ]
    return Report(
        entries,
        label=label,
        rank=rank,
        missing=[n for n in exp_named if n not in got_named],
        unexpected=[n for n in got_named if n not in exp_named],
    )


def check_close(expected, got, *, verbose=True, **kwargs) -> Report:
    """compare(), print the report (just its summary if ok and not verbose), raise if failed."""
    report = compare(expected, got, **kwargs)
    print(report if verbose or not report.ok else report.summary())
    report.raise_if_failed()
    return report


NOT_IMPLEMENTED = "not implemented yet"  # what a lab's rank function returns for an unwritten exercise


def fail(what: str, hint: str) -> NoReturn:
    """A lab check's failure: what it saw, then the hint that names the mistake."""
    raise AssertionError(f"{what}\nhint: {hint}")


def attempt(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a rank, as a lab's check runs a learner's code: its value,
    NOT_IMPLEMENTED for an unwritten exercise, or "raised T: message", which the kernel then
    reports with the case (a rank that raised would leave its peers waiting in a collective)."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        return NOT_IMPLEMENTED
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"


def run_check(name: str, thunk):
    """labkit.exercise.check (it prints '<name>: not implemented yet' or FAIL in a learner's
    notebook, and raises when grading), where a returned Report that is not ok also fails."""
    from .exercise import check  # imported here: it pulls in the launcher

    def thunk_then_report():
        result = thunk()
        if isinstance(result, Report):
            result.raise_if_failed()
        return result

    return check(name, thunk_then_report)


def _fmt(value: float, unit: str) -> str:
    return fmt_bytes(value) if unit == "B" else f"{value:.4g} {unit}".rstrip()


def _match_line(label, expected, measured, rel_tol, unit):
    match = abs(measured - expected) <= rel_tol * abs(expected) if expected else measured == 0
    line = f"{label}: expected {_fmt(expected, unit)} / measured {_fmt(measured, unit)} / "
    if match:
        return match, line + "match"
    off = f" ({(measured - expected) / expected:+.1%})" if expected else ""
    return match, line + "MISMATCH" + off


def assert_match(
    label: str, expected: float, measured: float, rel_tol: float = 0.01, unit: str = "B"
) -> None:
    """Print 'label: expected X / measured Y / match'; on a mismatch (beyond rel_tol) raise
    AssertionError with the same line, 'MISMATCH (+x%)': a claim in a notebook must be able to fail."""
    match, line = _match_line(label, expected, measured, rel_tol, unit)
    print(line)
    if not match:
        raise AssertionError(line)


def expect_match(
    label: str, expected: float, measured: float, rel_tol: float = 0.01, unit: str = "B"
) -> bool:
    """assert_match, returning True: it used to only print a MISMATCH, a check that could not fail."""
    assert_match(label, expected, measured, rel_tol, unit)
    return True


def machine_load() -> float:
    """The 1-minute load average per core (os.getloadavg()[0] / os.cpu_count()): 1.0 is every
    core busy; above that, runnable processes wait for a core."""
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def too_loaded(ranks: int) -> bool:
    """True when the machine is too loaded to trust a wall time measured on `ranks` ranks: the
    load average is above cores + ranks, i.e. more runnable processes than cores besides the
    ranks' own (the ranks themselves add about `ranks` to the load while they run)."""
    return os.getloadavg()[0] > (os.cpu_count() or 1) + ranks


def load_report(ranks: int) -> dict:
    """What a benchmark reports beside its timings: the 1-minute load average, the cores, and
    whether the machine was too loaded to trust a wall time measured on `ranks` ranks
    (too_loaded). Read it right after the measurement: the average covers its last minute."""
    return {
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "cpu_cores": os.cpu_count(),
        "too_noisy_to_call": too_loaded(ranks),
    }


def load_line(report: dict) -> str:
    """load_report as one printed line."""
    line = f"load average {report['load_avg_1min']:.1f} (1 min) on {report['cpu_cores']} cores"
    return line + ("; timings too noisy to call on this machine" if report["too_noisy_to_call"] else "")


def timing_match(
    label: str, expected: float, measured: float, rel_tol: float, ranks: int, unit: str = "s"
) -> bool:
    """assert_match for a wall time: on a machine too loaded to trust times (too_loaded(ranks))
    print 'label: expected X / measured Y / too noisy to call on this machine: load N' and return
    False, never raising (a busy machine must not stop a Run All); otherwise assert_match (raises
    on a mismatch) and return True."""
    if too_loaded(ranks):
        print(
            f"{label}: expected {_fmt(expected, unit)} / measured {_fmt(measured, unit)} / "
            f"too noisy to call on this machine: load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        return False
    assert_match(label, expected, measured, rel_tol, unit)
    return True


# ---------------------------------------------------------------- answers given as numbers
def answer_numbers(value, keys, what, shape=None):
    """A learner's answer to a numbers exercise, read as {key: float} (or, with shape=(rows,
    cols), {key: rows x cols floats}), before any comparison: a wrong type or a missing key raises
    AssertionError "expected a dict with keys ...", never an AttributeError from in here."""
    form = "numbers" if shape is None else f"a list of {shape[0]} lists of {shape[1]} numbers"
    want = f"{what} must return a dict with keys {', '.join(map(repr, keys))}, each {form}"
    if not isinstance(value, Mapping):
        raise AssertionError(
            f"expected a dict with keys {', '.join(map(repr, keys))}; got "
            f"{type(value).__name__} {_short(value)}\nhint: {want}"
        )
    missing = [k for k in keys if k not in value]
    if missing:
        raise AssertionError(
            f"expected a dict with keys {', '.join(map(repr, keys))}; missing "
            f"{', '.join(map(repr, missing))} (got keys {list(value)})\nhint: {want}"
        )
    out = {}
    for k in keys:
        try:
            if shape is None:
                out[k] = float(value[k])
            else:
                rows = [[float(x) for x in row] for row in value[k]]
                if [len(r) for r in rows] != [shape[1]] * shape[0]:
                    raise ValueError
                out[k] = rows
        except (TypeError, ValueError):
            raise AssertionError(
                f"{k!r}: expected {'a number' if shape is None else form}, got "
                f"{_short(value[k])}\nhint: {want}"
            ) from None
    return out


def _short(value, width=60):
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
