"""Settings table -> the paper's figures. Each function returns a Plot (the figure and a frame of
exactly the values it drew, saved beside it) or None when the figure does not apply.

Input is the seed-aggregated table (`tables.aggregate_seeds` after `add_baselines`): one row per
setting, `<col>` the mean over seeds and `<col>_std` the standard deviation (the error bars).
Panels are titled by model and dataset and settings labelled by `names` (report/names.py); a
setting that failed is listed in every figure that cannot draw it. Memory figures (breakdown,
budget) are in plots_memory.py.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Collection

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from memtrain.report import derive, style
from memtrain.report.draw import (
    Plot,
    coincident,
    drawn_labels,
    failed_lines,
    finish,
    hollow,
    is_true,
    not_learned,
    note,
    ok_rows,
    plain_axes,
    points,
)
from memtrain.report.names import DEFAULT as DEFAULT_NAMES
from memtrain.report.names import Names
from memtrain.report.plots_memory import breakdown, budget, sequence, sharding
from memtrain.report.style import Memory, byte_unit, order_settings, panels, setting_styles

__all__ = ["Plot", "all_plots", "breakdown", "budget", "curves", "failures", "pareto_front",
           "save", "sequence", "sharding", "throughput", "tradeoff"]


# ---------------------------------------------------------------- 1. memory-accuracy trade-off


def _blank() -> Line2D:
    """A legend handle that draws nothing: for a line of text in an in-panel legend."""
    return Line2D([], [], linestyle="none")


def pareto_front(x: pd.Series, y: pd.Series) -> list[int]:
    """Positions (into x, y) of the points no other point beats on both less memory and higher
    accuracy, ordered by memory."""
    order = sorted(range(len(x)), key=lambda i: (x.iloc[i], -y.iloc[i]))
    front, best = [], -float("inf")
    for i in order:
        if y.iloc[i] > best:
            front.append(i)
            best = y.iloc[i]
    return front


def language_model(g: pd.DataFrame) -> bool:
    """A panel of language models: their rows' metric is the validation loss (lower better)."""
    return bool("metric" in g and g["metric"].eq("test_loss").any())


