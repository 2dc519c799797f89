"""Pieces of the `synthetic` method: the synthetic label matrices, the loss against them, and
one partition's training phase (a thin adapter around `train.train`). Where the model is cut:
`cuts.py`.

Kept apart from `phases.py` so that a phase is a plain picklable description (`Phase`) that a
worker process can run as well as the parent.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.data import Data, Split
from memtrain.errors import ConfigError
from memtrain.run.train import evaluate, train

# A dense S of shape (cut width, classes) is held on the device; refuse sizes that would rival
# the activations it is meant to save (1 GiB of fp32).
MAX_LABEL_ENTRIES = 2**28
# The label loss's forward works on 1/LOSS_CHUNKS of the batch at a time, so its temporaries stay
# a small fraction of the partition's output (a [B, D] gather and difference set part0's peak).
LOSS_CHUNKS = 16


# ---------------------------------------------------------------- synthetic labels


def label_matrix(seed: int, cut: int, dim: int, num_classes: int, kappa: float) -> torch.Tensor:
    """S of shape (dim, num_classes), entries kappa * U(0, 1), fixed by (seed, cut index).

    A cut whose output is a feature map (C, H, W) gets dim = C*H*W: class c's target is column c
    reshaped to (C, H, W).
    """
    if dim * num_classes > MAX_LABEL_ENTRIES:
        raise ConfigError(f"method synthetic: the label matrix at cut {cut} would hold "
                          f"{dim}x{num_classes} entries (over {MAX_LABEL_ENTRIES}); cut later in "
                          f"the network (method.cuts) or use smaller images")
    g = torch.Generator().manual_seed(seed * 1_000_003 + cut)
    return kappa * torch.rand(dim, num_classes, generator=g)


class NearestColumn(nn.Module):
    """Wraps a partition: logits = minus the mean squared distance of its output to each class's
    column of S, so `train.evaluate` reports decoding accuracy, and NLL of these logits is the MSE
    to the true class's target."""

    def __init__(self, part: nn.Module, s: torch.Tensor):
        super().__init__()
        self.part, self.s = part, s  # s: [D, classes], a constant (not a buffer of the model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.part(x).flatten(1).float()  # [B, D]
        dist = (f * f).sum(1, keepdim=True) - 2 * f @ self.s + (self.s * self.s).sum(0)
        return -dist / f.shape[1]  # [B, classes]


