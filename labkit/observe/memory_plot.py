"""Pictures of measured memory: a timeline per rank, and bars that compare strategies.

Colors come from labkit.observe.style.MEMORY_COLORS, so parameters are the same blue in every lab.
Theory values (16P, 16P/N, ...) are drawn next to the measurement, never mixed into it.
Left out: interactive zoom and per-tensor detail; the records carry only per-category bytes.
"""

import matplotlib.pyplot as plt
import numpy as np

from labkit.observe.memory_record import ALL_CATEGORIES, MemoryRecord
from labkit.units import fmt_bytes
from labkit.observe.style import MEMORY_COLORS, show_own, use_course_style

LABEL_BOX = dict(facecolor="white", alpha=0.75, edgecolor="none", pad=1.5)
MAX_TICK_LABELS = 8  # more x labels than this overlap at the default figure width
THEORY_STYLES = [("black", "--"), ("dimgray", ":"), ("black", "-."), ("dimgray", (0, (5, 2, 1, 2)))]


def _unit_for(max_bytes):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= scale:
            return unit, scale
    return "B", 1


def _as_records(records):
    if isinstance(records, MemoryRecord):
        return [records]
    return [r for r in records if r is not None]


def _theory_for(value, position):
    """A theory value is one number for every panel, or a list with one number (or None: no
    line on that panel) per panel."""
    return value[position] if isinstance(value, (list, tuple)) else value


def plot_memory_timeline(records, theory=None, title=None, ax=None, x="index"):
    """Stacked areas of bytes by category over the step, one subplot per rank.

    records: results.memory (a list by rank) or one MemoryRecord. theory: {label: bytes} (or a
    list of bytes per rank) drawn as dashed lines. x: "index" (one slot per sample, readable) or
    "time" (seconds since the tracker started, honest about durations). Returns the figure.
    """
    use_course_style()
    records = _as_records(records)
    if not records:
        raise ValueError("no memory records: was a MemoryTracker used on any rank?")
    theory = theory or {}
    own_figure = ax is None
    if own_figure:
        fig, axes = plt.subplots(
            len(records), 1, figsize=(11, 1.0 + 3.2 * len(records)), sharey=True, squeeze=False
        )
        axes = list(axes[:, 0])
    else:
        axes = list(ax) if isinstance(ax, (list, tuple, np.ndarray)) else [ax]
        fig = axes[0].figure
        if len(axes) != len(records):
            raise ValueError(f"got {len(axes)} axes for {len(records)} records")
    categories = [c for c in ALL_CATEGORIES if any(c in r.used_categories() for r in records)]
    theory_values = [
        t for v in theory.values() for i in range(len(records)) if (t := _theory_for(v, i)) is not None
    ]
    highest = max([r.peak_total for r in records] + theory_values + [1])
    unit, scale = _unit_for(highest)
    for position, (record, axis) in enumerate(zip(records, axes)):
        _draw_timeline(axis, record, categories, scale, x)
        for (label, value), (color, style) in zip(theory.items(), THEORY_STYLES * 4):
            value = _theory_for(value, position)
            if value is None:
                continue
            axis.axhline(value / scale, color=color, linestyle=style, linewidth=2)
            axis.annotate(
                f"{label} = {fmt_bytes(value)}",
                xy=(1.0, value / scale),
                xycoords=("axes fraction", "data"),
                xytext=(-4, 3),
                textcoords="offset points",
                ha="right",
                va="bottom",
                fontsize=11,
                bbox=LABEL_BOX,
            )
        who = f"rank {record.rank}" if record.rank is not None else (record.name or "this process")
        axis.set_title(who, loc="left")
        axis.set_ylabel(f"memory ({unit})")
        axis.set_ylim(0, highest / scale * 1.35)  # room for phase names
    axes[-1].set_xlabel("sample (phase edges, marks, collectives)" if x == "index" else "time (s)")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return show_own(fig) if own_figure else fig


