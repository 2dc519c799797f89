"""Failures as rows, interrupted runs that resume bit for bit, sweeps that skip finished jobs."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import NO_REPORT, job_dir, run_memtrain, warm_python

from memtrain import api
from memtrain.hydra_callbacks import count_statuses, format_counts, job_stamps
from memtrain.run import faults

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8"]
# small enough that thousands of steps take seconds
# (one thread: on a busy 2-core machine two spin-waiting threads make tiny steps 10x slower)
NARROW = [*TINY, "model.widths=[16,16,16,16,16]", "trainer.eval_max_batches=1",
          "trainer.threads=1"]


@pytest.mark.parametrize("fault,status,message", [
    ("oom", "oom", "CUDA out of memory (injected"),
    ("nan", "diverged", "loss became nan at step 45"),
    ("error", "error", "RuntimeError: injected failure"),
])
def test_injected_fault_gives_its_row(in_tmp, fault, status, message):
    """Each failure is the row's status, and metrics.csv keeps every step logged before it
    (every 10th: steps 0-40 before a fault at 45), whatever ended the run."""
    row = api.run([*NARROW, f"trainer.fault={fault}", "trainer.fault_step=45",
                   "trainer.max_steps=50", "trainer.log_every=10"], out_dir=in_tmp / "r")
    s = json.loads((in_tmp / "r" / "summary.json").read_text())
    assert row["status"] == s["status"] == status
    assert message in s["error"]
    if fault != "error":
        assert s["failed_step"] == 45
    if fault == "oom":  # the peak reached before the failure (here: the tracker's, step 1)
        assert s["mem_tracker_peak_bytes"] > s["mem_params_bytes"] > 0
    assert _logged_steps(in_tmp / "r") == [0, 10, 20, 30, 40]


def _logged_steps(run) -> list[int]:
    """The steps of metrics.csv's training loss rows."""
    import pandas as pd

    rows = pd.read_csv(run / "metrics.csv")
    return rows[(rows["split"] == "train") & (rows["name"] == "loss")]["step"].tolist()


@pytest.mark.slow
def test_a_failure_after_training_keeps_the_metrics(in_tmp, monkeypatch):
    """Bad input found after the loop (a ConfigError, exit 2 from the command) is the row's
    error, and the row keeps every metric the run logged: the training rows and the
    evaluation's."""
    from memtrain.errors import ConfigError
    from memtrain.run import runner

    def refuse(*args):
        raise ConfigError("refused after training")

    monkeypatch.setattr(runner.distributed, "gather_memory", refuse)
    with pytest.raises(ConfigError, match="refused after training"):
        api.run([*NARROW, "trainer.max_steps=12", "trainer.log_every=5"], out_dir=in_tmp / "r")
    s = json.loads((in_tmp / "r" / "summary.json").read_text())
    assert s["status"] == "error" and s["error"] == "refused after training"
    assert _logged_steps(in_tmp / "r") == [0, 5, 10, 11]
    import pandas as pd

    assert "test" in set(pd.read_csv(in_tmp / "r" / "metrics.csv")["split"])


def _weights(path):
    return torch.load(path, weights_only=True)


def _assert_same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.mark.slow
def test_sigterm_then_resume_equals_uninterrupted(in_tmp):
    args = [*TINY, "trainer.max_steps=8", "trainer.save_weights=true"]
    full = api.run(args, out_dir=in_tmp / "full")
    part = api.run([*args, "trainer.fault=sigterm", "trainer.fault_step=3"], out_dir=in_tmp / "p")
    assert part["status"] == "interrupted" and part["signal"] == "SIGTERM"
    assert part["failed_step"] == 4 and (in_tmp / "p" / "resume.pt").is_file()
    # a checkpoint is plain tensors and containers: it loads with weights_only=True
    assert _weights(in_tmp / "p" / "resume.pt")["step"] == 4
    again = api.run([*args, "trainer.fault=sigterm", "trainer.fault_step=3",
                     "trainer.resume=true"], out_dir=in_tmp / "p")
    assert again["status"] == "ok" and again["resumed_at_step"] == 4
    assert again["run_id"] == part["run_id"]  # resume does not change what the run is
    assert not (in_tmp / "p" / "resume.pt").exists()  # a finished run keeps no checkpoint
    _assert_same_weights(in_tmp / "full" / "weights.pt", in_tmp / "p" / "weights.pt")
    assert again["train_loss"] == full["train_loss"]
    assert again["mem_act_saved_bytes"] == full["mem_act_saved_bytes"]  # carried over


