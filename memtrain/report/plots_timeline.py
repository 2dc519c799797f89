"""A sweep's step anatomy (`trainer.memory_timeline=true`): what each run recorded beside itself
(timeline.parquet, saved_by_module.csv, plan.csv), set side by side.

- `timelines`: one timeline panel per setting on a shared y-axis (small multiples), the
  baseline's peak as a dashed line in every panel of its model; the x-axis is the fraction of
  each step's events, so a step of 600 ops and one of 30,000 (quantize) compare.
- `layers`: per model, the baseline's 12 modules that save most for backward, each as a group
  of bars, one per setting: which layers a method actually shrinks. A module a checkpoint plan
  recomputes is drawn hatched at the baseline's length behind the bytes the run kept.
- `anatomy`: per checkpoint setting, its step's timeline with each recomputed group marked
  where backward runs it again, over its segments' saved bytes against the baseline's, each
  segment kept or recomputed as the plan says (plan.csv).
- `module_tables`: the per-module tables of report.md (memtrain.memory.by_module.compare).

Input is the per-run table (`Report.runs`): the first seed of each setting that wrote the
files is read (paths relative to its `run_dir`). Each figure's data frame is what was drawn.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.patches import Patch

from memtrain.memory import by_module, timeline
from memtrain.report import style
from memtrain.report.draw import Plot
from memtrain.report.names import DEFAULT as DEFAULT_NAMES
from memtrain.report.names import Names
from memtrain.report.style import order_settings, setting_styles

COL = "memory_timeline"
HATCH = "////"


def _first(runs: pd.DataFrame, col: str) -> pd.DataFrame:
    """The first seed of each setting whose `col` file exists, in the display order."""
    if col not in runs:
        return runs.iloc[0:0]
    have = runs[runs[col].notna() & (runs[col].astype(str) != "")]
    if "seed" in have:
        have = have.sort_values("seed", kind="stable")
    have = have.drop_duplicates("label")
    ok = [(Path(r["run_dir"]) / str(r[col])).is_file() for _, r in have.iterrows()]
    return order_settings(have[ok]) if len(have) else have


def _timelines(runs: pd.DataFrame) -> list[tuple[pd.Series, pd.DataFrame]]:
    """(row, its timeline in `timeline.wide` form) of each setting's first seed."""
    return [(r, _read_wide(r)) for _, r in _first(runs, COL).iterrows()]


def _read_wide(r: pd.Series) -> pd.DataFrame:
    return timeline.wide(pd.read_parquet(Path(r["run_dir"]) / str(r[COL])))


def _baseline_peaks(found, baseline: str) -> dict:
    base = {}  # (model, dataset) -> the baseline's timeline peak
    for r, df in found:
        if r.get("method") == baseline:
            base.setdefault((r.get("model"), r.get("dataset")), timeline.peak(df)["bytes"])
    return base


def _ref_line(ax, ref: float | None, unit: tuple[str, float]):
    if ref is not None:
        ax.axhline(ref / unit[1], color="k", lw=style.line_width(0.7), ls="--", zorder=5)


def _legend(fig, axes, baseline: str, ncol: int = 4, extra: tuple = ()) -> None:
    """Every category any panel drew, the phases' shades, the baseline's peak: once, under the
    panels."""
    handles: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    order = [timeline.LABELS[c] for c in timeline.CATEGORIES[::-1]]
    labs = [lb for lb in order if lb in handles] + [lb for lb in handles if lb not in order]
    hs = [handles[lb] for lb in labs]
    hs += [Patch(facecolor=timeline.PHASE_SHADE[p], edgecolor="#999999", lw=0.3)
           for p in timeline.PHASES]
    labs += [f"{p} (shade)" for p in timeline.PHASES]
    hs.append(plt.Line2D([], [], color="k", ls="--", lw=style.line_width(0.7)))
    labs.append(f"{baseline}'s peak")
    for h, lb in extra:
        hs.append(h)
        labs.append(lb)
    fig.legend(hs, labs, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol,
               frameon=False, fontsize="small", handlelength=1.2, columnspacing=1.0)


