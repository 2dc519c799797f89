"""Memory figures: the breakdown at the activation peak, the checkpoint budget figure, memory
against sequence length and per-rank memory against the number of ranks."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.lines import Line2D

from memtrain import columns
from memtrain.report import draw, style
from memtrain.report.draw import Plot
from memtrain.report.names import DEFAULT as DEFAULT_NAMES
from memtrain.report.names import Names
from memtrain.report.style import Memory, byte_unit, order_settings, panels, setting_styles

# ---------------------------------------------------------------- 2. memory breakdown

# (part, its name: the label of its mem_at_act_peak_<part>_bytes column, memtrain/columns.py)
BREAKDOWN = tuple((k, columns.label(f"mem_at_act_peak_{k}_bytes")) for k in columns.BREAKDOWN)
BREAKDOWN_COLORS = ("#4c72b0", "#8da0cb", "#a6d854", "#fc8d62", "#d9d9d9")
# The moment of the step a breakdown is taken at, best first: the activation peak is where
# methods differ (the total peak of a small model is its optimizer step, the same for all).
MOMENTS = (("mem_at_act_peak", "at the activation peak",
            "buffers, the batch and backward temporaries"),
           ("mem_at_peak", "at the peak of the step", "buffers and the batch"))


def _moment(agg: pd.DataFrame) -> tuple[str, str, str] | None:
    for m in MOMENTS:
        cols = [f"{m[0]}_{k}_bytes" for k, _ in BREAKDOWN]
        if all(c in agg for c in cols) and agg[cols].notna().any().any():
            return m
    return None


def _where(agg: pd.DataFrame) -> str:
    src = set(agg["mem_peak_source"].dropna()) - {""} if "mem_peak_source" in agg else set()
    return ("CPU live-tensor tracker" if src == {"tracker"} else
            "live-tensor tracker; peak: CUDA" if src == {"cuda"} else "live-tensor tracker")


@style.styled
def breakdown(agg: pd.DataFrame, names: Names = DEFAULT_NAMES) -> Plot | None:
    """Stacked horizontal bars of memory by kind at the activation peak (or, for runs without
    that breakdown, at the peak of the step; the axis says which), one bar per setting, the
    step's peak as a tick. Settings without a breakdown (failed before it) are listed."""
    moment = _moment(agg)
    if moment is None:
        return None
    prefix, when, other = moment
    kinds = [name for _, name in BREAKDOWN]
    cols = [f"{prefix}_{k}_bytes" for k, _ in BREAKDOWN]
    peak = agg.get("mem_peak_alloc_bytes")
    div, unit = byte_unit(pd.concat([agg[cols].sum(axis=1), peak]) if peak is not None
                          else agg[cols].sum(axis=1))
    styles, ps = setting_styles(agg), panels(agg, names)
    scale = style.current().rc["font.size"] / 7
    heights = max(len(g) for _, g in ps) * 0.22 * scale + 0.9 * scale
    fig, axes = style.subplots(len(ps), height=heights)
    drawn = []
    for ax, (title, g) in zip(axes, ps):
        g = order_settings(g).iloc[::-1]  # baseline on top
        y = list(range(len(g)))
        has = g[cols].notna().any(axis=1)
        left = pd.Series(0.0, index=g.index)
        for (kind, _), name, col, color in zip(BREAKDOWN, kinds, cols, BREAKDOWN_COLORS):
            w = g[col].fillna(0.0) / div
            ax.barh(y, w.where(has, 0.0), left=left, color=color, label=name, height=0.7,
                    edgecolor="white", linewidth=0.3)
            drawn += [{"panel": title, "label": lb, "kind": kind, "left": lf, "width": v}
                      for lb, lf, v, h in zip(g["label"], left, w, has) if h]
            left = left + w
        if peak is not None:
            ax.plot(g["mem_peak_alloc_bytes"] / div, y, linestyle="none", marker="|",
                    color="black", markersize=style.marker_size(2.0), label="peak of the step")
        phases = g.get("n_phases", pd.Series(1.0, index=g.index)).fillna(1.0)
        ax.set_yticks(y, [lb + ("\n(largest phase)" if n > 1 else "")
                          for lb, n in zip(g["label"], phases)])
        for tick, lb in zip(ax.get_yticklabels(), g["label"]):
            tick.set_color(styles[lb]["color"])
        for yi, (_, r), h in zip(y, g.iterrows(), has):
            if not h:  # failed before the accounting step: nothing measured, said so
                ax.text(0, yi, f" not measured ({r['status']})", va="center",
                        fontsize="x-small", color=draw.FAILED_COLOR)
            elif r["worst_status"] != "ok":  # the failed step's memory, or the ok runs' mean
                lost = f" {r['status']}" if r["n_ok"] == 0 else f" mean of ok runs ({r['status']})"
                ax.text(left[r.name], yi, lost, va="center", fontsize="x-small",
                        color=draw.FAILED_COLOR)
        ax.grid(axis="y", visible=False)
        ax.set(title=title, xlabel=f"memory {when} ({unit})")
    draw.plain_axes(fig)
    fig.tight_layout(pad=0.3, h_pad=1.2)
    handles, labels = axes[0].get_legend_handles_labels()
    order = [labels.index(k) for k in (*kinds, "peak of the step") if k in labels]
    fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper center",
               bbox_to_anchor=(0.5, 0.0), ncol=3,
               frameon=False, handlelength=1.0, columnspacing=0.8)
    return Plot("breakdown", fig, pd.DataFrame(drawn),
                f"Memory by kind {when} of the accounting step ({_where(agg)}), one bar per "
                f"setting (a multi-phase method: its largest phase); other: {other}; the tick: "
                f"the step's total peak, `mem_peak_alloc_bytes`.")


