"""Headless execution never waits for its timeout after a widget cell (issue 28).

The stall: labkit's widgets drew their first plot inside the cell with `with output:` (an
ipywidgets Output capture). A headless client (nbclient, behind nbconvert --execute, papermill,
nbgrader) mimics the front end for that capture by sending a comm_msg with the widget's outputs
on the kernel's shell socket while it awaits the cell's execute_reply on that same socket; the
send can swallow the socket's wake-up for the reply, and the client sleeps until its timeout
(seen under CPU load: the next cell started exactly T seconds late). The race itself is rare on
a quiet machine, so this test pins its precondition, which is deterministic: with live widgets,
running every labkit widget headless makes nbclient send nothing on the shell socket but the
cells' execute_requests, and no cell waits anywhere near its timeout.
"""

import asyncio
import os
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

CELLS = [
    "import matplotlib.pyplot as plt\nfrom labkit.labs import ddp_lab, fsdp_lab, memory_widget",
    "ddp_lab.ring_slider(4)",
    "memory_widget.memory_calculator(7.5e9, 64)",
    # the controls that launch ranks, with a stand-in experiment (what matters is the capture)
    "def experiment(*args, **kwargs):\n    print('ranks ran', args)\n    plt.plot([0, 1], [1, 0])\n"
    "    plt.show()\n    return {}",
    "memory_widget.experiment_control(experiment)",
    "ddp_lab.experiment_controls(lambda n, mb: (n, mb), lambda results: experiment(results))",
    "fsdp_lab.knob_experiment = experiment\nfsdp_lab.knob_widget(cfg=None)",
    "print('after the widgets')",
]
TIMEOUT = 60


def test_widget_cells_send_nothing_back_and_never_wait_for_the_timeout():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT, kernel_name="python3", record_timing=True)
    sent = []

    async def run():
        async with client.async_setup_kernel(env=env):
            channel = client.kc.shell_channel
            send = channel.send

            def counting_send(msg):
                sent.append(msg["header"]["msg_type"])
                return send(msg)

            channel.send = counting_send
            for index, cell in enumerate(client.nb.cells):
                start = time.monotonic()
                await client.async_execute_cell(cell, index, execution_count=index + 1)
                waited = time.monotonic() - start
                assert waited < TIMEOUT / 2, f"cell {index} took {waited:.0f} s (timeout {TIMEOUT} s)"

    # widgets on, as for a person (LABKIT_OUTPUT=live, not CI, not under pytest)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_CURRENT_TEST")}
    env["LABKIT_OUTPUT"] = "live"
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    asyncio.run(run())
    errors = [o for cell in nb.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    others = sorted(set(sent) - {"execute_request", "kernel_info_request"})
    assert not others, (
        f"nbclient sent {others} on the shell socket: a widget captured output with `with output:`"
        " (use labkit.exercise.draw_into)"
    )
    drawn = [
        state
        for state in client.widget_state.values()
        if state.get("_model_name") == "OutputModel"
        and any("image/png" in o.get("data", {}) for o in state.get("outputs", ()))
    ]
    assert len(drawn) >= 5, f"only {len(drawn)} widget outputs hold a plot"  # one per widget
