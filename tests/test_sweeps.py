"""Sweeps end to end (mlp6, trainer=smoke): relaunches join one setting, every-job-failed sweeps
report, job folders never collide, one sweep at a time per folder."""

import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
from conftest import run_memtrain, warm_python

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8", "trainer.threads=1"]
NARROW = [*TINY, "model.widths=[16,16,16,16,16]", "trainer.eval_max_batches=1"]
NO_REPORT = "+hydra.callbacks.report.enabled=false"


def _summaries(sweep):
    return {f.parent.name: f.read_bytes() for f in sweep.glob("*/summary.json")}


@pytest.mark.slow
def test_every_job_failed_sweep_leaves_report_and_failures_figure(in_tmp):
    p = run_memtrain("-m", "model=mlp6", "trainer=smoke", "trainer.fault=oom",
                     "trainer.fault_step=1", "trainer.batch_size=8,16", "trainer.threads=1",
                     "hydra.sweep.dir=sw", cwd=in_tmp)
    # a script or a scheduler checking the status must not read success; the rows, the report
    # and the closing count are still there (the status comes after every callback)
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == \
        "memtrain: every job of the sweep failed; their rows are in sw"
    assert "memtrain: 2 jobs: oom 2" in p.stdout
    assert "report of the sweep failed" not in p.stderr + p.stdout
    md = (in_tmp / "sw" / "report.md").read_text()
    assert "oom" in md and "failures" in md
    assert (in_tmp / "sw" / "figures" / "failures.png").stat().st_size > 1000
    drawn = pd.read_csv(in_tmp / "sw" / "figures" / "failures.csv")
    assert sorted(drawn["worst_status"]) == ["oom", "oom"]


@pytest.mark.slow
def test_relaunch_with_other_values_runs_only_the_new_config(in_tmp):
    """seed=5,0,1 skip_done into a seed=0,1 folder: seed 5 runs, nothing is overwritten."""
    sweep = in_tmp / "sw"
    assert run_memtrain("-m", *TINY, "trainer.seed=0,1", f"hydra.sweep.dir={sweep}", NO_REPORT,
                        cwd=in_tmp).returncode == 0
    before = _summaries(sweep)
    p = run_memtrain("-m", *TINY, "trainer.seed=5,0,1", "trainer.skip_done=true",
                     f"hydra.sweep.dir={sweep}", cwd=in_tmp)
    assert p.returncode == 0, p.stderr[-2000:]
    after = _summaries(sweep)
    assert {k: after[k] for k in before} == before  # byte for byte
    (new,) = set(after) - set(before)
    assert json.loads(after[new])["trainer.seed"] == 5
    assert "memtrain: 3 jobs: ok 3 (2 skipped: already done)" in p.stdout
    assert [ln.split(" -> ")[0] for ln in p.stdout.splitlines()
            if ln.startswith("memtrain: job ")] == [f"memtrain: job {i}/3" for i in (1, 2, 3)]
    runs = pd.read_csv(sweep / "summary.csv")
    assert sorted(runs["trainer.seed"]) == [0, 1, 5]
    assert "never finished" not in (sweep / "report.md").read_text()  # skip markers are no loss


@pytest.mark.slow
def test_a_sweep_folder_in_use_is_refused_in_one_line(in_tmp):
    sweep = in_tmp / "sw"
    sweep.mkdir()
    fd = os.open(sweep / ".memtrain-sweep.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242\n")
        p = run_memtrain("-m", *TINY, "trainer.seed=0,1", f"hydra.sweep.dir={sweep}",
                         cwd=in_tmp)
    finally:
        os.close(fd)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        f"memtrain: error: sweep folder {sweep} is in use by another sweep (pid 4242); wait for "
        f"it to end or choose another hydra.sweep.dir"]
    assert os.listdir(sweep) == [".memtrain-sweep.lock"]  # nothing written


