#!/usr/bin/env bash
# Real-browser test of the labs (tests/browser/): JupyterLab + headless Chromium Run All of every
# lab's learner copy (nbgrader's release, as `make lab` gives it; LABKIT_BROWSER_COPIES=solution:
# the notebooks themselves), check that each plot appears, each widget renders and redraws after
# one change, and no cell shows an error. LABKIT_BROWSER_KEEP=dir keeps the runs (make test grades them). Screenshots go to $LABKIT_BROWSER_SCREENSHOTS (default
# tests/browser/screenshots/). Extra arguments go to pytest (e.g. -k zero1).
# Needs Debian's chromium (apt-get install -y chromium) and pip's playwright, which this installs
# into the venv; Playwright's own browser download (`playwright install`) is not used.
# LABKIT_BROWSER_OPTIONAL=1 (make test): without chromium, say so loudly and exit 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python
CHROMIUM=${LABKIT_BROWSER_CHROMIUM:-$(command -v chromium || echo /usr/bin/chromium)}
if [ ! -x "$CHROMIUM" ]; then
  if [ "${LABKIT_BROWSER_OPTIONAL:-0}" = 1 ]; then
    bar=$(printf '%.0s#' $(seq 1 78))
    printf '%s\n%s\n%s\n%s\n%s\n' "$bar" \
      "# BROWSER TEST SKIPPED: no chromium on this machine." \
      "# No lab was run in a real JupyterLab: plots or widgets that do not show are NOT caught." \
      "# Debian/Ubuntu: sudo apt-get install -y chromium   (then: make browser-test)" "$bar" >&2
    exit 0
  fi
  echo "browser-test: no chromium found. Debian/Ubuntu: sudo apt-get install -y chromium" >&2
  exit 2
fi
"$PY" -c "import playwright" 2>/dev/null ||
  "$PY" -m pip install --disable-pip-version-check -q "playwright>=1.40,<2"
# This run's tag in the temp dirs' names: the leftover check below looks for this run's processes
# only (another make test on the machine may be running its own browser test).
export LABKIT_BROWSER=1 LABKIT_BROWSER_CHROMIUM="$CHROMIUM" LABKIT_BROWSER_RUN="run$$"
shots=${LABKIT_BROWSER_SCREENSHOTS:-tests/browser/screenshots}
# Cell numbers change when the labs do: a stale screenshot must not pass for this run's.
# LABKIT_BROWSER_APPEND=1 (make browser-timed, after browser-labs): add to the screenshots instead.
if [ "${LABKIT_BROWSER_APPEND:-0}" != 1 ]; then
  rm -f "$shots"/summary.txt "$shots"/*-cell[0-9]*-*.png "$shots"/*-page.png "$shots"/*.ipynb
fi
start=$(date +%s)
rc=0
"$PY" -m pytest -q -s -p no:cacheprovider tests/browser "$@" || rc=$?
echo "browser-test: $(( $(date +%s) - start )) s; screenshots in $shots/"
# JupyterLab, its kernels and Chromium run from temp dirs named labkit-browser-run<pid>-* /
# labkit-chromium-run<pid>-*: none of this run's may outlive the test.
sleep 1
if left=$(pgrep -af "labkit-(browser|chromium)-$LABKIT_BROWSER_RUN-" | grep -v pgrep); then
  echo "browser-test: processes left behind:" >&2; echo "$left" >&2
  rc=1
fi
exit $rc
