"""`make results` (tools/study/): every command of the GPU and CPU studies is a
valid configuration, a failing part is recorded and the next one runs, the tables take each
ratio against the right `none`, and the view survives what a killed study leaves behind."""

import json
import math
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, warm_python
from PIL import Image

from memtrain import api, record
from tools.study import results
from tools.study import study_plan as results_plan
from tools.study import study_tables as results_tables
from tools.study import view as results_view


def _sweep_points(overrides: list[str]) -> list[list[str]]:
    """Enough single jobs of a multirun that every swept value appears once."""
    keep = [o for o in overrides if not o.lstrip("+").startswith("hydra.")]
    split = [o.split("=", 1) for o in keep]
    values = [v.split(",") if "[" not in v else [v] for _, v in split]
    n = max(len(v) for v in values)
    return [[f"{k}={v[i % len(v)]}" for (k, _), v in zip(split, values)] for i in range(n)]


@pytest.mark.slow
def test_every_command_of_the_gpu_study_is_a_valid_config(tmp_path):
    """The GPU study cannot run here: each swept value of its memtrain commands is composed
    and its method built instead, so a wrong key, value or option fails here and not on the
    GPU box. (The CPU study runs whole in the committed docs/results/<date>_cpu/.)"""
    ctx = results_plan.Context("cpu", tmp_path, results_plan.PROFILES["gpu"])
    steps = [s for part in results_plan.PARTS for s in results_plan.BUILDERS[part](ctx)]
    sweeps = [s for s in steps if s.argv[:3] == ["-m", "memtrain", "-m"]]
    assert {s.part for s in sweeps} == set(results_plan.PARTS) - {"tests"}
    from hydra.utils import instantiate

    for step in sweeps:
        for job in _sweep_points(step.argv[3:]):
            cfg, _ = api.compose(job)
            instantiate(cfg.method)
    names = [(s.part, s.name) for s in steps]
    assert len(names) == len(set(names)), "two steps would share a folder"


def test_gpu_study_covers_the_issue_and_fits_its_budget(tmp_path):
    ctx = results_plan.Context("cuda", tmp_path, results_plan.PROFILES["gpu"],
                               lambda where: True)
    text = {p: " ".join(" ".join(s.argv) for s in results_plan.BUILDERS[p](ctx))
            for p in results_plan.PARTS}
    assert "trainer.batch_size=64,128" in text["baseline"]
    assert "trainer.precision=fp32,bf16" in text["baseline"]
    assert "method.kernel_size=2,4 method.targets=conv,conv+bn" in text["pool"]
    assert "method.kernel_size=1" in text["pool"]
    assert "method.sparsity=0.5,0.75,0.9" in text["prune"] and "model=resmlp24" in text["prune"]
    assert text["checkpoint"].count("method.budget_fraction=0.3,0.4,0.6,0.8") == 2  # + compile
    assert "method.strategy=uniform,sqrt,selective" in text["checkpoint"]
    assert "trainer.gpu_memory_gb=8.0" in text["probes"]
    # the study after the priority parts (tests/test_study_call.py holds those to one call)
    budget = sum(s.budget_s for p in results_plan.REST for s in results_plan.BUILDERS[p](ctx))
    assert budget < 20 * 60


def test_bad_part_or_size_is_a_one_line_error(capsys):
    assert results.main(["--parts", "pool,nosuch", "--dry-run"]) == 2
    assert "unknown part nosuch" in capsys.readouterr().err
    assert results.main(["--set", "pool.batch=64", "--dry-run"]) == 2
    assert "pool.batches" in capsys.readouterr().err  # the valid keys are listed
    assert results.main(["--set", "checkpoint.compile=maybe", "--dry-run"]) == 2
    with pytest.raises(ValueError, match="takes a int"):
        results_plan.apply_sets(results_plan.PROFILES["gpu"], ["resnet50.steps=x"])
    sized = results_plan.apply_sets(results_plan.PROFILES["gpu"], ["pool.batches=64",
                                                                    "checkpoint.compile=false"])
    assert sized["pool"]["batches"] == "64" and sized["checkpoint"]["compile"] is False
    assert results_plan.PROFILES["gpu"]["pool"]["batches"] == "128"  # the profile is unchanged


def _row(runs, part, step, num, **kw):
    row = {"status": "ok", "model": "resnet50", "dataset": "synthetic",
           "dataset.image_size": 32, "trainer.batch_size": 2, "trainer.precision": "fp32",
           "trainer.seed": 0, "trainer.max_steps": 4, "device": "cpu",
           "mem_peak_source": "tracker", "throughput_samples_s": 10.0, **kw}
    record.write_summary(runs / part / step / f"{num}_x", row)


