"""What the browser test does on a JupyterLab page: open a notebook, Run All, read what each cell
shows, and move one control of a widget.

Cells are read from the cell's own top-level output area (`.jp-Cell-outputArea`): an ipywidgets
Output nests a second `.jp-OutputArea` inside a cell, so a page-wide `.jp-OutputArea` locator
matches several elements (Playwright's strict mode refuses it) or the wrong one.
"""

import os
import time

PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
CELLS = f"{PANEL} .jp-Notebook .jp-Cell"

# One snapshot of every cell, in one round trip (the page changes while the kernel runs).
# Images are summarized by a hash of their src: a redrawn matplotlib figure is a new data: URL,
# a redrawn ipywidgets Image a new blob: URL.
_SNAPSHOT_JS = """(cells) => {
    const CONTROLS = '.widget-slider, .widget-toggle-buttons, .widget-dropdown select, '
                   + '.widget-checkbox';
    const hash = s => {
        let h = 5381;
        for (let i = 0; i < s.length; i++) h = (h * 33 ^ s.charCodeAt(i)) | 0;
        return s.length + ':' + h;
    };
    return Array.from(document.querySelectorAll(cells)).map(cell => {
        const area = cell.querySelector('.jp-Cell-outputArea');
        // the cell's own outputs, not those of an Output widget's nested .jp-OutputArea
        const top = area ? Array.from(area.querySelectorAll('.jp-OutputArea-output'))
                               .filter(o => o.closest('.jp-OutputArea') === area) : [];
        const imgs = area ? Array.from(area.querySelectorAll('img')) : [];
        return {
            text: area ? area.innerText : '',
            // what a widget shows below its controls (not the controls' own readouts)
            shown: area ? Array.from(area.querySelectorAll('.widget-output, .widget-html-content'))
                              .map(e => e.innerText).join('\\n') : '',
            imgs: imgs.map(i => hash(i.src)),
            loaded: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
            // a widget view is a .jupyter-widgets child of the output (no data-mime-type there)
            widgets: top.filter(o => o.querySelector(':scope > .jupyter-widgets')).length,
            controls: area ? area.querySelectorAll(CONTROLS).length : 0,
            stderr: area ? Array.from(area.querySelectorAll(
                '[data-mime-type="application/vnd.jupyter.stderr"]')).map(e => e.innerText) : [],
        };
    });
}"""


# A plot that "appears" must have ink in both halves: a figure rendered before its artists (all
# white) or cut short (title and top spine only) has none in the lower half. Counted at natural
# size: downscaling would wash thin black lines out to light gray.
_INK_JS = """([cells, index]) => {
    const cell = document.querySelectorAll(cells)[index];
    return Array.from(cell.querySelectorAll('.jp-Cell-outputArea img')).map(img => {
        const w = img.naturalWidth, h = img.naturalHeight;
        if (!w || !h) return [0, 0];
        const canvas = document.createElement('canvas');
        canvas.width = w; canvas.height = h;
        const g = canvas.getContext('2d');
        g.drawImage(img, 0, 0);
        const d = g.getImageData(0, 0, w, h).data;
        const ink = [0, 0];
        for (let y = 0; y < h; y++)
            for (let x = 0; x < w; x++) {
                const k = 4 * (y * w + x);
                const dark = d[k + 3] > 16 && Math.min(d[k], d[k + 1], d[k + 2]) < 200;
                if (dark) ink[y < h / 2 ? 0 : 1]++;
            }
        return ink.map(n => n / (w * h / 2));
    });
}"""
MIN_INK = 0.002  # a bottom spine alone is ~0.4% of a half; a blank half is 0


def blank_images(page, index):
    """(k, top ink, bottom ink) for each image in cell `index` with too little ink in a half."""
    return [
        (k, top, bottom)
        for k, (top, bottom) in enumerate(page.evaluate(_INK_JS, [CELLS, index]))
        if min(top, bottom) < MIN_INK
    ]


def snapshot(page):
    return page.evaluate(_SNAPSHOT_JS, CELLS)


# Run All's progress, read every second: the prompts only (a whole snapshot reads every output's
# text and hashes every image, work that competes with the kernel for the machine's cores).
_PROMPTS_JS = """(cells) => Array.from(document.querySelectorAll(cells)).map(cell => {
    const prompt = cell.querySelector('.jp-InputArea-prompt');
    return prompt ? prompt.innerText.trim() : '';
})"""


def prompts(page):
    return page.evaluate(_PROMPTS_JS, CELLS)


def kernel_idle(page) -> bool:
    """The status bar says '| Idle' and the toolbar's execution indicator agrees."""
    return page.evaluate(
        """(sel) => {
        const bar = document.querySelector('#jp-main-statusbar');
        const ind = document.querySelector(sel + ' .jp-Notebook-ExecutionIndicator');
        return !!bar && /\\|\\s*Idle\\b/.test(bar.innerText)
            && (!ind || ind.dataset.status === 'idle');
    }""",
        PANEL,
    )


