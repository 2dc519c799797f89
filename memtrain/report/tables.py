"""Run folders -> one tidy DataFrame (one row per run), baselines and seed aggregates.

Never imports torch: the report runs on a laptop with nothing but pandas and matplotlib.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd

from memtrain import columns
from memtrain.record import DRIVING_OPTIONS, GROUPS, SKIPPED
from memtrain.report import derive, screen
from memtrain.report.names import CONFIG_PREFIXES, InputError, Names, fmt_value, isna
from memtrain.report.names import DEFAULT as DEFAULT_NAMES

log = logging.getLogger(__name__)

SUMMARY = "summary.json"
METRICS = "metrics.csv"

CHOICES = GROUPS
SEED = "trainer.seed"
# `memtrain-report A B --compare`: which source (sweep) a run came from, a setting column of its
# own (build.load_sources), so the same setting from two sweeps stays two settings
SOURCE = "source"
# A run's baseline: the `none` run that differs from it only in the method (the documented rule).
DEFAULT_BASELINE = "method=none"
DEFAULT_MATCH = ("model", "dataset", "trainer.batch_size", "trainer.precision", SEED)
SHARDING = ("trainer.strategy", "trainer.world_size")  # matched too, where rows have them
# Columns made relative to the baseline (ratio) or differenced (delta), per run: the ratios are
# memtrain/columns.py's (RATIOS: the headline memory ratio first, then the detail)
RATIOS = {r.of: r.name for r in columns.RATIOS}
DELTAS = {"test_acc": "test_acc_delta", "test_loss": "test_loss_delta"}


# ---------------------------------------------------------------- loading


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


def find_unfinished(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Hydra job folders (they hold .hydra/) below `paths` that never wrote a summary.json (nor
    a skip marker: a job skipped by trainer.skip_done has its row elsewhere)."""
    out = []
    for p in map(Path, paths):
        for h in p.rglob(".hydra"):
            done = (h.parent / SUMMARY).exists() or (h.parent / SKIPPED).exists()
            if h.is_dir() and not done:
                out.append(h.parent.resolve())
    return sorted(set(out))


def load_runs(paths: Iterable[str | os.PathLike], latest: bool = True
              ) -> tuple[pd.DataFrame, list[tuple[Path, str]]]:
    """(runs, skipped): one row per readable summary.json, and (folder, reason) for the rest:
    a corrupt summary.json or a job folder without one. `latest`: one row per run_id, its
    latest (screen.latest_per_run); False keeps every row (a study's parts may each measure the
    same config, and each part's table shows its own)."""
    paths = list(paths)
    rows, files, skipped = [], [], []
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
        files.append(d / SUMMARY)
    rows, bad = screen.check_rows(rows, files)
    df, superseded = screen.as_numbers(pd.DataFrame(rows)), []
    if latest:
        df, superseded = screen.latest_per_run(df)
    for d, why in bad + superseded:
        skipped.append((d, why))
        log.warning("skipped %s: %s", d, why)
    for d in find_unfinished(paths):
        skipped.append((d, "no summary.json (job never finished)"))
        log.warning("skipped %s: no summary.json", d)
    return df, skipped


def load_summary_csv(path: str | os.PathLike) -> pd.DataFrame:
    """The rows of a committed summary.csv (memtrain-report's, one row per run) as load_runs
    returns them: numeric columns numeric (screen.as_numbers), `run_dir` as written (relative
    where the report was made with relative folders)."""
    return screen.as_numbers(pd.read_csv(path, low_memory=False))


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


# ---------------------------------------------------------------- labels


def method_label(row: pd.Series, skip: Iterable[str] = (), names: Names = DEFAULT_NAMES) -> str:
    """'pool k=2 upsample': the method and its parameters but `skip`, by `names` (see
    report/names.py: short parameter names, settings with a name of their own)."""
    return names.setting(row, skip)


def constant_params(df: pd.DataFrame) -> dict[str, dict[str, str]]:
    """method -> {column: value} of the method parameters that never change in `df`: legends
    leave them out, report.md states them once."""
    out: dict[str, dict[str, str]] = {}
    params = [c for c in df.columns if c.startswith("method.")]
    for m, g in df.groupby("method"):
        cols = [c for c in params if g[c].notna().any()]
        # A method run in one setting only is labelled by its name alone: its parameters are
        # constant, stated once in report.md, and would make legends unreadable.
        const = {c: fmt_value(g[c].iloc[0]) for c in cols
                 if g[c].notna().all() and g[c].map(fmt_value).nunique() == 1}
        if const:
            out[str(m)] = const
    return out


