"""torch's CUDA allocator history, one recorder per process.

`torch.cuda.memory._record_memory_history` is process-wide: a second caller that switched it on
and off again would end the first one's recording. `History` is the one switch memtrain uses:
every user holds it (`hold`) and lets go (`release`); recording starts with the first holder
and stops with the last, so `trainer.memory_snapshot` (the whole run, dumped at its end or on
OOM) and `trainer.memory_timeline` (one step) share it.

`StepHistory` cuts one step out of the shared history: the allocator's state at the step's
start (its allocated blocks) and the trace entries between that moment and the step's end, with
`max_memory_allocated` over the step (the peak statistics reset at its start).
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)

MAX_ENTRIES = 100_000  # the snapshot's default: enough for one step of every model here


class HistoryLost(RuntimeError):
    """The step's first entries were overwritten: the ring buffer is shorter than the step."""


class History:
    """The process's one recorder of the CUDA allocator history (see the module's doc)."""

    holders = 0
    max_entries = 0
    context: str | None = None

    @classmethod
    def hold(cls, max_entries: int = MAX_ENTRIES, context: str | None = "all") -> None:
        """Record from now on (at least `max_entries` entries; `context`: torch's, stack traces
        for the memory viewer, or None for none), until every holder released it."""
        stronger = context is not None and cls.context is None
        if cls.holders == 0 or max_entries > cls.max_entries or stronger:
            # on: a call with other settings changes them and keeps what was recorded
            cls.max_entries = max(max_entries, cls.max_entries if cls.holders else 0)
            cls.context = context if cls.holders == 0 or stronger else cls.context
            torch.cuda.memory._record_memory_history("all", context=cls.context,
                                                     max_entries=cls.max_entries)
        cls.holders += 1

    @classmethod
    def release(cls) -> None:
        cls.holders = max(0, cls.holders - 1)
        if cls.holders == 0:
            torch.cuda.memory._record_memory_history(None)
            cls.max_entries, cls.context = 0, None

    @classmethod
    def recording(cls) -> bool:
        return cls.holders > 0


def _key(e: dict) -> tuple:
    return e.get("action"), e.get("addr"), e.get("size"), e.get("time_us"), e.get("stream")


def step_entries(before: list[dict], after: list[dict]) -> list[dict]:
    """The entries of `after` (a later trace of the same ring buffer) recorded since `before`
    was taken: those past `before`'s last entry. HistoryLost when that entry is gone (the
    buffer went round within the step)."""
    if not before:
        return list(after)
    last = _key(before[-1])
    for i in range(len(after) - 1, -1, -1):
        if _key(after[i]) == last:
            return list(after[i + 1:])
    raise HistoryLost(f"the CUDA allocator history (max_entries {History.max_entries}) did not "
                      f"hold the whole step")


class StepHistory:
    """Around one step on a CUDA device: `blocks` (address, block size) allocated at its start,
    `entries` (the allocator's trace of the step, oldest first), `peak_bytes`
    (`torch.cuda.max_memory_allocated` over the step), `t0_s` (its start, Unix seconds)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.blocks: list[tuple[int, int]] = []
        self.entries: list[dict] = []
        self.peak_bytes = 0
        self.t0_s = 0.0
        self.lost = ""  # why the step's history is not whole (HistoryLost), if it is not
        self._before: list[dict] = []

    def _traces(self, snap: dict) -> list[dict]:
        traces = snap.get("device_traces", [])
        return traces[self.index] if self.index < len(traces) else []

    def __enter__(self) -> StepHistory:
        History.hold(context=None)  # frames only where a snapshot asked for them
        torch.cuda.synchronize(self.device)
        snap = torch.cuda.memory._snapshot()
        self.blocks = [(b["address"], b["size"]) for s in snap.get("segments", [])
                       if s.get("device", self.index) == self.index
                       for b in s.get("blocks", []) if b.get("state") == "active_allocated"]
        self._before = self._traces(snap)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.t0_s = time.time()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                torch.cuda.synchronize(self.device)
                self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
                after = self._traces(torch.cuda.memory._snapshot())
                self.entries = step_entries(self._before, after)
        except HistoryLost as e:  # the run goes on; its timeline is the tracker's
            self.lost = str(e)
            log.warning("trainer.memory_timeline: %s; the timeline is the tracker's", e)
        finally:
            self._before = []
            History.release()
