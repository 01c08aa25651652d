"""Write student versions of the labs from the solution notebooks.

    python scripts/make_student.py [--out student] [notebooks/dp_lab.ipynb ...]

In every code cell, the lines between `### BEGIN SOLUTION` and `### END SOLUTION` (nbgrader's
markers, so an instructor who uses nbgrader can take the solution notebooks as its source as they
are) become a TODO and `raise NotImplementedError`, at the markers' indentation. Cells tagged
`hidden-check`, and lines between `### BEGIN HIDDEN TESTS` / `### END HIDDEN TESTS`, are removed.
Outputs are cleared: a student runs the notebook to see them.
"""
import argparse
import glob
import os
import re

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"


def strip_solutions(source: str) -> str:
    out, skipping = [], None
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            indent = line[: len(line) - len(line.lstrip())]
            out += [f"{indent}# TODO: your code here (remove the raise below)",
                    f"{indent}raise NotImplementedError"]
            skipping = END
        elif stripped == HIDDEN_BEGIN:
            skipping = HIDDEN_END
        elif skipping and stripped == skipping:
            skipping = None
        elif not skipping:
            out.append(line)
    if skipping:
        raise ValueError(f"unterminated solution block: expected '{skipping}'")
    return "\n".join(out)


def student_notebook(nb):
    nb = nbformat.from_dict(nb)
    cells = []
    for cell in nb.cells:
        if "hidden-check" in cell.get("metadata", {}).get("tags", []):
            continue
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source)
            cell.outputs, cell.execution_count = [], None
        cells.append(cell)
    nb.cells = cells
    return nb


def exercise_count(nb) -> int:
    return sum(len(re.findall(re.escape(BEGIN), c.source)) for c in nb.cells
               if c.cell_type == "code")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*")
    ap.add_argument("--out", default="student")
    a = ap.parse_args()
    paths = a.notebooks or sorted(glob.glob("notebooks/*_lab.ipynb"))
    os.makedirs(a.out, exist_ok=True)
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        n = exercise_count(nb)
        target = os.path.join(a.out, os.path.basename(path))
        nbformat.write(student_notebook(nb), target)
        print(f"{path} → {target}: {n} exercise(s)")


if __name__ == "__main__":
    main()
