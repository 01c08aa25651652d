"""What `labkit.run` hands back (RunResult, or RankError / RankTimeout) and how it shows what the
ranks printed and why they failed.

Ranks write to one log file each (their fds 1 and 2, so C/C++ output is included); the kernel
prints the lines with a `[rank r]` prefix, either live or rank by rank at the end.
"""

import linecache
import os
import re
import sys
from typing import Any, Sequence

# A peer's symptom, not a root cause: these errors appear on ranks that were talking to the rank
# that really failed.
_SYMPTOMS = re.compile(
    r"connection (reset|closed|refused)|broken pipe|timed out|\btimeout\b|\bpeer\b|recvBytes|"
    r"sendBytes|\bsocket\b|ECONNRESET|EPIPE|\baborted\b",
    re.I,
)
_SYMPTOM_TYPES = {"ConnectionResetError", "BrokenPipeError", "TimeoutError", "DistNetworkError"}


class RankError(RuntimeError):
    """One or more ranks failed; `.failures` maps rank → (exception type name, message)."""

    def __init__(self, message, failures=None):
        super().__init__(message)
        self.failures = failures or {}


class RankTimeout(RankError):
    """Some ranks did not finish within the timeout; the message shows where each is stuck."""


def is_symptom(type_name: str, message: str) -> bool:
    if type_name == "RankDied":  # a death is a cause, whatever its last output says
        return False
    return type_name in _SYMPTOM_TYPES or bool(_SYMPTOMS.search(message))


def code_locations(*roots: Any, limit: int = 500) -> list:
    """(name, first line, last line, filename) of the code that travels by value.

    cloudpickle renames shipped code to "<dynamic-code>", so a rank cannot say which notebook
    cell a frame comes from; the kernel can, from the original code objects.
    """
    import types

    seen: set[int] = set()
    out: list = []
    todo = list(roots)
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (types.FunctionType, types.MethodType)):
            obj = getattr(obj, "__func__", obj)
            todo.append(obj.__code__)
            for name in obj.__code__.co_names:
                g = obj.__globals__.get(name)
                if getattr(g, "__module__", None) == "__main__":
                    todo.append(g)
        elif isinstance(obj, type) and obj.__module__ == "__main__":
            todo += [v for v in vars(obj).values() if callable(v) or isinstance(v, staticmethod)]
        elif isinstance(obj, (list, tuple)):
            todo += list(obj)
        elif isinstance(obj, types.CodeType):
            lines = [l for _, _, l in obj.co_lines() if l is not None] or [obj.co_firstlineno]
            out.append((obj.co_name, obj.co_firstlineno, max(lines), obj.co_filename))
            todo += [c for c in obj.co_consts if isinstance(c, types.CodeType)]
    return out


def _real_filename(filename, lineno, name, locations):
    if filename != "<dynamic-code>":
        return filename
    for n, first, last, real in locations:
        if n == name and first <= lineno <= last:
            return real
    return filename


def format_frames(frames: Sequence[Any], locations: Sequence[tuple] = ()) -> str:
    if not frames:
        return ""
    lines = ["Traceback (most recent call last):"]
    for filename, lineno, name, line in frames:
        filename = _real_filename(filename, lineno, name, locations)
        lines.append(f'  File "{short_path(filename)}", line {lineno}, in {name}')
        # The kernel knows the source of notebook cells; the rank did not.
        line = line or linecache.getline(filename, lineno).strip()
        if line:
            lines.append(f"    {line}")
    return "\n".join(lines)


def failure_report(errors: dict, world_size: int, backend: str, locations: Sequence[tuple] = ()) -> RankError:
    """Build one exception from per-rank error messages, root cause first."""
    # A rank that died comes first: its peers' errors are what its death did to them.
    order = sorted(
        errors,
        key=lambda r: (errors[r][1] != "RankDied", is_symptom(errors[r][1], errors[r][2]), errors[r][5], r),
    )
    roots = [r for r in order if not is_symptom(errors[r][1], errors[r][2])] or order[:1]
    first = errors[roots[0]]
    names = ", ".join(str(r) for r in roots)
    head = (
        f"rank{'s' if len(roots) > 1 else ''} {names} of {world_size} ({backend}) failed: "
        f"{first[1]}: {first[2]}"
    )
    parts = [head, ""]
    # Ranks that failed the same way (the same code raising on every rank) show one traceback.
    groups: dict[tuple, list[int]] = {}
    for r in roots:
        _, tname, msg, frames, only, _t = errors[r]
        groups.setdefault((tname, tuple(map(tuple, frames))), []).append(r)
    for ranks in groups.values():
        _, tname, msg, frames, only, _t = errors[ranks[0]]
        detail = [x for x in (format_frames(frames, locations), only) if x]
        if not detail:
            continue
        same = (
            f"ranks {', '.join(map(str, ranks))} (the same traceback)"
            if len(ranks) > 1
            else f"rank {ranks[0]}"
        )
        parts += [f"--- {same} ---", *detail]
        parts += [
            f"  rank {r}: {errors[r][1]}: {errors[r][2].splitlines()[0][:200]}"
            for r in ranks[1:]
            if errors[r][2] != msg
        ]
        parts.append("")
    others = [r for r in order if r not in roots]
    if others:
        parts.append("Caused on other ranks (consequences of the failure above, not causes):")
        for r in others:
            parts.append(f"  rank {r}: {errors[r][1]}: {errors[r][2].splitlines()[0][:200]}")
    stopped = [r for r in range(world_size) if r not in errors]
    if stopped:
        parts.append(
            f"Stopped by labkit: rank{'s' if len(stopped) > 1 else ''} "
            f"{', '.join(map(str, stopped))} (still running when the failure arrived)."
        )
    failures = {r: (errors[r][1], errors[r][2]) for r in errors}
    return RankError("\n".join(parts).rstrip(), failures)


