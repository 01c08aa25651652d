"""Two classroom controls for the ZeRO lab.

- `memory_calculator(...)`: per-rank bytes by category for ZeRO stages 0-3, from the ZeRO paper's
  formulas (labkit.costmodel.memory_per_rank), for any parameter count, N, precision and an
  optional activation budget; measured bars (e.g. the lab's own run) can be drawn beside them,
  either after the predicted ones (`measured`) or each beside its stage's prediction for the
  exact (P, precision, N) it was measured at (`measured_stages`, e.g. the lab's bf16 runs).
  Its inputs are exact (typed numbers, named sizes): the bars of 7.5e9 at N = 64 read the
  paper's 120 / 31.4 / 16.6 / 1.9 GB, labelled with the paper's rounding.
- `experiment_control(run_experiment, ...)`: world size and stage pickers that re-run a short
  experiment on real ranks and redraw its plot, with a progress bar while the ranks run.

Both need ipywidgets only where a person is looking: when labkit.exercise.widgets_enabled() is
False (nbval, CI, LABKIT_OUTPUT=ordered) they draw once with the defaults, statically.
Units: decimal (1 GB = 1e9 B), as the ZeRO paper. Left out: activation formulas (pass a number),
fragmentation and communication buffers (see labkit.costmodel for the FSDP buffers).
"""

import matplotlib.pyplot as plt

from labkit.costmodel import memory_per_rank
from labkit.exercise import draw_into, widgets_enabled
from labkit.observe.style import MEMORY_COLORS, mark_shown, show_own, use_course_style

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def _unit(max_bytes):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if max_bytes >= scale:
            return unit, scale
    return "B", 1


def bar_label(value):
    """A bar's total as the ZeRO paper prints it: one decimal, no trailing zero (120, 31.4, 1.9);
    under 1 (in the bar's unit) two significant digits."""
    return f"{round(value, 1):g}" if value >= 1 else f"{value:.2g}"


def _params_text(params):
    """The exact parameter count in the title: 805,248 (not 8.05e+05); billions as 7.5 B."""
    if float(params).is_integer() and params < 1e8:
        return f"{int(params):,}"
    return f"{params / 1e9:g} B"


def draw_memory_bars(
    params, n, stage=1, precision="mixed", activations=0.0, measured=None, ax=None, measured_stages=None
):
    """Predicted bytes per rank by category for stages 0-3 (the chosen stage drawn solid, the
    others faded) and, optionally, measured bars (black edges): measured = {label: {category:
    bytes}} after the predictions; measured_stages = {stage: {category: bytes}}, each right of
    its stage's prediction as "<stage> measured" (the caller vouches it was measured at these
    params, n and precision). The figure's `bar_labels` is the list of totals as annotated and
    `bar_names` the bars' names, left to right (what a test reads)."""
    use_course_style()
    bars = []
    for s in range(4):
        bars.append(
            (
                STAGE_NAMES[s],
                memory_per_rank(params, n, s, precision, activations=activations),
                s == stage,
                False,
            )
        )
        if s in (measured_stages or {}):
            bars.append((f"{STAGE_NAMES[s]} measured", measured_stages[s], s == stage, True))
    bars += [(label, by_category, True, True) for label, by_category in (measured or {}).items()]
    highest = max(sum(b.get(c, 0) for c in CATEGORIES) for _, b, _, _ in bars)
    unit, scale = _unit(highest)
    own_figure = ax is None
    if own_figure:
        _, ax = plt.subplots(figsize=(10, 4.5))
    used, labels = set(), []
    for x, (label, by_category, chosen, is_measured) in enumerate(bars):
        bottom = 0.0
        for category in CATEGORIES:
            height = by_category.get(category, 0) / scale
            if height:
                ax.bar(
                    x,
                    height,
                    bottom=bottom,
                    color=MEMORY_COLORS[category],
                    alpha=1.0 if chosen else 0.35,
                    edgecolor="black" if is_measured else None,
                    label=None if category in used else category,
                )
                used.add(category)
                bottom += height
        labels.append(bar_label(bottom))
        ax.annotate(labels[-1], (x, bottom), ha="center", va="bottom", fontsize=11)
    ax.set_xticks(range(len(bars)), [label for label, *_ in bars], rotation=15)
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.set_title(f"P = {_params_text(params)}, N = {n}, {precision}: per-rank memory by stage")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.figure.tight_layout()
    ax.figure.bar_labels, ax.figure.bar_names = labels, [label for label, *_ in bars]
    return show_own(ax.figure) if own_figure else ax.figure


# Exact stops for the size picker: the ZeRO paper's example first; the caller's own P is added.
NAMED_SIZES = {
    "ZeRO paper, 7.5 B": 7.5e9,
    "GPT-2, 124 M": 124e6,
    "GPT 1.3 B": 1.3e9,
    "GPT 13 B": 13e9,
    "GPT 175 B": 175e9,
}