def test_hang_waits_for_the_stop_signal_then_resumes_past_it(in_tmp, monkeypatch):
    """trainer.fault=hang (a run longer than its time limit): step 2 waits for a signal, then
    ends with its checkpoint; the resumed run goes on past it. With no signal it gives up."""
    args = [*TINY, "trainer.max_steps=5", "trainer.fault=hang", "trainer.fault_step=2"]
    log = in_tmp / "r" / "memtrain.log"
    monkeypatch.setattr(faults, "HANG_LIMIT_S", 120)  # a failing test fails in minutes

    def signal_once_hanging():  # SIGTERM to this process only while the run waits in step 2
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if log.is_file() and "injecting fault hang" in log.read_text():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    sender = threading.Thread(target=signal_once_hanging)
    sender.start()
    row = api.run(args, out_dir=in_tmp / "r")
    sender.join()
    assert row["status"] == "interrupted" and row["failed_step"] == 3, row
    again = api.run([*args, "trainer.resume=true"], out_dir=in_tmp / "r")
    assert again["status"] == "ok" and again["resumed_at_step"] == 3
    monkeypatch.setattr(faults, "HANG_LIMIT_S", 0.2)
    row = api.run(args, out_dir=in_tmp / "nobody")
    assert row["status"] == "error" and "no stop signal in 0.2 s" in row["error"]


@pytest.mark.slow
def test_resume_finds_the_checkpoint_in_another_folder(in_tmp):
    args = [*TINY, "trainer.max_steps=6", "trainer.fault=sigterm", "trainer.fault_step=2"]
    assert api.run(args, out_dir=in_tmp / "runs" / "a")["status"] == "interrupted"
    row = api.run([*args, "trainer.resume=true"], out_dir=in_tmp / "runs" / "b")
    assert row["status"] == "ok" and row["resumed_at_step"] == 3
    assert row["resumed_from"] == str(in_tmp / "runs" / "a")
    assert not list((in_tmp / "runs").rglob("resume*.pt"))


def test_kill_9_then_resume_from_the_last_saved_step_is_bit_identical(in_tmp):
    """SIGKILL leaves no handler a chance: no final checkpoint, no summary. The run resumes from
    its last periodic checkpoint (trainer.save_every, written whole or not at all) and ends with
    the weights and loss of the run that was never killed, bit for bit."""
    args = [*NARROW, "trainer.max_steps=600", "trainer.save_weights=true",
            "trainer.save_every=40", "dataset.train_size=800"]  # 100 steps per epoch
    run = in_tmp / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "memtrain", *args, f"hydra.run.dir={run}"],
                            cwd=in_tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def saved_past_the_first_epoch() -> bool:  # the shuffle state then differs from the seed's
        ckpt = run / "resume.pt"  # written to a temporary file, then renamed: whole or absent
        return ckpt.exists() and _weights(ckpt)["step"] > 100

    try:
        t0 = time.monotonic()
        while not saved_past_the_first_epoch():
            assert proc.poll() is None and time.monotonic() - t0 < 300, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert not (run / "summary.json").exists()
    saved = _weights(run / "resume.pt")["step"]
    assert saved % 40 == 0 and 100 < saved < 600
    again = api.run([*args, "trainer.resume=true"], out_dir=run)
    assert again["status"] == "ok" and again["resumed_at_step"] == saved
    full = api.run(args, out_dir=in_tmp / "full")
    _assert_same_weights(in_tmp / "full" / "weights.pt", run / "weights.pt")
    assert again["train_loss"] == full["train_loss"]


