"""Where the training loop reports as it goes: the seam for progress bars and live loggers.

The loop calls, for every `train.train` call (a run, or one phase of a multi-phase method):
`start(total_steps, prefix)` once, `step(...)` after every step, `metrics(rows)` for each group of
metric rows as they are made (the same rows metrics.csv gets: step, epoch, split, name, value;
names carry the phase's prefix), and `end()` once, also when the run fails. A logger subclasses
`Logger`, whose four hooks do nothing, and overrides those it uses; the runner builds the list
from the trainer options (`build`) and, once the run's row is final (any status), calls
`close(row)` on those that have it (TensorBoard's hparams and W&B's summary take the row's final
metrics there).
Loggers never change what is measured: the loop's records are written by the runner either way
(metrics.csv is rewritten whole, atomically, when the run ends).

The train rows of a logged step carry, beside loss and lr, the run's memory and throughput as
series (`measure.Measurement.series`): `samples_s` (the steps timed since the previous logged
step), `mem_peak_alloc_bytes` (the CUDA allocator's peak over the timed steps, or the CPU
tracker's peak of the accounting step: the row's column, its value so far), on CUDA
`mem_peak_reserved_bytes` and `mem_alloc_bytes` (allocated now), and `mem_peak_rss_bytes`.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from memtrain import columns
from memtrain.config.schema import LOGGERS  # trainer.logger's valid values
from memtrain.errors import ConfigError, check_choice
from memtrain.record import METRIC_FIELDS, METRICS

log = logging.getLogger("memtrain")
MemoryNow = Callable[[], dict[str, int]]  # measure.Measurement.memory_now
# the row's final metrics that TensorBoard's hparams and W&B's summary carry (those it has)
FINAL_METRICS = ("test_acc", "test_acc5", "test_loss", "train_loss", "learned",
                 columns.PEAK, columns.ACT_TEMP_PEAK, columns.ACT_PEAK, columns.SAVED,
                 columns.THROUGHPUT, columns.STEP_TIME, columns.ESTIMATE, columns.MAX_BATCH)


class Logger:
    """What the loop tells its loggers; each hook here does nothing."""

    def start(self, total_steps: int, prefix: str) -> None:
        """Before the first step of a `train` call: its steps and its metrics' name prefix."""

    def step(self, step: int, epoch: int, loss: float, samples_s: float,
             memory: MemoryNow) -> None:
        """After step `step` (counted from 1) of `epoch`: its loss, the samples per second of
        the last timed step (NaN before the first one) and a function giving the memory
        series now (`measure.Measurement.memory_now`; called only by loggers that show it)."""

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        """A group of metric rows as they are made (metrics.csv's rows)."""

    def end(self) -> None:
        """After the last step, also when the run fails."""


def _size(n: float) -> str:
    return f"{n / 2**30:.2f}G" if n >= 2**30 else f"{n / 2**20:.1f}M"


def memory_text(mem: Mapping[str, int], device: torch.device) -> str:
    """What a progress line says of memory, each figure named: the peak (CUDA's allocator over
    the timed steps, or the CPU allocator's peak of the accounting step, the row's
    `mem_peak_alloc_bytes`), on CUDA what is allocated now, and the process's peak RSS."""
    parts = []
    if columns.PEAK in mem:
        parts.append(f"{_size(mem[columns.PEAK])} peak "
                     f"({'cuda' if device.type == 'cuda' else device.type})")
    if "mem_alloc_bytes" in mem:
        parts.append(f"{_size(mem['mem_alloc_bytes'])} allocated")
    parts.append(f"{_size(mem['mem_peak_rss_bytes'])} rss")
    return ", ".join(parts)


