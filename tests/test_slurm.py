"""Sweeps on a real SLURM scheduler through `hydra/launcher=slurm`: a throwaway one-node cluster
(tests/slurm_cluster.py), the preset's CPU-only values, the `memtrain` command as a user runs it.

Skipped, saying why, where SLURM and munge are not installed (`apt-get install slurm-wlm munge`;
.ci/run does it) or the tests do not run as root (slurmd launches the jobs).
"""

import json
import os
import shlex
import subprocess

import pytest
import slurm_cluster
import torch
from conftest import job_dir, warm_python

from memtrain import api

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8", "trainer.threads=1"]
NO_REPORT = "+hydra.callbacks.report.enabled=false"  # where the test is not about the report
# the preset's values for a cluster without GPUs (docs/clusters.md, SLURM)
CPU_ONLY = {"MEMTRAIN_SLURM_GPUS_PER_NODE": "0", "MEMTRAIN_SLURM_CPUS_PER_TASK": "1",
            "MEMTRAIN_SLURM_MEM_GB": "1", "MEMTRAIN_SLURM_PARTITION": slurm_cluster.PARTITION}


@pytest.fixture(scope="module")
def cluster():
    gone = slurm_cluster.missing()
    if gone:
        pytest.skip(f"SLURM is not installed here (no {', '.join(gone)}); "
                    f"apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the throwaway SLURM cluster needs root (slurmd starts the jobs)")
    # a fixed size, not this machine's: the scancel test needs its fourth one-CPU job still
    # pending while two others hang, which holds on a two-CPU node whatever the machine has
    with slurm_cluster.SlurmCluster(cpus=slurm_cluster.TEST_CPUS) as c:
        yield c


def _env(cluster, cwd, **extra: str) -> dict[str, str]:
    # temporary files of memtrain and its jobs in the test's folder: a memtrain killed by a
    # failing test leaves nothing in /tmp
    tmp = cwd / "tmp"
    tmp.mkdir(exist_ok=True)
    return {**cluster.env, **CPU_ONLY, "TMPDIR": str(tmp), **extra}


def _command(cluster, args, cwd, env) -> dict:
    """`memtrain ARGS` through the zygote's stand-in interpreter (`warm_python`): the command is
    forked from the warm interpreter and so is each SLURM job (submitit starts a job with the
    sweep's interpreter, `python -u -m submitit.core._submit`, which the stand-in forks too), a
    job's signals forwarded to it."""
    return dict(args=[warm_python(), "-m", "memtrain", *args], cwd=cwd, text=True,
                env={**_env(cluster, cwd, **(env or {})), "PYTHONUNBUFFERED": "1"})


def _memtrain(cluster, *args: str, cwd, env=None, timeout: float = 600):
    return subprocess.run(**_command(cluster, args, cwd, env), capture_output=True,
                          timeout=timeout)


def _popen(cluster, *args: str, cwd, env=None) -> subprocess.Popen:
    """`memtrain` in the background (the test acts on the cluster meanwhile); as a context
    manager it is killed if the test fails first."""
    return _Killed(**_command(cluster, args, cwd, env), stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE)


class _Killed(subprocess.Popen):
    def __exit__(self, *exc):
        if self.poll() is None:
            self.kill()
        return super().__exit__(*exc)


def _rows(sweep) -> dict[int, dict]:
    return {int(f.parent.name.split("_")[0]): json.loads(f.read_text())
            for f in sweep.glob("*/summary.json")}


def _tasks(cluster, sweep) -> list[dict[str, str]]:
    """The SLURM array tasks this sweep submitted (their output goes to <sweep>/.submitit)."""
    mark = str(sweep / ".submitit")
    return [j for j in cluster.jobs() if j.get("StdOut", "").startswith(mark)]


def _ended(cluster, sweep) -> list[dict[str, str]]:
    """The sweep's tasks once SLURM has closed them all (a job's result is written before its
    processes exit)."""
    active = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED"}

    def closed():
        tasks = _tasks(cluster, sweep)
        return tasks if tasks and not any(t["JobState"] in active for t in tasks) else None

    return cluster.wait_for("the sweep's jobs to end", closed, timeout=120)


