"""Load run folders into one tidy DataFrame (one row per run)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

log = logging.getLogger(__name__)

SUMMARY = "summary.json"
METRICS = "metrics.csv"


def find_run_dirs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Every folder at or below `paths` that holds a summary.json (single runs, multiruns,
    nested sweeps), sorted, without duplicates."""
    found: set[Path] = set()
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"no such folder: {p}")
        if (p / SUMMARY).is_file():
            found.add(p.resolve())
        found.update(f.parent.resolve() for f in p.rglob(SUMMARY) if f.is_file())
    return sorted(found)


def load_runs(paths: Iterable[str | os.PathLike]) -> tuple[pd.DataFrame, list[tuple[Path, str]]]:
    """(runs, skipped): one row per readable summary.json, and (folder, reason) for the rest."""
    rows, skipped = [], []
    for d in find_run_dirs(paths):
        try:
            with open(d / SUMMARY, encoding="utf-8") as f:
                row = json.load(f)
            if not isinstance(row, dict):
                raise ValueError("summary.json is not a JSON object")
        except (OSError, ValueError) as e:
            skipped.append((d, f"{type(e).__name__}: {e}"))
            log.warning("skipped %s: %s", d, e)
            continue
        row["run_dir"] = str(d)
        rows.append(row)
    return pd.DataFrame(rows), skipped


def load_metrics(run_dirs: Iterable[str | os.PathLike]) -> pd.DataFrame:
    """Long metrics of the given run folders, with their run_dir; missing files are skipped."""
    frames = []
    for d in map(Path, run_dirs):
        f = d / METRICS
        if f.is_file() and f.stat().st_size > 0:
            try:
                m = pd.read_csv(f)
            except (pd.errors.ParserError, pd.errors.EmptyDataError) as e:
                log.warning("skipped %s: %s", f, e)
                continue
            m["run_dir"] = str(d)
            frames.append(m)
    cols = ["step", "epoch", "split", "name", "value", "run_dir"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)


COMPACT = {
    "method": "method",
    "model": "model",
    "dataset": "dataset",
    "trainer.batch_size": "batch",
    "status": "status",
    "mem_peak_alloc_bytes": "peak_MiB",
    "mem_peak_source": "source",
    "mem_act_saved_bytes": "act_saved_MiB",
    "throughput_samples_s": "samples_s",
    "test_acc": "test_acc",
}


def method_label(row: pd.Series) -> str:
    """'pool k=2 mode=upsample': the method and its parameters, for tables and legends."""
    parts = [str(row.get("method", ""))]
    for k, v in row.items():
        if isinstance(k, str) and k.startswith("method.") and v is not None and not (
                isinstance(v, float) and pd.isna(v)):
            parts.append(f"{k[len('method.'):]}={v}")
    return " ".join(parts)


def compact(df: pd.DataFrame) -> pd.DataFrame:
    """The few columns a terminal table shows, memory in MiB."""
    if df.empty:
        return df
    out = pd.DataFrame(index=df.index)
    out["method"] = df.apply(method_label, axis=1)
    for col, name in COMPACT.items():
        if col == "method" or col not in df:
            continue
        v = df[col]
        out[name] = pd.to_numeric(v, errors="coerce") / 2**20 if name.endswith("MiB") else v
    sort = [c for c in ("model", "dataset", "method") if c in out]
    return out.sort_values(sort).reset_index(drop=True)
