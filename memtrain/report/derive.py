"""Per-run columns the report derives from a summary: end-to-end throughput of multi-phase runs,
timing noise, the failure reason (an error's first line).

A method that trains in phases (synthetic: `part0.*`, `part1.*`, optionally `recovery.*`) keeps
the largest phase's step time in `step_time_s_median` / `throughput_samples_s`: that is one phase,
not the job. The report's throughput is end to end: the samples the whole model trained on over
the time all phases' steps took.
"""

from __future__ import annotations

import math
import re

import pandas as pd

# A run's step time is noisy when its 90th percentile is this far above its median (other jobs
# on the machine, frequency scaling): its throughput is drawn, flagged, not trusted.
NOISY_P90_OVER_MEDIAN = 1.5
PHASE = re.compile(r"^([A-Za-z]\w*)\.step_time_s_median$")
PARTITION = re.compile(r"^part\d+$")
ERROR_CHARS = 240  # a figure's footnote: about three lines of a paper column


def phases(df: pd.DataFrame) -> list[str]:
    """Phase prefixes with their own step times ('part0', 'part1', 'recovery')."""
    return [m.group(1) for c in df.columns if (m := PHASE.match(str(c)))]


def _get(row: pd.Series, col: str) -> float:
    v = pd.to_numeric(row.get(col), errors="coerce")
    return math.nan if v is None or pd.isna(v) else float(v)


def end_to_end(row: pd.Series, names: list[str]) -> dict[str, float]:
    """Throughput, step time, steps and timing noise of one run, over all its phases.

    A phase's time is its steps times its median step time (warm-up and evaluation excluded, as
    for a single-phase run); a sample has trained the model end to end once every partition
    (`part<j>`) has trained on it, so the samples are the fewest a partition saw plus those of
    whole-model phases (recovery). Single-phase runs keep their own columns.
    """
    done = [p for p in names if not math.isnan(_get(row, f"{p}.step_time_s_median"))
            and not math.isnan(_get(row, f"{p}.steps"))]
    median, p90 = _get(row, "step_time_s_median"), _get(row, "step_time_s_p90")
    if not done:
        return {"n_phases": 1, "throughput_e2e_samples_s": _get(row, "throughput_samples_s"),
                "step_time_e2e_s": median, "steps_e2e": _get(row, "steps"),
                "timing_noise": p90 / median if median > 0 else math.nan}
    time = samples = 0.0
    batch, part_samples = math.nan, []
    for p in done:
        steps, med = _get(row, f"{p}.steps"), _get(row, f"{p}.step_time_s_median")
        b = _get(row, f"{p}.throughput_samples_s") * med  # samples per step of the phase
        batch = b if math.isnan(batch) else batch
        time += steps * med
        if PARTITION.match(p):
            part_samples.append(steps * b)
        else:
            samples += steps * b
    samples += min(part_samples, default=0.0)
    noise = max(_get(row, f"{p}.step_time_s_p90") / _get(row, f"{p}.step_time_s_median")
                for p in done)
    return {"n_phases": len(done),
            "throughput_e2e_samples_s": samples / time if time > 0 else math.nan,
            "step_time_e2e_s": time * batch / samples if samples > 0 else math.nan,
            "steps_e2e": samples / batch if batch > 0 else math.nan, "timing_noise": noise}


def spread_noisy(step_times: pd.Series) -> bool:
    """Seeds of one setting whose step times lie more than NOISY_P90_OVER_MEDIAN apart: the
    machine's load changed between runs (each run may be steady within itself), so comparing
    their times with another setting's compares loads, not methods."""
    t = pd.to_numeric(step_times, errors="coerce").dropna()
    return len(t) > 1 and t.min() > 0 and t.max() / t.min() > NOISY_P90_OVER_MEDIAN


def first_line(text) -> str:
    """The first non-empty line of an error message (the rest is a traceback or detail)."""
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return ""
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")


def shorten(text: str, chars: int = ERROR_CHARS) -> str:
    return text if len(text) <= chars else text[:chars - 1].rstrip() + "…"


def _num(s: pd.Series) -> pd.Series:
    return pd.to_numeric(s, errors="coerce")


def add_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Add `n_phases`, `throughput_e2e_samples_s`, `step_time_e2e_s`, `steps_e2e`, `timing_noise`
    (p90 / median step time, the worst phase's), `timing_noisy`, `error_short` (the first line of
    `error`) and, for planned
    checkpoint runs, `plan_peak_rel` (the planner's activation peak / its baseline's) and
    `plan_overhead_pct`."""
    if df.empty:
        return df
    names = phases(df)
    extra = pd.DataFrame([end_to_end(r, names) for _, r in df.iterrows()], index=df.index)
    df = df.drop(columns=[c for c in extra.columns if c in df]).join(extra)
    df["timing_noisy"] = df["timing_noise"] > NOISY_P90_OVER_MEDIAN
    if {"plan_peak_bytes", "plan_baseline_peak_bytes"} <= set(df):  # checkpoint's planner
        df["plan_peak_rel"] = _num(df["plan_peak_bytes"]) / _num(df["plan_baseline_peak_bytes"])
    if "plan_overhead" in df:
        df["plan_overhead_pct"] = _num(df["plan_overhead"]) * 100
    df["error_short"] = df["error"].map(first_line) if "error" in df else ""
    return df
