"""`memtrain-report DIR [DIR...]`: every run below the folders -> summary.csv, summary.parquet,
settings.csv, report.md, report.html (self-contained) and figures/ (PNG and PDF), plus a table
on the terminal. `--compare A=DIR B=DIR`: the sweeps side by side, each row naming its source."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pandas as pd

from memtrain import columns
from memtrain.columns import ESTIMATE, PEAK, PEAK_SOURCE, RESERVED, TEST_ACC
from memtrain.report import markdown, tables
from memtrain.report.markdown import decimals_for
from memtrain.report.names import fmt_value, isna
from memtrain.report.style import method_rank

AT_PEAK_ACT = "mem_at_peak_act_bytes"  # activations alive at the step's peak (measure.py)

# The terminal table: the few columns that fit a line, each with one number format: column ->
# (heading, how a value is written). Memory in MiB and numbers with the decimals the column's
# largest value needs; ratios (memtrain/columns.py's: the headline one first) with two decimals,
# percentages with one.
MIB, RATIO, PERCENT, NUMBER, TEXT = "MiB", "ratio", "percent", "number", "text"
COMPACT = {
    "model": ("model", TEXT),
    "dataset": ("dataset", TEXT),
    "trainer.batch_size": ("batch", TEXT),
    "trainer.seed": ("seed", TEXT),
    "status": ("status", TEXT),
    PEAK: ("peak_MiB", MIB),
    columns.HEADLINE.name: ("peak/none", RATIO),
    RESERVED: ("reserved_MiB", MIB),  # CUDA only
    "mem_reserved_rel": ("reserved/none", RATIO),
    AT_PEAK_ACT: ("act_at_peak_%", PERCENT),
    "mem_act_temp_rel": ("act_temp/none", RATIO),  # detail: activations + backward temporaries
    "mem_saved_rel": ("saved/none", RATIO),  # detail: saved for backward
    PEAK_SOURCE: ("peak_from", TEXT),
    "throughput_e2e_samples_s": ("samples_s", NUMBER),  # end to end (derive.py)
    TEST_ACC: ("test_acc_%", PERCENT),
    # the GPU-free estimate's predictions (trainer.estimate=true)
    ESTIMATE: ("pred_peak_MiB", MIB),
    "mem_estimate_rel": ("pred_peak/none", RATIO),
}


def _share(df: pd.DataFrame) -> pd.Series:
    """The activations' part of the step's peak: 0 when the peak falls where no activation is
    alive (the optimizer's update), so that no activation saving can lower it."""
    return pd.to_numeric(df[AT_PEAK_ACT], errors="coerce") / pd.to_numeric(
        df[PEAK], errors="coerce")


def _written(v: pd.Series, how: str) -> pd.Series:
    """A column's values in its one format ('-' where missing)."""
    num = pd.to_numeric(v, errors="coerce")
    if how == TEXT:
        return v.map(lambda x: "-" if isna(x) else fmt_value(x))
    scale = {MIB: 1 / 2**20, PERCENT: 100.0}.get(how, 1.0)
    dec = {RATIO: 2, PERCENT: 1}.get(how) or decimals_for(num * scale)
    return (num * scale).map(lambda x: markdown.number(x, dec, missing="-"))


def compact(df: pd.DataFrame) -> pd.DataFrame:
    """The terminal table: one row per run, baseline first within each model and dataset (then
    the methods in their display order), every column in one number format (`COMPACT`)."""
    if df.empty:
        return df
    df = df.assign(**{AT_PEAK_ACT: _share(df)}) if {AT_PEAK_ACT, PEAK} <= set(df) else df
    order = df.assign(_rank=method_rank(df["method"]),
                      _label=df["label"] if "label" in df else df["method"])
    keys = [c for c in ("model", "dataset", tables.SOURCE, "_rank", "_label", "trainer.seed")
            if c in order]
    df = df.loc[order.sort_values(keys, kind="stable").index]
    out = pd.DataFrame(index=df.index)
    if tables.SOURCE in df:
        out["source"] = df[tables.SOURCE]
    out["method"] = df["label"] if "label" in df else df["method"]
    for col, (name, how) in COMPACT.items():
        if col not in df or (col != TEST_ACC and df[col].isna().all()):  # none measured
            continue
        out[name] = _written(df[col], how)
    return out.reset_index(drop=True)


def legend(table: pd.DataFrame, baseline: str = "none") -> list[str]:
    """What the terminal table's ratios are, one line each: the headline one, then the
    detail."""
    shown = set(table.columns)
    lines = [f"{COMPACT[r.name][0]}: {r.over(baseline)}" for r in columns.RATIOS
             if r.name in COMPACT and COMPACT[r.name][0] in shown]
    if COMPACT[AT_PEAK_ACT][0] in shown:
        lines.append(f"{COMPACT[AT_PEAK_ACT][0]}: the activations' share of the step's peak "
                     f"(`{AT_PEAK_ACT}`); at 0 the peak falls where no activation is alive (the "
                     f"optimizer's update), so no activation saving lowers peak/none")
    head = f"ratios: {columns.BASELINE_RULE.replace('none', baseline)}"
    return [ln.replace("`", "") for ln in (head, *lines)] if len(lines) else []


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="memtrain-report", description=__doc__)
    ap.add_argument("dirs", nargs="+", help="run folders, multirun folders or any parent; "
                    "with --compare each a source, as LABEL=DIR or DIR (labelled by its name)")
    ap.add_argument("--out", help="where the report goes (default: the first DIR; with "
                                  "--compare, compare/ beside it)")
    ap.add_argument("--compare", action="store_true",
                    help="one report over several sweeps side by side: every row names its "
                         "source (a column of the tables, [LABEL] in the figures) and takes "
                         "its baseline from its own source")
    ap.add_argument("--baseline", default=tables.DEFAULT_BASELINE,
                    help="which runs are baselines, as column=value[,column=value] "
                         "(default: %(default)s)")
    ap.add_argument("--match", default=",".join(tables.DEFAULT_MATCH),
                    help="columns a run and its baseline share (default: %(default)s, and "
                         "every model.* and dataset.* option)")
    ap.add_argument("--format", default="png,pdf",
                    help="figure formats, comma-separated (default: %(default)s)")
    ap.add_argument("--memory", default="auto", choices=("auto", "peak", "act", "saved"),
                    help="memory the figures plot: auto = the CUDA peak where every run has "
                         "one, else activation memory (CPU); peak, act (saved + recomputed "
                         "activations), saved (saved for backward)")
    ap.add_argument("--style", default="paper", choices=("paper", "slide"),
                    help="figure look: paper (a 3.3 in column, 7 pt text) or slide (6 in "
                         "panels, 14 pt text) (default: %(default)s)")
    ap.add_argument("--names", metavar="FILE.yaml",
                    help="display names: short parameter names, named settings, label renames, "
                         "model and dataset names (docs/reports.md)")
    ap.add_argument("--label", action="append", default=[], metavar="LABEL:NAME",
                    help="draw the setting labelled LABEL as NAME (repeatable)")
    ap.add_argument("--no-figures", action="store_true", help="tables and report.md only")
    ap.add_argument("--figures", metavar="NAME[,NAME]",
                    help="draw only these figures (cost, tradeoff, budget, ...: report.md "
                         "lists them)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from memtrain.report import names
    from memtrain.report.build import InputError, make_report

    args = parser().parse_args(argv)
    # what the report skips or warns about, it prints below, once: no second copy through
    # Python's last-resort log handler
    logging.getLogger("memtrain.report").addHandler(logging.NullHandler())
    try:  # a bad names file or --label is bad input: one line, exit 2, before any work
        disp = names.load(args.names, dict(names.parse_label(x) for x in args.label))
    except ValueError as e:
        print(f"memtrain-report: error: {e}", file=sys.stderr)
        return 2
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"memtrain-report: error: --out {args.out} is a file, not a folder", file=sys.stderr)
        return 2
    try:
        rep = make_report(args.dirs, args.out, baseline=args.baseline,
                          match=[k.strip() for k in args.match.split(",") if k.strip()],
                          formats=[f.strip() for f in args.format.split(",") if f.strip()],
                          memory=args.memory, figures=not args.no_figures, style=args.style,
                          names=disp, compare=args.compare,
                          only=None if args.figures is None else
                          [f.strip() for f in args.figures.split(",") if f.strip()])
    except FileNotFoundError as e:
        print(f"memtrain-report: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # --out under a file, or on a read-only disk
        print(f"memtrain-report: error: cannot write the report: {e}", file=sys.stderr)
        return 2
    except InputError as e:
        print(f"memtrain-report: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"memtrain-report: error: {e}", file=sys.stderr)
        return 1
    for d, why in rep.skipped:
        print(f"memtrain-report: skipped {d}: {why}", file=sys.stderr)
    for w in rep.warnings:
        print(f"memtrain-report: warning: {w}", file=sys.stderr)
    table = compact(rep.runs)
    with pd.option_context("display.max_rows", 200, "display.width", 250,
                           "display.max_columns", 30):
        print(table.to_string(index=False))
    base = tables.parse_baseline(args.baseline).get("method", args.baseline)
    print("\n" + "\n".join(legend(table, base)))
    figs = ", ".join(rep.figures) or "none"
    print(f"\n{len(rep.runs)} runs, {len(rep.settings)} settings -> {rep.out / 'report.md'}, "
          f"{'report.html, ' * (rep.out / 'report.html').is_file()}summary.csv, "
          f"summary.parquet; figures: {figs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
