"""Progress that reaches any log while a run trains: lines every trainer.log_every steps
without a terminal, metrics.csv written as rows are made (whole lines when killed),
TensorBoard scalars under the same names, evaluation every trainer.eval_every_steps."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from memtrain import api, loggers
from memtrain.errors import ConfigError
from memtrain.schema import Trainer

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8"]
LINE = re.compile(r"step (\d+)/(\d+) epoch \d+ loss [\d.]+ samples/s (\d+|-) mem [\d.]+G")


def _metrics(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_progress_lines_reach_a_redirected_log(in_tmp):
    """stdout to a file, stderr to a pipe (no terminal): a line every log_every steps."""
    with open(in_tmp / "log.txt", "w") as out:
        p = subprocess.run([sys.executable, "-m", "memtrain", *TINY, "trainer.max_steps=40",
                            "trainer.log_every=4", "trainer.progress=true", "hydra.run.dir=r"],
                           cwd=in_tmp, stdout=out, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    steps = [int(m.group(1)) for m in LINE.finditer((in_tmp / "log.txt").read_text())]
    assert steps == list(range(4, 41, 4))
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


def test_eval_every_steps_gives_curves_and_changes_no_training(in_tmp):
    base = api.run([*TINY, "trainer.max_steps=20"], out_dir=in_tmp / "a")
    every = api.run([*TINY, "trainer.max_steps=20", "trainer.eval_every_steps=5"],
                    out_dir=in_tmp / "b")
    test_steps = [int(r["step"]) for r in _metrics(in_tmp / "b" / "metrics.csv")
                  if r["split"] == "test" and r["name"] == "acc"]
    assert test_steps == [5, 10, 15, 20]  # 20 is the end's evaluation, once
    train = lambda d: [r for r in _metrics(d / "metrics.csv") if r["split"] == "train"]
    assert train(in_tmp / "a") == train(in_tmp / "b")  # evaluation drew no random numbers
    assert base["test_acc"] == every["test_acc"]
    assert base["run_id"] == every["run_id"]  # how often it is evaluated is not what it is


def test_tensorboard_has_the_metric_rows(in_tmp):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    api.run([*TINY, "trainer.max_steps=12", "trainer.log_every=3", "trainer.eval_every_steps=6",
             "trainer.logger=tensorboard"], out_dir=in_tmp / "r")
    acc = EventAccumulator(str(in_tmp / "r" / "tensorboard"))
    acc.Reload()
    rows = _metrics(in_tmp / "r" / "metrics.csv")
    assert sorted(acc.Tags()["scalars"]) == sorted({f"{r['split']}/{r['name']}" for r in rows})
    for tag in acc.Tags()["scalars"]:
        split, name = tag.split("/")
        want = [(int(r["step"]), float(r["value"])) for r in rows
                if (r["split"], r["name"]) == (split, name)]
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def test_tensorboard_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ConfigError) as e:
        Trainer.from_config({"logger": "tensorboard"})
    assert "trainer.logger=tensorboard needs the tensorboard package" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="trainer.logger must be one of csv, tensorboard"):
        Trainer.from_config({"logger": "wandb"})
    assert loggers.LOGGERS == ("csv", "tensorboard")

