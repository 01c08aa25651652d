"""make test executes each copy of a lab once (issue 39). These tests hold the pieces that make that
safe: nbval's run is kept with its outputs and its provenance (scripts/nbval_keep.py); nbgrader
grades a kept copy only when it is the complete run of the very notebook file being graded
(scripts/nbgrader_check.py); a graded blank copy passes the learner-copy check only when every
error in it is an unfinished exercise (scripts/check_student.py); the stage table is printed even
when a stage fails (scripts/stages.py)."""

import os
import subprocess
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import check_student  # noqa: E402
import nbgrader_check  # noqa: E402
import nbval_keep  # noqa: E402

v4 = nbformat.v4


def _notebook(path):
    nb = v4.new_notebook()
    nb.cells = [v4.new_markdown_cell("# 09 · test"), v4.new_code_cell("print(1)"), v4.new_code_cell("2")]
    nbformat.write(nb, path)
    return nbformat.read(path, as_version=4)


def _kept(tmp_path, ran):
    path = str(tmp_path / "x_lab.ipynb")
    nb = _notebook(path)
    stream = nbformat.NotebookNode(output_type="stream", name="stdout", text="1\n")
    cells = {0: ([stream], False)}
    if ran == 2:
        result = nbformat.NotebookNode(output_type="execute_result", data={"text/plain": "2"}, metadata={})
        cells[1] = ([result], False)
    return path, nbval_keep.kept(path, {"nb": nb, "cells": cells})


def test_kept_copy_holds_this_runs_outputs_and_its_provenance(tmp_path):
    path, nb = _kept(tmp_path, ran=2)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].outputs[0].text == "1\n" and code[1].outputs[0]["execution_count"] == 2
    meta = nb.metadata["labkit_executed"]
    assert meta["code_cells"] == meta["ran"] == 2 and meta["failed"] == 0


def test_grading_uses_a_kept_copy_only_if_complete_and_of_this_file(tmp_path):
    path, nb = _kept(tmp_path, ran=2)
    kept = tmp_path / "kept"
    kept.mkdir()
    nbformat.write(nb, str(kept / "x_lab.ipynb"))
    copy, why = nbgrader_check.executed_copy(path, str(kept))
    assert copy == str(kept / "x_lab.ipynb") and why == ""

    assert nbgrader_check.executed_copy(path, None)[0] is None
    assert "does not exist" in nbgrader_check.executed_copy(path, str(tmp_path / "nowhere"))[1]

    with open(path, "a") as f:  # the notebook changed since nbval ran it
        f.write("\n")
    copy, why = nbgrader_check.executed_copy(path, str(kept))
    assert copy is None and "another version" in why

    path, partial = _kept(tmp_path, ran=1)  # nbval skipped or never reached a cell
    nbformat.write(partial, str(kept / "x_lab.ipynb"))
    copy, why = nbgrader_check.executed_copy(path, str(kept))
    assert copy is None and "ran 1 of its 2" in why


def test_grading_uses_a_browser_run_only_if_complete_and_of_this_release_copy(tmp_path):
    """--learner-runs: the browser test's runs of the blank copies, by the same rule as nbval's."""
    release, nb = _kept(tmp_path, ran=2)
    runs = tmp_path / "browser"
    runs.mkdir()
    assert "no --learner-runs folder" in nbgrader_check.executed_copy(release, None, "--learner-runs")[1]
    nbformat.write(nb, str(runs / "x_lab.ipynb"))
    assert nbgrader_check.executed_copy(release, str(runs), "--learner-runs")[0] == str(runs / "x_lab.ipynb")
    with open(release, "a") as f:  # generate_assignment wrote another copy (the lab changed)
        f.write("\n")
    copy, why = nbgrader_check.executed_copy(release, str(runs), "--learner-runs")
    assert copy is None and "another version" in why


def test_execute_blank_names_a_lab_or_is_refused(tmp_path):
    path = str(tmp_path / "x_lab.ipynb")
    _notebook(path)
    with pytest.raises(SystemExit, match=r"--execute-blank 09_y_lab: no such lab here \(labs: 09_x_lab\)"):
        nbgrader_check.check([path], str(tmp_path / "course"), execute_blank=["09_y_lab"])


def _learner_run(stderr):
    """A blank copy as a learner's JupyterLab ran it: the check printed on stderr, no error."""
    nb = v4.new_notebook()
    check = v4.new_code_cell("labkit.exercise.check('x', ...)")
    check.metadata["nbgrader"] = {"grade": True, "grade_id": "x", "points": 1}
    check.outputs = [v4.new_output("stream", name="stderr", text=stderr)]
    nb.cells = [v4.new_code_cell("def mine():\n    raise NotImplementedError()"), check]
    return nb