def config_columns(df: pd.DataFrame) -> list[str]:
    """The columns that say what ran: the Hydra choices and every flattened option."""
    return [c for c in df.columns
            if c in CHOICES or c == SOURCE or c.startswith(CONFIG_PREFIXES)]


# Options that drive a run without changing what it computes (left out of run_id): a relaunch
# with trainer.resume=true is the same setting.
DRIVING = tuple(f"trainer.{k}" for k in DRIVING_OPTIONS)


def setting_columns(df: pd.DataFrame, seed: str = SEED) -> list[str]:
    """The config columns that tell one setting from another: all of them but the seed and the
    options left out of run_id (DRIVING)."""
    return [c for c in config_columns(df) if c != seed and c not in DRIVING]


def _varying(df: pd.DataFrame, cols: Sequence[str]) -> list[str]:
    return [c for c in cols if df[c].astype(str).nunique(dropna=False) > 1]


def add_labels(df: pd.DataFrame, seed: str = SEED, names: Names = DEFAULT_NAMES) -> pd.DataFrame:
    """Add `label`: the method and the parameters that vary between its settings (see
    constant_params), plus any other option that varies within the same model and dataset
    (e.g. `lr=0.02`), named by `names` (short parameter names, the user's renames). Two settings
    never share a label: a rename that would merge them is not applied (a warning says so)."""
    df = df.copy()
    if not len(df):
        df["label"] = pd.Series(dtype=str)
        return df
    const = constant_params(df)
    df["label"] = df.apply(lambda r: method_label(r, const.get(str(r.get("method")), {}), names),
                           axis=1)
    extra_pool = [c for c in setting_columns(df, seed)
                  if not c.startswith("method") and c not in ("model", "dataset")]
    for _, idx in df.groupby(["model", "dataset"], dropna=False).groups.items():
        g = df.loc[idx]
        for c in _varying(g, extra_pool):
            if c == SOURCE:  # after the rest: "pool k=2 [gpu]"
                continue
            short = c.rsplit(".", 1)[-1]
            has = g[c].notna()
            df.loc[g.index[has], "label"] += " " + short + "=" + g.loc[has, c].map(fmt_value)
    if SOURCE in df:  # --compare: every label names its source, varying or not
        df["label"] += df[SOURCE].map(lambda v: f" [{v}]")
    renamed = df["label"].map(names.relabel)
    keys = [c for c in ("model", "dataset") if c in df]
    clash = df.assign(_new=renamed).groupby([*keys, "_new"], dropna=False)["label"].transform(
        "nunique") > 1
    for old in sorted(set(df.loc[clash, "label"])):
        log.warning("label rename %r -> %r is not applied: it would merge settings", old,
                    names.relabel(old))
    df["label"] = renamed.where(~clash, df["label"])
    return df


# ---------------------------------------------------------------- baselines


