"""method=pool: the backward pass from pooled activations (Barley & Froening, arXiv 2409.11902).

The forward pass stays exact. Convolutions keep `pool_k(x)` for backward instead of x (grad_input
stays exact, grad_weight is approximate); with `targets=conv+bn` BatchNorm keeps a pooled x_hat
too (its whole backward becomes approximate). The pitfall (docs/methods/pool.md): a conv input is
usually a ReLU output that the ReLU saves as well, so ReLUs keep a 1-bit (or bool) mask; max-pools
keep uint8 window offsets instead of their input and int64 indices. Both of those are exact.
A layer whose input is data from outside the autograd graph (the batch, or a view of it: it
needs no gradient) is left alone unless `compress_input=true`: the loop keeps the batch for the
whole step, so a compressed copy adds memory and only degrades the first layer's gradient.

    memtrain method=pool method.kernel_size=4 method.mode=pooled method.targets=conv+bn
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.errors import ConfigError, check_choice, check_range
from memtrain.methods.common.compact import RELUS, CompactMaxPool2d, MaskedReLU
from memtrain.methods.common.swap import (
    cond_conv_kernels,
    is_timm_bn_act,
    is_timm_cond_conv2d,
    is_timm_conv2d_same,
    recast,
    swap_modules,
)
from memtrain.models.chain import registered

log = logging.getLogger(__name__)

POOL_TYPES = ("avg", "max")
MODES = ("upsample", "pooled")
RELU_MASKS = ("bits", "bool", "none")
TARGETS = ("conv", "conv+bn")


def _conv_class(m: nn.Module) -> type | None:
    """The pooled class for a convolution this method knows (nn.Conv2d, timm's Conv2dSame and
    CondConv2d), or None (other subclasses, such as weight-standardised convolutions, compute
    something else)."""
    if type(m) is nn.Conv2d:
        return PooledConv2d
    if is_timm_conv2d_same(m):
        return PooledConv2dSame
    return PooledCondConv2d if is_timm_cond_conv2d(m) else None


def _pooled(m: nn.Module, mode: str, **pooling) -> nn.Module:
    """`m` recast as its pooled class (a CondConv2d keeps its own forward for the calls that
    pool nothing: eval, no gradient, a small map)."""
    cls = _conv_class(m)
    if cls is PooledCondConv2d:
        pooling["plain_forward"] = type(m).forward
    return recast(m, cls, mode=mode, **pooling)


def _bn_class(m: nn.Module) -> type | None:
    """The pooled class for a batch norm this method knows (nn.BatchNorm2d, timm's
    BatchNormAct2d), or None."""
    if type(m) is nn.BatchNorm2d:
        return PooledBatchNorm2d
    return PooledBatchNormAct2d if is_timm_bn_act(m) else None


class PoolMethod:
    """Swaps Conv2d (and BatchNorm2d with targets=conv+bn) for pooled-backward versions, ReLU
    for a masked ReLU (unless relu_mask=none) and MaxPool2d for a compact-index one. Also
    timm's Conv2dSame, CondConv2d and BatchNormAct2d, by what they compute (a padded conv; a
    conv whose kernel each sample mixes from experts; a batch norm followed by its dropout and
    activation, whose ReLU is masked as any other)."""

    name = "pool"
    grads_exact = False  # grad_weight (and with conv+bn BatchNorm's backward) from pooled maps

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
        stem = _stem_convs(model)
        convs = swap_modules(model, lambda _, m: _conv_class(m) is not None,
                             lambda _, m: _pooled(m, self.mode, **pooling))
        relus = any(type(m) in (*RELUS, nn.MaxPool2d) for m in model.modules())
        bns = self.targets == "conv+bn" and any(_bn_class(m) for m in model.modules())
        input_only = not convs or (set(convs) <= stem and not self.compress_input)
        if not relus and not bns and input_only:
            what = (f"its only convolutions ({', '.join(convs)}) read the input batch, which the "
                    "step keeps anyway (method.compress_input=true would pool that copy)"
                    if convs else "it has no convolution")
            raise ConfigError(f"method=pool pools the maps convolutions save and swaps ReLUs, "
                              f"max-pools (and batch norms at method.targets=conv+bn) for compact "
                              f"ones; {type(model).__name__} has none of these and {what}: it "
                              f"would change nothing")
        if not convs:  # not silent: its ReLU masks alone can cost memory (Linear keeps the input)
            log.warning("method=pool found no nn.Conv2d in %s: nothing is pooled, only its ReLUs "
                        "and max-pools change", type(model).__name__)
        if self.targets == "conv+bn":
            swap_modules(model, lambda _, m: _bn_class(m) is not None,
                         lambda _, m: recast(m, _bn_class(m), **pooling))
        if self.relu_mask != "none":
            swap_modules(model, lambda _, m: type(m) in RELUS,
                         lambda _, m: MaskedReLU.of(m, self.relu_mask))
        swap_modules(model, lambda _, m: type(m) is nn.MaxPool2d and CompactMaxPool2d.fits(m),
                     lambda _, m: recast(m, CompactMaxPool2d))
        return model


def _stem_convs(model: nn.Module) -> set[str]:
    """Names of the convolutions in the model's chain entry (what reads the batch: a ViT's
    patch embedding, a ResNet's first convolution); empty for a model without a chain rule
    (a chain found by tracing has no entry module)."""
    chain = registered(model)
    entry = chain.entry if chain is not None else None
    inside = {id(m) for m in entry.modules()} if entry is not None else set()
    return {n for n, m in model.named_modules() if _conv_class(m) and id(m) in inside}


def _compress(module: nn.Module, x: torch.Tensor) -> bool:
    """Pool this call's saved map: training with autograd on, k > 1, the map not too small, and
    x made by the step (x needs a gradient; the batch does not) unless compress_input."""
    return (module.training and torch.is_grad_enabled() and module.k > 1
            and (x.requires_grad or module.compress_input)
            and min(x.shape[-2:]) >= module.min_size and x.dim() == 4)


def _same_pads(x: torch.Tensor, kernel_size, stride, dilation) -> list[int]:
    """F.pad's pads for TensorFlow's "SAME" padding of x (the odd pixel at the end)."""
    pads = []
    for size, k, s, d in zip(x.shape[:-3:-1], kernel_size[::-1], stride[::-1], dilation[::-1]):
        total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
        pads += [total // 2, total - total // 2]
    return pads


def _pooled_conv(module: nn.Module, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 padding, groups: int) -> torch.Tensor:
    """PooledConv2dFn with the module's settings, run as autocast would run the convolution."""
    dtype = autocast_dtype(x.device.type)
    if dtype is not None:  # what autocast does to a convolution, done before the Function
        x, w = x.to(dtype), w.to(dtype)
        b = b.to(dtype) if b is not None else None
    with torch.autocast(x.device.type, enabled=False):
        return PooledConv2dFn.apply(x, w, b, module.stride, padding, module.dilation, groups,
                                    module.k, module.pool_type, module.mode)


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
        return _pooled_conv(self, x, self.weight, self.bias, padding, self.groups)


