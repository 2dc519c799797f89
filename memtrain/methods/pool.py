"""method=pool: the backward pass from pooled activations (Barley & Froening, arXiv 2409.11902).

The forward pass stays exact. Convolutions keep `pool_k(x)` for backward instead of x (grad_input
stays exact, grad_weight is approximate); with `targets=conv+bn` BatchNorm keeps a pooled x_hat
too (its whole backward becomes approximate). The pitfall (docs/ARCHITECTURE.md): a conv input is
usually a ReLU output that the ReLU saves as well, so ReLUs keep a 1-bit (or bool) mask; max-pools
keep uint8 window offsets instead of their input and int64 indices. Both of those are exact.
A layer whose input is data from outside the autograd graph (the batch, or a view of it: it
needs no gradient) is left alone unless `compress_input=true`: the loop keeps the batch for the
whole step, so a compressed copy adds memory and only degrades the first layer's gradient.

    memtrain method=pool method.kernel_size=4 method.mode=pooled method.targets=conv+bn
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.errors import ConfigError, check_choice, check_range
from memtrain.methods.common.compact import (
    CompactMaxPool2dFn,
    MaskedReLUFn,
    PooledBatchNormFn,
    PooledConv2dFn,
    autocast_dtype,
)
from memtrain.methods.common.swap import swap_modules

log = logging.getLogger(__name__)

POOL_TYPES = ("avg", "max")
MODES = ("upsample", "pooled")
RELU_MASKS = ("bits", "bool", "none")
TARGETS = ("conv", "conv+bn")


class PoolMethod:
    """Swaps Conv2d (and BatchNorm2d with targets=conv+bn) for pooled-backward versions, ReLU
    for a masked ReLU (unless relu_mask=none) and MaxPool2d for a compact-index one."""

    name = "pool"

    def __init__(self, kernel_size: int = 2, pool_type: str = "avg", mode: str = "upsample",
                 min_size: int = 4, relu_mask: str = "bits", targets: str = "conv",
                 compress_input: bool = False):
        check_range("method.kernel_size", kernel_size, 1, 16)
        check_choice("method.pool_type", pool_type, POOL_TYPES)
        check_choice("method.mode", mode, MODES)
        check_range("method.min_size", min_size, 1)
        check_choice("method.relu_mask", relu_mask, RELU_MASKS)
        check_choice("method.targets", targets, TARGETS)
        check_choice("method.compress_input", compress_input, (True, False))
        if not isinstance(kernel_size, int) or not isinstance(min_size, int):
            raise ConfigError(f"method.kernel_size and method.min_size must be integers, got "
                              f"{kernel_size!r} and {min_size!r}")
        self.kernel_size, self.pool_type, self.mode = kernel_size, pool_type, mode
        self.min_size, self.relu_mask, self.targets = min_size, relu_mask, targets
        self.compress_input = compress_input

    def wrap(self, model: nn.Module) -> nn.Module:
        pooling = dict(k=self.kernel_size, pool_type=self.pool_type, min_size=self.min_size,
                       compress_input=self.compress_input)
        convs = swap_modules(model, lambda _, m: type(m) is nn.Conv2d,
                             lambda _, m: _recast(m, PooledConv2d, mode=self.mode, **pooling))
        if not convs:  # not silent: its ReLU masks alone can cost memory (Linear keeps the input)
            log.warning("method=pool found no nn.Conv2d in %s: nothing is pooled, only its ReLUs "
                        "and max-pools change", type(model).__name__)
        if self.targets == "conv+bn":
            swap_modules(model, lambda _, m: type(m) is nn.BatchNorm2d,
                         lambda _, m: _recast(m, PooledBatchNorm2d, **pooling))
        if self.relu_mask != "none":
            swap_modules(model, lambda _, m: type(m) is nn.ReLU,
                         lambda _, m: MaskedReLU(m.inplace, self.relu_mask))
        swap_modules(model, lambda _, m: type(m) is nn.MaxPool2d and CompactMaxPool2d.fits(m),
                     lambda _, m: _recast(m, CompactMaxPool2d))
        return model


def _recast(module: nn.Module, cls: type, **attrs) -> nn.Module:
    """A `cls` instance sharing `module`'s parameters, buffers and settings (same state_dict
    keys, same Parameter objects) plus `attrs`."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    new.__dict__.update(attrs)
    return new


def _compress(module: nn.Module, x: torch.Tensor) -> bool:
    """Pool this call's saved map: training with autograd on, k > 1, the map not too small, and
    x made by the step (x needs a gradient; the batch does not) unless compress_input."""
    return (module.training and torch.is_grad_enabled() and module.k > 1
            and (x.requires_grad or module.compress_input)
            and min(x.shape[-2:]) >= module.min_size and x.dim() == 4)


class PooledConv2d(nn.Conv2d):
    """nn.Conv2d whose backward keeps pool_k(input) (see PooledConv2dFn)."""

    k: int
    pool_type: str
    mode: str
    min_size: int
    compress_input: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = self.padding
        if isinstance(padding, str):  # "valid" is 0; "same" may be asymmetric: plain conv
            if padding != "valid":
                return super().forward(x)
            padding = (0, 0)
        if not _compress(self, x):
            return super().forward(x)
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        w, b = self.weight, self.bias
        dtype = autocast_dtype(x.device.type)
        if dtype is not None:  # what autocast does to a convolution, done before the Function
            x, w = x.to(dtype), w.to(dtype)
            b = b.to(dtype) if b is not None else None
        with torch.autocast(x.device.type, enabled=False):
            return PooledConv2dFn.apply(x, w, b, self.stride, padding, self.dilation,
                                        self.groups, self.k, self.pool_type, self.mode)


class PooledBatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d whose training backward keeps pool_k(x_hat) (see PooledBatchNormFn).
    Running statistics follow nn.BatchNorm2d exactly; eval mode is the plain module."""

    k: int
    pool_type: str
    min_size: int
    compress_input: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _compress(self, x):
            return super().forward(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm2d
                momentum = 1.0 / float(self.num_batches_tracked)
        with torch.autocast(x.device.type, enabled=False):
            return PooledBatchNormFn.apply(x, self.weight, self.bias, self.running_mean,
                                           self.running_var, momentum, self.eps, self.k,
                                           self.pool_type)


class MaskedReLU(nn.Module):
    """ReLU that keeps a packed 1-bit (`bits`) or bool mask for backward, not its output.
    Stateless, so one instance may be called many times (torchvision's blocks do)."""

    def __init__(self, inplace: bool = False, mask: str = "bits"):
        super().__init__()
        self.inplace, self.mask = inplace, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and x.requires_grad:
            return MaskedReLUFn.apply(x, self.inplace, self.mask)
        return F.relu(x, inplace=self.inplace)

    def extra_repr(self) -> str:
        return f"inplace={self.inplace}, mask={self.mask}"


class CompactMaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d whose backward keeps uint8 window offsets (exact, see CompactMaxPool2dFn)."""

    @staticmethod
    def fits(m: nn.MaxPool2d) -> bool:
        kh, kw = nn.modules.utils._pair(m.kernel_size)
        return not m.return_indices and kh * kw <= 256

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled() and x.requires_grad and x.dim() == 4):
            return super().forward(x)
        pair = nn.modules.utils._pair
        return CompactMaxPool2dFn.apply(x, pair(self.kernel_size),
                                        pair(self.stride or self.kernel_size), pair(self.padding),
                                        pair(self.dilation), self.ceil_mode)
