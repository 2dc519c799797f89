"""memtrain's submitit launchers: `hydra/launcher=slurm` and `hydra/launcher=local`.

A Hydra plugin (Hydra takes launchers only from the hydra_plugins namespace): the source lives
in memtrain/hydra_plugins/ and installs as `hydra_plugins.memtrain_launcher` (pyproject.toml).
Its presets, `local`, `parallel` (Hydra's joblib launcher) and `slurm`, are in Hydra's
ConfigStore (presets.py), so they and the launchers work in any Hydra app. Hydra's plugin scan
imports this module in every Hydra app at startup: memtrain's own modules are imported where a
launcher needs them.

Hydra's submitit launchers, plus what a sweep on a real cluster needs (each found on a real
SLURM scheduler, tests/test_slurm.py):

- A job that `trainer.skip_done` would skip is not submitted: it is skipped in the launching
  process (the job's own code path, so the same marker and count), and a relaunched sweep queues
  only what is not done.
- A job that ends without a result (cancelled while pending, killed, its node lost) becomes a
  row, `interrupted` (SLURM stopped it: a relaunch continues it) or `error`, instead of
  submitit's UncompletedJobError, which ended the sweep with a traceback: no closing count, no
  report, no continue command.
- (SLURM) The signal that SLURM sends `signal_delay_s` before the time limit (submitit's USR2)
  stops the run at the end of its step with a checkpoint, as SIGTERM does, instead of submitit
  requeueing from inside the step (which kept only the last `save_every` checkpoint, or none).
  Once the row is written, submitit's own handler requeues the job while
  `hydra.launcher.max_num_timeout` allows; the requeued job resumes with `trainer.resume=true`.
  Past that, the row stays `interrupted` and the sweep prints its continue command.
- (SLURM) A sharded run (`trainer.strategy=ddp|fsdp`) is one job of one task per rank
  (the slurm preset's `tasks_per_node`, presets.py); in each task `as_rank` exports torch's
  env:// variables (submitit's) and keeps every task but the first out of the job's folder.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import shutil
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.memtrain_launcher import presets  # noqa: F401 (registers the presets)
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

log = logging.getLogger(__name__)

# how a job that left no result ended: SLURM (or the local executor) stopped it, so a relaunch
# continues it; any other state (FAILED, OUT_OF_MEMORY, ...) is an error
STOPPED = ("CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
           "REQUEUED", "INTERRUPTED")


class _Sweep:
    """What memtrain adds to Hydra's BaseSubmititLauncher (mixed in before it)."""

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        started = time.time() - 1.0  # file times may be a little coarse
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        returns: dict[int, JobReturn] = {}
        todo: dict[int, tuple[list[str], DictConfig]] = {}
        done: dict[Path, dict[str, Path]] = {}  # search folder -> run_id -> folder (read once)
        for num, overrides in enumerate(job_overrides, initial_job_idx):
            cfg = self._job_config(overrides, num)
            if _done(cfg, sweep_dir, done):
                log.info("\t#%d : %s (done: not submitted)", num,
                         " ".join(filter_overrides(overrides)))
                returns[num] = self._run_here(cfg)
            else:
                todo[num] = (list(overrides), cfg)
        if todo:
            jobs = self._submit(todo, sweep_dir)
            _wait(jobs)
            for (num, (_, cfg)), job in zip(todo.items(), jobs):
                returns[num] = self._result(job, cfg, started)
        return [returns[num] for num in sorted(returns)]

    def _job_config(self, overrides, num: int) -> DictConfig:
        """The job's config as its own process composes it (sweep dir and subdir included)."""
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = num
            cfg.hydra.job.id = f"{num}"
        return cfg

    def _run_here(self, cfg: DictConfig) -> JobReturn:
        """A done job runs its skip path in this process (as Hydra's basic launcher runs jobs):
        marker and log in its folder, no training, nothing queued."""
        ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                      config=cfg, job_dir_key="hydra.sweep.dir",
                      job_subdir_key="hydra.sweep.subdir")
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return ret

    def _submit(self, todo: dict[int, tuple[list[str], DictConfig]], sweep_dir: Path) -> list:
        """One job array (submitit's map_array), each job keeping its number in the sweep."""
        import submitit

        params = dict(self.params)
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in shared else f"{self._EXECUTOR}_{k}": v
                                      for k, v in params.items()})
        log.info("Submitit '%s' sweep output dir : %s", self._EXECUTOR, sweep_dir)
        args = []
        for num, (overrides, _) in todo.items():
            log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
            args.append((overrides, "hydra.sweep.dir", num, f"job_id_for_{num}",
                         Singleton.get_state()))
        try:  # submitit prints a refused submission's stderr; its reason goes in our one line
            with contextlib.redirect_stderr(io.StringIO()):
                return executor.map_array(self, *zip(*args))
        except submitit.core.utils.FailedJobError as e:  # sbatch refused: nothing was queued
            _no_submission(sweep_dir, self._EXECUTOR, str(e))

    def _result(self, job, cfg: DictConfig, started: float) -> JobReturn:
        """The job's JobReturn; a job that left none gets a row (see the module docstring)."""
        if job.paths.result_pickle.exists() or job.paths.stdout.exists():
            try:  # a job that ran: its result, or (killed) submitit's wait for one, then why
                return job.results()[0]
            except Exception as e:  # UncompletedJobError, FailedJobError
                reason = str(e).splitlines()[0]
        else:
            reason = "it never started"
        from memtrain import record

        run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        task = _task_config(cfg)
        summary = run_dir / record.SUMMARY
        if summary.is_file() and summary.stat().st_mtime >= started:
            row = record.read_summary(run_dir)  # the job recorded itself, then died
        else:
            row = _lost_row(task, cfg, run_dir, _state(job), f"job {job.job_id}: {reason}")
        log.warning("job #%s (%s) left no result: its row says status=%s (%s)",
                    cfg.hydra.job.num, job.job_id, row.get("status"), run_dir)
        ret = JobReturn(overrides=list(cfg.hydra.overrides.task), cfg=task, hydra_cfg=cfg,
                        working_dir=str(run_dir), task_name=str(cfg.hydra.job.name),
                        status=JobStatus.COMPLETED)
        ret.return_value = row
        return ret