def test_ratios_use_the_parts_own_none_else_the_baselines(tmp_path):
    runs = tmp_path / "runs"
    _row(runs, "baseline", "none", 0, method="none", mem_peak_alloc_bytes=100)
    _row(runs, "pool", "pool", 0, method="pool", **{"method.kernel_size": 2,
                                                     "method.targets": "conv"},
         mem_peak_alloc_bytes=70, throughput_samples_s=8.0)
    _row(runs, "checkpoint", "none", 0, method="none", mem_peak_alloc_bytes=200)
    _row(runs, "checkpoint", "budget", 0, method="checkpoint", mem_peak_alloc_bytes=80,
         **{"method.strategy": "budget", "method.budget_fraction": 0.4})
    _row(runs, "checkpoint", "budget", 1, method="checkpoint", status="error",
         error="infeasible budget\nmore", **{"method.strategy": "budget",
                                             "method.budget_fraction": 0.2})
    _row(runs, "prune", "prune", 0, method="prune", mem_peak_alloc_bytes=50,
         **{"trainer.batch_size": 64, "method.sparsity": 0.5, "method.block_size": 32})
    df = results_tables.prepare(results_tables.load_rows(runs))
    x = {(r["part"], results_tables.setting(r)): r for _, r in df.iterrows()}
    assert x["pool", "k=2 conv"]["x_peak"] == pytest.approx(0.7)  # baseline's none
    assert x["pool", "k=2 conv"]["x_thr"] == pytest.approx(0.8)
    assert x["checkpoint", "budget 0.4"]["x_peak"] == pytest.approx(0.4)  # its own none
    assert math.isnan(x["prune", "s=0.5 b=32"]["x_peak"])  # no none of its batch size
    pool = "\n".join(results_tables.pool(df, runs))
    assert "| none | ok |" in pool and "| k=2 conv | ok | 0.00 | 0.700 |" in pool
    ck = "\n".join(results_tables.checkpoint(df, runs))
    assert "error: infeasible budget |" in ck  # a failed job keeps its row and its reason


@pytest.mark.parametrize("method,options,name", [
    ("none", {}, "none"),
    ("pool", {"kernel_size": 1, "targets": "conv"}, "compaction only (k=1)"),
    ("pool", {"kernel_size": 2.0, "targets": "conv+bn"}, "k=2 conv+bn"),
    ("prune", {"sparsity": 0.75, "block_size": 32.0}, "s=0.75 b=32"),
    ("checkpoint", {"strategy": "budget", "granularity": "op", "budget_fraction": 0.4},
     "budget op 0.4"),
    ("checkpoint", {"strategy": "budget", "budget_fraction": 0.4}, "budget 0.4"),  # older rows
    ("checkpoint", {"strategy": "compile", "granularity": "op", "budget_fraction": 0.3},
     "compile 0.3"),
    ("checkpoint", {"strategy": "sqrt", "granularity": "op", "budget_fraction": 0.5}, "sqrt"),
    ("synthetic", {"partitions": 3.0, "kappa": 1.0}, "K=3"),
    ("quantize", {"bits": 4}, "quantize"),  # no rule: the method's name, no code to edit
])
def test_setting_names_come_from_conf(method, options, name):
    """The study's short setting names are the rules of conf/report/study.yaml, applied by the
    report's labeller; a method without a rule is named by its name."""
    import pandas as pd

    row = pd.Series({"method": method, **{f"method.{k}": v for k, v in options.items()}})
    assert results_tables.setting(row) == name


