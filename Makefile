# Two commands on a fresh machine with Python >= 3.10 and make:
#   make lab    install everything into .venv, register the kernel, start JupyterLab on notebooks/
#   make test   same install, then pytest and every notebook under nbval
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch: 2.13.0 is the release the course is tested with. On machines with a local CPU wheel pip
# takes it; elsewhere set TORCH_INDEX to PyTorch's CPU (or CUDA) wheel index — see README,
# "GPUs and clusters".
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
PIP := $(PY) -m pip install --disable-pip-version-check -q
STAMP := $(VENV)/.installed-labkit
NOTEBOOKS := notebooks/00_setup.ipynb $(filter-out notebooks/00_setup.ipynb,$(sort $(wildcard notebooks/*_lab.ipynb)))
export LABKIT_OUTPUT ?= ordered

.PHONY: install lab test unit nbval notebooks student student-check browser-test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing torch ($(TORCH_SPEC)) and the course's packages into $(VENV) ..."
	$(PIP) "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) -e ".[test]"
	$(PY) -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit course)" >/dev/null
	@touch $(STAMP)

lab: install
	LABKIT_OUTPUT=live $(VENV)/bin/jupyter lab --ServerApp.root_dir=notebooks --ip=127.0.0.1 \
	  $(if $(DISPLAY),,--no-browser) $(if $(filter 0,$(shell id -u)),--allow-root)

test: install unit nbval student-check

unit: install
	$(PY) -m pytest -q tests

nbval: install
	$(PY) -m pytest -q --nbval-lax --nbval-current-env --nbval-cell-timeout=600 \
	  $(NOTEBOOKS)

# Rebuild notebooks from their sources (notebooks/src/*.py, jupytext percent format) and execute
# them in place: the stored outputs are what nbval compares marked cells with. NB=name for one.
NB ?= $(notdir $(basename $(wildcard notebooks/src/*.py)))
notebooks: install
	for nb in $(NB); do \
	  $(VENV)/bin/jupytext -q --to ipynb notebooks/src/$$nb.py -o notebooks/$$nb.ipynb && \
	  $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=600 notebooks/$$nb.ipynb || exit 1; done

# Student versions (solutions → TODO + raise NotImplementedError, hidden checks removed) in student/.
student: install
	$(PY) scripts/make_student.py --out student

# Real-browser test: JupyterLab + headless Chromium run each lab's first section (plot, widget, no
# error); screenshots in tests/browser/screenshots/. Needs Debian's chromium (apt-get install -y
# chromium); installs playwright into .venv. Run before each release (not in CI: see README).
browser-test: install
	VENV=$(VENV) scripts/browser_test.sh

# The student versions run top to bottom: unfinished checks say "not implemented yet", no crash.
student-check: student
	$(PY) scripts/check_student.py student/*.ipynb

bench: install
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
