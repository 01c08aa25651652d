# Two commands on a fresh machine with Python >= 3.10 and make:
#   make lab    install everything into .venv, register the kernel, write the learner copies
#               student/00_setup.ipynb, 01_dp_lab ... (never over your edits), start JupyterLab there
#   make test   same install, then pytest, every notebook under nbval, the learner copies, nbgrader,
#               and every lab in a real JupyterLab + Chromium (skipped, loudly, without chromium);
#               a table of the stages' times at the end
# Instructors: `make lab-solutions` opens notebooks/ (the solutions, with outputs).
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
# The course kernel "labkit" (what every notebook names) is registered --user: a JupyterHub's or
# any other Jupyter of this user finds it, which one inside .venv (--sys-prefix) would not.
# A shared image for many users: KERNEL_INSTALL=--prefix=/usr/local (docs/teaching.md).
KERNEL_INSTALL ?= --user
JUPYTER_LAB = $(VENV)/bin/jupyter lab --ip=127.0.0.1 $(if $(DISPLAY),,--no-browser) \
  $(if $(filter 0,$(shell id -u)),--allow-root)

# LABKIT_STRESS=N: every test stage runs with N CPU hogs beside it (scripts/with_hogs.py), the
# load of a shared JupyterHub or a CI runner with neighbours; `make test-busy` is LABKIT_STRESS=2.
LABKIT_STRESS ?=
BUSY := $(if $(LABKIT_STRESS),$(PY) scripts/with_hogs.py $(LABKIT_STRESS) --,)

.PHONY: install kernel lab lab-solutions test test-busy unit contract nbval nbval-labs nbval-timed browser-labs browser-timed grade grade-executed notebooks student student-reset \
  student-check browser browser-test bench clean lint typecheck format

# LABKIT_STAGE: set by scripts/stages.py for the stages of `make test`, which has installed and
# registered the kernel already (stages side by side must not both install at the same moment).
install: $(if $(LABKIT_STAGE),,$(STAMP) kernel)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing torch ($(TORCH_SPEC)) and the course's packages into $(VENV) ..."
	$(PIP) "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) -e ".[test]"
	@touch $(STAMP)

kernel: | $(STAMP)
	@# an old install's copy inside .venv would shadow this one for .venv's own Jupyter
	rm -rf $(VENV)/share/jupyter/kernels/labkit
	$(PY) -m ipykernel install $(KERNEL_INSTALL) --name labkit --display-name "Python (labkit course)"

# The learner's JupyterLab: the learner copies in student/, in course order (missing ones are
# written; existing ones are the learner's work and kept).
lab: install student
	LABKIT_OUTPUT=live $(JUPYTER_LAB) --ServerApp.root_dir=student

# The instructor's: the solution notebooks, with their outputs.
lab-solutions: install
	LABKIT_OUTPUT=live $(JUPYTER_LAB) --ServerApp.root_dir=notebooks

# Each notebook copy is executed once in `make test`: nbval runs the solutions and keeps what they
# printed (scripts/nbval_keep.py, into build/executed/); the browser test runs each learner copy in
# JupyterLab as a learner does and keeps it (into build/browser/); nbgrader then grades both as
# they stand, and executes one blank copy itself (GRADE_EXECUTE_BLANK: the instructor's autograde
# path, checks raising), or every one the browser did not run (no chromium). The learner copies'
# run-to-the-end check (scripts/check_student.py's) reads the same runs. The browser test, the lint
# and nbval over the untimed labs run beside pytest (`+`: alone, the browser stage waits about 40%
# of its time on JupyterLab, Chromium and kernel start-ups, pytest's workers 16%; side by side the
# cores stay busy); then the timed lab, alone: under nbval with its hogs, then in the browser.
# Under LABKIT_STRESS, one at a time, each with its own hogs. At the end, a table of the stages'
# times (scripts/stages.py).
STAGES := $(if $(LABKIT_STRESS),lint unit contract browser nbval grade-executed,\
  unit+contract+browser-labs+lint+nbval-labs nbval-timed browser-timed grade-executed)
test: install
	$(PY) scripts/stages.py $(STAGES)

test-busy:
	$(MAKE) test LABKIT_STRESS=2

# ruff (pyproject.toml's [tool.ruff]): the linter's small rule set and the formatter's check, over
# the code people read and change. `make format` rewrites it in place. Then the type check.
LINTED := labkit tests benchmarks scripts notebooks/src
lint: install
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/ruff check $(LINTED)
	$(MAKE) typecheck

# mypy over the files pyproject.toml's [tool.mypy] names (strategies, loop, comm, launch).
typecheck: install
	$(VENV)/bin/mypy

# After `make format` of notebooks/src, rebuild the notebooks (`make notebooks`): their cells are
# the sources' cells.
format: install
	$(VENV)/bin/ruff format $(LINTED)
	$(VENV)/bin/ruff check --fix $(LINTED)

# --durations: the slowest tests, listed at the end of every run (what to merge or share next when
# make test grows: issue 39).
# UNIT_WORKERS test files at a time (pytest-xdist, one file per worker, so a file's module fixtures
# are built once): a fifth of the single run's time was waiting on purpose (fail-fast peers, P2P
# deadlock timeouts, killed ranks, pip), which the other worker's ranks fill (measured on 2 cores:
# 1088 s -> 893 s). The notebooks stay one at a time: they keep both cores busy, and two at once
# took longer than one after the other (275 s against 252 s). UNIT_WORKERS=0: one process.
UNIT_WORKERS ?= 2
unit: install
	$(BUSY) $(PY) -m pytest -q --durations=25 $(if $(filter-out 0,$(UNIT_WORKERS)),-n $(UNIT_WORKERS) --dist loadfile) --ignore=tests/contract tests