@style.styled
def tradeoff(agg: pd.DataFrame, mem: Memory, baseline: str = "none",
             names: Names = DEFAULT_NAMES) -> Plot | None:
    """Memory relative to the baseline against test accuracy, one panel per model and dataset,
    the Pareto front dashed."""
    if agg["test_acc"].notna().sum() == 0:
        return None
    rel = agg[mem.rel].notna().any()
    div, unit = byte_unit(agg[mem.col])
    xcol, xlab = (mem.rel, mem.axis(baseline)) if rel else (mem.col, mem.axis(unit=unit))
    xscale = 1.0 if rel else div
    styles, ps = setting_styles(agg), panels(agg, names)
    fig, axes = style.subplots(len(ps))
    drawn = []
    for ax, (title, g) in zip(axes, ps):
        ok, lm = ok_rows(g), language_model(g)
        if lm:  # validation loss per token, lower better; the unigram loss is "chance"
            pts = points(ax, ok, xcol, "test_loss", styles, title, xscale=xscale,
                         flag="did_not_learn", yrange=(0.0, math.inf))
            chance = pd.to_numeric(g.get("unigram_loss", pd.Series(dtype=float)),
                                   errors="coerce")
            scale = 1.0
        else:
            pts = points(ax, ok, xcol, "test_acc", styles, title, xscale=xscale, yscale=0.01,
                         flag="did_not_learn", yrange=(0.0, 100.0))
            chance = pd.to_numeric(g.get("chance_acc", pd.Series(dtype=float)),
                                   errors="coerce")
            scale = 100.0
        if chance.notna().any():  # guessing's accuracy: a point at or below it learned nothing
            ax.axhline(chance.mean() * scale, color="#c00000", linestyle=":",
                       linewidth=style.line_width(0.7), zorder=0)
            for p in pts:
                p["chance"] = chance.mean() * scale
        # the front of the best points: a loss is better low, so it is drawn on -loss
        sign = -1.0 if lm else 1.0
        idx = pareto_front(pd.Series([p["x"] for p in pts]),
                           pd.Series([sign * p["y"] for p in pts]))
        if len(idx) > 1:  # a front of one point is no line
            ax.plot([pts[i]["x"] for i in idx], [pts[i]["y"] for i in idx], color="#999999",
                    drawstyle="steps-post", linestyle="--", linewidth=style.line_width(0.7),
                    zorder=1, label="_pareto")
        for i, p in enumerate(pts):
            p["pareto"] = i in idx
        drawn += pts
        if rel:
            ax.axvline(1.0, color="#bbbbbb", linewidth=style.line_width(0.6), linestyle=":",
                       zorder=0)
        skipped = [f"no baseline: {r.label}" for r in ok.itertuples()
                   if pd.isna(ok.at[r.Index, xcol])]
        front = ax.plot([], [], color="#999999", linestyle="--",
                        linewidth=style.line_width(0.7)) if len(idx) > 1 else []
        same = coincident(pts) + not_learned(g)
        note(ax, failed_lines(g) + skipped, (*front, *[_blank()] * len(same)),
             ["Pareto front"] * len(front) + same, panel=title)
        ax.set(title=title, xlabel=xlab,
               ylabel="validation loss" if lm else "test accuracy (%)")
    data = pd.DataFrame(drawn)
    extra = []
    if "chance" in data:
        extra.append((Line2D([], [], color="#c00000", linestyle=":"),
                      "chance (1 / classes; language models: the unigram loss)"
                      if language_model(agg) else "chance (1 / classes)"))
    if "did_not_learn" in data and data["did_not_learn"].any():
        extra.append((Line2D([], [], linestyle="none", marker="o",
                             markersize=style.marker_size(), **hollow({"color": "#666666"})),
                      "hollow: a run did not learn"))
    finish(fig, styles, drawn_labels(data), tuple(extra))
    x = mem.caption(baseline if rel else None)
    return Plot("tradeoff", fig, data, f"x: {x}. y: test accuracy (language models: the "
                f"validation loss per token), mean and standard deviation over seeds; the dashed "
                f"line is the Pareto front (less memory, better quality).")


# ---------------------------------------------------------------- 3. throughput against memory

THROUGHPUT = "throughput_e2e_samples_s"  # derive.py: all phases of a multi-phase run


@style.styled
def throughput(agg: pd.DataFrame, mem: Memory, names: Names = DEFAULT_NAMES) -> Plot | None:
    """Training throughput (samples/s, end to end: every phase of a multi-phase method) against
    memory, one panel per model and dataset. Settings whose step time was noisy (p90 / median
    above derive.NOISY_P90_OVER_MEDIAN in a run) are hollow."""
    col = THROUGHPUT if agg.get(THROUGHPUT, pd.Series(dtype=float)).notna().any() \
        else "throughput_samples_s"  # KeyError when no run has one: all_plots says so
    if agg[col].notna().sum() == 0 or agg[mem.col].notna().sum() == 0:
        return None
    div, unit = byte_unit(agg[mem.col])
    styles, ps = setting_styles(agg), panels(agg, names)
    fig, axes = style.subplots(len(ps))
    drawn = []
    for ax, (title, g) in zip(axes, ps):
        drawn += points(ax, ok_rows(g), mem.col, col, styles, title, xscale=div,
                        flag="timing_noisy")
        note(ax, failed_lines(g), panel=title)
        ax.set(title=title, xlabel=mem.axis(unit=unit), ylabel="throughput (samples/s)")
        ax.set_ylim(bottom=0)
    data = pd.DataFrame(drawn)
    extra = ()
    if "timing_noisy" in data and data["timing_noisy"].any():
        h = Line2D([], [], linestyle="none", marker="o", markersize=style.marker_size(),
                   **{k: v for k, v in hollow({"color": "#666666"}).items()})
        k = f"{derive.NOISY_P90_OVER_MEDIAN:g}×"
        extra = ((h, f"hollow: noisy timing (p90 > {k} median, or seeds {k} apart)"),)
    finish(fig, styles, drawn_labels(data), extra)
    return Plot("throughput", fig, data, f"x: {mem.caption()}. y: training samples per second "
                f"of the timed steps, end to end (every phase of a multi-phase method).")


