"""`memtrain-report DIR [DIR...]`: every run below the folders -> summary.csv, summary.parquet,
settings.csv, report.md, report.html (self-contained) and figures/ (PNG and PDF), plus a table
on the terminal. `--compare A=DIR B=DIR`: the sweeps side by side, each row naming its source."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pandas as pd

from memtrain.columns import unit
from memtrain.report import tables

# The terminal table: the few columns that fit a line.
COMPACT = {
    "model": "model",
    "dataset": "dataset",
    "trainer.batch_size": "batch",
    "status": "status",
    "mem_peak_alloc_bytes": "peak_MiB",
    "mem_peak_source": "source",
    "mem_act_saved_bytes": "act_saved_MiB",
    "mem_peak_rel": "peak_rel",
    "mem_saved_rel": "saved_rel",
    "mem_act_temp_rel": "act_temp_peak_rel",  # activations + backward temporaries
    "throughput_e2e_samples_s": "samples_s",  # end to end (derive.py)
    "test_acc": "test_acc",
    # the GPU-free estimate's predictions (trainer.estimate=true)
    "mem_estimate_bytes": "pred_peak_MiB",
    "mem_estimate_rel": "pred_peak_rel",
}


def compact(df: pd.DataFrame) -> pd.DataFrame:
    """The few columns a terminal table shows, memory (bytes, memtrain/columns.py) in MiB."""
    if df.empty:
        return df
    out = pd.DataFrame(index=df.index)
    out["method"] = df["label"] if "label" in df else df["method"]
    if tables.SOURCE in df:
        out.insert(0, "source", df[tables.SOURCE])
    for col, name in COMPACT.items():
        if col not in df or (col != "test_acc" and df[col].isna().all()):  # none measured
            continue
        v = df[col]
        out[name] = pd.to_numeric(v, errors="coerce") / 2**20 if unit(col) == "bytes" else v
    sort = [c for c in ("model", "dataset", "source", "method") if c in out]
    return out.sort_values(sort).reset_index(drop=True)


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
                         "model and dataset names (see the README)")
    ap.add_argument("--label", action="append", default=[], metavar="LABEL:NAME",
                    help="draw the setting labelled LABEL as NAME (repeatable)")
    ap.add_argument("--no-figures", action="store_true", help="tables and report.md only")
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
                          names=disp, compare=args.compare)
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
    with pd.option_context("display.max_rows", 200, "display.width", 200,
                           "display.max_columns", 20, "display.float_format", "{:.4g}".format):
        print(compact(rep.runs).to_string(index=False))
    figs = ", ".join(rep.figures) or "none"
    print(f"\n{len(rep.runs)} runs, {len(rep.settings)} settings -> {rep.out / 'report.md'}, "
          f"{'report.html, ' * (rep.out / 'report.html').is_file()}summary.csv, "
          f"summary.parquet; figures: {figs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