def _draw_timeline(axis, record, categories, scale, x):
    samples = record.samples
    xs = np.arange(len(samples)) if x == "index" else np.array([s.t for s in samples])
    layers = [[s.by_category.get(c, 0) / scale for s in samples] for c in categories]
    axis.stackplot(
        xs, layers, labels=categories, colors=[MEMORY_COLORS.get(c, "#7f7f7f") for c in categories], alpha=0.9
    )
    # The running high-water since the previous sample: shows temporaries no sample caught.
    axis.step(
        xs,
        np.array(record.high_water) / scale,
        where="pre",
        color="black",
        linewidth=1.2,
        label="high-water between samples",
    )
    if record.device_samples:
        allocated = [a / scale for a, _ in record.device_samples]
        axis.plot(
            xs[: len(allocated)], allocated, color="crimson", linewidth=2, label="cuda memory_allocated"
        )
    peak_at = int(np.argmax(record.high_water))
    axis.plot([xs[peak_at]], [record.peak_total / scale], marker="v", color="black", markersize=11)
    axis.annotate(
        f"peak {fmt_bytes(record.peak_total)}",
        xy=(xs[peak_at], record.peak_total / scale),
        xytext=(0, 8),
        textcoords="offset points",
        ha="center",
        fontsize=12,
        fontweight="bold",
    )
    _draw_phases(axis, record, xs)
    axis.set_xlim(xs[0], xs[-1] if len(xs) > 1 else xs[0] + 1)


PHASE_FONT = 11
PHASE_ROWS = (0.97, 0.89)  # axes fraction: a name that would overlap its row's last one drops a row


def _draw_phases(axis, record, xs):
    """Shade each phase and name it, in one of two rows where the name fits without touching the
    one before it ("optim" next to "optimizer" read "optimoptimizer"); a phase too narrow for
    either row stays unnamed (its neighbours' names and the shading place it). With many phases,
    name only each first occurrence."""
    named = set()
    crowded = len(record.phases) > 12
    fig = axis.figure
    lo, hi = float(xs[0]), float(xs[-1]) if len(xs) > 1 else float(xs[0]) + 1
    px_per_x = axis.get_position().width * fig.get_figwidth() * fig.dpi / max(hi - lo, 1e-12)
    char_px = 0.62 * PHASE_FONT * fig.dpi / 72  # a generous average glyph width
    row_end = [-np.inf] * len(PHASE_ROWS)  # pixel where each row's last name ends
    for number, (name, first, last) in enumerate(record.phases):
        axis.axvspan(xs[first], xs[last], color="0.85" if number % 2 else "0.93", zorder=-2)
        if crowded and name in named:
            continue
        centre = (float(xs[first]) + float(xs[last])) / 2
        half = len(name) * char_px / 2 + 3
        left, right = (centre - lo) * px_per_x - half, (centre - lo) * px_per_x + half
        row = next((r for r, end in enumerate(row_end) if left > end), None)
        if row is None:
            continue
        row_end[row] = right
        named.add(name)
        axis.text(
            centre,
            PHASE_ROWS[row],
            name,
            transform=axis.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=PHASE_FONT,
            clip_on=True,
        )
    shown = _tick_samples(record.marks, xs, int(np.argmax(record.high_water)))
    axis.set_xticks([xs[i] for i in shown], [record.samples[i].label for i in shown], rotation=25, ha="right")


def _tick_samples(marks, xs, peak_at, most=MAX_TICK_LABELS):
    """The marked samples to label on the x-axis: all of them if at most `most`, else `most` of
    them spread evenly along the axis (the marks nearest to evenly spaced positions), one of which
    is always the peak sample, so the labels do not overlap and the peak stays named."""
    marks = sorted(set(marks))
    if len(marks) <= most:
        return marks
    lo, hi = float(xs[marks[0]]), float(xs[marks[-1]])
    chosen = []
    for j in range(most):
        target = lo + (hi - lo) * j / (most - 1)
        free = [m for m in marks if m not in chosen]
        chosen.append(min(free, key=lambda m: abs(float(xs[m]) - target)))
    if peak_at not in chosen:  # the peak replaces the label nearest to it
        nearest = min(chosen, key=lambda m: abs(float(xs[m]) - float(xs[peak_at])))
        chosen[chosen.index(nearest)] = peak_at
    return sorted(chosen)


