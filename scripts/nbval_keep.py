"""pytest plugin: keep each notebook as nbval executed it, with this run's outputs, so that a later
stage reads them instead of executing the notebook again (`make test` grades the solutions with
nbgrader from these copies: scripts/nbgrader_check.py --executed).

    python -m pytest --nbval-lax -p scripts.nbval_keep --nbval-keep=build/executed notebooks/x.ipynb

Each kept copy is the notebook with every code cell's outputs replaced by what its cell printed,
displayed or raised in this run (nbval's own record of them, `IPyNbCell.test_outputs`), and with
metadata["labkit_executed"]: the SHA-256 of the notebook file that was run, how many code cells
ran, and how many failed. A cell nbval skipped keeps no outputs and counts as not run, so a reader
can tell a complete run from a partial one. Only nbval's items are touched; other tests are
ignored, and without --nbval-keep the plugin does nothing.
"""

import copy
import hashlib
import os

import nbformat
import pytest

_runs: dict = {}  # notebook path -> {"nb": parsed notebook, "cells": {code cell number: (outputs, failed)}}


def pytest_addoption(parser):
    parser.addoption(
        "--nbval-keep",
        default=None,
        metavar="DIR",
        help="write each notebook nbval executed, with this run's outputs, into DIR",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "call" or not item.config.getoption("--nbval-keep"):
        return
    outputs = getattr(item, "test_outputs", None)  # nbval's cells only; None when skipped
    if outputs is None or not hasattr(item, "cell_num"):
        return
    path = str(item.parent.fspath)
    run = _runs.setdefault(path, {"nb": item.parent.nb, "cells": {}})
    run["cells"][item.cell_num] = (list(outputs), outcome.get_result().failed)


def kept(path: str, run: dict) -> nbformat.NotebookNode:
    """The notebook at `path` with the outputs recorded in `run`."""
    nb = copy.deepcopy(run["nb"])
    count = ran = failed = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        got = run["cells"].get(count)
        count += 1
        if got is None:
            cell.outputs, cell.execution_count = [], None
            continue
        ran += 1
        failed += got[1]
        cell.outputs = [copy.deepcopy(o) for o in got[0]]
        cell.execution_count = ran
        for o in cell.outputs:
            if o.get("output_type") == "execute_result":
                o["execution_count"] = ran
    nb.metadata["labkit_executed"] = provenance(path, count, ran, failed)
    return nb


def provenance(path: str, code_cells: int, ran: int, failed: int) -> dict:
    """metadata["labkit_executed"] of a run of the notebook file at `path`: what
    scripts/nbgrader_check.py's executed_copy reads to tell a complete run of that very file."""
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    return {"source_sha256": sha, "code_cells": code_cells, "ran": ran, "failed": failed}


def pytest_sessionfinish(session):
    where = session.config.getoption("--nbval-keep")
    if not where:
        return
    os.makedirs(where, exist_ok=True)
    for path, run in _runs.items():
        nbformat.write(kept(path, run), os.path.join(where, os.path.basename(path)))
    _runs.clear()
