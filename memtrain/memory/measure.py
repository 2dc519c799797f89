"""Memory and time accounting: the measurement protocol of docs/measurement.md.

Three independent instruments, each usable alone:
- `SavedBytes`: bytes packed for backward by `saved_tensors_hooks` in one step, counted once per
  storage; what was alive before the step (parameters, buffers, the batch: `alive_before_step`)
  is excluded, as the tracker's activation peak excludes it. Works on any device.
- `PeakTracker` (memtrain/memory/tracker.py): live-tensor tracking through one step (torch's
  MemTracker), giving the peak, its breakdown at that moment and the peak of activation memory
  (recomputation included): the breakdown, on every device.
- `allocator.CpuHistory`: the CPU allocator's own events of the step (torch's profiler), filed
  under the tracker's categories (`allocator.cpu_peaks`): the CPU's peak
  (`mem_peak_source=allocator`), kernels' scratch included, which no tensor holds.
- `StepTimer` + CUDA allocator statistics: step times and the real CUDA peak.
`Measurement` applies them to a training run: which step is warm-up, accounted or timed, and
which peak a row reports.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterable

import torch
from torch import nn

from memtrain.columns import (
    ACT_PEAK,
    ACT_TEMP_PEAK,
    PEAK,
    PEAK_SOURCE,
    RESERVED,
    SAVED,
    STEP_TIME,
    STEP_TIME_P90,
    THROUGHPUT,
)

# the headline columns by their names in the one list of columns
from memtrain.memory import allocator
from memtrain.memory.tracker import PeakTracker, local


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """(device, data pointer) of t's storage: views of one storage share it. A fake tensor (the
    estimate) has no data pointer; its storage object's address tells storages apart instead."""
    from torch._subclasses.fake_tensor import is_fake

    t = local(t)
    s = t.untyped_storage()
    return (str(t.device), s._cdata if is_fake(t) else s.data_ptr())


def alive_before_step(model: nn.Module, *batch: torch.Tensor | None) -> list[torch.Tensor]:
    """What a training step finds alive and does not create: parameters, buffers and the batch
    (input and targets). Saved-bytes counts exclude these storages: the loop keeps them for the
    whole step anyway, so a layer that saves them costs nothing, and a compressed copy of them
    is memory on top (`mem_peak_act_bytes` excludes them for the same reason: the tracker files
    the batch as "other", not as an activation)."""
    return [*model.parameters(), *model.buffers(),
            *(t for t in batch if isinstance(t, torch.Tensor))]


# where a strategy's wrap leaves the buffers it holds beside every step's tensors (an object with
# a `buffers` dict: distributed.py's DDP gradient buckets), counted as other memory
COMM_BUFFERS = "_memtrain_buckets"