class ProgressBar(Logger):
    """A tqdm bar per train() call with loss, samples/s and memory (`trainer.progress`, on a
    terminal only: `build` leaves it out when stderr is not a TTY)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bar = None

    def start(self, total_steps: int, prefix: str) -> None:
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(total=total_steps, dynamic_ncols=True, leave=False, unit="step")
        # log lines (ProgressLines among them) print above the bar instead of through it
        self._redirect = logging_redirect_tqdm()
        self._redirect.__enter__()

    def step(self, step: int, epoch: int, loss: float, samples_s: float,
             memory: MemoryNow) -> None:
        self._bar.set_postfix_str(f"ep {epoch} loss {loss:.3f} {samples_s:.0f}/s "
                                  f"mem {memory_text(memory(), self.device)}", refresh=False)
        self._bar.update()

    def end(self) -> None:
        if self._bar is not None:
            self._redirect.__exit__(None, None, None)
            self._bar.close()
            self._bar = None


class ProgressLines(Logger):
    """One log line every `every` steps (and on the last): step, loss, samples/s and memory
    (`memory_text`: the peak, and the process's RSS, each named).
    Through logging, so it reaches memtrain.log and the console however they are redirected
    (SLURM logs, nohup), where a progress bar draws nothing."""

    def __init__(self, device: torch.device, every: int):
        self.device, self.every = device, every
        self.total, self.prefix = 0, ""

    def start(self, total_steps: int, prefix: str) -> None:
        self.total, self.prefix = total_steps, prefix

    def step(self, step: int, epoch: int, loss: float, samples_s: float,
             memory: MemoryNow) -> None:
        if step % self.every and step != self.total:
            return
        rate = "-" if math.isnan(samples_s) else f"{samples_s:.0f}"
        log.info("%sstep %d/%d epoch %d loss %.4f samples/s %s mem %s", self.prefix, step,
                 self.total, epoch, loss, rate, memory_text(memory(), self.device))


class CsvLog(Logger):
    """metrics.csv as training goes: rows appended and flushed as they are made, so a killed
    run leaves every row made so far, each line whole (the runner's final atomic write replaces
    the file with the complete records)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS
        with open(self.path, "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerow(METRIC_FIELDS)

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        with open(self.path, "a", newline="") as f:  # closed (so flushed) after every group
            csv.DictWriter(f, METRIC_FIELDS, extrasaction="ignore",
                           lineterminator="\n").writerows(rows)


def hparams_of(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's config as hyperparameters: its identity and config columns (the chosen
    options, every option flattened), in the types TensorBoard and W&B take (None left out)."""
    out = {}
    for k, v in row.items():
        col = columns.lookup(k)
        if col is not None and col.kind in ("identity", "config") and v is not None:
            out[k] = v if isinstance(v, (bool, int, float, str)) else str(v)
    return out


def final_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's final metrics (FINAL_METRICS, those it holds as finite numbers)."""
    out = {}
    for k in FINAL_METRICS:
        v = row.get(k)
        if isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


def _summary_writer():
    """torch.utils.tensorboard's SummaryWriter; a one-line ConfigError when tensorboard (an
    optional dependency) is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("trainer.logger=tensorboard needs the tensorboard package: pip install "
                          "'memtrain[tensorboard]' (or pip install tensorboard), or use "
                          "trainer.logger=csv") from None
    return SummaryWriter


class TensorBoard(Logger):
    """The metric rows as TensorBoard scalars (`<split>/<name>` at their step, the names of
    metrics.csv: memory and samples/s among them) in `<run_dir>/tensorboard`; when the row is
    final (`close`), the run's hyperparameters (`hparams_of`) with its final metrics
    (`final/<column>` scalars) through TensorBoard's hparams plugin, as Lightning's
    TensorBoardLogger writes them: the HPARAMS tab compares the runs of a sweep."""

    def __init__(self, run_dir: Path):
        self.writer = _summary_writer()(log_dir=str(Path(run_dir) / "tensorboard"))
        self.last_step = 0

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.writer.add_scalar(f"{r['split']}/{r['name']}", r["value"], r["step"])
            self.last_step = max(self.last_step, int(r["step"]))

    def end(self) -> None:
        self.writer.flush()

    def close(self, row: Mapping[str, Any] | None = None) -> None:
        if row is not None:
            from torch.utils.tensorboard.summary import hparams

            final = {f"final/{k}": v for k, v in final_metrics(row).items()}
            params = {**hparams_of(row), "status": str(row.get("status", ""))}
            fw = self.writer._get_file_writer()  # the run's own event file (no sub-folder)
            for summary in hparams(params, final):
                fw.add_summary(summary)
            for k, v in final.items():
                self.writer.add_scalar(k, v, self.last_step)
        self.writer.close()


def _wandb():
    """The wandb package; a one-line ConfigError when it is not installed."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("trainer.logger=wandb needs the wandb package: pip install "
                          "'memtrain[wandb]' (or pip install wandb), or use "
                          "trainer.logger=csv") from None
    return wandb


class WandB(Logger):
    """Weights & Biases, offline unless the user says otherwise: `WANDB_MODE` as set, else
    `offline` (the run lives in `<run_dir>/wandb/offline-run-*`, no network needed; `wandb sync`
    uploads it later). The run's config is the row's hyperparameters (`hparams_of`), each
    metric row a logged value (`<split>/<name>`, memory and samples/s among them); when the row
    is final (`close`) its final metrics and status go to the run's summary. W&B's step only
    grows, so a method's phases (each a `train` call counting from 0) follow one another:
    the W&B step is the phase's first step plus memtrain's, which each entry also logs as
    `<prefix>step`. `WANDB_PROJECT` names the project (default memtrain)."""

    def __init__(self, run_dir: Path, hparams: Mapping[str, Any]):
        wandb = _wandb()
        run_dir = Path(run_dir)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "memtrain"), dir=str(run_dir),
            name=run_dir.name, config=dict(hparams), mode=os.environ.get("WANDB_MODE", "offline"),
            reinit="create_new")
        self.base = self.next_base = 0
        self.prefix = ""

    def start(self, total_steps: int, prefix: str) -> None:
        self.base, self.prefix = self.next_base, prefix

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        by_step: dict[int, dict[str, Any]] = {}
        for r in rows:
            s = int(r["step"])
            by_step.setdefault(s, {f"{self.prefix}step": s})[f"{r['split']}/{r['name']}"] = \
                r["value"]
        for s, values in sorted(by_step.items()):
            self.run.log(values, step=self.base + s)
            self.next_base = max(self.next_base, self.base + s + 1)

    def close(self, row: Mapping[str, Any] | None = None) -> None:
        if row is not None:
            self.run.summary.update({**final_metrics(row), "status": row.get("status", "")})
        self.run.finish(exit_code=0 if row is None or row.get("status") == "ok" else 1)


def check(logger: str) -> None:
    """trainer.logger is a known logger whose package is installed (before training)."""
    check_choice("trainer.logger", logger, LOGGERS)
    if logger == "tensorboard":
        _summary_writer()
    if logger == "wandb":
        _wandb()


def build(trainer, device: torch.device, run_dir: Path, tty: bool,
          hparams: Mapping[str, Any] | None = None) -> list[Logger]:
    """The loggers a run's trainer options ask for: metrics.csv always (with tensorboard or
    wandb beside it, as `trainer.logger` says; `hparams`: the run's config, `hparams_of` its
    row); with `trainer.progress`, lines every `trainer.log_every` steps and, on a terminal, a
    bar."""
    out: list[Logger] = [CsvLog(run_dir)]
    if trainer.logger == "tensorboard":
        out.append(TensorBoard(run_dir))
    if trainer.logger == "wandb":
        out.append(WandB(run_dir, hparams or {}))
    if trainer.progress:
        out.append(ProgressLines(device, trainer.log_every))
        if tty:
            out.append(ProgressBar(device))
    return out