class PooledConv2dSame(PooledConv2d):
    """timm's Conv2dSame, pooled: the input padded as TensorFlow's "SAME" (per call, the odd
    pixel at the end), then PooledConv2d's unpadded convolution on it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = _same_pads(x, self.kernel_size, self.stride, self.dilation)
        return super().forward(F.pad(x, pads) if any(pads) else x)


class PooledCondConv2d(nn.Module):
    """timm's CondConv2d, pooled (recast in place: its experts, state_dict keys and settings):
    each sample's kernel mixed from the experts by its routing weights, as the module does,
    then the batch as one grouped convolution (groups x B) through PooledConv2dFn, which keeps
    the pooled input. The kernel mix stays in autograd (the routing and the experts get their
    gradients through it); calls that pool nothing run the module's own forward."""

    k: int
    pool_type: str
    mode: str
    min_size: int
    compress_input: bool
    plain_forward: Callable  # CondConv2d.forward (a function, called with self)

    def forward(self, x: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        if not _compress(self, x):
            return self.plain_forward(self, x, routing_weights)
        n, c, h, w = x.shape
        weight, bias = cond_conv_kernels(self, routing_weights)
        x = x.reshape(1, n * c, h, w)
        padding = self.padding
        if self.dynamic_padding:
            pads = _same_pads(x, self.kernel_size, self.stride, self.dilation)
            x, padding = (F.pad(x, pads) if any(pads) else x), (0, 0)
        out = _pooled_conv(self, x, weight, bias, padding, self.groups * n)
        return out.permute(1, 0, 2, 3).view(n, self.out_channels, *out.shape[-2:])


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


class PooledBatchNormAct2d(PooledBatchNorm2d):
    """timm's BatchNormAct2d, pooled: PooledBatchNorm2d, then the module's own `drop` and `act`
    (a ReLU there is swapped for a masked one as anywhere else)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(super().forward(x)))


# ---------------------------------------------------------------- autograd functions
#
# - `PooledConv2dFn`: saves `pool(x)` (avg or max values, never int64 indices) and the weight.
#   grad_input is exact (it needs only the weight); grad_weight comes from the pooled input,
#   `mode="upsample"` (nearest-upsampled pooled input, full grad_output) or `mode="pooled"` (grad
#   output pooled too, correlation at low resolution, rescaled by the element-count ratio).
# - `PooledBatchNormFn`: training-mode BatchNorm2d that saves the pooled normalised input x_hat;
#   its backward uses the upsampled x_hat (approximate).
# Both keep what backward needs through `ctx.save_for_backward` (memtrain's contract). The
# ReLU and max-pool this method compacts are common/compact.py's (quantize uses them too).


def pool(x: torch.Tensor, k: int, pool_type: str) -> torch.Tensor:
    """k x k pooling, stride k; a partial last window (size not divisible by k) is kept
    (ceil mode; the average then runs over the elements inside)."""
    if k == 1:
        return x
    if pool_type == "max":  # values only: max_pool2d without return_indices
        return F.max_pool2d(x, k, k, ceil_mode=True)
    return F.avg_pool2d(x, k, k, ceil_mode=True)


def upsample(xp: torch.Tensor, k: int, size: tuple[int, int]) -> torch.Tensor:
    """Nearest upsampling by k, cropped to `size`: element (i, j) reads xp[i // k, j // k]
    (F.interpolate's nearest would misalign when the size is not a multiple of k)."""
    if k == 1:
        return xp
    return xp.repeat_interleave(k, dim=-2)[..., :size[0], :].repeat_interleave(k, dim=-1)[
        ..., :size[1]]


def _fit(t: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Crop or zero-pad the last two dims of t to `size` (F.pad crops on negative pads)."""
    dh, dw = size[0] - t.shape[-2], size[1] - t.shape[-1]
    return F.pad(t, (0, dw, 0, dh)) if dh or dw else t


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast would run a convolution in on this device, or None."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


# ---------------------------------------------------------------- convolution


class PooledConv2dFn(torch.autograd.Function):
    """conv2d that keeps `pool(x)` and the weight for backward.

    Called outside autocast with tensors already in the compute dtype (see PooledConv2d).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, k, pool_type, mode):
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        ctx.conf = (stride, padding, dilation, groups, k, mode)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        ctx.save_for_backward(pool(x, k, pool_type), weight)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xp, weight = ctx.saved_tensors
        stride, padding, dilation, groups, k, mode = ctx.conf
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_out = grad_out.contiguous()
        args = (stride, padding, dilation, False, [0], groups)
        gx = gw = gb = None
        if mode == "pooled" and k > 1 and need_w:
            gw = _pooled_grad_weight(xp, weight, grad_out, ctx.x_shape, k, args)
            need_w = False
        if need_x or need_w or need_b:
            # grad_input reads only the shape of the input, so the upsampled map gives it exactly
            x_full = upsample(xp, k, ctx.x_shape[-2:]) if need_w else \
                grad_out.new_empty(1).expand(ctx.x_shape)
            gx, gw_up, gb = torch.ops.aten.convolution_backward(
                grad_out, x_full, weight, [weight.shape[0]] if ctx.has_bias else None,
                *args, (need_x, need_w, need_b))
            gw = gw if gw is not None else gw_up
        return gx, gw, gb, None, None, None, None, None, None, None


def _pooled_grad_weight(xp, weight, grad_out, x_shape, k, args):
    """grad_weight correlated at 1/k resolution: the same convolution run on the pooled input
    must produce the pooled grad_output's size (cropped or zero-padded to it); the sum over
    positions is scaled by how many full-resolution outputs each pooled one stands for."""
    stride, padding, dilation = args[:3]
    gp = F.avg_pool2d(grad_out, k, k, ceil_mode=True)
    size = tuple(
        (xp.shape[-2 + i] + 2 * padding[i] - dilation[i] * (weight.shape[-2 + i] - 1) - 1)
        // stride[i] + 1 for i in range(2))
    gp = _fit(gp, size)
    scale = grad_out.shape[-2] * grad_out.shape[-1] / (gp.shape[-2] * gp.shape[-1])
    _, gw, _ = torch.ops.aten.convolution_backward(
        gp.contiguous(), xp, weight, None, *args, (False, True, False))
    return gw * scale


# ---------------------------------------------------------------- batch norm


class PooledBatchNormFn(torch.autograd.Function):
    """Training-mode batch norm (running statistics updated as nn.BatchNorm2d does) that keeps
    pool(x_hat), the weight and 1/std; backward from the nearest-upsampled x_hat."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, k, pool_type):
        out, mean, rstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var,
                                                  True, momentum, eps)
        shape = (1, -1, 1, 1)
        # pooling commutes with the per-channel affine map x -> (x - mean) * rstd (rstd > 0)
        acc = torch.promote_types(x.dtype, torch.float32)  # statistics precision, at least fp32
        xhat_p = pool(x, k, pool_type).to(acc)  # a new tensor (k > 1): normalised in place
        xhat_p.sub_(mean.view(shape)).mul_(rstd.view(shape))
        ctx.k, ctx.size, ctx.x_dtype = k, x.shape[-2:], x.dtype
        ctx.save_for_backward(xhat_p.to(x.dtype), weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xhat_p, weight, rstd = ctx.saved_tensors
        dims = (0, 2, 3)
        shape = (1, -1, 1, 1)
        acc = torch.promote_types(ctx.x_dtype, torch.float32)
        g = grad_out.to(acc)
        xhat = upsample(xhat_p.to(acc), ctx.k, ctx.size)
        gb = g.sum(dims)
        gw = (g * xhat).sum(dims)
        gx = None
        if ctx.needs_input_grad[0]:
            n = g.numel() / g.shape[1]
            scale = rstd if weight is None else rstd * weight.to(acc)
            gx = (scale.view(shape) * (g - (gb / n).view(shape) - xhat * (gw / n).view(shape)))
            gx = gx.to(ctx.x_dtype)
        gw = gw.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        gb = gb.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None, None, None, None, None
