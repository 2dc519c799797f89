"""Operator-granularity checkpoint plans (after MONeT and Checkmate): inside every recomputed
group, each op whose output autograd would hold is a decision: keep its output (torch's selective
checkpointing caches it, `CheckpointPolicy.MUST_SAVE`) or recompute it in backward.

The profile (`OpTimer`, a TorchDispatchMode over one instrumented forward) lists every aten op of
every segment in forward order with its fresh output bytes, its forward time (scaled per
segment to the segment's measured forward, `calibrate`), its FLOPs and the bytes it reads and
writes; its cost, what the program minimises, is priced from those (`price`, `method.cost`):
the time, a roofline of FLOPs and bytes (what the time falls back to on a probe's fake tensors,
where no clock means anything), or the FLOPs. A sweep plans every budget on one cached profile
(`cache.py`), so its
plans do not move with the clock from job to job. The 0-1 program is the segment
program of `plan.py` plus one variable y_o per keepable op: y_o <= 1 - kept_i (only ops of
recomputed segments), the kept bytes are held from the forward until the group is recomputed
(end-of-forward row and the recompute rows of later groups), and the objective is the cost of
every recomputed op minus the cost of the kept ones. The plan applies through
`create_selective_checkpoint_contexts` with a policy that checks each op against the profile and
raises on a mismatch, so a plan never silently applies to another op sequence.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

import memtrain.methods.checkpoint.plan as planner
from memtrain.errors import ConfigError
from memtrain.memory import measure

Key = tuple[int, int]  # (segment, op index within the segment's forward)

# Nominal roofline of the cost where no time is measured (fake tensors), per device type:
# FLOP/s and bytes/s. Only their ratio shapes the plan. CPU: fitted once to one
# core of this project's CI machine (resnet50, 224 px, batch 8: convolutions ~50 GFLOP/s,
# training-mode BatchNorm and ReLU ~1.5 GB/s of bytes read + written; 4 GB/s had made
# BatchNorm look 3x cheaper than it runs). CUDA: an A100/H100-class ratio.
ROOFLINE = {"cpu": (5e10, 1.5e9), "cuda": (4e14, 2e12)}
IDEMPOTENT_INPLACE = {torch.ops.aten.relu_.default}  # f(f(x)) = f(x)


def _allows_mutation() -> bool:
    """Whether this torch's SAC can be told that a cached output changes in place."""
    import inspect

    from torch.utils.checkpoint import create_selective_checkpoint_contexts as sac

    return "allow_cache_entry_mutation" in inspect.signature(sac).parameters


@dataclass
class Op:
    name: str  # str(aten overload), what the policy checks
    nbytes: int  # fresh output storages (what keeping it holds)
    cost: float  # what the planner minimises (`price`: time, roofline or FLOPs)
    time: float = 0.0  # measured forward time, seconds
    flops: float = 0.0  # torch.utils.flop_counter's count (matmuls, convolutions; else 0)
    moved: int = 0  # bytes its tensor arguments and outputs hold (read + written)
    keepable: bool = True  # fresh outputs, not the segment's output, never overwritten later
    # (but by an idempotent in-place op as its first use: `relu_` after BatchNorm)
    relu_after: bool = False  # its cached output then holds relu(output); recompute reapplies it
    # bytes of its fresh outputs that no op saves for backward: kept, the recompute holds them
    # beside what it saves again until it reaches the op (`planner.peak_bytes`' `cached`)
    unsaved: int = 0


@dataclass
class Compact:
    """A lossless compaction choice of one kept segment (compact.py measures them)."""

    seg: int  # the segment
    saves: int  # saved bytes the compacted segment keeps less (measured, >= 1)
    cost: float  # the planner's cost (> 0; `price`): roofline of the extra forward ops, their
    # FLOPs, or with measured times `time`
    time: float  # extra measured time of the segment's forward + backward, seconds (>= 0)
    what: str  # "relu x3, max_pool2d x1"
    transient: int = 0  # the compacted forward's transient peak (`plan.transients`)
    flops: float = 0.0  # the extra forward ops' `flop_cost` (what cost=flops prices)
    roofline: float = 0.0  # the extra forward ops' roofline (what cost=roofline prices)


