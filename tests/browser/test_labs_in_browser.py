"""Real-browser test: every lab, Run All in JupyterLab in headless Chromium, end to end.

Not part of `make test` / `pytest tests` (skipped there in one line): it needs Debian's `chromium`
and pip's `playwright`, and takes minutes. Run it with

    make browser-test                 # or: scripts/browser_test.sh [pytest args, e.g. -k zero1]
    LABKIT_BROWSER=1 .venv/bin/python -m pytest -q -s tests/browser   # the same, by hand

Per lab (notebooks/*.ipynb as found at collection), its learner copy: what `make lab` gives a
learner, nbgrader's release of the lab (every solution a `raise NotImplementedError()`, each check
printing "TODO ... not implemented yet" and the lab carrying on with labkit's reference), named as
the learner sees it (01_dp_lab.ipynb). Plus tests/browser/fixture_widgets.ipynb,
which proves the checks see a plot, a widget's redraw and an error, and that the redraw,
blank-image and shown-once checks fail on a widget that redraws nothing, on an empty figure and
on a figure shown twice):
  1. JupyterLab serves a stripped copy (so all that shows comes from this run) to a kernel that
     sees a person's notebook (no CI, LABKIT_OUTPUT=live: the labs make real widgets); what the
     checks expect (plots, "[rank 0]" lines, images per cell) comes from the solution notebook's
     stored outputs, cell for cell (a learner copy has the lab's cells, in its order);
  2. Run > Run All Cells; wait until every code cell has run and the kernel is idle;
  3. no cell shows an error (except cells tagged raises-exception), also in the saved copy;
     each cell whose stored output has a PNG shows a loaded <img> with ink in both halves (not a
     blank or half-drawn figure), each figure once (no image twice in a cell, and no more images
     than the stored output has, outside widgets); each cell that makes a widget
     renders one; cells whose stored output says "[rank 0]" show it;
  4. each widget: change one control (and press its Run button if any), wait for its picture (or
     text) to be redrawn and the kernel idle; the new picture is not blank; no error after;
  5. screenshots of each plot and each widget (before and after the change), a whole-page one on
     failure, the executed copy and summary.txt, in LABKIT_BROWSER_SCREENSHOTS
     (default tests/browser/screenshots/, git-ignored);
  6. with LABKIT_BROWSER_KEEP=dir (make test sets build/browser), a learner copy that passed is
     kept there as JupyterLab saved it, with metadata["labkit_executed"] (the SHA-256 of the
     release copy it ran, code cells, how many ran): `make grade-executed` grades it as it stands
     instead of executing the blank copy again (scripts/nbgrader_check.py --learner-runs).

Knobs: LABKIT_BROWSER=1 (required), LABKIT_BROWSER_NOTEBOOKS=glob of the labs' file names (e.g.
"fixture*", "zero1*"), LABKIT_BROWSER_COPIES=learner|solution (default learner; solution runs the
notebooks themselves, as an instructor's `make lab-solutions` shows them), LABKIT_BROWSER_KEEP=dir,
LABKIT_BROWSER_SCREENSHOTS=dir, LABKIT_BROWSER_CHROMIUM=path, LABKIT_BROWSER_OUTPUT=live|ordered,
LABKIT_BROWSER_TIMEOUT=seconds for one notebook's Run All (default 900; a lab takes 30-90 s on
2 cores, more when other jobs share them).
"""

import fnmatch
import glob
import os
import re
import shutil
import sys
import tempfile
import time

import pytest

if os.environ.get("LABKIT_BROWSER") != "1":
    pytest.skip("real-browser test: run `make browser-test` (sets LABKIT_BROWSER=1)", allow_module_level=True)

import nbformat  # noqa: E402

try:
    import playwright  # noqa: F401
