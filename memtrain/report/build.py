"""The whole report of a set of run folders: tables, report.md and figures, in one call.

Used by `memtrain-report` and by the Hydra callback at the end of a multirun.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from memtrain import columns
from memtrain.report import derive, markdown, tables
from memtrain.report import html as html_page
from memtrain.report.names import DEFAULT as DEFAULT_NAMES
from memtrain.report.names import InputError, Names

log = logging.getLogger(__name__)


@dataclass
class Report:
    runs: pd.DataFrame  # one row per run, relative columns and label added
    settings: pd.DataFrame  # one row per setting, mean and <col>_std over seeds
    out: Path
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    figures: dict[str, list[Path]] = field(default_factory=dict)
    not_drawn: dict[str, str] = field(default_factory=dict)



def to_parquet(df: pd.DataFrame, path: Path) -> None:
    """Parquet wants one type per column: mixed object columns (e.g. 2 and 'max') become text."""
    df = df.copy()
    for c in df.columns:
        if df[c].dtype == object:
            kinds = {type(v) for v in df[c] if v is not None and not (isinstance(v, float)
                                                                       and pd.isna(v))}
            if len(kinds) > 1:
                df[c] = df[c].map(lambda v: None if v is None or (isinstance(v, float) and
                                                                  pd.isna(v)) else str(v))
    tmp = path.with_name(f".{path.name}.tmp")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def analyse(runs: pd.DataFrame, baseline: str = tables.DEFAULT_BASELINE,
            match: Sequence[str] = tables.DEFAULT_MATCH, names: Names = DEFAULT_NAMES
            ) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """(runs with derived and baseline columns and labels, settings aggregated over seeds,
    warnings)."""
    runs, warnings = tables.add_baselines(derive.add_columns(runs), baseline, match)
    mixed = columns.mixed_schemas(runs.get(columns.SCHEMA, pd.Series(dtype=object)))
    warnings = [*([mixed] if mixed else []), *warnings]
    for w in warnings:
        log.warning(w)
    runs = tables.add_labels(runs, names=names)
    return runs, tables.aggregate_seeds(runs, names=names), warnings


def parse_sources(specs: Iterable[str | os.PathLike]) -> list[tuple[str, Path]]:
    """`--compare`'s sources: each `label=path`, or a path labelled by its folder's name (an
    existing path wins over a split at '='). Two sources with one label are bad input."""
    out: list[tuple[str, Path]] = []
    for spec in map(str, specs):
        label, sep, path = spec.partition("=")
        if not sep or Path(spec).exists() or not label:
            label, path = Path(spec).resolve().name or spec, spec
        out.append((label, Path(path)))
    seen: dict[str, Path] = {}
    for label, path in out:
        if label in seen:
            raise InputError(f"--compare: {seen[label]} and {path} are both labelled {label!r}; "
                             f"name them: memtrain-report A=PATH B=PATH --compare")
        seen[label] = path
    return out


def load_sources(sources: Sequence[tuple[str, Path]]
                 ) -> tuple[pd.DataFrame, list[tuple[Path, str]]]:
    """The runs of each source, each source read alone (its own latest row per run_id: the
    same config in two sweeps is two runs), with the `source` column naming it."""
    frames, skipped = [], []
    for label, path in sources:
        df, skip = tables.load_runs([path])
        skipped += skip
        if not df.empty:
            frames.append(df.assign(**{tables.SOURCE: label}))
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), skipped


def make_report(dirs: Iterable[str | os.PathLike], out: str | os.PathLike | None = None, *,
                baseline: str = tables.DEFAULT_BASELINE,
                match: Sequence[str] = tables.DEFAULT_MATCH,
                formats: Sequence[str] = ("png", "pdf"), memory: str = "auto",
                figures: bool = True, style: str = "paper",
                names: Names | Mapping | str | os.PathLike | None = None,
                labels: Mapping[str, str] | None = None, compare: bool = False,
                html: bool = True, only: Sequence[str] | None = None) -> Report:
    """Load every run below `dirs` and write summary.csv, summary.parquet, settings.csv,
    report.md, report.html (self-contained: the figures embedded) and figures/ into `out`
    (default: the first folder).

    `style`: paper (a column of a two-column paper) or slide; `names`: display names (a mapping
    or a YAML file, see report/names.py) and `labels` (label as drawn -> another) over them.
    `only`: the names of the figures to draw (plots.FIGURES, plots_timeline.FIGURES), no other
    drawn; None: every figure that applies. `compare`: `dirs` are sources to set side by side
    (`parse_sources`: `label=path` or a folder named by itself); every run carries its
    source's label (`source`), a setting of one source is another setting than the same of
    another, and each run's baseline is its own source's (default `out`: `compare/` beside the
    first source).

    Raises:
        FileNotFoundError: a folder does not exist.
        ValueError: no run below the folders, or a bad option.
    """
    from memtrain.record import atomic_write
    from memtrain.report import names as names_mod
    from memtrain.report import plots
    from memtrain.report import style as style_mod

    sources = parse_sources(dirs) if compare else None
    dirs = [p for _, p in sources] if sources else [Path(d) for d in dirs]
    tables.parse_baseline(baseline)
    if memory not in style_mod.MEMORY_CHOICES:
        raise InputError(f"--memory must be one of {', '.join(style_mod.MEMORY_CHOICES)}, "
                         f"got {memory!r}")
    if only is not None:
        from memtrain.report import plots, plots_timeline

        known = (*plots.FIGURES, *plots_timeline.FIGURES)
        if unknown := [n for n in only if n not in known]:
            raise InputError(f"--figures: no figure named {', '.join(unknown)}; the figures "
                             f"are {', '.join(known)}")
    if style not in style_mod.LOOKS:
        raise InputError(f"--style must be one of {', '.join(style_mod.LOOKS)}, got {style!r}")
    disp = names_mod.load(names, labels)
    raw, skipped = load_sources(sources) if sources else tables.load_runs(dirs)
    if raw.empty:
        raise InputError(f"no run folders (with summary.json) below {', '.join(map(str, dirs))}")
    if sources:
        match = [*match, tables.SOURCE]  # a run's baseline is its own sweep's
    out = Path(out or (dirs[0].resolve().parent / "compare" if sources else dirs[0]))
    out.mkdir(parents=True, exist_ok=True)
    runs, settings, warnings = analyse(raw, baseline, match, disp)
    rep = Report(runs, settings, out, skipped, warnings)
    atomic_write(out / "summary.csv", runs.to_csv(index=False))
    to_parquet(runs, out / "summary.parquet")
    atomic_write(out / "settings.csv", settings.to_csv(index=False))
    mem = style_mod.memory_metric(runs, memory)
    pngs: dict[str, bytes] = {}  # what report.html embeds
    captions: dict[str, str] = {}
    if figures:
        metrics = tables.load_metrics(runs["run_dir"])
        base_name = tables.parse_baseline(baseline).get("method", baseline)
        with style_mod.using(style):
            made, rep.not_drawn = plots.all_plots(settings, metrics, mem, base_name, disp,
                                                  only)
            from memtrain.report import plots_timeline

            # the runs' step anatomy (trainer.memory_timeline): drawn only where recorded
            for name, fig in plots_timeline.FIGURES.items():
                if only is not None and name not in only:
                    continue
                if (p := fig(runs, base_name, disp)) is not None:
                    made.append(p)
            for p in made:
                captions[p.name] = p.caption
                rep.figures[p.name] = plots.save(p, out / "figures", formats,
                                                 png=pngs if html else None)
    shown = [f"{label}={path}" for label, path in sources] if sources else dirs
    from memtrain.report.plots_timeline import module_tables

    text = markdown.render(settings, mem=mem, baseline=baseline, match=match, sources=shown,
                           n_runs=len(runs), skipped=skipped, warnings=warnings,
                           figures=rep.figures, not_drawn=rep.not_drawn, out=out, names=disp,
                           modules=module_tables(
                               runs, tables.parse_baseline(baseline).get("method", baseline)),
                           captions=captions)
    atomic_write(out / "report.md", text)
    if html:
        page = html_page.render(text, {name: pngs[name] for name in rep.figures if name in pngs},
                                out)
        if page is None:
            rep.warnings.append("report.html not written: it needs the markdown package "
                                "(pip install markdown)")
        else:
            atomic_write(out / "report.html", page)
    return rep
