"""End to end: the CLI, a multirun, the Python API and the report's first cut on tiny runs."""

import json
from pathlib import Path

import pytest
from conftest import NO_REPORT, run_memtrain

from memtrain import api
from memtrain.report.tables import load_runs

REQUIRED = [
    "run_id", "status", "method", "model", "dataset", "trainer.batch_size",
    "mem_peak_alloc_bytes", "mem_peak_source", "mem_peak_reserved_bytes", "mem_peak_act_bytes",
    "mem_act_saved_bytes", "mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes",
    "throughput_samples_s", "step_time_s_median", "test_acc", "test_acc5", "train_loss", "wall_s",
    "device_name", "torch_version", "git_commit", "hostname",
]
TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8"]


def _check_summary(path: Path, **expect):
    s = json.loads(path.read_text())
    missing = [k for k in REQUIRED if k not in s]
    assert not missing, missing
    assert s["status"] == "ok", s.get("error")
    assert s["mem_peak_source"] == "allocator"  # CPU: the allocator's events, scratch included
    assert s["mem_act_saved_bytes"] > 0 and s["mem_peak_alloc_bytes"] > s["mem_params_bytes"] > 0
    assert s["throughput_samples_s"] > 0 and 0 <= s["test_acc"] <= 1
    for k, v in expect.items():
        assert s[k] == v, (k, s[k])
    return s


@pytest.mark.slow
def test_cli_single_run_leaves_valid_records(in_tmp):
    p = run_memtrain(*TINY, cwd=in_tmp, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (summary,) = list(in_tmp.glob("runs/*/*_none_mlp6_synthetic/summary.json"))
    _check_summary(summary, method="none", model="mlp6", dataset="synthetic")
    run = summary.parent
    assert (run / "memtrain.log").exists() and (run / ".hydra" / "config.yaml").exists()
    header = (run / "metrics.csv").read_text().splitlines()[0]
    assert header == "step,epoch,split,name,value"
    assert not list(run.glob(".*.tmp"))  # no temporary files left behind


@pytest.mark.slow
def test_multirun_two_jobs(in_tmp):
    p = run_memtrain("-m", *TINY, "trainer.seed=0,1", NO_REPORT, cwd=in_tmp, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    summaries = sorted(in_tmp.glob("runs/multirun/*/*/*/summary.json"))
    assert len(summaries) == 2
    rows = [_check_summary(s) for s in summaries]
    assert {r["trainer.seed"] for r in rows} == {0, 1}
    assert rows[0]["run_id"] != rows[1]["run_id"]
    df, skipped = load_runs([in_tmp / "runs"])
    assert len(df) == 2 and not skipped


@pytest.mark.slow
def test_api_run_and_build(in_tmp):
    row = api.run(TINY, out_dir=in_tmp / "r")
    _check_summary(in_tmp / "r" / "summary.json")
    assert row["run_id"] == json.loads((in_tmp / "r" / "summary.json").read_text())["run_id"]
    # same config, same run_id; another seed, another
    assert api.run(TINY, out_dir=in_tmp / "r2")["run_id"] == row["run_id"]
    data, model, method = api.build(TINY)
    assert method.name == "none" and data.input_shape == (3, 8, 8)


@pytest.mark.slow
def test_report_loads_nested_runs_and_skips_corrupt(in_tmp, capsys):
    from memtrain.report.command import main as report_main

    api.run(TINY, out_dir=in_tmp / "study" / "a" / "0")
    api.run([*TINY, "trainer.seed=1"], out_dir=in_tmp / "study" / "b" / "nested" / "1")
    bad = in_tmp / "study" / "c"
    bad.mkdir(parents=True)
    (bad / "summary.json").write_text("{not json")
    assert report_main([str(in_tmp / "study")]) == 0
    out = capsys.readouterr()
    assert "skipped" in out.err and "mlp6" in out.out
    import pandas as pd

    df = pd.read_csv(in_tmp / "study" / "summary.csv")
    assert len(df) == 2 and set(df["trainer.seed"]) == {0, 1}


@pytest.mark.slow
def test_failing_run_records_status_error(in_tmp):
    import pytest

    from memtrain.errors import ConfigError

    # the ImageNet stem on 8 px images is a config error: raised, and recorded as a row
    row_dir = in_tmp / "e"
    with pytest.raises(ConfigError, match="needs images of >= 32 px"):
        api.run(["trainer=smoke", "model=resnet18", "model.small_input=false",
                 "dataset.image_size=8"], out_dir=row_dir)
    s = json.loads((row_dir / "summary.json").read_text())
    assert s["status"] == "error" and "32 px" in s["error"]
    assert s["test_acc"] is None  # NaN is written as null


