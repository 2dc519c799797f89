"""Hydra callbacks registered in conf/config.yaml (`hydra.callbacks.*`)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from memtrain.record import SKIPPED, STATUSES, SUMMARY
from memtrain.run.faults import SweepStop

LOCK = ".memtrain-sweep.lock"


def _stamp(job: Path) -> tuple:
    """What a sweep that ran the job folder leaves changed in it (Hydra rewrites
    .hydra/config.yaml; the job its summary, or a skip marker): each file's time and size."""
    out = []
    for f in (job / ".hydra" / "config.yaml", job / SUMMARY, job / SKIPPED):
        try:
            st = f.stat()
        except OSError:
            out.append(None)
            continue
        out.append((st.st_mtime_ns, st.st_size))
    return tuple(out)


def _jobs(sweep_dir: Path) -> set[Path]:
    return {p.parent for name in (".hydra", SUMMARY, SKIPPED) for p in sweep_dir.rglob(name)}


def job_stamps(sweep_dir: Path) -> dict[Path, tuple]:
    """The job folders below sweep_dir as they are now (`count_statuses(..., before=)`)."""
    return {j: _stamp(j) for j in _jobs(sweep_dir)}


def count_statuses(sweep_dir: Path, before: dict[Path, tuple] | None = None
                   ) -> tuple[Counter, int]:
    """(jobs per status, jobs skipped as already done) over the run folders below sweep_dir;
    with `before` (`job_stamps` when the sweep started), only the folders written since (this
    sweep's, not an earlier one's in the same folder, however shortly before it ended).

    A folder with neither a readable summary.json nor a skip marker is a job that died without a
    record (killed hard, or the node lost): counted as `missing`.
    """
    counts: Counter = Counter()
    skipped = 0
    jobs = _jobs(sweep_dir)
    if before is not None:
        jobs = {j for j in jobs if before.get(j) != _stamp(j)}
    for job in sorted(jobs):
        if (job / SKIPPED).is_file():
            skipped += 1
            if not (job / SUMMARY).is_file():
                counts["ok"] += 1
                continue
        try:
            status = json.loads((job / SUMMARY).read_text(encoding="utf-8")).get("status")
        except (OSError, ValueError, AttributeError):
            status = "missing"
        counts[status or "missing"] += 1
    return counts, skipped


def format_counts(counts: Counter, skipped: int = 0) -> str:
    order = [s for s in STATUSES if counts[s]] + sorted(set(counts) - set(STATUSES))
    parts = ", ".join(f"{s} {counts[s]}" for s in order) or "no records"
    extra = f" ({skipped} skipped: already done)" if skipped else ""
    return f"memtrain: {sum(counts.values())} jobs: {parts}{extra}"


class StatusCount(Callback):
    """Prints one closing line per multirun: how many jobs ended with each status.

    Reads the jobs' summary.json files, so it works with every launcher (the jobs may have run
    in other processes or on other machines)."""

    # set at the end of a multirun whose every job failed: the CLI then exits 1 (a script or a
    # scheduler checking the status must not read success), after every callback has run
    all_failed: str | None = None

    def __init__(self) -> None:
        self.before: dict[Path, tuple] | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # the folders of earlier sweeps into the same folder, as they are: not this sweep's
        self.before = job_stamps(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        counts, skipped = count_statuses(sweep_dir, self.before)
        print(format_counts(counts, skipped), flush=True)
        if sum(counts.values()) and not counts["ok"]:
            StatusCount.all_failed = f"every job of the sweep failed; their rows are in {sweep_dir}"
        # jobs in worker processes (hydra/launcher=parallel, local) return interrupted rows
        # instead of exiting; the sweep as a whole ends here, as the basic launcher's would
        stop = SweepStop.requested
        if stop or counts["interrupted"]:
            print(f"memtrain: interrupted ({stop or 'a job was stopped'}); checkpoints saved in "
                  f"{sweep_dir}; continue with: "
                  f"{continue_command(config.hydra.overrides, str(sweep_dir))}",
                  file=sys.stderr, flush=True)
            sys.exit(128 + (2 if stop == "SIGINT" else 15))


# characters Hydra's override grammar reads as syntax in an unquoted value (a sweep's comma, a
# function call's parentheses, a list, a dict, an interpolation, quotes, escapes, spaces)
_HYDRA_SPECIAL = set("()[]{},=:'\"\\ $*?<>|&;#`!~\t")


def hydra_quote(value: str) -> str:
    """A value as one Hydra override value: quoted when Hydra would read syntax in it (a run
    folder named `a(b),c` is otherwise a sweep of a function call); the shell's quoting comes on
    top (shlex)."""
    if not set(value) & _HYDRA_SPECIAL:
        return value
    # inside quotes Hydra reads a backslash as an escape only before a quote (or the closing one)
    body = re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), value)
    return f"'{body}'"


