"""Gantt chart of a run's compute and communication, one lane pair per rank.

    results = labkit.run(train, world_size=2)
    labkit.observe.timeline.plot_timeline(results.traces)

Per rank: a compute lane (orange spans; hatched black where the thread was blocked on a
collective) above a communication lane (one color per op, the same in every lab, labelled
"<op> <size> <busbw>" where the bar is wide enough). Concurrent collectives (async buckets) get
sub-rows; a collective that sent bytes across nodes (a simulated two-level network) is
cross-hatched. On the right: the rank's overlap % and exposed communication time (labkit.observe.trace_stats).

Left out: per-thread lanes (all of a rank's threads share its two lanes), and events shorter than
a pixel are drawn at a pixel's width rather than skipped, so dense runs look busier than they are.
"""

import collections

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from labkit.observe import trace_stats
from labkit.observe.style import BLOCKED_COLOR, COMPUTE_COLOR, op_color, show_own, use_course_style
from labkit.units import fmt_bytes

FIG_WIDTH_IN = 12.0
RANK_HEIGHT_IN = 1.5  # one rank's lane pair
TOP_IN, BOTTOM_IN = 0.6, 1.05
BAR_FONT_PT = 11
MAX_COMM_ROWS = 3
INTER_NODE_HATCH = "xx"  # a collective that sent bytes across nodes (labkit.launch.topology)


def _rank_offsets(traces):
    """Seconds to add to each rank's times so that all ranks share one zero.

    Same host: perf_counter is one clock for every process, so shift by the raw t0 and the ranks
    line up exactly. Several hosts: clocks are unrelated; keep each rank's zero (its barrier exit)."""
    if len({t.get("host") for t in traces}) == 1:
        zero = min(t["t0"] for t in traces)
        return [t["t0"] - zero for t in traces]
    return [0.0 for _ in traces]


def _top_level(spans):
    """Spans not inside another one (by time), in start order: the compute lane's bars."""
    top, cover_end = [], float("-inf")
    for sp in sorted(spans, key=lambda s: (s["start"], -s["end"])):
        if sp["start"] >= cover_end:
            top.append(sp)
            cover_end = sp["end"]
        else:
            cover_end = max(cover_end, sp["end"])
    return top


def _comm_rows(events):
    """Greedy sub-row per event so concurrent collectives don't hide each other."""
    row_ends, rows = [], []
    for ev in events:
        for i, end in enumerate(row_ends):
            if ev["start"] >= end:
                row_ends[i] = ev["end"]
                rows.append(i)
                break
        else:
            if len(row_ends) < MAX_COMM_ROWS:
                row_ends.append(ev["end"])
                rows.append(len(row_ends) - 1)
            else:  # more in flight than rows: share the last one
                row_ends[-1] = max(row_ends[-1], ev["end"])
                rows.append(MAX_COMM_ROWS - 1)
    return rows, max(1, len(row_ends))


def _bar_label(ev, visible_ms, points_per_ms):
    """The longest of the label variants that fits in the bar's visible part, or None."""
    ms = visible_ms
    size = fmt_bytes(ev["nbytes"])
    gbps = trace_stats.busbw(ev["op"], ev["nbytes"], ev["end"] - ev["start"], ev.get("world_size", 1))
    rate = f"{gbps:.2f} GB/s" if gbps >= 0.1 else f"{gbps * 1e3:.3g} MB/s"  # not "0.00 GB/s"
    variants = [f"{ev['op']} {size} {rate}", f"{size} {rate}", size]
    if ev["nbytes"] == 0:
        variants = [ev["op"]]
    for text in variants:
        if len(text) * BAR_FONT_PT * 0.6 + 6 <= ms * points_per_ms:
            return text
    return None


def _visible(start_ms, end_ms, view):
    """(center, width) of the part of [start_ms, end_ms] inside the view, for a label."""
    lo, hi = max(start_ms, view[0]), min(end_ms, view[1])
    return (lo + hi) / 2, max(0.0, hi - lo)


# What one figure's lanes share: the view (ms), the asked-for range, points per ms, what to label.
_Frame = collections.namedtuple("_Frame", "view t_range_ms points_per_ms show_labels show_inner")


