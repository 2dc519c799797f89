"""report.md: per model and dataset, one row per method setting, relative to the baseline.

Numbers have a fixed precision per column: memory in the unit that suits the table (KiB, MiB or
GiB) with the decimals its largest value needs, ratios (`x / none`) with two decimals, accuracy
in % with one decimal, Δ in points with a sign; a spread over seeds takes its mean's decimals.

Every text that comes from a run's row (a label, a model's name, an error, a module's name, a
folder) is written by `text` or `code`: shown as written, never read as HTML or as a link
(`<script>` in a method name is text here as in report.html, which renders this text).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from memtrain import columns
from memtrain.columns import ACT_PEAK, PEAK, RESERVED, SAVED, TEST_ACC, THROUGHPUT, label
from memtrain.report import derive
from memtrain.report.draw import is_true
from memtrain.report.names import DEFAULT as DEFAULT_NAMES
from memtrain.report.names import Names
from memtrain.report.style import Memory, byte_unit, order_settings
from memtrain.report.tables import SOURCE, constant_params

NOISY = "†"  # marks a throughput measured with noisy step times


def text(v) -> str:
    """A run's text as Markdown that shows it as written: `&`, `<` and `>` as entities (no HTML
    tag, no autolink), `](` escaped (no link or image), one line (no new block)."""
    s = str(v).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return " ".join(s.replace("](", "]\\(").splitlines())


def code(v) -> str:
    """A run's text as a code span (shown literally by every renderer): one line, its backticks
    turned to quotes so that none ends the span."""
    return "`" + " ".join(str(v).replace("`", "'").splitlines()) + "`"


def number(v, decimals: int = 2, scale: float = 1.0, sign: bool = False, missing: str = "–",
           whole_from: float | None = None) -> str:
    """One number of a table: `decimals` after the point ('+' with `sign`), `missing` for
    None/NaN (or a value that is no number); with `whole_from`, a value at least that large
    whole with thousands separators ('1,830'); text stays as it is."""
    if isinstance(v, str):
        return v
    v = pd.to_numeric(v, errors="coerce")
    if v is None or pd.isna(v):
        return missing
    v = float(v) * scale
    if whole_from is not None and abs(v) >= whole_from:
        return f"{v:,.0f}"
    return f"{v:{'+' if sign else ''}.{decimals}f}"


def pm(mean, std, decimals: int = 2, scale: float = 1.0, sign: bool = False) -> str:
    """'1.23 ± 0.04' (std over seeds, same decimals), '1.23' for one seed, '–' when missing."""
    if mean is None or pd.isna(mean):
        return "–"
    s = number(mean, decimals, scale, sign)
    # float noise of identical seeds (1e-17) is no spread worth printing
    if std is not None and not pd.isna(std) and std > 1e-9 * abs(mean):
        s += f" ± {number(std, decimals, scale)}"
    return s


def decimals_for(values: pd.Series) -> int:
    """Decimals that give about three significant digits to the column's largest value."""
    top = pd.to_numeric(values, errors="coerce").abs().max()
    if pd.isna(top) or top >= 100:
        return 0
    return 1 if top >= 10 else 2


def _cell(r: pd.Series, col: str, decimals: int = 2, scale: float = 1.0, sign: bool = False):
    return pm(r.get(col), r.get(f"{col}_std"), decimals, scale, sign)


def _ratio(r: pd.Series, col: str) -> str:
    """A ratio: two decimals, its spread over seeds too."""
    return _cell(r, col)


def _setting(r: pd.Series, g: pd.DataFrame) -> list[str]:
    """The first cells of a row: the setting's label, and with `--compare` its source in a
    column of its own (the label's " [source]" then left off)."""
    if SOURCE not in g:
        return [text(r["label"])]
    src = str(r.get(SOURCE))
    return [text(str(r["label"]).removesuffix(f" [{src}]")), text(src)]


def _bytes_col(g: pd.DataFrame, col: str) -> tuple[float, str, int]:
    """(divisor, unit, decimals) of a memory column in this table."""
    div, unit = byte_unit(g[col]) if col in g else (2**20, "MiB")
    return div, unit, decimals_for(g[col] / div) if col in g else 1


