"""A model's chain found, not registered: one traced forward on a sample batch.

Where no `@chain_rule` names a model's type (chain.py), its chain comes from the module tree and
one forward of a few samples (no gradients; buffers and the RNG state restored afterwards), with
a hook on every module and every aten op logged (`_Trace`). A chain is a run of module calls,
children of one call (their parent module's forward, or a Sequential's), where:

- each call's first positional argument is the previous call's output, the same tensor object,
  and its other arguments (side inputs: a causal mask, position embeddings, position ids, None
  caches, flags) are the same objects as the first call's: a group of consecutive calls can run
  from the first call's arguments alone (checkpoint's `CheckpointGroup` carries them);
- each call returns one tensor, and its module is called once in the forward;
- no op outside the next call reads a call's output, and nothing a call makes inside is read
  outside it: grouped, the intermediate outputs are never seen by anyone else.

A call whose own forward does nothing but run such a chain of its children (an nn.Sequential,
a stage of a downsample and its blocks) is replaced by that chain, recursively, as many levels
down as keep the chain within `MAX_SEGMENTS`: timm's ResNet becomes its stem's modules, every
block of every stage, pooling and fc. Of the chains found anywhere in the tree, the one whose
segments make the most bytes of new tensors outside its largest segment wins (what a plan can
split and free: a short chain at a network's full-resolution stem, not a long one of tiny maps
deep inside), then the one that runs the most ops outside its largest segment (the first of
equals, outermost first); fewer than two segments is no chain, refused in one line that says
what broke it.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MIN_SEGMENTS = 2
MAX_SEGMENTS = 32  # expansion stops before a chain has more segments (`_segments`)
MAX_DEPTH = 8


@dataclass(eq=False)  # compared by identity
class Call:
    """One module call of the traced forward; `enter`/`exit`: its span on the trace's clock."""

    module: nn.Module
    name: str
    parent: int | None  # index of the enclosing call (None: the model's own call)
    enter: int
    args: tuple
    kwargs: dict
    exit: int = -1
    out: Any = None
    children: list[int] = field(default_factory=list)


@dataclass
class Found:
    """What the trace found: the chain's segments (each the module names of consecutive calls
    of one parent), whether they take side inputs, whether they make up the whole forward
    (model(x) == s_n(...s_1(x))); or why none."""

    names: list[list[str]]
    side: bool = False
    whole: bool = False
    why: str = ""


class _Trace(TorchDispatchMode):
    """Every aten op of a forward: its tick on the shared clock, the ids of its tensor inputs
    and of the tensors it made (fresh objects); every tensor seen is kept alive, so an id is
    never reused while the trace lives."""

    def __init__(self):
        super().__init__()
        self.tick = 0
        self.ops: list[tuple[int, str]] = []  # (tick, op name)
        self.producer: dict[int, int] = {}  # tensor id -> tick of the op that made it
        self.readers: dict[int, list[tuple[int, str]]] = {}  # tensor id -> (tick, op) reading it
        self.alive: list[torch.Tensor] = []
        self.seen: set[int] = set()
        self.writes: list[tuple[int, Any]] = []  # (tick, storage written in place)
        self.nbytes: dict[int, int] = {}  # tensor id -> bytes of the storage it was made with
        self.storages: set[Any] = set()

    def clock(self) -> int:
        self.tick += 1
        return self.tick

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        t = self.clock()
        name = str(func.overloadpacket.__name__)
        ins = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        for a in ins:
            self.readers.setdefault(id(a), []).append((t, name))
            self._see(a)
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and id(o) not in self.seen:
                self.producer[id(o)] = t
                key = _storage(o)  # a view of a tensor seen before makes no bytes
                self.nbytes[id(o)] = 0 if key in self.storages else \
                    o.untyped_storage().nbytes()
                self._see(o)
        for arg, v in zip(func._schema.arguments, args):
            if arg.alias_info is not None and arg.alias_info.is_write \
                    and isinstance(v, torch.Tensor):
                self.writes.append((t, _storage(v)))
        self.ops.append((t, name))
        return out

    def _see(self, a: torch.Tensor) -> None:
        if id(a) not in self.seen:
            self.seen.add(id(a))
            self.alive.append(a)
            self.storages.add(_storage(a))