def comm_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The buffers a strategy holds beside the tensors a step makes (`COMM_BUFFERS`): DDP's
    gradient buckets (one gradient-sized buffer in all, gradient_as_bucket_view off as torch's
    default); [] otherwise."""
    hook = getattr(model, COMM_BUFFERS, None)
    return list(hook.buffers.values()) if hook is not None else []

class SavedBytes:
    """Counts bytes saved for backward, once per storage, `exclude` (and views of it) left out:
    pass `alive_before_step(model, x, y)` so only what the step creates counts.

    Use as a context manager around the forward pass; `bytes` holds the count afterwards.
    Tensors a method keeps for backward must go through `ctx.save_for_backward` (or any
    autograd-saved path) to be seen here: that is the contract every method follows.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), device: torch.device | None = None,
                 model: nn.Module | None = None):
        exclude = list(exclude)
        self._exclude = {storage_key(t) for t in exclude}
        # FSDP: the parameters a step gathers are made during the step, so no key before it
        # names them; a saved tensor on a parameter's storage at pack time is one of them
        from torch.distributed.tensor import DTensor

        self._gathered = model if model is not None and any(
            isinstance(t, DTensor) for t in exclude) else None
        self._seen: dict[tuple[str, int], int] = {}
        self._ctx = None
        # a GPU run: saved storages in host memory (an offloader's) are counted apart
        self._host = device is not None and device.type != "cpu"

    def record(self, key: tuple[str, int], t: torch.Tensor) -> None:
        """Called once per packed tensor that counts; subclasses attribute it further."""
        self._seen[key] = t.untyped_storage().nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta" and not isinstance(t, nn.Parameter):
            key = storage_key(t)
            if key not in self._exclude and key[1] != 0 and not self._is_parameter(t):
                self.record(key, t)
        return t

    def _is_parameter(self, t: torch.Tensor) -> bool:
        if self._gathered is None:
            return False
        own = local(t).untyped_storage()._cdata
        return any(local(p).untyped_storage()._cdata == own for p in self._gathered.parameters())

    @property
    def bytes(self) -> int:
        """Saved bytes on the run's device (every device, when none was given)."""
        return sum(v for k, v in self._seen.items() if not (self._host and k[0] == "cpu"))

    @property
    def host_bytes(self) -> int:
        """Saved bytes in host memory on a GPU run (offload's); 0 otherwise."""
        return sum(v for k, v in self._seen.items() if self._host and k[0] == "cpu")

    @property
    def count(self) -> int:
        return len(self._seen)

    def __enter__(self) -> SavedBytes:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


