"""The one GPU call (scripts/gpu-results.sh -> python -m tools.study): its priority parts fit the
call's deadline with the installs, run most valuable first, a part complete in the committed
records is not measured again unless asked, and the archive is written after every part."""

import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from memtrain.columns import SCHEMA, SCHEMA_VERSION
from tools.study import results
from tools.study import study_plan as plan

ROOT = Path(__file__).resolve().parents[1]


def _gpu_steps(part: str, tmp_path: Path) -> list[plan.Step]:
    # the call may land on a fresh machine: no baseline `none` to reuse
    ctx = plan.Context("cuda", tmp_path, plan.PROFILES["gpu"], lambda where: False)
    return plan.BUILDERS[part](ctx)


def test_priority_parts_come_first_and_fit_the_call_with_the_installs(tmp_path):
    assert plan.PARTS[:len(plan.PRIORITY)] == plan.PRIORITY == ("tests", "table", "monet",
                                                                 "papers")
    assert set(plan.REST) | set(plan.PRIORITY) == set(plan.PARTS) == set(plan.BUILDERS)
    assert plan.INSTALL_S + sum(plan.BUDGETS[p] for p in plan.PRIORITY) <= plan.CALL_S <= 480
    for part in plan.PRIORITY:  # each part's steps within the part's own budget
        steps = _gpu_steps(part, tmp_path)
        assert steps and sum(s.budget_s for s in steps) <= plan.BUDGETS[part], part
    # the parser's default is every part, in this order
    assert results.parser().parse_args([]).parts == ",".join(plan.PARTS)


def test_the_priority_parts_measure_what_the_table_needs(tmp_path):
    text = {p: [" ".join(s.argv) for s in _gpu_steps(p, tmp_path)] for p in plan.PRIORITY}
    assert "-m gpu" in text["tests"][0] and "tests/test_gpu.py" in text["tests"][0]
    image, image_others, words, words_others = text["table"]
    for line in (image, image_others):
        assert "model=resnet50 " in line and "dataset.image_size=224 " in line
        assert "trainer.batch_size=128 " in line and "trainer.estimate=true" in line
    for line in (words, words_others):
        assert "model=gpt2_small " in line and "dataset.seq_len=1024 " in line
        assert "trainer.batch_size=8 " in line and "trainer.estimate=true" in line
    for line in (image, words):
        assert "method=none,checkpoint " in line and "trainer.precision=fp32,bf16 " in line
    for line in (image_others, words_others):
        assert "trainer.precision=fp32 " in line and "none" not in line.split()[3]
    none, ckpt = text["monet"]
    assert "trainer.batch_size=184 " in none and "method=none " in none
    assert "method.granularity=op,block method.budget_fraction=0.4 " in ckpt
    assert "trainer.batch_size=184 " in ckpt
    pool, quantize, prune = text["papers"]
    assert "method=none,pool " in pool and "method.bits=2 " in quantize
    assert "trainer.batch_size=64 " in quantize and "trainer.precision=fp32 " in quantize
    assert "model=resmlp24 " in prune and "method=none,prune " in prune


def _record(device: str, schema: int = SCHEMA_VERSION, step: str = "ok") -> dict:
    return {"part": "table", "status": step, "device": device, SCHEMA: schema,
            "steps": [{"name": "image", "status": step}]}


@pytest.mark.parametrize("record, skipped", [
    (_record("h100-80gb-hbm3"), True),
    (_record("h200", step="failed (exit 1)"), True),  # failures measured are results
    (_record("cpu"), False),  # a CPU record does not stand for a GPU's
    (_record("h100", schema=SCHEMA_VERSION - 1), False),  # columns meant something else then
    (_record("h100", step="timeout after 300 s"), False),  # cut short: measure again
    (_record("h100", step="skipped (deadline)"), False)])
def test_a_committed_part_is_skipped_unless_asked(tmp_path, capsys, record, skipped):
    root = tmp_path / "committed"
    (root / "2030-01-01_gpu" / "parts").mkdir(parents=True)
    (root / "2030-01-01_gpu" / "parts" / "table.json").write_text(json.dumps(record))
    args = ["--parts", "tests,table", "--dry-run", "--committed", str(root),
            "--runs", str(tmp_path / "r"), "--out", str(tmp_path / "v")]
    assert results.main(args) == 0
    out = capsys.readouterr().out
    assert "## tests" in out and ("## table" not in out) == skipped
    assert ("table: complete in" in out) == skipped
    assert results.main([*args, "--remeasure", "table"]) == 0  # asked: measured again
    assert "## table" in capsys.readouterr().out