def _done(cfg: DictConfig, sweep_dir: Path, cache: dict[Path, dict[str, Path]]) -> bool:
    """With `trainer.skip_done`, whether the job's run_id already finished ok where it looks
    (an app without memtrain's trainer options: never)."""
    try:
        t = cfg.get("trainer")
        if not OmegaConf.is_config(t) or not t.get("skip_done"):
            return False
        from memtrain.config import loader
        from memtrain.run import resume

        root = Path(t.search_dir or sweep_dir)
        rid = loader.run_id(cfg)
    except OmegaConfBaseException:  # an unresolvable value: the job runs, its row says why
        return False
    if root not in cache:
        cache[root] = resume.done_runs(root)
    return rid in cache[root]


def _wait(jobs: list) -> None:
    """Until every job has ended (a result, or a final state from the scheduler). Asking is
    cheap: a local job's process is polled, and submitit's SLURM watcher asks sacct at its own
    pace and answers from what it knows meanwhile."""
    pending = list(jobs)
    while pending:
        pending = [j for j in pending if not j.done()]
        if pending:
            time.sleep(0.25)


def _state(job) -> str:
    try:
        return (job.state or "UNKNOWN").split()[0]  # sacct says "CANCELLED by 0"
    except Exception:
        return "UNKNOWN"


def _task_config(cfg: DictConfig) -> DictConfig:
    task = copy.deepcopy(cfg)
    with open_dict(task):
        del task["hydra"]
    return task


def _lost_row(task: DictConfig, cfg: DictConfig, run_dir: Path, state: str,
              why: str) -> dict[str, Any]:
    """The row of a job that ended without recording one: what it is, how it ended."""
    from memtrain import record
    from memtrain.config import loader

    choices = dict(cfg.hydra.runtime.choices)
    try:
        row = loader.identity(task, choices)
    except OmegaConfBaseException:  # an interpolation that cannot be resolved: as written
        row = loader.identity(task, choices, resolve=False)
    status = "interrupted" if state in STOPPED else "error"
    row.update(status=status, error=f"ended {state} without a result ({why})",
               test_acc=float("nan"), test_acc5=float("nan"), run_dir=str(run_dir),
               finished_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / record.METRICS).is_file():
        record.write_metrics(run_dir, [])
    record.write_summary(run_dir, row)
    return row


