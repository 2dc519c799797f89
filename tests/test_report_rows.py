"""The report's rows: bad summary values skipped with file and column, one row per run_id and
one setting across relaunches, baselines only on the same device kind, reports of sweeps in
which every job failed. Fabricated folders (tests/report_fixtures.py: made-up numbers)."""

import json

import pandas as pd
import pytest
from report_fixtures import MiB, write_run

from memtrain.report import tables
from memtrain.report.build import analyse, make_report
from memtrain.report.command import main as report_main


def _edit(folder, **values):
    f = folder / "summary.json"
    row = json.loads(f.read_text())
    row.update(values)
    f.write_text(json.dumps(row))


def _raw_edit(folder, key, text):
    """Put JSON text that json.dumps would not write (a huge integer, Infinity) as a value."""
    f = folder / "summary.json"
    row = json.loads(f.read_text())
    row[key] = "@@"
    f.write_text(json.dumps(row).replace('"@@"', text))


@pytest.mark.parametrize("key,text,what", [
    ("mem_peak_alloc_bytes", '"12 GiB"', "text where a number goes"),
    ("custom_score", '"high"', "text where a number goes"),  # numeric in the other rows
    ("test_acc", "[0.9, 0.8]", "a list"),
    ("mem_act_saved_bytes", "1" + "0" * 30, "an integer beyond 64 bits"),
    ("throughput_samples_s", "Infinity", "an infinity"),
    ("method.kernel_size", '{"a": 1}', "a dict"),
    # impossible by the column's unit (memtrain/columns.py)
    ("test_acc", "7.5", "outside [0, 1] (fraction)"),
    ("throughput_samples_s", "-5", "outside [0, inf] (samples/s)"),
    ("mem_act_saved_bytes", "-1", "outside [0, inf] (bytes)"),
])
def test_a_bad_value_skips_its_row_only(tmp_path, capsys, key, text, what):
    r = tmp_path / "runs"
    for i, seed in enumerate((0, 1, 2)):
        write_run(r / f"n{i}", seed=seed, test_acc=0.9, foreign={"custom_score": 1.5})
        write_run(r / f"p{i}", method="pool", seed=seed, peak=60 * MiB, test_acc=0.8,
                  foreign={"custom_score": 2.5})
    _raw_edit(r / "p1", key, text)
    assert report_main([str(r), "--no-figures"]) == 0
    err = capsys.readouterr().err
    assert err.count(f"{r / 'p1' / 'summary.json'}: column {key!r}") == 1, err  # once
    assert what in err
    runs = pd.read_csv(r / "summary.csv")
    assert len(runs) == 5 and not runs["run_dir"].str.endswith("/p1").any()
    settings = pd.read_csv(r / "settings.csv").set_index("method")
    # the other rows keep every column: nothing blanked for all
    assert settings.loc["pool", "mem_peak_alloc_bytes"] == 60 * MiB
    assert settings.loc["pool", "custom_score"] == 2.5 and settings.loc["pool", "n_runs"] == 2
    assert "p1" in (r / "report.md").read_text().split("## Skipped folders")[1]


def test_relaunch_options_do_not_split_a_setting(tmp_path):
    """trainer.resume/skip_done (left out of run_id) are left out of the setting too."""
    r = tmp_path / "runs"
    write_run(r / "0", seed=0, extra={"trainer.resume": False, "trainer.skip_done": False})
    for seed in (1, 2):
        write_run(r / str(seed), seed=seed, test_acc=0.8 + seed / 100,
                  extra={"trainer.resume": True, "trainer.skip_done": True,
                         "trainer.save_every": 50})
    raw, _ = tables.load_runs([r])
    _, settings, _ = analyse(raw)
    assert len(settings) == 1 and settings.iloc[0]["n_runs"] == 3
    assert settings.iloc[0]["label"] == "none"  # resume=... is no label either


def test_a_run_ids_latest_row_stands_for_it(tmp_path):
    """An interrupted run resumed in another folder: the finished row supersedes the old one."""
    r = tmp_path / "runs"
    write_run(r / "old", status="interrupted", test_acc=None,
              extra={"run_id": "abc", "finished_at": "2026-11-22T10:00:00.000+00:00"})
    write_run(r / "new", test_acc=0.9,
              extra={"run_id": "abc", "finished_at": "2026-11-22T11:00:00.000+00:00",
                     "trainer.resume": True})
    write_run(r / "other", seed=1)
    raw, skipped = tables.load_runs([r])
    assert sorted(raw["run_dir"].str.rsplit("/", n=1).str[-1]) == ["new", "other"]
    assert [d.name for d, _ in skipped] == ["old"] and "superseded" in skipped[0][1]
    _, settings, _ = analyse(raw)
    assert settings.iloc[0]["status"] == "ok" and settings.iloc[0]["n_runs"] == 2
    # without a recorded time the summary file's age decides
    _edit(r / "old", finished_at=None)
    _edit(r / "new", finished_at=None)  # written last: the newer file
    raw, _ = tables.load_runs([r])
    assert set(raw["status"]) == {"ok"} and len(raw) == 2


