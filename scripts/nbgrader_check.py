"""Grade the labs with nbgrader, as an instructor would: the solutions earn every point, an
unanswered copy none, and the unanswered copy still runs to its end.

    python scripts/nbgrader_check.py [notebooks/dp_lab.ipynb ...]   (default: every *_lab)

    python scripts/nbgrader_check.py --executed build/executed [notebooks/...]

    python scripts/nbgrader_check.py --executed build/executed --learner-runs build/browser \
        --execute-blank 08_moe_lab

In a temporary course directory: generate_assignment on each lab (scripts/make_student.py), then
autograde two submissions of it, the release copy unmodified ("blank") and the solution notebook
("solution"). nbgrader runs them with the kernel named in the notebook ("labkit"): it must be
registered where nbgrader's Jupyter finds it (`make kernel`).

Each copy is executed once in `make test`:
- The blank copy: with --learner-runs DIR, the run of it that the browser test kept (tests/browser:
  JupyterLab's Run All, as a learner runs it) is graded as it stands, like the solution below. Its
  checks printed "TODO ... not implemented yet" on stderr, which nbgrader scores 0 as it scores the
  error its own run raises (labkit.exercise). Used only if it is the run of this very release copy
  (same SHA-256; nbgrader's generate_assignment writes the same file each time) and every code cell
  ran; otherwise, and for each lab named by --execute-blank (make test names one, so that the path
  an instructor's autograde takes, nbgrader executing the copy with its checks raising, runs in
  every `make test`), the blank copy is executed here by nbgrader's autograde. Either run is also
  the learner copy's check (scripts/check_student.py's `problems_in`): every check said "not
  implemented yet" and nothing else, and every other cell ran (its fallback to the reference
  works). It must score 0.
- The solution: with --executed DIR, the copy nbval executed in this `make test` (scripts/
  nbval_keep.py) is graded as it stands, by nbgrader with its ClearOutput and Execute
  preprocessors left out. It is used only if it is the run of this very notebook file (same
  SHA-256) and every code cell ran; otherwise this script says why and executes the solution
  itself. It must score every point, and only raises-exception cells may error.
Exits 1, naming the lab and the exercise, otherwise.

A copy whose autograde fails or outlasts LABKIT_GRADE_TIMEOUT seconds (default 1200; the kernel
and every process under it are killed then) is graded once more, saying why: a kernel that
could not bind its ports (jupyter_client picks them before the kernel binds them, and another
process may take one in between) must not fail or hang the grading. A real failure fails twice.
"""

import argparse
import contextlib
import glob
import hashlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings

import nbformat

# nbgrader 0.9's gradebook warns about its own sessions under SQLAlchemy 2.x; not ours to fix
warnings.filterwarnings("ignore", message="Object of type <Submitted")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_student import problems_in  # noqa: E402
from make_student import course_name, generate, nbgrader_api  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from labkit.launch._descendants import become_subreaper, descendants  # noqa: E402

GRADE_TIMEOUT = float(os.environ.get("LABKIT_GRADE_TIMEOUT", "1200"))
RUN_BY = {"solution": "nbval's run", "blank": "the browser test's run"}  # the copies graded as they stand


def scores(api, name, student) -> dict:
    with api.gradebook as gb:
        nb = gb.find_submission_notebook(name, name, student)
        return {g.name: (g.score, g.max_score) for g in nb.grades}


def stray_errors(path, graded_may_fail) -> list:
    """Cells of an autograded notebook that raised, other than those expected to."""
    out = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        expected = (
            graded_may_fail
            and cell.metadata.get("nbgrader", {}).get("grade")
            or "raises-exception" in cell.metadata.get("tags", [])
        )
        for o in cell.get("outputs", []):
            if o.output_type == "error" and not expected:
                out.append(f"cell {i}: {o.ename}: {o.evalue[:200]}")
    return out


def executed_copy(path, executed, flag="--executed") -> tuple:
    """(the copy of `path` executed in this run that `executed` holds, or None; why not, if None)."""
    if not executed:
        return None, f"no {flag} folder"
    copy = os.path.join(executed, os.path.basename(path))
    if not os.path.exists(copy):
        return None, f"{copy} does not exist"
    meta = nbformat.read(copy, as_version=4).metadata.get("labkit_executed", {})
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    if meta.get("source_sha256") != sha:
        return None, f"{copy} is the run of another version of {path}"
    if meta.get("ran") != meta.get("code_cells"):
        return None, f"{copy} ran {meta.get('ran')} of its {meta.get('code_cells')} code cells"
    return copy, ""


