"""The allocators' own records of a step: CUDA's history, one recorder per process; the CPU's
events, through torch's profiler (`CpuHistory`, `cpu_peaks`).

`torch.cuda.memory._record_memory_history` is process-wide: a second caller that switched it on
and off again would end the first one's recording. `History` is the one switch memtrain uses:
every user holds it (`hold`) and lets go (`release`); recording starts with the first holder
and stops with the last, so `trainer.memory_snapshot` (the whole run, dumped at its end or on
OOM) and `trainer.memory_timeline` (one step) share it.

`StepHistory` cuts one step out of the shared history: the allocator's state at the step's
start (its allocated blocks) and the trace entries between that moment and the step's end, with
`max_memory_allocated` over the step (the peak statistics reset at its start).

`CpuHistory` records one step's CPU allocations and frees (torch's profiler, `profile_memory`:
the allocator reports every allocation, a buffer a kernel makes with no tensor attached too) and
the live-tensor tracker's marks (`tracker.PeakTracker(marks=True)`: a storage noted, a storage
freed); `cpu_peaks` replays them: the step's peak of every allocation, its breakdown in the
tracker's categories, and `scratch`, the allocations in which the tracker saw no tensor.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field

import torch

from memtrain.columns import TRACKED

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


# ---------------------------------------------------------------- the CPU: the profiler's events

SCRATCH = "scratch"  # an allocation in which the tracker saw no tensor (a kernel's scratch)
CPU_CATEGORIES = (*TRACKED, SCRATCH)
ALLOC, BORN, FREED = 0, 1, 2  # kinds of event: the allocator's (+ or - bytes), the tracker's


class CpuHistory:
    """Around one step on the CPU: `events`, the allocator's allocations and frees and the
    tracker's marks in the order they happened, (kind, address or mark, bytes) with kind ALLOC
    (bytes < 0: a free), BORN (the tracker's births[mark]) or FREED (the record whose id is
    mark died). Only what happens inside is seen: a free of memory allocated before is not
    reported (c10 logs that it is unknown). `error`: why nothing was recorded (another
    profiler is running), else ""."""

    def __init__(self):
        self.events: list[tuple[int, int, int]] = []
        self.error = ""
        self._prof = None

    def __enter__(self) -> CpuHistory:
        if torch._C._autograd._profiler_enabled():
            self.error = "another torch.profiler was running"
            return self
        # kineto's own log lines (its stages, and an error on machines without a GPU) are no
        # news to a user of a CPU run; a level set by the user is kept
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                            profile_memory=True)
        with warnings.catch_warnings():  # torch 2.11 warns of every profile, one cycle or not
            warnings.filterwarnings("ignore", "Warning: Profiler clears events", UserWarning)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(*exc)
        if exc[0] is None:
            self.events = _profiled(prof)


def _profiled(prof) -> list[tuple[int, int, int]]:
    """The profile's CPU allocation events and memtrain's marks, in time order."""
    from torch._C._profiler import _EventType

    from memtrain.memory.tracker import MARK

    out: list[tuple[int, int, int, int, int]] = []  # (time, order, kind, a, b)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        kind, a = n.typed  # one call: each builds the event's fields anew
        if kind == _EventType.Allocation:
            if a.device.type == "cpu":
                out.append((n.start_time_ns, len(out), ALLOC, a.ptr, a.alloc_size))
        elif kind == _EventType.TorchOp and n.name.startswith(MARK):
            what, _, value = n.name[len(MARK):].partition(":")
            out.append((n.start_time_ns, len(out), BORN if what == "born" else FREED,
                        int(value), 0))
        stack.extend(n.children)
    out.sort()
    return [e[2:] for e in out]


@dataclass
class CpuPeaks:
    """What `cpu_peaks` found: the step's peak of every allocation and its breakdown
    (`at_peak`, CPU_CATEGORIES), the highest activations + backward temporaries + scratch alive
    at one moment, the highest scratch alive at one moment."""

    peak_bytes: int = 0
    at_peak: dict[str, int] = field(default_factory=dict)
    act_temp_peak_bytes: int = 0
    scratch_peak_bytes: int = 0


def cpu_peaks(events: list[tuple[int, int, int]], start: list[tuple[int, int, str]],
              births: list[tuple[int, int, str, int]]) -> CpuPeaks:
    """Replays a step's `CpuHistory.events`. `start`: the storages the step found, (record id,
    bytes, category); `births`: the tracker's births, (address, bytes, category, record id),
    each marked BORN in the events when the tracker noted it.

    An allocation is filed under the category of the birth that finds it alive at its address
    and of its size, from the moment it was made (an op's output is made before the tracker
    sees it); one no birth finds is scratch. A birth that finds no allocation of the step is a
    storage made before the step and used in it: counted from then on, as the tracker counts
    it. Those and the storages the step found leave at their record's FREED mark (the
    allocator does not report a free of what it allocated before the step)."""
    cats = {c: i for i, c in enumerate(CPU_CATEGORIES)}
    found, outside = _match(events, births, cats)
    values = [0] * len(CPU_CATEGORIES)
    held: dict[int, tuple[int, int]] = {}  # record id -> (bytes, category): made before
    for rid, nbytes, cat in start:
        held[rid] = (nbytes, cats[cat])
        values[cats[cat]] += nbytes
    live: dict[int, tuple[int, int]] = {}  # address -> (bytes, category)
    act = (cats["act"], cats["temp"], cats[SCRATCH])
    out = CpuPeaks(sum(values), dict(zip(CPU_CATEGORIES, values)))
    for i, (kind, a, n) in enumerate(events):
        if kind == ALLOC and n > 0:
            cat = found.get(i, cats[SCRATCH])
            live[a] = (n, cat)
            values[cat] += n
        elif kind == ALLOC and a in live:
            size, cat = live.pop(a)
            values[cat] -= size
        elif kind == BORN and i in outside:
            _, nbytes, cat, rid = births[a]
            held[rid] = (nbytes, cats[cat])
            values[cats[cat]] += nbytes
        elif kind == FREED and a in held:
            size, cat = held.pop(a)
            values[cat] -= size
        else:
            continue
        total = sum(values)
        if total > out.peak_bytes:
            out.peak_bytes, out.at_peak = total, dict(zip(CPU_CATEGORIES, values))
        out.act_temp_peak_bytes = max(out.act_temp_peak_bytes, sum(values[c] for c in act))
        out.scratch_peak_bytes = max(out.scratch_peak_bytes, values[cats[SCRATCH]])
    return out


def _match(events: list[tuple[int, int, int]], births: list[tuple[int, int, str, int]],
           cats: dict[str, int]) -> tuple[dict[int, int], set[int]]:
    """(the category of each allocation event a birth finds, the BORN events that find none):
    a birth finds the allocation alive at its address if it has the birth's size and no other
    birth found it."""
    alive: dict[int, tuple[int, int]] = {}  # address -> (event, bytes)
    found: dict[int, int] = {}
    outside: set[int] = set()
    for i, (kind, a, n) in enumerate(events):
        if kind == ALLOC:
            if n > 0:
                alive[a] = (i, n)
            else:
                alive.pop(a, None)
        elif kind == BORN and a < len(births):
            addr, nbytes, cat, _ = births[a]
            hit = alive.get(addr)
            if hit is not None and hit[1] == nbytes and hit[0] not in found:
                found[hit[0]] = cats[cat]
            else:
                outside.add(i)
    return found, outside
