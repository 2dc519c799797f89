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
from matplotlib.text import Text
from matplotlib.ticker import ScalarFormatter

from memtrain.report import derive, style
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
    caption: str = ""  # what the axes mean, in full (report.md prints it under the figure)


def ok_rows(g: pd.DataFrame) -> pd.DataFrame:
    """Settings with at least one run that ended ok."""
    return g[g["n_ok"] > 0]


def failed_lines(g: pd.DataFrame) -> list[str]:
    """Settings with a failed run: not drawn (no run ok) or drawn from the runs that were."""
    return [f"{'failed' if r.n_ok == 0 else 'mean of ok runs'}: {r.label} ({r.status})"
            for r in g.itertuples() if r.worst_status != "ok"]


def not_learned(g: pd.DataFrame) -> list[str]:
    """'did not learn: synthetic (2/3 runs): test accuracy 10.1%, chance 10.0%; each phase on
    its own task: part0 21%, part1 100%' for each drawn setting with a run that did not learn
    (`learned` false: memtrain.run.learned), so a hollow point says why."""
    out = []
    for _, r in ok_rows(g).iterrows():
        if not is_true(r.get("did_not_learn")):
            continue
        runs = f"{int(r['n_not_learned'])}/{int(r['n_ok'])} runs"
        if str(r.get("metric")) == "test_loss":
            what = (f"validation loss {r.get('test_loss'):.3g}, unigram "
                    f"{r.get('unigram_loss'):.3g}")
        else:
            what = f"test accuracy {100 * r.get('test_acc'):.1f}%"
            if pd.notna(r.get("chance_acc")):
                what += f", chance {100 * r['chance_acc']:.1f}%"
        own = [f"{p} {100 * r[f'{p}.test_acc']:.0f}%" for p in derive.phases(g)
               if pd.notna(r.get(f"{p}.test_acc"))]
        phases = f"; each phase on its own task: {', '.join(own)}" if own else ""
        out.append(f"did not learn: {r['label']} ({runs}): {what}{phases}")
    return out


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
    """Plain axes (`plain_axes`), tight layout, then the shared legend of the settings drawn
    (and `extra` entries)."""
    plain_axes(fig)
    fig.tight_layout(pad=0.3, h_pad=1.2)
    style.shared_legend(fig, styles, labels, extra)
    _notes_legend(fig, fig.legends[-1] if fig.legends else None)


# A linear axis whose data span less than this (relative to the values, absolute near 0) shows
# float noise (identical seeds' 1e-17): it is widened to MIN_HALF_SPAN around its centre.
TINY_SPAN = 1e-9
MIN_HALF_SPAN = 1.0


def plain_axes(fig) -> None:
    """Every axis of `fig` states its ticks' own values: no offset, and a linear axis whose
    limits span only float noise widened around its centre (a span of 1e-17 drew ticks 0-2.5
    under a '1e-17' offset)."""
    for ax in fig.axes:
        for axis, get, put in ((ax.xaxis, ax.get_xlim, ax.set_xlim),
                               (ax.yaxis, ax.get_ylim, ax.set_ylim)):
            fmt = axis.get_major_formatter()
            if isinstance(fmt, ScalarFormatter):
                fmt.set_useOffset(False)
            if axis.get_scale() != "linear":
                continue
            lo, hi = get()
            if abs(hi - lo) < TINY_SPAN * max(1.0, abs(lo), abs(hi)):
                mid = (lo + hi) / 2
                half = max(MIN_HALF_SPAN, 0.05 * abs(mid))
                put(mid - half, mid + half)


# ---------------------------------------------------------------- layout checks


def _drawn_ticks(ax) -> set[int]:
    """ids of the tick labels matplotlib draws (those inside the view; the rest keep stale
    positions)."""
    out = set()
    for axis in (ax.xaxis, ax.yaxis):
        for tick in axis._update_ticks():
            out |= {id(tick.label1), id(tick.label2)}
    return out


def visible_texts(fig) -> list[tuple[Text, object]]:
    """(text, its box in display pixels) of every piece of text drawn on `fig` (drawn
    already: `layout_problems` draws it)."""
    renderer = fig.canvas.get_renderer()
    ticks, all_ticks = set(), set()
    for ax in fig.axes:
        if ax.get_visible():
            ticks |= _drawn_ticks(ax)
        for axis in (ax.xaxis, ax.yaxis):
            for tick in (*axis.get_major_ticks(), *axis.get_minor_ticks()):
                all_ticks |= {id(tick.label1), id(tick.label2)}
    out = []
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip():
            continue
        if id(t) in all_ticks and id(t) not in ticks:
            continue
        if not _shown(t):
            continue
        out.append((t, t.get_window_extent(renderer)))
    return out


def _shown(artist) -> bool:
    """Whether the artist and every parent it hangs from (an axes, a legend) is visible."""
    ax = getattr(artist, "axes", None)
    return ax is None or ax.get_visible()


def overlapping_texts(fig, slack: float = 1.0) -> list[str]:
    """'"a" over "b"' for every two texts of `fig` (drawn) whose boxes overlap by more than
    `slack` pixels both ways."""
    boxes = visible_texts(fig)
    out = []
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1:]:
            w = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
            h = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
            if w > slack and h > slack:
                out.append(f"{a.get_text()!r} over {b.get_text()!r}")
    return out


def offset_texts(fig) -> list[str]:
    """The offset or exponent texts drawn beside any axis of `fig` (drawn: '1e-17', '+1')."""
    return [t for ax in fig.axes if ax.get_visible()
            for t in (ax.xaxis.get_offset_text().get_text(), ax.yaxis.get_offset_text().get_text())
            if t]


def layout_problems(fig) -> list[str]:
    """What makes a figure unreadable: overlapping texts, offset notation, axis labels over one
    line (the figure drawn once, at its own size and dpi)."""
    fig.canvas.draw()
    labels = [f"axis label over one line: {lab!r}" for ax in fig.axes if ax.get_visible()
              for lab in (ax.get_xlabel(), ax.get_ylabel()) if "\n" in lab]
    return [*overlapping_texts(fig), *(f"offset notation {t!r}" for t in offset_texts(fig)),
            *labels]


def drawn_labels(data: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(data["label"])) if "label" in data else []
