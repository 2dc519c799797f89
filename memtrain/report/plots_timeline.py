"""A sweep's memory timelines (`trainer.memory_timeline=true`): one panel per setting, a shared
y-axis (small multiples), the baseline's peak as a reference line in every panel of its model.

Input is the per-run table (`Report.runs`): the first seed of each setting that wrote a timeline
is drawn (`memory_timeline`, relative to its `run_dir`); the figure's data frame holds each
panel's peak, which equals the row's `mem_timeline_peak_bytes`.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from memtrain import timeline
from memtrain.report.draw import Plot
from memtrain.report.names import DEFAULT as DEFAULT_NAMES
from memtrain.report.names import Names
from memtrain.report.style import order_settings

COL = "memory_timeline"


def _timelines(runs: pd.DataFrame) -> list[tuple[pd.Series, pd.DataFrame]]:
    if COL not in runs:
        return []
    have = runs[runs[COL].notna() & (runs[COL].astype(str) != "")]
    if "seed" in have:
        have = have.sort_values("seed", kind="stable")
    out = []
    for _, r in order_settings(have.drop_duplicates("label")).iterrows():
        path = Path(r["run_dir"]) / str(r[COL])
        if path.is_file():
            out.append((r, pd.read_parquet(path)))
    return out


def timelines(runs: pd.DataFrame, baseline: str = "none",
              names: Names = DEFAULT_NAMES) -> Plot | None:
    """Small multiples of the runs' step timelines, or None when no run recorded one."""
    found = _timelines(runs)
    if not found:
        return None
    top = max(timeline.peak(df)["bytes"] for _, df in found)
    unit = timeline.unit_of(top)
    base = {}  # (model, dataset) -> the baseline's timeline peak
    for r, df in found:
        if r.get("method") == baseline:
            base.setdefault((r.get("model"), r.get("dataset")), timeline.peak(df)["bytes"])
    n = len(found)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.4 * rows), sharey=True,
                             squeeze=False, layout="constrained")
    drawn = []
    for i, (ax, (r, df)) in enumerate(zip(axes.flat, found)):
        title = f"{r['label']} ({names.panel(r.get('model'), r.get('dataset'))})"
        p = timeline.draw(ax, df, unit, legend=False, title=title)
        ref = base.get((r.get("model"), r.get("dataset")))
        if ref is not None:
            ax.axhline(ref / unit[1], color="k", lw=0.8, ls="--", zorder=5)
            ax.annotate(f"{baseline} peak", (0, ref / unit[1]),
                        xycoords=("axes fraction", "data"), xytext=(2, 2),
                        textcoords="offset points", fontsize="xx-small")
        if i % cols:
            ax.set_ylabel("")
        drawn.append({"panel": title, "label": r["label"], "run_dir": r["run_dir"],
                      "peak_bytes": p["bytes"], "peak_phase": p["phase"],
                      "peak_module": p["module"], "baseline_peak_bytes": ref,
                      "events": int(df["event"].nunique())})
    handles: dict = {}
    for ax in axes.flat[:n]:  # every category any panel drew, once, under the panels
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values())[::-1], list(handles)[::-1], loc="outside lower center",
               ncol=4, fontsize="x-small", frameon=False,
               title="shaded: forward (white), backward (blue), optimizer (violet)",
               title_fontsize="x-small")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    for ax in axes.flat:
        ax.set_ylim(0, top / unit[1] * 1.15)
    return Plot("timeline", fig, pd.DataFrame(drawn))
