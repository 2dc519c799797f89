"""Pieces of the `synthetic` method: cutting a model into sequential partitions, the synthetic
label matrices, and one partition's training phase (a thin adapter around `train.train`).

Kept apart from `synthetic.py` so that a phase is a plain picklable description (`Phase`) that a
worker process can run as well as the parent.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.data import Data, Split
from memtrain.errors import ConfigError
from memtrain.train import evaluate, train

# A dense S of shape (cut width, classes) is held on the device; refuse sizes that would rival
# the activations it is meant to save (1 GiB of fp32).
MAX_LABEL_ENTRIES = 2**28
# Automatic cuts accept a largest partition this much above the least possible one, for evenness.
BALANCE_SLACK = 0.02


# ---------------------------------------------------------------- cutting a model into units


class MixerHead(nn.Module):
    """timm MlpMixer's norm + forward_head as one module, so the head can end a partition."""

    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.norm, self.head_drop, self.head = mixer.norm, mixer.head_drop, mixer.head
        self.global_pool = mixer.global_pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, C] -> [B, classes]
        x = self.norm(x)
        if self.global_pool == "avg":
            x = x.mean(dim=1)
        return self.head(self.head_drop(x))


class LabelStandardize(nn.Module):
    """Fixed (x - kappa/2) / (kappa/sqrt(12)): a partition after a cut sees its input centred
    and of unit variance, as the synthetic labels' entries are kappa * U(0, 1). Parameter-free
    and affine, so the composed model's function class is unchanged; without it plain SGD on the
    all-positive, off-centre inputs often kills every ReLU of mlp6's right part in a few steps.
    """

    def __init__(self, kappa: float):
        super().__init__()
        self.kappa = kappa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - 0.5 * self.kappa) * (12**0.5 / self.kappa)

    def extra_repr(self) -> str:
        return f"kappa={self.kappa}"


def units(model: nn.Module) -> list[nn.Module]:
    """The model as a list of modules whose composition is its forward: the cut candidates.

    mlp6 (nn.Sequential): Flatten, 5 Linear-ReLU blocks, classifier. torchvision ResNet: stem,
    each residual block of layer1..layer4 (stages are runs of blocks; blocks balance better than
    stages, layer4 alone holds ~3/4 of ResNet-18), head (avgpool, flatten, fc). timm MlpMixer
    (resmlp): stem, each block, head (norm, token mean, fc).
    """
    from timm.models.mlp_mixer import MlpMixer
    from torchvision.models import ResNet

    if isinstance(model, ResNet):
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        head = nn.Sequential(model.avgpool, nn.Flatten(1), model.fc)
        blocks = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4)
                  for b in layer]
        return [stem, *blocks, head]
    if isinstance(model, MlpMixer):
        return [model.stem, *model.blocks, MixerHead(model)]
    if isinstance(model, nn.Sequential):
        return list(model.children())
    raise ConfigError(f"method synthetic cuts nn.Sequential models (mlp6), torchvision ResNets "
                      f"and timm MlpMixers (resmlp12/24); got {type(model).__name__}")


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _best_split(prefix: list[int], k: int, cost) -> tuple[float, tuple[int, ...]]:
    """Minimise `cost(group sizes)` over splits of units into k contiguous groups with
    parameters; `cost` folds group by group: cost(size, rest_cost) (optimal substructure)."""
    n = len(prefix) - 1

    @cache
    def best(start: int, parts: int) -> tuple[float, tuple[int, ...]]:
        if parts == 1:
            total = prefix[n] - prefix[start]
            return (cost(total, None) if total > 0 else float("inf")), ()
        options = []
        for end in range(start + 1, n - parts + 2):
            group = prefix[end] - prefix[start]
            if group > 0:
                rest, cuts = best(end, parts - 1)
                options.append((cost(group, rest), (end, *cuts)))
        return min(options, default=(float("inf"), ()))

    return best(0, k)


def balanced_cuts(sizes: list[int], k: int) -> list[int]:
    """Boundaries (unit indices, partition j = units[cuts[j-1]:cuts[j]]) splitting `sizes` into
    k contiguous groups, each with parameters: the largest group as small as possible (within
    BALANCE_SLACK), then, among those, the most even split (least sum of squares), so that no
    partition is needlessly tiny (ResNet-18's 5k-parameter head alone, say)."""
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    largest, _ = _best_split(prefix, k, lambda g, rest: max(g, rest or 0))
    if largest == float("inf"):
        have = sum(1 for s in sizes if s > 0)
        raise ConfigError(f"method.partitions={k} is more than this model allows (at most {have} "
                          f"partitions with parameters)")
    inf = float("inf")
    cap = largest * (1 + BALANCE_SLACK)
    _, cuts = _best_split(prefix, k, lambda g, rest: inf if g > cap else g * g + (rest or 0))
    return list(cuts)


def check_cuts(cuts: list[int], sizes: list[int]) -> None:
    n = len(sizes)
    bounds = [0, *cuts, n]
    if any(b <= a for a, b in zip(bounds, bounds[1:])) or cuts[0] < 1 or cuts[-1] > n - 1:
        raise ConfigError(f"method.cuts must be strictly increasing unit indices in [1, {n - 1}] "
                          f"for this model ({n} units), got {cuts}")
    empty = [j for j, (a, b) in enumerate(zip(bounds, bounds[1:])) if sum(sizes[a:b]) == 0]
    if empty:
        raise ConfigError(f"method.cuts={cuts} leaves partition {empty[0]} without parameters; "
                          f"move its boundary")


@torch.no_grad()
def cut_shapes(parts: nn.Sequential, input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
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


def mse_to_label(out: torch.Tensor, y: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """MSE of a partition's output [B, ...] against its class targets (rows of S^T).

    Unreduced, then averaged: torch's CPU mse_loss(reduction="mean") returns a 0-dim loss on a
    storage of the output's full size, held for as long as the loss is (through backward), which
    the estimate's fake tensors cannot show; the unreduced map is freed once averaged."""
    return F.mse_loss(out.flatten(1).float(), targets[y], reduction="none").mean()


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
        s = phase.s_out.to(device)
        hooks["loss_fn"] = partial(mse_to_label, targets=s.t().contiguous())
        hooks["evaluate_fn"] = partial(evaluate_decoded, s=s)
    optimizer = build_optimizer(phase.optim, phase.module)
    scheduler = None
    if phase.factors is not None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(_factor, phase.factors))
    return train(phase.module, phase_data(phase, data, device), optimizer, scheduler,
                 metric_prefix=f"{phase.name}.", **hooks, **phase.train_kwargs)
