"""What every report figure shares: the Plot record, points with error bars, the in-panel note of
settings a panel cannot show, the legend under the panels.

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


def note(ax, lines: list[str], handles: tuple = (), labels: tuple = ()) -> None:
    """An in-panel legend (placed where no data is) with `handles` and the settings the panel
    cannot show, in red: nothing is dropped silently."""
    cross = Line2D([], [], linestyle="none", marker="x", color=FAILED_COLOR,
                   markersize=style.marker_size(0.75))
    if lines or handles:
        leg = ax.legend([*handles, *[cross] * len(lines)], [*labels, *lines], loc="best",
                        frameon=True, framealpha=0.85, edgecolor="none", fontsize="x-small",
                        handlelength=1.2)
        for t in leg.get_texts()[len(handles):]:
            t.set_color(FAILED_COLOR)


def is_true(v) -> bool:
    """True for a set flag (Python or NumPy bool, 1); False for unset, false or missing."""
    return v is not None and not pd.isna(v) and bool(v)


def hollow(st: dict) -> dict:
    """The style of a flagged point: the same marker, white inside."""
    return {**st, "markerfacecolor": "white"}


def points(ax, g: pd.DataFrame, x: str, y: str, styles: dict, panel: str, xscale: float = 1.0,
           yscale: float = 1.0, flag: str | None = None) -> list[dict]:
    """Mean points with std error bars (both axes), one Line2D per setting, labelled. Settings
    whose `flag` column is true are drawn hollow."""
    drawn = []
    for _, r in order_settings(g).iterrows():
        xv, yv = r[x] / xscale, r[y] / yscale
        xe, ye = (r.get(f"{x}_std") or 0.0) / xscale, (r.get(f"{y}_std") or 0.0) / yscale
        if pd.isna(xv) or pd.isna(yv):
            continue
        flagged = bool(flag) and is_true(r.get(flag))
        st = hollow(styles[r["label"]]) if flagged else styles[r["label"]]
        ax.errorbar([xv], [yv], xerr=[0 if pd.isna(xe) else xe], yerr=[0 if pd.isna(ye) else ye],
                    fmt="none", ecolor=st["color"], elinewidth=style.line_width(0.6),
                    capsize=style.marker_size(0.4), alpha=0.8)
        ax.plot([xv], [yv], linestyle="none", label=r["label"],
                markeredgecolor=st["color"] if flagged else "white", markeredgewidth=0.6,
                zorder=3, **st)
        row = {"panel": panel, "label": r["label"], "method": r["method"], "x": xv, "y": yv,
               "xerr": xe, "yerr": ye}
        if flag:
            row[flag] = flagged
        drawn.append(row)
    return drawn


def finish(fig, styles: dict, labels: list[str], extra: tuple = ()) -> None:
    """Tight layout, then the shared legend of the settings drawn (and `extra` entries)."""
    fig.tight_layout(pad=0.3, h_pad=1.2)
    style.shared_legend(fig, styles, labels, extra)


def drawn_labels(data: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(data["label"])) if "label" in data else []