# ---------------------------------------------------------------- 5. checkpoint budget figure

# series -> the annotation of its fraction and its line: the planner at op granularity (or a run
# from before granularity existed), the planner at block granularity, torch.compile's budget
SERIES = {"budget": "b", "budget block": "b", "compile": "amb"}
LINES = {"budget": "-", "budget block": "--", "compile": ":"}
FRACTION = "method.budget_fraction"
ACT_REL = columns.ratio("mem_act_rel")  # the planner's target: activations alone


def _budget_rows(agg: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(strategy per row, rows that are checkpoint runs with a meaningful fraction)."""
    # Runs without a strategy column predate the other strategies: the planner's budget.
    strategies = agg.get("method.strategy", pd.Series("budget", index=agg.index)).fillna("budget")
    if "method.granularity" in agg:  # a series per granularity of the planner
        block = (strategies == "budget") & (agg["method.granularity"] == "block")
        strategies = strategies.where(~block, "budget block")
    is_b = (agg["method"] == "checkpoint") & agg[FRACTION].notna() & strategies.isin(list(SERIES))
    return strategies, is_b


def _target_panel(ax, rows: pd.DataFrame, styles: dict, title: str, baseline: str
                  ) -> list[dict]:
    """Measured activation peak (filled) and the planner's (hollow, a size larger: a ring when
    they agree) against the budget (the target, dashed diagonal), both relative to the
    baseline's activation peak; `rows` are the budget settings, failed ones listed."""
    ok = draw.ok_rows(rows)
    color = style.method_color("checkpoint")
    lim = [0, max([1.05, *(ok[c].max() * 1.05 for c in ("mem_act_rel", "plan_peak_rel")
                           if c in ok and ok[c].notna().any())])]
    ax.plot(lim, lim, color="#888888", linestyle="--", linewidth=style.line_width(0.7), zorder=1)
    drawn = []
    for _, r in ok.sort_values(FRACTION).iterrows():
        b, marker = r[FRACTION], styles[r["label"]]["marker"]
        planned = r.get("plan_peak_rel")
        if planned is not None and pd.notna(planned):
            ax.plot([b], [planned], linestyle="none", marker=marker, zorder=3,
                    markersize=style.marker_size(1.6), **draw.hollow({"color": color}))
        ax.errorbar([b], [r["mem_act_rel"]], yerr=[r.get("mem_act_rel_std") or 0.0],
                    fmt=marker, color=color, markersize=style.marker_size(),
                    markeredgecolor="white", markeredgewidth=0.4,
                    elinewidth=style.line_width(0.6), capsize=style.marker_size(0.4), zorder=4)
        drawn.append({"panel": title, "label": r["label"], "method": "checkpoint",
                      "x": b, "y": r["mem_act_rel"], "planned": planned, "target": b,
                      "kind": "target"})
    ax.set(xlim=lim, ylim=lim, title=f"{title}: budget", xlabel="budget b",
           ylabel=ACT_REL.axis(baseline))
    h = (Line2D([], [], color="#888888", linestyle="--", linewidth=style.line_width(0.7)),
         Line2D([], [], linestyle="none", marker="o", markersize=style.marker_size(1.6),
                **draw.hollow({"color": color})),
         Line2D([], [], linestyle="none", marker="o", markersize=style.marker_size(),
                color=color, markeredgecolor="white"))
    ax.legend(h, ["target (the budget)", "planned", "measured"], loc="upper left",
              fontsize="x-small", frameon=True, framealpha=0.85, edgecolor="none")
    draw.note(ax, draw.failed_lines(rows), panel=title)
    return drawn


