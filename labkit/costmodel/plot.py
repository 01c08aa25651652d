"""The notebook side of the cost model: figures, the published checks, and a 'what if' widget.

Figures are plain `matplotlib.figure.Figure` objects (no pyplot state), so they render the same
in a notebook, in a test under Agg, or into PNG bytes for the widget. What this leaves out: the
published numbers are hard-coded anchors (the ZeRO and FSDP papers), not re-derived here.
"""

from __future__ import annotations

import io
from collections import defaultdict

from matplotlib.figure import Figure

from labkit import costmodel as cm
from labkit.costmodel import links
from labkit.observe.style import BLOCKED_COLOR, COMPUTE_COLOR, MEMORY_COLORS, OP_COLORS, use_course_style

# Published anchors: Rajbhandari et al. 2020 (ZeRO), Zhao et al. 2023 (PyTorch FSDP).
# (the ZeRO paper's table is labkit.costmodel.ZERO_TABLE_GB)
FSDP_175B_TFLOPS_BAND = (173.0, 186.0)  # FSDP paper, A100, 128-512 GPUs

# Recorded constants, not measured in this run: gloo at 64 MiB on the course's 2-core x86 CI machine
# (torch 2.13 CPU), November 2026.
GLOO_64MIB_TIMES_S = {"all_reduce": 0.043, "reduce_scatter": 0.081, "all_gather": 0.089}
GLOO_4RANK_BUSBW_64MIB = 0.84e9

STRATEGY_STYLE = {"ddp": ("-", "o"), "zero1": ("--", "s"), "zero2": ("-.", "^"), "fsdp": (":", "D")}
STRATEGY_LABEL = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "FSDP"}


def zero_table(model_params=7.5e9, n=64):
    """{strategy: bytes by category} for the ZeRO paper's table (model states only)."""
    return {s: cm.memory_per_rank(model_params, n, cm.STAGE[s]) for s in cm.STRATEGIES}


def fsdp_paper_check(ns=(128, 256, 512), batches=(1, 2), link=links.DGX_A100_IB200, hw=cm.A100):
    """Predicted GPT-175B FSDP throughput on the FSDP paper's setting, one row per (n, batch).

    Assumptions: seq 2048, batch = sequences per GPU, activation checkpointing on (without it
    175B at batch 1 does not fit in 80 GB), 8 A100s per node on NVLink, one 200 Gb/s NIC per GPU.
    `hw_tflops` counts the recomputed forward, which we read the paper's number as doing.
    """
    rows = []
    for batch in batches:
        for n in ns:
            r = cm.step_time(
                cm.GPT_175B,
                n,
                "fsdp",
                link,
                hw,
                global_batch_tokens=n * 2048 * batch,
                activation_checkpointing=True,
            )
            rows.append(
                {
                    "n": n,
                    "batch": batch,
                    "hw_tflops": r["hw_tflops_per_gpu"],
                    "model_tflops": r["tflops_per_gpu"],
                    "exposed_fraction": r["exposed_comm_s"] / r["step_s"],
                    "memory_gb": r["memory_total"] / cm.GB,
                    "fits": r["fits"],
                }
            )
    return rows


def disagreements(link=None):
    """Where the alpha-beta model and the course's own gloo measurements part ways.

    Rows of (what, model, measured, why). The model is calibrated on 2-rank all_reduce only.
    """
    link = link or links.gloo_link()
    m = {op: links.collective_time(op, 2, 64 * 2**20, link) for op in GLOO_64MIB_TIMES_S}
    g = GLOO_64MIB_TIMES_S
    return [
        (
            "all_reduce 64 MiB, 2 ranks (ms)",
            1e3 * m["all_reduce"],
            1e3 * g["all_reduce"],
            "the calibration point: these should agree",
        ),
        (
            "reduce_scatter 64 MiB, 2 ranks (ms)",
            1e3 * m["reduce_scatter"],
            1e3 * g["reduce_scatter"],
            "gloo runs reduce-scatter as a full all-reduce",
        ),
        (
            "all_gather 64 MiB, 2 ranks (ms)",
            1e3 * m["all_gather"],
            1e3 * g["all_gather"],
            "gloo's all_gather is not a bandwidth-optimal ring",
        ),
        (
            "FSDP / DDP communication per step",
            (2 * m["all_gather"] + m["reduce_scatter"]) / m["all_reduce"],
            (2 * g["all_gather"] + g["reduce_scatter"]) / g["all_reduce"],
            "3 Psi vs 2 Psi in theory; gloo's slow RS/AG make it far worse",
        ),
        (
            "all_reduce busbw 64 MiB, 4 ranks (GB/s)",
            link.busbw_Bps / cm.GB,
            GLOO_4RANK_BUSBW_64MIB / cm.GB,
            "4 ranks share 2 cores: contention the model leaves out",
        ),
    ]