def _draw_rank(ax, trace, offset, base_y, frame):
    """Compute lane at base_y + 1, communication lane at base_y (each 0.8 high); frame: the
    figure's _Frame (what is in view, its scale, what to label)."""
    view, t_range_ms, points_per_ms = frame.view, frame.t_range_ms, frame.points_per_ms
    show_labels, show_inner = frame.show_labels, frame.show_inner
    to_ms = lambda t: (t + offset) * 1e3  # noqa: E731
    compute = trace_stats.compute_spans(trace)
    top = _top_level(compute)
    ax.broken_barh(
        [(to_ms(s["start"]), (s["end"] - s["start"]) * 1e3) for s in top],
        (base_y + 0.6, 0.8),
        facecolors=COMPUTE_COLOR,
        edgecolor="white",
        linewidth=0.5,
    )
    if show_inner:
        inner = [s for s in compute if not any(s is t for t in top)]
        ax.broken_barh(
            [(to_ms(s["start"]), (s["end"] - s["start"]) * 1e3) for s in inner],
            (base_y + 0.6, 0.3),
            facecolors="#ffd29e",
            edgecolor=COMPUTE_COLOR,
            linewidth=0.5,
        )
    if show_labels:
        for s in top:
            center, width_ms = _visible(to_ms(s["start"]), to_ms(s["end"]), view)
            if len(s["name"]) * BAR_FONT_PT * 0.6 + 6 <= width_ms * points_per_ms:
                ax.text(
                    center,
                    base_y + 1.0,
                    s["name"],
                    ha="center",
                    va="center",
                    fontsize=BAR_FONT_PT,
                    clip_on=True,
                )
    blocked = trace_stats.union(trace_stats.blocked_intervals(trace))
    ax.broken_barh(
        [(to_ms(s), (e - s) * 1e3) for s, e in blocked],
        (base_y + 0.6, 0.8),
        facecolors="none",
        edgecolor=BLOCKED_COLOR,
        hatch="///",
        linewidth=0.8,
    )

    events = sorted(trace["events"], key=lambda ev: ev["start"])
    rows, n_rows = _comm_rows(events)
    row_h = 0.8 / n_rows
    for ev, row in zip(events, rows):
        y = base_y - 0.4 + (n_rows - 1 - row) * row_h
        ax.broken_barh(
            [(to_ms(ev["start"]), (ev["end"] - ev["start"]) * 1e3)],
            (y, row_h),
            facecolors=op_color(ev["op"]),
            edgecolor="white",
            linewidth=0.5,
            hatch=INTER_NODE_HATCH if ev.get("inter_bytes") else None,
        )
        center, width_ms = _visible(to_ms(ev["start"]), to_ms(ev["end"]), view)
        text = _bar_label(ev, width_ms, points_per_ms) if show_labels and row_h >= 0.4 else None
        if text:
            ax.text(
                center,
                y + row_h / 2,
                text,
                ha="center",
                va="center",
                fontsize=BAR_FONT_PT,
                color="white",
                clip_on=True,
            )
    for start, _end in trace_stats.steps(trace):  # step boundaries, when the lab marks them
        ax.plot(
            [to_ms(start)] * 2, [base_y - 0.45, base_y + 1.45], color="#444444", linestyle=":", linewidth=1.2
        )

    t_range_s = None if t_range_ms is None else (t_range_ms[0] / 1e3 - offset, t_range_ms[1] / 1e3 - offset)
    stats = trace_stats.overlap_stats(trace, t_range=t_range_s)
    pct = "–" if stats["overlap_pct"] is None else f"{stats['overlap_pct']:.0f}%"
    ax.text(
        1.01,
        base_y + 0.5,
        f"overlap {pct}\nexposed {stats['exposed_s'] * 1e3:.1f} ms",
        transform=ax.get_yaxis_transform(),
        va="center",
        ha="left",
        fontsize=12,
    )


def plot_timeline(traces, title=None, t_range=None, show_labels=True, ax=None, show_inner=False):
    """Draw the ranks' traces (results.traces, or one trace) as a Gantt chart; returns the figure.

    t_range=(lo, hi) in milliseconds, as read off the axis, zooms in (and restricts the per-rank
    overlap figures to that window). show_inner also draws nested spans, thinner, in the
    compute lane."""
    use_course_style()
    if isinstance(traces, dict):
        traces = [traces]
    traces = [t for t in traces if t is not None]
    if not traces:
        raise ValueError("no traces to plot: was the run recorded (labkit.run returns results.traces)?")
    traces = sorted(traces, key=lambda t: t["rank"])
    offsets = _rank_offsets(traces)
    n = len(traces)
    own_figure = ax is None
    if own_figure:
        # Fixed inches for title, axis label and legend, so they never crowd a few ranks' lanes.
        height = TOP_IN + BOTTOM_IN + RANK_HEIGHT_IN * n
        fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, height))
        fig.subplots_adjust(left=0.13, right=0.83, top=1 - TOP_IN / height, bottom=BOTTOM_IN / height)
    fig = ax.figure

    if t_range is None:
        ends = [(ev["end"] + off) * 1e3 for t, off in zip(traces, offsets) for ev in t["events"]]
        ends += [(sp["end"] + off) * 1e3 for t, off in zip(traces, offsets) for sp in t["spans"]]
        starts = [(ev["start"] + off) * 1e3 for t, off in zip(traces, offsets) for ev in t["events"]]
        starts += [(sp["start"] + off) * 1e3 for t, off in zip(traces, offsets) for sp in t["spans"]]
        lo, hi = (min(starts), max(ends)) if starts else (0.0, 1.0)
        pad = 0.01 * max(hi - lo, 1e-3)
        view = (lo - pad, hi + pad)
    else:
        view = tuple(t_range)
    axes_width_pt = ax.get_position().width * fig.get_figwidth() * 72
    points_per_ms = axes_width_pt / max(view[1] - view[0], 1e-9)

    frame = _Frame(view, t_range, points_per_ms, show_labels, show_inner)
    yticks, ylabels = [], []
    for i, (trace, offset) in enumerate(zip(traces, offsets)):
        base_y = (n - 1 - i) * 2.5  # rank 0 on top
        _draw_rank(ax, trace, offset, base_y, frame)
        yticks += [base_y + 1, base_y]
        ylabels += [f"rank {trace['rank']} compute", "comm"]
    ax.set_yticks(yticks, ylabels)
    ax.set_ylim(-0.7, (n - 1) * 2.5 + 1.7)
    ax.set_xlim(*view)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title)

    ops = sorted({ev["op"] for t in traces for ev in t["events"]})
    handles = [Patch(facecolor=COMPUTE_COLOR, label="compute")]
    handles += [Patch(facecolor="none", edgecolor=BLOCKED_COLOR, hatch="///", label="blocked")]
    handles += [Patch(facecolor=op_color(op), label=op) for op in ops]
    if any(ev.get("inter_bytes") for t in traces if t for ev in t["events"]):
        handles += [
            Patch(facecolor="white", edgecolor="#444444", hatch=INTER_NODE_HATCH, label="sent across nodes")
        ]
    ncol = min(len(handles), 6)
    if own_figure:
        fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.48, 0.0), ncol=ncol, frameon=False)
    else:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=ncol, frameon=False)
    return show_own(fig) if own_figure else fig