except ImportError as e:  # asked for explicitly: fail loudly, do not skip
    raise ImportError(
        "the browser test needs pip's playwright in the course venv: "
        ".venv/bin/pip install 'playwright>=1.40,<2' (no `playwright install`: "
        "it uses Debian's chromium)"
    ) from e

import _jlab_page as jp  # noqa: E402
from _jlab_server import RUN, chromium, jupyterlab, stop_kernels  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# The labs come from this one glob: their names and order may change (e.g. 01_dp_lab.ipynb).
NOTEBOOKS = os.path.join(ROOT, "notebooks", "*.ipynb")
FIXTURE = os.path.join(HERE, "fixture_widgets.ipynb")
SHOTS = os.path.abspath(os.environ.get("LABKIT_BROWSER_SCREENSHOTS", os.path.join(HERE, "screenshots")))
RUN_ALL_TIMEOUT = float(os.environ.get("LABKIT_BROWSER_TIMEOUT", "900"))
COPIES = os.environ.get("LABKIT_BROWSER_COPIES", "learner")
if COPIES not in ("learner", "solution"):
    raise ValueError(
        f"LABKIT_BROWSER_COPIES={COPIES!r}: 'learner' (each lab's learner copy, the default) or "
        "'solution' (the notebooks themselves)"
    )
KEEP = os.environ.get("LABKIT_BROWSER_KEEP")
REDRAW_TIMEOUT = 300  # a widget that re-runs real ranks: seconds on a busy 2-core machine
RENDER_TIMEOUT = 60  # images and widget views render after the kernel is idle

ERROR_TEXT = re.compile(r"Traceback|Error")
# Cells that make a widget: ipywidgets directly, or labkit's widget helpers.
WIDGET_SOURCE = re.compile(
    r"\bwidgets\.\w+\(|\binteract(ive)?(_output)?\(|\b(ring_slider|"
    r"experiment_controls?|memory_calculator|what_if_widget|knob_widget)\("
)
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
PLOT_SOURCE = re.compile(r"\bplt\.|\.plot\(|\bplot_\w*\(")
# Fixture only: a widget that redraws nothing, to prove the redraw check can fail.
NO_REDRAW_TAG = "browser-test-no-redraw"
BLANK_TAG = "browser-test-blank-plot"  # and an empty figure, for the blank-image check
TWICE_TAG = "browser-test-shown-twice"  # and a figure shown twice, for the shown-once check


def _notebooks():
    paths = sorted(glob.glob(NOTEBOOKS)) + [FIXTURE]
    pattern = os.environ.get("LABKIT_BROWSER_NOTEBOOKS")
    return [p for p in paths if not pattern or fnmatch.fnmatch(os.path.basename(p), pattern)]


def _shots(name):
    os.makedirs(SHOTS, exist_ok=True)
    return os.path.join(SHOTS, name)


@pytest.fixture(scope="module")
def served():
    """{lab file name: (its name in JupyterLab, the file served)}: the learner copy nbgrader's
    generate_assignment makes of each lab (scripts/make_student.py, as `make lab` does), or with
    LABKIT_BROWSER_COPIES=solution the notebook itself; the fixture as it is."""
    labs = [p for p in _notebooks() if p != FIXTURE]
    out = {os.path.basename(p): (os.path.basename(p), p) for p in _notebooks()}
    with tempfile.TemporaryDirectory(prefix=f"labkit-browser-{RUN}-course-") as course:
        if COPIES == "learner" and labs:
            sys.path.insert(0, os.path.join(ROOT, "scripts"))
            from make_student import course_name, generate

            released = generate(labs, course)
            for p in labs:
                out[os.path.basename(p)] = (course_name(p) + ".ipynb", released[course_name(p)])
        yield out


@pytest.fixture(scope="module")
def lab_server(served):
    notebooks = {name: path for name, path in served.values()}
    with jupyterlab(notebooks, os.path.join(ROOT, "data"), _shots("jupyterlab.log")) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    with chromium() as context:
        yield context


