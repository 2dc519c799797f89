"""A step's memory timeline (`trainer.memory_timeline=true`): its table and its figure.

On the CPU, `measure.PeakTracker` records, on the accounting step, the live bytes by category
after every allocation and free its tracker (torch's MemTracker) sees, with the phase of the
step (forward, backward, optimizer), the innermost module active then and whether that module's
forward runs again in backward (a checkpointed segment's recomputation). On CUDA the events are
the allocator's own (torch's allocator history, `from_allocator`): every allocation and free of
the step, each block filed under the category of the tensor the tracker saw in it. This module is
what that record becomes: `timeline.parquet` beside the run (tidy: one row per event and
category) and `timeline.png`/`.pdf` (stacked areas per category, phases shaded, recomputation
marked, the peak's module named).

Torch-free (pandas and matplotlib only): the report draws a sweep's timelines side by side with
the same functions (`report/plots_timeline.py`).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from memtrain.columns import TRACKED

FILE = "timeline.parquet"
FIGURE = "timeline"  # .png and .pdf
# the tracker's categories (TRACKED: MemTracker's reference types), bottom to top of the stacked
# areas; `grads`: parameter gradients from the moment autograd makes them (the tracker files a
# gradient as a temporary until autograd hands it to its parameter; the record moves those bytes
# back); `update`: the update's temporaries (what the optimizer step makes and frees; a timeline
# written before this category has none); `untracked` (CUDA only): allocator blocks in which the
# tracker saw no tensor of the step (kernels' workspaces, allocations made inside an op; at the
# start, what the step finds allocated and does not use, such as a dataset held on the GPU)
CATEGORIES = (*TRACKED, "untracked")
LABELS = {"params": "parameters", "buffers": "buffers", "optim": "optimizer state",
          "update": "update temporaries", "grads": "gradients", "act": "activations",
          "temp": "backward temporaries", "other": "other (the batch, ...)",
          "untracked": "untracked (blocks of no tracked tensor: workspaces, data on the GPU)"}
COLORS = {"params": "#4c72b0", "buffers": "#8c8c8c", "optim": "#8172b2", "update": "#b5a8d6",
          "grads": "#55a868", "act": "#dd8452", "temp": "#c44e52", "other": "#ccb974",
          "untracked": "#dddddd"}
PHASES = ("forward", "backward", "optimizer")
PHASE_SHADE = {"forward": "#ffffff", "backward": "#e8eef7", "optimizer": "#f3ecf7"}
RECOMPUTE_COLOR = "#333333"
COLUMNS = ["part", "event", "time_s", "phase", "module", "recompute", "category", "bytes"]
SOURCES = {"tracker": "the live-tensor tracker (torch's MemTracker), after every op",
           "cuda": "torch's CUDA allocator history, every allocation and free"}


def table(events: Sequence[tuple], part: str = "", first_event: int = 0,
          categories: Sequence[str] = TRACKED) -> pd.DataFrame:
    """The tidy table of one recorded step: `events` are (time_s, phase, module, recompute,
    *bytes per `categories`); `part` names the step's phase of a method that trains in parts
    (synthetic)."""
    wide = pd.DataFrame(list(events), columns=["time_s", "phase", "module", "recompute",
                                               *categories])
    wide["recompute"] = wide["recompute"].astype(bool)
    wide.insert(0, "event", range(first_event, first_event + len(wide)))
    wide.insert(0, "part", part)
    long = wide.melt(id_vars=["part", "event", "time_s", "phase", "module", "recompute"],
                     value_vars=list(categories), var_name="category", value_name="bytes")
    long["bytes"] = long["bytes"].astype("int64")
    return long.sort_values(["event", "category"], key=_category_order).reset_index(drop=True)


def _category_order(s: pd.Series) -> pd.Series:
    return s.map({c: i for i, c in enumerate(CATEGORIES)}) if s.name == "category" else s


def wide(df: pd.DataFrame) -> pd.DataFrame:
    """One row per event: part, phase, module, recompute, time and a column per category (0
    where the table has none), plus `total`."""
    if "recompute" not in df:  # written before the column existed
        df = df.assign(recompute=False)
    if "total" in df:  # already wide; rows written before a category existed have none of it
        return df.assign(**{c: 0 for c in CATEGORIES if c not in df})
    meta = df.drop_duplicates("event").set_index("event")[
        ["part", "time_s", "phase", "module", "recompute"]]
    cats = df.groupby(["event", "category"])["bytes"].sum().unstack("category", fill_value=0)
    w = meta.join(cats).sort_index().reset_index()
    w.columns.name = None
    for c in CATEGORIES:
        if c not in w:
            w[c] = 0
        w[c] = w[c].astype("int64")
    w["total"] = w[list(CATEGORIES)].sum(axis=1)
    return w


def peak(df: pd.DataFrame) -> dict:
    """The highest total and where it is: its bytes, event, phase, module and part (`df`: the
    tidy table or its `wide` form)."""
    w = wide(df)
    if w.empty:
        return {"bytes": 0, "event": -1, "phase": "", "module": "", "part": ""}
    r = w.loc[w["total"].idxmax()]
    return {"bytes": int(r["total"]), "event": int(r["event"]), "phase": r["phase"],
            "module": r["module"], "part": r["part"]}


def columns(df: pd.DataFrame, path: str, source: str = "tracker") -> dict:
    """The row's columns for a written timeline."""
    p = peak(df)
    return {"memory_timeline": path, "mem_timeline_source": source,
            "mem_timeline_peak_bytes": p["bytes"],
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


def short_module(name: str) -> str:
    """A tracker's module name without its root's class name ('ResNet.layer1.0' ->
    'layer1.0'); the root itself and '' stay."""
    return name.partition(".")[2] or name


def peak_text(p: dict, unit: tuple[str, float]) -> str:
    """'peak 146.0 MiB in backward, layer3.0.conv1' (the optimizer's step, outside modules)."""
    where = short_module(p["module"]) or ("the optimizer's step" if p["phase"] == "optimizer"
                                          else "outside any module")
    return f"peak {p['bytes'] / unit[1]:.1f} {unit[0]} in {p['phase']}, {where}"


def draw(ax, df: pd.DataFrame, unit: tuple[str, float] = ("MiB", 2**20), legend: bool = True,
         title: str = "", source: str = "tracker") -> dict:
    """Stacked areas per category over the step, phases shaded, recomputed forwards marked by a
    strip along the top, the peak marked and named under the title. The x-axis is the fraction
    of the step's events (event i spans [i/n, (i+1)/n]), so steps of a few hundred and of tens of
    thousands of events (quantize's many small ops) read alike side by side. Returns the peak
    (`peak`)."""
    w = wide(df)
    name, scale = unit
    n = max(1, len(w))
    first = int(w["event"].min()) if len(w) else 0
    x = (w["event"] - first + 0.5) / n

    def edge(e: int) -> float:
        return (e - first) / n

    for ph, a, b in spans(w, "phase"):
        ax.axvspan(edge(a), edge(b + 1), color=PHASE_SHADE.get(ph, "#ffffff"), lw=0, zorder=0)
    cats = [c for c in CATEGORIES if w[c].any()]
    ax.stackplot(x, *(w[c] / scale for c in cats), labels=[LABELS[c] for c in cats],
                 colors=[COLORS[c] for c in cats], lw=0, zorder=1)
    for _part, a, _ in spans(w, "part")[1:]:
        ax.axvline(edge(a), color="k", lw=0.6, ls=":", zorder=2)
    recomputed = [(a, b) for rec, a, b in spans(w, "recompute") if rec]
    for i, (a, b) in enumerate(recomputed):
        ax.axvspan(edge(a), edge(b + 1), ymin=0.96, ymax=1.0, color=RECOMPUTE_COLOR, lw=0,
                   zorder=3, label="_" if i else "forward recomputed in backward")
    p = peak(w)
    if p["event"] >= 0:
        ax.plot([edge(p["event"]) + 0.5 / n], [p["bytes"] / scale], "v", color="k", ms=3,
                zorder=4, label="peak")
    ax.set_xlim(0, 1)
    ax.set_ylim(bottom=0)
    what = "allocator event" if source == "cuda" else "event"
    ax.set(xlabel=f"fraction of the step's {what}s", ylabel=f"live memory ({name})")
    ax.grid(False)
    head = peak_text(p, unit) if p["event"] >= 0 else "no event recorded"
    ax.set_title(f"{title}\n{head}" if title else head, fontsize="small")
    if legend:
        from matplotlib.patches import Patch

        shades = [Patch(facecolor=PHASE_SHADE[ph], label=f"{ph} (shade)", edgecolor="#999999",
                        lw=0.3) for ph in PHASES if ph in set(w["phase"])]
        handles, labels = ax.get_legend_handles_labels()
        ax.legend([*handles[::-1], *shades], [*labels[::-1], *(s.get_label() for s in shades)],
                  fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  frameon=False)
    return p


def unit_of(nbytes: float) -> tuple[str, float]:
    for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return name, scale
    return "bytes", 1


def write(df: pd.DataFrame, run_dir: Path, title: str = "",
          formats: Sequence[str] = ("png", "pdf"), source: str = "tracker") -> dict:
    """timeline.parquet and the figure beside the run; returns the row's columns."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    df.to_parquet(run_dir / FILE, index=False, compression="zstd")
    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    draw(ax, df, unit_of(peak(df)["bytes"]), title=title, source=source)
    for fmt in formats:
        fig.savefig(run_dir / f"{FIGURE}.{fmt}", dpi=150)
    plt.close(fig)
    return columns(df, FILE, source)


def read(run_dir: str | Path, name: str = FILE) -> pd.DataFrame:
    return pd.read_parquet(Path(run_dir) / name)


# ---------------------------------------------------------------- CUDA: the allocator's history

# The caching allocator hands out blocks in multiples of 512 bytes (its kMinBlockSize); its
# history records the size asked for, its statistics (max_memory_allocated) the block's size
BLOCK = 512


def block_bytes(n: int) -> int:
    return max(BLOCK, -(-int(n) // BLOCK) * BLOCK)


def from_allocator(entries: Sequence[Mapping], start: Sequence[tuple[int, int, str]],
                   births: Sequence[tuple[int, int, str]],
                   marks: Sequence[tuple[float, str, str, bool]], t0_s: float) -> list[tuple]:
    """A step's events from torch's CUDA allocator history, in `table`'s format (categories:
    CATEGORIES, `untracked` last).

    `entries`: the step's trace entries (`torch.cuda.memory._snapshot()["device_traces"][d]`,
    oldest first: `action`, `addr`, `size`, `time_us`); an event per `alloc` and per
    `free_requested` (where the allocator's `allocated` count drops). `start`: the blocks
    allocated when the step began, (address, block size, category). `births`: the storages the
    tracker saw made during the step, in order, (address, bytes, category): an allocation takes
    the category of the first unmatched birth at its address and of its size (in 512-byte
    blocks), or `untracked` (a workspace, an op's internal buffer). Sizes are counted in 512-byte
    blocks, as the allocator's statistics count them; a cached block reused for a smaller request
    can be larger still (up to 1 MiB), which the history does not record. `marks`: the tracker's
    events (seconds since `t0_s`, phase, module, recompute), oldest first: an allocation belongs
    to the op of the first mark at or after its time (the tracker sees an op's outputs after it
    ran). `t0_s`: the step's start in the allocator's clock (Unix seconds)."""
    index = {c: i for i, c in enumerate(CATEGORIES)}
    live: dict[int, tuple[int, int]] = {}  # address -> (bytes, category index)
    values = [0] * len(CATEGORIES)
    for addr, size, cat in start:
        live[addr] = (int(size), index[cat])
        values[index[cat]] += int(size)
    queue: dict[tuple[int, int], deque[str]] = {}
    for addr, nbytes, cat in births:
        queue.setdefault((addr, block_bytes(nbytes)), deque()).append(cat)
    times = [m[0] for m in marks]
    events = []
    for e in entries:
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            size = block_bytes(e["size"])
            q = queue.get((addr, size))
            cat = index[q.popleft()] if q else index["untracked"]
            live[addr] = (size, cat)
            values[cat] += size
        elif action == "free_requested" and addr in live:
            size, cat = live.pop(addr)
            values[cat] -= size
        else:
            continue
        t = e.get("time_us", 0) / 1e6 - t0_s
        i = min(bisect.bisect_left(times, t), len(marks) - 1) if marks else -1
        phase, module, rec = (marks[i][1], marks[i][2], marks[i][3]) if i >= 0 else ("", "",
                                                                                      False)
        events.append((t, phase, module, rec, *values))
    return events