@dataclass
class OpProfile:
    ops: list[list[Op]] = field(default_factory=list)  # per segment, forward order
    compact: list[Compact] = field(default_factory=list)  # lossless choices (compact.py)

    def keys(self) -> list[Key]:
        return [(i, j) for i, seg in enumerate(self.ops) for j, o in enumerate(seg)
                if o.keepable and o.nbytes > 0]


class OpTimer(TorchDispatchMode):
    """Lists the aten ops of the segment that `current()` names (-1: outside every segment)."""

    def __init__(self, n: int, current, device: torch.device):
        super().__init__()
        self.current, self.device = current, device
        self.ops: list[list[Op]] = [[] for _ in range(n)]
        self.producer: dict[tuple[str, int], Key] = {}
        # op -> its fresh storages, each [bytes, saved], marked saved when an op packs it while
        # it lives (told by the storage object: a freed one's address is reused by later ones)
        self.fresh: dict[Key, list[list]] = {}
        self._alive = WeakIdKeyDictionary()  # storage -> its entry in `fresh`
        self.used: set[tuple[str, int]] = set()  # producers' outputs read by some op already
        self.mutable = _allows_mutation()
        self.flops, self.bandwidth = ROOFLINE.get(device.type, ROOFLINE["cuda"])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils import checkpoint
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        seg = self.current()
        # the ops SAC's policy never sees (older torch: detach only)
        ignored = getattr(checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default})
        if seg < 0 or func in ignored:
            return func(*args, **kwargs)
        measure.sync(self.device)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        measure.sync(self.device)
        dt = time.perf_counter() - t0
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        in_keys = {measure.storage_key(t) for t in ins}
        self._writes(func, args, in_keys)
        fresh = {measure.storage_key(t): t.untyped_storage().nbytes() for t in outs
                 if measure.storage_key(t) not in in_keys}
        flop = 0
        if func.overloadpacket in flop_registry:
            flop = flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        moved = sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)
        op = Op(str(func), sum(fresh.values()), flop / self.flops + moved / self.bandwidth, dt,
                flop, moved,
                keepable=bool(outs) and len(fresh) == len({measure.storage_key(t) for t in outs}))
        for k in fresh:
            self.producer[k] = (seg, len(self.ops[seg]))
        entries = self.fresh[(seg, len(self.ops[seg]))] = []
        for t in outs:
            st = t.untyped_storage()
            if measure.storage_key(t) in fresh and st not in self._alive:
                self._alive[st] = [st.nbytes(), False]
                entries.append(self._alive[st])
        self.ops[seg].append(op)
        return out

    def packed(self, t: torch.Tensor) -> None:
        """An op saved t for backward: the fresh storage it lives in is saved."""
        entry = self._alive.get(t.untyped_storage())
        if entry is not None:
            entry[1] = True

    def _writes(self, func, args, in_keys) -> None:
        """An output written in place is not keepable (its cached copy would go stale), unless
        the write is its first use and idempotent (relu_ after BatchNorm: recomputing from the
        cached, already rectified values gives the same values; SAC is told to allow it)."""
        written = {measure.storage_key(v) for a, v in zip(func._schema.arguments, args)
                   if a.alias_info is not None and a.alias_info.is_write
                   and isinstance(v, torch.Tensor)}
        for k in in_keys:
            p = self.producer.get(k)
            if p is None:
                continue
            op = self.ops[p[0]][p[1]]
            first = k not in self.used
            self.used.add(k)
            if k in written:
                if first and func in IDEMPOTENT_INPLACE and self.mutable:
                    op.relu_after = True
                else:
                    op.keepable = False


