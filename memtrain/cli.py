"""The `memtrain` command: overrides checked, Hydra's entry point, exit codes.

The work of a job is `runner.run` (compose -> build -> probes -> train -> record); this module
only turns its `Outcome` into what a shell expects: 0 ok, 1 a run that failed, 2 bad input,
128 + signal for an interrupted run (with the command that continues it).
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig, OmegaConf

from memtrain.config import loader
from memtrain.errors import ConfigError
from memtrain.run import distributed, faults, runner

log = logging.getLogger("memtrain")


def _fail(code: int, message: str) -> NoReturn:
    """Exit with `code` and one line on stderr, in the run's log file too (memtrain.log, once
    Hydra has set it up); of several ranks, rank 0 speaks for the job."""
    if distributed.launched()[0] == 0:
        line = f"memtrain: {message}"
        print(line, file=sys.stderr, flush=True)
        _to_log_files(line)
    sys.exit(code)


def _to_log_files(line: str) -> None:
    """`line` in the files the root logger writes (the run's memtrain.log), not again on the
    console, which has it from stderr already."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
            handler.flush()


def _keep_sigterm() -> None:
    """Rank 0 of a job of several (torchrun): torchrun stops every rank with SIGTERM once one
    has exited, and the other ranks exit at once on bad input or a failure of their own; rank
    0 keeps the signal instead of dying, so it still writes the job's row and says why. The
    signal is not lost: a run that starts after it stops after its first step (a stopped
    sweep's job does the same), and during the run the run's own handler takes it."""
    import signal

    def keep(signum, frame) -> None:
        faults.SweepStop.requested = "SIGTERM"

    signal.signal(signal.SIGTERM, keep)


def _hydra_task(cfg: DictConfig) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    # a launcher's worker process (joblib, submitit): an interrupted job is a row, not an exit
    # that would take the worker pool and its sibling jobs down; the main process ends the sweep
    worker = multirun and faults.SweepStop.install_worker()
    run_dir = Path(hc.runtime.output_dir)
    search = Path(hc.sweep.dir) if multirun else None
    out = runner.run(cfg, run_dir, dict(hc.runtime.choices), search)
    summary, status = out.summary, out.status
    if isinstance(out.error, ConfigError):
        if hc.verbose:
            traceback.print_exception(out.error)
        if multirun:  # the row says status=error; the sweep goes on
            log.error("config error: %s", out.error)
            return {"status": "error", "error": str(out.error)}
        _fail(2, f"error: {out.error}")
    log.info(f"{'skipped (done) ' if summary.get('skipped') else ''}{status}: "
             f"{summary['method']} {summary['model']} {summary['dataset']} "
             f"{(m := summary.get('metric') or 'test_acc')}={summary.get(m, float('nan')):.4f} "
             f"-> {run_dir}"
             + (f" (did not learn: {summary['not_learned_why']})"
                if summary.get("learned") is False else ""))
    if status == "interrupted" and not worker:  # the user or the cluster wants it to stop
        # stopped before its first step (faults.Stopped): no checkpoint, the same command again
        saved = f"checkpoint saved in {run_dir}; " if "failed_step" in summary else ""
        _fail(faults.exit_code(summary.get("signal")),
              f"interrupted ({summary.get('error')}); {saved}continue "
              f"with: {_resume_command(hc, multirun, run_dir)}")
    if not multirun and status != "ok":
        msg = summary.get("error") or (str(out.error) if out.error else status)
        _fail(1, f"run ended with status={status}: {msg} (log: {run_dir / 'memtrain.log'})")
    return summary


def _resume_command(hc, multirun: bool, run_dir: Path) -> str:
    """The command that continues this run (or, for a multirun, the whole sweep)."""
    from memtrain.hydra_callbacks import continue_command

    if multirun:  # the sweep's own overrides (multirun.yaml), not this job's values
        saved = Path(hc.sweep.dir) / "multirun.yaml"
        over = OmegaConf.load(saved).hydra.overrides if saved.is_file() else hc.overrides
        return continue_command(over, hc.sweep.dir)
    return continue_command(hc.overrides, run_dir=run_dir, launcher=_launcher())


def _under_torchrun() -> bool:
    """This process is one rank of several that torchrun (its elastic agent) started."""
    import os

    return distributed.is_launched() and "TORCHELASTIC_RUN_ID" in os.environ


def _launcher() -> list[str]:
    """How this run was started: `memtrain`, or torchrun's command for the same ranks."""
    import os

    if not _under_torchrun():
        return ["memtrain"]
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", distributed.launched()[1]))
    nodes = distributed.launched()[1] // max(1, per_node)
    return ["torchrun", f"--nproc-per-node={per_node}",
            *([f"--nnodes={nodes}"] if nodes > 1 else []), "-m", "memtrain"]


def _as_rank(overrides: list[str]) -> list[str]:
    """Under torchrun every rank composes the config itself, and `${now:...}` in the run folder
    may differ between them. Rank 0 decides the folder (`runner.run` hands its folder to the
    others); the other ranks get a temporary folder of their own for Hydra, no `.hydra/` copy
    of the config and no log file (warnings to their console only), so they write no output."""
    rank = distributed.launched()[0]
    if rank == 0:
        return overrides
    import atexit
    import shutil
    import tempfile

    scratch = tempfile.mkdtemp(prefix=f"memtrain-rank{rank}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    ours = ("hydra.run.dir=", "hydra.output_subdir=", "hydra/job_logging=",
            "hydra.job_logging.")
    return [*[o for o in overrides if not o.startswith(ours)],
            f"hydra.run.dir={scratch}", "hydra.output_subdir=null", "hydra/job_logging=stdout",
            "hydra.job_logging.root.level=WARNING"]


def main() -> None:
    """Console entry point: validate the overrides, then hand over to Hydra.

    The command line is read by Hydra's own argument parser, so its flags (`--cfg`, `-p`,
    `--info`, `--config-dir`, `-sc install=bash`, ...) reach Hydra untouched and only the real
    overrides are checked, on the search path the command gives Hydra.
    """
    import hydra
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(sys.argv[1:])
    if args.help:  # memtrain's own: what it is, its groups, examples (Hydra's: --hydra-help)
        from memtrain.config import groups

        print(groups.help_text())
        return
    if args.package and not args.cfg:  # Hydra reads -p only with --cfg; alone it trained a run
        sys.argv[1:1] = ["--cfg", "job"]
        args.cfg = "job"
    if _under_torchrun() and distributed.launched()[0] == 0:
        _keep_sigterm()
    # -sc's own arguments (install=bash, query=...) and a rerun's pickle are not overrides
    if not (args.shell_completion or args.experimental_rerun):
        try:
            shows = bool(args.cfg or args.info or args.help or args.hydra_help)  # writes nothing
            loader.check_overrides(args.overrides, config_path=args.config_path,
                                   config_dir=args.config_dir, config_name=args.config_name,
                                   multirun=True if args.multirun else None, jobs=not shows)
            if not shows:
                loader.check_default_output_dir(args.overrides, bool(args.multirun),
                                                config_path=args.config_path,
                                                config_dir=args.config_dir,
                                                config_name=args.config_name)
        except ConfigError as e:
            if any(a.startswith("hydra.verbose=") and not a.endswith("=false")
                   for a in args.overrides):
                traceback.print_exc()
            _fail(2, f"error: {e}")
    # after the values are checked: a bad value is named as such, not as a bad launch
    if args.multirun and distributed.is_launched():
        _fail(2, "error: a multirun (-m) under torchrun would run every sweep point in every "
                 "rank at once; sweep with a launcher that starts one job of several ranks per "
                 "point (hydra/launcher=slurm: one task per GPU), or run one torchrun per point")
    if args.multirun:  # SIGTERM stops every job, leaving rows
        faults.SweepStop.install_main()
    if distributed.is_launched() and not (args.cfg or args.info or args.shell_completion):
        given = list(args.overrides)
        sys.argv[1:] = [a for a in sys.argv[1:] if a not in given] + _as_rank(given)
    task = hydra.main(version_base="1.3", config_path=str(loader.conf_dir()),
                      config_name="config")(_hydra_task)
    task()
    from memtrain.hydra_callbacks import StatusCount

    if StatusCount.all_failed:  # after the report and the lock's release
        _fail(1, StatusCount.all_failed)


if __name__ == "__main__":
    main()