@style.styled
def timelines(runs: pd.DataFrame, baseline: str = "none",
              names: Names = DEFAULT_NAMES) -> Plot | None:
    """Small multiples of the runs' step timelines, or None when no run recorded one."""
    found = _timelines(runs)
    if not found:
        return None
    top = max(timeline.peak(df)["bytes"] for _, df in found)
    unit = timeline.unit_of(top)
    base = _baseline_peaks(found, baseline)
    several = len({(r.get("model"), r.get("dataset")) for r, _ in found}) > 1
    n = len(found)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    look = style.current()
    fig, axes = plt.subplots(rows, cols, figsize=(look.panel_w * cols, look.panel_h * rows),
                             sharey=True, squeeze=False)
    drawn = []
    for i, (ax, (r, df)) in enumerate(zip(axes.flat, found)):
        title = str(r["label"]) + (f" ({names.panel(r.get('model'), r.get('dataset'))})"
                                   if several else "")
        src = str(r.get("mem_timeline_source") or "tracker")
        p = timeline.draw(ax, df, unit, legend=False, title=title, source=src)
        ref = base.get((r.get("model"), r.get("dataset")))
        _ref_line(ax, ref, unit)
        if i % cols:
            ax.set_ylabel("")
        if i < n - cols:
            ax.set_xlabel("")
        drawn.append({"panel": title, "label": r["label"], "run_dir": r["run_dir"],
                      "peak_bytes": p["bytes"], "peak_phase": p["phase"],
                      "peak_module": p["module"], "baseline_peak_bytes": ref,
                      "events": int(df["event"].nunique()),
                      "recomputed_events": int(df["recompute"].sum())})
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    for ax in axes.flat:
        ax.set_ylim(0, top / unit[1] * 1.1)
    fig.tight_layout(pad=0.3, h_pad=1.0, w_pad=0.8)
    if not several:
        fig.suptitle(names.panel(found[0][0].get("model"), found[0][0].get("dataset"))
                     + ": one training step", y=1.02, fontsize="medium")
    _legend(fig, list(axes.flat)[:n], baseline)
    return Plot("timeline", fig, pd.DataFrame(drawn))


# ---------------------------------------------------------------- where the activations live


def _saved_runs(runs: pd.DataFrame, baseline: str) -> list[tuple[tuple, pd.Series,
                                                               list[pd.Series]]]:
    """Per model and dataset with a baseline run that recorded its modules: (key, the baseline's
    row, the other settings' rows), each the first seed of its setting."""
    have = _first(runs, "saved_by_module")
    out = []
    for key, g in have.groupby(["model", "dataset"], sort=True):
        base = g[g["method"] == baseline]
        if len(base):
            b = base.iloc[0]
            out.append((key, b, [r for _, r in g.iterrows() if r["label"] != b["label"]]))
    return out


def _plan(r: pd.Series) -> pd.DataFrame | None:
    path = r.get("plan_table")
    if path is None or pd.isna(path) or not str(path):
        return None
    return by_module.read(r["run_dir"], path)


def module_tables(runs: pd.DataFrame, baseline: str = "none"
                  ) -> dict[tuple, tuple[pd.DataFrame, dict[str, list[str]]]]:
    """Per (model, dataset): the per-module table (`by_module.compare`, one column per setting's
    label, the baseline's first) and, for each setting with a plan (checkpoint), its decision
    per row ('kept', 'recomputed (group 2-4)')."""
    out = {}
    for key, b, others in _saved_runs(runs, baseline):
        t = by_module.compare(by_module.read(b["run_dir"], b["saved_by_module"]),
                              [(str(r["label"]), by_module.read(r["run_dir"], r["saved_by_module"]))
                               for r in others])
        t = t.rename(columns={"baseline": str(b["label"])})
        plans = {}
        for r in others:
            plan = _plan(r)
            if plan is not None:
                plans[str(r["label"])] = [by_module.decision(m, plan) for m in t.index[:-2]] + \
                    ["", ""]
        out[key] = (t, plans)
    return out


