"""Where the training loop reports as it goes: the seam for progress bars and live loggers.

The loop calls, for every `train.train` call (a run, or one phase of a multi-phase method):
`start(total_steps, prefix)` once, `step(...)` after every step, `metrics(rows)` for each group of
metric rows as they are made (the same rows metrics.csv gets: step, epoch, split, name, value;
names carry the phase's prefix), and `end()` once, also when the run fails. A logger is any
object with these four methods; the runner builds the list from the trainer options (`build`).
Loggers never change what is measured: the loop's records are written by the runner either way
(metrics.csv is rewritten whole, atomically, when the run ends).
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any, Protocol

import torch

from memtrain import measure
from memtrain.errors import ConfigError, check_choice
from memtrain.record import METRIC_FIELDS, METRICS

log = logging.getLogger("memtrain")
LOGGERS = ("csv", "tensorboard")  # trainer.logger


class Logger(Protocol):
    def start(self, total_steps: int, prefix: str) -> None: ...

    def step(self, step: int, epoch: int, loss: float, samples_s: float) -> None:
        """After step `step` (counted from 1) of `epoch`: its loss, and the samples per second of
        the last timed step (NaN before the first one)."""
        ...

    def metrics(self, rows: list[dict[str, Any]]) -> None: ...

    def end(self) -> None: ...


def memory_now(device: torch.device) -> str:
    """The memory figure a progress line shows: the CUDA peak so far, or the process's RSS."""
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f}G"
    return f"{measure.peak_rss_bytes() / 2**30:.2f}G rss"


class ProgressBar:
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

    def step(self, step: int, epoch: int, loss: float, samples_s: float) -> None:
        self._bar.set_postfix_str(f"ep {epoch} loss {loss:.3f} {samples_s:.0f}/s "
                                  f"mem {memory_now(self.device)}", refresh=False)
        self._bar.update()

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        pass

    def end(self) -> None:
        if self._bar is not None:
            self._redirect.__exit__(None, None, None)
            self._bar.close()
            self._bar = None


class ProgressLines:
    """One log line every `every` steps (and on the last): step, loss, samples/s and memory.
    Through logging, so it reaches memtrain.log and the console however they are redirected
    (SLURM logs, nohup), where a progress bar draws nothing."""

    def __init__(self, device: torch.device, every: int):
        self.device, self.every = device, every
        self.total, self.prefix = 0, ""

    def start(self, total_steps: int, prefix: str) -> None:
        self.total, self.prefix = total_steps, prefix

    def step(self, step: int, epoch: int, loss: float, samples_s: float) -> None:
        if step % self.every and step != self.total:
            return
        rate = "-" if math.isnan(samples_s) else f"{samples_s:.0f}"
        log.info("%sstep %d/%d epoch %d loss %.4f samples/s %s mem %s", self.prefix, step,
                 self.total, epoch, loss, rate, memory_now(self.device))

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        pass

    def end(self) -> None:
        pass


class CsvLog:
    """metrics.csv as training goes: rows appended and flushed as they are made, so a killed
    run leaves every row made so far, each line whole (the runner's final atomic write replaces
    the file with the complete records)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS
        with open(self.path, "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerow(METRIC_FIELDS)

    def start(self, total_steps: int, prefix: str) -> None:
        pass

    def step(self, step: int, epoch: int, loss: float, samples_s: float) -> None:
        pass

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        with open(self.path, "a", newline="") as f:  # closed (so flushed) after every group
            csv.DictWriter(f, METRIC_FIELDS, extrasaction="ignore",
                           lineterminator="\n").writerows(rows)

    def end(self) -> None:
        pass


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


class TensorBoard:
    """The metric rows as TensorBoard scalars (`<split>/<name>` at their step, the names of
    metrics.csv) in `<run_dir>/tensorboard`."""

    def __init__(self, run_dir: Path):
        self.writer = _summary_writer()(log_dir=str(Path(run_dir) / "tensorboard"))

    def start(self, total_steps: int, prefix: str) -> None:
        pass

    def step(self, step: int, epoch: int, loss: float, samples_s: float) -> None:
        pass

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.writer.add_scalar(f"{r['split']}/{r['name']}", r["value"], r["step"])

    def end(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def check(logger: str) -> None:
    """trainer.logger is a known logger whose package is installed (before training)."""
    check_choice("trainer.logger", logger, LOGGERS)
    if logger == "tensorboard":
        _summary_writer()


def build(trainer, device: torch.device, run_dir: Path, tty: bool) -> list[Logger]:
    """The loggers a run's trainer options ask for: metrics.csv always (with tensorboard beside
    it for `trainer.logger=tensorboard`); with `trainer.progress`, lines every
    `trainer.log_every` steps and, on a terminal, a bar."""
    out: list[Logger] = [CsvLog(run_dir)]
    if trainer.logger == "tensorboard":
        out.append(TensorBoard(run_dir))
    if trainer.progress:
        out.append(ProgressLines(device, trainer.log_every))
        if tty:
            out.append(ProgressBar(device))
    return out
