"""`make results-figures`: the README's pictures of the report's figures, drawn again from
committed rows, so a picture in docs/ is what memtrain-report draws from those runs, not a
hand-made one.

    python -m memtrain.study.screens          # docs/figures/<name>.png, each from its rows

Each entry of SCREENS names a folder under docs/results/rows/ holding memtrain-report's
summary.csv of a sweep (every run's row as memtrain wrote it) and the figure to draw from it:
the rows go through the report's own pipeline (report.build.analyse: derived columns, baselines,
labels, seeds aggregated), the report's figure function draws them in the paper look, and the
PNG is stamped with the rows' device, date and the file they came from (study.view.stamp).
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
    name: str  # the figure (report.plots.all_plots's name) and the PNG's
    rows: str  # folder under docs/results/rows/ with memtrain-report's summary.csv


# the report's figure functions (report.plots.all_plots draws the same)
FIGURES = {"cost": lambda settings, mem: plots.cost(settings, mem),
           "estimates": lambda settings, mem: plots.estimates(settings),
           "sequence": lambda settings, mem: plots.sequence(settings)}
SCREENS = (
    Screen("cost", "cost_mlp6_fmnist_cpu"),
    Screen("estimates", "estimates_resnet50_224_cpu"),
    Screen("sequence", "transformer_study_cpu"),  # issue 34: make transformer-study-cpu
)


def draw(screen: Screen, root: Path = ROOT, out: Path | None = None) -> Path:
    """The figure of `screen` from its committed rows -> `out/<name>.png` (stamped)."""
    rows = root / ROWS / screen.rows / "summary.csv"
    raw = report_tables.load_summary_csv(rows)
    runs, settings, _ = analyse(raw)
    mem = style.memory_metric(runs, "auto")
    with style.using("paper"):
        fig = FIGURES[screen.name](settings, mem)
    if fig is None:
        raise ValueError(f"{rows}: its rows give no {screen.name} figure")
    out = Path(out or root / OUT)
    with tempfile.TemporaryDirectory() as tmp:
        png = plots.save(fig, tmp, ("png",))[0]
        out.mkdir(parents=True, exist_ok=True)
        target = out / f"{screen.name}.png"
        target.write_bytes(png.read_bytes())
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
