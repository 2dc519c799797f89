"""`make results-figures`: the docs' pictures of the report's figures, drawn again from
committed rows, so a picture in docs/ is what memtrain-report draws from those runs, not a
hand-made one.

    python -m tools.doc_figures          # docs/figures/<name>.png and .csv, from its rows
    python -m tools.doc_figures --capture-timeline RUNS NAME   # first commit a sweep's
                                              # rows and step files as docs/results/rows/NAME/

Each entry of SCREENS names a folder under docs/results/rows/ holding memtrain-report's summary.csv
of a sweep (every run's row as memtrain wrote it) and the report's figure to draw from it: the
rows go through the report's own pipeline (report.build.analyse: derived columns, baselines,
labels, seeds aggregated), the report's figure function draws them in the paper look, and the
PNG is stamped with the rows' device, date and the file they came from (study.view.stamp).
The step-anatomy figures (`trainer.memory_timeline`: timeline, layers, anatomy) also read the
files each run wrote beside itself; `capture_timeline` commits them in a folder per run
(`make timeline-figures`: a real resnet18 sweep on the CPU, then these pictures).
Beside each PNG, `<name>.csv` holds exactly the values it drew (the report's figure data):
tests/test_doc_figures.py draws again and compares those, not the pixels (images differ across
matplotlib versions).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from memtrain.report import plots, plots_memory, plots_timeline, style
from memtrain.report import tables as report_tables
from memtrain.report.build import analyse
from tools.study import view

ROOT = Path(__file__).resolve().parents[1]
ROWS = Path("docs/results/rows")
OUT = Path("docs/figures")


@dataclass(frozen=True)
class Screen:
    name: str  # the PNG's and CSV's name under docs/figures/
    rows: str  # folder under docs/results/rows/ with memtrain-report's summary.csv
    figure: str  # the report's figure drawn (a key of FIGURES: report.plots' function)


# the report's figure functions (report.plots.all_plots and report.build draw the same), on
# (runs, settings, memory metric)
FIGURES = {"cost": lambda runs, settings, mem: plots.cost(settings, mem),
           "estimates": lambda runs, settings, mem: plots.estimates(settings),
           "sequence": lambda runs, settings, mem: plots.sequence(settings),
           "sharding": lambda runs, settings, mem: plots_memory.sharding(settings),
           "timeline": lambda runs, settings, mem: plots_timeline.timelines(runs),
           "layers": lambda runs, settings, mem: plots_timeline.layers_figure(runs),
           "anatomy": lambda runs, settings, mem: plots_timeline.anatomy(runs)}
TIMELINE_ROWS = "timeline_resnet18_cpu"
SCREENS = (
    Screen("headline", "headline_fmnist_cpu", "cost"),  # README's first figure
    Screen("estimates", "estimates_resnet50_224_cpu", "estimates"),
    Screen("sequence", "transformer_study_cpu", "sequence"),  # make transformer-study-cpu
    Screen("sharding", "sharding_study_cpu", "sharding"),  # experiment=sharding_study
    Screen("timeline", TIMELINE_ROWS, "timeline"),
    Screen("layers", TIMELINE_ROWS, "layers"),
    Screen("anatomy", TIMELINE_ROWS, "anatomy"),
)
# what a run wrote beside itself that the step-anatomy figures read (summary.csv's columns)
STEP_FILES = ("memory_timeline", "saved_by_module", "plan_table")


def capture_timeline(runs: Path, name: str, root: Path = ROOT) -> Path:
    """The rows of the sweep below `runs` (study.docs.capture: summary.csv, settings.csv,
    report.md) and, in a folder per run under docs/results/rows/NAME/, the files each run wrote
    for `trainer.memory_timeline` (the timeline as `timeline.wide` without its clock, in
    zstd: what the figures draw, a fifth of the bytes); summary.csv's `run_dir` points there."""
    import shutil

    import pandas as pd

    from memtrain.memory import timeline
    from tools.docs import capture

    out = capture(runs, name, root)
    csv = out / "summary.csv"
    df = pd.read_csv(csv, low_memory=False)
    dirs = []
    for _, r in df.iterrows():
        src = Path(r["run_dir"]) if Path(r["run_dir"]).is_absolute() else root / r["run_dir"]
        dst = out / Path(str(r["run_dir"])).name
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        for col in STEP_FILES:
            f = r.get(col)
            if not isinstance(f, str) or not (src / f).is_file():
                continue
            if f.endswith(".parquet"):
                wide = timeline.wide(pd.read_parquet(src / f)).drop(columns="time_s")
                wide.to_parquet(dst / f, index=False, compression="zstd")
            else:
                shutil.copyfile(src / f, dst / f)
        dirs.append(dst.relative_to(root).as_posix())
    df["run_dir"] = dirs
    df.to_csv(csv, index=False)
    return out


def plot(screen: Screen, root: Path = ROOT):
    """The report's Plot of `screen`'s committed rows (its figure and the values it drew),
    and the rows."""
    rows = root / ROWS / screen.rows / "summary.csv"
    raw = report_tables.load_summary_csv(rows)
    raw["run_dir"] = raw["run_dir"].map(lambda d: str(root / d))  # a run's files, committed
    runs, settings, _ = analyse(raw)
    mem = style.memory_metric(runs, "auto")
    with style.using("paper"):
        fig = FIGURES[screen.figure](runs, settings, mem)
    if fig is None:
        raise ValueError(f"{rows}: its rows give no {screen.figure} figure")
    return fig, raw


def draw(screen: Screen, root: Path = ROOT, out: Path | None = None, made=None) -> Path:
    """The figure of `screen` from its committed rows -> `out/<name>.png` (stamped) and
    `out/<name>.csv` (the values it drew); `made`: `plot`'s (figure, rows), when drawn
    already."""
    fig, raw = made or plot(screen, root)
    here = f"{Path(root).resolve().as_posix()}/"  # run folders read, written as committed
    fig.data = fig.data.map(lambda v: v.replace(here, "") if isinstance(v, str) else v)
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
    ap = argparse.ArgumentParser(prog="python -m tools.doc_figures", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help=f"where the PNGs go (default: {OUT})")
    ap.add_argument("--capture-timeline", nargs=2, metavar=("RUNS", "NAME"),
                    help="first commit the rows and step files of the sweep below RUNS as "
                         "docs/results/rows/NAME/")
    args = ap.parse_args(argv)
    if args.capture_timeline:
        print(capture_timeline(Path(args.capture_timeline[0]), args.capture_timeline[1]))
    for s in SCREENS:
        print(draw(s, out=Path(args.out) if args.out else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
