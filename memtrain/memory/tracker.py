"""The live-tensor tracker of one training step: torch's MemTracker, as memtrain reads it.

`PeakTracker` follows every storage a step's operators make (torch's MemTracker, a dispatch mode)
and keeps, after every op, the live bytes per category (`columns.TRACKED`): the step's peak and
its breakdown, the activation peak, the peak of activations + backward temporaries. It also
notes, on request, every storage it files (`births`: the CUDA timeline and the CPU allocator's
count file allocations under them) and marks births and deaths in torch's profiler (`marks`:
the CPU allocator's count places them among its own events, `memtrain.memory.allocator`).
"""

from __future__ import annotations

import functools
import gc
import time
import weakref

import torch
from torch import nn

from memtrain.columns import TRACKED

# MemTracker's own categories, in `TRACKED`'s order without `update` (which no reference type
# names: an optimizer-step tensor that dies within the step, filed again after the step)
_RAW = tuple(c for c in TRACKED if c != "update")
MARK = "memtrain::"  # the profiler marks' prefix: `born:<i>` (births[i]), `freed:<id>`


class PeakTracker:
    """Tracks live tensors through one training step with torch's MemTracker.

    After the `with` block: `peak_bytes` (total live bytes at the peak), `at_peak` (breakdown at
    that moment: params, buffers, grads, optim (optimizer state), update (the update's
    temporaries: tensors the optimizer step makes and frees, such as SGD's weight-decay and
    Nesterov copies of a gradient), act (activations and backward temporaries), other) and
    `act_peak_bytes`: the highest activation memory at any moment of the step, where
    activations are the tensors made by module forwards, including forwards that a checkpointed
    segment re-runs during backward (MemTracker files those as activations too), so whatever
    recomputation brings back is counted. Backward temporaries are not: whatever backward
    allocates outside a recomputed forward (activation gradients, and what a method makes to
    run its backward: quantize's dequantized copies, pool's upsampled maps).
    `act_temp_peak_bytes`: the highest activations + backward temporaries alive at one moment of
    the step, the complete tensor memory of a method's activations (`act_peak_bytes` alone
    over-credits a method that trades saved bytes for backward temporaries). It equals the CPU
    allocator's own count of what the step allocates outside kernels' scratch, gradients left
    out (tests/test_act_temp_peak.py).
    `at_act_peak`: the breakdown at the moment of that activation peak (params, grads, optim,
    act = `act_peak_bytes`, other = buffers, the batch, backward and update temporaries).
    `rng_peak_bytes`: the most bytes of RNG state copies (`torch.get_rng_state`, and CUDA's,
    both host tensors) alive at one moment: checkpointing keeps one per recomputed group from
    its forward to its recomputation, and one more while it recomputes. No operator makes them,
    so MemTracker alone would not see them; they are tracked as other, on the CPU's count.
    """

    def __init__(self, *external, device: torch.device | None = None, timeline: bool = False,
                 births: bool = False, marks: bool = False):
        # the run's device only (host copies of an offloaded GPU run are not GPU memory)
        self._device = device
        self._counted: dict = {}  # device -> whether its bytes count
        self._mt, self._kinds = _memtracker(external)
        kinds = self._kinds
        self.act_peak_bytes = 0
        self.act_temp_peak_bytes = 0  # activations + backward temporaries at one moment
        self.rng_peak_bytes = 0
        self._rng_now = 0
        self._patched: list[tuple[object, str, object]] = []  # (owner, name, original)
        # after each op: the counted devices' bytes per MemTracker category (`_RAW`), and what
        # the tracker filed as an activation, temporary or optimizer tensor when it was made,
        # to be filed again under what it turned out to be (`_refile`): record -> ([(from op,
        # bytes)], category, made inside FSDP's hooks); (from op, to op, bytes, category,
        # category) moves, categories as indices of TRACKED
        self._series: list[list[int]] = []
        self._made: dict[int, tuple[list[tuple[int, int]], int, bool]] = {}
        self._moves: list[tuple[int, int, int, int, int]] = []
        self._final: dict[int, int] = {}  # record -> the category it was filed again under
        # `trainer.memory_timeline`: the live bytes per category after every op (`events`,
        # rows of memtrain.memory.timeline.table), with the loop's `phase`, the innermost module and
        # whether a forward runs again in backward (MemTracker's `_in_ac`: a recomputation)
        self.events: list[tuple] | None = [] if timeline else None
        self.phase = "forward"
        self._category = {r: name for name in _RAW for r in kinds[name]}
        self._t0, self.wall0 = time.perf_counter(), time.time()
        # every storage the step makes, (address, bytes, its record), in order, so the
        # allocator's blocks can be filed under the tracker's categories (`births`); with
        # `marks`, each is marked in torch's profiler when noted, and so is each death
        self._marks = marks
        self._births: list[tuple[int, int, object]] | None = [] if births or marks else None
        self.start_storages: list[tuple[int, str]] = []  # (address, category) at the start
        self.start_records: list[tuple[object, int]] = []  # (record, bytes) at the start
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

        # torch's tracker, made to keep what this class reads: the private members replaced
        # here are the code most exposed to torch's changes, one function each
        self._replace_update_snap()
        self._replace_update_peak_stats()
        if self._births is not None:
            self._replace_track_noting_births()

    def _replace_update_peak_stats(self) -> None:
        """Replaces MemTracker's `_update_peak_stats`, which its dispatch mode calls after every
        op, with one that appends the op's live bytes per category to the step's series.

        Why: torch's keeps the step's peak and the breakdown at that moment, and a peak per
        module, which nothing here reads and which costs a pass over every module at every
        allocation (most of an accounting step's time on a model of a few hundred modules under
        quantize's many small ops). This one keeps the step's peak as MemTracker does
        (`_peak_mem`, `_peak_mem_snap`), and the series the peaks and their breakdowns are read
        from after the step (`__exit__`), counting only the run's device.

        Checked on torch 2.11 and 2.14: `_update_peak_stats(peak_state)`, called with the
        op's outputs filed; `_curr_mem_snap`, device -> {category or `_TOTAL_KEY`: bytes}."""
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY as _TOTAL

        mt, series = self._mt, self._series
        refs = [self._kinds[k] for k in _RAW]  # MemTracker's categories behind each of _RAW
        # MemTracker's own categories one to one (FSDP's tracker: several behind some)
        flat = [r[0] for r in refs] if all(len(r) == 1 for r in refs) else None
        zero = [0] * len(_RAW)

        def update(state):
            vector = None
            for dev, snap in mt._curr_mem_snap.items():
                total = snap[_TOTAL]
                if mt._peak_mem.get(dev, 0) < total:
                    mt._peak_mem[dev], mt._peak_mem_snap[dev] = total, dict(snap)
                if not self._counts(dev):
                    continue
                get = snap.get
                v = [get(k, 0) for k in flat] if flat is not None else \
                    [sum(get(k, 0) for k in r) for r in refs]
                vector = v if vector is None else [a + b for a, b in zip(vector, v)]
            series.append(vector or zero)
            if self.events is not None:
                self._record(mt)

        mt._update_peak_stats = update

    def _replace_update_snap(self) -> None:
        """Replaces MemTracker's `_update_snap`, which files each change to a tracked storage
        (added, deleted, filed under another category, resized), with itself, also noting what
        may be filed again after the step (`_refile`).

        Why: what the tracker files as an activation, a temporary or an optimizer tensor when it
        is made may turn out to be something else, and is then filed again under that from the
        moment it was made:
        - a parameter's gradient, made in backward: MemTracker files it as a temporary until
          autograd hands it to the parameter (its grad hook retags it a few ops later);
        - a tensor the optimizer step makes (MemTracker: optimizer) and that dies within the
          step: the update's temporary, not optimizer state;
        - FSDP2's buffers: its hooks (the all-gather before a unit's forward and backward, the
          reduce-scatter after its backward) make them with `empty`, and FSDP's tracker names
          them (all-gather, reduce-scatter, unsharded parameter or gradient) when the
          collective runs; one a hook made and freed unnamed is communication (other).
        With `marks`, each death is also marked in torch's profiler.

        Checked on torch 2.11 and 2.14: `_update_snap(u_type, winfo, old_mem_consumed=None,
        old_reftype=None)` with `_UpdateType` ADD, DEL, REF and SIZE; `winfo.reftype`,
        `winfo.device`, `winfo.mem_consumed` (the new size, on SIZE)."""
        from torch.distributed._tools.mem_tracker import _UpdateType

        mt = self._mt
        index = {name: i for i, name in enumerate(TRACKED)}
        cat_of = {r: index[name] for name, rs in self._kinds.items() for r in rs}
        ACT, TEMP, OPT, UPDATE, OTHER = (index[k] for k in ("act", "temp", "optim", "update",
                                                             "other"))
        hooks = hasattr(mt, "in_hook")
        made, moves, series, final = self._made, self._moves, self._series, self._final

        def settle(key: int, to: int) -> None:
            parts, cat, _ = made.pop(key)
            if to != cat:
                final[key] = to
                now = len(series)
                moves.extend((start, now if end is None else end, nbytes, cat, to)
                             for start, end, nbytes in parts)

        def update_snap(kind, winfo, **kw):
            orig_update_snap(kind, winfo, **kw)
            if kind == _UpdateType.DEL and self._marks:
                self._mark(f"freed:{id(winfo)}")
            if not self._counts(winfo.device):
                return
            key = id(winfo)
            if kind == _UpdateType.ADD:
                cat = cat_of.get(winfo.reftype)
                if cat in (ACT, TEMP, OPT):
                    made[key] = ([(len(series), None, winfo.mem_consumed)], cat,
                                 hooks and mt.in_hook > 0)
            elif key not in made:
                return
            elif kind == _UpdateType.REF:
                settle(key, cat_of.get(winfo.reftype, OTHER))
            elif kind == _UpdateType.DEL:
                if made[key][2]:  # a hook's buffer, never named: communication
                    settle(key, OTHER)
                elif made[key][1] == OPT:  # made by the optimizer step and gone: its temporary
                    settle(key, UPDATE)
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

    def _replace_track_noting_births(self) -> None:
        """Replaces MemTracker's `_track` (files an op's output) and
        `_update_and_maybe_create_winfos` (files a tensor it is handed: the model's, the
        optimizer's, the batch, an RNG state) with themselves, also noting each storage filed
        for the first time (`births`, `_noting_births`).

        Why: the CPU allocator's count and the CUDA timeline file the allocator's blocks under
        the tracker's categories by address, and MemTracker keeps no order of its storages.

        Checked on torch 2.11 and 2.14: `_track(reftype, t)`,
        `_update_and_maybe_create_winfos(t, reftype, update_existing=False)`; `_WINFO`, storage
        -> (record, weak reference)."""
        mt = self._mt
        mt._track = self._noting_births(mt._track, 1)
        mt._update_and_maybe_create_winfos = self._noting_births(
            mt._update_and_maybe_create_winfos, 0)

    @staticmethod
    def _mark(name: str) -> None:
        """A mark in torch's profiler, no operator (the CPU allocator's count, `marks`)."""
        from torch._C._profiler import _RecordFunctionFast

        with _RecordFunctionFast(MARK + name):
            pass

    def _born(self, st: torch.UntypedStorage, record) -> None:
        self._births.append((st.data_ptr(), st.nbytes(), record))
        if self._marks:
            self._mark(f"born:{len(self._births) - 1}")

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
                    self._born(st, winfos[st][0])
            return out

        return wrapped

    def _noting_resizes(self) -> None:
        """Replaces `UntypedStorage.resize_` (MemTracker's, which files the new size) with itself,
        also noting a tracked storage's new allocation as a birth, its old one as a death.

        Why: FSDP frees and refills its unsharded parameters this way, a new block of the
        allocator's under the same storage. Checked on torch 2.11 and 2.14: MemTracker installs
        its `resize_` on entering (this runs after), `_WINFO` as in
        `_replace_track_noting_births`."""
        resize = torch.UntypedStorage.resize_
        winfos = self._mt._WINFO

        @functools.wraps(resize)
        def resize_(st, size):
            before = st.data_ptr()
            resize(st, size)
            record = winfos.get(st, (None, None))[0]
            if record is None or st.data_ptr() == before:
                return
            if before and self._marks:
                self._mark(f"freed:{id(record)}")
            if st.data_ptr():
                self._born(st, record)

        self._patch(torch.UntypedStorage, "resize_", resize_)

    def _tracking_rng_states(self) -> None:
        """Replaces `torch.get_rng_state` and `torch.cuda.get_rng_state` while entered: every
        RNG state copy is tracked as other, and counted in `rng_peak_bytes`.

        Why: they are host tensors no operator makes, so MemTracker's dispatch mode never sees
        them (checkpointing keeps one per recomputed group). Checked on torch 2.11 and 2.14:
        they are filed with MemTracker's `_update_and_maybe_create_winfos(t, reftype)`."""
        other = self._kinds["other"][0]

        def tracked(get):
            @functools.wraps(get)
            def wrapped(*args, **kwargs):
                state = get(*args, **kwargs)
                n = state.untyped_storage().nbytes()
                self._rng_now += n
                self.rng_peak_bytes = max(self.rng_peak_bytes, self._rng_now)
                weakref.finalize(state, self._rng_freed, n)
                self._mt._update_and_maybe_create_winfos(state, other)
                return state
            return wrapped

        self._patch(torch, "get_rng_state", tracked(torch.get_rng_state))
        self._patch(torch.cuda, "get_rng_state", tracked(torch.cuda.get_rng_state))

    def _rng_freed(self, n: int) -> None:
        self._rng_now -= n

    def _patch(self, owner, name: str, fn) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    def _unpatch(self) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched = []

    def gradients(self, grads: list[torch.Tensor]) -> None:
        """The parameters' gradients, at the end of the update: any of them the tracker still
        files as a temporary (FSDP2's sharded gradients, which its post-backward makes and its
        tracker never retags) was gradient memory from the moment it was made."""
        grads_at = TRACKED.index("grads")
        for g in grads:
            info = self._mt._WINFO.get(local(g).untyped_storage(), (None, None))[0]
            if info is not None and id(info) in self._made:
                parts, cat, _ = self._made.pop(id(info))
                self._final[id(info)] = grads_at
                now = len(self._series)
                self._moves.extend((start, now if end is None else end, nbytes, cat, grads_at)
                                   for start, end, nbytes in parts)

    def _counts(self, dev: torch.device) -> bool:
        if self._device is None:
            return True
        counts = self._counted.get(dev)
        if counts is None:
            counts = self._counted[dev] = torch.device(dev).type == self._device.type
        return counts

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

    def _record(self, mt) -> None:
        """One timeline event: its time, phase, module and recomputation (its bytes per category
        are the series' row, filed again after the step, `_refile`)."""
        self.events.append((time.perf_counter() - self._t0, self.phase, self.module_now(),
                            bool(mt._in_ac)))

    def category(self, record) -> str:
        """The category a tracked storage's record was last filed under (a gradient as a
        gradient, an update's temporary as `update`, from their start)."""
        again = self._final.get(id(record))
        return TRACKED[again] if again is not None else self._category.get(record.reftype,
                                                                            "other")

    def births(self) -> list[tuple[int, int, str]]:
        """The storages the step made, (address, bytes, category as last filed: a gradient as
        a gradient from its start), in the order the tracker saw them (with `births=True`)."""
        return [(addr, n, self.category(w)) for addr, n, w in self._births or ()]

    def cpu_records(self) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str, int]]]:
        """(the storages the step found, (record id, bytes, category); its births, (address,
        bytes, category, record id)): what `allocator.cpu_peaks` files allocations under."""
        return ([(id(w), n, self.category(w)) for w, n in self.start_records],
                [(addr, n, self.category(w), id(w)) for addr, n, w in self._births or ()])

    def __enter__(self) -> PeakTracker:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        # Python's cycle collector paused through the step: tensors held by reference cycles
        # (torch 2.11's non-reentrant checkpoint makes some) then die when the step ends, not
        # whenever a collection happens to run, so the same step measures the same peak in any
        # process (it was lower in a process's first step, where a collection fell mid-step).
        # No collection first: garbage from before the step is not counted, and a full
        # collection in a large process costs more than a small step.
        self._gc_was = gc.isenabled()
        gc.disable()
        self._t0, self.wall0 = time.perf_counter(), time.time()
        self._mt.__enter__()
        self._tracking_rng_states()
        from torch.distributed._tools import mem_tracker

        self._patch(mem_tracker, "tree_map_only", _map_only(mem_tracker.tree_map_only))
        if self.events is not None:  # the timeline's modules (after MemTracker's hooks: its
            # module tracker has named the module when ours runs)
            self._hooks = [register_module_forward_pre_hook(self._enter_forward),
                           register_module_forward_hook(self._leave_forward, always_call=True)]
        if self._births is not None:  # what the step finds: parameters, state, the batch
            self._noting_resizes()
            found = [(st, w) for st, (w, _) in list(self._mt._WINFO.items()) if st.data_ptr()]
            self.start_storages = [(st.data_ptr(), self.category(w)) for st, w in found]
            self.start_records = [(w, w.mem_consumed) for _, w in found]
        return self

    def __exit__(self, *exc) -> None:
        if self._gc_was:
            gc.enable()
        for h in self._hooks:
            h.remove()
        self._hooks, self._forwards = [], []
        self._unpatch()
        self._mt.__exit__(*exc)
        series = self._refile()  # [op, category] (numpy: a step has thousands of ops)
        P, B, OPT, U, G, A, T, X = range(len(TRACKED))
        if self.events is not None:
            self.events = [(*e, *v) for e, v in zip(self.events, series.tolist())]
        self._made = {}

        def row(values) -> list[int]:  # the series at the first op where `values` is largest
            return [int(v) for v in series[int(values.argmax())]] if len(series) \
                else [0] * len(TRACKED)

        totals = series.sum(axis=1)
        at = row(totals)
        self.peak_bytes = sum(at)
        self.at_peak = {"params": at[P], "buffers": at[B], "grads": at[G], "optim": at[OPT],
                        "update": at[U], "act": at[A] + at[T], "other": at[X]}
        self.act_temp_peak_bytes = int((series[:, A] + series[:, T]).max()) if len(series) else 0
        # At the activation peak, act is exactly act_peak_bytes; backward temporaries go to other.
        a = row(series[:, A])
        self.act_peak_bytes = a[A]
        self.at_act_peak = {"params": a[P], "grads": a[G], "optim": a[OPT], "act": a[A],
                            "other": a[B] + a[X] + a[T] + a[U]}
        self._series = []

    def _refile(self):
        """The series of the step in TRACKED's categories, each move applied: what it turned
        out to be, from the op it was made at (`from`, inclusive) to the op it was named at
        (`to`, exclusive)."""
        import numpy as np

        if not self._series:
            return np.zeros((0, len(TRACKED)), dtype=np.int64)
        raw = np.asarray(self._series, dtype=np.int64).reshape(len(self._series), -1)
        series = np.insert(raw, TRACKED.index("update"), 0, axis=1)
        diff = np.zeros((series.shape[0] + 1, series.shape[1]), dtype=np.int64)
        for start, end, nbytes, cat, to in self._moves:
            if end > start and nbytes:
                diff[start, cat] -= nbytes
                diff[start, to] += nbytes
                diff[end, cat] += nbytes
                diff[end, to] -= nbytes
        self._moves = []
        return series + np.cumsum(diff[:-1], axis=0)