def profile_ops(model, x: torch.Tensor, rec_factory, repeats: int, scale: float,
                autocast=contextlib.nullcontext, names: list[str] | None = None) -> OpProfile:
    """`repeats` forwards under OpTimer (the first warms up); `rec_factory()` is a fresh
    profiling recorder (`plan._Recorder`) telling the current segment and the outputs.
    Each forward enters `autocast` anew, as a training step does: autocast caches its weight
    casts until the context ends, so one context around every forward would cast in the first
    only, and the op sequence (which the plan's policy checks) would differ between them."""
    runs = []
    for _ in range(repeats):
        rec = rec_factory()
        timer = OpTimer(len(rec.outputs), lambda r=rec: r.current, x.device)
        rec.on_pack = timer.packed
        try:
            with autocast(), rec, timer:
                out = model(x)
        finally:
            rec.close()
        del out
        runs.append(timer.ops)
    ops = runs[-1]
    for k, r in enumerate(runs[:-1]):
        changed = _first_change(r, ops)
        if changed is not None:
            i, j, was, now = changed
            where = names[i] if names and i < len(names) else f"#{i}"
            raise ConfigError(f"method checkpoint: the op sequence changed between profiling "
                              f"forwards {k + 1} and {len(runs)}: in segment {i} ({where}), op "
                              f"{j} was {was} and is {now}; an op plan needs the same ops in "
                              f"every forward (a forward that branches on state it changes, or "
                              f"a chain rule whose segments differ between calls): fix that, or "
                              f"plan whole groups with method.granularity=block")
    out_keys = {measure.storage_key(o) for o in rec.outputs if isinstance(o, torch.Tensor)}
    for i, seg in enumerate(ops):
        for j, o in enumerate(seg):
            later = [r[i][j].time for r in runs[1:]] or [o.time]
            o.time = statistics.median(later) * scale
            o.nbytes, o.cost = int(o.nbytes * scale), o.cost * scale
            o.flops, o.moved = o.flops * scale, int(o.moved * scale)
            o.unsaved = int(scale * sum(b for b, saved in timer.fresh.get((i, j), ())
                                        if not saved))
            if any(timer.producer.get(k) == (i, j) for k in out_keys):
                o.keepable = False  # the segment's output: a boundary, modelled per segment
    return OpProfile(ops)


def _first_change(a: list[list[Op]], b: list[list[Op]]) -> tuple[int, int, str, str] | None:
    """(segment, op index, op in `a`, op in `b`) where two forwards' op sequences first differ
    ("none": one ends there), or None when they are the same."""
    for i in range(max(len(a), len(b))):
        sa = a[i] if i < len(a) else []
        sb = b[i] if i < len(b) else []
        for j in range(max(len(sa), len(sb))):
            na = sa[j].name if j < len(sa) else "none"
            nb = sb[j].name if j < len(sb) else "none"
            if na != nb:
                return i, j, na, nb
    return None


# ---------------------------------------------------------------- plans and the program


def held_extra(prof: OpProfile, n: int, keep: set[Key], unsaved: bool = False) -> list[int]:
    """Per segment, the bytes of its kept ops' outputs (`unsaved`: of those no op saves)."""
    extra = [0] * n
    for i, j in keep:
        o = prof.ops[i][j]
        extra[i] += o.unsaved if unsaved else o.nbytes
    return extra


def _compacts(prof: OpProfile, groups: list[planner.Group], compact) -> list[Compact]:
    """The compaction choices of the segments in `compact` that the plan keeps (a recomputed
    segment is never compacted: see `compact.py`)."""
    inside = {i for a, e in groups for i in range(a, e + 1)}
    chosen = set(compact) - inside
    return [c for c in prof.compact if c.seg in chosen]


def op_plan(p: planner.Profile, prof: OpProfile, groups: list[planner.Group],
            keep: set[Key], compact=()) -> planner.Plan:
    """The plan of these groups with these ops kept and these kept segments compacted (keeps
    outside the groups and compactions inside them are dropped)."""
    inside = {i for a, e in groups for i in range(a, e + 1)}
    keep = {k for k in keep if k[0] in inside}
    comp = _compacts(prof, groups, compact)
    rec = sum(o.time for i in inside for j, o in enumerate(prof.ops[i]) if (i, j) not in keep)
    less = [0] * p.n
    transient = list(p.transient)
    for c in comp:
        less[c.seg] = c.saves
        if transient:
            transient[c.seg] = c.transient
    plan = planner.Plan(list(groups),
                        planner.peak_bytes(p, groups, held_extra(prof, p.n, keep), less,
                                           transient, held_extra(prof, p.n, keep, True)),
                        rec + sum(c.time for c in comp), p.step_time)
    plan.extra["keep"] = sorted(keep)
    plan.extra["compact"] = sorted(c.seg for c in comp)
    return plan


def op_cost(prof: OpProfile, groups: list[planner.Group], keep: set[Key],
            compact=()) -> float:
    return sum(o.cost for a, e in groups for i in range(a, e + 1)
               for j, o in enumerate(prof.ops[i]) if (i, j) not in keep) + \
        sum(c.cost for c in _compacts(prof, groups, compact))


