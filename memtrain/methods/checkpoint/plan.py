"""Profiler, activation-peak model and budget planner of the checkpoint method (after MONeT).

A plan is a list of checkpointed groups `(first, last)` of consecutive segments; every other
segment is kept. The peak model, in bytes of activation memory (what the CPU tracker's
`mem_peak_act_bytes` counts, recomputation included):

- in every row below, the chain's input when the step made it (`held_in`: the first segment
  keeps it, saved by its ops or by its checkpoint) and the side inputs the step made (the same
  for every segment: a decoder's rotary cos and sin, kept by the segments' ops or checkpoints
  until the first one's backward; one that no op saves, `side`, only where a group is
  recomputed), and from the forward's end on the model's output (`output`: the training step
  keeps it until the update; a language model's logits);
- end of forward: tail + inner bytes of every kept segment + the autocast weight casts of every
  checkpointed one (autocast caches them until the forward ends) + every live boundary, where a
  boundary (a segment's output) is live unless it lies strictly inside a checkpointed group
  (the checkpoint keeps only the group's input; the next segment keeps the group's output);
- recompute of group (a, e) during backward: everything live before segment a (later segments
  and the tail are freed by then) + the group's inner bytes + its internal boundaries + its
  output when the group's last op saves it, or, where more, what a segment of the group makes
  at once while it recomputes over what the group's earlier segments keep (`rec_peak`);
- forward of segment i: what is held before it + its input + its `transient` (what its forward
  makes at once with nothing saved, as a checkpointed forward runs: `transients`).

The peak is the largest of these. The planner minimises the recomputed forward FLOPs
(deterministic; times when no FLOPs were profiled) subject to peak <= budget as a 0-1
program (scipy.optimize.milp, HiGHS): one variable per kept segment, one per candidate group,
each segment covered once, one recompute constraint per group start (`_program`).
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memtrain.memory import measure
from memtrain.methods.checkpoint.segments import Segment

Group = tuple[int, int]


@dataclass
class Profile:
    """Per segment: `inner` saved bytes (boundaries excluded), `out` output bytes, whether the
    segment's own ops save its output (`out_saved`), forward `time` in seconds; `tail` saved
    bytes outside every segment (the head, the loss); `step_time` of one baseline forward +
    backward."""

    names: list[str]
    inner: list[int]
    out: list[int]
    out_saved: list[bool]
    time: list[float]
    tail: int = 0
    step_time: float = float("nan")
    cast: list[int] = field(default_factory=list)  # autocast copies of weights, within inner
    # forward multiply-adds x 2 of the segment's convolutions and linear layers: the planner's
    # cost (deterministic, unlike a clock on a shared machine); empty: the measured times
    flops: list[int] = field(default_factory=list)
    # inner bytes as a recomputation in backward keeps them, where they differ (in a stack the
    # inner methods' saved-tensor hooks are off by then: quantize's are full precision again)
    recompute: list[int] = field(default_factory=list)
    # the peak bytes a segment's forward makes while it runs with nothing saved (a checkpointed
    # forward: its input excluded, its output included; `transients`); empty: not measured
    transient: list[int] = field(default_factory=list)
    # the peak bytes a segment's forward makes while it runs and saves (a recompute: its input
    # excluded; `transients`), over the whole forward (`rec_peak`) and up to its last op that
    # saves (`rec_last`: a recompute stops there, torch's early stop), empty: not measured
    rec_peak: list[int] = field(default_factory=list)
    rec_last: list[int] = field(default_factory=list)
    # FSDP (set by the method, never cached): the parameter bytes a rank gathers beyond its
    # shard to run each segment's forward; a recomputed group gathers its earlier segments
    # again, one at a time, while its last one's are gathered for its backward anyway
    gathered: list[int] = field(default_factory=list)
    # the chain's input where the step made it (an entry's output, not the batch), and the side
    # inputs the step made that an op saves: the segments' ops or their checkpoints keep them
    # from the entry's forward to the first segment's backward, in every row (out of `inner`
    # and `tail`)
    held_in: int = 0
    # the side inputs the step made that no op saves: a recomputed group's checkpoint keeps them
    # for its recompute, so a plan that recomputes holds them in every row (none does not)
    side: int = 0
    # the model's output where no segment made it and nothing saves it (a head's logits): the
    # training step keeps it until the update, so it is alive from the forward's end on
    output: int = 0

    def __post_init__(self):
        self.cast = self.cast or [0] * len(self.names)

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def baseline_peak(self) -> int:
        return peak_bytes(self, [])


@dataclass
class Plan:
    groups: list[Group]
    peak: int
    recompute_s: float
    step_time: float = float("nan")
    extra: dict = field(default_factory=dict)

    @property
    def overhead(self) -> float:
        """Predicted extra step time: recomputed forward time / baseline step time."""
        return self.recompute_s / self.step_time


class Infeasible(Exception):
    def __init__(self, min_peak: int):
        super().__init__(f"smallest feasible peak {min_peak}")
        self.min_peak = min_peak


# ---------------------------------------------------------------- the peak model


def _live(p: Profile, groups: list[Group]) -> tuple[list[bool], list[bool]]:
    kept = [True] * p.n
    live = [True] * p.n  # boundary j = output of segment j
    for a, e in groups:
        for i in range(a, e + 1):
            kept[i] = False
        for j in range(a, e):
            live[j] = False
    return kept, live


def _recompute_bytes(p: Profile, a: int, e: int) -> int:
    """What the recompute of group (a, e) holds at its peak: every segment's saved bytes and
    internal boundaries, and, where measured, what a segment makes at once while it recomputes
    over what the segments before it in the group hold (a block's downsample output, alive
    until the residual add; the stem's max-pool output)."""
    inner = p.recompute or p.inner
    gathered = max(p.gathered[a:e], default=0) if p.gathered else 0
    kept = sum(inner[a:e + 1]) + sum(p.out[a:e]) + (p.out[e] if p.out_saved[e] else 0) + gathered
    if not p.rec_peak or p.recompute:
        return kept
    before, most = 0, 0
    for i in range(a, e + 1):
        most = max(most, before + (p.rec_last[i] if i == e else p.rec_peak[i]))
        before += inner[i] + p.out[i]
    return max(kept, most + gathered)


def peak_bytes(p: Profile, groups: list[Group], extra: list[int] | None = None,
               less: list[int] | None = None, transient: list[int] | None = None,
               cached: list[int] | None = None) -> int:
    """Modelled activation peak of a plan (see the module docstring); `extra[i]`: bytes a
    recomputed segment i holds from its forward until its recompute (op-level plans: the
    outputs of its kept ops, `ops.py`); `cached[i]`: the part of `extra[i]` that no op saves
    for backward, so that its group's recompute holds it beside the recomputed saves until it
    reaches the op (op-level plans: a kept output that only feeds an op which saves nothing,
    as a block's last projection feeds its residual add); `less[i]`: bytes a kept segment i
    holds less than its profile says, and a recomputed one recomputes less (op-level plans:
    its compaction, `compact.py`); `transient`: the segments' forward transients where they
    differ from the profile's (compacted ones)."""
    kept, live = _live(p, groups)
    extra = extra or [0] * p.n
    less = less or [0] * p.n
    cached = cached or [0] * p.n
    held_in = p.held_in + (p.side if groups else 0)
    held = [(p.inner[i] - less[i]) * kept[i] + extra[i] * (not kept[i]) + p.out[i] * live[i]
            for i in range(p.n)]
    held_before = list(itertools.accumulate(held, initial=0))  # [i]: sum(held[:i])
    after = held_in + p.output  # held in every row from the forward's end on
    peaks = [p.tail + held_before[-1] + sum(c for c, k in zip(p.cast, kept) if not k) + after]
    for a, e in groups:
        peaks.append(held_before[a] + _recompute_bytes(p, a, e) - sum(less[a:e + 1])
                     + sum(cached[a:e + 1]) + after)
    transient = transient or p.transient
    # the forward of segment i: what is held before it (a recomputed segment's cast copies
    # too, and its input, the output of segment i - 1, live or not), its own transient (what a
    # recomputed segment's forward makes and drops), and in a recomputed one the outputs of
    # its kept ops (op-level plans: all of them at once, a bound, for a row the 0-1 program
    # can hold); running sums: one pass, not one per segment
    before, out, cast = 0, p.out, p.cast
    for i, t in enumerate(transient):
        gone_input = out[i - 1] * (not live[i - 1]) if i else 0
        peaks.append(before + gone_input + t + held_in + extra[i] * (not kept[i]))
        before += held[i] + cast[i] * (not kept[i])
    return max(peaks)


def recompute_cost(p: Profile) -> list[float]:
    """What the planner minimises per segment: its FLOPs when profiled, else its time."""
    return [float(f) for f in p.flops] if any(p.flops) else list(p.time)


def recompute_time(p: Profile, groups: list[Group]) -> float:
    return sum(sum(p.time[a:e + 1]) for a, e in groups)


def make_plan(p: Profile, groups: list[Group]) -> Plan:
    return Plan(list(groups), peak_bytes(p, groups), recompute_time(p, groups), p.step_time)


def uniform_groups(n: int, every: int) -> list[Group]:
    """Consecutive groups of `every` segments, all checkpointed (the last may be shorter)."""
    return [(a, min(a + every, n) - 1) for a in range(0, n, every)]


# ---------------------------------------------------------------- the 0-1 program


def _program(p: Profile, max_group: int):
    """Matrices of the program: variables [kept_0..kept_{n-1}, z_g for g in groups].

    The recompute rows are one per group start a, `rows[a] @ x <= B - consts[a]`: what is held
    before a (`prefix`) plus R_g z_g for every group g that starts at a. The cover lets at most
    one group start at a, so the row is that group's recompute where one does; where none
    does, it says prefix <= B, which the end-of-forward row implies (it holds everything the
    prefix holds, and more). No big-M term: the program's relaxation stays tight."""
    n = p.n
    groups = [(a, e) for a in range(n) for e in range(a, min(n, a + max_group))]
    nv = n + len(groups)
    mib = float(2**20)  # bytes in MiB keep the coefficients well scaled for HiGHS
    inner, out = np.array(p.inner) / mib, np.array(p.out) / mib
    cover = np.zeros((n, nv))
    fwd = np.zeros(nv)  # end-of-forward bytes = fwd_const + fwd @ x
    cast = np.array(p.cast) / mib
    fwd[:n] = inner - cast  # a recomputed segment still holds its casts until the forward ends
    # `peak_bytes`: held in every row from the forward's end (the side inputs no op saves,
    # which only a recomputing plan holds, in every row: a bound where nothing recomputes)
    after = (p.held_in + p.side + p.output) / mib
    fwd_const = p.tail / mib + out.sum() + cast.sum() + after
    for g, (a, e) in enumerate(groups):
        cover[a:e + 1, n + g] = 1
        fwd[n + g] = -out[a:e].sum()
    np.fill_diagonal(cover[:, :n], 1)
    rows, consts = np.zeros((n, nv)), np.zeros(n)
    for a in range(n):
        rows[a, :a] = inner[:a]
        for h, (a2, e2) in enumerate(groups):  # boundaries before a that a group hides
            lo, hi = a2, min(e2, a)
            if hi > lo:
                rows[a, n + h] -= out[lo:hi].sum()
        consts[a] = out[:a].sum() + after
    for g, (a, e) in enumerate(groups):
        rows[a, n + g] += _recompute_bytes(p, a, e) / mib
    cost = np.zeros(nv)
    seg_cost = recompute_cost(p)
    cost[n:] = [sum(seg_cost[a:e + 1]) for a, e in groups]
    cost[n:] /= max(cost[n:].max(), 1e-30)  # well scaled for HiGHS
    return groups, cover, fwd, fwd_const, rows, consts, cost, mib


def _transient_rows(p: Profile, groups: list[Group], nv: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, consts): the forward of segment i, row @ x + const <= B, one per segment with a
    measured transient: kept segments before i hold their inner bytes, recomputed ones their
    autocast casts; boundaries before i are live unless a group hides them, and i's input
    always is (`peak_bytes`)."""
    n, mib = p.n, float(2**20)
    inner, out, cast = (np.array(v, dtype=float) / mib for v in (p.inner, p.out, p.cast))
    rows, consts = np.zeros((len(p.transient), nv)), np.zeros(len(p.transient))
    for i, t in enumerate(p.transient):
        rows[i, :i] = inner[:i] - cast[:i]
        for h, (a2, e2) in enumerate(groups):  # boundaries before i - 1 that a group hides
            hi = min(e2, i - 1)
            if hi > a2:
                rows[i, n + h] -= out[a2:hi].sum()
        consts[i] = cast[:i].sum() + out[:i].sum() + (t + p.held_in + p.side) / mib
    return rows, consts


def _solve(p: Profile, budget: float | None, max_group: int) -> list[Group] | None:
    """budget None: minimise the peak (an extra continuous variable B); else minimise time.
    None when the program has no solution."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    groups, cover, fwd, fwd_c, rows, consts, cost, mib = _program(p, max_group)
    n, nv = p.n, len(cost)
    free_b = budget is None
    width = nv + free_b
    pad = (lambda m: np.hstack([m, np.zeros((m.shape[0], 1))])) if free_b else (lambda m: m)
    a_fwd, a_rec = pad(fwd[None, :]), pad(rows)
    if free_b:  # ... - B <= rhs
        a_fwd[:, -1] = -1
        a_rec[:, -1] = -1
        ub_fwd, ub_rec = -fwd_c, -consts
    else:
        b = budget / mib
        ub_fwd, ub_rec = b - fwd_c, b - consts
    c = np.append(np.zeros(nv), 1.0) if free_b else cost
    cons = [LinearConstraint(pad(cover), 1, 1), LinearConstraint(a_fwd, -np.inf, ub_fwd),
            LinearConstraint(a_rec, -np.inf, ub_rec)]
    if p.transient:
        trows, tconsts = _transient_rows(p, groups, nv)
        a_tr = pad(trows)
        if free_b:
            a_tr[:, -1] = -1
        cons.append(LinearConstraint(a_tr, -np.inf, (0.0 if free_b else budget / mib) - tconsts))
    integrality = np.append(np.ones(nv), 0) if free_b else np.ones(nv)
    lo = np.zeros(width)
    hi = np.append(np.ones(nv), np.inf) if free_b else np.ones(width)
    # mip_rel_gap=0: the optimum, not whichever plan within HiGHS's default 0.01% gap it met first
    res = milp(c, constraints=cons, integrality=integrality, bounds=Bounds(lo, hi),
               options={"mip_rel_gap": 0.0})
    if res.x is None:
        return None
    return sorted(groups[g] for g in range(len(groups)) if res.x[n + g] > 0.5)


def plan_budget(p: Profile, budget: float, max_group: int | None = None) -> Plan:
    """The plan of least recompute time whose modelled peak is <= budget (bytes).

    Raises `Infeasible` with the smallest achievable peak when no plan fits.
    """
    max_group = max_group or p.n
    t0 = time.perf_counter()
    target = float(budget)
    for _ in range(3):
        groups = _solve(p, target, max_group)
        if groups is None:
            break
        plan = make_plan(p, groups)
        if plan.peak <= budget:
            plan.extra["solve_s"] = time.perf_counter() - t0
            return plan
        # within the solver's tolerance but over by bytes: tighten by the excess and re-solve
        target -= plan.peak - budget + 1
    raise Infeasible(min_peak(p, max_group))


def min_peak(p: Profile, max_group: int | None = None) -> int:
    """The smallest modelled peak any plan reaches."""
    return peak_bytes(p, _solve(p, None, max_group or p.n))


def brute_force(p: Profile, budgets: list[float],
                max_group: int | None = None) -> list[Plan | None]:
    """Exhaustive search over every plan (tests: small n only): for each budget, the plan of
    least recompute time within it (None where none fits), all found in one pass."""
    max_group = max_group or p.n
    best: list[Plan | None] = [None] * len(budgets)
    best_cost = [float("inf")] * len(budgets)
    seg_cost = recompute_cost(p)
    for groups in _all_plans(p.n, 0, max_group):
        plan = make_plan(p, groups)
        cost = sum(sum(seg_cost[a:e + 1]) for a, e in groups)
        for k, b in enumerate(budgets):
            if plan.peak <= b and cost < best_cost[k]:
                best[k], best_cost[k] = plan, cost
    return best


def _all_plans(n: int, i: int, max_group: int) -> Iterator[list[Group]]:
    if i == n:
        yield []
        return
    for rest in _all_plans(n, i + 1, max_group):  # segment i kept
        yield rest
    for e in range(i, min(n, i + max_group)):  # segment i starts a checkpointed group
        for rest in _all_plans(n, e + 1, max_group):
            yield [(i, e), *rest]


# ---------------------------------------------------------------- the profiler


class _Recorder(measure.SavedBytes):
    """Counts saved storages like SavedBytes and attributes each to the segment whose forward
    packed it."""

    def __init__(self, model: nn.Module, segments: list[Segment], x: torch.Tensor, device,
                 count_flops: bool = True):
        super().__init__(exclude=measure.alive_before_step(model, x))
        self.device = device
        self.saved: dict[tuple[str, int], tuple[int, int]] = {}  # key -> (bytes, segment or -1)
        # Autocast's copy of a weight: same shape as one of the segment's parameters, another
        # dtype (a heuristic; activations practically never share a weight's shape).
        self.weight_shapes = [{(tuple(q.shape), q.dtype) for m in seg.modules()
                               for q in m.parameters()} for seg in segments]
        self.casts: set[tuple[str, int]] = set()
        self.outputs: list[torch.Tensor | None] = [None] * len(segments)
        self.first_input: torch.Tensor | None = None  # the chain's input, where the step made it
        self.side_inputs: list[torch.Tensor] = []  # the first segment's other tensor arguments
        self.on_pack: Callable[[torch.Tensor], None] | None = None  # told of every save
        self.times = [0.0] * len(segments)
        self.current = -1
        self._t0 = 0.0
        self.handles = []
        self.flops = [0] * len(segments)
        for i, seg in enumerate(segments):
            mods = seg.modules()
            self.handles.append(mods[0].register_forward_pre_hook(self._enter(i),
                                                                  with_kwargs=True))
            self.handles.append(mods[-1].register_forward_hook(self._leave(i)))
            for m in (m for top in mods for m in top.modules()):
                if count_flops and isinstance(m, nn.Conv2d | nn.Linear):  # (its ops: not
                    # under an op profile, whose op sequence must be the forward's own)
                    self.handles.append(m.register_forward_hook(self._count(i)))

    def _count(self, i: int):
        def hook(mod, _args, out):
            w = mod.weight  # conv: out [N, Co, H, W] x (Ci/groups * kh * kw); linear: x in
            self.flops[i] += 2 * out.numel() * (w[0].numel())
        return hook

    def _enter(self, i: int):
        def hook(_mod, args, kwargs):
            measure.sync(self.device)
            self.current, self._t0 = i, time.perf_counter()
            if i == 0 and args and isinstance(args[0], torch.Tensor) and \
                    measure.storage_key(args[0]) not in self._exclude:  # made, not the batch
                self.first_input = args[0]
            if i == 0:  # side inputs the step made (a causal mask, rotary cos and sin)
                self.side_inputs = [
                    t for t in tree_flatten((args[1:], kwargs))[0]
                    if isinstance(t, torch.Tensor) and measure.storage_key(t) not in self._exclude]
        return hook

    def _leave(self, i: int):
        def hook(_mod, _args, out):
            measure.sync(self.device)
            self.times[i] = time.perf_counter() - self._t0
            self.outputs[i], self.current = out, -1
        return hook

    def record(self, key: tuple[str, int], t: torch.Tensor) -> None:
        if self.on_pack is not None:
            self.on_pack(t)
        if key in self.saved:
            return
        super().record(key, t)
        self.saved[key] = (t.untyped_storage().nbytes(), self.current)
        if self.current >= 0:  # (autocast reads as off inside autograd's hooks)
            shapes = self.weight_shapes[self.current]
            if any(sh == tuple(t.shape) and dt != t.dtype for sh, dt in shapes):
                self.casts.add(key)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def profile(model: nn.Module, segments: list[Segment], x: torch.Tensor,
            loss_fn: Callable[[torch.Tensor], torch.Tensor], autocast=None,
            repeats: int = 3, scale: float = 1.0) -> Profile:
    """Measure every segment on `x` (the run's device and precision) without changing the model:
    buffers (BatchNorm statistics), gradients and the RNG state are restored afterwards.

    `scale` multiplies bytes and times (profiling on a slice of the batch). On fake tensors
    (a probe) the baseline step is not timed: its `step_time` is three of the segments'
    forwards (a backward costs about two), in the units of their times, what a probe's plan
    sums its recomputation in (a probe's clock times dispatch, not kernels)."""
    autocast = autocast or contextlib.nullcontext
    device = x.device
    steps, per_seg = [], []
    with unchanged(model, device):
        for _ in range(0 if is_fake(x) else repeats):  # baseline step time
            measure.sync(device)
            t0 = time.perf_counter()
            with autocast():
                loss = loss_fn(model(x))
            loss.backward()
            measure.sync(device)
            steps.append(time.perf_counter() - t0)
        for _ in range(repeats):  # per-segment forward times and saved storages
            rec = _Recorder(model, segments, x, device)
            try:
                with rec, autocast():
                    out = model(x)
                    # the loss's saves (a language model's log-softmax): held at the forward's
                    # end, in `tail`, as the head's
                    kept_loss = loss_fn(out)
            finally:
                rec.close()
            del kept_loss
            per_seg.append(rec.times)
        result = _attribute(rec, segments, out)
        result.flops = list(rec.flops)
        del out
        result.transient, result.rec_peak, result.rec_last = transients(model, segments, x,
                                                                        autocast, scale)
    result.time = [statistics.median(ts[1:] or ts) * scale
                   for ts in zip(*per_seg)]  # first forward warms caches up
    result.step_time = (statistics.median(steps[1:] or steps) * scale if steps
                        else 3 * sum(result.time))
    for k in ("inner", "out", "cast", "flops"):
        setattr(result, k, [int(v * scale) for v in getattr(result, k)])
    result.tail, result.held_in, result.output, result.side = (int(v * scale) for v in (
        result.tail, result.held_in, result.output, result.side))
    return result


class _Live(TorchDispatchMode):
    """Bytes of the storages that ops make, alive now (a weak reference on each storage); per
    segment, after each of its ops, what is alive over what was when it began (`trace`), and
    how many of its ops had run at its last save for backward (`saved_after`)."""

    def __init__(self, n: int):
        super().__init__()
        self.live, self.current, self.base = 0, -1, 0
        self.alive: dict[tuple[str, int], int] = {}
        self.keep = False  # saves kept (a recompute) or dropped (a checkpointed forward)
        self.trace: list[list[int]] = [[] for _ in range(n)]  # alive over base, per op
        self.saved_after = [0] * n  # ops run when the segment last saved a tensor

    def pack(self, t):  # a save for backward, right after the op that made it
        if self.current >= 0:
            self.saved_after[self.current] = len(self.trace[self.current])
        return t if self.keep else None

    def _free(self, key) -> None:
        self.live -= self.alive.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = {measure.storage_key(t) for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):  # fresh storages only (not views, not in place)
                key = measure.storage_key(t)
                if key not in self.alive and key not in ins:
                    st = t.untyped_storage()
                    self.alive[key] = st.nbytes()
                    self.live += st.nbytes()
                    weakref.finalize(st, self._free, key)
        if self.current >= 0:
            self.trace[self.current].append(self.live - self.base)
        return out

    def enter(self, i: int):
        def hook(_mod, _args):
            self.current, self.base = i, self.live
        return hook

    def leave(self, _mod, _args, _out) -> None:
        self.current = -1


def transients(model: nn.Module, segments: list[Segment], x: torch.Tensor, autocast=None,
               scale: float = 1.0) -> tuple[list[int], list[int], list[int]]:
    """Per segment, what its forward makes at once over its input (views and in-place writes
    make nothing; the model unchanged afterwards): `transient`, with every save dropped (a
    checkpointed segment's forward), and with saves kept (a recompute) `rec_peak` over the
    whole forward and `rec_last` up to its last op that saves (where a recompute stops). The
    peak model's rows count what is kept; a recomputed segment's forward can make more than
    that at once (resnet's stem: convolution, BatchNorm and ReLU outputs; a block's downsample
    output until the residual add)."""
    drop, keep = (_trace(model, segments, x, autocast, k) for k in (False, True))
    scaled = lambda v: int(v * scale)  # noqa: E731
    return ([scaled(max(t, default=0)) for t in drop.trace],
            [scaled(max(t, default=0)) for t in keep.trace],
            [scaled(max(t[:k], default=0)) for t, k in zip(keep.trace, keep.saved_after)])


def forward_transients(model: nn.Module, segments: list[Segment], x: torch.Tensor, autocast,
                       scale: float = 1.0) -> list[int]:
    """`transients`' first list alone (one forward, saves dropped)."""
    return [int(max(t, default=0) * scale)
            for t in _trace(model, segments, x, autocast, False).trace]


def _trace(model: nn.Module, segments: list[Segment], x: torch.Tensor, autocast,
           keep: bool) -> _Live:
    """One forward under `_Live`, saves kept or dropped, the model unchanged afterwards."""
    autocast = autocast or contextlib.nullcontext
    live = _Live(len(segments))
    live.keep = keep
    handles = []
    for i, seg in enumerate(segments):
        mods = seg.modules()
        handles.append(mods[0].register_forward_pre_hook(live.enter(i)))
        handles.append(mods[-1].register_forward_hook(live.leave))
    try:
        with unchanged(model, x.device), torch.autograd.graph.saved_tensors_hooks(
                live.pack, lambda t: t), autocast(), live:
            out = model(x)
        del out
    finally:
        for h in handles:
            h.remove()
    return live


@contextlib.contextmanager
def unchanged(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Measuring steps inside leave the model as they found it: buffers (BatchNorm statistics)
    copied back, gradients cleared, the RNG state (CPU, and the device's on CUDA) restored."""
    buffers = {id(b): b.detach().clone() for b in model.buffers()}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield
    with torch.no_grad():
        for b in model.buffers():
            b.copy_(buffers[id(b)])
    for prm in model.parameters():
        prm.grad = None


def tracked_act_peak(model: nn.Module, x: torch.Tensor,
                     loss_fn: Callable[[torch.Tensor], torch.Tensor], autocast,
                     scale: float = 1.0) -> int:
    """The activation peak (`measure.PeakTracker`) of one forward and backward of the model as
    it is, times `scale`; buffers, gradients and the RNG state restored afterwards."""
    with unchanged(model, x.device):
        with measure.PeakTracker(model, x, device=x.device) as tracker:
            with autocast():
                loss = loss_fn(model(x))
            loss.backward()
        del loss
    return int(tracker.act_peak_bytes * scale)


def measured_overhead(model: nn.Module, x: torch.Tensor,
                      loss_fn: Callable[[torch.Tensor], torch.Tensor], autocast,
                      plan_off: Callable[[], None], plan_on: Callable[[], None],
                      repeats: int = 3, clock: Callable[[], float] = time.perf_counter) -> float:
    """The plan's measured extra step time: forward + backward on `x` without the plan
    (`plan_off()`) and with it (`plan_on()`), alternating so both see the same load, one
    untimed pass of each first; median with / median without - 1. The plan is on afterwards;
    buffers, gradients and the RNG state restored."""
    autocast = autocast or contextlib.nullcontext
    times: dict[bool, list[float]] = {False: [], True: []}
    with unchanged(model, x.device):
        for r in range(repeats + 1):
            for on in (False, True):
                (plan_on if on else plan_off)()
                measure.sync(x.device)
                t0 = clock()
                with autocast():
                    loss = loss_fn(model(x))
                loss.backward()
                measure.sync(x.device)
                dt = clock() - t0
                if r:  # the first pass of each warms up
                    times[on].append(dt)
                del loss
                for prm in model.parameters():
                    prm.grad = None
    return statistics.median(times[True]) / statistics.median(times[False]) - 1


def _attribute(rec: _Recorder, segments: list[Segment], model_out: Any = None) -> Profile:
    """The recorder's saved storages per segment (`Profile`), with the chain's input the step
    made (`held_in`, out of the segment or head that saved it) and the model's output that no
    segment made and nothing saved (`output`)."""
    out_keys = {}
    for i, o in enumerate(rec.outputs):
        if not isinstance(o, torch.Tensor):
            raise RuntimeError(f"segment {segments[i].name} did not return one tensor")
        out_keys[measure.storage_key(o)] = i
    n = len(segments)
    first = rec.first_input
    first_key = measure.storage_key(first) if first is not None else None
    side = {measure.storage_key(t) for t in rec.side_inputs} - {first_key} - set(out_keys)
    inner, out_saved, tail, cast = [0] * n, [False] * n, 0, [0] * n
    held_in = first.untyped_storage().nbytes() if first is not None else 0
    side_saved: set = set()
    for k, (nbytes, seg) in rec.saved.items():
        if k in rec.casts:
            cast[seg] += nbytes
        if k in out_keys:
            out_saved[out_keys[k]] |= seg == out_keys[k]
        elif k == first_key:
            continue  # `held_in`
        elif k in side:
            held_in += nbytes
            side_saved.add(k)
        elif seg >= 0:
            inner[seg] += nbytes
        else:
            tail += nbytes
    unsaved = {measure.storage_key(t): t.untyped_storage().nbytes() for t in rec.side_inputs
               if measure.storage_key(t) in side - side_saved}
    out = [o.untyped_storage().nbytes() for o in rec.outputs]
    output = 0
    if isinstance(model_out, torch.Tensor):
        k = measure.storage_key(model_out)
        if k not in out_keys and k not in rec.saved and k != first_key:
            output = model_out.untyped_storage().nbytes()
    return Profile([s.name for s in segments], inner, out, out_saved, [0.0] * n, tail,
                   cast=cast, held_in=held_in, output=output, side=sum(unsaved.values()))