def _overhead_panel(ax, g: pd.DataFrame, strategies: pd.Series, is_b: pd.Series, mem: Memory,
                    styles: dict, title: str, baseline: str) -> list[dict]:
    """Memory against step-time overhead: every setting a point, one line per strategy whose
    fraction means something, joined in fraction order, the planner's prediction hollow."""
    ok = draw.ok_rows(g)
    drawn = draw.points(ax, ok, "overhead_pct", mem.rel, styles, title,
                        xrange=(-100.0, math.inf))  # a step cannot take less than no time
    color = style.method_color("checkpoint")
    for strategy, tag in SERIES.items():  # the two fractions mean different things
        b = ok[is_b.loc[ok.index] & (strategies.loc[ok.index] == strategy)].sort_values(FRACTION)
        b = b[b["overhead_pct"].notna() & b[mem.rel].notna()]
        if b.empty:
            continue
        ax.plot(b["overhead_pct"], b[mem.rel], color=color, linewidth=style.line_width(0.8),
                zorder=2, label=f"_{strategy}", linestyle=LINES[strategy])
        for _, r in b.iterrows():
            ax.annotate(f"{tag}={r[FRACTION]:g}", (r["overhead_pct"], r[mem.rel]),
                        fontsize="x-small", textcoords="offset points", xytext=(3, 2),
                        color=color)
            if mem.rel == "mem_act_rel" and pd.notna(r.get("plan_peak_rel")) and pd.notna(
                    r.get("plan_overhead_pct")):
                ax.plot([r["plan_overhead_pct"]], [r["plan_peak_rel"]], linestyle="none",
                        marker=styles[r["label"]]["marker"], zorder=3,
                        markersize=style.marker_size(1.6), label="_planned",
                        **draw.hollow({"color": color}))
                ax.plot([r["plan_overhead_pct"], r["overhead_pct"]],
                        [r["plan_peak_rel"], r[mem.rel]], color=color,
                        linewidth=style.line_width(0.4), linestyle=":", zorder=1,
                        label="_planned to measured")
    noisy = [f"noisy timing: {r.label}" + (", the baseline of every overhead here"
                                             if r.label == baseline else "")
             for r in ok.itertuples() if draw.is_true(getattr(r, "timing_noisy", None))]
    draw.note(ax, draw.failed_lines(g), (Line2D([], [], linestyle="none"),) * len(noisy), noisy,
              panel=title)
    ax.axvline(0.0, color="#bbbbbb", linewidth=style.line_width(0.6), linestyle=":", zorder=0)
    ax.set(title=f"{title}: memory against overhead", xlabel="step-time overhead (%)",
           ylabel=mem.axis(baseline))
    return drawn


