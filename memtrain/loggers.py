"""Where the training loop reports as it goes: the seam for progress bars and live loggers.

The loop calls, for every `train.train` call (a run, or one phase of a multi-phase method):
`start(total_steps, prefix)` once, `step(...)` after every step, `metrics(rows)` for each group of
metric rows as they are made (the same rows metrics.csv gets: step, epoch, split, name, value;
names carry the phase's prefix), and `end()` once, also when the run fails. A logger is any
object with these four methods; the runner builds the list from the trainer options. Loggers
never change what is measured: the loop's records are written by the runner either way.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from memtrain import measure


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
    terminal only: the runner leaves it out when stderr is not a TTY)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bar = None

    def start(self, total_steps: int, prefix: str) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total_steps, dynamic_ncols=True, leave=False, unit="step")

    def step(self, step: int, epoch: int, loss: float, samples_s: float) -> None:
        self._bar.set_postfix_str(f"ep {epoch} loss {loss:.3f} {samples_s:.0f}/s "
                                  f"mem {memory_now(self.device)}", refresh=False)
        self._bar.update()

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        pass

    def end(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