def _storage(t: torch.Tensor) -> Any:
    return t.untyped_storage()._cdata


def trace(model: nn.Module, sample: Any) -> tuple[list[Call], _Trace]:
    """Every module call and op of `model(sample)` (the model as it was afterwards)."""
    names = {id(m): n for n, m in model.named_modules()}
    calls: list[Call] = []
    stack: list[int] = []
    tr = _Trace()

    def pre(mod, args, kwargs):
        i = len(calls)
        parent = stack[-1] if stack else None
        calls.append(Call(mod, names.get(id(mod), "?"), parent, tr.clock(), args, dict(kwargs)))
        if parent is not None:
            calls[parent].children.append(i)
        stack.append(i)

    def post(mod, args, kwargs, out):
        # a module may run in place of another's hooks: pop back to this module's call
        while stack:
            i = stack.pop()
            if calls[i].module is mod:
                calls[i].exit, calls[i].out = tr.clock(), out
                for o in tree_flatten(out)[0]:
                    if isinstance(o, torch.Tensor):
                        tr._see(o)
                break

    handles = []
    for m in {id(m): m for m in model.modules()}.values():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        with unchanged(model, sample), torch.no_grad(), tr:
            model(sample)
    finally:
        for h in handles:
            h.remove()
    return calls, tr


@contextlib.contextmanager
def unchanged(model: nn.Module, sample: Any) -> Iterator[None]:
    """Buffers (BatchNorm statistics) and the RNG state as they were before."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    device = sample.device if isinstance(sample, torch.Tensor) else torch.device("cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)


# ---------------------------------------------------------------- the analysis


def _same(a: Any, b: Any) -> bool:
    """The same side input: the same tensor object; containers item by item; other values
    equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return type(a) is type(b) and (a is b or bool(a == b))
    except Exception:  # an object without a truthful ==
        return a is b


def _side_differs(a: Call, b: Call) -> str | None:
    """Which side input of `b` is not `a`'s, or None when all are the same."""
    if len(a.args) != len(b.args):
        return f"{len(b.args) - 1} positional against {len(a.args) - 1}"
    for k, (x, y) in enumerate(zip(a.args[1:], b.args[1:]), 1):
        if not _same(x, y):
            return f"positional argument {k}"
    for k in sorted(a.kwargs.keys() | b.kwargs.keys()):
        if k not in a.kwargs or k not in b.kwargs or not _same(a.kwargs[k], b.kwargs[k]):
            return f"argument {k}"
    return None


