"""Exercises in the labs: check the learner's code, and fall back to the reference when it is not
written yet or wrong, so a learner stuck on one exercise still sees the rest of the lab.

    labkit.exercise.check("ring all-reduce", lambda: check_ring(my_ring_all_reduce))   # graded cell
    impl = labkit.exercise.pick("ring all-reduce", my_ring_all_reduce, collectives.ring_all_reduce)

Two modes. In a learner's notebook `check` never raises: it prints "PASS", or "TODO ... not
implemented yet" or "FAIL" with the check's message on stderr, and the learner's Run All reaches
the end. stderr because JupyterLab shows it on a red ground, and because nbgrader gives no points
to a graded cell that wrote to stderr: a learner copy run in JupyterLab and graded as it stands
scores what nbgrader's own run of it scores (`make test` grades the copies its browser test ran).
When grading (nbgrader's autograde and validate set NBGRADER_EXECUTION; `make nbval` sets
LABKIT_EXERCISE=strict) an unfinished or wrong exercise raises, which is what scores 0 in
nbgrader and fails nbval; anything the check writes to stderr goes to stdout there, because
nbgrader also zeroes a passing cell that writes to stderr (a warning, a note from the ranks).
`check` returns None, so a graded cell shows no value (nbgrader would read one as partial
credit); `result(name)` is the value of a check that passed.

A later exercise may build on the learner's earlier classes (fsdp_lab's units subclass each
other): `check(name, thunk, needs=[earlier names])` says first, when it fails, that an earlier
exercise it stands on fails, so its own hints are not read as the cause.
"""

import contextlib
import os
import sys
import traceback

from .launch._report import RankError

status = {}  # exercise name -> "passed" | "not implemented" | "failed"
_results = {}  # exercise name -> the value of its check, when it passed


def grading() -> bool:
    """True under nbgrader's autograde/validate and under `LABKIT_EXERCISE=strict`."""
    return bool(os.environ.get("NBGRADER_EXECUTION")) or os.environ.get("LABKIT_EXERCISE") == "strict"


def _not_implemented(exc: BaseException) -> bool:
    if isinstance(exc, NotImplementedError):
        return True
    if isinstance(exc, RankError) and exc.failures:
        return all(t == "NotImplementedError" for t, _ in exc.failures.values())
    return False


class BuildsOnAFailure(AssertionError):
    """A check failed while an exercise it builds on fails too: that one is the first suspect."""


def _run(name, thunk, needs=()):
    _results.pop(name, None)
    try:
        value = thunk()
    except Exception as exc:
        status[name] = "not implemented" if _not_implemented(exc) else "failed"
        failing = [n for n in needs if status.get(n) == "failed"]
        if status[name] == "failed" and failing:
            said = str(exc).strip() or type(exc).__name__
            raise BuildsOnAFailure(
                f"this exercise builds on your {', '.join(repr(n) for n in failing)}, whose check "
                f"fails above: fix that first (what this check saw, probably a consequence: "
                f"{type(exc).__name__}: {said})"
            ) from exc
        raise
    status[name], _results[name] = "passed", value
    print(f"PASS {name}: check passed")


def check(name: str, thunk, needs=()) -> None:
    """Run a check. Grading: raise if it fails. Otherwise print the outcome and carry on.
    needs: the names of earlier exercises whose code this one's runs on."""
    if grading():
        with contextlib.redirect_stderr(sys.stdout):
            _run(name, thunk, needs)
        return
    try:
        _run(name, thunk, needs)
    except Exception as exc:
        say = sys.stderr  # see the top: red in JupyterLab, and no points from nbgrader
        if status[name] == "not implemented":
            print(
                f"TODO {name}: not implemented yet; the cells below use labkit's reference "
                f"solution until you write it.",
                file=say,
            )
        else:
            message = str(exc).strip() or "(no message)"
            print(f"FAIL {name}: {type(exc).__name__}: {message}", file=say)
            if not isinstance(exc, (AssertionError, RankError)):
                # a bug in the learner's code, not a wrong result: where it is matters (a
                # RankError already carries the rank's traceback)
                tb = exc.__traceback__
                while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                    tb = tb.tb_next  # this module's frames: not the learner's concern
                print("".join(traceback.format_exception(type(exc), exc, tb)), file=say)
            print("     The cells below use labkit's reference solution until this check passes.", file=say)


def result(name: str):
    """The value the check returned, if it passed; else None."""
    return _results.get(name)


def pick(name: str, mine, reference):
    """The learner's implementation if its check passed, else the reference (with a note)."""
    if status.get(name) == "passed":
        return mine
    print(f"NOTE using labkit's reference for '{name}' (yours: {status.get(name, 'not checked yet')})")
    return reference


def widgets_enabled() -> bool:
    """Interactive controls only where a person is looking; under nbval/CI/nbgrader run the
    defaults once (nbgrader's executor hung on the zero1 lab's widget: nobody answers it)."""
    from .launch._report import default_output_mode

    return default_output_mode() == "live" and not os.environ.get("CI") and not grading()


def draw_into(output, draw, *args, **kwargs):
    """Run draw(*args, **kwargs) as draw_in_callback does and put what it printed and displayed
    into the ipywidgets Output `output`, replacing what was there; returns draw's value.

    Never `with output:`. That capture tells the front end to route this cell's messages into
    the widget, and headless clients (nbclient: nbconvert --execute, papermill, nbgrader, nbval's
    executor) mimic it by sending a comm_msg with the widget's new outputs on the kernel's shell
    socket while they await the cell's execute_reply on that same socket. That send can swallow
    the socket's (edge-triggered) wake-up for the reply, and the client then sleeps until its
    timeout before it sees the reply: the next cell started exactly T seconds late, kernel idle
    (seen under CPU load: dp_lab's experiment controls, zero1_lab's memory calculator and
    'try it on real ranks', fsdp_lab's knob widget). Setting `outputs` from the kernel is a plain
    widget-state update: no client sends anything back."""
    from IPython.utils.capture import capture_output

    try:
        with capture_output(stdout=True, stderr=True, display=True) as captured:
            return draw_in_callback(draw, *args, **kwargs)
    finally:  # what was drawn before a failure still shows
        outs = [
            {"output_type": "stream", "name": name, "text": text}
            for name, text in (("stdout", captured.stdout), ("stderr", captured.stderr))
            if text
        ]
        outs += [
            {"output_type": "display_data", "data": o.data, "metadata": o.metadata or {}}
            for o in captured.outputs
        ]
        output.outputs = tuple(outs)


def draw_in_callback(draw, *args, **kwargs):
    """Call draw(*args, **kwargs) and show its figures from a widget callback, outside pyplot's
    interactive mode. In interactive mode the inline backend may flush (draw) the same figure
    from another kernel thread while the callback draws it -- ipykernel handles comm messages
    on subshell threads -- and the two draws race on one image buffer: the learner sees a
    blank plot (seen in the browser test: 8 of 9 first clicks of dp_lab's bucket widget).
    The backend is loaded first: loading it is what turns IPython's interactive mode on, and
    if that happened inside ioff(), leaving ioff() would turn it off for the rest of the kernel
    (every later plain plot then showed up only inside a widget's next redraw)."""
    import matplotlib.pyplot as plt

    load = getattr(plt, "_get_backend_mod", None)  # pyplot's own lazy loader (matplotlib >= 3.5)
    if load is not None:
        load()
    with plt.ioff():
        value = draw(*args, **kwargs)
        plt.show()
    return value
