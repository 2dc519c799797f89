"""The view of a study: docs/results/<name>/ made again from runs/results/<name>/.

- `results.md`: device and date, the parts' statuses, headline figures, one section per part;
- memtrain-report over every run (summary.csv, settings.csv, report.md, figures/; no parquet:
  the view is committed), and highlights/: the trade-off figure of the trade-off part and the
  budget figure of the checkpoint part, each drawn from that part's runs alone
  (docs/results/README.md shows them);
- every figure stamped with the device and the date it was measured on.
Each piece is made on its own: one that fails is named in results.md, the others are written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pandas as pd

from memtrain.record import atomic_write
from memtrain.report.tables import ratio as report_ratio
from tools.study import study_tables

# the columns a run shares with its `none` (the report's --match): the parts measure none
# at several sizes, step counts and probe settings, and each ratio must use its own
MATCH = ",".join(k for k in study_tables.MATCH if k not in ("device", "mem_peak_source"))
# the figures docs/results/README.md shows, drawn from one part's runs (and the none runs its
# ratios use)
HIGHLIGHTS = {"tradeoff": "tradeoff", "checkpoint": "budget"}
MAX_WIDTH = 1200  # pixels: the report's multi-panel figures are ~3300 wide, too heavy to commit


def report(dirs: list[Path], out: Path, env: dict, only: str | None = None,
           python: str = sys.executable) -> tuple[str, list[Path]]:
    """memtrain-report (PNG figures, run by the interpreter `python`) into a scratch folder,
    then into `out` all but the parquet copy of summary.csv (binary; the view is committed),
    or only figure `only` (the one it draws) as `out/<only>.png`; returns a status line and
    the PNGs."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [python, "-m", "memtrain.report.command", *map(str, dirs), "--out", tmp,
                "--format", "png", "--match", MATCH, *(["--figures", only] if only else [])]
        try:
            p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            return "timeout", []
        if p.returncode:
            return f"failed (exit {p.returncode}): " + \
                (p.stderr.strip().splitlines() or ["?"])[-1][:200], []
        if only:
            fig = Path(tmp) / "figures" / f"{only}.png"
            if not fig.exists():
                return f"no {only} figure (see report.md's list of figures not drawn)", []
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fig, out / fig.name)
            return "ok", [out / fig.name]
        shutil.rmtree(out / "figures", ignore_errors=True)  # figures of an earlier view
        copied = []
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file() and f.suffix != ".parquet":
                copied.append(out / f.relative_to(tmp))
                copied[-1].parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, copied[-1])
    return "ok", [f for f in copied if f.suffix == ".png"]