# The contract (tests/contract): every promise over every name in labkit.strategies.NAMES, at 2
# and 4 ranks; a stage of its own so its cost has a row in make test's table.
contract: install
	$(BUSY) $(PY) -m pytest -q tests/contract

# LABKIT_EXERCISE=strict: an exercise check that fails raises (in a learner's notebook it prints
# FAIL and the lab carries on with the reference), so a broken solution fails nbval.
# The labs whose story is drawn from clocks (hsdp_lab: flat vs two-level, HSDP vs FSDP, the shard
# group) always run under two CPU hogs here, so every `make test` (and CI) checks that their
# printed story holds on a busy machine; the rest under LABKIT_STRESS only.
TIMED_NOTEBOOKS := notebooks/hsdp_lab.ipynb
NBVAL = env LABKIT_EXERCISE=strict $(PY) -m pytest -q --nbval-lax --nbval-current-env --nbval-cell-timeout=600
EXECUTED := build/executed
# `make test` runs nbval-labs beside pytest and the browser test, then nbval-timed alone (with its
# two hogs and nothing else beside it).
nbval: nbval-labs nbval-timed

nbval-labs: install
	rm -rf $(EXECUTED)
	$(BUSY) $(NBVAL) -p scripts.nbval_keep --nbval-keep=$(EXECUTED) $(filter-out $(TIMED_NOTEBOOKS),$(NOTEBOOKS))

nbval-timed: install
	$(PY) scripts/with_hogs.py $(or $(LABKIT_STRESS),2) -- $(NBVAL) -p scripts.nbval_keep --nbval-keep=$(EXECUTED) \
	  $(TIMED_NOTEBOOKS)

# nbgrader on every lab: generate_assignment; autograde of the untouched release copy (0 points
# on every check, and it runs to the end as a learner copy must) and of the solutions (every point).
grade: install
	$(BUSY) $(PY) scripts/nbgrader_check.py

# As `make test` grades: the solutions from the copies `make nbval` just executed, the blank copies
# from the runs `make browser` just kept (a copy of another version of a notebook, or one that did
# not run every cell, is executed again, saying why), GRADE_EXECUTE_BLANK's blank copy executed by
# nbgrader's autograde whatever the browser kept; the blank runs checked as learner copies too.
BROWSER_KEPT := build/browser
GRADE_EXECUTE_BLANK ?= 08_moe_lab
grade-executed: install
	$(BUSY) $(PY) scripts/nbgrader_check.py --executed $(EXECUTED) --learner-runs $(BROWSER_KEPT) \
	  $(foreach lab,$(GRADE_EXECUTE_BLANK),--execute-blank $(lab))

# Rebuild notebooks from their sources (notebooks/src/*.py, jupytext percent format) and execute
# them in place: the stored outputs are what nbval compares marked cells with. NB=name for one.
NB ?= $(notdir $(basename $(wildcard notebooks/src/*.py)))
notebooks: install
	for nb in $(NB); do \
	  $(VENV)/bin/jupytext -q --to ipynb notebooks/src/$$nb.py -o notebooks/$$nb.ipynb && \
	  LABKIT_EXERCISE=strict $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=600 notebooks/$$nb.ipynb || exit 1; done

# Learner copies (nbgrader's generate_assignment: solutions become raise NotImplementedError,
# outputs cleared) in student/, named in course order. `student` keeps existing copies;
# `student-reset` overwrites them, and with them the learner's edits.
student: install
	$(PY) scripts/make_student.py --out student

student-reset: install
	$(PY) scripts/make_student.py --out student --force

# Real-browser test: JupyterLab + headless Chromium Run All of the learner copy of every
# notebooks/*.ipynb (as `make lab` gives it; a new lab is picked up by the glob), move each widget
# once (its plot must be redrawn), check that every cell whose stored output has an image shows
# one, and no error; screenshots in tests/browser/screenshots/; `make browser` keeps the runs
# for the grading. LABKIT_BROWSER_COPIES=solution runs the solution notebooks instead. Needs
# Debian's chromium (apt-get install -y chromium; .ci/run installs it) and pip's playwright (in
# .[test]). `browser` (part of `make test`) says loudly
# that it skipped when there is no chromium; `browser-test` fails then.
# `make test` runs browser-labs beside pytest and browser-timed (hsdp_lab, whose cells check
# measured step times against the model) alone, after. Beside pytest and nbval (load 4-5 on 2
# cores) its model-vs-measurement check once failed: the link's held time counted late wake-ups
# then (labkit.comm._link counts the sleeps' lengths now).
empty :=
space := $(empty) $(empty)
TIMED_K := $(subst $(space), or ,$(strip $(basename $(notdir $(TIMED_NOTEBOOKS)))))
BROWSER = VENV=$(VENV) LABKIT_BROWSER_OPTIONAL=1 LABKIT_BROWSER_KEEP=$(BROWSER_KEPT) $(BUSY) scripts/browser_test.sh
browser: browser-labs browser-timed

browser-labs: install
	rm -rf $(BROWSER_KEPT)
	$(BROWSER) -k "not ($(TIMED_K))"

browser-timed: install
	LABKIT_BROWSER_APPEND=1 $(BROWSER) -k "$(TIMED_K)"

browser-test: install
	VENV=$(VENV) $(BUSY) scripts/browser_test.sh

# Fresh learner copies (in build/, never student/) run top to bottom: unfinished checks say
# "not implemented yet", no crash.
student-check: install
	rm -rf build/student && $(PY) scripts/make_student.py --out build/student
	$(BUSY) $(PY) scripts/check_student.py build/student/*.ipynb

bench: install
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	-$(PY) -m jupyter kernelspec remove -y labkit
	rm -rf $(VENV) build *.egg-info
