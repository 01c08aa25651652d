"""Real-browser test: each lab's first section, run in JupyterLab in headless Chromium.

Not part of `make test` / `pytest tests` (it is skipped there, visibly, in one line): it needs
Debian's `chromium` package and pip's `playwright` (pointed at /usr/bin/chromium; Playwright's own
browser download does not work on the course machines). Run it with

    make browser-test                      # or: scripts/browser_test.sh
    LABKIT_BROWSER=1 .venv/bin/python -m pytest -q tests/browser     # the same, by hand

What it does, per notebook in notebooks/*.ipynb (whatever exists at collection time) plus the
fixture tests/browser/fixture_widgets.ipynb (which proves the checks can see a plot, a widget and
an error):
  1. starts JupyterLab on a free port with a random token, on a temporary copy of notebooks/
     (outputs stripped, so everything on screen was produced by this run; the repo is untouched);
  2. opens the notebook at /lab/tree/<name>, waits for the kernel to be idle;
  3. runs the first section cell by cell with Shift+Enter (cells before the second markdown heading
     "## ", or the first LABKIT_BROWSER_CELLS cells), waiting for each code cell's [n] prompt;
  4. checks: no cell shows an error (an stderr output area with "Error"/"Traceback", or an
     `error` output in the notebook JupyterLab saves), except cells tagged raises-exception;
     an <img> plot appears if the section's stored outputs have a PNG; an ipywidgets widget
     renders if the section makes one; "[rank 0]" text appears if the stored outputs have it;
  5. saves a screenshot <name>.png (and the executed copy <name>.ipynb) under
     LABKIT_BROWSER_SCREENSHOTS (default tests/browser/screenshots/).
JupyterLab, its kernels and Chromium are killed in fixture teardown, also on failure.

Environment knobs: LABKIT_BROWSER=1 (required), LABKIT_BROWSER_SCREENSHOTS=dir,
LABKIT_BROWSER_CELLS=N, LABKIT_BROWSER_NOTEBOOKS=glob (e.g. "fixture*"),
LABKIT_BROWSER_CHROMIUM=/path/to/chromium, LABKIT_BROWSER_CELL_TIMEOUT=seconds (default 300),
LABKIT_BROWSER_OUTPUT=live|ordered (labkit's output mode in the kernel; default live, as `make lab`).
"""
import fnmatch
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

if os.environ.get("LABKIT_BROWSER") != "1":
    pytest.skip("real-browser test: run `make browser-test` (sets LABKIT_BROWSER=1)",
                allow_module_level=True)

import nbformat  # noqa: E402
import psutil  # noqa: E402

try:
    from playwright.sync_api import sync_playwright
except ImportError as e:  # asked for explicitly: fail loudly, do not skip
    raise ImportError("the browser test needs pip's playwright in the course venv: "
                      ".venv/bin/pip install 'playwright>=1.40,<2' (no `playwright install`: "
                      "it uses Debian's chromium)") from e

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BIN = os.path.dirname(sys.executable)
FIXTURE = os.path.join(HERE, "fixture_widgets.ipynb")
SHOTS = os.path.abspath(os.environ.get("LABKIT_BROWSER_SCREENSHOTS",
                                       os.path.join(HERE, "screenshots")))
CELL_TIMEOUT = float(os.environ.get("LABKIT_BROWSER_CELL_TIMEOUT", "300"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

ERROR_TEXT = re.compile(r"Traceback|Error")
WIDGET_SOURCE = re.compile(r"\bipywidgets\b|\bwidgets\.\w+\(|\binteract(ive)?(_output)?\(")
PLOT_SOURCE = re.compile(r"\bplt\.|\.plot\(|\bplot_\w*\(")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_SELECTOR = ".jp-OutputArea-output .jupyter-widgets, .jp-OutputArea-output [class*='widget-']"


def _notebooks():
    paths = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))) + [FIXTURE]
    pattern = os.environ.get("LABKIT_BROWSER_NOTEBOOKS")
    if pattern:
        paths = [p for p in paths if fnmatch.fnmatch(os.path.basename(p), pattern)]
    return paths


# ---------------------------------------------------------------- what to expect, from the .ipynb
def _is_heading2(cell) -> bool:
    return cell.cell_type == "markdown" and any(
        line.startswith("## ") for line in cell.source.splitlines())


def first_section(nb) -> int:
    """Number of cells in the first section: up to (not including) the second '## ' heading."""
    if os.environ.get("LABKIT_BROWSER_CELLS"):
        return min(int(os.environ["LABKIT_BROWSER_CELLS"]), len(nb.cells))
    headings = [i for i, c in enumerate(nb.cells) if _is_heading2(c)]
    return headings[1] if len(headings) >= 2 else len(nb.cells)


