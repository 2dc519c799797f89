"""Memory and time accounting: the measurement protocol of docs/measurement.md.

Three independent instruments, each usable alone:
- `SavedBytes`: bytes packed for backward by `saved_tensors_hooks` in one step, counted once per
  storage; what was alive before the step (parameters, buffers, the batch: `alive_before_step`)
  is excluded, as the tracker's activation peak excludes it. Works on any device.
- `PeakTracker`: live-tensor tracking through one step (torch's MemTracker), giving the peak,
  its breakdown at that moment and the peak of activation memory (recomputation included). This
  is the CPU's peak (`mem_peak_source=tracker`) and the breakdown on CUDA.
- `StepTimer` + CUDA allocator statistics: step times and the real CUDA peak.
`Measurement` applies them to a training run: which step is warm-up, accounted or timed, and
which peak a row reports.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import resource
import socket
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

# the headline columns by their names in the one list of columns
from memtrain import allocator
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


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """(device, data pointer) of t's storage: views of one storage share it. A fake tensor (the
    estimate) has no data pointer; its storage object's address tells storages apart instead."""
    from torch._subclasses.fake_tensor import is_fake

    t = local(t)
    s = t.untyped_storage()
    return (str(t.device), s._cdata if is_fake(t) else s.data_ptr())