def _solve(p: planner.Profile, prof: OpProfile, budget: float | None, max_group: int,
           ops: bool) -> tuple[list[planner.Group], set[Key], list[int]] | None:
    """The segment program of `plan.py` with, at op granularity (`ops`; without, block
    granularity on the op costs), a y variable per keepable op (y_o <= 1 - kept_i) and a c
    variable per compaction choice of segment i (`compact.py`): c <= kept_i takes its bytes
    off every row that counts the kept segment (end of forward, recomputes of later groups,
    forwards of later segments) and puts its compacted forward's transient in its own
    forward's row; its cost on the objective. budget None: minimise the peak. Returns (groups,
    kept ops, compacted segments)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    groups, cover, fwd, fwd_c, rows, consts, _, mib = planner._program(p, max_group)
    n, ng = p.n, len(groups)
    keys = prof.keys() if ops else []
    comp = prof.compact if ops else []
    nk, nc = len(keys), len(comp)
    seg = np.array([i for i, _ in keys], dtype=int)
    unsaved = np.array([prof.ops[i][j].unsaved for i, j in keys]) / mib
    # w_(a, i): the kept outputs of segment i that no op saves, held while the group that
    # starts at a recomputes (where it covers i; see below)
    cap = np.bincount(seg, weights=unsaved, minlength=n) if nk else np.zeros(n)
    pairs = [(a, i) for a in range(n) for i in range(a, min(n, a + max_group)) if cap[i] > 0]
    nw = len(pairs)
    seg_cost = [sum(o.cost for o in s) for s in prof.ops]
    width = n + ng + nk + nc + nw
    y = n + ng + np.arange(nk)
    ck = n + ng + nk + np.arange(nc)
    wv = n + ng + nk + nc + np.arange(nw)
    cost = np.zeros(width)
    cost[n:n + ng] = [sum(seg_cost[a:e + 1]) for a, e in groups]
    cost[y] = [-prof.ops[i][j].cost for i, j in keys]
    cost[ck] = [c.cost for c in comp]
    cost /= max(np.abs(cost).max(), 1e-30)
    b = np.array([prof.ops[i][j].nbytes for i, j in keys]) / mib
    saves = np.array([c.saves for c in comp]) / mib
    cseg = np.array([c.seg for c in comp], dtype=int)
    pad = lambda m: np.hstack([m, np.zeros((m.shape[0], nk + nc + nw))])  # noqa: E731
    a_cover, a_fwd, a_rec = pad(cover), pad(fwd[None, :]), pad(rows)
    a_fwd[0, y] = b
    a_fwd[0, ck] = -saves
    for a in range(n):  # the row of group start a (`planner._program`): kept outputs before a
        a_rec[a, y] = np.where(seg < a, b, 0.0)  # are held, compactions before a hold less
        a_rec[a, ck] = np.where(cseg < a, -saves, 0.0)
    # w_(a, i) >= u_i - U_i (1 - s_(a, i)): u_i the unsaved kept bytes of segment i, U_i their
    # most, s_(a, i) = 1 when the group that starts at a covers i; the row of a adds w_(a, i)
    a_w = np.zeros((nw, width))
    for k, (a, i) in enumerate(pairs):
        a_rec[a, wv[k]] = 1.0
        a_w[k, y] = np.where(seg == i, unsaved, 0.0)
        a_w[k, wv[k]] = -1.0
        for g, (a2, e2) in enumerate(groups):
            if a2 == a and e2 >= i:
                a_w[k, n + g] = cap[i]
    ub_w = cap[[i for _, i in pairs]]
    # y_o + kept_i <= 1; c - kept_i <= 0
    excl = [np.zeros((nk, width)), np.zeros((nc, width))]
    excl[0][np.arange(nk), seg] = excl[0][np.arange(nk), y] = 1
    excl[1][np.arange(nc), cseg], excl[1][np.arange(nc), ck] = -1, 1
    a_excl = np.vstack([*excl, a_w])
    ub_excl = np.concatenate([np.ones(nk), np.zeros(nc), ub_w])
    integer = np.append(np.ones(n + ng + nk + nc), np.zeros(nw))  # w is continuous
    hi = np.append(np.ones(n + ng + nk + nc), cap[[i for _, i in pairs]])
    free_b = budget is None
    if free_b:
        extend = lambda m, v: np.hstack([m, np.full((m.shape[0], 1), v)])  # noqa: E731
        a_cover, a_excl = extend(a_cover, 0.0), extend(a_excl, 0.0)
        a_fwd, a_rec = extend(a_fwd, -1.0), extend(a_rec, -1.0)
        ub_fwd, ub_rec = -fwd_c, -consts
        c = np.append(np.zeros(width), 1.0)
        integrality, hi = np.append(integer, 0), np.append(hi, np.inf)
    else:
        bb = budget / mib
        ub_fwd, ub_rec = bb - fwd_c, bb - consts
        c, integrality = cost, integer
    cons = [LinearConstraint(a_cover, 1, 1), LinearConstraint(a_fwd, -np.inf, ub_fwd),
            LinearConstraint(a_rec, -np.inf, ub_rec)]
    if p.transient:  # the forward of each segment (`plan._transient_rows`)
        trows, tconsts = planner._transient_rows(p, groups, n + ng)
        a_tr = pad(trows)
        for i in range(len(trows)):
            a_tr[i, y] = np.where(seg <= i, b, 0.0)  # its own kept ops too (`peak_bytes`)
            a_tr[i, ck] = np.where(cseg < i, -saves, 0.0)
            for m, choice in enumerate(comp):  # compacted, segment i makes other transients
                if choice.seg == i:
                    a_tr[i, ck[m]] += (choice.transient - p.transient[i]) / mib
        if free_b:
            a_tr = extend(a_tr, -1.0)
        cons.append(LinearConstraint(a_tr, -np.inf, (0.0 if free_b else budget / mib) - tconsts))
    if len(a_excl):
        cons.append(LinearConstraint(a_excl, -np.inf, ub_excl))
    res = milp(c, constraints=cons, integrality=integrality, bounds=Bounds(np.zeros(len(c)), hi),
               options={"mip_rel_gap": 0.0, "time_limit": 120.0})
    if res.x is None:
        return None
    chosen = sorted(groups[g] for g in range(ng) if res.x[n + g] > 0.5)
    return (chosen, {keys[k] for k in range(nk) if res.x[y[k]] > 0.5},
            [comp[m].seg for m in range(nc) if res.x[ck[m]] > 0.5])


def plan_budget(p: planner.Profile, prof: OpProfile, budget: float,
                max_group: int | None = None, ops: bool = True) -> planner.Plan:
    """The plan of least recompute cost (`Op.cost`) whose modelled peak is <= budget;
    `planner.Infeasible` with the smallest peak otherwise. `ops=False`: whole segments only."""
    max_group = max_group or p.n
    t0 = time.perf_counter()
    target = float(budget)
    for _ in range(3):
        got = _solve(p, prof, target, max_group, ops)
        if got is None:
            break
        plan = op_plan(p, prof, *got)
        if plan.peak <= budget:
            plan.extra["solve_s"] = time.perf_counter() - t0
            return plan
        target -= plan.peak - budget + 1  # over by the solver's tolerance: tighten, re-solve
    got = _solve(p, prof, None, max_group, ops)
    raise planner.Infeasible(op_plan(p, prof, *got).peak)


def recompute_flops(prof: OpProfile, groups: list[planner.Group], keep: set[Key]) -> float:
    """The FLOPs (torch's flop counter) of every op a plan recomputes."""
    return sum(o.flops for a, e in groups for i in range(a, e + 1)
               for j, o in enumerate(prof.ops[i]) if (i, j) not in keep)


def recomputed_matmuls(prof: OpProfile, groups: list[planner.Group], keep: set[Key]) -> str:
    """The FLOP-carrying ops a plan recomputes, counted by kind: "bmm x11, addmm x2"."""
    c = Counter(short(o.name) for a, e in groups for i in range(a, e + 1)
                for j, o in enumerate(prof.ops[i]) if (i, j) not in keep and o.flops > 0)
    return ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "-"


def brute_force(p: planner.Profile, prof: OpProfile, budget: float) -> planner.Plan | None:
    """Every segment plan x every subset of keepable ops x every subset of the kept segments'
    compactions (tests: tiny instances only)."""
    best, best_cost = None, float("inf")
    keys = prof.keys()
    for groups in planner._all_plans(p.n, 0, p.n):
        inside = {i for a, e in groups for i in range(a, e + 1)}
        cand = [k for k in keys if k[0] in inside] + \
            [c.seg for c in prof.compact if c.seg not in inside]
        for bits in itertools.product((0, 1), repeat=len(cand)):
            on = [k for k, bit in zip(cand, bits) if bit]
            keep = {k for k in on if isinstance(k, tuple)}
            compact = [k for k in on if not isinstance(k, tuple)]
            plan = op_plan(p, prof, groups, keep, compact)
            cost = op_cost(prof, groups, keep, compact)
            if plan.peak <= budget and cost < best_cost - 1e-12:
                best, best_cost = plan, cost
    return best


# ---------------------------------------------------------------- applying a plan


class PlanPolicy:
    """`make()` -> the context_fn of one checkpointed group: a selective-checkpoint policy that
    saves the kept ops' outputs, recomputes the rest, and checks every op name against the
    profile (RuntimeError on a mismatch: the plan was made for another forward)."""

    def __init__(self, names: list[str], keep: set[int], group: str, mutated: bool = False):
        self.names, self.keep, self.group, self.mutated = names, keep, group, mutated

    def make(self):
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        count = itertools.count()

        def policy(ctx, func, *args, **kwargs):
            if ctx.is_recompute:
                return CheckpointPolicy.PREFER_RECOMPUTE
            k = next(count)
            if k >= len(self.names) or self.names[k] != str(func):
                want = self.names[k] if k < len(self.names) else "the end of the group"
                raise RuntimeError(f"checkpoint plan of group {self.group}: op {k} is {func}, "
                                   f"the profile has {want}; the plan does not fit this forward")
            return CheckpointPolicy.MUST_SAVE if k in self.keep else \
                CheckpointPolicy.PREFER_RECOMPUTE

        # a kept output that relu_ rectifies in place (`Op.relu_after`) changes after caching
        kw = {"allow_cache_entry_mutation": True} if self.mutated else {}
        fwd, recompute = create_selective_checkpoint_contexts(policy, **kw)
        if hasattr(fwd, "respect_saved_tensors_hooks"):
            # kept outputs go through the saved-tensor hooks like any saved tensor, so the
            # accounting step's SavedBytes counts them (torch >= 2.12; older: bypassed). Set
            # here: checkpoint() sets it only on a context it recognises, and ours wraps SAC's.
            fwd.respect_saved_tensors_hooks = True
        return _ends_at(fwd, count, len(self.names), self.group), recompute


@contextlib.contextmanager
def _ends_at(ctx, count, n: int, group: str):
    with ctx:
        yield
    seen = next(count)
    if seen != n:
        raise RuntimeError(f"checkpoint plan of group {group}: the forward ran {seen} ops, the "
                           f"profile has {n}; the plan does not fit this forward")


def policies(prof: OpProfile, names: list[str], groups: list[planner.Group],
             keep: set[Key]) -> list[PlanPolicy]:
    out = []
    for a, e in groups:
        seq = [(i, j) for i in range(a, e + 1) for j in range(len(prof.ops[i]))]
        out.append(PlanPolicy([prof.ops[i][j].name for i, j in seq],
                              {k for k, ij in enumerate(seq) if ij in keep},
                              f"{names[a]}..{names[e]}",
                              any(prof.ops[i][j].relu_after for i, j in seq if (i, j) in keep)))
    return out


def short(name: str) -> str:
    """aten.convolution.default -> convolution"""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 else name


def describe(prof: OpProfile, groups: list[planner.Group], keep: set[Key]) -> list[str]:
    """One line per group: the ops it recomputes and the ops it keeps, counted by kind."""
    lines = []
    for a, e in groups:
        rec, kept = Counter(), Counter()
        for i in range(a, e + 1):
            for j, o in enumerate(prof.ops[i]):
                (kept if (i, j) in keep else rec)[short(o.name)] += 1
        fmt = lambda c: ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "-"  # noqa: E731
        lines.append(f"group {a}-{e}: recompute {fmt(rec)}; keep {fmt(kept)}")
    return lines


def calibrate(prof: OpProfile, seg_time: list[float]) -> None:
    """Scale each segment's op times to sum to its measured forward time: the per-op clock
    adds dispatch overhead, and on a shared machine the two passes see different loads; so
    op-level and block-level plans are predicted from the same segment times."""
    for seg, t in zip(prof.ops, seg_time, strict=True):
        total = sum(o.time for o in seg)
        for o in seg:
            o.time = o.time * t / total if total > 0 else t / len(seg)


COSTS = ("time", "roofline", "flops")


def roofline(o: Op, device_type: str) -> float:
    """An op's nominal time on the device's roofline (`ROOFLINE`): FLOPs and bytes moved."""
    flops, bandwidth = ROOFLINE.get(device_type, ROOFLINE["cuda"])
    return o.flops / flops + o.moved / bandwidth


def flop_cost(o: Op) -> float:
    """An op's FLOPs (torch.utils.flop_counter: matmuls and convolutions), at least 1 (an op
    without FLOPs is nearly free, not free), as torch.compile's activation memory budget prices
    a recomputation by default (`activation_memory_budget_runtime_estimator="flops"`)."""
    return max(o.flops, 1.0)


def price(prof: OpProfile, how: str, device_type: str) -> None:
    """Set every op's and compaction's `cost`, what the program minimises (`method.cost`):

    - `time`: the measured (calibrated) forward times, what a plan's predicted overhead sums,
      so the program minimises the figure it reports. Measured on this project's CPU (resnet50
      224 px, batch 184 profiled on 8, one profile): at 0.4x op/block overhead 0.67 on times
      against 0.72 on the roofline, which prices in-place ReLUs and adds ~25x above what they
      run and BatchNorm's statistics below. A compaction costs at least 1e-3 of its segment's
      time, so a free-looking one is still taken only when it helps the budget.
    - `roofline`: FLOPs and bytes on the device's nominal roofline (`ROOFLINE`); what `time`
      falls back to where no clock means anything (a probe's fake tensors).
    - `flops`: FLOPs alone (`flop_cost`), the measure of Korthikanti et al. (2022) and of
      torch.compile's memory budget: the matmuls are what costs, an op without FLOPs (scale,
      mask, softmax, dropout, LayerNorm, GELU, copies) is nearly free to recompute. On a
      transformer with math attention it recomputes the attention core and keeps the matmuls'
      outputs; a device's clock can disagree (the CPU runs math attention's elementwise s x s
      ops as slowly as the layer's linears: docs/results/transformer_checkpoint_cpu.md)."""
    if how not in COSTS:
        raise ValueError(f"cost {how!r} is not one of {', '.join(COSTS)}")
    for seg in prof.ops:
        for o in seg:
            o.cost = (o.time if how == "time" else roofline(o, device_type)
                      if how == "roofline" else flop_cost(o))
    for c in prof.compact:  # its extra forward (time: + backward, measured)
        c.cost = (max(c.time, 1e-3 * sum(o.time for o in prof.ops[c.seg])) if how == "time"
                  else c.roofline if how == "roofline" else max(c.flops, 1.0))


def profile_model(model, segments, x: torch.Tensor, autocast=None, repeats: int = 2,
                  scale: float = 1.0) -> OpProfile:
    """`profile_ops` on `x` without changing the model (`plan.unchanged`)."""
    autocast = autocast or contextlib.nullcontext
    with planner.unchanged(model, x.device):
        return profile_ops(model, x, lambda: planner._Recorder(model, segments, x, x.device,
                                                               count_flops=False),
                           repeats, scale, autocast, [s.name for s in segments])


@functools.cache
def sac_cache_is_counted() -> bool:
    """Whether the outputs that selective checkpointing caches (a plan's kept ops) can be routed
    through saved-tensor hooks, where memtrain counts saved bytes (measure.SavedBytes) and where
    the plan's accounting assumes them: SAC's forward context has `respect_saved_tensors_hooks`
    (torch >= 2.12; `PlanPolicy.make` sets it). torch 2.11 has not: its SAC cache keeps them out
    of the hooks, so a run would keep bytes that no column shows."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    fwd, _ = create_selective_checkpoint_contexts(lambda *a, **k: CheckpointPolicy.MUST_SAVE)
    return hasattr(fwd, "respect_saved_tensors_hooks")
