"""The study's markdown tables, one section per part, from the runs' summary.json files.

Built on memtrain/report/: its row loader (`tables.load_runs`, every row kept), its ratios
(`tables.add_baselines`, `tables.ratio`), its byte units (`style.byte_unit`), its number format
(`markdown.number`) and its setting labels (`names.Names`, the rules of conf/report/study.yaml);
the column names and labels are memtrain/columns.py's.

Ratios are against the `none` run measured alike (same model, size, batch, precision, steps and
probes; one of the same part first): never across devices or peak sources. Every table reads the
raw columns (`mem_peak_alloc_bytes`, `mem_peak_act_bytes`, ...), so it does not depend on the
report's derived ones. A row that did not end ok keeps its status and its error.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from memtrain.columns import ACT_PEAK as ACT
from memtrain.columns import (
    ACT_TEMP_PEAK,
    ERROR,
    ESTIMATE,
    ESTIMATE_ACT,
    MAX_BATCH,
    METHOD,
    PEAK,
    SAVED,
    STATUS,
    STEP_TIME,
    TEST_ACC,
    THROUGHPUT,
)
from memtrain.report import derive, markdown, names, style
from memtrain.report import tables as report

MATCH = ("model", "dataset", "dataset.image_size", "dataset.channels", "trainer.batch_size",
         "trainer.precision", "trainer.seed", "trainer.max_steps", "trainer.warmup_steps",
         "trainer.epochs", "trainer.estimate", "trainer.find_max_batch", "trainer.gpu_memory_gb",
         "optim", "device", "mem_peak_source")
# each ratio (x_*) and difference (d_acc) against the run's none: report.add_baselines
# x_act: activations + backward temporaries (what a method's step needs for them, not only what
# it keeps: quantize's dequantized copies and pool's upsampled maps count)
# (rows written before the complete activation peak existed have activations only: their x_act
# is that one, and a table of such rows says "act. peak", not "act.+temp. peak")
RATIOS = {PEAK: "x_peak", ACT_TEMP_PEAK: "x_act_temp", ACT: "x_act_only", SAVED: "x_saved",
          THROUGHPUT: "x_thr", STEP_TIME: "x_step", MAX_BATCH: "x_batch"}
DELTAS = {TEST_ACC: "d_acc"}
OVERHEAD_HEAD = ("| date | device | model | px | batch | plain loop ms/step | memtrain ms/step | "
                 "ratio | torch |")
# a setting's short name (conf/report/study.yaml), the method's name where no rule names it
NAMES = names.load(names.conf_file("study"))


def load_rows(runs: Path) -> pd.DataFrame:
    """One row per run below runs/<part>/<step>/ (report.load_runs, every row kept: parts may
    measure the same config), with `part` and `step` columns; `run_dir` is where it is now."""
    runs = Path(runs)
    df = report.load_runs([runs], latest=False)[0] if runs.is_dir() else pd.DataFrame()
    if len(df):  # <part>/<step>/<job>/summary.json
        rel = df["run_dir"].map(lambda d: Path(d).relative_to(runs.resolve()).parts)
        df = df[rel.map(len) == 3].assign(part=rel.str[0], step=rel.str[1])
        df = df.reset_index(drop=True)
    for col in ("part", "step", METHOD, STATUS, *MATCH):
        if col not in df:
            df[col] = None
    return df


def read_md_table(path: Path) -> pd.DataFrame:
    """The first markdown table of a file (a benchmark's output), as text cells."""
    if not path.exists():
        return pd.DataFrame()
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")]
            for ln in path.read_text().splitlines() if ln.startswith("|")]
    rows = [r for r in rows if not all(set(c) <= set("-: ") for c in r)]
    return pd.DataFrame(rows[1:], columns=rows[0]) if rows else pd.DataFrame()


def add_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """`x_peak`, `x_act`, `x_saved`, `x_thr`, `x_step`, `x_batch`, `d_acc`: each run against the
    first ok none with equal MATCH columns, one of its own part first."""
    df = report.add_baselines(df, report.DEFAULT_BASELINE, MATCH, ratios=RATIOS,
                              deltas=DELTAS, prefer=("part",), first=True)[0]
    return df.assign(x_act=df["x_act_temp"].where(df["x_act_temp"].notna(), df["x_act_only"]))


def _act_head(df: pd.DataFrame) -> str:
    """The x_act column's heading: what its rows measured."""
    complete = ACT_TEMP_PEAK in df and pd.to_numeric(df[ACT_TEMP_PEAK], errors="coerce").notna()
    return "act.+temp. peak x none" if bool(getattr(complete, "any", lambda: False)()) else \
        "act. peak x none"