def test_bad_remeasure_is_a_one_line_error(capsys):
    assert results.main(["--remeasure", "tabel", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown part tabel" in err[0] and "table" in err[0]


def _jsons(archive: Path) -> list[str]:
    if not archive.exists():
        return []
    with tarfile.open(archive) as tar:
        return sorted(n for n in tar.getnames() if n.endswith(".json"))


def test_the_archive_is_written_after_every_part(tmp_path, monkeypatch):
    """A fake part runner: each part writes one row; when a part starts, the archive already
    holds every earlier part's row and record, so a call cut off there returns them."""
    runs, out, archive = tmp_path / "runs", tmp_path / "view", tmp_path / "out" / "s.tar.gz"
    seen = []

    def fake_part(part, ctx, env, time_left, stamp=None, whole_steps=False, python=None):
        seen.append((part, whole_steps, _jsons(archive)))
        (ctx.runs / part).mkdir(parents=True)
        (ctx.runs / part / "row.json").write_text("{}")
        return {"part": part, "status": "ok", **stamp, "steps": [{"status": "ok"}]}

    monkeypatch.setattr(results, "run_part", fake_part)
    monkeypatch.setenv("MEMTRAIN_COMMIT", "abc123")
    rc = results.main(["--device", "cpu", "--parts", "tests,table,baseline", "--runs",
                       str(runs), "--out", str(out), "--archive", str(archive),
                       "--committed", str(tmp_path / "none"), "--no-report"])
    assert rc == 0
    rows = lambda *ps: sorted([f"{runs.name}/{p}/row.json" for p in ps] +  # noqa: E731
                              [f"{out.name}/parts/{p}.json" for p in ps])
    assert seen == [("tests", False, []), ("table", False, rows("tests")),
                    ("baseline", True, rows("tests", "table"))]
    assert _jsons(archive) == rows("tests", "table", "baseline")
    rec = json.loads((out / "parts" / "table.json").read_text())
    assert rec["device"] == "cpu" and rec["commit"] == "abc123"
    assert rec[SCHEMA] == SCHEMA_VERSION and rec["torch"]


def test_later_parts_start_a_step_only_where_its_budget_fits(tmp_path, monkeypatch):
    """After the priority parts a step whose budget exceeds the time left is skipped (a step
    killed half-way measures nothing); a priority part's steps stop at its capped budget."""
    ran = []
    monkeypatch.setattr(results, "run_step", lambda step, log, timeout, env, python: ran.append(
        (step.name, timeout)) or {"name": step.name, "status": "ok", "seconds": 0,
                                  "budget_s": step.budget_s})
    steps = [plan.Step("baseline", "long", [], 200), plan.Step("baseline", "short", [], 50)]
    monkeypatch.setitem(plan.BUILDERS, "baseline", lambda ctx: steps)
    ctx = plan.Context("cpu", tmp_path, plan.PROFILES["smoke"])
    rec = results.run_part("baseline", ctx, {}, lambda: 100.0, whole_steps=True)
    assert [s["status"] for s in rec["steps"]] == ["skipped (deadline)", "ok"]
    assert ran == [("short", 100.0)]
    ran.clear()
    monkeypatch.setitem(plan.BUILDERS, "table", lambda ctx: [plan.Step("table", "t", [], 9e3)])
    results.run_part("table", ctx, {}, lambda: 1e6)
    assert ran == [("t", pytest.approx(plan.PART_CAP * plan.BUDGETS["table"], abs=1))]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_the_rehearsal_runs_the_script_in_its_own_environment(tmp_path):
    """make gpu-rehearsal (printed, not run): a fresh Python 3.12 environment of its own with
    torch 2.11 and no Hydra from the registry, then the GPU call's own script at smoke size,
    writing nowhere near docs/results/."""
    p = subprocess.run(["make", "-n", "-C", str(ROOT), "gpu-rehearsal",
                        f"REHEARSAL={tmp_path / 'env'}"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    text = p.stdout
    assert "python3.12 -m venv" in text and "--system-site-packages" not in text
    install = next(ln for ln in text.splitlines() if "pip install" in ln)
    assert "torch==2.11.0" in install and "hydra" not in install.lower()
    assert "bash scripts/gpu-results.sh" in text and "--profile smoke" in text
    assert "--device cpu" in text and "--out runs/rehearsal/view" in text
    assert f"PY={tmp_path / 'env'}/bin/python" in text
