"""One look for every picture in the course.

The same thing has the same color in every lab (an all-gather is always the same green), and
fonts are large enough for a classroom projector. A helper that makes its own figure shows it
(`show_own`): it must not depend on pyplot's interactive mode, which a widget's first drawing can
leave off for the rest of the kernel (the figures then surface later, inside some other widget).

matplotlib is imported where a picture is drawn, not here: rank processes import modules that
import this one (for the colors) and draw nothing.
"""

# Communication ops: one color each, everywhere.
OP_COLORS = {
    "all_reduce": "#1f77b4",  # blue
    "reduce_scatter": "#d62728",  # red
    "all_gather": "#2ca02c",  # green
    "broadcast": "#9467bd",  # purple
    "send": "#8c564b",  # brown
    "recv": "#e377c2",  # pink
    "barrier": "#7f7f7f",  # grey
    "other": "#bcbd22",  # olive
}
# Compute spans and waits.
COMPUTE_COLOR = "#ff7f0e"  # orange
BLOCKED_COLOR = "#000000"  # hatched black overlay: the thread is blocked on communication

# Memory categories: one color each, everywhere.
MEMORY_COLORS = {
    "parameters": "#1f77b4",
    "gradients": "#ff7f0e",
    "optimizer": "#9467bd",
    "activations": "#8c564b",
    "all_gather": "#2ca02c",  # the all-gather buffer shares the all-gather op color
    "reduce_scatter": "#d62728",  # likewise for reduce-scatter buffers
    "other": "#7f7f7f",
}

RC = {
    "font.size": 13,
    "axes.titlesize": 15,
    "axes.labelsize": 13,
    "legend.fontsize": 11,
    "xtick.labelsize": 11,
    "ytick.labelsize": 11,
    "figure.dpi": 100,
}


def op_color(op: str) -> str:
    """Color for a collective op name such as 'ring_all_reduce' or 'all_gather_into_tensor'."""
    for key, color in OP_COLORS.items():
        if key in op:
            return color
    return OP_COLORS["other"]


def use_course_style():
    """Apply the course's font sizes to matplotlib (called by every plot function)."""
    import matplotlib as mpl

    mpl.rcParams.update(RC)


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _shown_already():
    """A shown figure's `_ipython_display_`: IPython then displays nothing for it (not even
    "<Figure size ...>"), so a cell ending in the helper's call shows the figure once."""


def mark_shown(obj):
    """Mark obj (a figure, a widget box) as displayed already: a cell whose value it is does not
    show it a second time. Returns obj."""
    obj._ipython_display_ = _shown_already  # module-level: a figure still pickles
    return obj


def show_own(fig):
    """Display `fig` now and drop it from pyplot, when running in a Jupyter kernel; elsewhere
    (scripts, tests) do nothing. For a figure the helper itself made: one given an `ax` belongs to
    the caller, who shows it. Returns fig, marked as shown: a cell whose value it is (the helper's
    call as its last line, no `;`) does not show it a second time (issue 30: every stored
    notebook showed these figures twice, as display_data and as the cell's value)."""
    if _in_kernel():
        from IPython.display import display
        import matplotlib.pyplot as plt

        display(fig)
        plt.close(fig)
        mark_shown(fig)
    return fig