# ---------------------------------------------------------------- 4. learning curves


def _curve_points(agg: pd.DataFrame, metrics: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """(mean, std, count of test accuracy per setting and x, x axis name). x is the step when a
    run was evaluated at several steps within an epoch, else the epoch (1 = after the first).
    An evaluation after all phases (epoch -1: synthetic's composed model) is placed where the
    run ended: its end-to-end steps, or its last epoch."""
    acc = metrics[(metrics["split"] == "test") & (metrics["name"] == "acc")]
    owner = {d: i for i, dirs in agg["run_dirs"].items() for d in str(dirs).split(";")}
    acc = acc.assign(setting=acc["run_dir"].map(owner), value=pd.to_numeric(acc["value"]),
                     epoch=pd.to_numeric(acc["epoch"]), step=pd.to_numeric(acc["step"]))
    acc = acc.dropna(subset=["setting"])
    within = acc[acc["epoch"] >= 0].groupby(["run_dir", "epoch"])["step"].nunique()
    by_step = bool(len(within)) and within.max() > 1
    final = acc["epoch"] < 0
    nan = pd.Series(float("nan"), index=agg.index)
    if by_step:
        end = agg.get("steps_e2e", agg.get("steps", nan))
        x = acc["step"].where(~final, acc["setting"].map(end))
    else:
        x = (acc["epoch"] + 1).where(~final, acc["setting"].map(agg.get("epochs_done", nan)))
    acc = acc.assign(x=x, final=final).dropna(subset=["x"])
    per = acc.groupby(["setting", "x"]).agg(mean=("value", "mean"), std=("value", "std"),
                                             count=("value", "count"), final=("final", "any"))
    per = per.reset_index()
    return per, "step" if by_step else "epoch"


@style.styled
def curves(agg: pd.DataFrame, metrics: pd.DataFrame, names: Names = DEFAULT_NAMES
           ) -> Plot | None:
    """Test accuracy over training, mean over seeds with a std band, one line per setting; x in
    epochs, or in steps when runs were evaluated within epochs. Applies when some setting was
    evaluated at two or more points."""
    if metrics.empty:
        return None
    per, xname = _curve_points(agg, metrics)
    if per.empty or per.groupby("setting")["x"].nunique().max() < 2:
        return None
    styles, ps = setting_styles(agg), panels(agg, names)
    fig, axes = style.subplots(len(ps))
    drawn = []
    for ax, (title, g) in zip(axes, ps):
        for i, lb in order_settings(g)["label"].items():
            c = per[per["setting"] == i].sort_values("x")
            if c.empty:
                continue
            st = styles[lb]
            y, e = c["mean"] * 100, c["std"].fillna(0.0) * 100
            up = st["markersize"] / style.marker_size()  # the baseline's wider: a halo
            ax.plot(c["x"], y, label=lb, color=st["color"], marker=st["marker"],
                    markersize=0.6 * st["markersize"], linewidth=up ** 2 * style.line_width())
            ax.fill_between(c["x"], y - e, y + e, color=st["color"], alpha=0.15, linewidth=0)
            drawn += [{"panel": title, "label": lb, "x": x, "y": v, "yerr": s, "n": n,
                       "axis": xname} for x, v, s, n in zip(c["x"], y, e, c["count"])]
        has = set(per["setting"])
        failed = [f"{'includes failed runs' if r.Index in has else 'no evaluation'}: {r.label} "
                  f"({r.status})" for r in g.itertuples() if r.worst_status != "ok"]
        once = [lb for i, lb in g["label"].items()
                if per.loc[per["setting"] == i, "final"].all() and (per["setting"] == i).any()]
        handles = [Line2D([], [], linestyle="none", color=styles[lb]["color"],
                          marker=styles[lb]["marker"], markersize=style.marker_size(0.6))
                   for lb in once]
        same = coincident([d for d in drawn if d["panel"] == title])
        note(ax, failed, (*handles, *[_blank()] * len(same)),
             [*(f"{lb}: evaluated after all phases" for lb in once), *same], panel=title)
        ax.set(title=title, xlabel=xname, ylabel="test accuracy (%)")
        ax.xaxis.get_major_locator().set_params(integer=True)
    data = pd.DataFrame(drawn)
    finish(fig, styles, drawn_labels(data))
    return Plot("curves", fig, data, f"Test accuracy at each evaluation ({xname}s), mean over "
                f"seeds with a band of one standard deviation.")


# ---------------------------------------------------------------- 6. failure map


def _reasons(agg: pd.DataFrame) -> dict[str, int]:
    """Each distinct failure reason -> its footnote number, in the order of the settings."""
    out: dict[str, int] = {}
    for r in agg.get("error_short", pd.Series(dtype=str)).fillna(""):
        if r and r not in out:
            out[r] = len(out) + 1
    return out


@style.styled
def failures(agg: pd.DataFrame, names: Names = DEFAULT_NAMES) -> Plot | None:
    """Settings x (model, dataset) grid coloured by the worst status, each cell saying e.g.
    'error 1/3 [1]', the numbered reasons (the runs' `error`, first line) under the grid.

    Applies when any run did not end ok.
    """
    if (agg["worst_status"] == "ok").all():
        return None
    look = style.current()
    agg = order_settings(agg)
    labels = list(dict.fromkeys(agg["label"]))
    cols = [t for t, _ in panels(agg, names)]
    col_of = [names.panel(m, d) for m, d in zip(agg["model"], agg["dataset"])]
    reasons = _reasons(agg)
    em = look.rc["font.size"] / 72  # inches per em
    width = min(2 * look.panel_w, max(look.panel_w, 0.9 * em * max(map(len, labels))
                                          + 6 * em * len(cols) + 0.3))
    fig, ax = plt.subplots(figsize=(width, 2.2 * em * (len(labels) + 1.5)))
    drawn = []
    for (_, r), c in zip(agg.iterrows(), col_of):
        x, y = cols.index(c), labels.index(r["label"])
        color = style.STATUS_COLORS.get(r["worst_status"], "#e0e0e0")
        ax.add_patch(plt.Rectangle((x - 0.48, y - 0.45), 0.96, 0.9, color=color, linewidth=0))
        text = f"ok {r['n_runs']}/{r['n_runs']}" if r["status"] == "ok" else r["status"]
        why = r.get("error_short") or ""
        cell = text.replace(", ", "\n") + (f" [{reasons[why]}]" if why in reasons else "")
        ax.text(x, y, cell, ha="center", va="center", fontsize="x-small", color="black")
        drawn.append({"panel": c, "label": r["label"], "status": r["status"], "text": text,
                      "worst_status": r["worst_status"], "reason": why, "x": x, "y": y})
    ax.set(xlim=(-0.5, len(cols) - 0.5), ylim=(len(labels) - 0.5, -0.5),
           xticks=range(len(cols)), yticks=range(len(labels)), title="run status per setting")
    ax.set_xticklabels(cols)
    ax.set_yticklabels(labels)
    ax.grid(False)
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    fig.tight_layout(pad=0.3)
    if reasons:
        chars = max(30, int(fig.get_size_inches()[0] / (0.5 * em * 0.83)))
        lines = [textwrap.fill(f"[{n}] {derive.shorten(why)}", chars, subsequent_indent="     ")
                 for why, n in reasons.items()]
        fig.text(0.01, 0.0, "\n".join(lines), ha="left", va="top", fontsize="small",
                 transform=fig.transFigure)
    plain_axes(fig)
    return Plot("failures", fig, pd.DataFrame(drawn), "Each setting's runs by how they ended "
                "(the worst colours the cell); [n]: the reason under the grid, the first line "
                "of the runs' `error`.")


# ---------------------------------------------------------------- all of them


# ---------------------------------------------------------------- 1. the cost figure


@style.styled
def cost(agg: pd.DataFrame, mem: Memory, baseline: str = "none",
         names: Names = DEFAULT_NAMES) -> Plot | None:
    """What each setting costs for the memory it saves, the question in one figure: memory
    relative to the baseline on x; the test accuracy change (points) above and the step-time
    overhead (%) below, on aligned axes; one marker per setting, seeds as error bars (stopped at
    what the metric allows). A setting with a run that did not learn is hollow above, one whose
    timing was noisy hollow below."""
    if mem.rel not in agg or agg[mem.rel].notna().sum() == 0:
        return None
    acc = agg.get("test_acc_delta", pd.Series(dtype=float))
    step = agg.get("step_time_rel", pd.Series(dtype=float))
    if acc.notna().sum() == 0 and step.notna().sum() == 0:
        return None
    loss = agg.get("test_loss_delta", pd.Series(math.nan, index=agg.index))
    agg = agg.assign(acc_pts=acc * 100, acc_pts_std=agg.get("test_acc_delta_std", math.nan) * 100,
                     loss_delta=loss, loss_delta_std=agg.get("test_loss_delta_std", math.nan),
                     overhead_pct=(step - 1) * 100,
                     overhead_pct_std=agg.get("step_time_rel_std", math.nan) * 100)
    styles, ps = setting_styles(agg), panels(agg, names)
    look = style.current()
    fig, axes = plt.subplots(2, len(ps), sharex="col", squeeze=False,
                             figsize=(look.panel_w * len(ps), look.panel_h * 1.7))
    drawn = []
    for j, (title, g) in enumerate(ps):
        top, bottom = axes[0][j], axes[1][j]
        ok, lm = ok_rows(g), language_model(g)
        if lm:  # a language model's quality: its validation loss change (lower is better)
            drawn += [{**p, "row": "loss"} for p in points(
                top, ok, mem.rel, "loss_delta", styles, title, flag="did_not_learn")]
        else:
            drawn += [{**p, "row": "accuracy"} for p in points(
                top, ok, mem.rel, "acc_pts", styles, title, flag="did_not_learn",
                yrange=(-100.0, 100.0))]
        drawn += [{**p, "row": "overhead"} for p in points(
            bottom, ok, mem.rel, "overhead_pct", styles, title, flag="timing_noisy",
            yrange=(-100.0, math.inf))]
        for ax in (top, bottom):
            ax.axhline(0.0, color="#bbbbbb", linewidth=style.line_width(0.6), zorder=0)
            ax.axvline(1.0, color="#bbbbbb", linewidth=style.line_width(0.6), linestyle=":",
                       zorder=0)
            ax.margins(x=0.08, y=0.08)  # a marker at the data's edge stays whole
        # the baseline's own timing noisy: every overhead of the panel is in doubt, say so
        noisy = [f"noisy timing: {r.label}" + (", the baseline of every overhead here"
                                              if r.label == baseline else "")
                 for r in ok.itertuples() if is_true(getattr(r, "timing_noisy", None))]
        # settings at one place in the quality panel (an exact method on none's point)
        same = coincident([d for d in drawn if d["panel"] == title and d["row"] != "overhead"])
        same += not_learned(g)
        note(top, failed_lines(g), (_blank(),) * len(same), tuple(same), panel=title)
        if noisy:
            note(bottom, [], (Line2D([], [], linestyle="none"),) * len(noisy), tuple(noisy),
                 panel=f"{title}: overhead")
        top.set(title=title, ylabel="validation loss change" if lm else
                "accuracy change (points)")
        bottom.set(title=f"{title}: overhead", xlabel=mem.axis(baseline),
                   ylabel="step-time overhead (%)")
    data = pd.DataFrame(drawn)
    extra = ()
    flagged = [c for c in ("did_not_learn", "timing_noisy")
               if c in data and data[c].fillna(False).astype(bool).any()]
    if flagged:  # a hollow marker is explained wherever one is drawn
        extra = ((Line2D([], [], linestyle="none", marker="o", markersize=style.marker_size(),
                         **hollow({"color": "#666666"})), "hollow: a run did not learn (above) "
                  "or timed noisily (below)"),)
    finish(fig, styles, drawn_labels(data), extra)
    return Plot("cost", fig, data, f"x: {mem.caption(baseline)}. Above: the test accuracy "
                f"minus {baseline}'s, in points (language models: the validation loss per token "
                f"minus {baseline}'s); below: the step time over {baseline}'s, minus 1, in % "
                f"(end to end). Mean and standard deviation over seeds, each run against its "
                f"own seed's {baseline}.")


# ---------------------------------------------------------------- the GPU-free estimate


def estimates(agg: pd.DataFrame, names: Names = DEFAULT_NAMES) -> Plot | None:
    """The GPU-free estimate's predicted peak per setting (`trainer.estimate=true`), one
    horizontal bar each with its value, against the GPU memory it is set against (the cap asked
    for, or the measuring GPU's), a dashed line named in the legend; a bar past it is hatched
    (does not fit): what fits before a GPU is rented. The axis names the batch and image size
    when a panel has one of each."""
    from memtrain.report.markdown import ESTIMATES, gpu_memory_named

    col = ESTIMATES[0]
    if col not in agg or agg[col].notna().sum() == 0:
        return None
    div, unit = byte_unit(agg[col])
    styles, ps = setting_styles(agg), panels(agg, names)
    fig, axes = style.subplots(len(ps))
    drawn, extra, sizes = [], {}, {}
    for ax, (title, g) in zip(axes, ps):
        g = order_settings(g)
        g = g[g[col].notna()]
        cap, what = gpu_memory_named(g)
        ys = list(range(len(g)))[::-1]
        top = max([*(g[col] / div), cap / div if cap == cap else 0.0])
        for y, (_, r) in zip(ys, g.iterrows()):
            v = r[col] / div
            over = cap == cap and r[col] > cap
            ax.barh([y], [v], color=styles[r["label"]]["color"], height=0.7,
                    hatch="///" if over else None, edgecolor="white" if over else None,
                    linewidth=0)
            ax.annotate(f"{v:.3g}", (v, y), xytext=(2, 0), textcoords="offset points",
                        va="center", ha="left", fontsize="small", zorder=4,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3,
                              "alpha": 0.8})  # readable where the line crosses it
            drawn.append({"panel": title, "label": r["label"], "method": r["method"],
                          "predicted_peak_bytes": r[col],
                          "predicted_rel": r.get("mem_estimate_rel"),
                          **({"gpu_memory_bytes": cap, "fits": not over} if cap == cap else {})})
        ax.set_yticks(ys, list(g["label"]))
        size = [f"{k} {g[c].iloc[0]:g}{u}".strip() for c, k, u in
                (("trainer.batch_size", "batch", ""), ("dataset.image_size", "", " px"))
                if c in g and g[c].nunique() == 1 and pd.notna(g[c].iloc[0])]
        if size:
            sizes[title] = ", ".join(size)
        ax.set(title=title, xlabel=f"predicted peak ({unit})")
        if cap == cap:  # named in the legend under the figure: inside, it hid a bar
            line = ax.axvline(cap / div, color="#c00000", linestyle="--",
                              linewidth=style.line_width(0.8))
            extra[f"{cap / div:.3g} {unit}: {what}"] = line
            if any(d.get("fits") is False for d in drawn if d["panel"] == title):
                extra["over it: does not fit"] = Patch(facecolor="#888888", hatch="///",
                                                       edgecolor="white")
        ax.set_xlim(0, top * 1.15)  # room for the values at the bars' ends
        ax.xaxis.set_major_locator(MaxNLocator(4))
    # the settings are the bars' names: the legend holds only the line and the hatching
    finish(fig, styles, [], tuple((h, text) for text, h in extra.items()))
    at = "; ".join(f"{t}: {v}" for t, v in sizes.items())
    return Plot("estimates", fig, pd.DataFrame(drawn),
                f"The GPU-free estimate's predicted peak of one training step "
                f"(`mem_estimate_bytes`: fake tensors, nothing trained){f' ({at})' if at else ''}"
                f"; a hatched bar does not fit the GPU memory it is set against (the dashed "
                f"line).")


