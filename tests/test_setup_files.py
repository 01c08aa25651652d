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
    return [l.strip()[2:] for l in lines[start + 1 :] if l.strip().startswith("- ")]


def test_environment_yml_and_pyproject_name_the_same_dependencies():
    project = _pyproject()
    declared = {
        _name(r): r.split(_name(r), 1)[-1]
        for r in project["dependencies"] + project["optional-dependencies"]["test"]
    }
    env = {_name(r): r for r in _environment_pip() if not r.startswith("-e")}
    assert set(env) == set(declared), set(env) ^ set(declared)
    for name, req in env.items():
        if name != "torch":  # environment.yml pins the tested release inside the range
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


HUB_PYTHON = """
import sys
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import start_new_kernel
assert "labkit" in KernelSpecManager().find_kernel_specs(), "the course kernel is not listed"
km, kc = start_new_kernel(kernel_name="labkit", startup_timeout=240)  # a loaded machine: 60 s default
try:
    reply = kc.execute_interactive("import torch, labkit; print('torch', torch.__version__)",
                                   timeout=120, output_hook=lambda m: sys.stdout.write(
                                       m["content"].get("text", "")))
    assert reply["content"]["status"] == "ok", reply["content"]
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
"""


def test_the_hub_recipe_another_jupyter_starts_the_course_kernel(tmp_path):
    """docs/teaching.md's recipe, as written: `make kernel` (what `make install` runs) registers
    the kernel --user; a Jupyter of the same user outside .venv (here a fresh venv with only
    jupyter_client, HOME a temporary one) lists it, starts it and imports torch and labkit."""
    import subprocess
    import sys

    doc = open(os.path.join(ROOT, "docs", "teaching.md")).read()
    assert "make kernel" in doc and "jupyter kernelspec list" in doc
    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("JUPYTER_PATH", None)
    env.pop("JUPYTER_DATA_DIR", None)
    subprocess.run(["make", "-s", "kernel"], cwd=ROOT, env=env, check=True, timeout=120)
    assert os.path.exists(tmp_path / ".local/share/jupyter/kernels/labkit/kernel.json")
    hub = tmp_path / "hub"
    subprocess.run([sys.executable, "-m", "venv", str(hub)], check=True, timeout=120)
    subprocess.run(
        [str(hub / "bin/pip"), "install", "-q", "--disable-pip-version-check", "jupyter_client"],
        env=env,
        check=True,
        timeout=300,
    )
    listed = subprocess.run(
        [str(hub / "bin/jupyter"), "kernelspec", "list"], env=env, capture_output=True, text=True, timeout=60
    )
    assert "labkit" in listed.stdout and str(tmp_path) in listed.stdout, listed
    ran = subprocess.run(
        [str(hub / "bin/python"), "-c", HUB_PYTHON],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0 and "torch " in ran.stdout, ran.stdout + ran.stderr