def _num(v) -> float:
    return pd.to_numeric(v, errors="coerce")


def fmt(v, digits: int = 3) -> str:
    """A number of the tables (markdown.number): `digits` decimals, '-' when missing, whole from
    1000 on ('1,830'), text as it is."""
    return markdown.number(v, digits, missing="-", whole_from=1000)


def unit_of(values) -> tuple[str, float]:
    """GiB for figures of 2 GiB and more, MiB otherwise (style.byte_unit)."""
    div, unit = style.byte_unit(pd.Series(values, dtype=object), ("GiB", "MiB"), at_least=2)
    return unit, div


def table(df: pd.DataFrame, cols: dict[str, Callable[[pd.Series], str]]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(str(f(row)).replace("|", "/") for f in cols.values())
                     + " |")
    return lines


def setting(row: pd.Series) -> str:
    """A short name for a run's method setting: its rule's in conf/report/study.yaml, else the
    method's name (report/names.py's labeller, no parameter beside the rule's)."""
    return NAMES.setting(row, skip=[k for k in row.index if str(k).startswith("method.")])


def status(row: pd.Series) -> str:
    s = str(row.get(STATUS))
    err = row.get(ERROR)
    return s if s == "ok" or names.isna(err) else f"{s}: {derive.first_line(err)[:90]}"


def _mem(col: str, div: float) -> Callable[[pd.Series], str]:
    return lambda r: fmt(_num(r.get(col)) / div, 2)


def _x(col: str) -> Callable[[pd.Series], str]:
    return lambda r: fmt(r.get(col))