@pytest.mark.parametrize(
    "stderr, ok",
    [
        ("TODO x: not implemented yet; the cells below use labkit's reference solution\n", True),
        ("FAIL x: AssertionError: gradients differ\n", False),
    ],
)
def test_a_learner_run_of_a_blank_copy_passes_only_with_unfinished_checks(stderr, ok):
    problems = check_student.problems_in(_learner_run(stderr), "blank", graded=False)
    assert (problems == []) is ok, problems


def _graded_blank(error):
    nb = v4.new_notebook()
    check = v4.new_code_cell("labkit.exercise.check('x', ...)")
    check.metadata["nbgrader"] = {"grade": True, "grade_id": "x", "points": 1}
    check.outputs = [v4.new_output("error", ename=error[0], evalue=error[1], traceback=[])]
    nb.cells = [v4.new_code_cell("raise NotImplementedError()"), check, v4.new_code_cell("print('after')")]
    nb.cells[0].outputs = [v4.new_output("error", ename="NotImplementedError", evalue="", traceback=[])]
    nb.cells[0].metadata["tags"] = ["raises-exception"]
    return nb


@pytest.mark.parametrize(
    "error, ok",
    [
        (("NotImplementedError", ""), True),
        (("RankError", "rank 0 raised NotImplementedError"), True),
        (("AssertionError", "gradients differ"), False),
        (("RankError", "rank 1 raised ValueError: shapes"), False),
    ],
)
def test_a_graded_blank_copy_passes_only_with_unfinished_checks(error, ok):
    problems = check_student.problems_in(_graded_blank(error), "blank", graded=True)
    assert (problems == []) is ok, problems


def test_a_graded_blank_copy_whose_fallback_crashes_fails():
    nb = _graded_blank(("NotImplementedError", ""))
    nb.cells[2].outputs = [v4.new_output("error", ename="NameError", evalue="impl", traceback=[])]
    assert any("crashed" in p for p in check_student.problems_in(nb, "blank", graded=True))


def test_the_stage_table_is_printed_when_a_stage_fails(tmp_path):
    (tmp_path / "Makefile").write_text("good:\n\t@true\nbad:\n\t@false\nlate:\n\t@true\n")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "stages.py"), "good", "bad", "late"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
    )
    assert out.returncode != 0
    assert "good" in out.stdout and "FAILED" in out.stdout and "not run: late" in out.stdout, out.stdout


def test_stages_joined_by_plus_run_side_by_side_and_each_is_reported(tmp_path):
    """a+b: each waits until the other has started (it could not end if they ran one after the
    other), b's output comes whole after the group, the table has a row for each, and a failed
    member stops what follows."""
    wait = "for i in $$(seq 300); do [ -e {0} ] && break; sleep 0.1; done; [ -e {0} ]"
    (tmp_path / "Makefile").write_text(
        f"a:\n\t@touch a.on; {wait.format('b.on')}; echo A-out $$LABKIT_STAGE\n"
        f"b:\n\t@touch b.on; {wait.format('a.on')}; echo B-out\n"
        "bad:\n\t@false\nlate:\n\t@true\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    stages = [sys.executable, os.path.join(ROOT, "scripts", "stages.py")]
    out = subprocess.run(stages + ["a+b", "late"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "A-out 1" in out.stdout and out.stdout.index("A-out") < out.stdout.index("B-out"), out.stdout
    table = out.stdout.split("stage by stage:")[1]
    assert "(beside b)" in table and "(beside a)" in table and "late" in table, table
    out = subprocess.run(stages + ["a+bad", "late"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "FAILED" in out.stdout and "not run: late" in out.stdout, out.stdout


def test_a_hung_autograde_is_killed_and_graded_once_more(capsys):
    """A kernel that never answers (a port taken between jupyter_client's pick and the kernel's
    bind) must not hang `make test`: past the limit, everything below the grader is killed and the
    copy graded again; the retry's result is what counts."""
    calls = []

    class Api:
        def autograde(self, name, student, force=True):
            calls.append(subprocess.Popen(["sleep", "60"]))
            if len(calls) == 1:
                calls[-1].wait()  # a hang, until the watchdog kills the "kernel"
                return {"success": True}  # what comes back after the kill must not count
            calls[-1].kill()
            return {"success": True, "second": True}

    result = nbgrader_check.autograde(Api(), "01_x_lab", "blank", limit=2)
    assert result == {"success": True, "second": True}
    assert calls[0].returncode == -9  # the hung one's process was killed
    assert "grading it once more" in capsys.readouterr().out


def test_an_autograde_that_fails_twice_fails():
    class Api:
        def autograde(self, name, student, force=True):
            return {"success": False, "error": "Traceback ...\nDeadKernelError: Kernel died"}

    assert nbgrader_check.autograde(Api(), "01_x_lab", "blank", limit=30)["success"] is False
