"""No stored notebook shows one figure twice (issue 30: zero1_lab and fsdp_lab showed each of
their helpers' figures as display_data and again as the cell's value, a returned Figure)."""

import glob
import hashlib
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def repeated_figures(nb):
    """[(cell index, why)] for each code cell that shows one image twice, or an image as its value
    beside an image it displayed."""
    found = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        images = [
            (out["output_type"], hashlib.sha1(out["data"]["image/png"].encode()).hexdigest())
            for out in cell.get("outputs", [])
            if "image/png" in out.get("data", {})
        ]
        digests = [d for _, d in images]
        kinds = {k for k, _ in images}
        if len(set(digests)) < len(digests):
            found.append((index, "the same PNG twice"))
        elif "execute_result" in kinds and "display_data" in kinds:
            found.append((index, "a figure displayed, and an image as the cell's value too"))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_every_figure_shows_once(path):
    with open(path) as f:
        nb = json.load(f)
    assert repeated_figures(nb) == []


def test_the_scan_sees_a_figure_shown_twice():
    png = {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"}
    cell = {
        "cell_type": "code",
        "outputs": [
            {"output_type": "display_data", "data": png},
            {"output_type": "execute_result", "data": png},
        ],
    }
    assert repeated_figures({"cells": [cell]}) == [(0, "the same PNG twice")]


def test_hsdp_lab_stores_its_figures():
    """Issue 30 §3: hsdp_lab draws what it measures, the flat ring against the two-level
    all-reduce on the timeline and the bytes per step across and within nodes: each in its own
    cell, once (the browser test then checks those cells live, from these stored outputs)."""
    with open(os.path.join(ROOT, "notebooks", "hsdp_lab.ipynb")) as f:
        nb = json.load(f)
    with_images = {
        ("plot_flat_vs_hier" in "".join(c["source"]), "plot_node_bytes" in "".join(c["source"]))
        for c in nb["cells"]
        if c["cell_type"] == "code"
        and sum("image/png" in o.get("data", {}) for o in c.get("outputs", [])) == 1
    }
    assert {(True, False), (False, True)} <= with_images


def test_tp_lab_stores_its_figures():
    """tp_lab draws the TP step's timeline and the bytes per step across and within nodes of its
    two mesh layouts: each in its own cell, once."""
    with open(os.path.join(ROOT, "notebooks", "tp_lab.ipynb")) as f:
        nb = json.load(f)
    with_images = {
        ("plot_tp_step" in "".join(c["source"]), "plot_layout_bytes" in "".join(c["source"]))
        for c in nb["cells"]
        if c["cell_type"] == "code"
        and sum("image/png" in o.get("data", {}) for o in c.get("outputs", [])) == 1
    }
    assert {(True, False), (False, True)} <= with_images


def test_pp_lab_stores_its_figures():
    """pp_lab draws the three schedules' per-rank timelines (forward, backward, idle slots) in one
    figure, every searched layout of the selection table in another, and 1F1B against ZB-H1 (the
    W slots too) in a third: each in its own cell, once."""
    with open(os.path.join(ROOT, "notebooks", "pp_lab.ipynb")) as f:
        nb = json.load(f)
    cells = [
        c
        for c in nb["cells"]
        if c["cell_type"] == "code" and any("image/png" in o.get("data", {}) for o in c.get("outputs", []))
    ]
    drawn = sorted(
        name for c in cells for name in ("plot_schedules", "plot_choices") if name in "".join(c["source"])
    )
    assert drawn == ["plot_choices", "plot_schedules", "plot_schedules"] and len(cells) == 3, drawn
    assert all(sum("image/png" in o.get("data", {}) for o in c["outputs"]) == 1 for c in cells)


def test_seq_lab_stores_its_figure():
    """seq_lab draws the ring's steps per rank (both layouts in one figure): once, in its own cell."""
    with open(os.path.join(ROOT, "notebooks", "seq_lab.ipynb")) as f:
        nb = json.load(f)
    cells = [
        c
        for c in nb["cells"]
        if c["cell_type"] == "code" and any("image/png" in o.get("data", {}) for o in c.get("outputs", []))
    ]
    assert len(cells) == 1 and "plot_ring_steps" in "".join(cells[0]["source"])
    assert sum("image/png" in o.get("data", {}) for o in cells[0]["outputs"]) == 1