def local(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of `t`: a DTensor's local shard (FSDP's parameters, gradients and
    optimizer state), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def alive_before_step(model: nn.Module, *batch: torch.Tensor | None) -> list[torch.Tensor]:
    """What a training step finds alive and does not create: parameters, buffers and the batch
    (input and targets). Saved-bytes counts exclude these storages: the loop keeps them for the
    whole step anyway, so a layer that saves them costs nothing, and a compressed copy of them
    is memory on top (`mem_peak_act_bytes` excludes them for the same reason: the tracker files
    the batch as "other", not as an activation)."""
    return [*model.parameters(), *model.buffers(),
            *(t for t in batch if isinstance(t, torch.Tensor))]


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
    table (memtrain/layers.py)."""

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


class PeakTracker:
    """Tracks live tensors through one training step with torch's MemTracker.

    After the `with` block: `peak_bytes` (total live bytes at the peak), `at_peak` (breakdown at
    that moment: params, buffers, grads, optim, act (activations and backward temporaries),
    other) and `act_peak_bytes`: the highest activation memory at any moment of the step, where
    activations are the tensors made by module forwards, including forwards that a checkpointed
    segment re-runs during backward (MemTracker files those as activations too), so whatever
    recomputation brings back is counted. Backward temporaries are not: whatever backward
    allocates outside a recomputed forward (activation gradients, and what a method makes to
    run its backward: quantize's dequantized copies, pool's upsampled maps).
    `act_temp_peak_bytes`: the highest activations + backward temporaries alive at one moment of
    the step, the complete activation memory a method's step needs (`act_peak_bytes` alone
    over-credits a method that trades saved bytes for backward temporaries). It equals the CPU
    allocator's own count of what the step allocates outside kernels' workspaces, gradients
    left out (tests/test_act_temp_peak.py).
    `at_act_peak`: the breakdown at the moment of that activation peak (params, grads, optim,
    act = `act_peak_bytes`, other = buffers, the batch and backward temporaries).
    """

    def __init__(self, *external, device: torch.device | None = None, timeline: bool = False,
                 births: bool = False):
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY as _TOTAL
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _UpdateType

        # the run's device only (host copies of an offloaded GPU run are not GPU memory)
        self._device = device

        self._kinds = _kinds(external[0] if external else None)
        if self._kinds is not None:  # FSDP2: its tracker tells shards from gathered copies
            model, optimizer, *rest = external
            self._mt = _fsdp_tracker()(model, optimizer)
            self._mt.track_inputs(tuple(t for t in rest if isinstance(t, torch.Tensor)))
        else:
            self._kinds = {"params": [_MemRefType.PARAM], "buffers": [_MemRefType.BUFFER],
                           "grads": [_MemRefType.GRAD], "optim": [_MemRefType.OPT],
                           "act": [_MemRefType.ACT], "temp": [_MemRefType.TEMP],
                           "other": [_MemRefType.OTH]}
            self._mt = MemTracker()
            self._mt.track_external(*external)
        kinds = self._kinds
        self.act_peak_bytes = 0
        self.act_temp_peak_bytes = 0  # activations + backward temporaries at one moment
        # after each op: the counted devices' bytes per category (timeline.TRACKED), and what
        # the tracker filed as an activation or temporary when it was made, to be filed again
        # under what it turned out to be (`_refile`): record -> ([(from op, bytes)], category,
        # made inside FSDP's hooks); (from op, to op, bytes, category, category) moves
        self._series: list[list[int]] = []
        self._made: dict[int, tuple[list[tuple[int, int]], int, bool]] = {}
        self._moves: list[tuple[int, int, int, int, int]] = []
        mt = self._mt
        # `trainer.memory_timeline`: the live bytes per category after every op (`events`,
        # rows of memtrain.timeline.table), with the loop's `phase`, the innermost module and
        # whether a forward runs again in backward (MemTracker's `_in_ac`: a recomputation)
        self.events: list[tuple] | None = [] if timeline else None
        self.phase = "forward"
        names = ("params", "buffers", "optim", "grads", "act", "temp", "other")
        refs = [kinds[k] for k in names]  # timeline.TRACKED, each the tracker's kinds behind it
        self._category = {r: name for name in names for r in kinds[name]}
        self._t0, self.wall0 = time.perf_counter(), time.time()
        # CUDA timeline: every storage the step makes, (address, bytes, its record), in order,
        # so the allocator's blocks can be filed under the tracker's categories (`births`)
        self._births: list[tuple[int, int, object]] | None = [] if births else None
        self.start_storages: list[tuple[int, str]] = []  # (address, category) at the start
        # the modules whose forward runs now, innermost last (None: a module outside the
        # tracked models, such as checkpoint's wrapper of a group's first forward): in backward
        # MemTracker's module tracker also lists the modules whose backward runs, so a forward
        # recomputed there is named from this stack. Names as MemTracker's module tracker gives
        # them (the root's class name, then the path), the resident models' over the trained
        # one's: a synthetic partition's layers keep their names in the whole model
        self._names: dict[int, str] = {}
        for root in [e for e in external if isinstance(e, nn.Module)]:
            for n, m in root.named_modules():
                self._names[id(m)] = f"{type(root).__name__}.{n}" if n else type(root).__name__
        self._by_fqn: dict[str, nn.Module] = {}
        self._forwards: list[str | None] = []
        self._hooks: list = []

        # MemTracker's update hook runs at every allocation. It keeps the step's peak and the
        # breakdown at that moment (what `peak_bytes` and `at_peak` read), and a peak per module,
        # which nothing here reads and which costs a pass over every module at every allocation
        # (most of an accounting step's time on a few hundred modules under quantize's many
        # small ops: 31 s of 53 s for an efficientnet_b0 estimate). This hook keeps the step's
        # peak as MemTracker does, and the peak of the activation part alone with its moment.
        # What the tracker files as an activation or a temporary when it is made may turn out
        # to be something else, and is then filed again under that from the moment it was made
        # (`_refile`, applied to the series after the step):
        # - a parameter's gradient, made in backward: MemTracker files it as a temporary until
        #   autograd hands it to the parameter (its grad hook retags it a few ops later; on a
        #   256-wide MLP the weight gradient was most of the temporaries at their peak);
        # - FSDP2's buffers: its hooks (the all-gather before a unit's forward and backward, the
        #   reduce-scatter after its backward) make them with `empty`, and FSDP's tracker names
        #   them (all-gather, reduce-scatter, unsharded parameter or gradient) when the
        #   collective runs; one a hook made and freed unnamed is communication (other).
        TRACKED = ("params", "buffers", "optim", "grads", "act", "temp", "other")
        index = {name: i for i, name in enumerate(TRACKED)}
        cat_of = {r: index[name] for name, rs in kinds.items() for r in rs}
        ACT, TEMP, OTHER = index["act"], index["temp"], index["other"]
        hooks = hasattr(mt, "in_hook")
        made, moves, series = self._made, self._moves, self._series

        # MemTracker's own categories one to one (FSDP's tracker: several behind some)
        flat = [r[0] for r in refs] if all(len(r) == 1 for r in refs) else None
        counted: dict = {}  # device -> whether its bytes count (the run's device type)

        def update(state):
            vector = None
            for dev, snap in mt._curr_mem_snap.items():
                total = snap[_TOTAL]
                if mt._peak_mem.get(dev, 0) < total:
                    mt._peak_mem[dev], mt._peak_mem_snap[dev] = total, dict(snap)
                if not counted.setdefault(dev, self._counts(dev)):
                    continue
                get = snap.get
                v = [get(k, 0) for k in flat] if flat is not None else \
                    [sum(get(k, 0) for k in r) for r in refs]
                vector = v if vector is None else [a + b for a, b in zip(vector, v)]
            series.append(vector or [0] * len(TRACKED))
            if self.events is not None:
                self._record(mt, vector)

        def settle(key: int, to: int) -> None:
            parts, cat, _ = made.pop(key)
            if to != cat:
                now = len(series)
                moves.extend((start, now if end is None else end, nbytes, cat, to)
                             for start, end, nbytes in parts)

        def update_snap(kind, winfo, **kw):
            orig_update_snap(kind, winfo, **kw)
            if not self._counts(winfo.device):
                return
            key = id(winfo)
            if kind == _UpdateType.ADD:
                cat = cat_of.get(winfo.reftype)
                if cat in (ACT, TEMP):
                    made[key] = ([(len(series), None, winfo.mem_consumed)], cat,
                                 hooks and mt.in_hook > 0)
            elif key not in made:
                return
            elif kind == _UpdateType.REF:
                settle(key, cat_of.get(winfo.reftype, OTHER))
            elif kind == _UpdateType.DEL:
                if made[key][2]:  # a hook's buffer, never named: communication
                    settle(key, OTHER)
                else:
                    del made[key]
            elif kind == _UpdateType.SIZE:  # FSDP frees and refills a buffer by resizing it
                parts = made[key][0]
                start, _, nbytes = parts[-1]
                now = len(series)
                parts[-1] = (start, now, nbytes)
                parts.append((now, None, winfo.mem_consumed))

        orig_update_snap = mt._update_snap
        mt._update_snap = update_snap
        mt._update_peak_stats = update
        if self._births is not None:
            mt._track = self._noting_births(mt._track, 1)
            mt._update_and_maybe_create_winfos = self._noting_births(
                mt._update_and_maybe_create_winfos, 0)

    def _noting_births(self, fn, arg: int):
        """`fn` (a MemTracker method whose argument `arg` is a tensor), also noting the storages
        it files for the first time."""
        from torch.distributed._tools.common_utils import get_untyped_storages

        winfos = self._mt._WINFO

        def wrapped(*args, **kwargs):
            t = args[arg]
            new = [st for st in get_untyped_storages(t) if st not in winfos] \
                if isinstance(t, torch.Tensor) else []
            out = fn(*args, **kwargs)
            for st in new:
                if st in winfos and st.data_ptr():
                    self._births.append((st.data_ptr(), st.nbytes(), winfos[st][0]))
            return out

        return wrapped

    def gradients(self, grads: list[torch.Tensor]) -> None:
        """The parameters' gradients, at the end of the update: any of them the tracker still
        files as a temporary (FSDP2's sharded gradients, which its post-backward makes and its
        tracker never retags) was gradient memory from the moment it was made."""
        grads_at = ("params", "buffers", "optim", "grads").index("grads")
        for g in grads:
            info = self._mt._WINFO.get(local(g).untyped_storage(), (None, None))[0]
            if info is not None and id(info) in self._made:
                parts, cat, _ = self._made.pop(id(info))
                now = len(self._series)
                self._moves.extend((start, now if end is None else end, nbytes, cat, grads_at)
                                   for start, end, nbytes in parts)

    def _counts(self, dev: torch.device) -> bool:
        return self._device is None or torch.device(dev).type == self._device.type

    def module_now(self) -> str:
        """The innermost module whose forward runs now (in backward: whose backward runs, unless
        a forward is recomputed there), as torch's ModTracker names it (the root's class name,
        then the path: 'ResNet.layer1.0.conv1'); '' outside every module."""
        named = [n for n in self._forwards if n is not None]
        if named:
            return named[-1]
        # ModTracker's active modules are nested names ("Global" outside every module)
        tracker = self._mt._mod_tracker
        fqn = max(tracker.parents, key=lambda n: (n != "Global", n.count("."), n))
        if fqn == "Global":
            return ""
        if fqn not in self._by_fqn:  # the module it names, named as the forwards are
            self._by_fqn = {v: k for k, v in tracker._known_modules.items()}
        module = self._by_fqn.get(fqn)
        return self._names.get(id(module), fqn) if module is not None else fqn

    def _enter_forward(self, module: nn.Module, args) -> None:
        self._forwards.append(self._names.get(id(module)))

    def _leave_forward(self, module: nn.Module, args, out) -> None:
        if self._forwards:
            self._forwards.pop()

    def _record(self, mt, vector: list[int]) -> None:
        """One timeline event: the counted devices' bytes per category after this op (filed
        again after the step, `_refile`)."""
        self.events.append((time.perf_counter() - self._t0, self.phase, self.module_now(),
                            bool(mt._in_ac), *vector))

    def births(self) -> list[tuple[int, int, str]]:
        """The storages the step made, (address, bytes, category as last filed: a gradient as
        a gradient from its start), in the order the tracker saw them (with `births=True`)."""
        return [(addr, n, self._category.get(w.reftype, "other"))
                for addr, n, w in self._births or ()]

    def __enter__(self) -> PeakTracker:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        self._t0, self.wall0 = time.perf_counter(), time.time()
        self._mt.__enter__()
        if self.events is not None:  # the timeline's modules (after MemTracker's hooks: its
            # module tracker has named the module when ours runs)
            self._hooks = [register_module_forward_pre_hook(self._enter_forward),
                           register_module_forward_hook(self._leave_forward, always_call=True)]
        if self._births is not None:  # what the step finds: parameters, state, the batch
            self.start_storages = [(st.data_ptr(), self._category.get(w.reftype, "other"))
                                   for st, (w, _) in list(self._mt._WINFO.items())
                                   if st.data_ptr()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self._forwards = [], []
        self._mt.__exit__(*exc)
        series = self._refile()
        names = ("params", "buffers", "optim", "grads", "act", "temp", "other")
        P, B, OPT, G, A, T, X = range(len(names))
        if self.events is not None:
            self.events = [(*e[:4], *v) for e, v in zip(self.events, series)]
        self._made = {}
        totals = [sum(v) for v in series]
        self.peak_bytes = max(totals, default=0)
        at = series[totals.index(self.peak_bytes)] if series else [0] * len(names)
        self.at_peak = {"params": at[P], "buffers": at[B], "grads": at[G], "optim": at[OPT],
                        "act": at[A] + at[T], "other": at[X]}
        self.act_temp_peak_bytes = max((v[A] + v[T] for v in series), default=0)
        acts = [v[A] for v in series]
        self.act_peak_bytes = max(acts, default=0)
        # At the activation peak, act is exactly act_peak_bytes; backward temporaries go to other.
        a = series[acts.index(self.act_peak_bytes)] if series else [0] * len(names)
        self.at_act_peak = {"params": a[P], "grads": a[G], "optim": a[OPT], "act": a[A],
                            "other": a[B] + a[X] + a[T]}
        self._series = []

    def _refile(self) -> list[list[int]]:
        """The series of the step, each move applied: what it turned out to be, from the op it
        was made at (`from`, inclusive) to the op it was named at (`to`, exclusive)."""
        import numpy as np

        if not self._series:
            return []
        series = np.asarray(self._series, dtype=np.int64).reshape(len(self._series), -1)
        diff = np.zeros((series.shape[0] + 1, series.shape[1]), dtype=np.int64)
        for start, end, nbytes, cat, to in self._moves:
            if end > start and nbytes:
                diff[start, cat] -= nbytes
                diff[start, to] += nbytes
                diff[end, cat] += nbytes
                diff[end, to] -= nbytes
        self._moves = []
        return (series + np.cumsum(diff[:-1], axis=0)).tolist()


def _kinds(model) -> dict[str, list] | None:
    """The tracker's categories behind each part of a breakdown when `model` is sharded by
    FSDP2 (its own shards and the copies a step gathers are parameters, gradients likewise; the
    all-gather and reduce-scatter buffers and the step's inputs are other); None otherwise."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return None
    if not isinstance(model, FSDPModule):
        return None
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType as F

    return {"params": [F.SHARDED_PARAM, F.UNSHARDED_PARAM], "buffers": [F.BUFFER],
            "grads": [F.SHARDED_GRAD, F.UNSHARDED_GRAD], "optim": [F.OPT], "act": [F.ACT],
            "temp": [F.TEMP], "other": [F.INP, F.ALL_GATHER, F.REDUCE_SCATTER]}


@functools.cache
def _fsdp_tracker() -> type:
    """torch's FSDPMemTracker, which also says when FSDP2's own hooks run (`in_hook`): the
    unshard before a unit's forward and backward, the reshard after its forward, the
    reduce-scatter after its backward."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    def hooked(make):
        def instrument(self, fsdp_mod, orig):
            inner = make(self, fsdp_mod, orig)

            @functools.wraps(inner)
            def run(*args, **kwargs):
                self.in_hook += 1
                try:
                    return inner(*args, **kwargs)
                finally:
                    self.in_hook -= 1
            return run
        return instrument

    names = ("_fsdp_state_pre_forward", "_fsdp_state_post_forward",
             "_fsdp_param_group_pre_backward", "_fsdp_param_group_post_backward")
    return type("HookedFSDPMemTracker", (FSDPMemTracker,),
                {"in_hook": 0, **{n: hooked(getattr(FSDPMemTracker, n)) for n in names}})


class TimelineRecorder:
    """`trainer.memory_timeline=true`: while entered (the runner, around training), every
    accounting step records here its timeline, one table per part of the run (synthetic: one per
    phase; others: one), and the bytes each module saved for backward (`SavedByModule`);
    `table()` is the timelines end to end (memtrain/timeline.py's format), `saved` the modules'
    rows (memtrain/layers.py's). On the CPU a step's events are the tracker's
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
        from memtrain import timeline

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
        """The recorded steps end to end (memtrain/timeline.py's tidy table), or None."""
        import pandas as pd

        from memtrain import timeline

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
        from memtrain.distributed import comm_buffers

        comm = comm_buffers(model) if accounting else []
        tracker = PeakTracker(model, optimizer, x, y, *self.resident, *comm, device=self.device,
                              timeline=recorder is not None, births=cuda) if accounting else None
        if recorder is not None:  # which module saved what, for the per-module table
            self._saved = SavedByModule(alive_before_step(model, x, y), self.device, model,
                                        tracker.module_now)
        else:
            self._saved = SavedBytes(alive_before_step(model, x, y), self.device, model) \
                if accounting else None
        self._tracker = tracker
        # CUDA: the timeline is the allocator's history of this step (the process's recorder)
        history = allocator.StepHistory(self.device) if cuda else None
        if timed:
            self.timer.start()
        with maybe(history, cuda), maybe(tracker, accounting):
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
                          ("params", "grads", "optim", "act"))
            return {**self.peak_cuda, PEAK_SOURCE: "cuda", "mem_at_peak_other_bytes":
                    self.peak_cuda[PEAK] - tracked}
        if "mem_tracker_peak_bytes" not in self.summary:
            return {}
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
    at = tracker.at_peak
    return {
        SAVED: saved.bytes,
        "mem_act_saved_tensors": saved.count,
        ACT_PEAK: tracker.act_peak_bytes,
        ACT_TEMP_PEAK: tracker.act_temp_peak_bytes,
        "mem_tracker_peak_bytes": tracker.peak_bytes,
        "mem_params_bytes": tensor_bytes(model.parameters()),
        "mem_buffers_bytes": tensor_bytes(model.buffers()),
        "mem_optim_bytes": optimizer_bytes(optimizer),
        "mem_at_peak_params_bytes": at["params"],
        "mem_at_peak_grads_bytes": at["grads"],
        "mem_at_peak_optim_bytes": at["optim"],
        "mem_at_peak_act_bytes": at["act"],
        "mem_at_peak_other_bytes": at["buffers"] + at["other"],
        **{f"mem_at_act_peak_{k}_bytes": v for k, v in tracker.at_act_peak.items()},
        # offload on a GPU: what the step saved in host memory (in neither column above)
        **({"mem_act_saved_host_bytes": saved.host_bytes} if saved.host_bytes else {}),
    }


def _git_commit(here: Path | None = None) -> str:
    """The checkout's commit, `-dirty` when tracked files differ. Read without git's optional
    locks: `git status` otherwise refreshes the index under .git/index.lock, and a status cut
    off by the timeout (a loaded machine) leaves that lock behind, blocking the user's next
    commit."""
    here = here or Path(__file__).resolve().parent.parent
    git = ["git", "--no-optional-locks"]
    try:
        out = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], cwd=here,
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance(device: torch.device) -> dict[str, str | int]:
    """Who measured what, where: the columns every row carries."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        gpu_mem = torch.cuda.get_device_properties(device).total_memory
    else:
        name, cap, gpu_mem = platform.processor() or platform.machine(), "", 0
    return {
        "device": str(device),
        "device_name": name,
        "device_capability": cap,
        "device_total_memory_bytes": gpu_mem,
        "cpu_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "",
        "cudnn_version": str(torch.backends.cudnn.version() or "") if device.type == "cuda" else "",
        "triton_version": triton_version,
        "python_version": platform.python_version(),
        "git_commit": _git_commit(),
        "hostname": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
    }


@contextlib.contextmanager
def maybe(cm, enabled: bool):
    if enabled:
        with cm as v:
            yield v
    else:
        yield None