def _map_only(tree_map_only):
    """MemTracker's `tree_map_only`, which its dispatch mode calls on every op's output to file
    each tensor: the same calls and result, without the pytree walk where the output is one
    tensor or a plain tuple or list of them (most ops), a good part of the tracker's own time
    in a step of many small ops."""

    def mapped(cls, fn, tree):
        if cls is torch.Tensor:
            if isinstance(tree, torch.Tensor):
                return fn(tree)
            if type(tree) in (tuple, list) and all(
                    t is None or isinstance(t, torch.Tensor) for t in tree):
                return type(tree)(t if t is None else fn(t) for t in tree)
        return tree_map_only(cls, fn, tree)
    return mapped


def _memtracker(external: tuple) -> tuple:
    """torch's tracker of a step over `external` (the model, its optimizer, the batch) and the
    tracker's categories behind each part of a breakdown: FSDP's tracker, which tells shards
    from gathered copies, when the model is sharded by FSDP2; MemTracker otherwise."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    kinds = _kinds(external[0] if external else None)
    if kinds is not None:
        model, optimizer, *rest = external
        mt = _fsdp_tracker()(model, optimizer)
        mt.track_inputs(tuple(t for t in rest if isinstance(t, torch.Tensor)))
        return mt, kinds
    mt = MemTracker()
    mt.track_external(*external)
    return mt, {"params": [_MemRefType.PARAM], "buffers": [_MemRefType.BUFFER],
                "grads": [_MemRefType.GRAD], "optim": [_MemRefType.OPT],
                "act": [_MemRefType.ACT], "temp": [_MemRefType.TEMP],
                "other": [_MemRefType.OTH]}


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
    reduce-scatter after its backward.

    Replaces (in a subclass) FSDPMemTracker's wrappers of those hooks, `_fsdp_state_pre_forward`,
    `_fsdp_state_post_forward`, `_fsdp_param_group_pre_backward` and
    `_fsdp_param_group_post_backward`, each `(self, fsdp_mod, orig)` returning the hook it
    installs, with the same hook counting itself in `in_hook` while it runs. Why: the buffers
    those hooks make are named by the tracker only when their collective runs, and one made
    and freed unnamed is communication (`_replace_update_snap`). Checked on torch 2.11 and
    2.14."""
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


def local(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of `t`: a DTensor's local shard (FSDP's parameters, gradients and
    optimizer state), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t