_FRAME = re.compile(r'\s*File "(.*)", line (\d+) in (.*)')
# Frames that are the machinery around the learner's code, not where it is stuck.
_PLUMBING = (
    "/multiprocessing/",
    "labkit/launch/_worker.py",
    "/threading.py",
    "c10d_logger.py",
    "<string>",
    "labkit/observe/recording.py",
)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # labkit/


def short_path(filename: str) -> str:
    """Paths relative to where a learner would look: the package, not this machine's layout."""
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1]
    if filename.startswith(_PACKAGE_DIR + os.sep):
        return "labkit/" + filename[len(_PACKAGE_DIR) + 1 :]
    return filename


def format_stack_dump(text: str, locations: Sequence[tuple] = ()) -> str:
    """faulthandler's dump (most recent call first) → readable, most recent call last."""
    out: list[str] = []
    block: list[tuple] = []

    def flush():
        if not block:
            return
        frames = [f for f in reversed(block) if not any(p in f[0] for p in _PLUMBING)]
        for filename, lineno, name in frames:
            filename = _real_filename(filename, lineno, name, locations)
            out.append(f'    File "{short_path(filename)}", line {lineno}, in {name}')
            src = linecache.getline(filename, lineno).strip()
            if src:
                out.append(f"      {src}")
        block.clear()

    for line in text.splitlines():
        m = _FRAME.match(line)
        if m:
            block.append((m.group(1), int(m.group(2)), m.group(3).strip()))
        elif line.strip():
            flush()
            if "labkit-parent-watch" in line:
                continue
            head = line.strip().rstrip(":").replace(" (most recent call first)", "")
            head = head.replace("Current thread", "main thread")
            out.append("  " + head + " (most recent call last):")
    flush()
    # Drop the header of the watchdog thread, whose frames were all filtered out.
    return "\n".join(
        l
        for i, l in enumerate(out)
        if not (
            l.endswith("(most recent call last):")
            and (i + 1 == len(out) or out[i + 1].endswith("(most recent call last):"))
        )
    )


def last_output(lines: Sequence[str], locations: Sequence[tuple] = (), n: int = 8) -> str:
    """What a dead rank printed last. A crash that faulthandler caught ("Fatal Python error:
    Segmentation fault" and the Python stack) is shown as the error and a readable stack."""
    starts = [i for i, l in enumerate(lines) if l.startswith("Fatal Python error:")]
    if not starts:
        return "\n".join(lines[-n:]) or "(none)"
    crash = lines[starts[-1] :]
    stack = [l for l in crash[1:] if not l.startswith("Extension modules:")]
    before = "\n".join(lines[max(0, starts[-1] - 3) : starts[-1]])
    return "\n".join(x for x in (before, crash[0], format_stack_dump("\n".join(stack), locations)) if x)


class OutputPump:
    """Reads the ranks' log files and prints their lines with a rank prefix."""

    def __init__(self, paths, live: bool):
        self.paths, self.live = paths, live
        self.offsets = [0] * len(paths)
        self.partial = [""] * len(paths)
        self.lines: list[list[str]] = [[] for _ in paths]

    def _read(self, rank):
        try:
            with open(self.paths[rank], "rb") as f:
                f.seek(self.offsets[rank])
                data = f.read()
        except FileNotFoundError:
            return []
        self.offsets[rank] += len(data)
        text = self.partial[rank] + data.decode("utf-8", "replace")
        *complete, self.partial[rank] = text.split("\n")
        self.lines[rank] += complete
        return complete

    def pump(self) -> None:
        for rank in range(len(self.paths)):
            new = self._read(rank)
            if self.live:
                for line in new:
                    print(f"[rank {rank}] {line}", file=sys.stdout, flush=True)

    def finish(self) -> None:
        self.pump()
        for rank in range(len(self.paths)):
            if self.partial[rank]:
                self.lines[rank].append(self.partial[rank])
                if self.live:
                    print(f"[rank {rank}] {self.partial[rank]}", flush=True)
                self.partial[rank] = ""
        if not self.live:
            for rank, lines in enumerate(self.lines):
                for line in lines:
                    print(f"[rank {rank}] {line}", flush=True)

    def text(self, rank: int) -> str:
        return "\n".join(self.lines[rank])

    def tail(self, rank: int, n: int = 5) -> str:
        return "\n".join(self.lines[rank][-n:])


def default_output_mode() -> str:
    mode = os.environ.get("LABKIT_OUTPUT", "").strip().lower()
    if mode in ("live", "ordered"):
        return mode
    # Deterministic output where outputs are compared (nbval, CI), live for a person.
    if os.environ.get("CI") or os.environ.get("PYTEST_CURRENT_TEST") or "nbval" in sys.modules:
        return "ordered"
    return "live"


class RunResult(list):
    """The ranks' return values, indexed by rank, plus what labkit recorded on each rank."""

    traces: list
    memory: list
    logs: list
    wall_s: float
    backend: str
    world_size: int

    @classmethod
    def build(
        cls,
        values: list,
        extras: Sequence[dict],
        backend: str,
        logs: Sequence[str] = (),
        wall_s: float = float("nan"),
    ) -> "RunResult":
        """extras: per rank, what `_worker.end_hooks()` returned there."""
        result = cls(values)
        result.traces = [e.get("trace") for e in extras]
        result.memory = [e.get("memory") for e in extras]
        result.logs, result.wall_s = list(logs), wall_s
        result.backend, result.world_size = backend, len(values)
        return result
