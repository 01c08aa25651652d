"""The set-up files agree with each other, and each notebook matches its source."""
import glob
import os
import re

import pytest

from conftest import ROOT

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject():
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _environment_pip():
    lines = open(os.path.join(ROOT, "environment.yml")).read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == "- pip:")
    return [l.strip()[2:] for l in lines[start + 1:] if l.strip().startswith("- ")]


def test_environment_yml_and_pyproject_name_the_same_dependencies():
    project = _pyproject()
    declared = {_name(r): r.split(_name(r), 1)[-1] for r in
                project["dependencies"] + project["optional-dependencies"]["test"]}
    env = {_name(r): r for r in _environment_pip() if not r.startswith("-e")}
    assert set(env) == set(declared), (set(env) ^ set(declared))
    for name, req in env.items():
        if name != "torch":     # environment.yml pins the tested release inside the range
            assert req.lower().replace("_", "-").endswith(declared[name].replace(" ", "")), name
    assert "-e ." in _environment_pip()


def test_makefile_installs_the_tested_torch_inside_the_declared_range():
    make = open(os.path.join(ROOT, "Makefile")).read()
    pinned = re.search(r"TORCH_SPEC\s*\?=\s*torch==([\d.]+)", make).group(1)
    torch_req = next(r for r in _pyproject()["dependencies"] if _name(r) == "torch")
    lo, hi = re.search(r">=([\d.]+),<([\d.]+)", torch_req).groups()
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(lo) <= as_tuple(pinned) < as_tuple(hi)


@pytest.mark.parametrize("src", sorted(glob.glob(os.path.join(ROOT, "notebooks", "src", "*.py"))))
def test_notebook_matches_its_source(src):
    import jupytext
    import nbformat
    built = jupytext.read(src)
    path = os.path.join(ROOT, "notebooks", os.path.basename(src)[:-3] + ".ipynb")
    stored = nbformat.read(path, as_version=4)
    strip = lambda nb: [(c.cell_type, c.source.strip()) for c in nb.cells]  # noqa: E731
    assert strip(built) == strip(stored), f"rebuild with: make notebooks NB={os.path.basename(src)[:-3]}"


def test_data_corpus_is_small_and_documented():
    assert os.path.getsize(os.path.join(ROOT, "data", "corpus.txt")) <= 5 * 2**20
    assert os.path.exists(os.path.join(ROOT, "data", "README.md"))