def watched(call, limit: float) -> dict:
    """call() (an nbgrader autograde) in a thread; past `limit` seconds, kill every process
    below this one that the call started (the kernel nbgrader started and the ranks under it),
    which makes nbgrader's execution fail, and return its failure."""
    box: dict = {}
    before = set(descendants(os.getpid()))
    thread = threading.Thread(target=lambda: box.update(result=call()), daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        for _ in range(5):  # orphans of the killed come back below this process (a subreaper)
            for pid in set(descendants(os.getpid())) - before:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            thread.join(2)
            if not thread.is_alive():
                break
        thread.join(120)
        return {
            "success": False,
            "error": f"no result in {limit:.0f} s (LABKIT_GRADE_TIMEOUT): killed its kernel",
        }
    return box.get("result", {"success": False, "error": "autograde raised"})


def autograde(api, name, student, limit=None) -> dict:
    """nbgrader's autograde of one submission, once more if it fails or hangs (see the top)."""
    limit = GRADE_TIMEOUT if limit is None else limit
    result = watched(lambda: api.autograde(name, student, force=True), limit)
    if not result["success"]:
        why = (result.get("error") or "").strip().splitlines()[-1:] or ["(no message)"]
        print(f"{name} {student}: autograde failed ({why[0][:200]}); grading it once more", flush=True)
        result = watched(lambda: api.autograde(name, student, force=True), limit)
    return result


def check(paths, course, executed=None, learner_runs=None, execute_blank=()) -> list:
    api, problems = nbgrader_api(course), []
    graded_as_is = nbgrader_api(course, execute=False)
    labs = {course_name(p): p for p in paths}
    unknown = sorted(set(execute_blank) - set(labs))
    if unknown:
        raise SystemExit(
            f"--execute-blank {' '.join(unknown)}: no such lab here (labs: {', '.join(sorted(labs))})"
        )
    for name, release in generate(paths, course).items():
        source = os.path.join(course, "source", name, name + ".ipynb")
        runs = {
            "solution": executed_copy(labs[name], executed),
            "blank": (None, f"{name} is named by --execute-blank")
            if name in execute_blank
            else executed_copy(release, learner_runs, "--learner-runs"),
        }
        for student, notebook in (
            ("blank", runs["blank"][0] or release),
            ("solution", runs["solution"][0] or source),
        ):
            start = time.perf_counter()
            submitted = os.path.join(course, "submitted", student, name)
            os.makedirs(submitted, exist_ok=True)
            shutil.copy(notebook, os.path.join(submitted, name + ".ipynb"))
            ran, why = runs[student]
            as_is = ran is not None
            if (executed if student == "solution" else learner_runs) and not as_is:
                print(f"{name} {student}: executing it here: {why}", flush=True)
            result = autograde(graded_as_is if as_is else api, name, student)
            if not result["success"]:
                problems.append(f"{name} ({student}): autograde failed: {result.get('error', '')}")
                continue
            got = scores(api, name, student)
            for grade_id, (score, max_score) in sorted(got.items()):
                want = 0 if student == "blank" else max_score
                if score != want:
                    problems.append(
                        f"{name} ({student}): {grade_id} scored {score:g} of {max_score:g}, expected {want:g}"
                    )
            graded = os.path.join(course, "autograded", student, name, name + ".ipynb")
            if student == "blank":  # also the learner copy's run-to-the-end check
                problems += problems_in(
                    nbformat.read(graded, as_version=4), f"{name} (blank)", graded=not as_is
                )
            else:
                problems += [f"{name} ({student}): {e}" for e in stray_errors(graded, False)]
            total = sum(s for s, _ in got.values())
            how = f"graded from {RUN_BY[student]}" if as_is else "autograde"
            print(
                f"{name} {student:8s}: {total:g} / {sum(m for _, m in got.values()):g} points, "
                f"{len(got)} graded checks, {how} {time.perf_counter() - start:.0f} s",
                flush=True,
            )
    return problems


def grade_with_this_python(where):
    """nbgrader starts the notebooks' kernel ("labkit") by name. Put a kernelspec for it that
    runs this very interpreter first on Jupyter's path, so the grade is of this checkout's code,
    whichever checkout last registered the user-wide kernel."""
    from ipykernel.kernelspec import install

    install(kernel_name="labkit", display_name="Python (labkit course)", prefix=where)
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        [os.path.join(where, "share", "jupyter")] + os.environ.get("JUPYTER_PATH", "").split(os.pathsep)
    )


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*")
    parser.add_argument("--executed", metavar="DIR", help="the solutions as nbval executed them")
    parser.add_argument(
        "--learner-runs", metavar="DIR", help="the blank copies as the browser test ran them (tests/browser)"
    )
    parser.add_argument(
        "--execute-blank",
        metavar="LAB",
        action="append",
        default=[],
        help="execute this lab's blank copy with nbgrader even if --learner-runs has it (repeatable)",
    )
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(glob.glob("notebooks/*_lab.ipynb"))
    start = time.perf_counter()
    become_subreaper()  # a kernel's orphans stay below this process, where the watchdog finds them
    with tempfile.TemporaryDirectory(prefix="labkit-grading-") as course:
        grade_with_this_python(os.path.join(course, "kernel"))
        problems = check(paths, course, args.executed, args.learner_runs, args.execute_blank)
    for p in problems:
        print("FAIL", p)
    how = ", ".join(
        f"the {student}s from {RUN_BY[student]} where it is this copy's"
        if folder
        else f"{student}s executed here"
        for student, folder in (("solution", args.executed), ("blank", args.learner_runs))
    )
    print(
        f"nbgrader: {len(paths)} labs generated, each graded blank and solved ({how}) in "
        f"{time.perf_counter() - start:.0f} s, {len(problems)} problem(s)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
