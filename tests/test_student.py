"""Student versions: solutions become TODOs, hidden checks disappear, the rest is untouched."""
import os
import sys

import nbformat
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
from make_student import exercise_count, strip_solutions, student_notebook  # noqa: E402

SOLUTION = '''def ring_step(x):
    """Docstring stays."""
    ### BEGIN SOLUTION
    y = x * 2
    return y
    ### END SOLUTION

check(ring_step)
### BEGIN HIDDEN TESTS
assert ring_step(1) == 2
### END HIDDEN TESTS'''


def test_solution_becomes_todo_at_the_same_indentation():
    out = strip_solutions(SOLUTION)
    assert "y = x * 2" not in out and "assert ring_step" not in out
    assert "    raise NotImplementedError" in out and '"""Docstring stays."""' in out
    assert out.endswith("check(ring_step)")
    compile(out, "<student>", "exec")


def test_unterminated_block_is_an_error():
    with pytest.raises(ValueError, match="unterminated"):
        strip_solutions("### BEGIN SOLUTION\nx = 1")


def test_notebook_transform_drops_hidden_cells_and_outputs():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Lab"),
                nbformat.v4.new_code_cell(SOLUTION, outputs=[nbformat.v4.new_output(
                    "stream", text="2\n")], execution_count=3),
                nbformat.v4.new_code_cell("secret()", metadata={"tags": ["hidden-check"]})]
    assert exercise_count(nb) == 1
    st = student_notebook(nb)
    assert len(st.cells) == 2 and st.cells[1].outputs == [] and st.cells[1].execution_count is None
    assert "NotImplementedError" in st.cells[1].source


@pytest.mark.parametrize("path", sorted(
    p for p in __import__("glob").glob(os.path.join(os.path.dirname(__file__), "..", "notebooks",
                                                    "*_lab.ipynb"))))
def test_every_lab_has_exercises_that_compile_in_the_student_version(path):
    nb = nbformat.read(path, as_version=4)
    assert exercise_count(nb) >= 3, f"{path} has fewer than 3 exercises"
    for cell in student_notebook(nb).cells:
        if cell.cell_type == "code":
            src = "\n".join(l for l in cell.source.splitlines()
                            if not l.lstrip().startswith(("%", "!")))
            compile(src, path, "exec")