def expectations(nb) -> dict:
    """Cell indices the browser must show something for. Every lab is executed in place when
    built, so its stored outputs say which cells plot and print rank output; a notebook without
    stored outputs (the fixture) is judged by its source. Widgets are judged by source: the stored
    outputs come from a CI run, where the labs draw static figures instead."""
    code = {i: c for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()}
    stored = any(c.get("outputs") for c in code.values())

    def outs(c):
        return c.get("outputs", [])

    def tagged(tag):
        return {i for i, c in code.items() if tag in c.metadata.get("tags", [])}

    return {
        "runnable": sorted(code),
        "plot": [
            i
            for i, c in code.items()
            if (
                any("image/png" in o.get("data", {}) for o in outs(c))
                if stored
                else PLOT_SOURCE.search(c.source)
            )
        ],
        "widget": [
            i
            for i, c in code.items()
            if WIDGET_SOURCE.search(c.source) or any(WIDGET_MIME in o.get("data", {}) for o in outs(c))
        ],
        "rank0": [i for i, c in code.items() if any("[rank 0]" in o.get("text", "") for o in outs(c))],
        "may_raise": tagged("raises-exception"),
        "no_redraw": tagged(NO_REDRAW_TAG),
        "blank": tagged(BLANK_TAG),
        "twice": tagged(TWICE_TAG),
        # how many images each cell's stored output has (a lab's; the fixture stores none)
        "images": {
            i: sum("image/png" in o.get("data", {}) for o in outs(c)) for i, c in code.items() if stored
        },
    }


def shown_more_than_once(cells, want):
    """{cell: why} for each cell that shows a figure more than once: the same image twice (a
    helper's figure displayed and again as the cell's value, issue 30), or more images than its
    stored output, outside widgets (whose live drawings differ from the stored static ones)."""
    found = {}
    for i in want["plot"]:
        imgs = cells[i]["imgs"]
        if len(set(imgs)) < len(imgs):
            found[i] = f"the same image {len(imgs) - len(set(imgs)) + 1} times ({len(imgs)} images)"
        elif i not in want["widget"] and i in want["images"] and len(imgs) > want["images"][i]:
            found[i] = f"{len(imgs)} images, the stored output has {want['images'][i]}"
    return found


def _errors(cells, may_raise, problems, when):
    seen = set()
    for i, s in enumerate(cells):
        for text in s["stderr"]:
            if ERROR_TEXT.search(text):
                seen.add(i)
                if i not in may_raise:
                    problems.append(f"cell {i} shows an error {when}:\n{text[-1500:]}")
                break
        if "Error displaying widget" in s["text"]:
            problems.append(f"cell {i}: a widget failed to render ('Error displaying widget')")
    return seen


def _exercise_widgets(page, want, problems, stem):
    """Change one control of each widget and wait for its redraw; returns a line per widget."""
    done = []
    cells = page.locator(jp.CELLS)
    for i in want["widget"]:
        before = jp.snapshot(page)[i]
        if not before["widgets"]:
            continue  # reported by the render check
        t = time.time()
        try:
            did = jp.change_one_control(page, cells.nth(i))
            if i in want["no_redraw"]:  # the fixture's negative case: must time out
                try:
                    jp.wait_redrawn(page, i, before, 5)
                    problems.append(f"cell {i}: the redraw check passed on a widget that redraws nothing")
                except TimeoutError:
                    done.append(f"cell {i}: {did}; not redrawn, as expected")
                continue
            jp.wait_redrawn(page, i, before, REDRAW_TIMEOUT)
            problems += [
                f"cell {i}: after the change, image {k} is blank (ink {top:.2%} top, "
                f"{bottom:.2%} bottom half)"
                for k, top, bottom in jp.blank_images(page, i)
            ]
            done.append(f"cell {i}: {did}; redrawn in {time.time() - t:.1f} s")
            cells.nth(i).locator(".jp-Cell-outputArea").screenshot(
                path=_shots(f"{stem}-cell{i:02d}-widget-changed.png")
            )
        except Exception as e:  # report it and go on with the next widget
            problems.append(f"cell {i}: widget did not react: {type(e).__name__}: {e}")
    return done


