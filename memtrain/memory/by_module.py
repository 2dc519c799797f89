"""Where the activations live (`trainer.memory_timeline=true`): the bytes each module saved for
backward on the accounting step, and the plan a method applied per segment (checkpoint), as two
small files beside the run, and the table that sets a sweep's runs side by side per module.

- `saved_by_module.csv` (`SAVED_FILE`): one row per module that saved something, `part`
  (synthetic's phase, else ''), `module` (torch's ModTracker name: the root's class name, then
  the path, 'ResNet.layer1.0.conv1'; '' outside every module: the loss), `bytes` (on the run's
  device), `host_bytes` (an offloader's copies in host memory on a GPU run), `storages`. A
  storage counts once, for the module that packed it first (`measure.SavedByModule`), so the
  rows sum to the row's `mem_act_saved_bytes` (and `mem_act_saved_host_bytes`).
- `plan.csv` (`PLAN_FILE`): checkpoint's plan, one row per segment: `segment`, `name`,
  `modules` (the segment's modules, space-separated, as `model.named_modules()` names them),
  `decision` (keep or recompute), `group` ('a-b' for a recomputed group), and at op
  granularity `ops`, `kept_ops`, `kept_bytes` (the ops of a recomputed segment whose outputs the
  plan keeps) and `compact` (ReLU/max-pool compaction of a kept segment).

Torch-free: the report reads these files (report/plots_timeline.py, report/markdown.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd

from memtrain.memory.timeline import short_module

SAVED_FILE = "saved_by_module.csv"
PLAN_FILE = "plan.csv"
SAVED_COLUMNS = ["part", "module", "bytes", "host_bytes", "storages"]
PLAN_COLUMNS = ["segment", "name", "modules", "decision", "group", "ops", "kept_ops",
                "kept_bytes", "compact"]
TOP = 12  # modules in the table and the figure: the baseline's largest
OUTSIDE = "(outside the model: the loss)"


def write_saved(rows: Iterable[tuple], run_dir: str | Path) -> dict:
    """saved_by_module.csv beside the run; the row's column naming it."""
    df = pd.DataFrame(list(rows), columns=SAVED_COLUMNS)
    df.to_csv(Path(run_dir) / SAVED_FILE, index=False)
    return {"saved_by_module": SAVED_FILE}


def write_plan(rows: Sequence[dict], run_dir: str | Path) -> dict:
    """plan.csv beside the run (nothing without rows); the row's column naming it."""
    if not rows:
        return {}
    df = pd.DataFrame(list(rows)).reindex(columns=PLAN_COLUMNS)
    for c in ("ops", "kept_ops", "kept_bytes"):  # counts, blank where a segment is kept
        df[c] = df[c].astype("Int64")
    df.to_csv(Path(run_dir) / PLAN_FILE, index=False)
    return {"plan_table": PLAN_FILE}


def read(run_dir: str | Path, name: str) -> pd.DataFrame | None:
    """A run's file (`name`, relative to its folder), None where it is missing."""
    path = Path(run_dir) / str(name)
    if not path.is_file():
        return None
    if path.suffix != ".csv":
        return pd.read_parquet(path)
    text = {"part": str, "module": str, "name": str, "modules": str, "decision": str,
            "group": str}
    return pd.read_csv(path, keep_default_na=False, dtype=text,
                       na_values={c: [""] for c in ("ops", "kept_ops", "kept_bytes")})


def display(module: str) -> str:
    """A module as the table shows it: its path ('layer1.0.conv1'), the root's own forward as
    its class name, the loss as OUTSIDE."""
    return short_module(module) if module else OUTSIDE


def per_module(saved: pd.DataFrame) -> pd.Series:
    """Bytes per displayed module, the parts of a run added up."""
    saved = saved.assign(module=saved["module"].fillna("").astype(str).map(display))
    return saved.groupby("module", sort=False)["bytes"].sum()


def align(values: pd.Series, names: Sequence[str]) -> pd.Series:
    """`values` (bytes per module) gathered onto `names` (the baseline's modules): a module
    counts for the longest name it is, or lies inside of (a method that wraps a layer saves in
    the wrapper's child); what falls under none of them is left out."""
    out = pd.Series(0, index=list(names), dtype="int64")
    by_len = sorted(names, key=len, reverse=True)
    for m, v in values.items():
        home = next((n for n in by_len if m == n or m.startswith(n + ".")), None)
        if home is not None:
            out[home] += int(v)
    return out


def decision(module: str, plan: pd.DataFrame | None) -> str:
    """What `plan` does with the segment that holds `module` (a displayed name): 'kept',
    'recomputed (group 2-4)', at op granularity with the ops whose outputs it keeps
    ('recomputed (group 2-4), 3 of 11 ops kept'); '' outside every segment or without a plan."""
    if plan is None or plan.empty:
        return ""
    for r in plan.itertuples():
        mods = str(r.modules).split()
        if any(module == m or module.startswith(m + ".") for m in mods):
            if r.decision != "recompute":
                return "kept" + (", compacted" if _true(getattr(r, "compact", None)) else "")
            text = f"recomputed (group {r.group})"
            ops, kept = getattr(r, "ops", None), getattr(r, "kept_ops", None)
            if pd.notna(ops) and pd.notna(kept) and int(ops) > 0:
                text += f", {int(kept)} of {int(ops)} ops kept"
            return text
    return ""


def _true(v) -> bool:
    return v is not None and not (isinstance(v, float) and pd.isna(v)) and str(v) not in (
        "", "False", "false", "0")


def recomputed(module: str, plan: pd.DataFrame | None) -> bool:
    return decision(module, plan).startswith("recomputed")


def segment_of(module: str, plan: pd.DataFrame) -> int | None:
    """The plan's segment holding `module` (a displayed name), or None."""
    for r in plan.itertuples():
        if any(module == m or module.startswith(m + ".") for m in str(r.modules).split()):
            return int(r.segment)
    return None


def compare(base: pd.DataFrame, others: Sequence[tuple[str, pd.DataFrame]],
            top: int = TOP) -> pd.DataFrame:
    """The per-module table of one model: the baseline's `top` modules by bytes, a column of
    bytes per setting (`base` first as `baseline`, then each (label, saved) of `others`), then
    'other modules' (the rest) and 'total' (each run's saved bytes)."""
    b = per_module(base)
    names = list(b.sort_values(ascending=False, kind="stable").index[:top])
    cols = {"baseline": b}
    cols.update({label: per_module(s) for label, s in others})
    rows = {}
    for label, v in cols.items():
        kept = align(v, b.index.tolist())  # every baseline module, then the top ones shown
        shown = kept[names]
        rows[label] = [*shown.tolist(), int(v.sum()) - int(shown.sum()), int(v.sum())]
    return pd.DataFrame(rows, index=[*names, "other modules", "total"])
