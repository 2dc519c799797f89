"""`make results-figures`: the README's pictures of the report's figures, drawn again from
committed rows, so a picture in docs/ is what memtrain-report draws from those runs, not a
hand-made one.

    python -m memtrain.study.screens          # docs/figures/<name>.png and .csv, from its rows

Each entry of SCREENS names a folder under docs/results/rows/ holding memtrain-report's summary.csv
of a sweep (every run's row as memtrain wrote it) and the report's figure to draw from it: the
rows go through the report's own pipeline (report.build.analyse: derived columns, baselines,
labels, seeds aggregated), the report's figure function draws them in the paper look, and the
PNG is stamped with the rows' device, date and the file they came from (study.view.stamp).
Beside each PNG, `<name>.csv` holds exactly the values it drew (the report's figure data):
tests/test_screens.py draws again and compares those, not the pixels (images differ across
matplotlib versions).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from memtrain.report import plots, style
from memtrain.report import tables as report_tables
from memtrain.report.build import analyse
from memtrain.study import view

ROOT = Path(__file__).resolve().parents[2]
ROWS = Path("docs/results/rows")
OUT = Path("docs/figures")


@dataclass(frozen=True)
class Screen:
    name: str  # the PNG's and CSV's name under docs/figures/
    rows: str  # folder under docs/results/rows/ with memtrain-report's summary.csv
    figure: str  # the report's figure drawn (a key of FIGURES: report.plots' function)


# the report's figure functions (report.plots.all_plots draws the same)
FIGURES = {"cost": lambda settings, mem: plots.cost(settings, mem),
           "estimates": lambda settings, mem: plots.estimates(settings)}
SCREENS = (
    Screen("headline", "headline_fmnist_cpu", "cost"),  # README's first figure
    Screen("estimates", "estimates_resnet50_224_cpu", "estimates"),
)


def plot(screen: Screen, root: Path = ROOT):
    """The report's Plot of `screen`'s committed rows (its figure and the values it drew),
    and the rows."""
    rows = root / ROWS / screen.rows / "summary.csv"
    raw = report_tables.load_summary_csv(rows)
    runs, settings, _ = analyse(raw)
    mem = style.memory_metric(runs, "auto")
    with style.using("paper"):
        fig = FIGURES[screen.figure](settings, mem)
    if fig is None:
        raise ValueError(f"{rows}: its rows give no {screen.figure} figure")
    return fig, raw


def draw(screen: Screen, root: Path = ROOT, out: Path | None = None) -> Path:
    """The figure of `screen` from its committed rows -> `out/<name>.png` (stamped) and
    `out/<name>.csv` (the values it drew)."""
    fig, raw = plot(screen, root)
    out = Path(out or root / OUT)
    with tempfile.TemporaryDirectory() as tmp:
        png = plots.save(fig, tmp, ("png",))[0]
        out.mkdir(parents=True, exist_ok=True)
        target = out / f"{screen.name}.png"
        target.write_bytes(png.read_bytes())
        (out / f"{screen.name}.csv").write_bytes((Path(tmp) / f"{fig.name}.csv").read_bytes())
    p = view.provenance(raw)
    view.stamp(target, f"{ROWS / screen.rows}/summary.csv: {p['device']}, {p['date']}",
               colors=None)  # every method's colour as drawn
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memtrain.study.screens", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help=f"where the PNGs go (default: {OUT})")
    args = ap.parse_args(argv)
    for s in SCREENS:
        print(draw(s, out=Path(args.out) if args.out else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