@style.styled
def layers_figure(runs: pd.DataFrame, baseline: str = "none",
                  names: Names = DEFAULT_NAMES) -> Plot | None:
    """Grouped horizontal bars per module (the baseline's largest savers), one bar per setting;
    a module a checkpoint plan recomputes drawn hatched at the baseline's length (what it would
    have saved) behind what the run kept. None without a baseline that recorded its modules."""
    tables = module_tables(runs, baseline)
    if not tables:
        return None
    firsts = _first(runs, "saved_by_module")
    styles = setting_styles(firsts)
    look = style.current()
    panels = list(tables.items())
    heights = [len(t) - 2 for (t, _) in (v for _, v in panels)]
    nbars = max(len(t.columns) for (t, _) in (v for _, v in panels))
    row_h = 0.075 * nbars + 0.06
    fig, axes = plt.subplots(len(panels), 1, squeeze=False, figsize=(
        look.panel_w * 1.4, sum(h * row_h + 0.8 for h in heights)))
    drawn = []
    planned = False
    for ax, ((model, dataset), (t, plans)) in zip(axes.flat, panels):
        body = t.iloc[:-2]
        div, unit = style.byte_unit(pd.Series(body.to_numpy().ravel()))
        labels = list(t.columns)
        k = len(labels)
        h = 0.8 / k
        ys = list(range(len(body)))[::-1]  # the largest at the top
        right = body.to_numpy().max() / div
        for j, lb in enumerate(labels):
            off = (k - 1) / 2 * h - j * h
            color = styles.get(lb, {"color": "#777777"})["color"]
            ax.barh([y + off for y in ys], body[lb] / div, height=h * 0.9, color=color,
                    label=lb, zorder=2)
            said = plans.get(lb, [""] * len(body))
            for y, v, d in zip(ys, body[lb] / div, said):  # what the plan does there
                if d:
                    planned = True
                    short = "recomputed " + d.split("(group ")[1].split(")")[0] \
                        if d.startswith("recomputed") else "kept"
                    ax.text(v + right * 0.01, y + off, short, va="center", ha="left",
                            fontsize=style.current().rc["font.size"] * 0.6, color=color)
            drawn += [{"panel": names.panel(model, dataset), "module": m, "label": lb,
                       "bytes": int(body[lb].iloc[i]), "decision": said[i]}
                      for i, m in enumerate(body.index)]
        ax.set_yticks(ys, list(body.index), fontsize="small")
        ax.set_xlim(0, right * 1.15)
        ax.grid(axis="y", visible=False)
        ax.set_xlabel(f"saved for backward on the accounting step, {unit}")
        ax.set_title(f"{names.panel(model, dataset)}: the {len(body)} modules that save most "
                     f"in {labels[0]}", fontsize="small")
    fig.tight_layout(pad=0.3, h_pad=1.0)
    extra = ((Patch(visible=False), "beside a plan's bar: its segment kept, or recomputed "
                                    "in backward as group a-b"),) if planned else ()
    style.shared_legend(fig, {lb: {**st, "marker": "s"} for lb, st in styles.items()},
                        list(firsts["label"]), extra)
    return Plot("layers", fig, pd.DataFrame(drawn))


# ---------------------------------------------------------------- a checkpoint step's anatomy


def _segment_bytes(saved: pd.DataFrame, plan: pd.DataFrame) -> list[int]:
    """Saved bytes per plan segment (modules gathered onto the segments' module names)."""
    per = by_module.per_module(saved)
    out = [0] * len(plan)
    for m, v in per.items():
        s = by_module.segment_of(m, plan)
        if s is not None:
            out[s] += int(v)
    return out


