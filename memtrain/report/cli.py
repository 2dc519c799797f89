"""`memtrain-report DIR [DIR...]`: every run below the folders -> summary.csv, summary.parquet,
settings.csv, report.md and figures/ (PNG and PDF), plus a table on the terminal."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from memtrain.report import tables


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="memtrain-report", description=__doc__)
    ap.add_argument("dirs", nargs="+", help="run folders, multirun folders or any parent")
    ap.add_argument("--out", help="where the report goes (default: the first DIR)")
    ap.add_argument("--baseline", default=tables.DEFAULT_BASELINE,
                    help="which runs are baselines, as column=value[,column=value] "
                         "(default: %(default)s)")
    ap.add_argument("--match", default=",".join(tables.DEFAULT_MATCH),
                    help="columns a run and its baseline share (default: %(default)s)")
    ap.add_argument("--format", default="png,pdf",
                    help="figure formats, comma-separated (default: %(default)s)")
    ap.add_argument("--memory", default="auto", choices=("auto", "peak", "act", "saved"),
                    help="memory the figures plot: auto = the CUDA peak where every run has "
                         "one, else activation memory (CPU); peak, act (saved + recomputed "
                         "activations), saved (saved for backward)")
    ap.add_argument("--no-figures", action="store_true", help="tables and report.md only")
    return ap


def main(argv: list[str] | None = None) -> int:
    from memtrain.report.build import make_report

    args = parser().parse_args(argv)
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"memtrain-report: error: --out {args.out} is a file, not a folder", file=sys.stderr)
        return 2
    try:
        rep = make_report(args.dirs, args.out, baseline=args.baseline,
                          match=[k.strip() for k in args.match.split(",") if k.strip()],
                          formats=[f.strip() for f in args.format.split(",") if f.strip()],
                          memory=args.memory, figures=not args.no_figures)
    except FileNotFoundError as e:
        print(f"memtrain-report: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # --out under a file, or on a read-only disk
        print(f"memtrain-report: error: cannot write the report: {e}", file=sys.stderr)
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
        print(tables.compact(rep.runs).to_string(index=False))
    figs = ", ".join(rep.figures) or "none"
    print(f"\n{len(rep.runs)} runs, {len(rep.settings)} settings -> {rep.out / 'report.md'}, "
          f"summary.csv, summary.parquet; figures: {figs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