# report.md's first table: the headline memory ratio (memtrain/columns.py), then the detail
# ratios every table shows: saved bytes and the activation peak, so that a saving in one and a
# loss in the other is visible
DETAIL = tuple(columns.ratio(n) for n in ("mem_act_temp_rel", "mem_saved_rel"))
RESERVED_REL = columns.ratio("mem_reserved_rel")


def _has(g: pd.DataFrame, col: str) -> bool:
    return col in g and pd.to_numeric(g[col], errors="coerce").notna().any()


def shown_ratios(g: pd.DataFrame, mem: Memory) -> list[columns.Ratio]:
    """The ratios a table of `g` shows: the headline one, reserved beside it where measured
    (CUDA), the figures' memory ratio when it is another, the detail."""
    out = [columns.HEADLINE, *([RESERVED_REL] if _has(g, RESERVED) else [])]
    out += [r for r in (mem.ratio, *DETAIL) if r not in out]
    return out


def table(g: pd.DataFrame, mem: Memory, baseline: str, peak_src: str) -> str:
    """One markdown table of the settings of a model and dataset, baseline first: the step's
    total peak and its ratio to the baseline (the headline), CUDA's reserved peak beside it
    where measured, then the detail ratios (`shown_ratios`), throughput, accuracy, status."""
    pdiv, punit, pdec = _bytes_col(g, PEAK)
    reserved = _has(g, RESERVED)
    rdiv, runit, rdec = _bytes_col(g, RESERVED)
    act = mem.col != PEAK  # the figures' memory in bytes too, when they plot another
    adiv, aunit, adec = _bytes_col(g, mem.col)
    ratios = shown_ratios(g, mem)
    tput = "throughput_e2e_samples_s" if "throughput_e2e_samples_s" in g else THROUGHPUT
    tdec = decimals_for(g[tput]) if tput in g else 0
    head = ["setting", *([SOURCE] if SOURCE in g else []), "seeds",
            f"{label(PEAK)} {punit} ({peak_src})", ratios[0].heading(baseline),
            *([f"{label(RESERVED)} {runit}", ratios[1].heading(baseline)] if reserved else []),
            *([f"{mem_short(mem)} {aunit}"] if act else []),
            *(r.heading(baseline) for r in ratios[1 + reserved:]),
            label(THROUGHPUT), f"throughput / {baseline}", f"{label(TEST_ACC)} %",
            "Δ acc (pts)", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in order_settings(g).iterrows():
        noisy = NOISY if is_true(r.get("timing_noisy")) else ""
        cells = [*_setting(r, g), str(r["n_runs"]),
                 _cell(r, PEAK, pdec, 1 / pdiv), _ratio(r, ratios[0].name),
                 *([_cell(r, RESERVED, rdec, 1 / rdiv), _ratio(r, ratios[1].name)]
                   if reserved else []),
                 *([_cell(r, mem.col, adec, 1 / adiv)] if act else []),
                 *(_ratio(r, x.name) for x in ratios[1 + reserved:]),
                 _cell(r, tput, tdec) + noisy, _ratio(r, "throughput_rel"),
                 _cell(r, TEST_ACC, 1, 100), _cell(r, "test_acc_delta", 1, 100, sign=True),
                 text(r["status"]) + (f", did not learn {int(r['n_not_learned'])}/"
                                      f"{int(r['n_ok'])}" if r.get("n_not_learned", 0) else "")]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def ratio_lines(agg: pd.DataFrame, mem: Memory, baseline: str) -> list[str]:
    """report.md's definitions of the ratios its tables show: the headline first."""
    shown = shown_ratios(agg, mem)
    return [f"- The memory ratio, {shown[0].definition(baseline)}.",
            "- Detail: " + "; ".join(r.definition(baseline) for r in shown[1:]) + "."]


ESTIMATES = ("mem_estimate_bytes", "mem_estimate_act_bytes", "mem_estimate_saved_bytes")


def gpu_memory_named(g: pd.DataFrame) -> tuple[float, str]:
    """(bytes, what it is) of the GPU memory a prediction is set against: the cap asked for
    (`trainer.gpu_memory_gb`), else the measuring device's (0 on the CPU: none); NaN when
    neither is known."""
    for col, scale, what in (("gpu_memory_cap_bytes", 1, "trainer.gpu_memory_gb"),
                             ("trainer.gpu_memory_gb", 2**30, "trainer.gpu_memory_gb"),
                             ("device_total_memory_bytes", 1, "the GPU's memory")):
        v = pd.to_numeric(g.get(col, pd.Series(dtype=float)), errors="coerce") * scale
        v = v[v > 0]
        if len(v):
            return float(v.max()), what
    return float("nan"), ""


def gpu_memory(g: pd.DataFrame) -> float:
    """The GPU memory a prediction is set against, in bytes (gpu_memory_named)."""
    return gpu_memory_named(g)[0]


def estimates_table(g: pd.DataFrame, baseline: str) -> str | None:
    """The GPU-free estimate's predictions (trainer.estimate=true), when any setting has one:
    predicted peak, activation peak and saved bytes, each against the baseline's prediction,
    and whether the peak fits the GPU memory it is set against."""
    if not any(c in g and g[c].notna().any() for c in ESTIMATES):
        return None
    div, unit, dec = _bytes_col(g, ESTIMATES[0])
    cap = gpu_memory(g)
    head = ["setting", *([SOURCE] if SOURCE in g else []), f"predicted {label(PEAK)} {unit}",
            f"/ {baseline}",
            f"predicted {label(ACT_PEAK)} / {baseline}", f"predicted {label(SAVED)} / {baseline}"]
    if cap == cap:
        head.append(f"fits {cap / 2**30:.4g} GiB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in order_settings(g).iterrows():
        if pd.isna(r.get(ESTIMATES[0])):
            continue
        cells = [*_setting(r, g), _cell(r, ESTIMATES[0], dec, 1 / div),
                 _ratio(r, "mem_estimate_rel"),
                 _ratio(r, "mem_estimate_act_rel"), _ratio(r, "mem_estimate_saved_rel")]
        if cap == cap:
            cells.append("yes" if r[ESTIMATES[0]] <= cap else "no")
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def failed(g: pd.DataFrame) -> list[str]:
    """'- pool k=2 (error 1/2): ValueError: ...' for each setting with a failed run."""
    return [f"- {text(r['label'])} ({text(r['status'])}): "
            f"{text(r.get('error_short') or 'no error message')}"
            for _, r in order_settings(g).iterrows() if r["worst_status"] != "ok"]


def mem_short(mem: Memory) -> str:
    """The memory column's short name (memtrain/columns.py): 'peak', 'act. peak', 'saved act.'."""
    return label(mem.col)


def peak_source(agg: pd.DataFrame) -> str:
    """Where the peaks of the ok runs came from: CUDA, CPU tracker, or mixed (both)."""
    src = set()
    for v in agg.get("mem_peak_source", pd.Series(dtype=str)).dropna().astype(str):
        src |= set(v.split(",")) - {""}
    if not src:
        return "not measured"
    return "CUDA" if src == {"cuda"} else "CPU tracker" if src == {"tracker"} else "mixed"


def modules_table(t: pd.DataFrame, plans: dict[str, list[str]]) -> str:
    """Where the activations live (`trainer.memory_timeline`): one row per module (the
    baseline's largest savers, then the rest and the total, which is each run's
    `mem_act_saved_bytes`), a column of saved bytes per setting, and beside each setting with a
    plan (checkpoint) what the plan does with the module's segment."""
    div, unit = byte_unit(pd.Series(t.to_numpy().ravel()))
    dec = decimals_for(pd.Series(t.to_numpy().ravel()) / div)
    head = ["module"]
    for lb in t.columns:
        head.append(f"{text(lb)} {unit}")
        if lb in plans:
            head.append(f"{text(lb)}: plan")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, (m, r) in enumerate(t.iterrows()):
        cells = [f"**{m}**" if m == "total" else text(m)]
        for lb in t.columns:
            cells.append(number(r[lb], dec, 1 / div))
            if lb in plans:
                cells.append(text(plans[lb][i]))
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def render(agg: pd.DataFrame, *, mem: Memory, baseline: str, match: Sequence[str],
           sources: Sequence[str], n_runs: int, skipped: list[tuple[Path, str]],
           warnings: list[str], figures: dict[str, list[Path]], not_drawn: dict[str, str],
           out: Path, names: Names = DEFAULT_NAMES,
           modules: dict | None = None, captions: dict[str, str] | None = None) -> str:
    """The whole report.md text; `baseline` is the --baseline spec (method=none); `modules`:
    the per-module tables of `trainer.memory_timeline` runs by (model, dataset)
    (report.plots_timeline.module_tables); `captions`: each figure's, under it."""
    short = text(baseline.split(",")[0].partition("=")[2] or baseline)
    peak_src = peak_source(agg)
    parts = [
        "# memtrain report", "",
        f"{n_runs} run{'s' * (n_runs != 1)} in {len(agg)} setting{'s' * (len(agg) != 1)} "
        f"from {', '.join(map(str, sources))}.", "",
        *([f"- Compared: {', '.join(code(x) for x in sorted(agg[SOURCE].astype(str).unique()))}"
           " (the `source` column: each folder's label); a run's baseline is from its own "
           "source."] if SOURCE in agg else []),
        f"- Baseline of a run: the {code(baseline)} run (status ok) with the same "
        f"{', '.join(code(k) for k in match)}; a baseline run is its own. Ratios and Δ are "
        f"per run, then averaged over seeds (mean ± std).",
        *ratio_lines(agg, mem, short),
        f"- Memory in the figures: `{mem.ratio.heading(short)}` ({mem.source}).",
        "- Throughput: samples/s of the timed steps, end to end for methods that train in "
        "phases (every phase's steps; `throughput_e2e_samples_s`). "
        f"{NOISY}: step times were noisy (p90 above {derive.NOISY_P90_OVER_MEDIAN:g}× the "
        "median in a run, or the seeds' step times that far apart: the load changed between "
        "runs), so ratios of times are not to be trusted.",
    ]
    const = constant_params(agg)
    if const:
        shared = "; ".join(f"{text(m)}: " + " ".join(
            f"{text(k.removeprefix('method.'))}={text(v)}" for k, v in kv.items())
            for m, kv in const.items())
        parts.append(f"- Shared by every setting of a method (left out of the labels): {shared}.")
    parts.append("")
    for (model, dataset), g in agg.groupby(["model", "dataset"], sort=True):
        parts += [f"## {text(names.panel(model, dataset))}", ""]
        est = estimates_table(g, short)
        if est is None or g.get(PEAK, pd.Series(dtype=float)).notna().any():
            parts += [table(g, mem, short, peak_src), ""]  # what was measured
        if est:
            parts += ["Predicted by the GPU-free estimate (`trainer.estimate=true`: one step on "
                      "fake tensors, no data, nothing trained):", "", est, ""]
        if fail := failed(g):
            parts += ["Failed runs (the reason is the first line of the run's `error`):", "",
                      *fail, ""]
        if (model, dataset) in (modules or {}):
            t, plans = modules[(model, dataset)]
            parts += [f"Where the activations live: saved for backward per module on the "
                      f"accounting step, the {len(t) - 2} modules that save most in "
                      f"{text(t.columns[0])} (a storage counts once, for the module that saved it "
                      f"first; `saved_by_module.csv` beside each run, the first seed of each "
                      f"setting):", "", modules_table(t, plans), ""]
    if figures or not_drawn:
        parts += ["## Figures", ""]
        for name, paths in figures.items():
            png = next((p for p in paths if p.suffix == ".png"), paths[0])
            parts.append(f"![{name}]({png.relative_to(out).as_posix()})")
            parts.append("")
            if (captions or {}).get(name):
                parts += [f"*{name}*: {text(captions[name])}", ""]
        parts += [f"- {name}: not drawn ({text(why)})" for name, why in not_drawn.items()]
        parts.append("")
    if skipped:
        parts += ["## Skipped folders", ""] + [f"- {code(d)}: {text(why)}"
                                               for d, why in skipped] + [""]
    if warnings:
        parts += ["## Warnings", ""] + [f"- {text(w)}" for w in warnings] + [""]
    return "\n".join(parts)
