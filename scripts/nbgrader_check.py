"""Grade the labs with nbgrader, as an instructor would: the solutions earn every point, an
unanswered copy none, and the unanswered copy still runs to its end.

    python scripts/nbgrader_check.py [notebooks/dp_lab.ipynb ...]   (default: every *_lab)

In a temporary course directory: generate_assignment on each lab (scripts/make_student.py), then
autograde two submissions of it, the release copy unmodified ("blank") and the solution notebook
("solution"). nbgrader runs them with the kernel named in the notebook ("labkit"): it must be
registered where nbgrader's Jupyter finds it (`make kernel`). In the graded blank copy, a cell
that errors and is neither a graded check nor tagged raises-exception means a fallback broke;
in the graded solutions, only raises-exception cells may error.
Exits 1, naming the lab and the exercise, otherwise.
"""

import glob
import os
import shutil
import sys
import tempfile
import time
import warnings

import nbformat

# nbgrader 0.9's gradebook warns about its own sessions under SQLAlchemy 2.x; not ours to fix
warnings.filterwarnings("ignore", message="Object of type <Submitted")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_student import generate, nbgrader_api  # noqa: E402


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


def check(paths, course) -> list:
    api, problems = nbgrader_api(course), []
    for name, release in generate(paths, course).items():
        source = os.path.join(course, "source", name, name + ".ipynb")
        for student, notebook in (("blank", release), ("solution", source)):
            start = time.perf_counter()
            submitted = os.path.join(course, "submitted", student, name)
            os.makedirs(submitted, exist_ok=True)
            shutil.copy(notebook, os.path.join(submitted, name + ".ipynb"))
            result = api.autograde(name, student)
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
            problems += [f"{name} ({student}): {e}" for e in stray_errors(graded, student == "blank")]
            total = sum(s for s, _ in got.values())
            print(
                f"{name} {student:8s}: {total:g} / {sum(m for _, m in got.values()):g} points, "
                f"{len(got)} graded checks, autograde {time.perf_counter() - start:.0f} s",
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
    paths = argv or sorted(glob.glob("notebooks/*_lab.ipynb"))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="labkit-grading-") as course:
        grade_with_this_python(os.path.join(course, "kernel"))
        problems = check(paths, course)
    for p in problems:
        print("FAIL", p)
    print(
        f"nbgrader: {len(paths)} labs generated and autograded twice in "
        f"{time.perf_counter() - start:.0f} s, {len(problems)} problem(s)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
