"""A throw-away JupyterLab server and a headless Chromium for the browser test.

Both run from temp dirs named labkit-browser-<run>-* / labkit-chromium-<run>-*, so scripts/browser_test.sh can
check that nothing outlives the test; both are killed on exit, also when the test fails.
"""

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import nbformat
import psutil

# This test run's tag in its temp dirs' names (scripts/browser_test.sh sets it): the leftover check
# after the run looks for this run's processes only, not those of another `make test` beside it.
RUN = os.environ.get("LABKIT_BROWSER_RUN", str(os.getpid()))

BIN = os.path.dirname(sys.executable)
# Without the background-networking flags Chromium dials Google's servers, and the course
# machines' closed network refuses those connections (slow, noisy start-up).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 1000}


def api(server, method, path, timeout=10):
    req = urllib.request.Request(
        f"{server['url']}{path}", method=method, headers={"Authorization": f"token {server['token']}"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body else None


def stop_kernels(server):
    """One lab's kernel (and its ranks) at a time: 2 cores cannot run two labs side by side."""
    for s in api(server, "GET", "/api/sessions") or []:
        with contextlib.suppress(Exception):
            api(server, "DELETE", f"/api/sessions/{s['id']}", timeout=20)


def _kill(procs):
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
                alive.append(p)
    psutil.wait_procs(alive, timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_settings(settings_dir):
    for plugin, values in {
        # Every cell stays in the DOM, so the checks see all of them; timing in the saved copy
        # tells which cell was slow.
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "recordTiming": True},
        # No news/update toast, no request to the internet.
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        path = os.path.join(settings_dir, plugin + ".jupyterlab-settings")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(values, f)


def _write_kernelspecs(data_dir, names):
    """The labs name the `labkit` kernel that `make kernel` installs per user, which may point at
    another checkout's venv: the test gives every kernel name its notebooks use to this venv."""
    for name in names:
        spec = {
            "argv": [
                sys.executable,
                "-Xfrozen_modules=off",
                "-m",
                "ipykernel_launcher",
                "-f",
                "{connection_file}",
            ],
            "display_name": f"{name} (browser test)",
            "language": "python",
        }
        os.makedirs(os.path.join(data_dir, "kernels", name))
        with open(os.path.join(data_dir, "kernels", name, "kernel.json"), "w") as f:
            json.dump(spec, f)


def _server_env(tmp):
    # The kernel must see a person's notebook: labkit.exercise.widgets_enabled() is false under
    # CI or pytest, and the labs then draw static figures instead of widgets.
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "CI",
            "PYTEST_CURRENT_TEST",
            "JUPYTER_CONFIG_DIR",
            "JUPYTER_RUNTIME_DIR",
            "JUPYTER_DATA_DIR",
            "JUPYTER_PATH",
        )
    }
    # This checkout's labkit first, whatever the venv has installed (an editable install of
    # another checkout, or none).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.update(
        LABKIT_OUTPUT=os.environ.get("LABKIT_BROWSER_OUTPUT", "live"),
        PATH=BIN + os.pathsep + env.get("PATH", ""),
        JUPYTER_CONFIG_DIR=os.path.join(tmp, "config"),  # no user config,
        JUPYTER_DATA_DIR=os.path.join(tmp, "data"),  # no user kernels
        JUPYTER_RUNTIME_DIR=os.path.join(tmp, "runtime"),
        JUPYTERLAB_SETTINGS_DIR=os.path.join(tmp, "settings"),
        JUPYTERLAB_WORKSPACES_DIR=os.path.join(tmp, "workspaces"),
        IPYTHONDIR=os.path.join(tmp, "ipython"),
    )
    return env


@contextlib.contextmanager
def jupyterlab(notebooks, data_dir, log_copy):
    """JupyterLab on a free port with a random token, serving stripped copies of `notebooks`
    ({name in JupyterLab: file}; everything on screen comes from this run, the repo is untouched).
    Yields a dict with url, token, dir, and the notebooks as read, by name."""
    tmp = tempfile.mkdtemp(prefix=f"labkit-browser-{RUN}-")
    nbdir = os.path.join(tmp, "course", "notebooks")
    os.makedirs(nbdir)
    if os.path.isdir(data_dir):  # the labs read ../data relative to notebooks/, as in the repo
        os.symlink(data_dir, os.path.join(tmp, "course", "data"))
    read = {}
    for name, src in notebooks.items():
        read[name] = nb = nbformat.read(src, as_version=4)
        stripped = nbformat.from_dict(json.loads(json.dumps(nb)))
        for c in stripped.cells:
            if c.cell_type == "code":
                c.outputs, c.execution_count = [], None
        nbformat.write(stripped, os.path.join(nbdir, name))
    _write_settings(os.path.join(tmp, "settings"))
    _write_kernelspecs(
        os.path.join(tmp, "data"),
        {nb.metadata.get("kernelspec", {}).get("name", "python3") for nb in read.values()} - {"python3"},
    )

    port, token = _free_port(), secrets.token_hex(16)
    log_path = os.path.join(tmp, "jupyterlab.log")
    log = open(log_path, "w")
    cmd = [
        os.path.join(BIN, "jupyter"),
        "lab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={nbdir}",
        f"--LabApp.user_settings_dir={os.path.join(tmp, 'settings')}",
        f"--LabApp.workspaces_dir={os.path.join(tmp, 'workspaces')}",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers run as root
        cmd.append("--allow-root")
    proc = subprocess.Popen(
        cmd,
        cwd=nbdir,
        env=_server_env(tmp),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    server = {"url": f"http://127.0.0.1:{port}", "token": token, "dir": nbdir, "notebooks": read}
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"JupyterLab exited ({proc.returncode}):\n" + open(log_path).read()[-3000:]
                )
            try:
                api(server, "GET", "/api/status", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(
                        "JupyterLab did not answer /api/status in 120 s:\n" + open(log_path).read()[-3000:]
                    )
                time.sleep(0.5)
        yield server
    finally:
        _stop_server(server, proc)
        log.close()
        shutil.copy(log_path, log_copy)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop_server(server, proc):
    # Kernels (and their forkservers and ranks) run in sessions of their own: note them first.
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(Exception):
        api(server, "POST", "/api/shutdown", timeout=5)
        proc.wait(timeout=10)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, sig)
                proc.wait(timeout=10)
    _kill(family)


def chromium_path():
    path = os.environ.get("LABKIT_BROWSER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(path):
        raise RuntimeError(
            "no chromium: `apt-get install -y chromium` (Debian's package) or set LABKIT_BROWSER_CHROMIUM"
        )
    return path


@contextlib.contextmanager
def chromium():
    """A Playwright browser context on Debian's chromium with a fresh profile (Playwright's own
    browser download does not work on the course machines)."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix=f"labkit-chromium-{RUN}-")
    before = {p.pid for p in psutil.Process().children()}
    pw = sync_playwright().start()
    context = None
    try:
        # A persistent context is how Playwright takes a --user-data-dir.
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=chromium_path(),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport=VIEWPORT,
            device_scale_factor=1,
        )
        yield context
    finally:
        # Playwright's driver and Chromium: children of this process that were not there before.
        family = [
            c
            for p in psutil.Process().children()
            if p.pid not in before
            for c in [p] + p.children(recursive=True)
        ]
        try:
            if context is not None:
                context.close()
        finally:
            pw.stop()
            _kill(family)
            shutil.rmtree(profile, ignore_errors=True)