class _MSEToLabel(torch.autograd.Function):
    """mean((out - targets[y])^2) over every element, with what the step needs and nothing more.

    `F.mse_loss(out, targets[y])` materialises the gathered targets (saved for backward) and the
    difference, two tensors of the output's size on top of the output: on mlp6 (batch 128)
    they put part0's activation peak 22% above the whole model's. Here the forward gathers and
    squares ~1/LOSS_CHUNKS of the rows at a time and saves only `out` (which the partition's
    last op usually saves anyway) and `y` (the batch's labels); the backward builds the gradient,
    which autograd needs anyway, in one gathered tensor, in place.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, y: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = max(1, out.shape[0] // LOSS_CHUNKS)
        total = torch.zeros((), dtype=torch.float32, device=out.device)
        for i in range(0, out.shape[0], rows):
            d = targets.index_select(0, y[i:i + rows]).view(-1, *out.shape[1:])  # fp32 rows
            total += d.sub_(out[i:i + rows]).pow_(2).sum()
            del d  # freed before the next chunk's gather
        ctx.save_for_backward(out, y)
        ctx.targets = targets  # a constant of the phase, alive before the step: not saved
        return total / out.numel()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, y = ctx.saved_tensors
        g = ctx.targets.index_select(0, y).view(out.shape)  # [B, ...] fp32
        g.sub_(out).mul_(grad * (-2.0 / out.numel()))  # 2 (out - t) / N * grad
        return g.to(out.dtype), None, None


def mse_to_label(out: torch.Tensor, y: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """MSE of a partition's output [B, ...] against its class targets (rows of S^T, [classes,
    D] in fp32): `F.mse_loss(out.flatten(1).float(), targets[y])` without its [B, D]
    temporaries (`_MSEToLabel`)."""
    return _MSEToLabel.apply(out, y, targets)


def evaluate_decoded(model, split, device, batch_size, autocast, max_batches=None,
                     channels_last=False, *, s: torch.Tensor) -> dict[str, float]:
    """`train.evaluate` of a regression partition: acc = nearest-column decoding, loss = MSE."""
    return evaluate(NearestColumn(model, s), split, device, batch_size, autocast, max_batches,
                    channels_last, loss_fn=F.nll_loss)


# ---------------------------------------------------------------- a partition's input


class MappedSplit(Split):
    """A split whose inputs are replaced by `fn(x, y)`: the frozen earlier partitions' output,
    or the previous cut's synthetic label plus noise. Labels pass through."""

    def __init__(self, base: Split, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.base, self.fn = base, fn

    def __len__(self) -> int:
        return len(self.base)

    def batches(self, batch_size, device, shuffle=False, generator=None,
                drop_last=False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in self.base.batches(batch_size, device, shuffle, generator, drop_last):
            yield self.fn(x, y), y


def frozen_input(prefix: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return prefix(x)


def synthetic_input(targets: torch.Tensor, shape: tuple[int, ...], std: float,
                    x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = targets[y].view(-1, *shape)  # S[:, y], shaped like the cut's output
    return z + std * torch.randn_like(z) if std > 0 else z.clone()


# ---------------------------------------------------------------- optimizer of a phase


def optimizer_spec(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """The run's optimizer class and per-group settings restricted to `module`'s parameters, as
    plain data (parameter positions, not tensors) so a worker process can rebuild it."""
    pos = {id(p): i for i, p in enumerate(module.parameters())}
    groups = []
    for g in optimizer.param_groups:
        idx = [pos[id(p)] for p in g["params"] if id(p) in pos]
        if idx:
            opts = {k: v for k, v in g.items() if k not in ("params", "initial_lr")}
            opts["lr"] = g.get("initial_lr", g["lr"])  # the schedule's base, not its current value
            groups.append((idx, opts))
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return {"cls": type(optimizer), "groups": groups, "defaults": defaults}


def build_optimizer(spec: dict[str, Any], module: nn.Module) -> torch.optim.Optimizer:
    params = list(module.parameters())
    groups = [{"params": [params[i] for i in idx], **opts} for idx, opts in spec["groups"]]
    return spec["cls"](groups, **spec["defaults"])


def lr_factors(scheduler, run_total: int, phase_total: int,
               tail: bool = False) -> list[float] | None:
    """The run's LambdaLR as a table over a phase of `phase_total` steps (picklable, unlike the
    schedule's closure); None when the run has no schedule. A partition gets the whole schedule
    stretched to its length; `tail` gives the run's last `phase_total` steps instead (recovery:
    end-to-end fine-tuning at the low end of the schedule)."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if not lambdas:
        return None
    f = lambdas[0]
    if tail:
        start = max(0, run_total - phase_total)
        return [float(f(start + s)) for s in range(phase_total + 1)]
    scale = run_total / max(1, phase_total)
    return [float(f(int(s * scale))) for s in range(phase_total + 1)]


def _factor(table: list[float], step: int) -> float:
    return table[min(step, len(table) - 1)]


# ---------------------------------------------------------------- one phase


@dataclass
class Phase:
    """One training phase: partition `index` (or the end-to-end recovery), as plain data."""

    name: str                           # metric prefix and summary column prefix: part0, recovery
    module: nn.Module                   # what this phase trains (its parameters only)
    optim: dict[str, Any]               # optimizer_spec(...)
    factors: list[float] | None         # lr_factors(...)
    train_kwargs: dict[str, Any]        # train.train keyword arguments (trainer, device...)
    prefix: nn.Module | None = None     # frozen earlier partitions (right_input=left)
    s_in: torch.Tensor | None = None    # previous cut's S (right_input=synthetic)
    in_shape: tuple[int, ...] | None = None
    noise_std: float = 0.0
    s_out: torch.Tensor | None = None   # this cut's S; None: cross-entropy on the classes


def phase_data(phase: Phase, data: Data, device: torch.device) -> Data:
    """The data as this phase's module sees it: raw inputs, frozen outputs or synthetic labels."""
    if phase.prefix is not None:
        phase.prefix.to(device).eval()
        fn = partial(frozen_input, phase.prefix)
    elif phase.s_in is not None:
        targets = phase.s_in.t().contiguous().to(device)  # [classes, D]
        fn = partial(synthetic_input, targets, phase.in_shape, phase.noise_std)
    else:
        return data
    return Data(MappedSplit(data.train, fn), MappedSplit(data.test, fn), data.num_classes,
                phase.in_shape, data.name)


def run_phase(phase: Phase, data: Data):
    """Train one phase with `train.train`; returns its TrainResult (module trained in place)."""
    device = phase.train_kwargs["device"]
    hooks: dict[str, Any] = {}
    if phase.s_out is not None:
        targets = phase.s_out.t().contiguous().to(device)  # [classes, D]: one copy on the device
        hooks["loss_fn"] = partial(mse_to_label, targets=targets)
        hooks["evaluate_fn"] = partial(evaluate_decoded, s=targets.t())
        # graded on the partition's own task (its output decoded to the nearest synthetic label,
        # its input the earlier cut's label for later partitions): not the test task's accuracy
        hooks["eval_name"] = "synthetic_label_acc"
    optimizer = build_optimizer(phase.optim, phase.module)
    scheduler = None
    if phase.factors is not None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(_factor, phase.factors))
    return train(phase.module, phase_data(phase, data, device), optimizer, scheduler,
                 metric_prefix=f"{phase.name}.", **hooks, **phase.train_kwargs)