def _stored_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        parts.append(str(out.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def expectations(nb, n: int) -> dict:
    """What the browser must show for the first n cells. The stored outputs (every lab is executed
    in place when built) say whether the section plots and prints rank output; a notebook without
    stored outputs (the fixture) is judged by its source. Widgets are judged by source as well:
    under nbval/CI (where the stored outputs are made) labs show a static fallback instead."""
    code = [c for c in nb.cells[:n] if c.cell_type == "code"]
    has_stored = any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
    stored_png = any("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", []))
    stored_widget = any(WIDGET_MIME in o.get("data", {}) for c in code for o in c.get("outputs", []))
    return {
        "plot": stored_png if has_stored else any(PLOT_SOURCE.search(c.source) for c in code),
        "widget": stored_widget or any(WIDGET_SOURCE.search(c.source) for c in code),
        "rank0": any("[rank 0]" in _stored_text(c) for c in code),
        "may_raise": {i for i, c in enumerate(nb.cells[:n])
                      if "raises-exception" in c.metadata.get("tags", [])},
    }


# ------------------------------------------------------------------------------ JupyterLab server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(server, method, path, timeout=10):
    req = urllib.request.Request(f"{server['url']}{path}", method=method,
                                 headers={"Authorization": f"token {server['token']}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body else None


def _kill(procs):
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


def _write_settings(settings_dir):
    for plugin, values in {
        # every cell in the DOM (the checks and the screenshot see all of them)
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        # no news/update toast, no request to the internet
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                        "checkForUpdates": False},
    }.items():
        path = os.path.join(settings_dir, plugin + ".jupyterlab-settings")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(values, f)


@pytest.fixture(scope="module")
def lab_server():
    tmp = tempfile.mkdtemp(prefix="labkit-browser-")
    course = os.path.join(tmp, "course")
    nbdir = os.path.join(course, "notebooks")
    os.makedirs(nbdir)
    # The labs' cwd is notebooks/ as in the repo; ../data resolves to the repo's data (read only).
    if os.path.isdir(os.path.join(ROOT, "data")):
        os.symlink(os.path.join(ROOT, "data"), os.path.join(course, "data"))
    for src in _notebooks():
        nb = nbformat.read(src, as_version=4)
        for c in nb.cells:          # what the browser shows is produced by this run only
            if c.cell_type == "code":
                c.outputs, c.execution_count = [], None
        nbformat.write(nb, os.path.join(nbdir, os.path.basename(src)))
    _write_settings(os.path.join(tmp, "settings"))

    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "PYTEST_CURRENT_TEST", "JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR")}
    env.update(LABKIT_OUTPUT=os.environ.get("LABKIT_BROWSER_OUTPUT", "live"),
               PATH=BIN + os.pathsep + env.get("PATH", ""),
               JUPYTER_CONFIG_DIR=os.path.join(tmp, "config"),      # no user config
               JUPYTER_RUNTIME_DIR=os.path.join(tmp, "runtime"),
               JUPYTERLAB_SETTINGS_DIR=os.path.join(tmp, "settings"),
               JUPYTERLAB_WORKSPACES_DIR=os.path.join(tmp, "workspaces"),
               IPYTHONDIR=os.path.join(tmp, "ipython"))
    port, token = _free_port(), secrets.token_hex(16)
    log_path = os.path.join(tmp, "jupyterlab.log")
    log = open(log_path, "w")
    cmd = [os.path.join(BIN, "jupyter"), "lab", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={nbdir}",
           f"--LabApp.user_settings_dir={os.path.join(tmp, 'settings')}",
           f"--LabApp.workspaces_dir={os.path.join(tmp, 'workspaces')}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:     # containers / CI machines run as root
        cmd.append("--allow-root")
    proc = subprocess.Popen(cmd, cwd=nbdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    server = {"url": f"http://127.0.0.1:{port}", "token": token, "dir": nbdir, "log": log_path}
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited ({proc.returncode}):\n"
                                   + open(log_path).read()[-3000:])
            try:
                _api(server, "GET", "/api/status", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("JupyterLab did not answer /api/status in 120 s:\n"
                                       + open(log_path).read()[-3000:])
                time.sleep(0.5)
        yield server
    finally:
        # Kernels (and their forkservers and ranks) run in their own sessions: note them first.
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        try:
            _api(server, "POST", "/api/shutdown", timeout=5)
            proc.wait(timeout=10)
        except Exception:
            pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        _kill(family)
        log.close()
        shutil.copy(log_path, os.path.join(_shots_dir(), "jupyterlab.log"))
        shutil.rmtree(tmp, ignore_errors=True)


def _shots_dir():
    os.makedirs(SHOTS, exist_ok=True)
    return SHOTS


# ------------------------------------------------------------------------------ headless Chromium
def _chromium():
    path = os.environ.get("LABKIT_BROWSER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        raise RuntimeError("no chromium: `apt-get install -y chromium` (Debian's package) or set "
                           "LABKIT_BROWSER_CHROMIUM")
    return path


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="labkit-chromium-")
    before = {p.pid for p in psutil.Process().children()}
    family = []
    pw = sync_playwright().start()
    context = None
    try:
        # A persistent context is how Playwright takes a --user-data-dir: a fresh one per run.
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
        yield context
    finally:
        # Playwright's driver and Chromium are children of this process that were not there before.
        family = [c for p in psutil.Process().children() if p.pid not in before
                  for c in [p] + p.children(recursive=True)]
        try:
            if context is not None:
                context.close()
        finally:
            pw.stop()
            _kill(family)
            shutil.rmtree(profile, ignore_errors=True)


# ------------------------------------------------------------------------------------ page helpers
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"


def _wait_idle(page, timeout_s, ncells=0):
    """Kernel started and idle (the status bar says '| Idle', the toolbar indicator agrees), and,
    when ncells is given, the notebook's own cells are in the DOM (not the loading placeholder)."""
    page.wait_for_function(
        """([sel, n]) => {
            const bar = document.querySelector('#jp-main-statusbar');
            const ind = document.querySelector(sel + ' .jp-Notebook-ExecutionIndicator');
            return document.querySelectorAll(sel + ' .jp-Notebook .jp-Cell').length >= n
                && bar && /\\|\\s*Idle\\b/.test(bar.innerText)
                && (!ind || ind.dataset.status === 'idle');
        }""", arg=[PANEL, ncells], timeout=timeout_s * 1000, polling=250)


def _dismiss_dialogs(page):
    dialog = page.locator(".jp-Dialog .jp-mod-accept")
    if dialog.count():
        dialog.first.click()


def _wait_prompt(page, cell, count, timeout_s):
    """Wait until this code cell's prompt reads [count] (the kernel's count for the k-th run)."""
    prompt = cell.locator(".jp-InputArea-prompt")
    deadline = time.time() + timeout_s
    while True:
        text = prompt.inner_text().strip()
        m = re.fullmatch(r"\[(\d+)\]:?", text)
        if m and int(m.group(1)) >= count:
            return
        if time.time() > deadline:
            raise TimeoutError(f"prompt still {text!r} after {timeout_s:.0f} s")
        page.wait_for_timeout(200)


def _screenshot(page, n, path):
    """Make the viewport tall enough for the section, then a full-page screenshot."""
    height = page.evaluate(
        """([sel, last]) => {
            const outer = document.querySelector(sel + ' .jp-WindowedPanel-outer');
            const cells = document.querySelectorAll(sel + ' .jp-Cell');
            if (!outer || !cells.length) return 0;
            outer.scrollTop = 0;
            const cell = cells[Math.min(last, cells.length - 1)];
            return cell.getBoundingClientRect().bottom + 60;
        }""", [PANEL, n - 1])
    if height > 1000:
        page.set_viewport_size({"width": 1400, "height": int(min(height, 12000))})
        page.wait_for_timeout(500)
    page.screenshot(path=path, full_page=True)


def _save(page, server, name, timeout_s=30):
    path = os.path.join(server["dir"], name)
    mtime = os.path.getmtime(path)
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    deadline = time.time() + timeout_s
    while os.path.getmtime(path) == mtime:
        if time.time() > deadline:
            return None
        page.wait_for_timeout(200)
    page.wait_for_timeout(300)                  # let the write finish
    return nbformat.read(path, as_version=4)


def _stop_kernels(server):
    for s in _api(server, "GET", "/api/sessions") or []:
        try:
            _api(server, "DELETE", f"/api/sessions/{s['id']}", timeout=20)
        except Exception:
            pass


# ----------------------------------------------------------------------------------------- test
@pytest.mark.parametrize("path", _notebooks(), ids=os.path.basename)
def test_first_section_runs_in_jupyterlab(lab_server, browser, path):
    name = os.path.basename(path)
    nb = nbformat.read(path, as_version=4)
    n = first_section(nb)
    want = expectations(nb, n)
    if name == "00_setup.ipynb":
        want["rank0"] = True
    t0 = time.time()
    page = browser.new_page()
    page_errors = []
    page.on("pageerror", lambda e: page_errors.append(str(e)))
    problems, timings = [], {}
    try:
        # ?reset: a fresh workspace, so the previous notebook's tab (and a kernel) is not restored
        page.goto(f"{lab_server['url']}/lab/tree/{name}?reset&token={lab_server['token']}",
                  wait_until="domcontentloaded", timeout=120_000)
        page.wait_for_selector(f"{PANEL} .jp-Notebook .jp-Cell", timeout=120_000)
        _dismiss_dialogs(page)
        _wait_idle(page, 180, ncells=len(nb.cells))
        timings["open"] = time.time() - t0
        cells = page.locator(f"{PANEL} .jp-Notebook .jp-Cell")
        assert cells.count() == len(nb.cells), (cells.count(), len(nb.cells))

        # Select the first cell in command mode, then Shift+Enter through the section.
        cells.nth(0).locator(".jp-InputPrompt, .jp-Cell-inputCollapser").first.click()
        page.keyboard.press("Escape")
        runs = 0
        for i in range(n):
            page.keyboard.press("Shift+Enter")
            cell = nb.cells[i]
            if cell.cell_type != "code" or not cell.source.strip():
                continue
            runs += 1
            t = time.time()
            try:
                _wait_prompt(page, cells.nth(i), runs, CELL_TIMEOUT)
            except TimeoutError as e:
                problems.append(f"cell {i}: {e}")
                break
            timings[f"cell {i}"] = time.time() - t
        _wait_idle(page, CELL_TIMEOUT)

        # Widgets and plots render asynchronously after the kernel is idle: give them time.
        section = [cells.nth(i) for i in range(n)]
        if want["widget"]:
            try:
                page.locator(PANEL).locator(WIDGET_SELECTOR).first.wait_for(timeout=30_000)
            except Exception:
                pass
        if want["plot"]:
            try:
                page.wait_for_selector(f"{PANEL} .jp-OutputArea-output img", timeout=30_000)
            except Exception:
                pass
        page.wait_for_timeout(500)

        # --- checks on what the learner sees
        errors_seen = set()
        for i, cell in enumerate(section):
            stderr = cell.locator(
                ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            for k in range(stderr.count()):
                text = stderr.nth(k).inner_text()
                if ERROR_TEXT.search(text):
                    errors_seen.add(i)
                    if i not in want["may_raise"]:
                        problems.append(f"cell {i} shows an error:\n{text[-1500:]}")
                        break
        imgs = sum(c.locator(".jp-OutputArea-output img").count() for c in section)
        widgets = sum(c.locator(WIDGET_SELECTOR).count() for c in section)
        text_out = "\n".join(c.locator(".jp-OutputArea").inner_text() for c in section
                             if c.locator(".jp-OutputArea").count())
        if want["plot"] and not imgs:
            problems.append("the section plots (stored outputs have a PNG) but no <img> appeared")
        if want["widget"] and not widgets:
            problems.append("the section makes an ipywidgets widget but none rendered")
        if "Error displaying widget" in text_out:
            problems.append("a widget failed to render ('Error displaying widget')")
        if want["rank0"] and "[rank 0]" not in text_out:
            problems.append("no '[rank 0]' output text appeared")
        if name == os.path.basename(FIXTURE) and errors_seen != want["may_raise"]:
            problems.append(f"fixture: the error check saw errors in cells {sorted(errors_seen)}, "
                            f"expected exactly {sorted(want['may_raise'])}")

        # --- the same notebook as JupyterLab saves it: error outputs, exactly
        saved = _save(page, lab_server, name)
        if saved is None:
            problems.append("JupyterLab did not save the notebook (Ctrl+S) within 30 s")
        else:
            for i, c in enumerate(saved.cells[:n]):
                for o in c.get("outputs", []) if c.cell_type == "code" else []:
                    if o.output_type == "error" and i not in want["may_raise"]:
                        problems.append(f"cell {i}: saved output is an error: "
                                        f"{o.ename}: {o.evalue}")
            if len(saved.cells) > n and any(c.get("outputs") for c in saved.cells[n:]
                                            if c.cell_type == "code"):
                problems.append(f"cells after the first section (from {n}) were run")
            shutil.copy(os.path.join(lab_server["dir"], name),
                        os.path.join(_shots_dir(), name))
        timings["total"] = time.time() - t0
        summary = (f"{name}: ran cells 0..{n - 1} in {timings['total']:.1f} s; "
                   f"img={imgs} widgets={widgets} rank0={'[rank 0]' in text_out} "
                   f"errors in tagged cells={sorted(errors_seen)}")
        print(summary, {k: round(v, 1) for k, v in timings.items()})
        with open(os.path.join(_shots_dir(), "summary.txt"), "a") as f:
            f.write(summary + "\n")
    finally:
        shot = os.path.join(_shots_dir(), os.path.splitext(name)[0] + ".png")
        try:
            _screenshot(page, n, shot)
        except Exception as e:  # a screenshot must not hide the real failure
            problems.append(f"(screenshot failed: {e})")
        page.close()
        _stop_kernels(lab_server)
    if page_errors:
        print(f"{name}: JavaScript errors on the page (not failing the test): {page_errors[:5]}")
    assert not problems, f"{name} (screenshot: {shot}):\n" + "\n".join(problems)
