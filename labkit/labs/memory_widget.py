"""Two classroom controls for the ZeRO lab.

- `memory_calculator(...)`: per-rank bytes by category for ZeRO stages 0-3, from the ZeRO paper's
  formulas (labkit.costmodel.memory_per_rank), for any parameter count, N, precision and an
  optional activation budget; measured bars (e.g. the lab's own run) can be drawn beside them.
- `experiment_control(run_experiment, ...)`: world size and stage pickers that re-run a short
  experiment on real ranks and redraw its plot, with a progress bar while the ranks run.

Both need ipywidgets only where a person is looking: when labkit.exercise.widgets_enabled() is
False (nbval, CI, LABKIT_OUTPUT=ordered) they draw once with the defaults, statically.
Units: decimal (1 GB = 1e9 B), as the ZeRO paper. Left out: activation formulas (pass a number),
fragmentation and communication buffers (see labkit.costmodel for the FSDP buffers).
"""
import matplotlib.pyplot as plt

from labkit.costmodel import memory_per_rank
from labkit.exercise import draw_in_callback, widgets_enabled
from labkit.observe.style import MEMORY_COLORS, use_course_style

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def _unit(max_bytes):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if max_bytes >= scale:
            return unit, scale
    return "B", 1


def draw_memory_bars(params, n, stage=1, precision="mixed", activations=0.0, measured=None, ax=None):
    """Predicted bytes per rank by category for stages 0-3 (the chosen stage drawn solid, the
    others faded) and, optionally, measured bars: measured = {label: {category: bytes}}."""
    use_course_style()
    bars = [(STAGE_NAMES[s], memory_per_rank(params, n, s, precision, activations=activations), s == stage, False)
            for s in range(4)]
    bars += [(label, by_category, True, True) for label, by_category in (measured or {}).items()]
    highest = max(sum(b.get(c, 0) for c in CATEGORIES) for _, b, _, _ in bars)
    unit, scale = _unit(highest)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 4.5))
    used = set()
    for x, (label, by_category, chosen, is_measured) in enumerate(bars):
        bottom = 0.0
        for category in CATEGORIES:
            height = by_category.get(category, 0) / scale
            if height:
                ax.bar(x, height, bottom=bottom, color=MEMORY_COLORS[category],
                       alpha=1.0 if chosen else 0.35, edgecolor="black" if is_measured else None,
                       label=None if category in used else category)
                used.add(category)
                bottom += height
        ax.annotate(f"{bottom:.3g}", (x, bottom), ha="center", va="bottom", fontsize=11)
    ax.set_xticks(range(len(bars)), [label for label, *_ in bars], rotation=15)
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.set_title(f"{params:.3g} parameters, N = {n}, {precision}: per-rank memory by stage")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.figure.tight_layout()
    return ax.figure


def memory_calculator(params=7.5e9, n=64, stage=1, precision="mixed", activations=0.0, measured=None):
    """Sliders for parameter count, N, stage, precision and activations (GB) over draw_memory_bars.
    Without widgets: one static figure with the given values (returned)."""
    if not widgets_enabled():
        fig = draw_memory_bars(params, n, stage, precision, activations, measured)
        plt.show()
        return fig
    import ipywidgets as widgets

    def redraw(log10_params, n, stage, precision, activations_gb):
        draw_in_callback(draw_memory_bars, 10 ** log10_params, n, stage, precision,
                         activations_gb * 1e9, measured)

    import math
    return widgets.interact(
        redraw,
        log10_params=widgets.FloatSlider(value=math.log10(params), min=5, max=12, step=0.05,
                                         description="log10 P"),
        n=widgets.IntSlider(value=n, min=1, max=1024, description="N ranks"),
        stage=widgets.ToggleButtons(options=[0, 1, 2, 3], value=stage, description="stage"),
        precision=widgets.Dropdown(options=["mixed", "fp32"], value=precision, description="precision"),
        activations_gb=widgets.FloatText(value=activations / 1e9, description="act. GB"))


def experiment_control(run_experiment, world_sizes=(2, 4), stages=(0, 1, 2), default=(2, 1)):
    """run_experiment(world_size, stage) runs ranks and draws (e.g. plot_memory_timeline).
    With widgets: pickers + a "run" button, a progress bar while the ranks run, the plot below.
    Without: runs run_experiment(*default) once and returns its value."""
    if not widgets_enabled():
        return run_experiment(*default)
    import ipywidgets as widgets
    from IPython.display import display

    size = widgets.ToggleButtons(options=list(world_sizes), value=default[0], description="N ranks")
    stage = widgets.ToggleButtons(options=[(STAGE_NAMES[s], s) for s in stages], value=default[1],
                                  description="stage")
    button = widgets.Button(description="run on real ranks", button_style="primary")
    progress = widgets.IntProgress(value=0, min=0, max=2, description="idle")
    output = widgets.Output()

    def on_click(_):
        button.disabled = True
        progress.value, progress.bar_style = 1, "info"
        progress.description = f"{size.value} ranks…"
        output.clear_output(wait=True)
        try:
            with output:
                draw_in_callback(run_experiment, size.value, stage.value)
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