def _screenshot_outputs(page, want, stem):
    """Pictures for people; the checks are elsewhere. An empty output area (a cell that never ran)
    is invisible and cannot be shot: skipped, so it does not hide the checks' report."""
    cells = page.locator(jp.CELLS)
    for i in sorted(set(want["plot"]) | set(want["widget"])):
        kind = "widget" if i in want["widget"] else "plot"
        area = cells.nth(i).locator(".jp-Cell-outputArea")
        if area.count() and area.is_visible():
            area.screenshot(path=_shots(f"{stem}-cell{i:02d}-{kind}.png"), timeout=30_000)


def _page_screenshot(page, path):
    """The notebook scrolls inside its panel: make the viewport as tall as the notebook first."""
    height = page.evaluate(
        """(sel) => {
        const outer = document.querySelector(sel + ' .jp-WindowedPanel-outer');
        if (outer) outer.scrollTop = 0;
        return outer ? outer.scrollHeight + 200 : 0; }""",
        jp.PANEL,
    )
    page.set_viewport_size({"width": 1400, "height": int(min(max(height, 1000), 16000))})
    page.wait_for_timeout(500)
    page.screenshot(path=path)


def _check_saved(page, lab_server, name, want, problems):
    """The saved copy: every code cell ran, no error but in raises-exception cells. Returns it."""
    path = os.path.join(lab_server["dir"], name)
    if not jp.save(page, path):
        problems.append("JupyterLab did not save the notebook (Ctrl+S) within 30 s")
        return None
    saved = nbformat.read(path, as_version=4)
    for i in want["runnable"]:
        c = saved.cells[i]
        if c.get("execution_count") is None:
            problems.append(f"cell {i}: not executed in the saved copy")
        for o in c.get("outputs", []):
            if o.output_type == "error" and i not in want["may_raise"]:
                problems.append(f"cell {i}: saved output is an error: {o.ename}: {o.evalue}")
    shutil.copy(path, _shots(name))
    return saved


def _keep(saved, source):
    """The learner copy as this run executed it, for nbgrader to grade as it stands (see the top):
    with the SHA-256 of the release copy it ran, so a grader can tell it is the run of its copy."""
    from nbval_keep import provenance  # scripts/, on the path since the `served` fixture

    code = [c for c in saved.cells if c.cell_type == "code" and c.source.strip()]  # Run All skips empty ones
    ran = sum(c.get("execution_count") is not None for c in code)
    saved.metadata["labkit_executed"] = provenance(source, len(code), ran, failed=0)
    os.makedirs(KEEP, exist_ok=True)
    nbformat.write(saved, os.path.join(KEEP, os.path.basename(source)))