def wait_until(page, condition, timeout_s, what):
    deadline = time.time() + timeout_s
    while not condition():
        if time.time() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        page.wait_for_timeout(250)


def open_notebook(page, server, name, ncells):
    # ?reset: a fresh workspace, so the previous notebook's tab (and its kernel) is not restored.
    page.goto(
        f"{server['url']}/lab/tree/{name}?reset&token={server['token']}",
        wait_until="domcontentloaded",
        timeout=120_000,
    )
    page.wait_for_selector(CELLS, timeout=120_000)
    dialog = page.locator(".jp-Dialog .jp-mod-accept")  # e.g. "Select Kernel"
    if dialog.count():
        dialog.first.click()
    wait_until(
        page,
        lambda: page.locator(CELLS).count() >= ncells and kernel_idle(page),
        180,
        "notebook open with its kernel idle",
    )


def run_all(page, runnable, timeout_s, stall_s=20):
    """Run > Run All Cells, then wait until every runnable cell has a numbered prompt and the
    kernel is idle. Returns the cells that never ran: Run All stops at an untagged error, and the
    kernel then stays idle; `stall_s` of idle with unrun cells and no [*] means it has stopped."""
    page.locator("#jp-MainMenu .lm-MenuBar-item", has_text="Run").first.click()
    page.locator(".lm-Menu").get_by_text("Run All Cells", exact=True).click()
    deadline, idle_since = time.time() + timeout_s, None
    page.wait_for_timeout(1000)
    while True:
        shown = prompts(page)
        unrun = [i for i in runnable if not shown[i].strip("[]: ").isdigit()]
        queued = any("*" in p for p in shown)
        idle = kernel_idle(page)
        if not unrun and idle:
            return []
        idle_since = (idle_since or time.time()) if idle and not queued else None
        if idle_since and time.time() - idle_since > stall_s:
            return unrun
        if time.time() > deadline:
            raise TimeoutError(f"Run All not finished after {timeout_s:.0f} s; cells not run: {unrun}")
        page.wait_for_timeout(1000)


def _signature(cell_snapshot):
    return tuple(cell_snapshot["imgs"]) or cell_snapshot["shown"]


def change_one_control(page, cell):
    """Change one control of the widget in `cell` (a Locator) and press its Run button if it has
    one (the labs' real-rank experiments only re-run on the button). Takes the LAST slider,
    toggle group, dropdown or checkbox, in that order of preference: the labs put the world size
    first, and re-running a few more ranks is what makes a 2-core run slow. Returns what it did."""
    area = cell.locator(".jp-Cell-outputArea")
    sliders = area.locator(".widget-slider")
    toggles = area.locator(".widget-toggle-buttons")
    selects = area.locator(".widget-dropdown select")
    checks = area.locator(".widget-checkbox input[type=checkbox]")
    if sliders.count():
        slider = sliders.last
        readout = slider.locator(".widget-readout")
        before = readout.inner_text()
        handle = slider.locator(".noUi-handle").first
        handle.focus()
        for key in ("ArrowRight", "ArrowLeft", "ArrowLeft"):  # at its maximum: step down
            handle.press(key)
            page.wait_for_timeout(300)
            if readout.inner_text() != before:
                break
        did = (
            f"slider {slider.locator('.widget-label').first.inner_text()!r}: "
            f"{before} -> {readout.inner_text()}"
        )
        if readout.inner_text() == before:
            raise AssertionError(f"the slider did not move ({did})")
    elif toggles.count():
        group = toggles.last
        button = group.locator("button:not(.mod-active)").first
        label = button.inner_text()
        button.click()
        did = f"toggle -> {label!r}"
    elif selects.count():
        select = selects.last
        n, k = select.evaluate("s => [s.options.length, s.selectedIndex]")
        select.select_option(index=(k + 1) % n)
        did = f"dropdown -> {select.evaluate('s => s.options[s.selectedIndex].text')!r}"
    elif checks.count():
        checks.last.click()
        did = "checkbox toggled"
    else:
        raise AssertionError("the widget has no slider, toggle, dropdown or checkbox to change")
    run = area.locator("button.widget-button")
    if run.count():
        run.first.click()
        did += f", then {run.first.inner_text()!r}"
    return did


def wait_redrawn(page, index, before, timeout_s):
    """Wait until cell `index` shows a different output (a new image, or else new text under its
    controls) and the kernel is idle again, with every image loaded."""

    def redrawn():
        s = snapshot(page)[index]
        return (
            _signature(s) != _signature(before)
            and (s["imgs"] or not before["imgs"])
            and s["loaded"] == len(s["imgs"])
            and kernel_idle(page)
        )

    wait_until(page, redrawn, timeout_s, f"cell {index} redrawn after the change")


def save(page, path, timeout_s=30):
    """Ctrl+S; True once JupyterLab has written the file."""
    mtime = os.path.getmtime(path)
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    deadline = time.time() + timeout_s
    while os.path.getmtime(path) == mtime:
        if time.time() > deadline:
            return False
        page.wait_for_timeout(200)
    page.wait_for_timeout(300)  # let the write finish
    return True
