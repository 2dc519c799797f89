"""A step's memory timeline (`trainer.memory_timeline=true`): its table and its figure.

`measure.PeakTracker` records, on the accounting step, the live bytes by category after every
allocation and free its tracker (torch's MemTracker) sees, with the phase of the step (forward,
backward, optimizer) and the innermost module active then. This module is what that record
becomes: `timeline.parquet` beside the run (tidy: one row per event and category) and
`timeline.png`/`.pdf` (stacked areas per category, phases shaded, the peak's module named).

Torch-free (pandas and matplotlib only): the report draws a sweep's timelines side by side with
the same functions (`report/plots_timeline.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

FILE = "timeline.parquet"
FIGURE = "timeline"  # .png and .pdf
# the tracker's categories (MemTracker's reference types), bottom to top of the stacked areas;
# `grads`: parameter gradients from the moment autograd makes them (the tracker files a gradient
# as a temporary until autograd hands it to its parameter; the record moves those bytes back)
CATEGORIES = ("params", "buffers", "optim", "grads", "act", "temp", "other")
LABELS = {"params": "parameters", "buffers": "buffers", "optim": "optimizer state",
          "grads": "gradients", "act": "activations", "temp": "temporaries",
          "other": "other (the batch, ...)"}
COLORS = {"params": "#4c72b0", "buffers": "#8c8c8c", "optim": "#8172b2", "grads": "#55a868",
          "act": "#dd8452", "temp": "#c44e52", "other": "#ccb974"}
PHASES = ("forward", "backward", "optimizer")
PHASE_SHADE = {"forward": "#ffffff", "backward": "#e8eef7", "optimizer": "#f3ecf7"}
COLUMNS = ["part", "event", "time_s", "phase", "module", "category", "bytes"]


def table(events: Sequence[tuple], part: str = "", first_event: int = 0) -> pd.DataFrame:
    """The tidy table of one recorded step: `events` are (time_s, phase, module, *bytes per
    CATEGORIES); `part` names the step's phase of a method that trains in parts (synthetic)."""
    wide = pd.DataFrame(list(events), columns=["time_s", "phase", "module", *CATEGORIES])
    wide.insert(0, "event", range(first_event, first_event + len(wide)))
    wide.insert(0, "part", part)
    long = wide.melt(id_vars=["part", "event", "time_s", "phase", "module"],
                     value_vars=list(CATEGORIES), var_name="category", value_name="bytes")
    long["bytes"] = long["bytes"].astype("int64")
    return long.sort_values(["event", "category"], key=_category_order).reset_index(drop=True)


def _category_order(s: pd.Series) -> pd.Series:
    return s.map({c: i for i, c in enumerate(CATEGORIES)}) if s.name == "category" else s


def wide(df: pd.DataFrame) -> pd.DataFrame:
    """One row per event: part, phase, module, time and a column per category, plus `total`."""
    w = df.pivot_table(index=["event", "part", "time_s", "phase", "module"],
                       columns="category", values="bytes", aggfunc="sum").reset_index()
    for c in CATEGORIES:
        if c not in w:
            w[c] = 0
    w["total"] = w[list(CATEGORIES)].sum(axis=1)
    return w.sort_values("event").reset_index(drop=True)


def peak(df: pd.DataFrame) -> dict:
    """The highest total and where it is: its bytes, event, phase, module and part."""
    w = wide(df)
    if w.empty:
        return {"bytes": 0, "event": -1, "phase": "", "module": "", "part": ""}
    r = w.loc[w["total"].idxmax()]
    return {"bytes": int(r["total"]), "event": int(r["event"]), "phase": r["phase"],
            "module": r["module"], "part": r["part"]}


def columns(df: pd.DataFrame, path: str) -> dict:
    """The row's columns for a written timeline."""
    p = peak(df)
    return {"memory_timeline": path, "mem_timeline_peak_bytes": p["bytes"],
            "mem_timeline_peak_phase": p["phase"], "mem_timeline_peak_module": p["module"],
            "mem_timeline_events": int(df["event"].nunique())}


def spans(w: pd.DataFrame, key: str) -> list[tuple[str, int, int]]:
    """Runs of equal `key` over the events: (value, first event, last event)."""
    out: list[tuple[str, int, int]] = []
    for v, e in zip(w[key], w["event"]):
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1], e)
        else:
            out.append((v, e, e))
    return out


def draw(ax, df: pd.DataFrame, unit: tuple[str, float] = ("MiB", 2**20), legend: bool = True,
         title: str = "") -> dict:
    """Stacked areas per category over the event index, phases shaded, the peak marked and its
    module named. Returns the peak (`peak`)."""
    w = wide(df)
    name, scale = unit
    for ph, a, b in spans(w, "phase"):
        ax.axvspan(a - 0.5, b + 0.5, color=PHASE_SHADE.get(ph, "#ffffff"), lw=0, zorder=0)
    cats = [c for c in CATEGORIES if w[c].any()]
    ax.stackplot(w["event"], *(w[c] / scale for c in cats), labels=[LABELS[c] for c in cats],
                 colors=[COLORS[c] for c in cats], lw=0, zorder=1, step=None)
    parts = spans(w, "part")
    for _part, a, _ in parts[1:]:
        ax.axvline(a - 0.5, color="k", lw=0.6, ls=":", zorder=2)
    p = peak(df)
    if p["event"] >= 0:
        ax.plot([p["event"]], [p["bytes"] / scale], "v", color="k", ms=4, zorder=3)
        where = ".".join(p["module"].split(".")[1:]) or p["module"] or (
            "the optimizer's step" if p["phase"] == "optimizer" else "outside any module")
        ax.annotate(f"peak {p['bytes'] / scale:.1f} {name}\n{p['phase']}: {where}",
                    (p["event"], p["bytes"] / scale), xytext=(4, 2), textcoords="offset points",
                    fontsize="x-small", va="bottom", ha="left" if p["event"] < w["event"].max() / 2
                    else "right", zorder=4)
    ax.set_xlim(w["event"].min() - 0.5, w["event"].max() + 0.5)
    ax.set_ylim(bottom=0)
    ax.set(xlabel="allocation/free event of the step", ylabel=f"live memory ({name})")
    if title:
        ax.set_title(title, fontsize="small", pad=14)
    if legend:
        from matplotlib.patches import Patch

        shades = [Patch(color=PHASE_SHADE[ph], label=f"{ph} (shade)", ec="#999999", lw=0.3)
                  for ph in PHASES if ph in set(w["phase"])]
        handles, labels = ax.get_legend_handles_labels()
        ax.legend([*handles[::-1], *shades], [*labels[::-1], *(s.get_label() for s in shades)],
                  fontsize="x-small", loc="upper left", frameon=False)
    return p


def unit_of(nbytes: float) -> tuple[str, float]:
    for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return name, scale
    return "bytes", 1


def write(df: pd.DataFrame, run_dir: Path, title: str = "",
          formats: Sequence[str] = ("png", "pdf")) -> dict:
    """timeline.parquet and the figure beside the run; returns the row's columns."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    df.to_parquet(run_dir / FILE, index=False)
    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    draw(ax, df, unit_of(peak(df)["bytes"]), title=title)
    for fmt in formats:
        fig.savefig(run_dir / f"{FIGURE}.{fmt}", dpi=150)
    plt.close(fig)
    return columns(df, FILE)


def read(run_dir: str | Path, name: str = FILE) -> pd.DataFrame:
    return pd.read_parquet(Path(run_dir) / name)