def _order(df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    df = df.assign(_none=df["method"] != "none", _set=df.apply(setting, axis=1))
    return df.sort_values([*cols, "_none", "method", "_set"], kind="stable")


def baseline(df: pd.DataFrame, runs: Path) -> list[str]:
    d = _order(df[(df["part"] == "baseline")], "trainer.batch_size", "trainer.precision")
    unit, div = unit_of(d[PEAK]) if len(d) else ("MiB", 2.0**20)
    lines = table(d, {
        "batch": lambda r: r["trainer.batch_size"], "precision": lambda r: r["trainer.precision"],
        "status": status, f"peak {unit}": _mem(PEAK, div),
        f"reserved {unit}": _mem("mem_peak_reserved_bytes", div),
        "params": _mem("mem_at_peak_params_bytes", div),
        "grads": _mem("mem_at_peak_grads_bytes", div),
        "optimizer": _mem("mem_at_peak_optim_bytes", div),
        "activations": _mem("mem_at_peak_act_bytes", div),
        "other": _mem("mem_at_peak_other_bytes", div),
        f"saved act. {unit}": _mem(SAVED, div),
        "samples/s": _x("throughput_samples_s"),
        "step ms (median / p90)": lambda r: f"{fmt(1e3 * _num(r.get('step_time_s_median')), 1)}"
                                            f" / {fmt(1e3 * _num(r.get('step_time_s_p90')), 1)}",
        "peak source": lambda r: r.get("mem_peak_source")})
    lines += ["", "Breakdown: the parts at the moment of the peak (they add up to it; on CUDA "
              "`other` is the CUDA peak minus the tracked tensors: allocator rounding and "
              "workspaces; on the CPU it holds the batch)."]
    overhead = runs / "baseline" / "overhead.md"
    if overhead.exists():  # rows appended by `benchmarks.overhead --out`
        lines += ["", "Runner overhead (`python -m benchmarks.overhead`: memtrain's loop "
                  "against a plain PyTorch loop, same model, batches and optimizer; median step "
                  "time over the rounds):", "", OVERHEAD_HEAD, "|" + " --- |" * 9,
                  *overhead.read_text().strip().splitlines()]
    return lines


def _vs_none(df: pd.DataFrame, unit: str, div: float, extra: dict | None = None) -> list[str]:
    cols = {"setting": setting, "status": status, f"peak {unit}": _mem(PEAK, div),
            "peak x none": _x("x_peak"), _act_head(df): _x("x_act"),
            "saved x none": _x("x_saved"), "samples/s": _x("throughput_samples_s"),
            "throughput x none": _x("x_thr")}
    return table(df, {**cols, **(extra or {})})


def pool(df: pd.DataFrame, runs: Path) -> list[str]:
    cells = _cells(df, "pool")
    d = df[df["_cell"].isin(cells) & df["method"].isin(["none", "pool"])
           & df["part"].isin(["pool", "baseline"])]
    d = _order(d, "trainer.batch_size", "trainer.precision")
    unit, div = unit_of(d[PEAK]) if len(d) else ("MiB", 2.0**20)
    return _vs_none(d, unit, div, {"batch": lambda r: r["trainer.batch_size"],
                                   "precision": lambda r: r["trainer.precision"]})


def _cells(df: pd.DataFrame, part: str) -> set:
    return set(df.loc[df["part"] == part, "_cell"])


def prune(df: pd.DataFrame, runs: Path) -> list[str]:
    d = _order(df[df["part"] == "prune"], "trainer.precision")
    unit, div = unit_of(d[PEAK]) if len(d) else ("MiB", 2.0**20)
    lines = _vs_none(d, unit, div, {"precision": lambda r: r["trainer.precision"],
                                    "model": lambda r: r["model"]})
    kernels = runs / "prune" / "kernels.md"
    if kernels.exists():
        body = [ln for ln in kernels.read_text().strip().splitlines() if not ln.startswith("# ")]
        lines += ["", "Kernels (`python -m benchmarks.kernels prune`):", *body]
    return lines


def checkpoint(df: pd.DataFrame, runs: Path) -> list[str]:
    cells = _cells(df, "checkpoint")
    d = df[df["_cell"].isin(cells) & df["method"].isin(["none", "checkpoint"])
           & df["part"].isin(["checkpoint", "baseline"])]
    d = _order(d, "trainer.batch_size")
    unit, div = unit_of(d[PEAK]) if len(d) else ("MiB", 2.0**20)
    return table(d, {
        "setting": setting, "status": status, f"peak {unit}": _mem(PEAK, div),
        "peak x none": _x("x_peak"), _act_head(d): _x("x_act"),
        "step ms": lambda r: fmt(1e3 * _num(r.get("step_time_s_median")), 1),
        "step time x none": _x("x_step"),
        "planned act. peak MiB": _mem("plan_peak_bytes", 2.0**20),
        "measured act. peak MiB": _mem(ACT, 2.0**20),
        "planned overhead %": lambda r: fmt(100 * _num(r.get("plan_overhead")), 1)})


def _part_peaks(row: pd.Series, col: str, div: float) -> str:
    k = int(_num(row.get("method.partitions"))) if row["method"] == "synthetic" else 0
    vals = [_num(row.get(f"part{j}.{col}")) for j in range(k)] if k else [_num(row.get(col))]
    return " / ".join(fmt(v / div, 2) for v in vals)


def _largest(row: pd.Series, col: str, base: pd.DataFrame) -> str:
    k = int(_num(row.get("method.partitions"))) if row["method"] == "synthetic" else 0
    top = max([_num(row.get(f"part{j}.{col}")) for j in range(k)] or [_num(row.get(col))])
    ref = base[base["_key"] == row["_key"]]
    return fmt(report.ratio(top, ref.iloc[0][col])) if len(ref) else "-"


def synthetic(df: pd.DataFrame, runs: Path) -> list[str]:
    d = df[df["part"].isin(["synthetic", "tradeoff"]) & df["method"].isin(["none", "synthetic"])]
    d = _order(d, "model")
    base = d[(d["method"] == "none") & (d["status"] == "ok")]
    unit, div = unit_of(d[PEAK]) if len(d) else ("MiB", 2.0**20)
    return table(d, {
        "model": lambda r: r["model"], "setting": setting, "status": status,
        f"peak per partition {unit}": lambda r: _part_peaks(r, PEAK, div),
        "largest x none": lambda r: _largest(r, PEAK, base),
        "act. peak per partition MiB": lambda r: _part_peaks(r, ACT, 2.0**20),
        "largest act. x none": lambda r: _largest(r, ACT, base),
        "test acc": _x("test_acc"), "acc - none": lambda r: fmt(100 * r["d_acc"], 1)})


def tradeoff(df: pd.DataFrame, runs: Path) -> list[str]:
    d = _order(df[df["part"] == "tradeoff"], "model")
    unit, div = unit_of(d[PEAK]) if len(d) else ("MiB", 2.0**20)
    return _vs_none(d, unit, div, {"test acc": _x("test_acc"),
                                   "acc - none (points)": lambda r: fmt(100 * r["d_acc"], 1)})


def probe_note(row: pd.Series) -> str:
    """Why a probe cannot match the run it predicts (facts of the code, not of this run)."""
    notes = []
    if not names.isna(row.get("mem_estimate_error")):
        notes.append(f"estimate failed: {str(row['mem_estimate_error'])[:80]}")
    if row["method"] == "checkpoint" and row.get("method.strategy") in ("budget", "uniform",
                                                                         "sqrt"):
        notes.append("the probes build the model with wrap() only; recomputation is planned "
                     "in fit(), so they see the model without it")
    if row["method"] == "synthetic":
        notes.append("the probes run the whole partitioned model end to end; training holds "
                     "one partition at a time")
    return "; ".join(notes)


def estimate(df: pd.DataFrame, runs: Path) -> list[str]:
    d = _order(df[(df["part"] == "probes") & df["step"].str.startswith("estimate")], "model")
    unit, div = unit_of(d[PEAK]) if len(d) else ("MiB", 2.0**20)

    def ratio(r):
        return report.ratio(r.get(ESTIMATE), r.get(PEAK))

    return table(d, {
        "model": lambda r: r["model"], "setting": setting, "status": status,
        f"estimate {unit}": _mem(ESTIMATE, div),
        f"measured peak {unit}": _mem(PEAK, div),
        "estimate / measured": lambda r: fmt(ratio(r)),
        "within 10%": lambda r: "-" if math.isnan(ratio(r)) else
        ("yes" if abs(ratio(r) - 1) <= 0.1 else "no"),
        "act. estimate / measured": lambda r: fmt(report.ratio(r.get(ESTIMATE_ACT), r.get(ACT))),
        f"measured other {unit}": _mem("mem_at_peak_other_bytes", div),
        "peak source": lambda r: r.get("mem_peak_source"), "why it differs": probe_note})


def capacity(df: pd.DataFrame, runs: Path) -> list[str]:
    d = _order(df[(df["part"] == "probes") & df["step"].str.startswith("capacity")], "model")
    basis = lambda r: "2 real steps under the cap" if r.get("device") == "cuda" or \
        str(r.get("device", "")).startswith("cuda") else "estimate <= cap"
    return table(d, {
        "model": lambda r: r["model"], "setting": setting, "status": status,
        "cap GiB": lambda r: r.get("trainer.gpu_memory_gb"),
        "largest batch": lambda r: fmt(r.get("max_batch_size"), 0), "x none": _x("x_batch"),
        "decided by": basis, "note": probe_note})


def tests(df: pd.DataFrame, runs: Path) -> list[str]:
    xml = runs / "tests" / "junit.xml"
    if not xml.exists():
        return ["No test report (junit.xml) was written."]
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    lines = [f"`pytest -m gpu`: {passed} passed, {n['failures']} failed, {n['errors']} errors, "
             f"{n['skipped']} skipped ({float(suite.get('time', 0)):.0f} s)."]
    for case in suite.iter("testcase"):
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None and (kind != "skipped" or n["skipped"] < n["tests"]):
                msg = (el.get("message") or "").splitlines()[0][:120] if el.get("message") else ""
                lines.append(f"- {kind}: `{case.get('name')}` {msg}")
    if n["tests"] and n["skipped"] == n["tests"]:
        reason = (suite.find("testcase/skipped").get("message") or "").splitlines()[0][:120]
        lines.append(f"- every test skipped: {reason}")
    return lines


SECTIONS: dict[str, tuple[str, Callable[[pd.DataFrame, Path], list[str]]]] = {
    "tests": ("CUDA tests", tests),
    "baseline": ("baseline: resnet50, none", baseline),
    "pool": ("pool: resnet50 (compaction only, k=2 and 4, conv and conv+bn)", pool),
    "prune": ("prune: ResMLP end to end and the kernels", prune),
    "checkpoint": ("checkpoint: resnet50 frontier (budget, compile at the same budgets, "
                   "uniform, sqrt, selective)", checkpoint),
    "synthetic": ("synthetic: per-partition peak vs none", synthetic),
    "tradeoff": ("trade-off: every method at its default, trained (experiment=quick)", tradeoff),
    "estimate": ("estimate vs measured peak, every method", estimate),
    "capacity": ("find_max_batch under a memory cap, every method", capacity),
}
# which part's status a section reports
SECTION_PART = {"estimate": "probes", "capacity": "probes"}


def prepare(df: pd.DataFrame) -> pd.DataFrame:
    if not len(df):
        return df.assign(_cell=None, _key=None, x_peak=math.nan, x_act=math.nan,
                         x_saved=math.nan, x_thr=math.nan, x_step=math.nan, d_acc=math.nan,
                         x_batch=math.nan)
    df = add_ratios(df)
    df["_key"] = df.apply(report.match_key, axis=1, match=MATCH)
    df["_cell"] = df["_key"]
    return df