class TimeLimit:
    """In a SLURM job: submitit's signal (USR2, `signal_delay_s` before the time limit) stops
    the run at the end of its step with a checkpoint; `requeue()` then hands it to submitit."""

    def __init__(self) -> None:
        import submitit

        self.sig = getattr(signal, f"SIG{submitit.JobEnvironment.USR_SIG}")
        self.hit = False
        self.submitit_handler: Any = None

    def __enter__(self) -> TimeLimit:
        self.submitit_handler = signal.signal(self.sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        from memtrain.run import faults

        self.hit = True
        name = signal.Signals(signum).name
        run = faults.StopSignals.active
        if run is not None:
            run.request(name, " (the SLURM time limit is near)")
        else:  # before the run started: it stops after its first step
            faults.SweepStop.requested = name
            log.warning("%s received (the SLURM time limit is near) before the run started",
                        name)

    def __exit__(self, *exc) -> None:
        signal.signal(self.sig, self.submitit_handler)

    def requeue(self) -> None:
        """submitit's handler: requeue the job and exit while max_num_timeout allows; past
        that it says why not and the job ends with its `interrupted` row."""
        if not callable(self.submitit_handler):
            return
        try:
            self.submitit_handler(self.sig, None)
        except Exception as e:  # UncompletedJobError: timed out too many times
            log.warning("not requeued: %s", e)


def _no_submission(sweep_dir: Path, executor: str, error: str) -> NoReturn:
    """The scheduler refused the job array (no SLURM configured here, a bad partition): one
    line, exit 2, and no sweep folder left that holds nothing but Hydra's multirun.yaml."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    why = next((ln for ln in reversed(lines) if "fatal" in ln or "error" in ln),
               lines[-1] if lines else "no reason given")
    leftovers = {sweep_dir / n for n in ("multirun.yaml", ".submitit", ".memtrain-sweep.lock")}
    if sweep_dir.is_dir() and set(sweep_dir.iterdir()) <= leftovers:
        shutil.rmtree(sweep_dir, ignore_errors=True)
    print(f"memtrain: error: hydra/launcher={executor}: the scheduler refused the jobs ({why}); "
          f"run on a {executor.upper()} login node, or use hydra/launcher=local", file=sys.stderr,
          flush=True)
    sys.exit(2)


def as_rank(sweep_overrides: list[str]) -> list[str]:
    """In a SLURM task of a job of several (trainer.strategy=ddp|fsdp: one task per GPU): the
    environment torch.distributed's env:// rendezvous reads (submitit's; every task sees every
    GPU of its node and takes its local rank's), and for the tasks but the first, overrides
    that keep Hydra from writing into the job's folder (rank 0 writes the row, the log and
    .hydra/; the others warn on their console)."""
    import submitit

    env = submitit.JobEnvironment()
    if env.num_tasks <= 1:
        return list(sweep_overrides)
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    if env.num_nodes == 1:  # every rank on this node: the loopback, whatever names resolve
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    if env.global_rank == 0:
        return list(sweep_overrides)
    ours = ("hydra.output_subdir=", "hydra/job_logging=", "hydra.job_logging.")
    return [*[o for o in sweep_overrides if not o.startswith(ours)],
            "hydra.output_subdir=null", "hydra/job_logging=stdout",
            "hydra.job_logging.root.level=WARNING"]


class SlurmLauncher(_Sweep, submitit_launcher.SlurmLauncher):
    """`hydra/launcher=slurm` (presets.SlurmConf)."""

    def __call__(self, sweep_overrides, *args, **kwargs) -> JobReturn:  # in the SLURM job
        with TimeLimit() as limit:
            ret = super().__call__(as_rank(sweep_overrides), *args, **kwargs)
        value = ret._return_value if ret.status == JobStatus.COMPLETED else None
        if limit.hit and isinstance(value, dict) and value.get("status") == "interrupted":
            limit.requeue()
        return ret


class LocalLauncher(_Sweep, submitit_launcher.LocalLauncher):
    """`hydra/launcher=local` (presets.LocalConf)."""