def plot_scaling(rows, band=None, title=None):
    """TFLOPS per GPU and exposed-communication share vs number of GPUs, one line per
    (model, strategy). Configurations that do not fit in memory are drawn as crosses.
    band: optional (low, high) TFLOPS range to shade, e.g. FSDP_175B_TFLOPS_BAND."""
    use_course_style()
    fig = Figure(figsize=(13, 5), layout="constrained")
    ax_tf, ax_exp = fig.subplots(1, 2)
    groups = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["strategy"])].append(r)
    model_names = list(dict.fromkeys(r["model"] for r in rows))
    palette = ["#17becf", "#e377c2", "#8c564b", "#bcbd22", "#7f7f7f", "#1f77b4"]
    for (model, strategy), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["n"])
        color = palette[model_names.index(model) % len(palette)]
        style, marker = STRATEGY_STYLE[strategy]
        ns = [r["n"] for r in rs]
        label = f"{model}, {STRATEGY_LABEL[strategy]}"
        ax_tf.plot(ns, [r["tflops_per_gpu"] for r in rs], style, color=color, lw=2, label=label)
        ax_exp.plot(ns, [100 * r["exposed_comm_s"] / r["step_s"] for r in rs], style, color=color, lw=2)
        for ax, key in ((ax_tf, "tflops"), (ax_exp, "exposed")):
            for r in rs:
                y = r["tflops_per_gpu"] if key == "tflops" else 100 * r["exposed_comm_s"] / r["step_s"]
                ax.plot(
                    r["n"],
                    y,
                    marker if r["fits"] else "x",
                    color=color,
                    ms=8,
                    mfc=color if r["fits"] else "none",
                )
    if band:
        ax_tf.axhspan(*band, color="grey", alpha=0.25, label="published band")
    for ax in (ax_tf, ax_exp):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (x: does not fit in memory)")
        ax.grid(alpha=0.3)
    ax_tf.set_ylabel("model TFLOPS per GPU")
    ax_tf.set_ylim(bottom=0)
    ax_exp.set_ylabel("exposed communication (% of step)")
    ax_exp.set_ylim(0, 100)
    ax_tf.legend(loc="lower left", fontsize=9)
    fig.suptitle(title or f"Predicted scaling on {rows[0]['link']}, {rows[0]['hw']}")
    return fig


def plot_memory_stack(memories, capacity_bytes=None, title=None, ax=None, annotate=True):
    """Stacked bars of per-rank memory by category (course memory colors).

    memories: {label: {category: bytes}}, e.g. zero_table() or {s: step_time(...)["memory"]}.
    """
    use_course_style()
    fig = None
    if ax is None:
        fig = Figure(figsize=(8, 5), layout="constrained")
        ax = fig.subplots()
    labels = list(memories)
    categories = [c for c in MEMORY_COLORS if any(m.get(c, 0) > 0 for m in memories.values())]
    bottoms = [0.0] * len(labels)
    for cat in categories:
        heights = [memories[lab].get(cat, 0.0) / cm.GB for lab in labels]
        ax.bar(
            [STRATEGY_LABEL.get(lab, lab) for lab in labels],
            heights,
            bottom=bottoms,
            color=MEMORY_COLORS[cat],
            label=cat,
        )
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if annotate:
        for i, total in enumerate(bottoms):
            ax.annotate(
                f"{total:.1f} GB",
                (i, total),
                ha="center",
                va="bottom",
                xytext=(0, 3),
                textcoords="offset points",
            )
    if capacity_bytes:
        ax.axhline(
            capacity_bytes / cm.GB,
            color="black",
            ls="--",
            lw=1.5,
            label=f"GPU memory {capacity_bytes / cm.GB:.0f} GB",
        )
    ax.set_ylabel("memory per rank (GB = 1e9 B)")
    ax.set_ylim(0, max(bottoms + [capacity_bytes / cm.GB if capacity_bytes else 0]) * 1.15)
    ax.legend(fontsize=10)
    ax.set_title(title or "Memory per rank")
    return fig if fig is not None else ax.figure


