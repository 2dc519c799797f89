"""Shared look of the report figures: two looks (a paper column, a slide), one colour per
method, the memory axis.

`paper` (default): one panel is a column (3.3 in) wide and fonts are 7 pt, so a figure placed
at its natural size in a two-column paper needs no rescaling. `slide`: one panel is 6 in wide
with 14 pt text, for a 16:9 slide. Sizes inside figures are relative ("small", markers scaled
from `lines.markersize`), so both looks come from the same code.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display, safe inside a Hydra job

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from memtrain import columns  # noqa: E402
from memtrain.columns import ACT_TEMP_PEAK, PEAK_SOURCE, SAVED  # noqa: E402
from memtrain.report.names import BASELINE_METHOD, METHODS, Names, method_order  # noqa: E402
from memtrain.report.names import DEFAULT as DEFAULT_NAMES  # noqa: E402

_BASE_RC = {
    "axes.grid": True, "grid.alpha": 0.4, "axes.spines.top": False, "axes.spines.right": False,
    "savefig.bbox": "tight", "savefig.pad_inches": 0.02, "pdf.fonttype": 42,
    # every tick says its own value: no "1e-17" or "+1" offset, no "1e6" exponent above an axis
    "axes.formatter.useoffset": False, "axes.formatter.limits": (-9, 12),
}


@dataclass(frozen=True)
class Look:
    """Figure sizes and rcParams of one output medium."""

    name: str
    panel_w: float  # inches, one panel
    panel_h: float
    rc: dict
    stacked: int  # panels stacked in one column up to this many, two columns beyond
    legend_col_in: float  # width of one legend column, inches
    legend_right: bool = False  # the settings' legend beside the panels (a slide is wide)


PAPER = Look("paper", 3.3, 2.3, {
    **_BASE_RC, "font.size": 7, "axes.titlesize": 7, "axes.labelsize": 7, "xtick.labelsize": 6,
    "ytick.labelsize": 6, "legend.fontsize": 6, "lines.markersize": 4, "lines.linewidth": 1.0,
    "axes.linewidth": 0.6, "grid.linewidth": 0.4, "savefig.dpi": 300}, 2, 1.6)
SLIDE = Look("slide", 6.0, 4.0, {
    **_BASE_RC, "font.size": 14, "axes.titlesize": 15, "axes.labelsize": 14,
    "xtick.labelsize": 12, "ytick.labelsize": 12, "legend.fontsize": 12, "lines.markersize": 8,
    "lines.linewidth": 2.0, "axes.linewidth": 1.0, "grid.linewidth": 0.6, "savefig.dpi": 200},
    1, 3.2, legend_right=True)
LOOKS = {"paper": PAPER, "slide": SLIDE}
_current = [PAPER]


def current() -> Look:
    return _current[-1]


@contextlib.contextmanager
def using(name: str):
    """Draw the figures made inside the block in look `name` (paper or slide)."""
    if name not in LOOKS:
        raise ValueError(f"style must be one of {', '.join(LOOKS)}, got {name!r}")
    _current.append(LOOKS[name])
    try:
        yield LOOKS[name]
    finally:
        _current.pop()


def marker_size(scale: float = 1.0) -> float:
    return current().rc["lines.markersize"] * scale


def line_width(scale: float = 1.0) -> float:
    return current().rc["lines.linewidth"] * scale


# Methods' order and colours: conf/report/methods.yaml (names.METHODS, names.method_order), so a
# method keeps its colour everywhere; one not listed there takes a spare colour, by its place.
SPARE_COLORS = ("#d62728", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#7f7f7f")
MARKERS = "osD^v<>pP*h"
# Light tints: the cell text (black) stays legible on every one of them.
STATUS_COLORS = {"ok": "#c7e9c0", "oom": "#fc9272", "diverged": "#fdd0a2", "error": "#bcbddc",
                 "interrupted": "#fee391", "running": "#e0e0e0", "missing": "#f5f5f5"}


def styled(fn):
    """Run a figure function under the current look's rcParams: text takes its size when
    created."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with plt.rc_context(current().rc):
            return fn(*args, **kwargs)

    return wrapper


def method_color(method: str) -> str:
    """The method's colour of conf/report/methods.yaml; a method without one takes a spare
    colour (one no listed method uses) by its place among those (names.method_order): the same
    in every figure, whichever methods a report holds."""
    if METHODS.get(method):
        return METHODS[method]
    spare = [c for c in SPARE_COLORS if c not in set(METHODS.values())] or list(SPARE_COLORS)
    others = [m for m in method_order([method]) if not METHODS.get(m)]
    return spare[others.index(method) % len(spare)]


def method_rank(methods: pd.Series) -> pd.Series:
    """Each row's method's place in the display order (names.method_order)."""
    order = {m: i for i, m in enumerate(method_order(methods.dropna().astype(str)))}
    return methods.astype(str).map(order).fillna(len(order)).astype(int)


def order_settings(agg: pd.DataFrame) -> pd.DataFrame:
    """Baseline first, then methods in the display order, then by label."""
    key = method_rank(agg["method"]).astype(str).str.zfill(3) + agg["label"]
    return agg.assign(_k=key).sort_values("_k").drop(columns="_k")


def setting_styles(agg: pd.DataFrame) -> dict[str, dict]:
    """label -> matplotlib style: colour by method, a marker of its own per setting (in study
    order), so settings that coincide (a method that changes nothing) or a grey print still
    tell apart; the baseline's marker is larger."""
    styles: dict[str, dict] = {}
    for _, r in order_settings(agg).iterrows():
        if r["label"] not in styles:
            # the baseline a size up: a setting that coincides with it shows inside its halo
            size = marker_size(1.4 if str(r["method"]) == BASELINE_METHOD else 1.0)
            styles[r["label"]] = {"color": method_color(str(r["method"])),
                                  "marker": MARKERS[len(styles) % len(MARKERS)],
                                  "markersize": size}
    return styles