def memory_calculator(
    params=7.5e9,
    n=64,
    stage=1,
    precision="mixed",
    activations=0.0,
    measured=None,
    sizes=None,
    measured_stages=None,
):
    """Exact inputs over draw_memory_bars: the parameter count typed as a number (or picked from
    `sizes`, {label: P}, plus NAMED_SIZES), N typed, stage, precision, activations (GB).
    measured_stages = {(params, precision, n): {stage: {category: bytes}}}: measured bars drawn
    beside the predictions only while the inputs are exactly those (P, precision, N).
    No slider rounds P: a log-scale slider's 0.05 steps turned 7.5e9 into 7.94e9.
    Without widgets: one static figure with the given values (returned). With widgets: the
    controls and the plot (a VBox; `.controls` holds the inputs, `.figure` the last drawing)."""

    def measured_at(p, precision_, n_):
        return (measured_stages or {}).get((p, precision_, n_))

    if not widgets_enabled():
        fig = draw_memory_bars(
            params,
            n,
            stage,
            precision,
            activations,
            measured,
            measured_stages=measured_at(params, precision, n),
        )
        plt.show()
        return fig
    import ipywidgets as widgets
    from IPython.display import display

    stops = {**(sizes or {}), **NAMED_SIZES}
    controls = {
        "size": widgets.Dropdown(
            options=[("(typed)", 0.0)] + [(k, v) for k, v in stops.items()],
            value=params if params in stops.values() else 0.0,
            description="model",
        ),
        "params": widgets.FloatText(value=params, description="P"),
        "n": widgets.BoundedIntText(value=n, min=1, max=1_000_000, description="N ranks"),
        "stage": widgets.ToggleButtons(options=[0, 1, 2, 3], value=stage, description="stage"),
        "precision": widgets.Dropdown(options=["mixed", "fp32"], value=precision, description="precision"),
        "activations_gb": widgets.FloatText(value=activations / 1e9, description="act. GB"),
    }
    output = widgets.Output()
    box = widgets.VBox(
        [
            widgets.HBox([controls["size"], controls["params"], controls["n"]]),
            controls["stage"],
            widgets.HBox([controls["precision"], controls["activations_gb"]]),
            output,
        ]
    )
    box.controls, box.figure = controls, None

    def pick_size(change):
        if change["new"]:
            controls["params"].value = change["new"]  # redraws through the P box

    def redraw(_change=None):
        c = {k: w.value for k, w in controls.items()}
        if c["size"] and c["size"] != c["params"]:
            controls["size"].value = 0.0  # a typed P that is no stop
        box.figure = draw_into(
            output,
            draw_memory_bars,
            c["params"],
            c["n"],
            c["stage"],
            c["precision"],
            c["activations_gb"] * 1e9,
            measured,
            measured_stages=measured_at(c["params"], c["precision"], c["n"]),
        )
        plt.close(box.figure)  # shown in the output already; pyplot need not keep it

    controls["size"].observe(pick_size, names="value")
    for name in ("params", "n", "stage", "precision", "activations_gb"):
        controls[name].observe(redraw, names="value")
    redraw()
    display(box)
    # shown: a cell ending in this call must not show the box (and its figure) again as its value
    # (the browser test saw cells 12 and 76 of zero1_lab show the same image twice)
    return mark_shown(box)


def experiment_control(run_experiment, world_sizes=(2, 4), stages=(0, 1, 2), default=(2, 1)):
    """run_experiment(world_size, stage) runs ranks and draws (e.g. plot_memory_timeline).
    With widgets: pickers + a "run" button, a progress bar while the ranks run, the plot below.
    Without: runs run_experiment(*default) once and returns its value."""
    if not widgets_enabled():
        return run_experiment(*default)
    import ipywidgets as widgets
    from IPython.display import display

    size = widgets.ToggleButtons(options=list(world_sizes), value=default[0], description="N ranks")
    stage = widgets.ToggleButtons(
        options=[(STAGE_NAMES[s], s) for s in stages], value=default[1], description="stage"
    )
    button = widgets.Button(description="run on real ranks", button_style="primary")
    progress = widgets.IntProgress(value=0, min=0, max=2, description="idle")
    output = widgets.Output()

    def on_click(_):
        button.disabled = True
        progress.value, progress.bar_style = 1, "info"
        progress.description = f"{size.value} ranks…"
        try:
            draw_into(output, run_experiment, size.value, stage.value)
            progress.bar_style, progress.description = "success", "done"
        except Exception:
            progress.bar_style, progress.description = "danger", "failed"
            raise
        finally:
            progress.value, button.disabled = 2, False

    button.on_click(on_click)
    display(widgets.VBox([widgets.HBox([size, stage]), widgets.HBox([button, progress]), output]))
    on_click(None)
    return None