def _per_rank_bars(value):
    """-> list of (by_category, high_water or None), one per rank, from any accepted input."""
    if isinstance(value, (MemoryRecord, dict)):
        value = [value]
    bars = []
    for item in value:
        if isinstance(item, MemoryRecord):
            bars.append((item.peak_by_category, item.peak_total))
        elif item is not None:
            bars.append((item, None))
    return bars


def plot_memory_bars(named_records, theory=None, title=None, ax=None):
    """Peak bytes by category for several strategies side by side, one bar per rank.

    named_records: {strategy: results.memory | MemoryRecord | {category: bytes} | list of those}.
    theory: {strategy: bytes per rank} drawn as a dashed line over that strategy's bars, or
    {strategy: {category: bytes}} drawn as a hatched "theory" bar next to the measured ones.
    """
    use_course_style()
    theory = theory or {}
    own_figure = ax is None
    if own_figure:
        fig, ax = plt.subplots(figsize=(11, 5.5))
    fig = ax.figure
    groups = {name: _per_rank_bars(value) for name, value in named_records.items()}
    for name, value in theory.items():
        if isinstance(value, dict):
            groups.setdefault(name, []).append((value, "theory"))
    highest = max(
        [sum(b.values()) for bars in groups.values() for b, _ in bars]
        + [hw for bars in groups.values() for _, hw in bars if isinstance(hw, int)]
        + [v for v in theory.values() if not isinstance(v, dict)]
        + [1]
    )
    unit, scale = _unit_for(highest)
    position, ticks, tick_labels, used = 0.0, [], [], set()
    for name, bars in groups.items():
        start = position
        for rank, (by_category, high_water) in enumerate(bars):
            bottom = 0.0
            is_theory = high_water == "theory"
            for category in ALL_CATEGORIES:
                height = by_category.get(category, 0) / scale
                if height:
                    ax.bar(
                        position,
                        height,
                        bottom=bottom,
                        width=0.8,
                        color=MEMORY_COLORS.get(category, "#7f7f7f"),
                        hatch="//" if is_theory else None,
                        edgecolor="white" if is_theory else None,
                        label=category if category not in used else None,
                    )
                    used.add(category)
                    bottom += height
            if isinstance(high_water, int) and high_water > sum(by_category.values()):
                ax.plot(
                    [position - 0.4, position + 0.4],
                    [high_water / scale] * 2,
                    color="black",
                    linewidth=2,
                    label="high-water between samples" if "high-water" not in used else None,
                )
                used.add("high-water")
            ticks.append(position)
            tick_labels.append("theory" if is_theory else f"r{rank}")
            position += 1.0
        if name in theory and not isinstance(theory[name], dict):
            level = theory[name] / scale
            ax.plot([start - 0.5, position - 0.5], [level, level], color="black", linestyle="--", linewidth=2)
            ax.annotate(
                f"theory {fmt_bytes(theory[name])}",
                xy=(position - 0.5, level),
                xytext=(0, 4),
                textcoords="offset points",
                ha="right",
                fontsize=11,
                bbox=LABEL_BOX,
            )
        ax.annotate(
            name,
            xy=((start + position - 1) / 2, 0),
            xycoords=("data", "axes fraction"),
            xytext=(0, -34),
            textcoords="offset points",
            ha="center",
            fontsize=13,
            fontweight="bold",
        )
        position += 0.8  # gap between strategies
    ax.set_xticks(ticks, tick_labels)
    ax.set_ylabel(f"peak memory per rank ({unit})")
    ax.set_ylim(0, highest / scale * 1.15)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(title or "peak memory per rank: measured (solid) vs theory (dashed / hatched)")
    fig.tight_layout()
    return show_own(fig) if own_figure else fig
