"""Progress that reaches any log while a run trains: lines every trainer.log_every steps
without a terminal, metrics.csv written as rows are made (whole lines when killed) with the
run's memory and throughput as series, TensorBoard scalars under the same names and the run's
hparams, W&B offline, evaluation every trainer.eval_every_steps."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import warm_python

from memtrain import api, preflight
from memtrain.config.schema import Trainer
from memtrain.errors import ConfigError
from memtrain.run import loggers

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8"]
LINE = re.compile(r"step (\d+)/(\d+) epoch \d+ loss [\d.]+ samples/s (\d+|-) "
                  r"mem (?:([\d.]+[MG]) peak \(cpu\), )?[\d.]+[MG] rss")


def _metrics(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_progress_lines_reach_a_redirected_log(in_tmp):
    """stdout to a file, stderr to a pipe (no terminal): a line every log_every steps."""
    with open(in_tmp / "log.txt", "w") as out:
        p = subprocess.run([warm_python(), "-m", "memtrain", *TINY, "trainer.max_steps=40",
                            "trainer.log_every=4", "trainer.progress=true", "hydra.run.dir=r"],
                           cwd=in_tmp, stdout=out, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = list(LINE.finditer((in_tmp / "log.txt").read_text()))
    assert [int(m.group(1)) for m in lines] == list(range(4, 41, 4))
    # the CPU peak, once the accounting step has measured it (smoke: step 2, after 1 warm-up)
    assert all(m.group(4) for m in lines)
    # the run's own log file holds the same lines
    assert len(LINE.findall((in_tmp / "r" / "memtrain.log").read_text())) == 10


@pytest.mark.slow
def test_metrics_csv_is_valid_while_training_and_when_killed(in_tmp):
    proc = subprocess.Popen([sys.executable, "-m", "memtrain", *TINY, "trainer.max_steps=100000",
                             "trainer.epochs=1000", "trainer.log_every=1", "hydra.run.dir=r"],
                            cwd=in_tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    path = in_tmp / "r" / "metrics.csv"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if path.exists() and len(_metrics(path)) >= 60:
                break
            assert proc.poll() is None, "the run ended before it was killed"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)  # no handler, no final write
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = _metrics(path)
    assert not (in_tmp / "r" / "summary.json").exists()  # killed before the end: the live file
    assert len(rows) >= 60 and list(rows[0]) == ["step", "epoch", "split", "name", "value"]
    assert all(r["value"] not in (None, "") for r in rows)  # every line whole
    loss = [int(r["step"]) for r in rows if r["name"] == "loss"]
    assert loss == list(range(len(loss)))  # every step, in order (log_every=1)


@pytest.mark.slow
def test_eval_every_steps_gives_curves_and_changes_no_training(in_tmp):
    base = api.run([*TINY, "trainer.max_steps=20"], out_dir=in_tmp / "a")
    every = api.run([*TINY, "trainer.max_steps=20", "trainer.eval_every_steps=5"],
                    out_dir=in_tmp / "b")
    test_steps = [int(r["step"]) for r in _metrics(in_tmp / "b" / "metrics.csv")
                  if r["split"] == "test" and r["name"] == "acc"]
    assert test_steps == [5, 10, 15, 20]  # 20 is the end's evaluation, once
    train = lambda d: [r for r in _metrics(d / "metrics.csv")  # what training computed
                       if r["split"] == "train" and r["name"] in ("loss", "lr")]
    assert train(in_tmp / "a") == train(in_tmp / "b")  # evaluation drew no random numbers
    assert base["test_acc"] == every["test_acc"]
    assert base["run_id"] == every["run_id"]  # how often it is evaluated is not what it is


@pytest.mark.slow
def test_tensorboard_has_the_metric_rows_and_the_runs_hparams(in_tmp):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    row = api.run([*TINY, "trainer.max_steps=12", "trainer.log_every=3",
                   "trainer.eval_every_steps=6", "trainer.logger=tensorboard"],
                  out_dir=in_tmp / "r")
    acc = EventAccumulator(str(in_tmp / "r" / "tensorboard"))
    acc.Reload()
    rows = _metrics(in_tmp / "r" / "metrics.csv")
    tags = acc.Tags()["scalars"]
    series = sorted(t for t in tags if not t.startswith("final/"))
    assert series == sorted({f"{r['split']}/{r['name']}" for r in rows})
    assert {"train/mem_peak_alloc_bytes", "train/samples_s"} <= set(series)
    for tag in series:
        split, name = tag.split("/")
        want = [(int(r["step"]), float(r["value"])) for r in rows
                if (r["split"], r["name"]) == (split, name)]
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
    # hparams: the row's options, and its final metrics as scalars the HPARAMS tab reads
    content = acc.PluginTagToContent("hparams")
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hp = start.session_start_info.hparams
    assert hp["method"].string_value == "none" and hp["model"].string_value == "mlp6"
    assert hp["status"].string_value == "ok"
    assert hp["trainer.batch_size"].number_value == row["trainer.batch_size"] == 8
    assert hp["dataset.image_size"].number_value == 8
    exp = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    metric_tags = {m.name.tag for m in exp.metric_infos}
    assert {"final/test_acc", "final/mem_peak_alloc_bytes", "final/throughput_samples_s"} \
        <= metric_tags
    for tag in metric_tags:
        column = tag.removeprefix("final/")
        assert acc.Scalars(tag)[-1].value == pytest.approx(float(row[column]), rel=1e-6)


@pytest.mark.slow
def test_metrics_csv_holds_memory_and_throughput_consistent_with_the_row(in_tmp):
    """Every logged step (log_every=1) carries the series; each step's samples/s is the
    batch over that step's time, so the row's throughput (batch / the median step time) is
    one of them; the memory series ends at the row's peak and never passes the row's RSS."""
    row = api.run([*TINY, "trainer.max_steps=9", "trainer.warmup_steps=2"],
                  out_dir=in_tmp / "r")
    rows = _metrics(in_tmp / "r" / "metrics.csv")
    named = lambda n: [(int(r["step"]), float(r["value"])) for r in rows  # noqa: E731
                       if r["split"] == "train" and r["name"] == n]
    # warm-up (steps 0, 1) and the accounting step (2) are not timed: 3..8 are, one each
    rate = named("samples_s")
    assert [s for s, _ in rate] == list(range(3, 9))
    assert row["throughput_samples_s"] == pytest.approx(
        sorted(v for _, v in rate)[len(rate) // 2], rel=1e-9)  # torch's lower median of times
    # the CPU's peak is the allocator's events' in the accounting step, known from it on: the
    # row's value
    peak = named("mem_peak_alloc_bytes")
    assert [s for s, _ in peak] == list(range(2, 9))
    assert {v for _, v in peak} == {row["mem_peak_alloc_bytes"]}
    assert row["mem_peak_source"] == "allocator"
    rss = [v for _, v in named("mem_peak_rss_bytes")]
    assert len(rss) == 9 and rss == sorted(rss) and rss[-1] <= row["mem_peak_rss_bytes"]


def _wandb_records(path):
    """The records of a .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB's
    log format (32 KiB blocks of records: crc32c 4, length 2, type 1 (full 1, first 2, middle
    3, last 4), data), which wandb (0.31: in its Go core, no Python reader left) writes."""
    raw, out, part, pos = path.read_bytes(), [], b"", 7
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(raw[pos + 4:pos + 6], "little"), raw[pos + 6]
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        part = data if kind in (1, 2) else part + data
        if kind in (1, 4):
            out.append(part)
    return out


@pytest.mark.slow
def test_wandb_runs_offline_with_the_series_and_the_row(in_tmp, monkeypatch):
    """trainer.logger=wandb with no WANDB_MODE set: an offline run in the run folder (no
    network), its history holding the metric rows (memory among them) and its summary the
    row's final metrics, read back from the run's own .wandb file."""
    pytest.importorskip("wandb")
    for k in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(k, str(in_tmp / "home" / k.lower()))  # nothing in the user's home
    monkeypatch.setenv("WANDB_SILENT", "true")
    row = api.run([*TINY, "trainer.max_steps=6", "trainer.log_every=2",
                   "trainer.logger=wandb"], out_dir=in_tmp / "r")
    assert row["status"] == "ok"
    runs = list((in_tmp / "r" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((in_tmp / "r").rglob("*"))
    from wandb.proto import wandb_internal_pb2

    history, summary, config = [], {}, {}
    for data in _wandb_records(next(runs[0].glob("*.wandb"))):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in rec.history.item})
        elif kind == "summary":
            summary.update({i.key: json.loads(i.value_json) for i in rec.summary.update})
        elif kind in ("config", "run"):  # wandb.init's config travels with the run record
            got = rec.config if kind == "config" else rec.run.config
            config.update({i.key: json.loads(i.value_json) for i in got.update})
    logged = {(h["step"], k): v for h in history for k, v in h.items() if "/" in k}
    want = {(int(r["step"]), f"{r['split']}/{r['name']}"): float(r["value"])
            for r in _metrics(in_tmp / "r" / "metrics.csv")}
    assert logged == pytest.approx(want, rel=1e-6)
    assert any(k == "train/mem_peak_alloc_bytes" for _, k in logged)
    assert summary["test_acc"] == pytest.approx(row["test_acc"])
    assert summary["mem_peak_alloc_bytes"] == row["mem_peak_alloc_bytes"]
    assert config["method"] == "none" and config["model"] == "mlp6"


def test_tensorboard_missing_is_one_line(monkeypatch):
    """A logger whose package is missing: one line from the job's checks (preflight.check),
    before anything is built; a logger memtrain does not know: the trainer's own check."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ConfigError) as e:
        preflight.check(api.compose([*TINY, "trainer.logger=tensorboard"])[0])
    assert "trainer.logger=tensorboard needs the tensorboard package" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="trainer.logger must be one of csv, tensorboard, wandb"):
        Trainer.from_config({"logger": "mlflow"})
    assert loggers.LOGGERS == ("csv", "tensorboard", "wandb")


def test_wandb_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(ConfigError) as e:
        preflight.check(api.compose([*TINY, "trainer.logger=wandb"])[0])
    assert "trainer.logger=wandb needs the wandb package" in str(e.value)
    assert "\n" not in str(e.value)

