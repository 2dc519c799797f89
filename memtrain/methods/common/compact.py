"""Autograd functions of `method=pool`: exact forwards, backwards from compressed saved tensors.

- `PooledConv2dFn`: saves `pool(x)` (avg or max values, never int64 indices) and the weight.
  grad_input is exact (it needs only the weight); grad_weight comes from the pooled input,
  `mode="upsample"` (nearest-upsampled pooled input, full grad_output) or `mode="pooled"` (grad
  output pooled too, correlation at low resolution, rescaled by the element-count ratio).
- `PooledBatchNormFn`: training-mode BatchNorm2d that saves the pooled normalised input x_hat;
  its backward uses the upsampled x_hat (approximate).
- `MaskedReLUFn`: ReLU that saves a 1-bit packed (or bool) mask instead of its output.
- `CompactMaxPool2dFn`: exact max-pool whose backward needs only uint8 window offsets, instead of
  the input and int64 indices that aten's max-pool keeps.

Every tensor kept for backward goes through `ctx.save_for_backward` (memtrain's contract).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memtrain.kernels import bitmask

# ---------------------------------------------------------------- pooling helpers


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


# ---------------------------------------------------------------- ReLU


class MaskedReLUFn(torch.autograd.Function):
    """ReLU whose backward keeps only where the output is positive: 1 bit per element packed
    into bytes (`mask="bits"`) or a bool tensor (`mask="bool"`)."""

    @staticmethod
    def forward(ctx, x, inplace, mask):
        if inplace:
            out = x.relu_()
            ctx.mark_dirty(x)
        else:
            out = torch.relu(x)
        kept = bitmask.pack(out) if mask == "bits" else out > 0
        ctx.mask = mask
        ctx.save_for_backward(kept)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (kept,) = ctx.saved_tensors
        if ctx.mask == "bits":
            return bitmask.masked_grad(grad_out, kept), None, None
        return torch.where(kept, grad_out, grad_out.new_zeros(())), None, None


# ---------------------------------------------------------------- max-pool


class CompactMaxPool2dFn(torch.autograd.Function):
    """max_pool2d whose backward keeps the argmax as a uint8 offset inside its window (the
    window has at most 256 elements) instead of the input plus int64 flat indices: exact."""

    @staticmethod
    def forward(ctx, x, kernel_size, stride, padding, dilation, ceil_mode):
        # aten's int64 indices and the index arithmetic would cost several bytes per output
        # element at once (they set pool's activation peak in the stem): work in CHUNKS slices
        # of the batch (or channels), int32 and in place, so they stay ~1 byte per element.
        out = local = None
        for sl in _slices(x.shape[:2]):
            o, idx = F.max_pool2d(x[sl], kernel_size, stride, padding, dilation, ceil_mode,
                                  return_indices=True)
            if out is None:
                out = torch.empty(x.shape[:2] + o.shape[2:], dtype=o.dtype, device=o.device,
                                  memory_format=_memory_format(x))
                local = torch.empty(out.shape, dtype=torch.uint8, device=x.device)
            out[sl] = o
            local[sl] = _offsets(idx, x.shape[-1], kernel_size, stride, padding, dilation)
        ctx.conf = (x.shape, kernel_size, stride, padding, dilation)
        ctx.save_for_backward(local)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (local,) = ctx.saved_tensors
        x_shape, kernel_size, stride, padding, dilation = ctx.conf
        row, col = _window_origin(grad_out.shape[-2:], stride, padding, grad_out.device)
        gx = grad_out.new_zeros(*x_shape[:-2], x_shape[-2] * x_shape[-1])
        for sl in _slices(x_shape[:2]):  # int64 flat indices (scatter_add_ wants them) per slice
            off = local[sl].long()
            r = row + (off // kernel_size[1]) * dilation[0]
            c = col + (off % kernel_size[1]) * dilation[1]
            gx[sl].scatter_add_(-1, (r * x_shape[-1] + c).flatten(-2), grad_out[sl].flatten(-2))
        return gx.view(x_shape), None, None, None, None, None


CHUNKS = 8  # slices of a max-pool's (N, C) planes processed at a time


def _slices(nc: torch.Size) -> list[tuple[slice, slice]]:
    """About CHUNKS (batch, channel) slices covering nc: batch first, channels when N is small."""
    n, c = nc
    nb = min(n, CHUNKS)
    cb = min(c, -(-CHUNKS // nb))
    return [(slice(i * n // nb, (i + 1) * n // nb), slice(j * c // cb, (j + 1) * c // cb))
            for i in range(nb) for j in range(cb)]


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    cl = not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
    return torch.channels_last if cl else torch.contiguous_format


def _offsets(idx: torch.Tensor, w: int, kernel_size, stride, padding, dilation) -> torch.Tensor:
    """aten's flat argmax (row * w + col in the input plane) -> the offset inside its dilated
    window, in units of dilation, computed in int32 in place (a plane has < 2^31 elements)."""
    row, col = _window_origin(idx.shape[-2:], stride, padding, idx.device)
    c = idx.to(torch.int32)
    del idx
    r = torch.div(c, w, rounding_mode="floor")
    c.remainder_(w).sub_(col.to(torch.int32)).div_(dilation[1], rounding_mode="floor")
    r.sub_(row.to(torch.int32)).div_(dilation[0], rounding_mode="floor").mul_(kernel_size[1])
    return r.add_(c)


def _window_origin(out_hw, stride, padding, device):
    """Top-left input coordinates of every output window, broadcastable to [.., oh, ow]."""
    row = torch.arange(out_hw[0], device=device) * stride[0] - padding[0]
    col = torch.arange(out_hw[1], device=device) * stride[1] - padding[1]
    return row[:, None], col[None, :]
