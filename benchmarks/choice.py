"""The layout cost model against published runs, and its search: pure arithmetic, no launch.

    .venv/bin/python benchmarks/choice.py            # two tables
    .venv/bin/python benchmarks/choice.py --json     # the same numbers as JSON (stdout: the JSON alone)

Keys:
  anchors   per published row (labkit/costmodel/published.py, sources in docs/published_runs.md):
            published and modelled TFLOP/s per GPU, their ratio, what the figure counts ("hw":
            Megatron-LM's, the recomputed forward included; "model": MFU's), whether the row
            calibrated its GPU's matmul efficiency (one row per GPU type), the layout, bubble, memory
  search    per row: costmodel.search's top three (layout, micro-batch, step over the published
            layout's modelled step), where the published layout ranks among the layouts that fit,
            how many fit, and whether a top-three step is within 10% of the published one's
  band      published.error_band(): the largest step-time miss on a row not calibrated on
  choices   per pp_lab situation (labs.pp_choice.choose): the fastest family, the verdict, the
            families tied with the fastest (within the band) and what broke the tie
  load      the 1-minute load average (labkit.checks.load_report): nothing here is timed, the
            line says what else the machine was doing
Left out: everything the cost model leaves out (labkit/costmodel/layout.py's docstring).
"""

import argparse
import json

from labkit.checks import load_line, load_report
from labkit.costmodel import published
from labkit.costmodel.layout_search import rank_of
from labkit.labs import pp_choice

SHOWN = ("dp", "tp", "pp", "cp", "v", "zero", "reshard", "recompute")


def _short(row: dict) -> dict:
    lay = row["layout"]
    return {k: lay[k] for k in SHOWN if not (k == "reshard" and lay["zero"] < 3)}


def bench() -> dict:
    anchors = published.table()
    searched = {}
    for name, anchor in published.ANCHORS.items():
        rows = anchor.search()
        step = anchor.step()["step_s"]
        top = [{"layout": _short(r), "micro_batch": r["micro_batch"], "step_over_published": r["step_s"] / step}
               for r in rows[:3]]  # fmt: skip
        searched[name] = {
            "top3": top,
            "published_rank": rank_of(rows, anchor.layout, anchor.micro_batch),
            "fitting_layouts": len(rows),
            "top3_within_10pct": any(abs(t["step_over_published"] - 1) <= 0.10 for t in top),
        }
    choices = {
        situation: {
            "fastest": pp_choice.family(c["fastest"]["layout"]),
            "verdict": pp_choice.family(c["verdict"]["layout"]),
            "verdict_step_over_fastest": c["verdict"]["step_s"] / c["fastest"]["step_s"],
            "tied": list(c["tied"]),
            "broken_by": c["broken_by"],
        }
        for situation, c in pp_choice.choices().items()
    }
    return {
        "anchors": anchors,
        "search": searched,
        "band": published.error_band(anchors),
        "choices": choices,
        "load": load_report(1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    row = bench()
    if args.json:
        print(json.dumps(row, indent=2))
        return
    print(f"{'published run':48s} {'published':>9s} {'modelled':>9s} {'ratio':>6s}")
    for a in row["anchors"]:
        mark = "  (calibration)" if a["calibrated"] else ""
        print(
            f"{a['name']:48s} {a['published_tflops']:9.0f} {a['modelled_tflops']:9.1f} {a['ratio']:6.3f}{mark}"
        )
    print("\nsearch: the published layout's rank, and the top three (step over the published layout's)")
    for name, s in row["search"].items():
        tops = "; ".join(
            f"{t['layout']} mb {t['micro_batch']}: {t['step_over_published']:.3f}" for t in s["top3"]
        )
        print(
            f"{name}: rank {s['published_rank']} of {s['fitting_layouts']}, within 10%: {s['top3_within_10pct']}"
        )
        print(f"    {tops}")
    print(f"\nthe model's error band: {row['band']:.1%} of a step; pp_lab's situations read with it")
    for situation, c in row["choices"].items():
        print(
            f"{situation}: fastest {c['fastest']}, verdict {c['verdict']} "
            f"({c['verdict_step_over_fastest']:.3f}x, {len(c['tied'])} tied, broken by {c['broken_by']})"
        )
    print(load_line(row["load"]))


if __name__ == "__main__":
    main()