@pytest.mark.slow
def test_two_sweeps_at_once_into_one_folder(in_tmp):
    """Every run of both present afterwards, or the second refused in one line."""
    sweep = in_tmp / "sw"
    procs = [subprocess.Popen([warm_python(), "-m", "memtrain", "-m", *NARROW,
                               "trainer.max_steps=300", seeds, f"hydra.sweep.dir={sweep}",
                               NO_REPORT], cwd=in_tmp, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for seeds in ("trainer.seed=0,1", "trainer.seed=2,3")]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) in ([0, 0], [0, 2]), [o[1][-2000:] for o in outs]
    expected = set()
    for code, (_, err), seeds in zip(codes, outs, ((0, 1), (2, 3))):
        if code == 2:
            assert err.strip().splitlines()[-1].startswith("memtrain: error: sweep folder")
        else:
            expected |= set(seeds)
    rows = [json.loads(f.read_text()) for f in sweep.glob("*/summary.json")]
    assert sorted(r["trainer.seed"] for r in rows) == sorted(expected)
    assert {r["status"] for r in rows} == {"ok"}


@pytest.mark.slow
def test_interrupted_sweep_relaunched_is_one_setting_of_three_seeds(in_tmp):
    sweep = in_tmp / "sw"
    # job 1 is caught at its first checkpoint, 490 steps before its end
    args = [*NARROW, "trainer.max_steps=500", "trainer.save_every=10", "dataset.train_size=800",
            "trainer.seed=0,1,2", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen([warm_python(), "-m", "memtrain", "-m", *args], cwd=in_tmp,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    while not list(sweep.glob("1_*/resume.pt")):  # job 0 done, job 1 training
        assert proc.poll() is None and time.monotonic() - t0 < 300, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-2000:]
    again = shlex.split(err.split("continue with: memtrain ")[-1].splitlines()[0])
    p = run_memtrain(*again, cwd=in_tmp)
    assert p.returncode == 0, p.stderr[-2000:]
    settings = pd.read_csv(sweep / "settings.csv")
    assert len(settings) == 1 and settings.iloc[0]["n_runs"] == 3
    assert settings.iloc[0]["status"] == "ok" and settings.iloc[0]["seeds"] == "0,1,2"
    md = (sweep / "report.md").read_text()
    assert "3 runs in 1 setting" in md


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_sigterm_to_a_parallel_sweep_leaves_rows_and_resumes(in_tmp):
    """Three jobs on two workers: every job a row and a checkpoint, no worker outlives the sweep,
    and the printed command (quoted: the folder has a space) resumes it with the same launcher.

    The first step of each job waits for the signal (trainer.fault=hang), so the SIGTERM lands
    while both workers train, however slow the machine; a job started after it (job 2) passes
    that step at once, and the resumed jobs start past it."""
    sweep = in_tmp / "my sweep"
    args = ["-m", "hydra/launcher=parallel", *NARROW, "trainer.max_steps=3",
            "trainer.fault=hang", "trainer.fault_step=0", "trainer.seed=0,1,2",
            f"hydra.sweep.dir={sweep}", NO_REPORT]
    env = {**os.environ, "MEMTRAIN_PARALLEL_JOBS": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "memtrain", *args], cwd=in_tmp, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)

    def hanging() -> int:
        return sum("injecting fault hang" in f.read_text()
                   for f in sweep.glob("*/memtrain.log"))

    t0 = time.monotonic()
    while hanging() < 2:  # both jobs training, each in its first step
        assert proc.poll() is None and time.monotonic() - t0 < 300, proc.communicate()
        time.sleep(0.05)
    pids = {int(line.split()[0]) for line in subprocess.run(
        ["ps", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.splitlines()
        if int(line.split()[1]) == proc.pid}
    assert len(pids) >= 2  # the joblib workers
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    rows = [json.loads(f.read_text()) for f in sweep.glob("*/summary.json")]
    # job 2 had not started: it starts stopped (one step, a checkpoint, its row)
    assert sorted(r["trainer.seed"] for r in rows) == [0, 1, 2]
    assert {r["status"] for r in rows} == {"interrupted"}
    assert len(list(sweep.glob("*/resume.pt"))) == 3
    deadline = time.monotonic() + 30
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "a worker outlived the sweep"
    line = err.split("continue with: ")[-1].strip().splitlines()[0]
    again = shlex.split(line)
    assert again[:3] == ["memtrain", "-m", "hydra/launcher=parallel"]
    # the folder as one Hydra value (its space quoted for Hydra, under the shell's quoting)
    assert f"hydra.sweep.dir='{sweep}'" in again and NO_REPORT in again
    # n_jobs 1: joblib runs the three resumed jobs in the sweep's own process (workers would
    # only be more interpreters importing torch); the launcher is the same
    p = run_memtrain(*again[1:], cwd=in_tmp, env={"MEMTRAIN_PARALLEL_JOBS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Joblib.Parallel" in p.stdout + p.stderr  # the same launcher
    rows = [json.loads(f.read_text()) for f in sweep.glob("*/summary.json")]
    assert {r["status"] for r in rows} == {"ok"} and all(r["resumed_at_step"] > 0 for r in rows)


@pytest.mark.slow
def test_a_fault_in_a_parallel_worker_spares_its_siblings(in_tmp):
    """Four jobs on two workers: an injected SIGTERM or error in one is that job's row; the
    sibling finishes and the remaining jobs still start."""
    p = run_memtrain("-m", "hydra/launcher=parallel", *TINY, "trainer.fault=null,sigterm,error",
                     "trainer.fault_step=1", "trainer.seed=0", "hydra.sweep.dir=sw", NO_REPORT,
                     cwd=in_tmp, env={"MEMTRAIN_PARALLEL_JOBS": "2"})
    assert p.returncode == 143, p.stderr[-3000:]  # a job was stopped: the sweep says so
    rows = {r["trainer.fault"]: r["status"] for r in
            (json.loads(f.read_text()) for f in (in_tmp / "sw").glob("*/summary.json"))}
    assert rows == {None: "ok", "sigterm": "interrupted", "error": "error"}
    assert "memtrain: 3 jobs: ok 1, error 1, interrupted 1" in p.stdout
    assert "continue with: memtrain -m hydra/launcher=parallel" in p.stderr
    # the workers say which job of the sweep they start, as the local launcher does
    assert {f"memtrain: job {i}/3" for i in (1, 2, 3)} <= \
        {ln.split(" -> ")[0] for ln in p.stdout.splitlines()}


@pytest.mark.slow
def test_a_second_sweep_into_a_finished_folder_overwrites_nothing(in_tmp):
    """The same sweep again into its folder, without skip_done or resume: each job refuses to
    overwrite its finished row (which stays byte for byte) and says how to go on."""
    sweep = in_tmp / "sw"
    args = ["-m", *TINY, "trainer.seed=0,1", f"hydra.sweep.dir={sweep}", NO_REPORT]
    assert run_memtrain(*args, cwd=in_tmp).returncode == 0
    before = _summaries(sweep)
    p = run_memtrain(*args, cwd=in_tmp)
    assert _summaries(sweep) == before
    said = p.stdout + p.stderr
    assert said.count("already holds a finished run (status=ok); add trainer.skip_done="
                      "true to keep it") == 2, said[-2000:]


def test_job_progress_counts_the_jobs_as_the_sweepers_expand_them(capsys):
    """`memtrain: job i/n` (hydra_callbacks.JobProgress, `make run`'s progress): n is the
    sweep's job count, for the variants sweeper (experiment=quick's 4 + 2 + 1 jobs, times a
    swept common option) and for the basic one (a cartesian product)."""
    from omegaconf import open_dict

    from memtrain.config import loader
    from memtrain.hydra_callbacks import JobProgress, sweep_size

    with loader.session():
        quick = loader.hydra_compose("config", ["experiment=quick"], return_hydra_config=True)
        plain = loader.hydra_compose("config", [], return_hydra_config=True)
        assert sweep_size(quick) == 7
        with open_dict(quick), open_dict(plain):
            quick.hydra.overrides.task = ["experiment=quick", "trainer.seed=0,1,2"]
            plain.hydra.overrides.task = ["model=mlp6,resnet18", "trainer.seed=0,1,2"]
            plain.hydra.mode = "MULTIRUN"
            plain.hydra.job.num = 4
            plain.hydra.runtime.output_dir = "/sweep/4_abc"
        assert sweep_size(quick) == 21
        progress = JobProgress()
        progress.on_multirun_start(plain)
        progress.on_job_start(plain)
    assert capsys.readouterr().out == "memtrain: job 5/6 -> 4_abc\n"