@pytest.mark.parametrize("path", _notebooks(), ids=os.path.basename)
def test_notebook_runs_in_jupyterlab(served, lab_server, browser, path):
    name, source = served[os.path.basename(path)]  # a lab's learner copy, or the fixture
    stem = os.path.splitext(name)[0]
    nb = nbformat.read(path, as_version=4)  # the notebook itself: its stored outputs say what to expect
    if len(lab_server["notebooks"][name].cells) != len(nb.cells):
        raise AssertionError(
            f"{name} has {len(lab_server['notebooks'][name].cells)} cells, {path} {len(nb.cells)}"
        )
    want = expectations(nb)
    t0, problems, timings = time.time(), [], {}
    page = browser.new_page()
    js_errors = []
    page.on("pageerror", lambda e: js_errors.append(str(e)))
    try:
        jp.open_notebook(page, lab_server, name, len(nb.cells))
        assert page.locator(jp.CELLS).count() == len(nb.cells)
        timings["open"] = time.time() - t0
        unrun = jp.run_all(page, want["runnable"], RUN_ALL_TIMEOUT)
        timings["run all"] = time.time() - t0 - timings["open"]
        if unrun:
            problems.append(f"Run All stopped: cells {unrun} never ran")

        def rendered():
            s = jp.snapshot(page)
            return all(s[i]["loaded"] for i in want["plot"]) and all(s[i]["widgets"] for i in want["widget"])

        try:
            jp.wait_until(page, rendered, RENDER_TIMEOUT, "plots and widgets rendered")
        except TimeoutError:
            pass  # the per-cell checks below say which
        cells = jp.snapshot(page)
        seen = _errors(cells, want["may_raise"], problems, "after Run All")
        problems += [
            f"cell {i}: stored output has a PNG, but no image loaded here"
            for i in want["plot"]
            if not cells[i]["loaded"]
        ]
        blank = {i: jp.blank_images(page, i) for i in want["plot"] if cells[i]["loaded"]}
        problems += [
            f"cell {i}: image {k} is blank (ink {top:.2%} top, {bottom:.2%} bottom half)"
            for i, found in blank.items()
            if i not in want["blank"]
            for k, top, bottom in found
        ]
        problems += [
            f"fixture: cell {i}'s empty figure was not found blank" for i in want["blank"] if not blank.get(i)
        ]
        twice = shown_more_than_once(cells, want)
        problems += [
            f"cell {i}: a figure shows more than once: {why}"
            for i, why in twice.items()
            if i not in want["twice"]
        ]
        problems += [
            f"fixture: cell {i}'s figure shown twice was not found" for i in want["twice"] if i not in twice
        ]
        problems += [
            f"cell {i}: makes an ipywidgets widget, but none rendered"
            for i in want["widget"]
            if not cells[i]["widgets"]
        ]
        problems += [
            f"cell {i}: no '[rank 0]' output text"
            for i in want["rank0"]
            if "[rank 0]" not in cells[i]["text"]
        ]
        if name == os.path.basename(FIXTURE) and seen != want["may_raise"]:
            problems.append(
                f"fixture: the error check saw errors in cells {sorted(seen)}, "
                f"expected exactly {sorted(want['may_raise'])}"
            )
        # A widget the source patterns missed (a new labkit helper) is exercised all the same.
        found = {i for i, s in enumerate(cells) if s["widgets"] and s["controls"]}
        want["widget"] = sorted(set(want["widget"]) | found)
        _screenshot_outputs(page, want, stem)

        t = time.time()
        reactions = _exercise_widgets(page, want, problems, stem)
        timings["widgets"] = time.time() - t
        _errors(jp.snapshot(page), want["may_raise"], problems, "after the widget changes")
        saved = _check_saved(page, lab_server, name, want, problems)
        if KEEP and saved is not None and not problems and source != path:
            _keep(saved, source)
        timings["total"] = time.time() - t0
        summary = (
            f"{name}: {len(want['runnable'])} code cells run; plots {want['plot']}; "
            f"widgets {want['widget']}; errors in tagged cells {sorted(seen)}; "
            + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
            + "".join(f"\n    {r}" for r in reactions)
        )
        print("\n" + summary)
        with open(_shots("summary.txt"), "a") as f:
            f.write(summary + "\n")
    except Exception as e:
        problems.append(f"{type(e).__name__}: {e}")
    finally:
        if problems:
            try:
                _page_screenshot(page, _shots(f"{stem}-page.png"))
            except Exception as e:  # a screenshot must not hide the real failure
                problems.append(f"(page screenshot failed: {e})")
        page.close()
        stop_kernels(lab_server)
    if js_errors:
        print(f"{name}: JavaScript errors on the page (not failing the test): {js_errors[:5]}")
    assert not problems, f"{name} (screenshots in {SHOTS}):\n" + "\n".join(problems)