def parse_baseline(spec: str) -> dict[str, str]:
    """'method=none' or 'method=none,trainer.precision=fp32' -> {column: value}."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise InputError(f"--baseline must look like method=none, got {spec!r}")
        out[key] = value
    return out


def _is(df: pd.DataFrame, where: dict[str, str]) -> pd.Series:
    mask = pd.Series(True, index=df.index)
    for k, v in where.items():
        mask &= df[k].map(fmt_value) == v if k in df else False
    return mask


MISSING = "-"  # a missing value (None or NaN) in a match key: equal to any other missing one


def match_key(row: pd.Series, match: Sequence[str]) -> tuple:
    """The values a run and its baseline share, compared as labels show them (2.0 == 2)."""
    return tuple(MISSING if isna(v := row.get(k)) else fmt_value(v) for k in match)


_key = match_key


def ratio(value, base) -> float:
    """value / base; NaN when either is missing or the base is 0 (no ratio to draw)."""
    a, b = float(_num(value)), float(_num(base))
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def add_baselines(df: pd.DataFrame, baseline: str = DEFAULT_BASELINE,
                  match: Sequence[str] = DEFAULT_MATCH, *, ratios: dict[str, str] = RATIOS,
                  deltas: dict[str, str] = DELTAS, prefer: Sequence[str] = (),
                  first: bool = False) -> tuple[pd.DataFrame, list[str]]:
    """Add `is_baseline`, `baseline_run_dir` and the relative columns (`ratios`: column ->
    its ratio's name, `deltas`: column -> its difference's).

    A run's baseline is the finished (status ok) `baseline` run with equal `match` columns; a
    baseline run is its own. Among several candidates those equal to the run on `prefer` come
    first (a study: the none of the run's own part); then they are averaged (with a warning: add
    a key to `match`), or with `first` the first (in row order) is taken; none gives NaN and a
    warning. Returns (df, warnings), the warnings not logged (the caller says them).
    """
    df = df.copy()
    warnings: list[str] = []
    where = parse_baseline(baseline)
    if tuple(match) == DEFAULT_MATCH:  # the workload's own options too: a none of another
        # sequence length, attention kernel or image size is not this run's baseline, nor one
        # of another strategy or number of ranks (rows since those options exist)
        match = [*match, *(c for c in df.columns if c.startswith(("model.", "dataset."))),
                 *(c for c in SHARDING if c in df)]
    for k in [*where, *match]:
        if k not in df:
            warnings.append(f"column {k!r} (in --baseline/--match) is in no run; it matches "
                            f"as missing everywhere")
    df["is_baseline"] = _is(df, where)
    ok = df["is_baseline"] & (df.get("status", "ok") == "ok")
    base = df[ok]
    groups = {k: g for k, g in base.groupby(base.apply(_key, axis=1, match=match))} \
        if len(base) else {}
    for col in (*ratios.values(), *deltas.values()):
        df[col] = math.nan
    df["baseline_run_dir"] = None
    for i, row in df.iterrows():
        if not ok[i] and all(isna(row.get(c)) for c in ratios):
            continue  # nothing measured (e.g. refused before training): nothing to relate
        cand = base.loc[[i]] if ok[i] else groups.get(_key(row, match))
        if cand is not None and prefer and not ok[i]:
            own = cand[cand.apply(_key, axis=1, match=prefer) == _key(row, prefer)]
            cand = own if len(own) else cand
        if cand is not None and not ok[i]:
            cand, why = _same_device(row, cand)
            if why:
                warnings.append(f"no {baseline} baseline for {method_label(row)} on its device: "
                                f"{why}; relative columns are NaN")
                continue
        if cand is None:
            if not row["is_baseline"]:
                warnings.append(f"no {baseline} baseline for {method_label(row)} "
                                f"({', '.join(f'{k}={fmt_value(row.get(k))}' for k in match)}): "
                                f"relative columns are NaN")
            continue
        if first:
            cand = cand.iloc[:1]
        elif len(cand) > 1:
            warnings.append(f"{len(cand)} {baseline} runs match {method_label(row)} "
                            f"({_key(row, match)}); using their mean. Add a key to --match.")
        df.at[i, "baseline_run_dir"] = ";".join(cand["run_dir"].astype(str))
        for col, rel in ratios.items():
            if col in df:
                df.at[i, rel] = ratio(row.get(col), _num(cand[col]).mean())
        for col, delta in deltas.items():
            if col in df:
                df.at[i, delta] = _num(row.get(col)) - _num(cand[col]).mean()
    return df, warnings


# A ratio is only drawn between runs measured alike: the device kind (cpu, cuda) and where the
# peak came from (cuda allocator or live-tensor tracker).
DEVICE_KEYS = ("device", "mem_peak_source")


def _device_key(row: pd.Series) -> tuple[str | None, str | None]:
    """(device kind, peak source) of a run; None where the row has none (a run stopped before
    its accounting step measured nothing)."""
    kind, src = row.get("device"), row.get("mem_peak_source")
    return (None if isna(kind) or kind == "" else str(kind).split(":")[0],
            None if isna(src) or src == "" else str(src))


def _alike(mine: tuple, theirs: tuple) -> bool:
    """Measured alike: equal where both rows know (a missing part matches any: its ratios are
    NaN anyway)."""
    return all(a is None or b is None or a == b for a, b in zip(mine, theirs))


def _same_device(row: pd.Series, cand: pd.DataFrame) -> tuple[pd.DataFrame | None, str]:
    """The candidates measured like `row` (see DEVICE_KEYS), or (None, why not)."""
    mine = _device_key(row)
    theirs = cand.apply(_device_key, axis=1)
    same = cand[theirs.map(lambda k: _alike(mine, k))]
    if len(same):
        return same, ""

    def where(key: tuple) -> str:
        d, p = key
        return f"device {d or 'unknown'}" + (f", peak from {p}" if p else "")

    other = ", ".join(sorted({where(k) for k in theirs}))
    return None, f"the matching runs were measured on {other}, this one on {where(mine)}"


def _num(v):
    return pd.to_numeric(v, errors="coerce")


# ---------------------------------------------------------------- seeds


def status_summary(statuses: pd.Series) -> str:
    """'ok' when every run is ok, else e.g. 'ok 2/3, oom 1/3'."""
    counts = statuses.fillna("missing").value_counts()
    if list(counts.index) == ["ok"]:
        return "ok"
    n = len(statuses)
    return ", ".join(f"{s} {c}/{n}" for s, c in counts.items())


def aggregate_seeds(df: pd.DataFrame, seed: str = SEED,
                    names: Names = DEFAULT_NAMES) -> pd.DataFrame:
    """One row per setting (every config column but the seed): `n_runs`, `n_ok`, `status`
    (see status_summary), `worst_status`, `timing_noisy` (any ok run's, or its seeds' step times
    more than 1.5x apart: derive.spread_noisy), `error_short` (the most
    common reason among the failed runs), and for each numeric column its mean (same name) and
    standard deviation (`<name>_std`, ddof=1, NaN for one seed) over the runs that ended ok."""
    if df.empty:
        return df
    keys = setting_columns(df, seed)
    config = config_columns(df)  # options are kept as they are (first run's), never averaged
    numeric = [c for c in df.columns if c not in config
               and pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])]
    rows = []
    for _, g in df.groupby(keys, dropna=False, sort=False):
        row = g.iloc[0][[c for c in config if c != seed]].to_dict()
        ok = g[g["status"] == "ok"] if "status" in g else g
        row.update(n_runs=len(g), n_ok=len(ok),
                   status=status_summary(g["status"]) if "status" in g else "ok",
                   worst_status=_worst(g["status"]) if "status" in g else "ok",
                   seeds=",".join(sorted(g[seed].map(fmt_value))) if seed in g else "",
                   mem_peak_source=_sources(ok if len(ok) else g),
                   run_dirs=";".join(g["run_dir"].astype(str)) if "run_dir" in g else "",
                   timing_noisy=bool(ok.get("timing_noisy", pd.Series(dtype=bool)).any())
                   or derive.spread_noisy(ok.get("step_time_e2e_s", pd.Series(dtype=float))),
                   error_short=_common(g.drop(ok.index).get("error_short")),
                   # ok runs whose row says they did not learn (memtrain.run.learned)
                   n_not_learned=int((ok.get("learned", pd.Series(dtype=object))
                                      .map(said_false)).sum()))
        row["did_not_learn"] = row["n_not_learned"] > 0
        for c in numeric:
            vals = ok[c].astype(float)
            row[c] = vals.mean()
            row[f"{c}_std"] = vals.std(ddof=1) if vals.notna().sum() > 1 else math.nan
        # a failed setting still shows how far it got (e.g. the memory of the step that oomed)
        if not len(ok):
            for c in numeric:
                row[c] = g[c].astype(float).mean()
        rows.append(row)
    return add_labels(pd.DataFrame(rows), seed, names)


def said_false(v) -> bool:
    """A flag that says no: False as JSON writes it, 'False' or 'false' as text, 0 as a CSV of
    rows with gaps reads it (a column of true, false and missing loads as 1.0, 0.0, NaN)."""
    if isinstance(v, str):
        return v.strip().lower() == "false"
    try:
        return not isna(v) and float(v) == 0.0
    except (TypeError, ValueError):
        return False


def _sources(g: pd.DataFrame) -> str:
    """'tracker', 'cuda' or 'cuda,tracker': where the peaks of these runs came from."""
    src = g["mem_peak_source"].dropna().astype(str) if "mem_peak_source" in g else []
    return ",".join(sorted(set(src) - {""}))


def _common(texts: pd.Series | None) -> str:
    """The most frequent non-empty text ('' when none)."""
    texts = texts[texts.fillna("") != ""] if texts is not None else pd.Series(dtype=str)
    return str(texts.value_counts().index[0]) if len(texts) else ""


STATUS_ORDER = ("error", "oom", "diverged", "interrupted", "running", "missing", "ok")


def _worst(statuses: pd.Series) -> str:
    present = set(statuses.fillna("missing"))
    return next((s for s in STATUS_ORDER if s in present), sorted(present)[0])
