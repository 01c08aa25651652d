"""A Jupyter kernel that imported labkit shuts down cleanly: JupyterLab's "Shut Down Kernel" and
"Restart Kernel" (jupyter_client's graceful shutdown, what the server sends) leave no process
behind, and the kernel exits by itself, running its atexit handlers, instead of being killed.

Before labkit.launch._kernel_exit, ipykernel's sweep of its children waited on the resource
tracker (it ignores SIGTERM) until jupyter_client killed the kernel: no atexit, 2.5 s per restart.
"""

import os
import sys
import time

import psutil
import pytest
from jupyter_client.manager import KernelManager


def _kernel(tmp_path):
    km = KernelManager(kernel_cmd=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"])
    km.start_kernel(env=dict(os.environ, TMPDIR=str(tmp_path)), cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=240)
    return km, kc


def _run(kc, code, timeout=240):
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
    assert reply["content"]["status"] == "ok", reply["content"]


def _gone(pids, within_s=30.0):
    """The pids still alive (zombies count as gone) after waiting up to within_s."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


SETUP = """
import atexit, os, labkit
import torch.distributed as dist
from labkit.labs.checkpoint_runs import scratch_dir
atexit.register(lambda: open("exited", "w").write("atexit ran"))
scratch = scratch_dir("probe")
"""


@pytest.mark.parametrize("how", ["shutdown", "restart"])
def test_kernel_with_labkit_exits_by_itself_and_leaves_nothing(tmp_path, how):
    km, kc = _kernel(tmp_path)
    try:
        _run(kc, SETUP + "print(labkit.run(dist.get_rank, world_size=2))")  # the forkserver ran ranks
        kernel = psutil.Process(km.provisioner.process.pid)
        helpers = [p.pid for p in kernel.children(recursive=True)]
        assert len(helpers) >= 2, helpers  # forkserver and resource tracker
        if how == "restart":
            km.restart_kernel(now=False)
            kc.wait_for_ready(timeout=240)
        else:
            kc.stop_channels()
            km.shutdown_kernel(now=False)
    finally:
        if km.is_alive():
            if how == "restart":
                _run(kc, "import labkit")  # the new kernel works
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    assert (tmp_path / "exited").exists(), "the kernel was killed: its atexit handlers did not run"
    assert not [p for p in os.listdir(tmp_path) if p.startswith("labkit_probe_")], "scratch folder left"
    assert _gone(helpers + [kernel.pid]) == [], "processes left behind"


def test_shutdown_in_the_middle_of_a_launch_leaves_no_rank(tmp_path):
    km, kc = _kernel(tmp_path)
    kernel = psutil.Process(km.provisioner.process.pid)
    try:
        _run(kc, SETUP)
        kc.execute("import time; labkit.run(time.sleep, 120, world_size=2, timeout=300)")
        deadline = time.monotonic() + 120
        while len(kernel.children(recursive=True)) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)  # forkserver, tracker and two ranks
        everything = [p.pid for p in kernel.children(recursive=True)]
        assert len(everything) >= 4, everything
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    finally:
        if km.is_alive():
            km.shutdown_kernel(now=True)
    assert _gone(everything + [kernel.pid]) == [], "processes left behind"