class _Analysis:
    def __init__(self, calls: list[Call], tr: _Trace):
        self.calls, self.tr = calls, tr
        self.counts: dict[int, int] = {}
        for c in calls:
            self.counts[id(c.module)] = self.counts.get(id(c.module), 0) + 1
        self.ticks = [t for t, _ in tr.ops]  # sorted: the clock only goes forward
        # per tensor made by an op: (tick made, last tick read, id), by tick made
        last = {tid: max(t for t, _ in rs) for tid, rs in tr.readers.items()}
        made = sorted((t, last.get(tid, t), tid) for tid, t in tr.producer.items())
        self.made_at = [m[0] for m in made]
        self.made = made
        self.bytes_upto = [0]  # bytes of the tensors made before each entry of `made`
        for _, _, tid in made:
            self.bytes_upto.append(self.bytes_upto[-1] + tr.nbytes[tid])
        self._unfit: dict[int, str | None] = {}
        self._runs: dict[int, list[tuple[list[Call], str]]] = {}
        self._expand: dict[tuple[int, int], list[Call]] = {}

    def main(self, c: Call) -> torch.Tensor | None:
        return c.args[0] if c.args and isinstance(c.args[0], torch.Tensor) else None

    def ops_in(self, c: Call) -> int:
        return bisect.bisect_left(self.ticks, c.exit) - bisect.bisect_right(self.ticks, c.enter)

    def bytes_in(self, c: Call) -> int:
        """Bytes of the new tensors (not views) that the ops of call `c` made."""
        lo = bisect.bisect_right(self.made_at, c.enter)
        hi = bisect.bisect_left(self.made_at, c.exit)
        return self.bytes_upto[hi] - self.bytes_upto[lo]

    def unfit(self, c: Call) -> str | None:
        """Why call `c` cannot be a segment, or None."""
        if id(c) not in self._unfit:
            self._unfit[id(c)] = self._why_unfit(c)
        return self._unfit[id(c)]

    def _why_unfit(self, c: Call) -> str | None:
        if c.parent is None:
            return "it is the model itself"
        if self.counts[id(c.module)] > 1:
            return f"{c.name} is called {self.counts[id(c.module)]} times"
        if c.exit < 0:
            return f"{c.name} did not return"
        if self.main(c) is None:
            return f"{c.name} takes no tensor as its first positional argument"
        if not isinstance(c.out, torch.Tensor):
            return f"{c.name} returns {type(c.out).__name__}, not one tensor"
        return self.leak(c)

    def writes_input(self, c: Call) -> bool:
        """Whether an op of `c` writes into its first input (an in-place activation): a group
        cannot start there (its recompute would start from the overwritten input)."""
        key = _storage(self.main(c))
        return any(c.enter < t < c.exit and k == key for t, k in self.tr.writes)

    def _inside(self, t: int, c: Call) -> bool:
        return c.enter < t < c.exit

    def leak(self, c: Call) -> str | None:
        """Something `c` makes, other than its output, read by an op after it."""
        lo = bisect.bisect_right(self.made_at, c.enter)
        hi = bisect.bisect_left(self.made_at, c.exit)
        for _, last, tid in self.made[lo:hi]:
            if last > c.exit and tid != id(c.out):
                op = next(op for t, op in self.tr.readers[tid] if t > c.exit)
                return f"a tensor made inside {c.name} is read by {op} after it"
        return None

    def link(self, k: Call, siblings: list[int]) -> tuple[Call | None, str]:
        """The call that continues a chain after `k` among `siblings` (call indices), or None
        and why the chain ends at `k`."""
        out = k.out
        why = f"the output of {k.name} is the first input of no later module"
        for j in siblings:
            d = self.calls[j]
            if d.enter < k.exit or self.main(d) is not out:
                continue
            bad = self.unfit(d)
            if bad is not None:
                return None, bad
            differs = _side_differs(k, d)
            if differs is not None:
                why = f"{k.name} and {d.name} take different side inputs ({differs})"
                continue
            for t, op in self.tr.readers.get(id(out), ()):
                if t > k.exit and not self._inside(t, d) and not (t > d.exit and d.out is out):
                    return None, f"the output of {k.name} is also read by {op} outside {d.name}"
            return d, ""
        return None, why

    def runs(self, p: Call) -> list[tuple[list[Call], str]]:
        """The maximal runs of chained calls among `p`'s children, each with why it ends."""
        if id(p) in self._runs:
            return self._runs[id(p)]
        kids = p.children
        nxt: dict[int, Call] = {}
        ends: dict[int, str] = {}
        for i in kids:
            c = self.calls[i]
            if self.unfit(c) is not None:
                continue
            d, why = self.link(c, kids)
            if d is not None:
                nxt[id(c)] = d
            else:
                ends[id(c)] = why
        targets = {id(d) for d in nxt.values()}
        out = []
        for i in kids:
            c = self.calls[i]
            if id(c) in targets or (id(c) not in nxt and id(c) not in ends):
                continue
            run = [c]
            while id(run[-1]) in nxt and len(run) <= len(kids):
                run.append(nxt[id(run[-1])])
            out.append((run, ends.get(id(run[-1]), "")))
        self._runs[id(p)] = out
        return out

    def whole_run(self, p: Call) -> list[Call] | None:
        """The run of `p`'s children that is all `p` does (its input in, its output out, no
        call or op of its own besides), or None."""
        if self.main(p) is None or not isinstance(p.out, torch.Tensor):
            return None
        for run, _ in self.runs(p):
            if self.main(run[0]) is not self.main(p) or run[-1].out is not p.out:
                continue
            if len(run) != len(p.children) or self.ops_in(p) != sum(map(self.ops_in, run)):
                return None
            if p.parent is not None and _side_differs(p, run[0]) is not None:
                return None
            return run
        return None

    def expand(self, c: Call, depth: int) -> list[Call]:
        """`c` replaced by the run of its children that is all it does, recursively, at most
        `depth` levels down."""
        key = (id(c), depth)
        if key not in self._expand:
            run = self.whole_run(c) if depth > 0 else None
            self._expand[key] = [c] if run is None else [s for r in run
                                                         for s in self.expand(r, depth - 1)]
        return self._expand[key]