def plot_step_breakdown(results, ax=None, title=None):
    """One bar pair per step_time result: the step (compute, optimizer, exposed communication)
    and, beneath it, all communication by op -- the part not exposed was hidden by overlap."""
    use_course_style()
    fig = None
    if ax is None:
        fig = Figure(figsize=(9, 4.5), layout="constrained")
        ax = fig.subplots()
    labelled_ops = set()
    for i, r in enumerate(results):
        y = len(results) - 1 - i
        left = 0.0
        for width, color, hatch, label in (
            (r["compute_s"], COMPUTE_COLOR, None, "compute"),
            (r["optimizer_s"], MEMORY_COLORS["optimizer"], None, "optimizer step"),
            (r["exposed_comm_s"], "white", "//", "exposed communication"),
        ):
            ax.barh(
                y + 0.15,
                width,
                left=left,
                height=0.4,
                color=color,
                hatch=hatch,
                edgecolor=BLOCKED_COLOR if hatch else color,
                label=label if i == 0 else None,
            )
            left += width
        left = 0.0
        for op, t in r["comm_s"].items():
            first = t > 0 and op not in labelled_ops
            labelled_ops.add(op) if first else None
            ax.barh(
                y - 0.25,
                t,
                left=left,
                height=0.25,
                color=OP_COLORS[op],
                label=f"{op} (incl. hidden)" if first else None,
            )
            left += t
    ax.set_yticks(range(len(results)))
    ax.set_yticklabels([f"{STRATEGY_LABEL[r['strategy']]}, n={r['n']}" for r in reversed(results)])
    ax.set_xlabel("seconds per step")
    ax.legend(fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    ax.set_title(title or "Where the step goes")
    return fig if fig is not None else ax.figure


def _figure_png(fig):
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def what_if_widget(model_name="GPT 13B", n=64, strategy="fsdp", link_name=None, mfu=None):
    """Sliders for model, N, strategy, link, hardware, MFU and checkpointing; redraws a step
    breakdown and memory stack for all four strategies (the chosen one is summarized).

    The picture is an ipywidgets.Image of PNG bytes, so building it needs no frontend."""
    import ipywidgets as w

    options = links.LINKS
    hws = {cm.A100.name: cm.A100, cm.H100.name: cm.H100}
    controls = {
        "model": w.Dropdown(options=list(cm.MODELS), value=model_name, description="model"),
        "n": w.SelectionSlider(options=[2**k for k in range(3, 11)], value=n, description="GPUs"),
        "strategy": w.Dropdown(options=list(cm.STRATEGIES), value=strategy, description="strategy"),
        "link": w.Dropdown(
            options=list(options),
            value=link_name or links.DGX_A100_IB200.name,
            description="link",
            layout=w.Layout(width="420px"),
        ),
        "hw": w.Dropdown(options=list(hws), value=cm.A100.name, description="GPU"),
        "mfu": w.FloatSlider(value=mfu or cm.A100.mfu, min=0.1, max=0.9, step=0.05, description="MFU"),
        "ckpt": w.Checkbox(value=False, description="activation checkpointing"),
    }
    image, summary = w.Image(format="png"), w.HTML()

    def redraw(_change=None):
        model, nranks = cm.MODELS[controls["model"].value], controls["n"].value
        hw = cm.with_mfu(hws[controls["hw"].value], controls["mfu"].value)
        link = options[controls["link"].value]
        results = [
            cm.step_time(model, nranks, s, link, hw, activation_checkpointing=controls["ckpt"].value)
            for s in cm.STRATEGIES
        ]
        use_course_style()
        fig = Figure(figsize=(15, 5), layout="constrained")
        ax_step, ax_mem = fig.subplots(1, 2, width_ratios=[3, 2])
        plot_step_breakdown(results, ax=ax_step, title=f"{model.name} on {nranks} x {hw.name}")
        plot_memory_stack(
            {r["strategy"]: r["memory"] for r in results},
            capacity_bytes=hw.memory_bytes,
            ax=ax_mem,
            title="Memory per rank",
        )
        image.value = _figure_png(fig)
        r = results[cm.STRATEGIES.index(controls["strategy"].value)]
        summary.value = (
            f"<b>{STRATEGY_LABEL[r['strategy']]}</b>: step {r['step_s']:.3f} s, "
            f"{r['tflops_per_gpu']:.0f} model TFLOPS/GPU, exposed communication "
            f"{r['exposed_comm_s']:.3f} s of {r['comm_total_s']:.3f} s, memory "
            f"{r['memory_total'] / cm.GB:.1f} GB {'(fits)' if r['fits'] else '(<b>does not fit</b>)'}"
        )

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return w.VBox(
        [
            w.HBox([controls["model"], controls["n"], controls["strategy"]]),
            w.HBox([controls["link"], controls["hw"], controls["mfu"]]),
            controls["ckpt"],
            summary,
            image,
        ]
    )