def test_baseline_must_match_the_device_kind(tmp_path):
    r = tmp_path / "runs"
    write_run(r / "gpu_none", peak=300 * MiB, source="cuda", extra={"device": "cuda:0"})
    write_run(r / "cpu_pool", method="pool", peak=100 * MiB, extra={"device": "cpu"})
    write_run(r / "gpu_pool", method="pool", peak=150 * MiB, source="cuda",
              extra={"device": "cuda:1"})
    raw, _ = tables.load_runs([r])
    runs, _, warnings = analyse(raw)
    runs = runs.set_index(runs["run_dir"].str.rsplit("/", n=1).str[-1])
    assert runs.loc["gpu_pool", "mem_peak_rel"] == pytest.approx(0.5)  # cuda:1 vs cuda:0
    assert pd.isna(runs.loc["cpu_pool", "mem_peak_rel"])
    assert pd.isna(runs.loc["cpu_pool", "throughput_rel"])
    (w,) = [w for w in warnings if "on its device" in w]
    assert "device cuda, peak from cuda" in w and "this one on device cpu" in w
    rep = make_report([r], tmp_path / "out", figures=False)
    assert "this one on device cpu" in (rep.out / "report.md").read_text()


def test_a_run_stopped_before_its_peak_relates_without_a_device_warning(tmp_path):
    """A run interrupted before its accounting step has no peak source: it is measured alike
    with the none of its device (its throughput has a ratio), and no warning speaks of a peak
    "from nan"."""
    r = tmp_path / "runs"
    write_run(r / "none", extra={"device": "cpu"})
    write_run(r / "stopped", method="pool", status="interrupted", peak=float("nan"),
              act=float("nan"), source=None, test_acc=None, throughput=500.0,
              extra={"device": "cpu"})
    runs, _, warnings = analyse(tables.load_runs([r])[0])
    assert not [w for w in warnings if "nan" in w], warnings
    stopped = runs.set_index("method").loc["pool"]
    assert stopped["throughput_rel"] == pytest.approx(0.5)
    assert pd.isna(stopped["mem_peak_rel"])


def test_rows_of_two_schemas_are_told_apart(tmp_path):
    """Every row carries the schema of its columns (record.write_summary); a row written before
    versions were recorded is version 1. Read together, the report says so; the CPU peaks of
    the two (tracker's, allocator's) are no baseline of each other."""
    from memtrain import columns

    r = tmp_path / "runs"
    write_run(r / "old_none", peak=300 * MiB, foreign={columns.SCHEMA: None},
              extra={"device": "cpu"})
    write_run(r / "new_pool", method="pool", peak=100 * MiB, source="allocator",
              extra={"device": "cpu"})
    assert json.loads((r / "new_pool" / "summary.json").read_text())[columns.SCHEMA] == \
        columns.SCHEMA_VERSION == 2
    raw, _ = tables.load_runs([r])
    runs, _, warnings = analyse(raw)
    (w,) = [w for w in warnings if "schema" in w]
    assert "schema versions 1, 2" in w and columns.SCHEMA_CHANGES[2] in w
    assert pd.isna(runs.set_index("method").loc["pool", "mem_peak_rel"])
    one, _ = tables.load_runs([r / "new_pool"])
    assert not [w for w in analyse(one)[2] if "schema" in w]


def test_every_run_failed_still_reports(tmp_path):
    """No accuracy, no throughput anywhere: report.md and the failures figure, nothing else."""
    r = tmp_path / "runs"
    for i, b in enumerate((8, 16)):
        write_run(r / str(i), status="oom", test_acc=None, batch_size=b)
        row = json.loads((r / str(i) / "summary.json").read_text())
        for k in ("throughput_samples_s", "step_time_s_median", "test_acc5"):
            row.pop(k)
        (r / str(i) / "summary.json").write_text(json.dumps(row))
    assert report_main([str(r), "--format", "png"]) == 0
    assert (r / "figures" / "failures.png").is_file()
    md = (r / "report.md").read_text()
    assert "oom" in md and "throughput: not drawn (no throughput_samples_s column" in md


def test_a_folder_without_runs_is_bad_input(tmp_path, capsys):
    """An empty folder exits 2 like the other no-input cases (a missing folder, a bad option)."""
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.strip() == \
        f"memtrain-report: error: no run folders (with summary.json) below {tmp_path / 'empty'}"
    assert report_main([str(tmp_path / "empty"), "--baseline", "bogus"]) == 2