def find(model: nn.Module, sample: Any) -> Found:
    """The model's chain on `sample` (see the module): the module names of its calls, or an
    empty list and why none was found."""
    calls, tr = trace(model, sample)
    if not calls:
        return Found([], why="no module was called")
    a = _Analysis(calls, tr)
    best: list[list[Call]] = []
    score, why = (0, 0, 0), ""
    for p in calls:  # outermost first: the first of equal chains is the outermost
        for run, end in a.runs(p):
            segs = _segments(a, run)
            # the chain that makes the most bytes, then runs the most ops, outside its largest
            # segment: what a plan can split and free (not one segment holding most of the
            # forward, nor a long chain of small maps deep inside a branch)
            made = [sum(a.bytes_in(c) for c in s) for s in segs]
            ops = [sum(a.ops_in(c) for c in s) for s in segs]
            covered = (sum(made) - max(made, default=0), sum(ops) - max(ops, default=0),
                       len(segs))
            if len(segs) >= MIN_SEGMENTS and covered > score:
                best, score = segs, covered
            elif not why:
                why = end
    if not best:
        return Found([], why=why or _first_reason(a, calls))
    first = best[0][0]
    side = len(first.args) > 1 or bool(first.kwargs)
    # the whole forward: the model's own call expanded gives the same segments
    whole = any(_pieces(a, [calls[0]], d) == best for d in range(1, MAX_DEPTH + 2)) \
        and calls[0].children and not side
    return Found([[c.name for c in s] for s in best], side=side, whole=bool(whole))


def _segments(a: _Analysis, run: list[Call]) -> list[list[Call]]:
    """The run as segments, its calls replaced by their own chains (`_Analysis.expand`) as
    many levels down as keeps it within `MAX_SEGMENTS` (stages into blocks, but not every
    block into its layers: the op-level plan decides inside a segment, and the planner's
    program grows with the square of the segments), at least the run itself."""
    best = _pieces(a, run, 0)
    for depth in range(1, MAX_DEPTH + 1):
        segs = _pieces(a, run, depth)
        if len(segs) > MAX_SEGMENTS:
            break
        best = segs
    return best


def _pieces(a: _Analysis, run: list[Call], depth: int) -> list[list[Call]]:
    """The run expanded `depth` levels down, as segments: a call that writes into its input in
    place joins the segment before it (its sibling's: a segment is one parent's modules), or,
    where that is no sibling, splits the chain (the longest piece is kept). A call that hands
    its input back untouched (nn.Identity, dropout at p=0) is no segment: in a group it passes
    on what it is given, which is the same."""
    pieces: list[list[list[Call]]] = [[]]
    for c in (s for r in run for s in a.expand(r, depth)):
        if c.out is a.main(c) and a.ops_in(c) == 0:
            continue
        if a.writes_input(c):
            prev = pieces[-1][-1][-1] if pieces[-1] else None
            if prev is not None and prev.parent == c.parent:
                pieces[-1][-1].append(c)
            else:
                pieces.append([])
            continue
        pieces[-1].append([c])
    return max(pieces, key=lambda segs: sum(a.ops_in(c) for s in segs for c in s))


def _first_reason(a: _Analysis, calls: list[Call]) -> str:
    """Why the model's first called module starts no chain."""
    for c in calls[1:]:
        bad = a.unfit(c)
        if bad is not None:
            return bad
        siblings = calls[c.parent].children if c.parent is not None else []
        _, why = a.link(c, siblings)
        if why:
            return why
    return "no module's output is the next module's input"