@style.styled
def budget(agg: pd.DataFrame, mem: Memory, baseline: str = "none",
           names: Names = DEFAULT_NAMES) -> Plot | None:
    """Per model and dataset with checkpoint budget runs, two panels. Left: the activation
    peak against the budget `b` (fraction of the baseline's activation peak), the target as the
    diagonal, the planner's prediction hollow, measured filled. Right: memory against step-time
    overhead, one series per strategy whose fraction means something (budget `b=`: op
    granularity solid, block granularity dashed; compile `amb=`, torch's
    activation_memory_budget, dotted), every other setting a point.

    Applies when runs with method=checkpoint and a method.budget_fraction exist.
    """
    if FRACTION not in agg:
        return None
    strategies, is_b = _budget_rows(agg)
    # failed settings: the failures figure; an estimate-only sweep measured nothing to draw
    measured = agg[mem.rel].notna() if mem.rel in agg else pd.Series(False, index=agg.index)
    if not (is_b & (agg["n_ok"] > 0) & measured).any():
        return None
    agg = agg.assign(overhead_pct=(agg["step_time_rel"] - 1) * 100,
                     overhead_pct_std=agg.get("step_time_rel_std", 0.0) * 100)
    styles = setting_styles(agg)
    ps = panels(agg[agg["model"].isin(agg.loc[is_b, "model"])], names)
    planned = {title: g[is_b.loc[g.index] & strategies.loc[g.index].str.startswith("budget")]
               for title, g in ps}
    two = any(len(draw.ok_rows(p)) for p in planned.values())
    look = style.current()
    fig, axes = plt.subplots(len(ps), 1 + two, figsize=((1 + two) * look.panel_w,
                                                        look.panel_h * len(ps)), squeeze=False)
    drawn = []
    for row, (title, g) in zip(axes, ps):
        if two and draw.ok_rows(planned[title]).empty:
            row[0].set_visible(False)
        elif two:
            drawn += _target_panel(row[0], planned[title], styles, title, baseline)
        drawn += _overhead_panel(row[-1], g, strategies, is_b, mem, styles, title, baseline)
    data = pd.DataFrame(drawn)
    extra = ()
    if "planned" in data and data["planned"].notna().any():
        h = Line2D([], [], linestyle="none", marker="o", markersize=style.marker_size(),
                   **draw.hollow({"color": "#666666"}))
        extra = ((h, "hollow: the planner's prediction"),)
    draw.finish(fig, styles, draw.drawn_labels(data), extra)
    left = (f"Left: {ACT_REL.definition(baseline)}, measured (filled) and planned (hollow), "
            f"against the budget b, a fraction of {baseline}'s activation peak (the dashed "
            f"diagonal: on target). Right: " if two else "")
    return Plot("budget", fig, data, f"{left}y: {mem.caption(baseline)}; x: the step time over "
                f"{baseline}'s, minus 1, in % (end to end); b=: the planner's budget, amb=: "
                f"torch.compile's activation_memory_budget.")


# ---------------------------------------------------------------- 6. memory against sequence length

SEQ_LEN = "dataset.seq_len"
_SEQ_LABEL = r" seq_len=\S+"


def _lines_against(agg: pd.DataFrame, names: Names, x: str, x_name: str, col: str,
                   x_value=lambda v: v):
    """One panel per model and dataset, one line per setting (agg's `line`) of `col` against
    agg's `x` on a log-2 axis: the figure, its (axis, title) pairs, the values drawn (x as
    `x_name`, through `x_value`), the lines' styles and the bytes' unit."""
    div, unit = byte_unit(agg[col])
    colors = setting_styles(agg.assign(label=agg["line"]))
    fig, axes = style.subplots(len(panels(agg, names)))
    drawn, titled = [], []
    for ax, (title, g) in zip(axes, panels(agg, names)):
        ok = draw.ok_rows(g)
        for line, h in order_settings(ok.assign(label=ok["line"])).groupby("label", sort=False):
            h = h[h[col].notna() & h[x].notna()].sort_values(x)
            if h.empty:
                continue
            ax.plot(h[x], h[col] / div, label=line, linewidth=style.line_width(1.0),
                    **colors[line])
            drawn += [{"panel": title, "label": line, "method": r["method"],
                       x_name: x_value(r[x]), "bytes": r[col]} for _, r in h.iterrows()]
        ax.set_xscale("log", base=2)
        draw.note(ax, draw.failed_lines(g), panel=title)
        titled.append((ax, title))
    return fig, titled, pd.DataFrame(drawn), colors, unit


