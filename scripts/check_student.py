"""Execute learner copies, as a learner would, and check that each runs top to bottom.

    python scripts/check_student.py [student/*.ipynb]

A learner copy has every solution replaced by `raise NotImplementedError()`. It must still run
to the end: every exercise's check prints "not implemented yet" (no crash, no FAIL), and the
cells after it fall back to labkit's reference solution. Exits 1, naming the notebook and cell,
otherwise. `make test` does not run this script: scripts/nbgrader_check.py executes each release
copy once, the way nbgrader grades it, and applies the same checks (`problems_in(graded=True)`)
to that run. `make student-check` runs it.
"""

import glob
import os
import re
import sys
import time

import nbformat
from nbclient import NotebookClient

NOT_YET = "not implemented yet"
FAILED = re.compile(r"^FAIL ", re.M)  # labkit.exercise.check's line for a failed check


def unfinished(out) -> bool:
    """A graded check's error that means "not implemented yet": what labkit.exercise.check raises
    when grading, where a learner's kernel prints the TODO line instead (a RankError when the
    ranks raised it)."""
    return out.ename == "NotImplementedError" or (
        out.ename == "RankError" and "NotImplementedError" in out.evalue
    )


def problems_in(nb, path, graded=False) -> list:
    """What is wrong with an executed learner copy. graded=False: run as a learner runs it (checks
    print TODO / FAIL and never raise). graded=True: as nbgrader's autograde ran it, where an
    unfinished check raises NotImplementedError in its graded cell instead of printing TODO; any
    other error there is a check that failed, and the cells after it must still run."""
    exercises = sum(c.source.count("raise NotImplementedError") for c in nb.cells if c.cell_type == "code")
    problems, reported = [], 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        expected_error = "raises-exception" in cell.get("metadata", {}).get("tags", [])
        check_cell = graded and cell.get("metadata", {}).get("nbgrader", {}).get("grade")
        for out in cell.get("outputs", []):
            if out.output_type == "error" and check_cell:
                if unfinished(out):
                    reported += 1
                else:
                    problems.append(f"{path}: cell {i}: a check failed: {out.ename}: {out.evalue[:300]}")
            elif out.output_type == "error" and not expected_error:
                problems.append(f"{path}: cell {i} crashed: {out.ename}: {out.evalue[:300]}")
            if out.output_type == "stream":
                reported += out.text.count(NOT_YET)
                if FAILED.search(out.text):
                    problems.append(f"{path}: cell {i}: a check failed: {out.text[:300]}")
    if exercises and reported == 0:
        problems.append(f"{path}: {exercises} exercise(s) but no check said '{NOT_YET}'")
    print(
        f"{path}: {exercises} exercise(s), {reported} check(s) said '{NOT_YET}'"
        f"{' (raised it, graded)' if graded else ''}, {len(problems)} problem(s)",
        flush=True,
    )
    return problems


def check(path) -> list:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": os.path.dirname(path) or "."}},
    )
    client.execute()
    return problems_in(nb, path)


def main(argv):
    paths = argv or sorted(glob.glob("student/*.ipynb"))
    for grading in ("LABKIT_EXERCISE", "NBGRADER_EXECUTION"):  # a learner's kernel: not graded
        os.environ.pop(grading, None)
    if not paths:
        print("no student notebooks: run `make student` first")
        return 1
    start, problems = time.perf_counter(), []
    for path in paths:
        problems += check(path)
    for p in problems:
        print("FAIL", p)
    failed = len({p.split(":")[0] for p in problems})
    print(f"student notebooks executed in {time.perf_counter() - start:.0f} s")
    print(f"{len(paths) - failed} passed, {failed} failed")  # the plain closing line CI reads
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
