"""method=quantize: saved activations stored at 8, 4 or 2 bits (ActNN, ICML 2021; GACT, ICML 2022).

The forward pass is exact. Every floating-point activation the model's forward keeps for
backward (the inputs of convolutions and linears, BatchNorm's and GELU/SiLU's inputs, the
operands of elementwise products such as ResMLP's Affine and layer scale) is quantized when it is
saved and dequantized when backward needs it: per group of `group_size` elements (memory order) a
min-max scale and zero point, `bits` per element, stochastic rounding by default, so the saved
value is unbiased and so is every gradient linear in it (all weight gradients of convolutions
and linears; nonlinear backwards such as BatchNorm's and GELU's are approximate). Format and
kernels: kernels/quant.py (Triton on CUDA, vectorised torch elsewhere).

What is *not* quantized: parameters and the low-precision copies autocast makes of them (casts
and views of a parameter), the batch and anything else a step finds alive (no grad_fn: buffers,
BatchNorm's saved statistics), tensors whose packed form would not be smaller, tensors with
overlapping memory (expanded views), and non-float tensors. ReLUs keep pool's 1-bit masks
(`relu_mask=bits`) and max-pools pool's uint8 window offsets (both exact), so a ReLU's output is
kept once, quantized, by the layer that reads it.

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
from memtrain.methods._hooks import ChainedHooks, around_forward, recomputed_input
from memtrain.methods._swap import swap_modules
from memtrain.methods.pool import CompactMaxPool2d, MaskedReLU, _recast

ROUNDINGS = ("stochastic", "nearest")
RELU_MASKS = ("bits", "none")
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# autograd nodes that only cast or reshape their one input: a chain of them down to a parameter
# is a weight copy (autocast's, linear's weight.t()), not an activation
_PASS_THROUGH = ("ToCopyBackward", "TBackward", "ViewBackward", "TransposeBackward",
                 "PermuteBackward", "UnsafeViewBackward", "ExpandBackward", "ReshapeAlias",
                 "UnsqueezeBackward", "SqueezeBackward", "CloneBackward")


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


def _memory_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation that makes x contiguous (its memory order), or None when x's memory has
    gaps or overlaps (an expanded view), which reading it flat cannot reproduce."""
    perm = tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.shape[d])))
    return perm if x.permute(perm).is_contiguous() else None


def pack_tensor(x: torch.Tensor, bits: int, group_size: int, stochastic: bool) -> Packed | None:
    """x quantized in its memory order, or None when that would not save memory (too small,
    not a float, gaps or overlaps in its memory)."""
    if x.dtype not in FLOATS or x.numel() == 0:
        return None
    perm = _memory_order(x)
    if perm is None or quant.buffer_bytes(x.numel(), bits, group_size) >= \
            x.numel() * x.element_size():
        return None
    buf = quant.quantize(x.detach().permute(perm), bits, group_size, stochastic)
    return Packed(buf, x.shape, perm, x.dtype, bits, group_size)


def unpack_tensor(p: Packed, buf: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantized tensor, with the shape, dtype and strides x had. `buf` replaces p.buf
    (what an outer hook handed back for it)."""
    buf = p.buf if buf is None else buf
    permuted = [p.shape[d] for d in p.perm]
    flat = quant.dequantize(buf, p.shape.numel(), p.bits, p.group_size, p.dtype)
    inverse = sorted(range(len(p.perm)), key=p.perm.__getitem__)
    return flat.view(permuted).permute(inverse)


def is_activation(t: torch.Tensor) -> bool:
    """Made by the step's differentiable ops, and not a cast or view of a parameter."""
    fn = t.grad_fn
    if fn is None or isinstance(t, nn.Parameter):  # parameters, buffers, the batch, statistics
        return False
    while any(type(fn).__name__.startswith(p) for p in _PASS_THROUGH):
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return True
        fn = nxt[0]
    return type(fn).__name__ != "AccumulateGrad"


# ---------------------------------------------------------------- saved-tensor hooks


class ActivationQuantizer(ChainedHooks):
    """Saved-tensor hooks that quantize every activation saved inside the `with` (see the module
    docstring), each storage once per entry, and hand the packed buffer to the hooks that were
    active on entry (or keep it, when there were none): methods/_hooks.py."""

    def __init__(self, bits: int, group_size: int, stochastic: bool = True):
        self.bits, self.group_size, self.stochastic = bits, group_size, stochastic
        super().__init__()

    def keep(self, t: torch.Tensor) -> tuple[Packed | None, torch.Tensor]:
        act = is_activation(t) or (self.inside_checkpoint and recomputed_input(t))
        packed = pack_tensor(t, self.bits, self.group_size, self.stochastic) if act else None
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

    def __init__(self, bits: int = 4, group_size: int = 256, rounding: str = "stochastic",
                 relu_mask: str = "bits"):
        check_choice("method.bits", bits, quant.BITS)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 \
                or group_size % quant.GROUP_MULTIPLE or group_size > 4096:
            raise ConfigError(f"method.group_size must be a positive multiple of "
                              f"{quant.GROUP_MULTIPLE} up to 4096, got {group_size!r}")
        check_choice("method.rounding", rounding, ROUNDINGS)
        check_choice("method.relu_mask", relu_mask, RELU_MASKS)
        self.bits, self.group_size, self.rounding = bits, group_size, rounding
        self.relu_mask = relu_mask

    def hooks(self) -> ActivationQuantizer:
        """A fresh quantizer with this method's settings (for stacks and custom loops)."""
        return ActivationQuantizer(self.bits, self.group_size, self.rounding == "stochastic")

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.relu_mask == "bits":
            swap_modules(model, lambda _, m: type(m) is nn.ReLU,
                         lambda _, m: MaskedReLU(m.inplace, "bits"))
        swap_modules(model, lambda _, m: type(m) is nn.MaxPool2d and CompactMaxPool2d.fits(m),
                     lambda _, m: _recast(m, CompactMaxPool2d))
        return around_forward(model, self.hooks)