def panels(agg: pd.DataFrame, names: Names = DEFAULT_NAMES) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) per model and dataset, in a stable order; the title names both
    ('MLP-6 / Fashion-MNIST')."""
    return [(names.panel(model, dataset), g)
            for (model, dataset), g in agg.groupby(["model", "dataset"], sort=True)]


def subplots(n: int, height: float | None = None):
    """A grid of n panels, each a panel wide (a paper column): stacked in one column up to
    `Look.stacked` panels, two columns beyond. Returns (fig, flat list of axes)."""
    look = current()
    ncols = 1 if n <= look.stacked else 2
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(look.panel_w * ncols,
                                                    (height or look.panel_h) * nrows),
                             squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def shared_legend(fig, styles: dict[str, dict], labels: list[str], extra: tuple = ()) -> None:
    """One legend under the panels, in the study order: a setting looks the same everywhere.
    `extra`: (handle, text) pairs after the settings (e.g. what a hollow marker means)."""
    from matplotlib.lines import Line2D

    labels = [lb for lb in styles if lb in set(labels)]
    handles = [Line2D([], [], linestyle="none", **styles[lb]) for lb in labels]
    handles += [h for h, _ in extra]
    labels += [t for _, t in extra]
    if current().legend_right:
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5),
                   frameon=False, handletextpad=0.3)
        return
    width = fig.get_size_inches()[0]
    ncol = max(1, min(len(labels), int(width / current().legend_col_in)))
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol,
               frameon=False, handletextpad=0.3, columnspacing=1.0)


# ---------------------------------------------------------------- the memory axis


@dataclass(frozen=True)
class Memory:
    """Which memory column the figures plot, its ratio to the baseline (memtrain/columns.py's
    RATIOS: by default the headline one, the step's total peak) and how it was measured."""

    col: str
    rel: str
    source: str  # how it was measured, e.g. "CUDA max allocated", "CPU live-tensor tracker"

    @property
    def ratio(self) -> columns.Ratio:
        return columns.ratio(self.rel)

    @property
    def what(self) -> str:
        """'peak memory', 'activation + backward temporary memory', 'saved activations'."""
        return columns.axis(self.col)

    def axis(self, baseline: str | None = None, unit: str = "MiB") -> str:
        """One line: 'peak / none (mem_peak_alloc_bytes)' against a baseline, else 'peak
        (MiB)'; the definition is the caption's (`caption`)."""
        return self.ratio.axis(baseline) if baseline else f"{columns.label(self.col)} ({unit})"

    def caption(self, baseline: str | None = None) -> str:
        """The axis's definition, for a figure's caption."""
        what = self.ratio.definition(baseline) if baseline else \
            f"`{columns.label(self.col)}`: {columns.lookup(self.col).meaning}"
        return f"{what}; " + (self.source if self.source == NOT_MEASURED
                              else f"measured by {self.source}")


MEMORY_CHOICES = ("auto", "peak", "act", "saved")
NOT_MEASURED = "none measured: probes or estimates only"  # runs without an accounting step


def peak_source(sources: set[str]) -> str:
    """How the peaks of runs with these `mem_peak_source` values were measured."""
    known = {"cuda": "CUDA max allocated", "tracker": "the CPU live-tensor tracker"}
    said = sorted(known.get(s, f"the CPU ({s})") for s in sources) or [NOT_MEASURED]
    return " / ".join(said) + (", mixed" if len(said) > 1 else "")


def memory_metric(df: pd.DataFrame, choice: str = "auto") -> Memory:
    """The memory the figures plot: `auto` and `peak` the headline ratio's, the step's total
    peak (`mem_peak_alloc_bytes`: CUDA's allocated peak, or the CPU's); `act` the activations +
    backward temporaries at their peak, `saved` the bytes saved for backward (which undercount
    under recomputation), both detail."""
    if choice not in MEMORY_CHOICES:
        raise ValueError(f"--memory must be one of {', '.join(MEMORY_CHOICES)}, got {choice!r}")
    sources = set(df.get(PEAK_SOURCE, pd.Series(dtype=str)).dropna().astype(str)) - {""}
    ratio = {"auto": columns.HEADLINE, "peak": columns.HEADLINE,
             "act": columns.ratio("mem_act_temp_rel"), "saved": columns.ratio("mem_saved_rel")}
    r = ratio[choice]
    src = peak_source(sources)
    if r.of == SAVED:
        src = "saved-tensor hooks (every device)"
    elif r.of == ACT_TEMP_PEAK:
        src = "the live-tensor tracker"
    return Memory(r.of, r.name, src)


BYTE_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


def byte_unit(values: pd.Series, units: tuple[str, ...] = tuple(BYTE_UNITS),
              at_least: float = 1.0) -> tuple[float, str]:
    """(divisor, unit) of bytes (memtrain/columns.py): the largest of `units` in which the
    largest value is at least `at_least` (by default: between 1 and 1024), else the smallest."""
    top = pd.to_numeric(values, errors="coerce").abs().max()
    for unit in units[:-1]:
        if top >= at_least * BYTE_UNITS[unit]:
            return float(BYTE_UNITS[unit]), unit
    return float(BYTE_UNITS[units[-1]]), units[-1]
