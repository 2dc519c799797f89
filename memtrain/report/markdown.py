"""report.md: per model and dataset, one row per method setting, relative to the baseline."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from memtrain.report.style import Memory, order_settings
from memtrain.report.tables import constant_params


def pm(mean, std, fmt: str = "{:.3g}", scale: float = 1.0) -> str:
    """'1.23 ± 0.04' (std over seeds), '1.23' for one seed, '–' when missing."""
    if mean is None or pd.isna(mean):
        return "–"
    s = fmt.format(mean * scale)
    # float noise of identical seeds (1e-17) is no spread worth printing
    if std is not None and not pd.isna(std) and std > 1e-9 * abs(mean):
        s += " ± " + fmt.replace("+", "").format(std * scale)
    return s


def _cell(r: pd.Series, col: str, fmt: str = "{:.3g}", scale: float = 1.0) -> str:
    return pm(r.get(col), r.get(f"{col}_std"), fmt, scale)


def _ratio(r: pd.Series, col: str) -> str:
    return _cell(r, col, "{:.2f}") + ("×" if not pd.isna(r.get(col)) else "")


def _delta(r: pd.Series, col: str) -> str:
    v = r.get(col)
    return "–" if v is None or pd.isna(v) else _cell(r, col, "{:+.1f}", 100)


def table(g: pd.DataFrame, mem: Memory, baseline: str, peak_src: str) -> str:
    """One markdown table of the settings of a model and dataset. Saved bytes and the
    activation peak vs the baseline are always both shown: a saving in one column and a loss in
    the other must be visible."""
    act = mem.col != "mem_peak_alloc_bytes"  # a second memory column when figures plot another
    head = ["setting", "seeds", f"peak GiB ({peak_src})", f"peak vs {baseline}",
            *([f"{mem_short(mem)} MiB", f"{mem_short(mem)} vs {baseline}"] if act else []),
            f"saved act. vs {baseline}", f"act. peak vs {baseline}",
            f"throughput vs {baseline}", "test acc %", "Δ acc (pts)", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in order_settings(g).iterrows():
        cells = [r["label"], str(r["n_runs"]),
                 _cell(r, "mem_peak_alloc_bytes", "{:.3g}", 2**-30),
                 _ratio(r, "mem_peak_rel"),
                 *([_cell(r, mem.col, "{:.3g}", 2**-20), _ratio(r, mem.rel)] if act else []),
                 _ratio(r, "mem_saved_rel"), _ratio(r, "mem_act_rel"),
                 _ratio(r, "throughput_rel"),
                 _cell(r, "test_acc", "{:.1f}", 100), _delta(r, "test_acc_delta"),
                 r["status"]]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def mem_short(mem: Memory) -> str:
    return {"mem_peak_act_bytes": "activations", "mem_act_saved_bytes": "saved act."}.get(
        mem.col, "peak")


def render(agg: pd.DataFrame, *, mem: Memory, baseline: str, match: Sequence[str],
           sources: Sequence[str], n_runs: int, skipped: list[tuple[Path, str]],
           warnings: list[str], figures: dict[str, list[Path]], not_drawn: dict[str, str],
           out: Path) -> str:
    """The whole report.md text; `baseline` is the --baseline spec (method=none)."""
    short = baseline.split(",")[0].partition("=")[2] or baseline
    src = set(agg.get("mem_peak_source", pd.Series(dtype=str)).dropna().astype(str))
    peak_src = "CUDA" if src == {"cuda"} else "CPU tracker" if src == {"tracker"} else "mixed"
    parts = [
        "# memtrain report", "",
        f"{n_runs} run{'s' * (n_runs != 1)} in {len(agg)} setting{'s' * (len(agg) != 1)} "
        f"from {', '.join(map(str, sources))}.", "",
        f"- Baseline of a run: the `{baseline}` run (status ok) with the same "
        f"{', '.join(f'`{k}`' for k in match)}; a baseline run is its own. Ratios and Δ are "
        f"per run, then averaged over seeds (mean ± std).",
        f"- Memory in the figures: {mem.what}, {mem.source} (`{mem.col}`).",
        f"- Peak: `mem_peak_alloc_bytes` ({peak_src}).",
    ]
    if peak_src != "CUDA" and mem.col != "mem_peak_alloc_bytes":
        parts.append("- On the CPU there is no CUDA peak: the peak is the live-tensor tracker's, "
                     "so figures plot activation bytes instead.")
    const = constant_params(agg)
    if const:
        shared = "; ".join(f"{m}: " + " ".join(f"{k.removeprefix('method.')}={v}"
                                                for k, v in kv.items())
                           for m, kv in const.items())
        parts.append(f"- Shared by every setting of a method (left out of the labels): {shared}.")
    parts.append("")
    for (model, dataset), g in agg.groupby(["model", "dataset"], sort=True):
        parts += [f"## {model} / {dataset}", "", table(g, mem, short, peak_src), ""]
    if figures or not_drawn:
        parts += ["## Figures", ""]
        for name, paths in figures.items():
            png = next((p for p in paths if p.suffix == ".png"), paths[0])
            parts.append(f"![{name}]({png.relative_to(out).as_posix()})")
            parts.append("")
        parts += [f"- {name}: not drawn ({why})" for name, why in not_drawn.items()]
        parts.append("")
    if skipped:
        parts += ["## Skipped folders", ""] + [f"- `{d}`: {why}" for d, why in skipped] + [""]
    if warnings:
        parts += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    return "\n".join(parts)