class SavedByModule(SavedBytes):
    """SavedBytes that also files each counted storage under the module whose forward packed it
    first (`where()`: the innermost module active then, as `PeakTracker.module_now` names it;
    '' outside every module: the loss). Counted once per storage, as SavedBytes counts: the
    modules' bytes sum to `bytes` (and `host_bytes`). `trainer.memory_timeline`'s per-module
    table (memtrain/memory/by_module.py)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), device: torch.device | None = None,
                 model: nn.Module | None = None, where=lambda: ""):
        super().__init__(exclude, device, model)
        self._where = where
        self.module_of: dict[tuple[str, int], str] = {}

    def record(self, key: tuple[str, int], t: torch.Tensor) -> None:
        if key not in self.module_of:
            self.module_of[key] = self._where()
        super().record(key, t)

    def by_module(self) -> list[tuple[str, int, int, int]]:
        """(module, bytes on the run's device, bytes in host memory, storages), in the order
        the modules first saved something."""
        out: dict[str, list[int]] = {}
        for key, module in self.module_of.items():
            row = out.setdefault(module, [0, 0, 0])
            host = self._host and key[0] == "cpu"
            row[1 if host else 0] += self._seen[key]
            row[2] += 1
        return [(m, *v) for m, v in out.items()]



class TimelineRecorder:
    """`trainer.memory_timeline=true`: while entered (the runner, around training), every
    accounting step records here its timeline, one table per part of the run (synthetic: one per
    phase; others: one), and the bytes each module saved for backward (`SavedByModule`);
    `table()` is the timelines end to end (timeline.py's format), `saved` the modules'
    rows (by_module.py's). On the CPU a step's events are the tracker's
    (`PeakTracker.events`); on CUDA the allocator history's (`allocator.StepHistory`), filed
    under the tracker's categories (`timeline.from_allocator`). Off: a no-op."""

    active: TimelineRecorder | None = None

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.steps: list[tuple] = []  # (events, part, categories) of each recorded step
        self.saved: list[tuple] = []  # (part, module, bytes, host bytes, storages)
        self.source = "tracker"
        self.columns: dict = {}  # the row's columns of the recorded steps (CUDA: their peak)

    def add(self, tracker: PeakTracker, saved: SavedByModule | None, part: str,
            history=None) -> None:
        """A recorded step's events, kept as they are: the tables are made after training
        (`table`), outside every step."""
        from memtrain.memory import timeline

        if history is not None and history.lost:  # the tracker's events instead, said so
            self.columns["mem_timeline_note"] = history.lost
        if history is None or history.lost:
            self.steps.append((tracker.events, part, timeline.TRACKED))
        else:
            start = dict(tracker.start_storages)
            blocks = [(a, n, start.get(a, "untracked")) for a, n in history.blocks]
            marks = [e[:4] for e in tracker.events]
            events = timeline.from_allocator(history.entries, blocks, tracker.births(), marks,
                                             tracker.wall0)
            self.steps.append((events, part, timeline.CATEGORIES))
            self.source = "cuda"
            peak = self.columns.get("mem_timeline_alloc_peak_bytes", 0)
            self.columns["mem_timeline_alloc_peak_bytes"] = max(peak, history.peak_bytes)
        if saved is not None:
            self.saved += [(part, *row) for row in saved.by_module()]

    def table(self):
        """The recorded steps end to end (memtrain/memory/timeline.py's tidy table), or None."""
        import pandas as pd

        from memtrain.memory import timeline

        tables, first = [], 0
        for events, part, cats in self.steps:
            tables.append(timeline.table(events, part, first, cats))
            first += len(events)
        return pd.concat(tables, ignore_index=True) if tables else None

    def __enter__(self) -> TimelineRecorder:
        if self.enabled:
            TimelineRecorder.active = self
        return self

    def __exit__(self, *exc) -> None:
        if TimelineRecorder.active is self:
            TimelineRecorder.active = None


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors' storages, each once (a DTensor: its local shard's)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            seen[storage_key(t)] = local(t).untyped_storage().nbytes()
    return sum(seen.values())


def resident_bytes(modules: Iterable[nn.Module], trained: nn.Module,
                   device: torch.device) -> int:
    """Bytes of the parameters and buffers of `modules` on `device`'s kind that are not
    `trained`'s: what a step finds resident beside the module it trains."""
    own = {storage_key(t) for t in (*trained.parameters(), *trained.buffers())}
    return tensor_bytes(t for m in modules for t in (*m.parameters(), *m.buffers())
                        if t.device.type == device.type and storage_key(t) not in own)


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in opt.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Wall time per step, synchronised on CUDA so host clocks see finished work."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []
        self._t0 = 0.0

    def start(self) -> None:
        sync(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        sync(self.device)
        dt = time.perf_counter() - self._t0
        self.times.append(dt)
        return dt

    def summary(self, batch_size: int) -> dict[str, float]:
        if not self.times:
            nan = float("nan")
            return {STEP_TIME: nan, STEP_TIME_P90: nan, THROUGHPUT: nan}
        t = torch.tensor(self.times, dtype=torch.float64)
        median = float(t.median())
        return {
            STEP_TIME: median,
            STEP_TIME_P90: float(torch.quantile(t, 0.9)),
            THROUGHPUT: batch_size / median,
        }


def cuda_peak(device: torch.device) -> dict[str, int]:
    return {
        PEAK: torch.cuda.max_memory_allocated(device),
        RESERVED: torch.cuda.max_memory_reserved(device),
    }


def reset_cuda_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class Measurement:
    """The measurement protocol of one training run (docs/measurement.md).

    Steps 0 .. warmup-1 warm up (excluded from every figure). The next step is the accounting step
    (unless `account_memory` is off): saved-activation bytes and the live-tensor peak are taken on
    it, and it trains like any other step. Every later step is timed, and the CUDA peak is the
    maximum over those steps, work done `outside_window` (evaluation) excluded. `memory()` chooses
    the peak a row reports: CUDA's allocator on CUDA, the tracker's elsewhere.

    Columns go into `summary` (the run's record) as soon as they are measured, so a run that
    fails later still has them.
    """

    def __init__(self, device: torch.device, total_steps: int, warmup_steps: int,
                 account_memory: bool, summary: dict, resident: Iterable[nn.Module] = (),
                 part: str = "", settle: int = 0):
        self.device, self.account, self.summary = device, account_memory, summary
        self.part = part  # a method's phase that this loop trains (synthetic's part<j>)
        self._tracker: PeakTracker | None = None
        # modules whose tensors stay where they are beside the trained one (synthetic: the
        # partitions not in training): the tracker counts those on the run's device
        self.resident = tuple(resident)
        # Short runs shrink the warm-up so that at least one step is accounted and one is timed;
        # `settle`: the steps a strategy needs before its steps are alike (DDP rebuilds its
        # gradient buckets in its second step): warm-up at least, even at the cost of the timed
        # step in a very short run (the accounting step must be one like the others)
        self.warmup = max(min(warmup_steps, max(0, total_steps - 2)),
                          min(settle, max(0, total_steps - 1)))
        self.timer = StepTimer(device)
        self.peak_cuda = {PEAK: 0, RESERVED: 0}
        self._saved: SavedBytes | None = None
        self._window_open = False  # the CUDA peak window (after the accounting step)
        self._rate_from = 0  # timer.times[_rate_from:]: the steps since the last series row

    @contextlib.contextmanager
    def step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             x: torch.Tensor, y: torch.Tensor):
        """Around one whole training step: times it, or accounts it (tracker and saved bytes)."""
        accounting = self.account and step == self.warmup
        timed = step >= self.warmup and not accounting
        recorder = TimelineRecorder.active if accounting else None
        cuda = recorder is not None and self.device.type == "cuda"
        comm = comm_buffers(model) if accounting else []
        # the CPU: the allocator's own events of the step (`allocator.CpuHistory`), each
        # allocation filed under the tensor the tracker saw in it (its births and deaths marked)
        cpu = accounting and self.device.type == "cpu"
        tracker = PeakTracker(model, optimizer, x, y, *self.resident, *comm, device=self.device,
                              timeline=recorder is not None, births=cuda,
                              marks=cpu) if accounting else None
        if recorder is not None:  # which module saved what, for the per-module table
            self._saved = SavedByModule(alive_before_step(model, x, y), self.device, model,
                                        tracker.module_now)
        else:
            self._saved = SavedBytes(alive_before_step(model, x, y), self.device, model) \
                if accounting else None
        self._tracker = tracker
        # CUDA: the timeline is the allocator's history of this step (the process's recorder)
        history = allocator.StepHistory(self.device) if cuda else None
        events = allocator.CpuHistory() if cpu else None
        if timed:
            self.timer.start()
        with maybe(history, cuda), maybe(events, cpu), maybe(tracker, accounting):
            t0 = time.perf_counter()
            yield
            if accounting:
                sync(self.device)
                took = time.perf_counter() - t0
        if timed:
            self.timer.stop()
        self._tracker = None
        if accounting:
            self.summary.update(_accounting(self._saved, tracker, model, optimizer))
            if cpu:
                self.summary.update(_cpu_peak(events, tracker))
            # what recording cost the step: the same step without trainer.memory_timeline
            # (or with it) is the comparison (docs/timeline.md)
            self.summary["mem_accounting_step_s"] = took
            if recorder is not None:
                recorder.add(tracker, self._saved, self.part, history)
            other = resident_bytes(self.resident, model, self.device)
            if other:
                self.summary["mem_resident_other_bytes"] = other
            if comm:  # DDP's buckets: resident, tracked from the step's start (other)
                self.summary["mem_comm_buffers_bytes"] = tensor_bytes(comm)
            self._saved = None
        if step == self.warmup:  # the CUDA peak window opens after the accounting step
            reset_cuda_peak(self.device)
            self._window_open = True

    @contextlib.contextmanager
    def forward(self):
        """Around the forward pass: counts what is saved for backward on the accounting step;
        what follows it, up to `updating`, is the backward phase of the step's timeline."""
        self._phase("forward")
        with maybe(self._saved, self._saved is not None):
            yield
        self._phase("backward")

    def updating(self) -> None:
        """The update starts (clip, optimizer step, zero): the timeline's optimizer phase."""
        self._phase("optimizer")

    def _phase(self, name: str) -> None:
        if self._tracker is not None:
            self._tracker.phase = name

    def update_done(self, model: nn.Module) -> None:
        """After the optimizer step, before the gradients are freed: their bytes, once."""
        if self._saved is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            self.summary["mem_grads_bytes"] = tensor_bytes(grads)
            if self._tracker is not None:
                self._tracker.gradients(grads)

    @contextlib.contextmanager
    def outside_window(self):
        """Work that is no training step (evaluation): kept out of the CUDA peak."""
        if self.device.type == "cuda":
            for k, v in cuda_peak(self.device).items():
                self.peak_cuda[k] = max(self.peak_cuda[k], v)
        yield
        reset_cuda_peak(self.device)

    def samples_s(self, batch_size: int) -> float:
        """Throughput of the last timed step (NaN before the first)."""
        return batch_size / self.timer.times[-1] if self.timer.times else float("nan")

    def timing(self, batch_size: int) -> dict[str, float]:
        return self.timer.summary(batch_size)

    def memory_now(self) -> dict[str, int]:
        """The memory series of metrics.csv and the progress lines, as the run goes, named as
        the row's columns whose value they are so far: `mem_peak_alloc_bytes` (on CUDA the
        allocator's peak over the timed steps, evaluation excluded; elsewhere the tracker's peak
        of the accounting step; absent before either is measured: the row's peak is the last
        value), on CUDA `mem_peak_reserved_bytes` and `mem_alloc_bytes` (allocated now), and
        `mem_peak_rss_bytes` (the process's peak resident memory so far)."""
        out: dict[str, int] = {}
        if self.device.type == "cuda":
            out["mem_alloc_bytes"] = torch.cuda.memory_allocated(self.device)
            if self._window_open:
                now = cuda_peak(self.device)
                out.update({k: max(self.peak_cuda[k], now[k]) for k in (PEAK, RESERVED)})
        elif PEAK in self.summary:  # the CPU's, from the accounting step on
            out[PEAK] = self.summary[PEAK]
        elif "mem_tracker_peak_bytes" in self.summary:
            out[PEAK] = self.summary["mem_tracker_peak_bytes"]
        out["mem_peak_rss_bytes"] = peak_rss_bytes()
        return out

    def series(self, batch_size: int) -> dict[str, float]:
        """A logged step's memory and throughput: `memory_now()` and `samples_s`, the samples
        per second of the steps timed since the previous call (absent when none was timed:
        warm-up and the accounting step are not)."""
        times = self.timer.times[self._rate_from:]
        self._rate_from = len(self.timer.times)
        rate = {"samples_s": batch_size * len(times) / sum(times)} if times else {}
        return {**rate, **self.memory_now()}

    def memory(self) -> dict[str, float | int | str]:
        """The reported peak and its source: CUDA's allocator over the timed steps, or (on other
        devices) the live-tensor tracker's peak of the accounting step."""
        if self.device.type == "cuda":
            # The breakdown was taken at the tracker's peak; "other" absorbs what the allocator
            # holds beyond live tensors (workspaces, rounding) and what the tracker did not see.
            # Not clamped at 0: the tracker seeing more than CUDA allocated must show.
            tracked = sum(self.summary.get(f"mem_at_peak_{k}_bytes", 0) for k in
                          ("params", "grads", "optim", "update", "act"))
            return {**self.peak_cuda, PEAK_SOURCE: "cuda", "mem_at_peak_other_bytes":
                    self.peak_cuda[PEAK] - tracked}
        if "mem_tracker_peak_bytes" not in self.summary:
            return {}
        if PEAK in self.summary:  # the CPU's: written by the accounting step
            return {PEAK: self.summary[PEAK], RESERVED: float("nan"),
                    PEAK_SOURCE: self.summary.get(PEAK_SOURCE, "tracker")}
        return {PEAK: self.summary["mem_tracker_peak_bytes"], RESERVED: float("nan"),
                PEAK_SOURCE: "tracker"}

    def at_oom(self) -> dict[str, int | str]:
        """On CUDA, the peak reached before the failing allocation."""
        if self.device.type != "cuda":
            return {}
        return {**cuda_peak(self.device), PEAK_SOURCE: "cuda"}

    def state(self) -> dict:
        """What a resumed run needs to go on measuring (resume.capture's `extra`)."""
        return {"times": self.timer.times, "peak_cuda": self.peak_cuda}

    def restore(self, state: dict) -> None:
        self.timer.times.extend(state["times"])
        self._rate_from = len(self.timer.times)
        self._window_open = bool(self.timer.times)  # timed steps ran: past the accounting step
        self.peak_cuda.update(state["peak_cuda"])


def _accounting(saved: SavedBytes, tracker: PeakTracker, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> dict[str, int]:
    return {
        SAVED: saved.bytes,
        "mem_act_saved_tensors": saved.count,
        ACT_PEAK: tracker.act_peak_bytes,
        ACT_TEMP_PEAK: tracker.act_temp_peak_bytes,
        "mem_tracker_peak_bytes": tracker.peak_bytes,
        "mem_tracker_act_temp_bytes": tracker.act_temp_peak_bytes,
        "mem_params_bytes": tensor_bytes(model.parameters()),
        "mem_buffers_bytes": tensor_bytes(model.buffers()),
        "mem_optim_bytes": optimizer_bytes(optimizer),
        **_breakdown(tracker.at_peak),
        **{f"mem_at_act_peak_{k}_bytes": v for k, v in tracker.at_act_peak.items()},
        # offload on a GPU: what the step saved in host memory (in neither column above)
        **({"mem_act_saved_host_bytes": saved.host_bytes} if saved.host_bytes else {}),
        # checkpoint's RNG states (host tensors)
        **({"mem_rng_state_bytes": tracker.rng_peak_bytes} if tracker.rng_peak_bytes else {}),
    }


def _breakdown(at: dict[str, int]) -> dict[str, int]:
    """The row's breakdown at the peak from one in the tracker's categories (act: activations
    and backward temporaries; other: buffers and the rest; scratch where there is some)."""
    out = {f"mem_at_peak_{k}_bytes": at[k] for k in ("params", "grads", "optim", "update")}
    out["mem_at_peak_act_bytes"] = at.get("act", 0) + at.get("temp", 0)
    out["mem_at_peak_other_bytes"] = at.get("buffers", 0) + at.get("other", 0)
    if allocator.SCRATCH in at:
        out["mem_at_peak_scratch_bytes"] = at[allocator.SCRATCH]
    return out


def _cpu_peak(events: allocator.CpuHistory, tracker: PeakTracker) -> dict[str, int | str]:
    """The CPU's peak columns: the allocator's own peak of the step (every allocation, kernels'
    scratch included) and its breakdown, or where its events could not be had, the tracker's
    (`mem_peak_note` says why)."""
    if events.error or not events.events:
        return {PEAK: tracker.peak_bytes, PEAK_SOURCE: "tracker",
                "mem_peak_note": events.error or "the profiler recorded no allocation"}
    peaks = allocator.cpu_peaks(events.events, *tracker.cpu_records())
    return {PEAK: peaks.peak_bytes, PEAK_SOURCE: "allocator", **_breakdown(peaks.at_peak),
            ACT_TEMP_PEAK: peaks.act_temp_peak_bytes,
            "mem_scratch_peak_bytes": peaks.scratch_peak_bytes}


@contextlib.contextmanager
def maybe(cm, enabled: bool):
    if enabled:
        with cm as v:
            yield v
    else:
        yield None
