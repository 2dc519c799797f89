"""Where the `synthetic` method cuts a model, and the partitioned model it trains.

The model's units are its chain's (`memtrain.models.chain_of`: entry, segments, head).
`Partitioned` runs them as K partitions without moving a module, so parameter and buffer names
(saved weights, resume files) are the plain model's whatever the cuts. Automatic cuts balance
activation memory: one profiled forward attributes every saved tensor to the unit that saved it,
and a partition's modelled activation bytes are what its units save, its boundaries, and the
copies the method adds (the standardised input, the output the label's MSE keeps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from memtrain.errors import ConfigError
from memtrain.memory import measure

# Automatic cuts accept a largest partition this much above the least possible one, for evenness.
BALANCE_SLACK = 0.02
# Samples of the profiling forward: saved bytes grow linearly with the batch, so a slice of it
# ranks the cuts as the whole batch would, at a fraction of the memory.
PROFILE_BATCH = 8


class LabelStandardize(nn.Module):
    """Fixed (x - kappa/2) / (kappa/sqrt(12)): a partition after a cut sees its input centred
    and of unit variance, as the synthetic labels' entries are kappa * U(0, 1). Parameter-free
    and affine, so the composed model's function class is unchanged; without it plain SGD on the
    all-positive, off-centre inputs often kills every ReLU of mlp6's right part in a few steps.
    One new tensor (the shift's result, scaled in place): the next layer keeps it for backward,
    as the whole model keeps its activation at that point.
    """

    def __init__(self, kappa: float):
        super().__init__()
        self.kappa = kappa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sub(x, 0.5 * self.kappa).mul_(12**0.5 / self.kappa)

    def extra_repr(self) -> str:
        return f"kappa={self.kappa}"


class Partitioned(nn.Module):
    """The plain model's parameters, buffers and children under their own names, run as
    partitions: `parts[j]` = LabelStandardize (j > 0) + units[unit_bounds[j]:unit_bounds[j+1]].

    Nothing moves, so `state_dict()` has the plain model's keys under any cuts: weights load
    strictly into the model without the method, and moving a cut never renames a resumable
    state. Until `cut` there is one partition: the plain forward. Iterating, `len` and `[j]`
    give the partitions.
    """

    def __init__(self, model: nn.Module, units: list[nn.Module], kappa: float):
        super().__init__()
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
        for name, m in model.named_children():
            self.add_module(name, m)
        self.units, self.kappa = units, kappa  # plain lists: the modules are registered above
        self.cut([])

    def cut(self, cuts: list[int]) -> None:
        """Partition at these unit indices (increasing; [] = one partition)."""
        bounds = [0, *cuts, len(self.units)]
        self.parts = [nn.Sequential(*([LabelStandardize(self.kappa)] if a else []),
                                    *self.units[a:b]) for a, b in zip(bounds, bounds[1:])]
        self.unit_bounds, self.cuts = bounds, list(cuts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x

    def train(self, mode: bool = True) -> Partitioned:
        super().train(mode)
        for part in self.parts:  # the containers themselves (their modules are ours already)
            part.train(mode)
        return self

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, j: int) -> nn.Sequential:
        return self.parts[j]

    def __iter__(self):
        return iter(self.parts)

    def extra_repr(self) -> str:
        return f"cuts={self.cuts}, units={len(self.units)}"


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------- activation profile


@dataclass
class UnitProfile:
    """Per unit, from one training-mode forward: `inner` bytes its ops save for backward (unit
    outputs apart), `out` its output's bytes, `kept` its output's bytes when something saves
    that output and it is no part of the batch (else 0)."""

    inner: list[int]
    out: list[int]
    kept: list[int]

    def partition_bytes(self, a: int, b: int) -> int:
        """Modelled activation memory of units[a:b] trained as one partition: what its units
        save, its inner boundaries that stay saved, its output (the label MSE keeps it; the last
        partition's is the logits) and, after a cut, the standardised copy of its input."""
        inside = sum(self.inner[a:b]) + sum(self.kept[a:b - 1])
        return inside + self.out[b - 1] + (self.out[a - 1] if a else 0)


class _UnitRecorder(measure.SavedBytes):
    """SavedBytes that also notes which unit packed each storage first."""

    def __init__(self, exclude):
        super().__init__(exclude)
        self.unit = 0
        self.by_unit: dict[tuple[str, int], int] = {}

    def record(self, key: tuple[str, int], t: torch.Tensor) -> None:
        if key not in self.by_unit:
            super().record(key, t)
            self.by_unit[key] = self.unit


def profile_units(model: Partitioned, x: torch.Tensor, autocast=None) -> UnitProfile:
    """Profile `model.units` on `x` (a training-mode forward, no backward); BatchNorm
    statistics and the RNG state are left as they were."""
    buffers = [b.detach().clone() for b in model.buffers()]
    was = model.training
    model.train()
    rec = _UnitRecorder(measure.alive_before_step(model, x))
    outs: list[torch.Tensor] = []
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), rec, autocast or contextlib.nullcontext():
        h = x
        for i, unit in enumerate(model.units):
            rec.unit = i
            h = unit(h)
            outs.append(h)
    with torch.no_grad():
        for b, v in zip(model.buffers(), buffers):
            b.copy_(v)
    model.train(was)
    out_key = {measure.storage_key(o): i for i, o in enumerate(outs)}
    inner = [0] * len(outs)
    for key, unit in rec.by_unit.items():
        if key not in out_key:
            inner[unit] += rec._seen[key]
    saved = set(rec.by_unit)
    out = [o.numel() * o.element_size() for o in outs]
    kept = [n if measure.storage_key(o) in saved else 0 for n, o in zip(out, outs)]
    return UnitProfile(inner, out, kept)


# ---------------------------------------------------------------- choosing the cuts


def _best_split(n: int, k: int, size: Callable[[int, int], int],
                allowed: Callable[[int, int], bool], fold) -> tuple[float, tuple[int, ...]]:
    """Minimise `fold` over splits of n units into k contiguous allowed groups; `fold(size of
    the group, cost of the rest)` folds group by group (optimal substructure)."""

    @cache
    def best(start: int, parts: int) -> tuple[float, tuple[int, ...]]:
        if parts == 1:
            return (fold(size(start, n), None) if allowed(start, n) else float("inf")), ()
        options = []
        for end in range(start + 1, n - parts + 2):
            if allowed(start, end):
                rest, cuts = best(end, parts - 1)
                options.append((fold(size(start, end), rest), (end, *cuts)))
        return min(options, default=(float("inf"), ()))

    return best(0, k)


def balanced_cuts(params: list[int], k: int, size: Callable[[int, int], int]) -> list[int]:
    """Boundaries (partition j = units[cuts[j-1]:cuts[j]]) splitting the units into k contiguous
    groups, each with parameters: the largest `size(a, b)` as small as possible (within
    BALANCE_SLACK), then, among those, the most even split (least sum of squares), so that no
    partition is needlessly tiny."""
    prefix = [0]
    for p in params:
        prefix.append(prefix[-1] + p)
    n = len(params)

    def allowed(a: int, b: int) -> bool:
        return prefix[b] > prefix[a]

    largest, _ = _best_split(n, k, size, allowed, lambda g, rest: max(g, rest or 0))
    if largest == float("inf"):
        raise ConfigError(f"method.partitions={k} is more than this model allows (at most "
                          f"{sum(1 for p in params if p > 0)} partitions with parameters)")
    inf = float("inf")
    cap = largest * (1 + BALANCE_SLACK)
    _, cuts = _best_split(n, k, size, allowed,
                          lambda g, rest: inf if g > cap else g * g + (rest or 0))
    return list(cuts)


def check_cuts(cuts: list[int], params: list[int]) -> None:
    n = len(params)
    bounds = [0, *cuts, n]
    if any(b <= a for a, b in zip(bounds, bounds[1:])) or cuts[0] < 1 or cuts[-1] > n - 1:
        raise ConfigError(f"method.cuts must be strictly increasing unit indices in [1, {n - 1}] "
                          f"for this model ({n} units), got {cuts}")
    empty = [j for j, (a, b) in enumerate(zip(bounds, bounds[1:])) if sum(params[a:b]) == 0]
    if empty:
        raise ConfigError(f"method.cuts={cuts} leaves partition {empty[0]} without parameters; "
                          f"move its boundary")


@torch.no_grad()
def cut_shapes(parts: Partitioned, input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Per-sample output shape of every partition but the last (a probe forward in eval mode)."""
    device = next(parts.parameters()).device
    was = parts.training
    parts.eval()
    x = torch.zeros(1, *input_shape, device=device)
    shapes = []
    for part in list(parts)[:-1]:
        x = part(x)
        shapes.append(tuple(x.shape[1:]))
    parts.train(was)
    return shapes