def _makers(agg: pd.DataFrame, metrics: pd.DataFrame, mem: Memory, baseline: str,
            names: Names) -> dict:
    """Each figure's maker and the reason it was not drawn when it makes none (None: say
    nothing), in the order report.md shows them."""
    return {  # the cost figure first
        "cost": (lambda: cost(agg, mem, baseline, names), "no accuracy or timing against "
                                                         "the baseline"),
        "tradeoff": (lambda: tradeoff(agg, mem, baseline, names), "no test accuracy"),
        "breakdown": (lambda: breakdown(agg, names), "no memory breakdown columns"),
        "throughput": (lambda: throughput(agg, mem, names), "no throughput or memory"),
        "curves": (lambda: curves(agg, metrics, names), "no setting evaluated twice or more"),
        "sequence": (lambda: sequence(agg, names), None),  # only when seq_len varies
        "sharding": (lambda: sharding(agg, names), None),  # only when the world size varies
        "budget": (lambda: budget(agg, mem, baseline, names),
                   "no measured method=checkpoint run with a method.budget_fraction"),
        "failures": (lambda: failures(agg, names), "every run ended ok"),
        "estimates": (lambda: estimates(agg, names), None),  # only when estimated: no note
    }


# the figures `all_plots` can draw (memtrain-report --figures names them); the makers are not
# called here
FIGURES = tuple(_makers(None, None, None, "none", DEFAULT_NAMES))


