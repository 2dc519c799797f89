"""Which summary rows the report may use: bad values skipped, one row per run_id.

A summary.json is data from disk, possibly edited by hand or written by another version: a value
that cannot be what its column says (a string where a number goes, a list, an integer beyond 64
bits, an infinity, anything but text where memtrain/columns.py declares the option a run chose,
a status that is none) would blank, crash or mislabel the whole report, so that one row is
skipped with the file and the column named. A run_id that has several rows (an interrupted run
resumed in another folder, a sweep relaunched into a new one) is one run: its latest row stands
for it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pandas as pd

from memtrain import columns
from memtrain.record import STATUSES
from memtrain.report.names import CONFIG_PREFIXES

# Columns that always hold numbers (snake_case with units, the contract in DESIGN.md), even when
# a single run is reported and no other row could tell.
NUMERIC = re.compile(r"(^|\.)(mem_\w*bytes|\w*_s|\w*_s_(median|p90)|test_acc5?|train_loss|"
                     r"throughput_samples_s|failed_step|resumed_at_step|params)$")
INT64 = 2**63
FINISHED = "finished_at"  # UTC ISO time the summary was written (cli.execute)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def bad_value(v: Any) -> str | None:
    """Why `v` cannot be a value of any column (None when it can)."""
    if isinstance(v, (list, dict)):
        return f"a {type(v).__name__} (a summary holds one flat value per column)"
    if isinstance(v, int) and not isinstance(v, bool) and not -INT64 <= v < INT64:
        return "an integer beyond 64 bits"
    if isinstance(v, float) and math.isinf(v):
        return "an infinity"
    return None


NUMBER_UNITS = ("bytes", "s", "samples/s", "fraction", "ratio", "count", "loss", "perplexity")
ROW_STATUSES = (*STATUSES, "running")  # a job's row while it runs


def declared_type(k: str, v: Any) -> str | None:
    """Why `v` cannot be a value of column `k` as memtrain/columns.py declares it (None when it
    can, or when the column is not declared: another tool's, kept as it is)."""
    col = columns.lookup(k)
    if col is None or v is None and col.kind != "identity" and k != columns.STATUS:
        return None
    if col.kind == "identity" and not isinstance(v, str):
        return f"{_type(v)} where text goes ({col.meaning})"
    if k == columns.STATUS and v not in ROW_STATUSES:
        return f"no status (one of {', '.join(ROW_STATUSES)})"
    if col.unit in NUMBER_UNITS and not _number(v):
        return f"{_type(v)} where a number goes ({columns.UNITS[col.unit]})"
    if col.unit == "bool" and not isinstance(v, bool):
        return f"{_type(v)} where true or false goes"
    return None


def _type(v: Any) -> str:
    """What a JSON value is, as the messages say it."""
    return {type(None): "null", bool: "a boolean", str: "text", int: "a number",
            float: "a number"}.get(type(v), f"a {type(v).__name__}")


def _numeric_columns(rows: list[dict]) -> set[str]:
    """Columns that hold numbers: by name, or in more rows than they hold text (config options
    may mix, e.g. method.kernel_size 2 and 'max', so they are left alone)."""
    votes: dict[str, int] = {}
    for row in rows:
        for k, v in row.items():
            if isinstance(k, str) and not k.startswith(CONFIG_PREFIXES):
                votes[k] = votes.get(k, 0) + (1 if _number(v) else -1 if isinstance(v, str)
                                              else 0)
    return {k for k, n in votes.items() if n > 0 or NUMERIC.search(k)}


def check_rows(rows: list[dict], files: list[Path]) -> tuple[list[dict], list[tuple[Path, str]]]:
    """(usable rows, (folder, reason) of the skipped ones): a row with a bad value is skipped,
    naming its file and column; the others report."""
    numeric = _numeric_columns(rows)
    kept, skipped = [], []
    for row, f in zip(rows, files):
        why = None
        for k, v in row.items():
            reason = bad_value(v) or declared_type(k, v)
            if reason is None and k in numeric and isinstance(v, str):
                reason = "text where a number goes"
            if reason is None and _number(v) and (rng := columns.valid_range(k)) is not None:
                lo, hi = rng
                if v < lo or (hi is not None and v > hi):
                    reason = f"outside [{lo:g}, {'inf' if hi is None else f'{hi:g}'}] " \
                        f"({columns.unit(k)})"
            if reason is not None:
                why = f"{f}: column {k!r} holds {_short(v)}, {reason}"
                break
        if why is None:
            kept.append(row)
        else:
            skipped.append((f.parent, why))
    return kept, skipped


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def as_numbers(df: pd.DataFrame) -> pd.DataFrame:
    """Numeric columns as floats/ints even when every row holds null there (a sweep whose jobs
    all failed has no accuracy), so the report keeps them as NaN instead of dropping them."""
    rows = df.to_dict("records")
    for c in _numeric_columns(rows):
        if c in df and df[c].dtype == object:
            df[c] = pd.to_numeric(df[c], errors="coerce")
    return df


def latest_per_run(df: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple[Path, str]]]:
    """Keep one row per run_id, the latest (by `finished_at`, else the file's time); the
    superseded rows are returned as skipped, naming the row that stands for them."""
    if df.empty or "run_id" not in df:
        return df, []
    stamp = pd.to_datetime(df[FINISHED], utc=True, errors="coerce") if FINISHED in df \
        else pd.Series(pd.NaT, index=df.index, dtype="datetime64[ns, UTC]")
    seconds = (stamp - pd.Timestamp(0, tz="UTC")).dt.total_seconds()
    mtime = df["run_dir"].map(lambda d: (Path(d) / "summary.json").stat().st_mtime)
    order = seconds.fillna(mtime)
    has_id = df["run_id"].notna()
    ranked = df.assign(_when=order).sort_values("_when", kind="stable")
    latest = ranked[has_id.loc[ranked.index]].groupby("run_id", sort=False).tail(1).index
    keep = ~has_id | df.index.isin(latest)
    skipped = []
    for i in df.index[~keep]:
        rid = df.at[i, "run_id"]
        winner = df.loc[latest[df.loc[latest, "run_id"] == rid][0], "run_dir"]
        skipped.append((Path(df.at[i, "run_dir"]),
                        f"superseded by the later row of run_id {rid} in {winner} "
                        f"(status {df.at[i, 'status'] if 'status' in df else '?'})"))
    return df[keep].reset_index(drop=True), skipped
