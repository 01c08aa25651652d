"""What tp_lab's four checks share: the launch, the 4-rank mesh whose tp group is not the world,
value comparisons, the hints for errors a rank raised, and the agreement after each piece of the
learner's code (every rank learns whether some rank raised, so none waits in a collective for it).

A learner's error that raises on some ranks only while a peer waits for that rank in a collective
(rank 1's g raises, rank 3 waits in the all-reduce of their tp group) is reported at once: the
rank that raised waits AGREE_S for the others to agree, then leaves the launch with its own
exception (type, message, the learner's line) and the hint; labkit.run stops the rest within a
second. Left out: learner code that hangs without raising is still stopped by the launch's
RUN_TIMEOUT_S, as "timed out".
"""

from __future__ import annotations

import traceback
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from labkit.checks import NOT_IMPLEMENTED, fail
from labkit.launch import _report
from labkit.launch._report import RankError

ATOL = 1e-6
TP = 2  # the tp group's size in exercises 1-3
RUN_TIMEOUT_S = 180.0  # the launch's limit: only learner code that never returns (nor raises) meets it
AGREE_S = 5.0  # how long a rank whose code raised waits for the others' agreement (a loaded machine
# takes seconds to bring 4 ranks to it; a peer stuck in a collective for the raising rank never comes)
ANOTHER = "another rank"


def _run(fn, *args, world_size=2, timeout=None):
    import labkit

    # gloo even on a GPU machine: the lab's meshes and tensors are CPU ones
    _SEEN.clear()
    try:
        results = labkit.run(
            fn, *args, world_size=world_size, backend="gloo", timeout=timeout or RUN_TIMEOUT_S
        )
        _remember(list(results), _report.code_locations(fn, list(args)))
        return results
    except RankError as error:
        raised = sorted(r for r, (kind, _) in error.failures.items() if kind == CheckRaised.__name__)
        if not raised:
            raise
        what, _, hint = error.failures[raised[0]][1].partition("\nhint: ")
        line = _learner_frames(str(error), raised[0])
        raise AssertionError(f"{what}\n{line}\nhint: {hint}" if line else f"{what}\nhint: {hint}") from None


# ---------------------------------------------------------------- a rank that raised
class Raised(str):
    """What _try hands back when the learner's code raised: "raised T: message", as
    labkit.checks.attempt's, holding the exception while on the rank and its traceback's frames
    (which travel to the kernel: _fail shows the learner's line under the message)."""

    exc: BaseException | None = None
    frames: tuple = ()

    def __reduce__(self):
        return (_raised, (str(self), self.frames))


def _raised(text: str, frames: tuple) -> Raised:
    out = Raised(text)
    out.frames = frames
    return out


_SEEN: dict[str, str] = {}  # a launch's Raised texts -> their tracebacks, the learner's frames only


def _remember(value, locations) -> None:
    """Every Raised in a launch's results (dicts, lists), its frames formatted by the kernel
    (which knows the notebook cells' source)."""
    if isinstance(value, Raised) and value.frames:
        _SEEN[str(value)] = _report.format_frames(
            [f for f in value.frames if not any(p in f[0] for p in _PLUMBING)], locations
        ).removeprefix("Traceback (most recent call last):\n")
    elif isinstance(value, dict):
        for v in value.values():
            _remember(v, locations)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _remember(v, locations)


def _fail(what: str, hint: str) -> NoReturn:
    """labkit.checks.fail, with the learner's line under an error a rank raised that `what` names."""
    line = next((tb for text, tb in _SEEN.items() if text in what and tb), "")
    fail(f"{what}\n{line}" if line else what, hint)


class CheckRaised(AssertionError):
    """A rank's learner code raised while its peers waited for it: sent to the kernel at once."""