def test_sweep_of_three_one_invalid_then_relaunched_with_skip_done(cluster, in_tmp):
    """Three jobs, one invalid: three rows with their statuses, the closing count, report.md;
    every job ran as a task of one SLURM array and ended COMPLETED (a failed run is a row).
    Relaunched with a fourth value and skip_done: the two done jobs are skipped in the launching
    process (rows untouched), only the invalid one and the new one go to SLURM."""
    sweep = in_tmp / "sw"
    common = ["-m", "hydra/launcher=slurm", *TINY, f"hydra.sweep.dir={sweep}"]
    p = _memtrain(cluster, *common, "trainer.batch_size=8,16,0", cwd=in_tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _rows(sweep)
    assert [rows[i]["status"] for i in range(3)] == ["ok", "ok", "error"]
    assert [rows[i]["trainer.batch_size"] for i in range(3)] == [8, 16, 0]
    assert "trainer.batch_size must be in [1, inf], got 0" in rows[2]["error"]
    assert "memtrain: 3 jobs: ok 2, error 1" in p.stdout
    assert "3 runs" in (sweep / "report.md").read_text()
    tasks = _ended(cluster, sweep)
    assert len({t["ArrayJobId"] for t in tasks}) == 1
    assert sorted(t["ArrayTaskId"] for t in tasks) == ["0", "1", "2"]
    assert {t["JobState"] for t in tasks} == {"COMPLETED"}

    first = {t["JobId"] for t in tasks}
    p = _memtrain(cluster, *common, "trainer.batch_size=8,16,0,32", "trainer.skip_done=true",
                  NO_REPORT, cwd=in_tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "memtrain: 4 jobs: ok 3, error 1 (2 skipped: already done)" in p.stdout, p.stdout
    again = _rows(sweep)
    assert [again[i]["status"] for i in range(4)] == ["ok", "ok", "error", "ok"]
    assert again[3]["trainer.batch_size"] == 32
    for i in (0, 1):  # not run again
        assert again[i]["finished_at"] == rows[i]["finished_at"]
    assert again[2]["finished_at"] > rows[2]["finished_at"]  # not done: run again
    new = [t for t in _ended(cluster, sweep) if t["JobId"] not in first]
    assert sorted(t["ArrayTaskId"] for t in new) == ["0", "1"], new  # two jobs on SLURM
    assert {t["JobState"] for t in new} == {"COMPLETED"}


def test_time_limit_requeues_and_resumes_bit_for_bit(cluster, in_tmp):
    """A job longer than its SLURM time limit (a run that hangs until signalled): SLURM signals
    it signal_delay_s before the limit, the run stops after its step with a checkpoint, the job
    is requeued once (max_num_timeout=1) and resumes to the weights of an uninterrupted run."""
    args = [*TINY, "trainer.max_steps=8", "trainer.save_weights=true"]
    sweep = in_tmp / "sw"
    # SLURM counts minutes and looks every 30 s: with a 2-minute limit signalled 50 s before
    # it, the signal comes 40-70 s into the job. The hang is at step 0, so wherever the signal
    # lands the checkpoint is at step 1.
    proc = _popen(cluster, "-m", "hydra/launcher=slurm", *args, "trainer.fault=hang",
                  "trainer.fault_step=0", "trainer.resume=true", "hydra.launcher.timeout_min=2",
                  "hydra.launcher.signal_delay_s=50", NO_REPORT, f"hydra.sweep.dir={sweep}",
                  cwd=in_tmp, env={"MEMTRAIN_SLURM_MAX_NUM_TIMEOUT": "1"})
    with proc:
        requeued = cluster.wait_for("the job to be requeued", lambda: [
            t for t in _tasks(cluster, sweep) if t["Restarts"] == "1"], timeout=400)
        # the requeued job gets a long limit, so that a loaded machine cannot make it miss it
        cluster.run("scontrol", "update", f"JobId={requeued[0]['JobId']}", "TimeLimit=20")
        out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    (task,) = _ended(cluster, sweep)
    assert task["JobState"] == "COMPLETED" and task["Restarts"] == "1", task
    row = _rows(sweep)[0]
    assert row["status"] == "ok" and row["resumed_at_step"] == 1, row
    log = (job_dir(sweep, 0) / "memtrain.log").read_text()
    assert "SIGUSR2 received (the SLURM time limit is near)" in log, log
    assert "Requeued job" in log and "resuming from" in log
    assert not list(sweep.rglob("resume*.pt"))  # a finished run keeps no checkpoint
    threads = torch.get_num_threads()
    try:
        full = api.run(args, out_dir=in_tmp / "full")
    finally:
        torch.set_num_threads(threads)
    assert row["train_loss"] == full["train_loss"]
    ours = torch.load(job_dir(sweep, 0) / "weights.pt", weights_only=True)
    theirs = torch.load(in_tmp / "full" / "weights.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def test_scancel_leaves_rows_and_the_continue_command_resumes_on_slurm(cluster, in_tmp):
    """scancel of an array with two jobs hanging, one done and one pending: interrupted rows
    (the pending one too), the continue command. Run, it is a relaunch with skip_done: it
    queues on SLURM only the three jobs not done, and the interrupted ones resume."""
    sweep = in_tmp / "sw"
    # jobs: 0 hangs, 1 finishes, 2 hangs, 3 (never hangs) waits for a CPU
    args = ["-m", "hydra/launcher=slurm", *TINY, "trainer.max_steps=6", "trainer.fault=hang",
            "trainer.seed=0,1", "trainer.fault_step=0,100", NO_REPORT, f"hydra.sweep.dir={sweep}"]
    def hanging():
        logs = [d / "memtrain.log" for d in sweep.glob("[02]_*")]
        return len(logs) == 2 and all("injecting fault hang" in f.read_text() for f in logs)

    with _popen(cluster, *args, cwd=in_tmp) as proc:
        cluster.wait_for("jobs 0 and 2 to hang", hanging, timeout=400)
        array = _tasks(cluster, sweep)[0]["ArrayJobId"]
        cluster.run("scancel", array)
        out, err = proc.communicate(timeout=400)
    assert proc.returncode == 143, err[-3000:]
    rows = _rows(sweep)
    assert [rows[i]["status"] for i in range(4)] == ["interrupted", "ok", "interrupted",
                                                   "interrupted"]
    assert rows[0]["signal"] == rows[2]["signal"] == "SIGTERM"
    assert "ended CANCELLED without a result" in rows[3]["error"]  # it never started
    assert "memtrain: 4 jobs: ok 1, interrupted 3" in out
    again = shlex.split(err.split("continue with: ")[-1].splitlines()[0])
    assert again[:2] == ["memtrain", "-m"] and "hydra/launcher=slurm" in again
    assert {"trainer.resume=true", "trainer.skip_done=true"} <= set(again)

    done_at = rows[1]["finished_at"]
    p = _memtrain(cluster, *again[1:], cwd=in_tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "memtrain: 4 jobs: ok 4 (1 skipped: already done)" in p.stdout, p.stdout[-2000:]
    rows = _rows(sweep)
    assert [rows[i]["status"] for i in range(4)] == ["ok"] * 4
    assert rows[0]["resumed_at_step"] == rows[2]["resumed_at_step"] == 1
    assert "resumed_at_step" not in rows[3]
    assert rows[1]["finished_at"] == done_at  # not run again
    new = [t for t in _ended(cluster, sweep) if t["ArrayJobId"] != array]
    assert sorted(t["ArrayTaskId"] for t in new) == ["0", "1", "2"]  # on SLURM, three jobs
    assert {t["JobState"] for t in new} == {"COMPLETED"}



@pytest.mark.ranks
@pytest.mark.xdist_group("ranks")
def test_a_sharded_run_is_one_job_of_one_task_per_rank(cluster, in_tmp):
    """`trainer.strategy=ddp trainer.world_size=2` under hydra/launcher=slurm: one SLURM job of
    two tasks, the ranks (gloo between them, through submitit's env:// variables), and one ok
    row, written by the first task alone."""
    sweep = in_tmp / "sw"
    p = _memtrain(cluster, "-m", "hydra/launcher=slurm", *TINY, "trainer.strategy=ddp",
                  "trainer.world_size=2", NO_REPORT, f"hydra.sweep.dir={sweep}", cwd=in_tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _rows(sweep)
    assert list(rows) == [0] and rows[0]["status"] == "ok", rows
    assert rows[0]["world_size"] == 2 and rows[0]["local_batch_size"] == 4
    assert rows[0]["rank_max.mem_params_bytes"] == rows[0]["mem_params_bytes"]
    (task,) = _ended(cluster, sweep)
    assert task["JobState"] == "COMPLETED" and task.get("NumTasks", "2") == "2", task
    assert sorted(p.name for p in job_dir(sweep, 0).iterdir() if not p.name.startswith(".")) \
        == ["memtrain.log", "metrics.csv", "summary.json"]
