"""The compact ReLU and max-pool that several methods use (pool, quantize, checkpoint's
compaction): exact forwards, and exact backwards from far fewer saved bytes.

- `MaskedReLUFn`: ReLU that saves a 1-bit packed (or bool) mask instead of its output.
- `CompactMaxPool2dFn`: exact max-pool whose backward needs only uint8 window offsets, instead of
  the input and int64 indices that aten's max-pool keeps.
- `MaskedReLU`, `CompactMaxPool2d`: the modules that run them in training.

Every tensor kept for backward goes through `ctx.save_for_backward` (memtrain's contract).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.kernels import bitmask

# ---------------------------------------------------------------- ReLU


class MaskedReLUFn(torch.autograd.Function):
    """ReLU whose backward keeps only where the output is positive: 1 bit per element packed
    into bytes (`mask="bits"`) or a bool tensor (`mask="bool"`). With `top` (ReLU6: 6), the
    output is clamped to [0, top] and the mask is where it lies strictly inside, where
    torch's ReLU6 passes the gradient: one bit still."""

    @staticmethod
    def forward(ctx, x, inplace, mask, top=None):
        if inplace:
            out = x.relu_() if top is None else x.clamp_(0, top)
            ctx.mark_dirty(x)
        else:
            out = torch.relu(x) if top is None else x.clamp(0, top)
        if top is None:
            kept = bitmask.pack(out) if mask == "bits" else out > 0
        else:
            inside = (out > 0).logical_and_(out < top)
            kept = bitmask.pack(inside.view(torch.uint8)) if mask == "bits" else inside
        ctx.mask = mask
        ctx.save_for_backward(kept)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (kept,) = ctx.saved_tensors
        if ctx.mask == "bits":
            return bitmask.masked_grad(grad_out, kept), None, None, None
        return torch.where(kept, grad_out, grad_out.new_zeros(())), None, None, None


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


# ---------------------------------------------------------------- modules


class MaskedReLU(nn.Module):
    """ReLU (or with `top=6.0`, ReLU6) that keeps a packed 1-bit (`bits`) or bool mask for
    backward, not its output. Stateless, so one instance may be called many times
    (torchvision's blocks do)."""

    def __init__(self, inplace: bool = False, mask: str = "bits", top: float | None = None):
        super().__init__()
        self.inplace, self.mask, self.top = inplace, mask, top

    @classmethod
    def of(cls, m: nn.Module, mask: str = "bits") -> MaskedReLU:
        """The masked form of an nn.ReLU or nn.ReLU6 (`RELUS`)."""
        return cls(m.inplace, mask, float(m.max_val) if type(m) is nn.ReLU6 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and x.requires_grad:
            return MaskedReLUFn.apply(x, self.inplace, self.mask, self.top)
        if self.top is None:
            return F.relu(x, inplace=self.inplace)
        return F.hardtanh(x, 0.0, self.top, inplace=self.inplace)

    def extra_repr(self) -> str:
        top = "" if self.top is None else f", top={self.top}"
        return f"inplace={self.inplace}, mask={self.mask}{top}"


RELUS = (nn.ReLU, nn.ReLU6)  # the activations MaskedReLU replaces exactly (classes, not subclasses)


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
