"""Lossless local savings as choices of an operator-level checkpoint plan (MONeT's operator
selection; Gist's binarised ReLU -> max-pool): in a compacted segment every nn.ReLU (and
ReLU6) keeps a 1-bit mask of where its gradient passes (`MaskedReLUFn`,
methods/common/compact.py) instead of its output, and every nn.MaxPool2d keeps uint8 window
offsets (`CompactMaxPool2dFn`, there too) instead of its input and int64 indices. Both
backwards are exact; ReLUs stay in place where they were.

A mask frees a ReLU's output only where nothing else keeps it. In ResNet's stem (ReLU ->
max-pool, both compacted) nothing does; a ReLU feeding a convolution or a linear layer is still
kept whole by that layer, and its mask is bytes on top. So a segment's compaction is measured,
not assumed: one forward with every candidate module compacted gives each segment's saved bytes
(the profiler's own accounting), and only segments that it shrinks become choices of
`ops.py`'s program for a segment the plan keeps (its held bytes shrink from its forward
until its backward), chosen when the bytes it frees help the budget, at the cost of its
measured extra forward + backward (the segment alone, compacted and plain, alternately).

Never for a recomputed segment: a mask frees the ReLU's output only after the max-pool has
read it, so a recompute holds the output anyway while it runs. Offered there at first, it was
modelled at 1049856 bytes and a step measured 1327624 (resnet18 64 px b2, the stem compacted
and recomputed), once the tracker counted recomputed stems at all (`segments._OwnForward`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import memtrain.methods.checkpoint.ops as opplan
import memtrain.methods.checkpoint.plan as planner
from memtrain.memory import measure
from memtrain.methods.checkpoint.ops import Compact
from memtrain.methods.checkpoint.segments import Segment
from memtrain.methods.common.compact import CompactMaxPool2d, MaskedReLUFn


class _Masked:
    """The backward of a compacted nn.ReLU or nn.ReLU6: a packed 1-bit mask of where its gradient
    passes (0 < x, and x < `top` for ReLU6), not its output."""

    top: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and x.requires_grad:
            return MaskedReLUFn.apply(x, self.inplace, "bits", self.top)
        return super().forward(x)


class MaskedReLU(_Masked, nn.ReLU):
    """The class a compacted nn.ReLU runs as."""


class MaskedReLU6(_Masked, nn.ReLU6):
    """The class a compacted nn.ReLU6 runs as."""

    @property
    def top(self) -> float:
        return self.max_val


SWAPS = {nn.ReLU: MaskedReLU, nn.ReLU6: MaskedReLU6, nn.MaxPool2d: CompactMaxPool2d}
_KINDS = {nn.ReLU: "relu", nn.ReLU6: "relu6"}  # how a choice names what it compacts


def _compactable(m: nn.Module) -> bool:
    return type(m) in _KINDS or (type(m) is nn.MaxPool2d and CompactMaxPool2d.fits(m))


def candidates(segments: list[Segment]) -> list[list[nn.Module]]:
    """Per segment, the modules compaction would swap: plain nn.ReLU and nn.ReLU6, and fitting
    nn.MaxPool2d in the segment's module trees, except a module that two segments share
    (compacting it for a kept one would change the other's forward)."""
    per = [[m for top in s.modules() for m in top.modules() if _compactable(m)]
           for s in segments]
    uses = Counter(id(m) for ms in per for m in {id(m): m for m in ms}.values())
    return [list({id(m): m for m in ms if uses[id(m)] == 1}.values()) for ms in per]


def apply(modules: list[nn.Module]) -> Callable[[], None]:
    """Compact `modules` in place (a class swap: same objects, parameters, hooks and state
    dict); returns the function that undoes it."""
    before = [(m, type(m)) for m in modules]
    for m, cls in before:
        m.__class__ = SWAPS[cls]

    def undo() -> None:
        for m, cls in before:
            m.__class__ = cls
    return undo


@contextlib.contextmanager
def compacted(modules: list[nn.Module]) -> Iterator[None]:
    undo = apply(modules)
    try:
        yield
    finally:
        undo()


def _kinds(modules: list[nn.Module]) -> str:
    names = Counter(_KINDS.get(type(m), "max_pool2d") for m in modules)
    return ", ".join(f"{k} x{v}" for k, v in sorted(names.items()))


def _step_time(seg: Segment, x: torch.Tensor, autocast, repeats: int) -> float:
    """Median forward + backward time of `seg` alone on its input `x` (first run warms up)."""
    times = []
    for _ in range(repeats + 1):
        xi = x.detach().requires_grad_(x.is_floating_point())
        measure.sync(x.device)
        t0 = time.perf_counter()
        with autocast():
            out = xi
            for m in seg.modules():
                out = m(out)
        out.float().sum().backward()
        measure.sync(x.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def profile(model: nn.Module, segments: list[Segment], x: torch.Tensor, autocast, repeats: int,
            scale: float, base: planner.Profile, ops) -> list[Compact]:
    """The compaction choices of `segments`: one forward with every candidate compacted, its
    saved bytes per segment against `base.inner` (the same accounting, the same batch slice
    and `scale`), its ops' roofline (`ops.profile_model`) against `ops` (the plain
    forward's: the cost where no clock means anything), its forward transients, and each shrunk
    segment's forward + backward alone, compacted and plain, alternately (the compact
    max-pool's and the mask's backwards differ from aten's too)."""
    cands = candidates(segments)
    if not any(cands):
        return []
    inputs: dict[int, torch.Tensor] = {}
    hooks = [segments[i].modules()[0].register_forward_pre_hook(
        lambda _m, args, i=i: inputs.setdefault(i, args[0].detach()))
        for i, ms in enumerate(cands) if ms]
    try:
        with compacted([m for ms in cands for m in ms]), planner.unchanged(model, x.device):
            rec = planner._Recorder(model, segments, x, x.device, count_flops=False)
            try:
                with rec, autocast():
                    out = model(x)
            finally:
                rec.close()
            inner = planner._attribute(rec, segments).inner
            del out
    finally:
        for h in hooks:
            h.remove()
    with compacted([m for ms in cands for m in ms]):
        cops = opplan.profile_model(model, segments, x, autocast, repeats, scale)
        trans = planner.forward_transients(model, segments, x, autocast, scale)
    found = []
    for i, ms in enumerate(cands):
        saves = base.inner[i] - int(inner[i] * scale)
        if not ms or saves <= 0:
            continue
        dev = x.device.type
        fwd = sum(opplan.roofline(o, dev) for o in cops.ops[i]) - \
            sum(opplan.roofline(o, dev) for o in ops.ops[i])
        flops = sum(opplan.flop_cost(o) for o in cops.ops[i]) - \
            sum(opplan.flop_cost(o) for o in ops.ops[i])
        if is_fake(x):  # a probe: no clock (the roofline prices its plan)
            step = 0.0
        else:  # each shrunk segment alone, compacted and plain, alternately
            steps = {True: [], False: []}
            with planner.unchanged(model, x.device):
                for _ in range(max(repeats, 3)):
                    for on in (False, True):
                        with compacted(ms) if on else contextlib.nullcontext():
                            steps[on].append(_step_time(segments[i], inputs[i], autocast, 1))
            step = max(statistics.median(steps[True]) - statistics.median(steps[False]), 0.0)
        found.append(Compact(i, saves, max(fwd, 1e-12), step * scale, _kinds(ms), trans[i],
                             flops=max(flops, 1.0), roofline=max(fwd, 1e-12)))
    return found
