#!/usr/bin/env bash
# GPU check (<= 5 minutes on a single-GPU machine). Needs a CUDA build of torch in .venv
# (README: "GPUs and clusters"). Prints PASS/FAIL per check and, last, "N passed, M failed".
# Without a GPU (or with --cpu) it says so and runs the CPU parts (scripts/gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 300 "$PY" scripts/gpu_check.py "$@"
