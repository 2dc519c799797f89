"""Settings table -> the paper's figures. Each function returns a Plot (the figure and a frame of
exactly the values it drew, saved beside it) or None when the figure does not apply.

Input is the seed-aggregated table (`tables.aggregate_seeds` after `add_baselines`): one row per
setting, `<col>` the mean over seeds and `<col>_std` the standard deviation (the error bars).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from memtrain.report import style
from memtrain.report.style import Memory, byte_unit, order_settings, panels, setting_styles

# fontTools reports every glyph table it subsets at INFO; under Hydra's logging that is ~160
# lines per PDF report. Its warnings still show.
logging.getLogger("fontTools").setLevel(logging.WARNING)

BREAKDOWN = (("params", "parameters"), ("grads", "gradients"), ("optim", "optimizer state"),
             ("act", "activations"), ("other", "other"))
BREAKDOWN_COLORS = ("#4c72b0", "#8da0cb", "#a6d854", "#fc8d62", "#d9d9d9")


@dataclass
class Plot:
    name: str
    fig: Figure
    data: pd.DataFrame  # one row per drawn point or bar: panel, label, x, y (and errors)


def _ok(g: pd.DataFrame) -> pd.DataFrame:
    return g[g["n_ok"] > 0]


def _std(g: pd.DataFrame, col: str) -> pd.Series:
    s = f"{col}_std"
    return g[s].fillna(0.0) if s in g else pd.Series(0.0, index=g.index)


def _note(ax, lines: list[str], handles: tuple = (), labels: tuple = ()) -> None:
    """An in-panel legend (placed where no data is) with `handles` and the settings the panel
    cannot show: nothing is dropped silently."""
    from matplotlib.lines import Line2D

    x = Line2D([], [], linestyle="none", marker="x", color="#b00000", markersize=3)
    miss = [x] * len(lines)
    if lines or handles:
        leg = ax.legend([*handles, *miss], [*labels, *lines], loc="best", frameon=True,
                        framealpha=0.85, edgecolor="none", fontsize=5, handlelength=1.2)
        for t in leg.get_texts()[len(handles):]:
            t.set_color("#b00000")


def _failed_lines(g: pd.DataFrame) -> list[str]:
    """Settings with a failed run: not drawn (no run ok) or drawn from the runs that were."""
    return [f"{'failed' if r.n_ok == 0 else 'mean of ok runs'}: {r.label} ({r.status})"
            for r in g.itertuples() if r.worst_status != "ok"]


def _points(ax, g: pd.DataFrame, x: str, y: str, styles: dict, panel: str,
            xscale: float = 1.0, yscale: float = 1.0) -> list[dict]:
    """Mean points with std error bars (both axes), one Line2D per setting, labelled."""
    drawn = []
    for _, r in order_settings(g).iterrows():
        xv, yv = r[x] / xscale, r[y] / yscale
        xe, ye = (r.get(f"{x}_std") or 0.0) / xscale, (r.get(f"{y}_std") or 0.0) / yscale
        if pd.isna(xv) or pd.isna(yv):
            continue
        st = styles[r["label"]]
        ax.errorbar([xv], [yv], xerr=[0 if pd.isna(xe) else xe], yerr=[0 if pd.isna(ye) else ye],
                    fmt="none", ecolor=st["color"], elinewidth=0.6, capsize=1.5, alpha=0.8)
        ax.plot([xv], [yv], linestyle="none", label=r["label"], markeredgecolor="white",
                markeredgewidth=0.4, zorder=3, **st)
        drawn.append({"panel": panel, "label": r["label"], "method": r["method"], "x": xv,
                      "y": yv, "xerr": xe, "yerr": ye})
    return drawn


def _finish(fig, axes, styles, labels) -> None:
    fig.tight_layout(pad=0.3, h_pad=1.2)
    style.shared_legend(fig, styles, labels)


# ---------------------------------------------------------------- 1. memory-accuracy trade-off


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


@style.styled
def tradeoff(agg: pd.DataFrame, mem: Memory, baseline: str = "none") -> Plot | None:
    """Memory relative to the baseline against test accuracy, one panel per model."""
    rel = agg[mem.rel].notna().any()
    xcol, xlab = (mem.rel, mem.axis(baseline)) if rel else (mem.col, mem.axis(unit="MiB"))
    xscale = 1.0 if rel else 2**20
    if agg["test_acc"].notna().sum() == 0:
        return None
    styles, ps = setting_styles(agg), panels(agg)
    fig, axes = style.subplots(len(ps))
    drawn = []
    for ax, (title, g) in zip(axes, ps):
        ok = _ok(g)
        pts = _points(ax, ok, xcol, "test_acc", styles, title, xscale=xscale, yscale=0.01)
        drawn += pts
        if pts:
            p = pd.DataFrame(pts)
            idx = pareto_front(p["x"], p["y"])
            ax.plot(p["x"].iloc[idx], p["y"].iloc[idx], drawstyle="steps-post", color="#999999",
                    linestyle="--", linewidth=0.7, zorder=1, label="_pareto")
            for i in idx:
                drawn[len(drawn) - len(pts) + i]["pareto"] = True
        if rel:
            ax.axvline(1.0, color="#bbbbbb", linewidth=0.6, linestyle=":", zorder=0)
        skipped = [f"no baseline: {r.label}" for r in ok.itertuples() if pd.isna(getattr(r, xcol))]
        front = ax.plot([], [], color="#999999", linestyle="--", linewidth=0.7)
        _note(ax, _failed_lines(g) + skipped, front, ["Pareto front"])
        ax.set(title=title, xlabel=xlab, ylabel="test accuracy (%)")
    data = pd.DataFrame(drawn)
    data["pareto"] = data.get("pareto", False)
    data["pareto"] = data["pareto"].fillna(False).astype(bool)
    _finish(fig, axes, styles, list(dict.fromkeys(data["label"])))
    return Plot("tradeoff", fig, data)


# ---------------------------------------------------------------- 2. memory breakdown


@style.styled
def breakdown(agg: pd.DataFrame) -> Plot | None:
    """Stacked horizontal bars of memory at the peak, by kind, one bar per setting."""
    cols = [f"mem_at_peak_{k}_bytes" for k, _ in BREAKDOWN]
    if not all(c in agg for c in cols):
        return None
    have = agg[agg[cols].notna().any(axis=1)]
    if have.empty:
        return None
    div, unit = byte_unit(have[cols].sum(axis=1))
    styles, ps = setting_styles(agg), panels(have)
    heights = max(len(g) for _, g in ps) * 0.22 + 0.9
    fig, axes = style.subplots(len(ps), height=heights)
    drawn = []
    for ax, (title, g) in zip(axes, ps):
        g = order_settings(g).iloc[::-1]  # baseline on top
        left = pd.Series(0.0, index=g.index)
        for (kind, name), col, color in zip(BREAKDOWN, cols, BREAKDOWN_COLORS):
            w = g[col].fillna(0.0) / div
            ax.barh(g["label"], w, left=left, color=color, label=name, height=0.7,
                    edgecolor="white", linewidth=0.3)
            drawn += [{"panel": title, "label": lb, "kind": kind, "left": lf, "width": v}
                      for lb, lf, v in zip(g["label"], left, w)]
            left = left + w
        for tick, lb in zip(ax.get_yticklabels(), g["label"]):
            tick.set_color(styles[lb]["color"])
        for y, (_, r) in enumerate(g.iterrows()):
            if r["n_ok"] == 0:  # memory of the failed step, still shown, and said so
                ax.text(left[r.name], y, f" {r['status']}", va="center", fontsize=5,
                        color="#b00000")
        ax.grid(axis="y", visible=False)
        src = agg["mem_peak_source"].dropna().unique() if "mem_peak_source" in agg else []
        where = "CPU live-tensor tracker" if set(src) == {"tracker"} else "CUDA" \
            if set(src) == {"cuda"} else "measured"
        ax.set(title=title, xlabel=f"memory at the peak, {unit} ({where})")
    fig.tight_layout(pad=0.3, h_pad=1.2)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=5,
               frameon=False, handlelength=1.0, columnspacing=0.8)
    return Plot("breakdown", fig, pd.DataFrame(drawn))


# ---------------------------------------------------------------- 3. throughput against memory


@style.styled
def throughput(agg: pd.DataFrame, mem: Memory) -> Plot | None:
    """Training throughput (samples/s) against memory, one panel per model."""
    if agg["throughput_samples_s"].notna().sum() == 0 or agg[mem.col].notna().sum() == 0:
        return None
    div, unit = byte_unit(agg[mem.col])
    styles, ps = setting_styles(agg), panels(agg)
    fig, axes = style.subplots(len(ps))
    drawn = []
    for ax, (title, g) in zip(axes, ps):
        drawn += _points(ax, _ok(g), mem.col, "throughput_samples_s", styles, title, xscale=div)
        _note(ax, _failed_lines(g))
        ax.set(title=title, xlabel=mem.axis(unit=unit), ylabel="throughput (samples/s)")
    data = pd.DataFrame(drawn)
    _finish(fig, axes, styles, list(dict.fromkeys(data["label"])))
    return Plot("throughput", fig, data)


# ---------------------------------------------------------------- 4. learning curves


@style.styled
def curves(agg: pd.DataFrame, metrics: pd.DataFrame) -> Plot | None:
    """Test accuracy after each epoch, mean over seeds with a std band, one line per setting.

    Applies when some setting was evaluated after two or more epochs.
    """
    acc = metrics[(metrics["split"] == "test") & (metrics["name"] == "acc")]
    if acc.empty:
        return None
    # a run belongs to one setting (row of agg); labels repeat across models, rows do not
    owner = {d: i for i, dirs in agg["run_dirs"].items() for d in dirs.split(";")}
    acc = acc.assign(setting=acc["run_dir"].map(owner), value=pd.to_numeric(acc["value"]),
                     epoch=pd.to_numeric(acc["epoch"]) + 1)
    acc = acc.dropna(subset=["setting"])
    per = acc.groupby(["setting", "epoch"])["value"].agg(["mean", "std", "count"]).reset_index()
    if per.empty or per.groupby("setting")["epoch"].nunique().max() < 2:
        return None
    styles, ps = setting_styles(agg), panels(agg)
    fig, axes = style.subplots(len(ps))
    drawn = []
    for ax, (title, g) in zip(axes, ps):
        for i, lb in order_settings(g)["label"].items():
            c = per[per["setting"] == i].sort_values("epoch")
            if c.empty:
                continue
            st = styles[lb]
            y, e = c["mean"] * 100, c["std"].fillna(0.0) * 100
            ax.plot(c["epoch"], y, label=lb, color=st["color"], marker=st["marker"],
                    markersize=2.5)
            ax.fill_between(c["epoch"], y - e, y + e, color=st["color"], alpha=0.15, linewidth=0)
            drawn += [{"panel": title, "label": lb, "x": x, "y": v, "yerr": s, "n": n}
                      for x, v, s, n in zip(c["epoch"], y, e, c["count"])]
        ax.set(title=title, xlabel="epoch", ylabel="test accuracy (%)")
        ax.xaxis.get_major_locator().set_params(integer=True)
    data = pd.DataFrame(drawn)
    _finish(fig, axes, styles, list(dict.fromkeys(data["label"])))
    return Plot("curves", fig, data)


# ---------------------------------------------------------------- 5. checkpoint budget curve

# strategy -> the annotation of its fraction
SERIES = {"budget": "b", "compile": "amb"}


@style.styled
def budget(agg: pd.DataFrame, mem: Memory, baseline: str = "none") -> Plot | None:
    """Memory against step-time overhead: one series per strategy whose fraction means
    something, joined in fraction order (budget: `b=` the planner's fraction of the activation
    peak, solid; compile: `amb=` torch's activation_memory_budget, 0 = recompute everything,
    1 = the default partitioner, dotted), every other setting of the model as a point.

    Applies when runs with method=checkpoint and a method.budget_fraction exist.
    """
    col = "method.budget_fraction"
    if col not in agg:
        return None
    # Runs without a strategy column predate the other strategies: the planner's budget.
    strategies = agg.get("method.strategy", pd.Series("budget", index=agg.index)).fillna("budget")
    is_b = (agg["method"] == "checkpoint") & agg[col].notna() & strategies.isin(list(SERIES))
    if not is_b.any():
        return None
    agg = agg.assign(overhead_pct=(agg["step_time_rel"] - 1) * 100,
                     overhead_pct_std=agg.get("step_time_rel_std", 0.0) * 100)
    styles, ps = setting_styles(agg), panels(agg[agg["model"].isin(agg.loc[is_b, "model"])])
    fig, axes = style.subplots(len(ps))
    drawn = []
    for ax, (title, g) in zip(axes, ps):
        ok = _ok(g)
        drawn += _points(ax, ok, "overhead_pct", mem.rel, styles, title)
        for strategy, tag in SERIES.items():  # the two fractions mean different things
            b = ok[is_b.loc[ok.index] & (strategies.loc[ok.index] == strategy)].sort_values(col)
            b = b[b["overhead_pct"].notna() & b[mem.rel].notna()]
            if b.empty:
                continue
            color = style.method_color("checkpoint")
            ax.plot(b["overhead_pct"], b[mem.rel], color=color, linewidth=0.8, zorder=2,
                    label=f"_{strategy}", linestyle="-" if strategy == "budget" else ":")
            for _, r in b.iterrows():
                ax.annotate(f"{tag}={r[col]:g}", (r["overhead_pct"], r[mem.rel]), fontsize=5,
                            textcoords="offset points", xytext=(3, 2), color=color)
        _note(ax, _failed_lines(g))
        ax.set(title=title, xlabel=f"step-time overhead vs {baseline} (%)",
               ylabel=mem.axis(baseline))
    data = pd.DataFrame(drawn)
    _finish(fig, axes, styles, list(dict.fromkeys(data["label"])))
    return Plot("budget", fig, data)


# ---------------------------------------------------------------- 6. failure map


@style.styled
def failures(agg: pd.DataFrame) -> Plot | None:
    """Settings x model grid coloured by the worst status, each cell saying e.g. 'oom 1/3'.

    Applies when any run did not end ok.
    """
    if (agg["worst_status"] == "ok").all():
        return None
    agg = order_settings(agg)
    labels = list(dict.fromkeys(agg["label"]))
    cols = [t for t, _ in panels(agg)]
    several = agg["dataset"].nunique() > 1
    col_of = (agg["model"] + " / " + agg["dataset"]) if several else agg["model"].astype(str)
    width = min(2 * style.COLUMN_IN, 1.4 + 0.75 * len(cols) + 0.045 * max(map(len, labels)))
    fig, ax = plt.subplots(figsize=(width, 0.6 + 0.2 * len(labels)))
    drawn = []
    for (_, r), c in zip(agg.iterrows(), col_of):
        x, y = cols.index(c), labels.index(r["label"])
        color = style.STATUS_COLORS.get(r["worst_status"], "#bdbdbd")
        ax.add_patch(plt.Rectangle((x - 0.48, y - 0.45), 0.96, 0.9, color=color, linewidth=0))
        text = f"ok {r['n_runs']}/{r['n_runs']}" if r["status"] == "ok" else r["status"]
        ax.text(x, y, text.replace(", ", "\n"), ha="center", va="center", fontsize=5)
        drawn.append({"panel": c, "label": r["label"], "status": r["status"], "text": text,
                      "worst_status": r["worst_status"], "x": x, "y": y})
    ax.set(xlim=(-0.5, len(cols) - 0.5), ylim=(len(labels) - 0.5, -0.5),
           xticks=range(len(cols)), yticks=range(len(labels)), title="run status per setting")
    ax.set_xticklabels(cols)
    ax.set_yticklabels(labels)
    ax.grid(False)
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    fig.tight_layout(pad=0.3, h_pad=1.2)
    return Plot("failures", fig, pd.DataFrame(drawn))


def all_plots(agg: pd.DataFrame, metrics: pd.DataFrame, mem: Memory,
              baseline: str = "none") -> tuple[list[Plot], dict[str, str]]:
    """Every applicable figure, and for the others the reason they were not drawn."""
    makers = {
        "tradeoff": (lambda: tradeoff(agg, mem, baseline), "no test accuracy"),
        "breakdown": (lambda: breakdown(agg), "no memory breakdown columns"),
        "throughput": (lambda: throughput(agg, mem), "no throughput or memory"),
        "curves": (lambda: curves(agg, metrics), "no setting evaluated after 2+ epochs"),
        "budget": (lambda: budget(agg, mem, baseline),
                   "no method=checkpoint runs with method.budget_fraction"),
        "failures": (lambda: failures(agg), "every run ended ok"),
    }
    made, why = [], {}
    for name, (make, reason) in makers.items():
        try:
            p = make()
        except KeyError as e:  # e.g. every job failed before its timed steps: no throughput
            why[name] = f"no {e.args[0]} column in any run"
            continue
        if p is None:
            why[name] = reason
        else:
            made.append(p)
    return made, why


@style.styled
def save(plot: Plot, folder, formats=("png", "pdf")) -> list:
    """Write the figure in each format and its drawn data as CSV; close the figure."""
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        p = folder / f"{plot.name}.{fmt}"
        plot.fig.savefig(p)
        paths.append(p)
    plot.data.to_csv(folder / f"{plot.name}.csv", index=False)
    plt.close(plot.fig)
    return paths