@pytest.mark.slow
def test_real_sigterm_to_a_subprocess_then_resume(in_tmp):
    """A real signal at an arbitrary moment, across epochs (shuffle state), then resumed."""
    args = [*NARROW, "trainer.max_steps=500", "trainer.save_weights=true",
            "trainer.save_every=10", "dataset.train_size=800"]  # 100 steps per epoch
    run = in_tmp / "killed"
    proc = subprocess.Popen([warm_python(), "-m", "memtrain", *args, f"hydra.run.dir={run}"],
                            cwd=in_tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not (run / "resume.pt").exists():  # training has started
        assert proc.poll() is None and time.monotonic() - t0 < 300, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-2000:]
    assert "interrupted" in err and "trainer.resume=true" in err
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "interrupted" and 10 <= s["failed_step"] < 500, s.get("failed_step")
    p = run_memtrain(*args, "trainer.resume=true", f"hydra.run.dir={run}", cwd=in_tmp)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["resumed_at_step"] == s["failed_step"]
    threads = torch.get_num_threads()
    try:
        api.run([*args, "trainer.save_every=0"], out_dir=in_tmp / "full")
    finally:
        torch.set_num_threads(threads)
    _assert_same_weights(in_tmp / "full" / "weights.pt", run / "weights.pt")


@pytest.mark.slow
def test_skip_done_in_process(in_tmp):
    first = api.run(TINY, out_dir=in_tmp / "sweep" / "0")
    again = api.run([*TINY, "trainer.skip_done=true"], out_dir=in_tmp / "sweep" / "1")
    assert again["skipped"] and again["run_id"] == first["run_id"]
    assert not (in_tmp / "sweep" / "1" / "summary.json").exists()  # no second row
    marker = json.loads((in_tmp / "sweep" / "1" / "skipped.json").read_text())
    assert marker["done_in"].endswith("0")
    other = api.run([*TINY, "trainer.skip_done=true", "trainer.seed=1"],
                    out_dir=in_tmp / "sweep" / "2")
    assert other["status"] == "ok" and not other.get("skipped")
    counts, skipped = count_statuses(in_tmp / "sweep")
    assert counts == {"ok": 3} and skipped == 1
    assert format_counts(counts, skipped) == "memtrain: 3 jobs: ok 3 (1 skipped: already done)"
    # a sweep into the same folder right after counts its own jobs only, however close in time
    before = job_stamps(in_tmp / "sweep")
    (in_tmp / "sweep" / "3").mkdir()
    (in_tmp / "sweep" / "3" / "summary.json").write_text('{"status": "oom"}')
    (in_tmp / "sweep" / "1" / "skipped.json").write_text(json.dumps(marker))  # skipped again
    counts, skipped = count_statuses(in_tmp / "sweep", before)
    assert counts == {"ok": 1, "oom": 1} and skipped == 1


@pytest.mark.slow
def test_sweep_continues_counts_and_relaunch_resumes(in_tmp):
    """A sweep goes past oom/diverged/error rows and prints the count; a SIGTERM stops it; the
    printed command re-launches it: finished jobs skipped, the interrupted one resumed."""
    sweep = in_tmp / "sw"
    p = run_memtrain("-m", *TINY, "trainer.threads=1", "trainer.fault=null,oom,nan,error,sigterm",
                     "trainer.fault_step=1", f"hydra.sweep.dir={sweep}", NO_REPORT, cwd=in_tmp)
    assert p.returncode == 143, p.stderr[-3000:]
    rows = {int(f.parent.name.split("_")[0]): json.loads(f.read_text())
            for f in sweep.glob("*/summary.json")}
    assert [rows[i]["status"] for i in range(5)] == [
        "ok", "oom", "diverged", "error", "interrupted"]
    again = p.stderr.split("continue with: memtrain ")[-1].split()
    assert "trainer.skip_done=true" in again and "trainer.resume=true" in again
    p2 = run_memtrain(*again, cwd=in_tmp)
    assert p2.returncode == 0, p2.stderr[-3000:]
    assert "memtrain: 5 jobs: ok 2, oom 1, diverged 1, error 1 (1 skipped: already done)" \
        in p2.stdout, p2.stdout[-2000:]
    final = json.loads((job_dir(sweep, 4) / "summary.json").read_text())
    assert final["status"] == "ok" and final["resumed_at_step"] == 2
