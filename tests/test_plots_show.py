"""Every plot shows in its own cell of a real Jupyter kernel (the inline backend), whatever drew
the kernel's first figure.

zero1_lab's first figure is drawn by a widget callback (labkit.exercise.draw_in_callback, under
plt.ioff()). Loading the inline backend there turned pyplot's interactive mode on inside ioff(),
and leaving ioff() turned it off for good: the lab's later plots never appeared in their cells and
surfaced inside the next widget's redraw (the browser test saw it; this is the same in a plain
kernel, in seconds). labkit's plotting helpers also display the figures they make themselves, so
they show even where a learner's own code left interactive mode off.
"""

import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETUP = f"""
import sys
sys.path.insert(0, {ROOT!r})
import matplotlib.pyplot as plt
"""
WIDGET_FIRST = """
from labkit.exercise import draw_in_callback
def first():
    fig, ax = plt.subplots(); ax.plot([1, 2]); return fig
plt.close(draw_in_callback(first))
"""
PLAIN_PLOT = "fig, ax = plt.subplots(); ax.plot([1, 3]);"
# The helpers, each in its own cell, with interactive mode off (as a learner's plt.ioff() leaves it).
TRACE = """{"rank": 0, "world_size": 1, "t0": 0.0, "host": "h",
         "spans": [{"name": "backward", "kind": "compute", "start": 0.0, "end": 0.01, "depth": 0}],
         "events": [{"kind": "collective", "op": "all_reduce", "nbytes": 1 << 20, "world_size": 2,
                     "start": 0.005, "end": 0.015, "blocked": [], "async": True, "label": "b"}]}"""
RECORD = """import torch
from labkit.observe.memory import MemoryTracker
model = torch.nn.Linear(32, 32)
with MemoryTracker(model=model) as mt:
    mt.mark("one"); held = torch.empty(4096); mt.mark("two"); del held
record = mt.record()"""
HELPERS = {
    "plot_timeline": f"from labkit.observe.timeline import plot_timeline\nplot_timeline([{TRACE}]);",
    "plot_memory_timeline": RECORD + "\nfrom labkit.observe.memory_plot import plot_memory_timeline"
    "\nplot_memory_timeline(record);",
    "plot_memory_bars": "from labkit.observe.memory_plot import plot_memory_bars\n"
    "plot_memory_bars({'DDP': record});",
    "draw_memory_bars": "from labkit.labs.memory_widget import draw_memory_bars\ndraw_memory_bars(1e6, 4);",
    "plot_ring_step": "from labkit.labs.ddp_lab import plot_ring_step\nplot_ring_step(4, 1);",
}


def _run(cells):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": ROOT}}
    ).execute()
    return [sum("image/png" in o.get("data", {}) for o in c.outputs) for c in nb.cells]


def test_plots_show_after_a_widget_drew_the_first_figure():
    images = _run([SETUP, WIDGET_FIRST, PLAIN_PLOT, "print(plt.isinteractive())"])
    assert images[1] == 1, "the widget-style drawing itself showed no image"
    assert images[2] == 1, (
        "a plain pyplot cell after a widget's first drawing showed no image: "
        "draw_in_callback left interactive mode off"
    )


def test_labkit_helpers_show_what_they_draw_once():
    # the backend loaded first: loading it turns interactive mode on again
    images = _run([SETUP, "plt.close(plt.figure()); plt.ioff();"] + list(HELPERS.values()))
    shown = dict(zip(HELPERS, images[2:]))
    assert shown == {name: 1 for name in HELPERS}, shown


def test_helpers_as_a_cells_value_show_once():
    # the cell ends with the call (no `;`): its value is the figure, shown already (issue 30:
    # display_data + execute_result of the same PNG in zero1_lab's and fsdp_lab's stored cells)
    cells = [code.rstrip().rstrip(";") for code in HELPERS.values()]
    images = _run([SETUP, "plt.close(plt.figure())"] + cells)
    shown = dict(zip(HELPERS, images[2:]))
    assert shown == {name: 1 for name in HELPERS}, shown