def continue_command(overrides: DictConfig, sweep_dir: str | None = None,
                     run_dir: str | os.PathLike | None = None,
                     launcher: list[str] | None = None) -> str:
    """The shell command that continues a sweep (or a single run): its task overrides and its
    hydra ones (launcher, hydra.launcher.*, callbacks), then resume and skip_done; shell-quoted.
    `launcher`: the command's start (`memtrain`, or torchrun's for a run of several ranks).
    """
    if sweep_dir is not None:
        extra = ["trainer.resume=true", "trainer.skip_done=true",
                 f"hydra.sweep.dir={hydra_quote(str(sweep_dir))}"]
    else:
        extra = ["trainer.resume=true", f"hydra.run.dir={hydra_quote(str(run_dir))}"]
    dropped = {e.split("=")[0] for e in extra} | {"hydra.mode"}
    given = [*overrides.get("hydra", []), *overrides.get("task", [])]
    kept = [o for o in given if o.split("=")[0].lstrip("+~") not in dropped]
    words = [*(launcher or ["memtrain"]), *(["-m"] if sweep_dir is not None else []), *kept,
             *extra]
    return shlex.join(words)


def sweep_size(config: DictConfig) -> int | None:
    """How many jobs the multirun of `config` launches, counted as the basic and the variants
    sweepers expand them (`hydra.sweeper.params`, then the command's overrides, per variant);
    None for a sweep counted otherwise (another sweeper's own search)."""
    from memtrain.config.loader import _sweep_jobs

    sweeper = config.hydra.sweeper
    if not str(sweeper.get("_target_", "")).endswith(("BasicSweeper", "VariantSweeper")):
        return None
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    common = params + list(config.hydra.overrides.task)
    try:
        return sum(1 for _ in _sweep_jobs(common, [str(v) for v in sweeper.get("variants") or []]))
    except Exception:  # the sweeper reports its own errors; progress is only a courtesy
        return None


class JobProgress(Callback):
    """Prints `memtrain: job i/n -> <job folder>` as each job of a multirun starts, so a sweep
    (`make run`'s among them) shows where it is between the jobs' own progress lines."""

    def __init__(self) -> None:
        self.total: int | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.total = sweep_size(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        num = config.hydra.job.get("num")
        of = f"/{self.total}" if self.total else ""
        where = Path(str(config.hydra.runtime.output_dir)).name
        print(f"memtrain: job {int(num) + 1}{of} -> {where}", flush=True)


class SweepLock(Callback):
    """One sweep at a time per sweep folder: a second one started while the first runs is
    refused in one line (exit 2) before it writes anything there. The lock is an flock, so a
    killed sweep frees the folder; a relaunch after it ends is welcome."""

    def __init__(self) -> None:
        self._fd: int | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(sweep_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            print(f"memtrain: error: sweep folder {sweep_dir} is in use by another sweep "
                  f"(pid {owner}); wait for it to end or choose another hydra.sweep.dir",
                  file=sys.stderr, flush=True)
            sys.exit(2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


class ProbeCheck(Callback):
    """A single run whose probes cannot work here (`probes.check`: find_max_batch on the CPU
    without a cap) stops with one line and exit status 2 before Hydra makes its run folder
    (`on_run_start` sees the composed config, user presets included). Other problems of the
    trainer options are left to the job, which records them in its row."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from memtrain.config.schema import Trainer
        from memtrain.errors import ConfigError
        from memtrain.run import probes

        try:
            t = Trainer.from_config(config.trainer)
        except Exception:  # the job reports it, with its row
            return
        try:
            probes.check(t)
        except ConfigError as e:
            print(f"memtrain: error: {e}", file=sys.stderr)
            sys.exit(2)
