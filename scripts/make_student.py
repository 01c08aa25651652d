"""Write the learner copies of the notebooks, with nbgrader's generate_assignment.

    python scripts/make_student.py [--out student] [--force] [notebooks/dp_lab.ipynb ...]

The solution notebooks are nbgrader source: solution cells (`### BEGIN SOLUTION` regions) and
locked, graded check cells, in their cell metadata. Each notebook becomes one nbgrader
assignment named by its place in the course, taken from its title ("# 01 · ..." makes dp_lab
01_dp_lab), so a file browser lists the copies in course order. nbgrader replaces every solution
with `raise NotImplementedError()`, removes hidden tests and clears the outputs; the release is
what a learner gets, and what `nbgrader autograde` grades (scripts/nbgrader_check.py).

Files already in --out are a learner's work: they are kept unless --force.
"""

import argparse
import glob
import os
import re
import shutil
import sys
import tempfile

import nbformat


def course_name(path) -> str:
    """'01_dp_lab' for notebooks/dp_lab.ipynb, whose title reads '# 01 · ...'."""
    nb = nbformat.read(path, as_version=4)
    stem = os.path.splitext(os.path.basename(path))[0]
    title = next(c.source for c in nb.cells if c.cell_type == "markdown")
    number = re.match(r"#\s*(\d+)\s*·", title)
    if number is None:
        raise ValueError(f"{path}: its first markdown cell should be the title '# NN · ...'")
    prefix = number.group(1) + "_"
    return stem if stem.startswith(prefix) else prefix + stem


def nbgrader_api(course_root, timeout=600, execute=True):
    """nbgrader's Python API on a course directory (no nbgrader_config.py needed).
    execute=False: autograde grades the outputs a submission already holds (nbgrader's own
    preprocessors, less ClearOutput and Execute), for a notebook executed once elsewhere."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.converters import Autograde
    from traitlets.config import Config

    # nbgrader runs `alembic` (its database migrations) as a command: it must be on PATH
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    config = Config()
    config.CourseDirectory.root = os.path.abspath(course_root)
    config.Execute.timeout = timeout  # nbgrader's default is 30 s a cell; a launch may take more
    if not execute:
        for trait in ("sanitize_preprocessors", "autograde_preprocessors"):
            default = Autograde.class_traits()[trait].default()
            setattr(
                config.Autograde, trait, [p for p in default if p.__name__ not in ("ClearOutput", "Execute")]
            )
    return NbGraderAPI(config=config)


def generate(paths, course_root) -> dict:
    """generate_assignment for each notebook; returns {assignment name: released notebook}."""
    api, released = nbgrader_api(course_root), {}
    for path in paths:
        name = course_name(path)
        source = os.path.join(course_root, "source", name)
        os.makedirs(source, exist_ok=True)
        shutil.copy(path, os.path.join(source, name + ".ipynb"))
        result = api.generate_assignment(name)
        if not result["success"]:
            raise RuntimeError(
                f"nbgrader generate_assignment {path} failed:\n"
                f"{result.get('error', '')}\n{result.get('log', '')}"
            )
        released[name] = os.path.join(course_root, "release", name, name + ".ipynb")
    return released


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*")
    ap.add_argument("--out", default="student")
    ap.add_argument("--force", action="store_true", help="overwrite existing copies (a learner's edits)")
    a = ap.parse_args()
    paths = a.notebooks or sorted(glob.glob("notebooks/*.ipynb"))
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="labkit-nbgrader-") as course:
        for name, release in sorted(generate(paths, course).items()):
            target = os.path.join(a.out, name + ".ipynb")
            if os.path.exists(target) and not a.force:
                print(f"{target}: kept (yours; `make student-reset` overwrites it)")
                continue
            shutil.copy(release, target)
            print(f"{target}: written")


if __name__ == "__main__":
    main()