@style.styled
def anatomy(runs: pd.DataFrame, baseline: str = "none",
            names: Names = DEFAULT_NAMES) -> Plot | None:
    """Per checkpoint setting with a plan and a timeline: its step's timeline, each recomputed
    group named where backward runs its forward again, over its segments' saved bytes against
    the baseline's, kept segments solid and recomputed ones hatched (a group's op count kept by
    selective checkpointing under the bar). None without such a setting."""
    firsts = _first(runs, "plan_table")
    firsts = firsts[firsts[COL].notna()] if COL in firsts else firsts.iloc[0:0]
    if not len(firsts):
        return None
    found = _timelines(runs)
    base_tl = _baseline_peaks(found, baseline)
    bases = {k: b for k, b, _ in _saved_runs(runs, baseline)}
    styles = setting_styles(_first(runs, COL))
    look = style.current()
    n = len(firsts)
    fig, axes = plt.subplots(2, n, squeeze=False, figsize=(look.panel_w * 1.3 * n,
                                                           look.panel_h * 2.1),
                             gridspec_kw={"height_ratios": [1.1, 1.0]})
    drawn = []
    for c, (_, r) in enumerate(firsts.iterrows()):
        key = (r.get("model"), r.get("dataset"))
        plan = _plan(r)
        tl = _read_wide(r)
        unit = timeline.unit_of(max(timeline.peak(tl)["bytes"], base_tl.get(key, 0)))
        top, bottom = axes[0, c], axes[1, c]
        timeline.draw(top, tl, unit, legend=False, title=f"{r['label']} "
                      f"({names.panel(*key)})", source=str(r.get("mem_timeline_source")
                                                           or "tracker"))
        ref = base_tl.get(key)
        _ref_line(top, ref, unit)
        if ref is not None:
            top.set_ylim(0, max(top.get_ylim()[1], ref / unit[1] * 1.1))
        w = tl
        n_ev = max(1, len(w))
        first = int(w["event"].min()) if len(w) else 0
        ymax = top.get_ylim()[1]
        for rec, a, b in timeline.spans(w, "recompute"):
            if not rec:
                continue
            # the segment most of the span's events run in (a group's first module can run
            # under checkpoint's wrapper, which has no name in the model)
            inside = w.loc[(w["event"] >= a) & (w["event"] <= b), "module"].astype(str)
            segs = Counter(x for x in (by_module.segment_of(timeline.short_module(m), plan)
                                       for m in inside) if x is not None)
            seg = segs.most_common(1)[0][0] if segs else None
            group = plan.loc[plan["segment"] == seg, "group"].iloc[0] if seg is not None else ""
            top.text(((a + b + 1) / 2 - first) / n_ev, ymax * 0.955, str(group), ha="center",
                     va="top", fontsize="xx-small", color=timeline.RECOMPUTE_COLOR)
            drawn.append({"panel": r["label"], "what": "recomputed", "segment": seg,
                          "group": group, "first_event": a, "last_event": b})
        # the segments: the baseline's saved bytes against the run's, as the plan decides
        mine = _segment_bytes(by_module.read(r["run_dir"], r["saved_by_module"]), plan)
        b = bases.get(key)
        theirs = _segment_bytes(by_module.read(b["run_dir"], b["saved_by_module"]), plan) \
            if b is not None else [0] * len(plan)
        div, u = style.byte_unit(pd.Series([*mine, *theirs]))
        xs = list(range(len(plan)))
        color = styles.get(r["label"], {"color": "#777777"})["color"]
        bottom.bar([x - 0.2 for x in xs], [v / div for v in theirs], width=0.4,
                   color="#bbbbbb", label=f"{baseline}")
        rec = [d == "recompute" for d in plan["decision"]]
        bottom.bar([x + 0.2 for x in xs], [v / div for v in mine], width=0.4, color=color,
                   label=f"{r['label']}: saved", zorder=2)
        bottom.bar([x + 0.2 for x, q in zip(xs, rec) if q],
                   [max(v / div, 0) for v, q in zip(theirs, rec) if q], width=0.4,
                   facecolor="none", edgecolor=color, hatch=HATCH, lw=0.4, zorder=1,
                   label=f"{r['label']}: a recomputed segment (hatched up to {baseline}'s)")
        ticks = []
        for _, s in plan.iterrows():
            t = str(s["name"])
            if s["decision"] == "recompute":
                t += f"\n[{s['group']}]"
                if pd.notna(s.get("ops")) and int(s.get("ops") or 0):
                    t += f"\n{int(s['kept_ops'])}/{int(s['ops'])} kept"
            ticks.append(t)
        bottom.set_xticks(xs, ticks, fontsize="xx-small", rotation=90)
        bottom.grid(axis="x", visible=False)
        bottom.set_ylabel(f"saved for backward, {u}")
        bottom.set_title("saved per segment; [a-b]: recomputed as group a-b, k/n: ops whose "
                         "outputs the plan keeps", fontsize="small")
        for i, s in plan.iterrows():
            drawn.append({"panel": r["label"], "what": "segment", "segment": int(s["segment"]),
                          "name": s["name"], "decision": s["decision"], "group": s["group"],
                          "bytes": mine[i], "baseline_bytes": theirs[i]})
    fig.tight_layout(pad=0.3, h_pad=0.8, w_pad=0.8)
    hs, ls = axes[1, 0].get_legend_handles_labels()
    _legend(fig, list(axes[0]), baseline, ncol=3, extra=tuple(zip(hs, ls)))
    return Plot("anatomy", fig, pd.DataFrame(drawn))


# the step anatomy's figures by name, drawn where the runs recorded it (trainer.memory_timeline)
FIGURES = {"timeline": timelines, "layers": layers_figure, "anatomy": anatomy}
