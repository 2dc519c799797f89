"""Shared look of the report figures: paper column width, one colour per method, the memory axis.

Sizes are for a two-column paper: one panel is a column (3.3 in) wide and fonts are 7 pt, so a
figure placed at its natural size needs no rescaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display, safe inside a Hydra job

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

COLUMN_IN = 3.3
PANEL_H_IN = 2.3
RC = {
    "font.size": 7, "axes.titlesize": 7, "axes.labelsize": 7, "xtick.labelsize": 6,
    "ytick.labelsize": 6, "legend.fontsize": 6, "lines.markersize": 4, "lines.linewidth": 1.0,
    "axes.linewidth": 0.6, "axes.grid": True, "grid.linewidth": 0.4, "grid.alpha": 0.4,
    "axes.spines.top": False, "axes.spines.right": False, "savefig.dpi": 300,
    "savefig.bbox": "tight", "savefig.pad_inches": 0.02, "pdf.fonttype": 42,
}
# The seed papers' methods first, in the study's order, so a method keeps its colour everywhere.
METHOD_ORDER = ("none", "pool", "prune", "checkpoint", "synthetic")
METHOD_COLORS = {"none": "#222222", "pool": "#1f77b4", "prune": "#ff7f0e",
                 "checkpoint": "#2ca02c", "synthetic": "#9467bd"}
SPARE_COLORS = ("#d62728", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#7f7f7f")
MARKERS = "osD^v<>pP*h"
STATUS_COLORS = {"ok": "#c7e9c0", "oom": "#de2d26", "diverged": "#fd8d3c", "error": "#756bb1",
                 "interrupted": "#fee391", "running": "#bdbdbd", "missing": "#f0f0f0"}


def styled(fn):
    """Run a figure function under the report's rcParams: text takes its size when created."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with plt.rc_context(RC):
            return fn(*args, **kwargs)

    return wrapper


def method_color(method: str, known: list[str] | None = None) -> str:
    """The method's fixed colour; unknown methods take spare colours by name order."""
    if method in METHOD_COLORS:
        return METHOD_COLORS[method]
    others = sorted(m for m in (known or [method]) if m not in METHOD_COLORS)
    i = others.index(method) if method in others else 0
    return SPARE_COLORS[i % len(SPARE_COLORS)]


def method_rank(method: str) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


def order_settings(agg: pd.DataFrame) -> pd.DataFrame:
    """Baseline first, then methods in the study order, then by label."""
    key = agg["method"].map(method_rank).astype(str).str.zfill(3) + agg["label"]
    return agg.assign(_k=key).sort_values("_k").drop(columns="_k")


def setting_styles(agg: pd.DataFrame) -> dict[str, dict]:
    """label -> matplotlib style: colour by method, marker by setting within the method."""
    known = sorted(set(agg["method"].astype(str)))
    styles, seen = {}, {}
    for _, r in order_settings(agg).iterrows():
        if r["label"] in styles:
            continue
        m = str(r["method"])
        k = seen.get(m, 0)
        seen[m] = k + 1
        styles[r["label"]] = {"color": method_color(m, known), "marker": MARKERS[k % len(MARKERS)]}
    return styles


def panels(agg: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) per model (and dataset when there are several), in a stable order."""
    several = agg["dataset"].nunique() > 1
    out = []
    for (model, dataset), g in agg.groupby(["model", "dataset"], sort=True):
        out.append((f"{model} / {dataset}" if several else str(model), g))
    return out


def subplots(n: int, height: float = PANEL_H_IN):
    """A grid of n panels, each a paper column wide: stacked in one column up to two panels
    (the figure fits a column), two columns beyond. Returns (fig, flat list of axes)."""
    ncols = 1 if n <= 2 else 2
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(COLUMN_IN * ncols, height * nrows),
                             squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def shared_legend(fig, styles: dict[str, dict], labels: list[str]) -> None:
    """One legend under the panels, in the study order: a setting looks the same everywhere."""
    from matplotlib.lines import Line2D

    labels = [lb for lb in styles if lb in set(labels)]
    handles = [Line2D([], [], linestyle="none", markersize=4, **styles[lb]) for lb in labels]
    width = fig.get_size_inches()[0]
    ncol = max(1, min(len(labels), int(width / 1.6)))
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol,
               frameon=False, handletextpad=0.3, columnspacing=1.0)


# ---------------------------------------------------------------- the memory axis


@dataclass(frozen=True)
class Memory:
    """Which memory column the figures plot and how the axis says so."""

    col: str
    rel: str
    what: str  # "peak memory", "activation memory", "saved activations"
    source: str  # how it was measured, e.g. "CUDA max allocated", "CPU, no CUDA peak"

    def axis(self, baseline: str | None = None, unit: str = "MiB") -> str:
        """'activation memory relative to none\n(saved + recomputed; CPU, no CUDA peak)'."""
        head = f"{self.what} relative to {baseline}" if baseline else f"{self.what}, {unit}"
        return f"{head}\n({self.source})"


MEMORY_CHOICES = ("auto", "peak", "act", "saved")


def memory_metric(df: pd.DataFrame, choice: str = "auto") -> Memory:
    """The memory figure for the axes.

    `peak` is the CUDA peak where it was measured; on the CPU there is no CUDA peak, so `auto`
    uses activation bytes there (`act`: the highest activation memory in a step, recomputed
    tensors included, from the live-tensor tracker; `saved`: bytes saved for backward, which
    undercount under recomputation). The axis label names the source.
    """
    if choice not in MEMORY_CHOICES:
        raise ValueError(f"--memory must be one of {', '.join(MEMORY_CHOICES)}, got {choice!r}")
    sources = set(df.get("mem_peak_source", pd.Series(dtype=str)).dropna().astype(str))
    cuda_only = sources == {"cuda"}
    if choice == "auto":
        choice = "peak" if cuda_only else "act"
    if choice == "peak":
        src = ("CUDA max allocated" if cuda_only else
               "CPU live-tensor tracker" if sources == {"tracker"} else "CUDA / CPU tracker, mixed")
        return Memory("mem_peak_alloc_bytes", "mem_peak_rel", "peak memory", src)
    cpu = "" if cuda_only else "; CPU, no CUDA peak"
    if choice == "act":
        return Memory("mem_peak_act_bytes", "mem_act_rel", "activation memory",
                      f"saved + recomputed{cpu}")
    return Memory("mem_act_saved_bytes", "mem_saved_rel", "saved activations",
                  f"saved for backward{cpu}")


def byte_unit(values: pd.Series) -> tuple[float, str]:
    """(divisor, unit) that keeps the largest value between 1 and 1024."""
    top = pd.to_numeric(values, errors="coerce").abs().max()
    for div, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= div:
            return float(div), unit
    return 1.0, "B"