@pytest.mark.slow
def test_the_committed_cpu_view_comes_out_the_same(tmp_path):
    """docs/results/2026-11-23_cpu/: its rows (summary.csv, the declared columns: what the runs
    wrote) give again every table of its results.md that rows make, and its headlines."""
    import csv

    from memtrain import columns

    view = ROOT / "docs" / "results" / "2026-11-23_cpu"
    runs = tmp_path / "runs"

    def value(k, v):
        if k in ("run_id", "git_commit") or v in ("True", "False"):
            return v == "True" if v in ("True", "False") else v
        if columns.lookup(k).unit == "bool":  # a CSV column of bools with gaps reads as 0.0/1.0
            return float(v) != 0
        for kind in (int, float):
            try:
                return kind(v)
            except ValueError:
                pass
        return v

    with open(view / "summary.csv", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            rel = row["run_dir"].split(f"runs/results/{view.name}/")[1]
            record.write_summary(runs / rel, {k: value(k, v) for k, v in row.items()
                                              if v != "" and columns.declared(k)})
    df = results_tables.prepare(results_tables.load_rows(runs))
    text = (view / "results.md").read_text(encoding="utf-8")
    made = results_view.headlines(df, runs)
    assert made and all(line in text for line in made)
    for sec, (title, fn) in results_tables.SECTIONS.items():
        if sec == "tests":  # from junit.xml, not rows
            continue
        section = text.split(f"## {title}\n")[1].split("\n## ")[0]
        mine = [ln for ln in fn(df, runs) if ln.startswith("|")]
        theirs = [ln for ln in section.splitlines() if ln.startswith("|")]
        assert len(mine) > 2 and mine == theirs[:len(mine)], sec


def test_probe_notes_and_part_status_lines(tmp_path):
    import pandas as pd

    row = pd.Series({"method": "checkpoint", "method.strategy": "budget",
                     "mem_estimate_error": None})
    assert "planned in fit()" in results_tables.probe_note(row)
    assert results_tables.probe_note(pd.Series({"method": "none"})) == ""
    df = pd.DataFrame({"part": ["pool", "pool"], "status": ["ok", "oom"]})
    assert results_view.part_line("pool", None, df) == "not run"
    line = results_view.part_line("pool", {"status": "running"}, df)
    assert line.startswith("did not finish") and "ok 1, oom 1" in line


def test_tests_section_counts_junit(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "junit.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1" time="12">'
        '<testcase name="test_a"/><testcase name="test_b"><failure message="boom"/></testcase>'
        '<testcase name="test_c"><skipped message="no CUDA"/></testcase></testsuite>'
        '</testsuites>')
    text = "\n".join(results_tables.tests(None, tmp_path))
    assert "1 passed, 1 failed, 0 errors, 1 skipped" in text
    assert "failure: `test_b` boom" in text


def test_pack_leaves_out_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r" / "a").mkdir(parents=True)
    (tmp_path / "r" / "a" / "summary.json").write_text("{}")
    (tmp_path / "r" / "a" / "resume.pt").write_bytes(b"x")
    results.pack(tmp_path / "out" / "r.tar.gz", [tmp_path / "r", tmp_path / "missing"])
    with tarfile.open(tmp_path / "out" / "r.tar.gz") as tar:
        names = tar.getnames()
    assert "r/a/summary.json" in names and "r/a/resume.pt" not in names


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_a_failing_part_is_recorded_and_the_next_part_runs(tmp_path):
    """`make results DEVICE=cpu` at smoke size (CI): synthetic fails (an unknown model), the
    trade-off part after it still trains every method, and the view, the figures and the
    archive are all written. Without DOCS=0 the target then makes results-docs (`make -n`
    shows it; test_results_docs.py renders every block those tools write)."""
    out, runs, archive = tmp_path / "view", tmp_path / "runs", tmp_path / "a.tar.gz"
    root = Path(__file__).resolve().parents[1]
    cmd = ["make", "-s", "-C", str(root), "results", "DEVICE=cpu", f"PY={sys.executable}",
           "PARTS=synthetic,tradeoff", "RESULTS_NAME=t", f"ARCHIVE={archive}",
           f"ARGS=--profile smoke --set synthetic.model=nosuch --out {out} --runs {runs} "
           f"--python {warm_python()}"]  # its memtrain commands forked from the warm interpreter
    plan = subprocess.run([*cmd[:2], "-n", *cmd[2:]], capture_output=True, text=True,
                          timeout=60).stdout
    assert "-m tools.study --device cpu" in plan and "results-docs" in plan, plan
    p = subprocess.run([*cmd, "DOCS=0"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    status = {p: json.loads((runs / p / "status.json").read_text()) for p in
              ("synthetic", "tradeoff")}
    assert status["synthetic"]["status"].startswith("failed (exit 2)")
    assert status["tradeoff"]["status"] == "ok"
    text = (out / "results.md").read_text()
    assert "| synthetic | failed (exit 2)" in text and "nosuch" in text  # the log's last line
    rows = [ln for ln in text.split("## trade-off")[1].split("##")[0].splitlines()
            if ln.startswith("| ") and "| ok |" in ln]
    quick = yaml.safe_load((root / "conf/experiment/quick.yaml").read_text())
    settings = [v for line in quick["hydra"]["sweeper"]["variants"] for v in
                line.split()[0].removeprefix("method=").split(",")]  # one row per setting
    assert len(rows) == len(settings) and "prune" in settings, (rows, settings)
    assert (out / "report.md").exists() and (out / "summary.csv").exists()
    assert not list(out.glob("**/*.parquet"))
    for png in (out / "figures" / "tradeoff.png", out / "highlights" / "tradeoff.png"):
        with Image.open(png) as im:
            assert im.mode == "P" and im.width <= results_view.MAX_WIDTH  # stamped, reduced
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert any(n.endswith("view/results.md") for n in names)
    assert any(n.endswith("tradeoff/status.json") for n in names)


def test_a_part_past_the_deadline_keeps_its_earlier_results(tmp_path, capsys):
    """A part the deadline leaves unstarted is not wiped: `PARTS=` reruns and cut-short calls
    must not lose what an earlier invocation measured."""
    runs = tmp_path / "runs"
    (runs / "synthetic").mkdir(parents=True)
    (runs / "synthetic" / "status.json").write_text('{"status": "ok"}')
    rc = results.main(["--device", "cpu", "--parts", "synthetic", "--deadline-s", "0",
                       "--runs", str(runs), "--out", str(tmp_path / "v"), "--no-report"])
    assert rc == 0 and "synthetic: not started (deadline)" in capsys.readouterr().out
    assert (runs / "synthetic" / "status.json").read_text() == '{"status": "ok"}'
