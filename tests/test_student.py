"""The solution notebooks are nbgrader source, and the learner copies come out of nbgrader."""

import glob
import json
import os
import sys

import nbformat
import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_student  # noqa: E402

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
LABS = [p for p in NOTEBOOKS if p.endswith("_lab.ipynb")]
MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")


def _nbgrader(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def test_learner_copies_are_named_in_course_order():
    names = [make_student.course_name(p) for p in NOTEBOOKS]
    assert sorted(names) == [
        "00_setup",
        "01_dp_lab",
        "02_zero1_lab",
        "03_fsdp_lab",
        "04_hsdp_lab",
        "05_tp_lab",
        "06_pp_lab",
        "07_seq_lab",
        "08_moe_lab",
    ], names


@pytest.mark.parametrize("path", LABS, ids=os.path.basename)
def test_every_lab_is_nbgrader_source(path):
    nb = nbformat.read(path, as_version=4)
    ids = [_nbgrader(c)["grade_id"] for c in nb.cells if _nbgrader(c)]
    assert len(ids) == len(set(ids)), f"duplicate grade_id in {ids}"
    solutions = [c for c in nb.cells if _nbgrader(c).get("solution")]
    graded = [c for c in nb.cells if _nbgrader(c).get("grade")]
    assert len(solutions) >= 2 and len(graded) >= 2
    for cell in nb.cells:
        meta = _nbgrader(cell)
        if cell.cell_type == "markdown":
            assert not any(m in cell.source for m in MARKERS), "prose names an nbgrader marker"
        elif "### BEGIN SOLUTION" in cell.source:
            assert meta.get("solution") and not meta.get("grade"), "a solution outside a solution cell"
        if meta.get("grade"):
            # a graded cell is one check: its solution and its fallback (pick) live elsewhere, so
            # the lab goes on when the check raises under grading
            assert meta["points"] > 0 and meta["locked"] and not meta["solution"]
            assert "exercise.check(" in cell.source and "exercise.pick(" not in cell.source
            assert "### BEGIN SOLUTION" not in cell.source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebooks_name_the_course_kernel(path):
    assert nbformat.read(path, as_version=4).metadata.kernelspec.name == "labkit"


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return make_student.generate(NOTEBOOKS, str(tmp_path_factory.mktemp("course")))


def test_generate_assignment_strips_every_solution_and_output(released):
    assert sorted(released) == [
        "00_setup",
        "01_dp_lab",
        "02_zero1_lab",
        "03_fsdp_lab",
        "04_hsdp_lab",
        "05_tp_lab",
        "06_pp_lab",
        "07_seq_lab",
        "08_moe_lab",
    ]
    for name, path in released.items():
        nb = nbformat.read(path, as_version=4)
        text = json.dumps([c.source for c in nb.cells])
        assert not any(m in text for m in MARKERS), name
        solutions = [c for c in nb.cells if _nbgrader(c).get("solution")]
        assert all("raise NotImplementedError()" in c.source for c in solutions), name
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), name
        for cell in nb.cells:
            if cell.cell_type == "code":
                compile(
                    "\n".join(l for l in cell.source.splitlines() if not l.lstrip().startswith(("%", "!"))),
                    name,
                    "exec",
                )


def test_make_student_keeps_a_learners_copy(tmp_path, monkeypatch, capsys):
    release = tmp_path / "release.ipynb"
    release.write_text("fresh")
    monkeypatch.setattr(
        make_student,
        "generate",
        lambda paths, course: {"01_dp_lab": str(release), "02_zero1_lab": str(release)},
    )
    out = tmp_path / "student"
    out.mkdir()
    (out / "01_dp_lab.ipynb").write_text("the learner's work")
    monkeypatch.setattr(sys, "argv", ["make_student.py", "--out", str(out), "unused.ipynb"])
    make_student.main()
    assert (out / "01_dp_lab.ipynb").read_text() == "the learner's work"
    assert (out / "02_zero1_lab.ipynb").read_text() == "fresh"
    monkeypatch.setattr(sys, "argv", ["make_student.py", "--out", str(out), "--force", "unused.ipynb"])
    make_student.main()
    assert (out / "01_dp_lab.ipynb").read_text() == "fresh"