@style.styled
def sequence(agg: pd.DataFrame, names: Names = DEFAULT_NAMES) -> Plot | None:
    """Activation memory against the sequence length (the figure of Korthikanti et al.): one
    line per setting but the length (method, attention, ...), one panel per model and dataset;
    log-log, so a term linear in s and one in s^2 show as slopes 1 and 2. Drawn when a sweep
    varies `dataset.seq_len`."""
    if SEQ_LEN not in agg or pd.to_numeric(agg[SEQ_LEN], errors="coerce").nunique() < 2:
        return None
    col = next((c for c in (columns.ACT_TEMP_PEAK, columns.ACT_PEAK)
                if c in agg and agg[c].notna().any()), None)
    if col is None:
        return None
    agg = agg.assign(line=agg["label"].str.replace(_SEQ_LABEL, "", regex=True).str.strip(),
                     seq=pd.to_numeric(agg[SEQ_LEN], errors="coerce"))
    fig, panels_drawn, data, colors, unit = _lines_against(agg, names, "seq", "seq_len", col)
    for ax, title in panels_drawn:
        ax.set_yscale("log")
        ax.set(title=title, xlabel="sequence length (tokens)",
               ylabel=f"{columns.label(col)} ({unit})")
    draw.finish(fig, colors, draw.drawn_labels(data))
    return Plot("sequence", fig, data, f"y: `{columns.label(col)}`, {columns.lookup(col).meaning} "
                f"(`{col}`), against the sequence length, log-log: a term linear in the length "
                f"has slope 1, attention's scores slope 2.")


# ---------------------------------------------------------------- 7. per-rank memory against ranks

WORLD = "trainer.world_size"
STRATEGY = "trainer.strategy"
_WORLD_LABEL = r" world_size=\S+"


@style.styled
def sharding(agg: pd.DataFrame, names: Names = DEFAULT_NAMES) -> Plot | None:
    """One rank's peak against the number of ranks (trainer.world_size), one line per method
    and strategy (a run of one process: its point at 1 rank), one panel per model and dataset:
    how much of the per-rank memory sharding takes off (FSDP: parameters, gradients and
    optimizer state / N) and what a method still buys beside it. The peak is the measured one
    (`mem_peak_alloc_bytes`, the highest rank's) where the runs trained, else one rank's
    GPU-free estimate (`mem_estimate_bytes`). Drawn when a sweep varies the world size."""
    if WORLD not in agg or pd.to_numeric(agg[WORLD], errors="coerce").nunique() < 2:
        return None
    measured = columns.PEAK in agg and agg[columns.PEAK].notna().any()
    col = columns.PEAK if measured else columns.ESTIMATE
    if col not in agg or not agg[col].notna().any():
        return None
    single = agg[STRATEGY].astype(str).eq("single") if STRATEGY in agg else \
        pd.Series(False, index=agg.index)
    ranks = pd.to_numeric(agg[WORLD], errors="coerce").where(~single, 1)
    agg = agg.assign(line=agg["label"].str.replace(_WORLD_LABEL, "", regex=True).str.strip(),
                     ranks=ranks)
    fig, panels_drawn, data, colors, unit = _lines_against(agg, names, "ranks", "ranks", col,
                                                           int)
    what = columns.label(columns.PEAK) if measured else "predicted peak"
    for ax, title in panels_drawn:
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set(title=title, xlabel="ranks", ylabel=f"{what} per rank ({unit})")
    draw.finish(fig, colors, draw.drawn_labels(data))
    y = ("the step's total peak of the rank with the highest, `mem_peak_alloc_bytes`" if measured
         else "one rank's peak as the GPU-free estimate predicts it, `mem_estimate_bytes`")
    return Plot("sharding", fig, data, f"y: {y}; x: the ranks (`trainer.world_size`; a run of "
                f"one process at 1).")
