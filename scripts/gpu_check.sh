#!/usr/bin/env bash
# GPU check (≤ 5 minutes on a single-GPU machine). Needs a CUDA build of torch in .venv
# (README: "GPUs and clusters"). Prints PASS/FAIL per check and "N passed, M failed".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exec timeout 300 "$PY" scripts/gpu_check.py
