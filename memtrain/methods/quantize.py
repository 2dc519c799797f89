"""method=quantize: saved activations stored at 8, 4 or 2 bits (ActNN, ICML 2021; GACT, ICML 2022).

The forward pass is exact. Every floating-point activation the model's forward keeps for
backward (the inputs of convolutions and linears, BatchNorm's and GELU/SiLU's inputs, the
operands of elementwise products such as ResMLP's Affine and layer scale) is quantized when it is
saved and dequantized when backward needs it: per group of `group_size` elements (memory order) a
min-max scale and zero point, `bits` per element, stochastic rounding by default, so the saved
value is unbiased and so is every gradient linear in it (all weight gradients of convolutions
and linears; nonlinear backwards such as BatchNorm's and GELU's are approximate). Format and
kernels: kernels/quant.py (Triton on CUDA, vectorised torch elsewhere).

Channels (`channel_norm=minmax`; the default `auto` picks it at 2 bits, `none` at 4 and 8):
before grouping, every channel (dim 1) is shifted and scaled to [0, 1] by its own min and range
(8 bytes per channel in the buffer; only where a channel has at least MIN_CHANNEL_ELEMS
elements), so a channel of small range no longer gets a step set by its neighbours'. Why 2 bits
needed it: docs/methods/quantize.md.

What is *not* quantized: parameters and the low-precision copies autocast makes of them (casts
and views of a parameter), the batch and anything else a step finds alive (no grad_fn: buffers,
BatchNorm's saved statistics), tensors whose packed form would not be smaller, tensors whose
channels hold at most two elements each (a batch of two at 1x1: `EXACT_CHANNEL_ELEMS`), tensors
with overlapping memory (expanded views), and non-float tensors. A view with gaps (q, k and v split
from a fused qkv projection, a ViT's class token) is packed from a copy of its own elements.
ReLUs keep 1-bit masks (`relu_mask=bits`) and max-pools uint8 window offsets (both exact;
pool's modules, from methods/common/compact.py), so a ReLU's output is kept once, quantized, by
the layer that reads it.

Two ways to use the quantizer, so other methods can compose it (offload, stacks):
- `ActivationQuantizer(bits, group_size, stochastic)` is a `saved_tensors_hooks`: every saved
  tensor inside the `with` goes through `pack`/`unpack`. It hands its packed buffer (one uint8
  tensor) on to the hooks that were active when it was entered (memtrain's accounting, an
  offloader), so an outer `save_on_cpu` moves the quantized bytes, not the full tensor.
- `pack_tensor(x, ...) -> Packed` and `unpack_tensor(packed) -> x` inside a custom autograd
  Function (`ctx.packed = pack_tensor(x, ...)`; save `packed.buf` with `ctx.save_for_backward`).

    memtrain method=quantize method.bits=4 method.group_size=128 method.rounding=nearest
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from memtrain.errors import ConfigError, check_choice
from memtrain.kernels import quant
from memtrain.methods.common.activations import is_activation, memory_order, without_overlap
from memtrain.methods.common.compact import RELUS, CompactMaxPool2d, MaskedReLU
from memtrain.methods.common.hooks import ChainedHooks, around_forward, recomputed_input
from memtrain.methods.common.swap import recast, swap_modules

ROUNDINGS = ("stochastic", "nearest")
CHANNEL_NORMS = ("auto", "minmax", "none")
MIN_CHANNEL_ELEMS = 64  # per-channel scaling only where a channel's 8 bytes cost <= 1 bit each
# A tensor whose channels (dim 1) hold at most this many elements each is kept exact: its copy
# costs no more than per-channel scaling's 8 bytes a channel would, and without that scaling a
# group's step, set by other channels, can be the whole gap between a channel's two values,
# which BatchNorm's backward divides by (two samples normalise to -1 and +1 whatever their
# gap): at a batch of two, the squeeze vectors of SE blocks and 1x1 maps made the loss NaN.
EXACT_CHANNEL_ELEMS = 2
RELU_MASKS = ("bits", "none")
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------- one tensor


@dataclass
class Packed:
    """A quantized tensor: `buf` (uint8, kernels/quant.py's layout) plus how to rebuild x."""

    buf: torch.Tensor | None  # None in a hook's state: the bytes travel as the hook's inner tensor
    shape: torch.Size
    perm: tuple[int, ...]  # x.permute(perm) is contiguous: the memory order the groups follow
    dtype: torch.dtype
    bits: int
    group_size: int
    chan: tuple[int, int] | None = None  # (C, inner): per-channel scaling (kernels/quant.py)


def _channels(x: torch.Tensor, perm: tuple[int, ...]) -> tuple[int, int] | None:
    """(C, inner) of dim 1 in x's memory order (x.permute(perm) flat is [outer, C, inner]), or
    None when x has no second dim, one channel, or fewer than MIN_CHANNEL_ELEMS elements per
    channel (its 8 bytes of stats would cost more than a bit per element)."""
    if x.dim() < 2 or x.shape[1] < 2 or x.numel() < MIN_CHANNEL_ELEMS * x.shape[1]:
        return None
    k = perm.index(1)
    inner = 1
    for d in perm[k + 1:]:
        inner *= x.shape[d]
    return x.shape[1], inner


def pack_tensor(x: torch.Tensor, bits: int, group_size: int, stochastic: bool,
                per_channel: bool = True) -> Packed | None:
    """x quantized in its memory order (`per_channel`: each channel of dim 1 first scaled to
    [0, 1]; a view with gaps: its elements in row-major order), or None when that would not
    save memory (too small, not a float, overlaps in its memory) or when its channels hold
    too few elements to quantize (EXACT_CHANNEL_ELEMS)."""
    if x.dtype not in FLOATS or x.numel() == 0:
        return None
    if x.dim() >= 2 and x.numel() <= EXACT_CHANNEL_ELEMS * x.shape[1]:
        return None
    perm = memory_order(x)
    if perm is None:  # gaps: a view into a larger storage (q, k and v split from one qkv
        if not without_overlap(x):  # projection): its own elements, packed from a copy
            return None
        x, perm = x.contiguous(), tuple(range(x.dim()))
    chan = _channels(x, perm) if per_channel else None
    if quant.buffer_bytes(x.numel(), bits, group_size, chan[0] if chan else 0) >= \
            x.numel() * x.element_size():
        return None
    buf = quant.quantize(x.detach().permute(perm), bits, group_size, stochastic, chan=chan)
    return Packed(buf, x.shape, perm, x.dtype, bits, group_size, chan)


def unpack_tensor(p: Packed, buf: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantized tensor, with the shape, dtype and strides x had. `buf` replaces p.buf
    (what an outer hook handed back for it)."""
    buf = p.buf if buf is None else buf
    permuted = [p.shape[d] for d in p.perm]
    flat = quant.dequantize(buf, p.shape.numel(), p.bits, p.group_size, p.dtype, chan=p.chan)
    inverse = sorted(range(len(p.perm)), key=p.perm.__getitem__)
    return flat.view(permuted).permute(inverse)


# ---------------------------------------------------------------- saved-tensor hooks


class ActivationQuantizer(ChainedHooks):
    """Saved-tensor hooks that quantize every activation saved inside the `with` (see the module
    docstring), each storage once per entry, and hand the packed buffer to the hooks that were
    active on entry (or keep it, when there were none): methods/common/hooks.py."""

    def __init__(self, bits: int, group_size: int, stochastic: bool = True,
                 per_channel: bool = True):
        self.bits, self.group_size, self.stochastic = bits, group_size, stochastic
        self.per_channel = per_channel
        super().__init__()

    def keep(self, t: torch.Tensor) -> tuple[Packed | None, torch.Tensor]:
        act = is_activation(t) or (self.inside_checkpoint and recomputed_input(t))
        packed = pack_tensor(t, self.bits, self.group_size, self.stochastic,
                             self.per_channel) if act else None
        if packed is None:
            return None, t
        # the handle keeps the bytes through the outer hooks (an offloader moves them; a
        # checkpoint drops them and recomputes): the state keeps only how to rebuild x
        return dataclasses.replace(packed, buf=None), packed.buf

    def restore(self, packed: Packed | None, inner: torch.Tensor) -> torch.Tensor:
        return inner if packed is None else unpack_tensor(packed, inner)


# ---------------------------------------------------------------- the method


class QuantizeMethod:
    """ReLU -> 1-bit mask, MaxPool2d -> compact offsets (pool's modules), and an
    `ActivationQuantizer` around every training forward of the model."""

    name = "quantize"
    grads_exact = False  # backward reads low-bit copies of the saved activations

    def __init__(self, bits: int = 4, group_size: int = 256, rounding: str = "stochastic",
                 relu_mask: str = "bits", channel_norm: str = "auto"):
        check_choice("method.bits", bits, quant.BITS)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 \
                or group_size % quant.GROUP_MULTIPLE or group_size > 4096:
            raise ConfigError(f"method.group_size must be a positive multiple of "
                              f"{quant.GROUP_MULTIPLE} up to 4096, got {group_size!r}")
        check_choice("method.rounding", rounding, ROUNDINGS)
        check_choice("method.relu_mask", relu_mask, RELU_MASKS)
        check_choice("method.channel_norm", channel_norm, CHANNEL_NORMS)
        self.bits, self.group_size, self.rounding = bits, group_size, rounding
        # measured on resnet18 16 px (docs/methods/quantize.md): minmax keeps 2 bits from
        # diverging; at 4 bits plain groups trained better on the seeds measured
        if channel_norm == "auto":
            channel_norm = "minmax" if bits == 2 else "none"
        self.relu_mask, self.channel_norm = relu_mask, channel_norm

    def hooks(self) -> ActivationQuantizer:
        """A fresh quantizer with this method's settings (for stacks and custom loops)."""
        return ActivationQuantizer(self.bits, self.group_size, self.rounding == "stochastic",
                                   self.channel_norm == "minmax")

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.relu_mask == "bits":
            swap_modules(model, lambda _, m: type(m) in RELUS,
                         lambda _, m: MaskedReLU.of(m, "bits"))
        swap_modules(model, lambda _, m: type(m) is nn.MaxPool2d and CompactMaxPool2d.fits(m),
                     lambda _, m: recast(m, CompactMaxPool2d))
        return around_forward(model, self.hooks)