def all_plots(agg: pd.DataFrame, metrics: pd.DataFrame, mem: Memory, baseline: str = "none",
              names: Names = DEFAULT_NAMES, only: Collection[str] | None = None
              ) -> tuple[list[Plot], dict[str, str]]:
    """Every applicable figure (of `only`'s names, if given), and for the others the reason
    they were not drawn."""
    makers = _makers(agg, metrics, mem, baseline, names)
    made, why = [], {}
    for name, (make, reason) in makers.items():
        if only is not None and name not in only:
            continue
        try:
            p = make()
        except KeyError as e:  # e.g. every job failed before its timed steps: no throughput
            why[name] = f"no {e.args[0]} column in any run"
            continue
        if p is None:
            if reason is not None:
                why[name] = reason
        else:
            made.append(p)
    return made, why


@style.styled
def save(plot: Plot, folder, formats=("png", "pdf"), png: dict | None = None) -> list:
    """Write the figure in each format and its drawn data as CSV; close the figure. `png`: a
    dict that gets the figure's PNG bytes under its name (report.html embeds them; drawn in
    memory when the formats have no PNG)."""
    import io
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        p = folder / f"{plot.name}.{fmt}"
        plot.fig.savefig(p)
        paths.append(p)
        if png is not None and fmt == "png":
            png[plot.name] = p.read_bytes()
    if png is not None and plot.name not in png:
        buf = io.BytesIO()
        plot.fig.savefig(buf, format="png")
        png[plot.name] = buf.getvalue()
    plot.data.to_csv(folder / f"{plot.name}.csv", index=False)
    plt.close(plot.fig)
    return paths