def stamp(png: Path, text: str, colors: int | None = 64) -> None:
    """Write `text` in a band under the figure (the report draws no device or date), then keep
    `colors` colours (64: a third of the bytes; the figures are flat colours and text; None:
    all, where a palette of 64 lost small markers' colours, a green one drawn grey)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    with Image.open(png) as im:
        if im.width > MAX_WIDTH:
            im.resize((MAX_WIDTH, round(im.height * MAX_WIDTH / im.width)),
                      Image.LANCZOS).save(png)
    img = plt.imread(png)
    h, w = img.shape[:2]
    band = max(16, round(w / 32))
    fig = plt.figure(figsize=(w / 100, (h + band) / 100), dpi=100)
    fig.figimage(img, 0, band)
    fig.text(0.004, band / 2 / (h + band), text, fontsize=band * 0.55 * 72 / 100, va="center",
             color="0.25")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    if colors is None:
        return
    with Image.open(png) as im:
        small = im.convert("RGB").quantize(colors=colors)
    small.save(png, optimize=True)


def provenance(df: pd.DataFrame) -> dict[str, str]:
    def uniq(col: str) -> str:
        vals = sorted({str(v) for v in df.get(col, pd.Series(dtype=object)).dropna()})
        return ", ".join(vals) if vals else "-"

    dates = sorted(str(v)[:10] for v in df.get("finished_at", pd.Series(dtype=object)).dropna())
    date = "-" if not dates else dates[0] if dates[0] == dates[-1] else f"{dates[0]}..{dates[-1]}"
    device = uniq("device_name")
    if device != "-" and not uniq("device").startswith("cuda"):
        device = f"CPU {device}, {uniq('cpu_threads')} torch threads"
    from memtrain import columns

    return {"device": device, "date": date, "torch": uniq("torch_version"),
            "cuda": uniq("cuda_version"), "triton": uniq("triton_version"),
            "git": uniq("git_commit"),
            "schema": columns.schema_caption(df.get(columns.SCHEMA, [None] * len(df)))}


def statuses(runs: Path) -> dict[str, dict]:
    out = {}
    for path in runs.glob("*/status.json"):
        try:
            out[path.parent.name] = json.loads(path.read_text())
        except (OSError, ValueError):
            out[path.parent.name] = {"status": "unreadable status.json"}
    return out


def part_line(part: str, st: dict | None, df: pd.DataFrame) -> str:
    if st is None:
        return "not run"
    s = st.get("status", "?")
    if s == "running":
        s = "did not finish (stopped while running)"
    jobs = df.loc[df["part"] == part, "status"].value_counts()
    job = ", ".join(f"{k} {v}" for k, v in jobs.items())
    return (f"{s}; {st.get('seconds', '?')} s (budget ~{st.get('budget_s', 0):.0f} s)"
            + (f"; jobs: {job}" if job else ""))


def headlines(df: pd.DataFrame, runs: Path) -> list[str]:
    """The figures the issue's closing note asks for, where measured: `peak` is CUDA's
    max_memory_allocated on a GPU and the tracker's on the CPU, where parameters and optimizer
    state dominate it at tiny sizes, so the activation peak (`act.`) is given beside it."""
    out, f = [], study_tables.fmt
    ok = df[df["status"] == "ok"]
    for _, r in ok[(ok["part"] == "pool") & (ok["method"] == "pool")].iterrows():
        if study_tables.setting(r) in ("k=2 conv", "compaction only (k=1)"):
            out.append(f"pool {study_tables.setting(r)}, resnet50 b{r['trainer.batch_size']} "
                       f"{r['trainer.precision']}: peak x{f(r['x_peak'])}, act. "
                       f"x{f(r['x_act'])}, throughput x{f(r['x_thr'])} (paper: peak x0.71)")
    for _, r in ok[(ok["part"] == "prune") & (ok["method"] == "prune")].iterrows():
        out.append(f"prune {study_tables.setting(r)}, {r['model']} {r['trainer.precision']}: peak "
                   f"x{f(r['x_peak'])}, act. x{f(r['x_act'])} (paper: x0.68)")
    ck = ok[(ok["part"] == "checkpoint") & (ok["method"] == "checkpoint")]
    ck = ck[ck["method.strategy"].isin(["budget", "compile"])] if len(ck) else ck
    for strategy, g in ck.groupby("method.strategy") if len(ck) else []:
        col = "x_peak" if (g["mem_peak_source"] == "cuda").all() else "x_act"
        r = g.loc[(g[col] - 0.40).abs().idxmin()]
        out.append(f"checkpoint {strategy} nearest 0.40x ({col.replace('x_', '')}): "
                   f"{study_tables.setting(r)} gives x{f(r[col])} at step time x{f(r['x_step'])} "
                   f"(MONeT: x0.40 at +9.3% compute)")
    est = ok[(ok["part"] == "probes") & ok["step"].str.startswith("estimate")]
    for _, r in est[est["method"] == "none"].iterrows():
        ratio = report_ratio(r.get(study_tables.ESTIMATE), r.get(study_tables.PEAK))
        out.append(f"estimate / measured peak, none, {r['model']}: {f(ratio)}")
    kernels = study_tables.read_md_table(runs / "prune" / "kernels.md")
    for col in ("kernel_x_dense", "torch_bsr_x_dense"):
        if col in kernels:
            v = pd.to_numeric(kernels[col], errors="coerce").dropna()
            if len(v):
                out.append(f"prune kernels, {col}: median {f(v.median())} (range "
                           f"{f(v.min())}..{f(v.max())} over {len(v)} cases)")
    return [f"- {line}" for line in out] or ["- none measured yet"]


def figures(out: Path, made: list[Path], stamp_text: str) -> tuple[list[str], list[str]]:
    """Stamp the PNGs just made; returns (markdown links to every figure, problems)."""
    problems = []
    for png in made:
        try:
            stamp(png, stamp_text)
        except Exception as e:  # an unreadable PNG is named, the others stamped
            problems.append(f"stamp {png.name}: {type(e).__name__}: {e}")
    rels = [png.relative_to(out) for png in sorted([*out.glob("figures/*.png"),
                                                    *out.glob("highlights/*.png")])]
    return [f"- [{rel}]({rel})" for rel in rels], problems


def make(runs: Path, out: Path, env: dict, python: str = sys.executable) -> Path:
    """Write the view (its reports run by the interpreter `python`, the study's for its
    steps); never raises for one broken piece."""
    out.mkdir(parents=True, exist_ok=True)
    df = study_tables.prepare(study_tables.load_rows(runs))
    prov = provenance(df)
    problems = []
    reports, made = {}, []
    if len(df):
        reports["all runs"], made = report([runs], out, env, python=python)
    shutil.rmtree(out / "highlights", ignore_errors=True)
    for part, fig in HIGHLIGHTS.items():
        rows = df[df["part"] == part]
        if len(rows):  # the part's runs and the none runs its ratios were taken against
            nones = df[(df["method"] == "none") & df["_cell"].isin(rows["_cell"])
                       & (df["part"] != part)]
            dirs = [runs / part, *map(Path, nones["run_dir"])]
            reports[f"{part} ({fig})"], pngs = report(dirs, out / "highlights", env, fig,
                                                      python)
            made += pngs
    text = f"{prov['device']} · measured {prov['date']} · torch {prov['torch']} · memtrain " \
           f"{prov['git'][:12]}"
    figs, stamp_problems = figures(out, made, text)
    problems += stamp_problems
    st = statuses(runs)
    lines = [f"# memtrain results: {out.name}", "",
             f"Device: {prov['device']}; torch {prov['torch']}, "
             f"CUDA {prov['cuda']}, Triton {prov['triton']}; git {prov['git']}; "
             f"measured {prov['date']}. Made by `make results` "
             f"(`python -m tools.study`); raw runs in `{runs}`.", "",
             "| part | status |", "| --- | --- |"]
    parts = [*study_tables.SECTIONS]
    for sec in parts:
        part = study_tables.SECTION_PART.get(sec, sec)
        lines.append(f"| {sec} | {part_line(part, st.get(part), df)} |")
    lines += [f"| report ({k}) | {v} |" for k, v in reports.items()]
    lines += ["", "## Headlines", "", *headlines(df, runs)]
    for sec, (title, fn) in study_tables.SECTIONS.items():
        part = study_tables.SECTION_PART.get(sec, sec)
        lines += ["", f"## {title}", "", f"Status: {part_line(part, st.get(part), df)}.", ""]
        lines += _failed_steps(st.get(part))
        try:
            lines += fn(df, runs) if len(df) or sec == "tests" else ["No runs."]
        except Exception:  # one table's bug must not lose the others
            problems.append(f"table {sec}: {traceback.format_exc().splitlines()[-1]}")
            lines.append("(table not made: see Problems)")
    lines += ["", "## Figures", "", "memtrain-report over all runs (`report.md`, `summary.csv`, "
              "`figures/`); `highlights/`: the trade-off part's tradeoff figure and the "
              "checkpoint part's budget figure, each drawn from that part's runs alone:", "",
              *figs]
    if problems:
        lines += ["", "## Problems", "", *[f"- {p}" for p in problems]]
    sizes = {p: st[p]["size"] for p in sorted(st) if "size" in st[p]}
    if sizes:
        lines += ["", "## Sizes", "", "Each part as it ran (tools/study/study_plan.py; "
                  "`--set PART.KEY=VALUE` changes one):", "", "```json",
                  json.dumps(sizes, indent=1), "```"]
    atomic_write(out / "results.md", "\n".join(lines) + "\n")
    return out / "results.md"


def _failed_steps(st: dict | None) -> list[str]:
    if not st:
        return []
    out = []
    for s in st.get("steps", []):
        if s.get("status") != "ok":
            tail = ""
            log = Path(s.get("log", ""))
            if log.is_file():
                last = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
                tail = "\n".join(last[-3:])
            out += [f"Step `{s['name']}`: {s['status']} (`{s.get('command', '')[:300]}`)", ""]
            if tail:
                out += ["```", tail[-1500:], "```", ""]
    return out

