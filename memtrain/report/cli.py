"""`memtrain-report DIR [DIR...]`: every run below the folders -> summary.csv + a table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from memtrain.report.tables import compact, load_runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memtrain-report", description=__doc__)
    ap.add_argument("dirs", nargs="+", help="run folders, multirun folders or any parent")
    ap.add_argument("--out", help="where summary.csv goes (default: the first DIR)")
    args = ap.parse_args(argv)
    try:
        df, skipped = load_runs(args.dirs)
    except FileNotFoundError as e:
        print(f"memtrain-report: error: {e}", file=sys.stderr)
        return 2
    for d, why in skipped:
        print(f"memtrain-report: skipped {d}: {why}", file=sys.stderr)
    if df.empty:
        print(f"memtrain-report: error: no run folders (with summary.json) below "
              f"{', '.join(args.dirs)}", file=sys.stderr)
        return 1
    out = Path(args.out or args.dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    from memtrain.record import atomic_write

    atomic_write(out / "summary.csv", df.to_csv(index=False))
    with pd.option_context("display.max_rows", 200, "display.width", 200,
                           "display.max_columns", 20, "display.float_format", "{:.4g}".format):
        print(compact(df).to_string(index=False))
    print(f"\n{len(df)} runs -> {out / 'summary.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
