"""What every report figure shares: the Plot record, points with error bars, the notes of
settings a panel cannot show, the legends under the panels.

Input of every figure is the seed-aggregated table (`tables.aggregate_seeds` after
`add_baselines`): one row per setting, `<col>` the mean over seeds and `<col>_std` the standard
deviation (the error bars).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from memtrain.report import style
from memtrain.report.style import order_settings

# fontTools reports every glyph table it subsets at INFO; under Hydra's logging that is ~160
# lines per PDF report. Its warnings still show.
logging.getLogger("fontTools").setLevel(logging.WARNING)

FAILED_COLOR = "#b00000"


@dataclass
class Plot:
    name: str
    fig: Figure
    data: pd.DataFrame  # one row per drawn point or bar: panel, label, x, y (and errors)


def ok_rows(g: pd.DataFrame) -> pd.DataFrame:
    """Settings with at least one run that ended ok."""
    return g[g["n_ok"] > 0]


def failed_lines(g: pd.DataFrame) -> list[str]:
    """Settings with a failed run: not drawn (no run ok) or drawn from the runs that were."""
    return [f"{'failed' if r.n_ok == 0 else 'mean of ok runs'}: {r.label} ({r.status})"
            for r in g.itertuples() if r.worst_status != "ok"]


def coincident(drawn: list[dict], keys: tuple[str, ...] = ("x", "y")) -> list[str]:
    """'same values: none, prune' for each group of settings drawn at the same place (equal to
    4 significant digits; for a curve, every point): one would hide the other."""
    where: dict[tuple, list[str]] = {}
    for d in drawn:
        where.setdefault(d["label"], []).append(tuple(f"{d[k]:.4g}" for k in keys))
    groups: dict[tuple, list[str]] = {}
    for label, pts in where.items():
        groups.setdefault(tuple(sorted(pts)), []).append(label)
    return [f"same values: {', '.join(g)}" for g in groups.values() if len(g) > 1]


def note(ax, lines: list[str], handles: tuple = (), labels: tuple = (),
         panel: str | None = None) -> None:
    """Record what a panel must say beside its data: `handles`/`labels` (e.g. the Pareto front,
    settings drawn at the same place) and the settings it cannot show (`lines`, red): nothing is
    dropped silently. `finish` draws them under the figure, where they hide no data."""
    ax.memtrain_panel = panel or ax.get_title()
    ax.memtrain_notes = [*zip(handles, labels, [False] * len(labels)),
                         *((None, line, True) for line in lines)]


def _notes_legend(fig, below) -> None:
    """One legend of every panel's notes under `below` (a legend), prefixed by the panel when
    the figure has several; failed settings in red."""
    axes = [ax for ax in fig.axes if hasattr(ax, "memtrain_panel")]
    several = len({ax.memtrain_panel for ax in axes}) > 1
    cross = Line2D([], [], linestyle="none", marker="x", color=FAILED_COLOR,
                   markersize=style.marker_size(0.75))
    entries: dict[str, tuple] = {}
    for ax in axes:
        for handle, text, red in getattr(ax, "memtrain_notes", []):
            text = f"{ax.memtrain_panel}: {text}" if several else text
            entries.setdefault(text, (cross if red else handle, red))
    if not entries:
        return
    y = 0.0
    if below is not None and not style.current().legend_right:
        box = below.get_window_extent(fig.canvas.get_renderer())
        y = box.transformed(fig.transFigure.inverted()).y0
    leg = fig.legend([h for h, _ in entries.values()], list(entries), loc="upper center",
                     bbox_to_anchor=(0.5, y), frameon=False, fontsize="small",
                     handlelength=1.2)
    for t, (_, red) in zip(leg.get_texts(), entries.values()):
        if red:
            t.set_color(FAILED_COLOR)


def is_true(v) -> bool:
    """True for a set flag (Python or NumPy bool, 1); False for unset, false or missing."""
    return v is not None and not pd.isna(v) and bool(v)


def hollow(st: dict) -> dict:
    """The style of a flagged point: the same marker, white inside."""
    return {**st, "markerfacecolor": "white"}


def _clipped(v: float, err: float, rng: tuple[float, float] | None) -> tuple[float, float]:
    """(below, above) of an error bar of half-width `err` at `v`, stopped at the range's ends (a
    std wider than the mean would draw an accuracy below 0% or an overhead below -100%)."""
    if rng is None:
        return err, err
    return max(0.0, min(err, v - rng[0])), max(0.0, min(err, rng[1] - v))


def points(ax, g: pd.DataFrame, x: str, y: str, styles: dict, panel: str, xscale: float = 1.0,
           yscale: float = 1.0, flag: str | None = None,
           yrange: tuple[float, float] | None = None,
           xrange: tuple[float, float] | None = None) -> list[dict]:
    """Mean points with std error bars (both axes), one Line2D per setting, labelled. Settings
    whose `flag` column is true are drawn hollow. `yrange`: the metric's range (an accuracy's
    0-100%), where the error bars stop (`yerr_low`, `yerr_high` in the data)."""
    drawn = []
    for _, r in order_settings(g).iterrows():
        xv, yv = r[x] / xscale, r[y] / yscale
        xe, ye = (r.get(f"{x}_std") or 0.0) / xscale, (r.get(f"{y}_std") or 0.0) / yscale
        if pd.isna(xv) or pd.isna(yv):
            continue
        xe, ye = (0.0 if pd.isna(xe) else xe), (0.0 if pd.isna(ye) else ye)
        low, high = _clipped(yv, ye, yrange)
        xlow, xhigh = _clipped(xv, xe, xrange)
        flagged = bool(flag) and is_true(r.get(flag))
        st = hollow(styles[r["label"]]) if flagged else styles[r["label"]]
        ax.errorbar([xv], [yv], xerr=[[xlow], [xhigh]], yerr=[[low], [high]],
                    fmt="none", ecolor=st["color"], elinewidth=style.line_width(0.6),
                    capsize=style.marker_size(0.4), alpha=0.8)
        ax.plot([xv], [yv], linestyle="none", label=r["label"],
                markeredgecolor=st["color"] if flagged else "white", markeredgewidth=0.6,
                zorder=3, **st)
        row = {"panel": panel, "label": r["label"], "method": r["method"], "x": xv, "y": yv,
               "xerr": xe, "yerr": ye, "yerr_low": low, "yerr_high": high}
        if flag:
            row[flag] = flagged
        drawn.append(row)
    return drawn


def finish(fig, styles: dict, labels: list[str], extra: tuple = ()) -> None:
    """Tight layout, then the shared legend of the settings drawn (and `extra` entries)."""
    fig.tight_layout(pad=0.3, h_pad=1.2)
    style.shared_legend(fig, styles, labels, extra)
    _notes_legend(fig, fig.legends[-1] if fig.legends else None)


def drawn_labels(data: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(data["label"])) if "label" in data else []