def _try(fn, *args, **kwargs):
    """fn(*args, **kwargs): its value, NOT_IMPLEMENTED, or a Raised string (see labkit.checks.attempt)."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        return NOT_IMPLEMENTED
    except Exception as exc:
        out = Raised(f"raised {type(exc).__name__}: {exc}")
        out.exc = exc
        out.frames = tuple(
            (f.filename, f.lineno, f.name, f.line or "") for f in traceback.extract_tb(exc.__traceback__)
        )
        return out


def _agree(*values, where: str = "", hint=None, group=None) -> bool:
    """True on every rank when no rank's value is an error string: a mistake that raises on some
    ranks only (a piece picked by the world rank) must not leave the others waiting in a collective
    for it. torch's all-reduce over `group` (the world by default; a check whose point-to-point
    waits can time out passes a group of its own: gloo closes a timed-out group's connections),
    outside the windows the checks read. A rank whose
    own code raised waits AGREE_S for it: a peer that does not come waits in a collective for this
    rank, so this rank raises its error (CheckRaised: where, the error, hint(error)) at once."""
    ok = torch.tensor([0 if any(isinstance(v, str) for v in values) else 1])
    raised = next((v for v in values if isinstance(v, Raised) and v.exc is not None), None)
    if raised is None:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        return bool(ok.item())
    work = dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=AGREE_S))
    except RuntimeError:  # gloo's "Operation timed out!"
        said = hint(str(raised)) if hint is not None else "see the error above"
        error = CheckRaised(
            f"{where}: {raised} (no agreement from the other ranks within {AGREE_S:g} s: a peer waits for "
            f"this rank in a collective; the launch was stopped)\nhint: {said}"
        )
        raise error.with_traceback(raised.exc.__traceback__) from None
    return bool(ok.item())


_PLUMBING = (  # frames around the learner's code: the check's own, autograd's and nn.Module's call
    "labkit/labs/tp_checks/",
    "labkit/labs/pp_checks.py",
    "labkit/labs/seq_checks.py",
    "labkit/labs/moe_checks.py",
    "labkit/checks.py",
    "torch/autograd/function.py",
    "torch/nn/modules/module.py",
)


def _learner_frames(report: str, rank: int) -> str:
    """rank's traceback in labkit.run's report, the check's own frames left out: the learner's line."""
    lines, out, inside = report.splitlines(), [], False
    for i, line in enumerate(lines):
        if line.startswith("--- rank") and line.endswith(" ---"):
            # "--- rank 3 ---" or "--- ranks 0, 2 (the same traceback) ---"
            ranks = line[4:-4].split(" (")[0].split(" ", 1)[1].split(", ")
            inside = str(rank) in ranks
        elif inside and line.startswith('  File "'):
            if not any(p in line for p in _PLUMBING):
                src = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("    ") else ""
                out += [line, src] if src else [line]
        elif inside and not line.startswith(" ") and not line.startswith("Traceback"):
            inside = False
    return "\n".join(out)


def _not_implemented(values):
    if any(isinstance(v, str) and v == NOT_IMPLEMENTED for v in values):
        raise NotImplementedError(NOT_IMPLEMENTED)


# ---------------------------------------------------------------- values
def _close(a, b, atol=ATOL):
    return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=atol)


def _diff(a, b):
    return (
        f"max |diff| {(a - b).abs().max().item():.3g}"
        if a.shape == b.shape
        else f"shape {tuple(b.shape)}, expected {tuple(a.shape)}"
    )


def _quiet_torch():
    """torch's DTensor warns (stderr) that its 2-D full_tensor() takes two all-gathers: not ours."""
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------- the mesh
def _mesh():
    """4 ranks as a ("tp", "dp") mesh: the tp groups are {0, 2} and {1, 3}, so a tp group is NOT
    the world and a rank's index in it is not its global rank (rank 1 is 0 of {1, 3}, rank 2 is
    1 of {0, 2}): f / g over the default group, or a piece picked by dist.get_rank(), show here."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (TP, 2), mesh_dim_names=("tp", "dp"))["tp"]


def _where(res):
    """'rank R (R' of tp group [a, b])': the global rank and its place in its tp group."""
    return f"rank {res['rank']} ({res['tp_rank']} of tp group {res['peers']})"


def _group_info(mesh):
    group = mesh.get_group()
    return {
        "rank": dist.get_rank(),
        "tp_rank": dist.get_rank(group),
        "peers": dist.get_process_group_ranks(group),
    }


def _build_then_run(build, run, where="", hint=None):
    """run(build()), every rank agreeing after each half: a build that raises on some ranks never
    leaves the others in a collective."""
    built = _try(build)
    if not _agree(built, where=f"{where}, building it", hint=hint):
        return built if isinstance(built, str) else f"{ANOTHER} raised, building it"
    out = _try(run, built)
    _agree(out, where=where, hint=hint)
    return out


# ---------------------------------------------------------------- hints
def _torch_collectives(trace, window):
    """torch.distributed's own collectives (not labkit's traced ring) the recording saw in window."""
    return [
        e["op"]
        for e in trace["events"]
        if not e["op"].startswith("ring_")
        and window[0] <= e["start"] < window[1]
        and e["op"] not in ("send", "recv", "isend", "irecv", "barrier")
    ]


TORCH_COLLECTIVES = (
    "torch.distributed's own collectives ({ops}) bypass the course's traced ring and its simulated "
    "link: the values can be right, but sections 5 and 7 count and price labkit's ring_all_reduce "
    "only. Write it with ring_all_reduce(t, op='sum', group=group)"
)
WORLD_GROUP = (
    "all-reduced over the default group (every rank: {n} here), not over `group` (the tp group, "
    "{t} of them): pass group=group to ring_all_reduce"
)
WORLD_RANK = (
    "dist.get_rank() is the rank in the WORLD ({rank} here); the piece is picked by the rank in "
    "the tp group ({tp_rank} here): dist.get_rank(group)"
)
MESH_AS_GROUP = (
    "group= takes a ProcessGroup, not a DeviceMesh: the group argument the check passes you is "
    "already the tp group (use it as it is)"
)


def _error_hint(res, msg, default="see the error above"):
    """The hint for an error a rank raised: a world rank used as an index, a DeviceMesh as a group."""
    if "DeviceMesh" in msg:
        return MESH_AS_GROUP
    if ("index" in msg and "out of range" in msg) and res["rank"] != res["tp_rank"]:
        return WORLD_RANK.format(**res)
    return default
