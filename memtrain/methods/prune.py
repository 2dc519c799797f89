"""Method `prune`: block-sparse pruning of the activations that nn.Linear and 1x1 convolutions
keep for backward (Barley & Froening, arXiv 2311.16883).

The forward pass and grad_input are exact; only grad_weight = G^T @ A sees the pruned input. The
input A, viewed as a matrix (Linear: [rows, in_features]; 1x1 conv: [N*H*W, C_in]), is tiled into
b x b blocks, and the ceil((1 - s) n) blocks of largest norm (over the whole matrix) are kept
as values [nnz, b, b] plus int32 block indices (kernels/bsr.py, kernels/block_sparse.py).

Exactness: at sparsity 0 the swapped layers run the baseline's own autograd path (bitwise equal).
A layer call keeps its dense input (and so an exact gradient) where blocks would only add memory,
as planned on the run's first batch (PruneMethod.plan): an input another op keeps for backward
(resnet18's block inputs, which its 3x3 convs keep), the network's input (the batch, alive for the
whole step; `method.compress_input=true` prunes it anyway), and a matrix whose kept blocks take at
least as much as the matrix itself. A ReLU whose output only pruned layers keep saves a 1-bit mask
instead (`method.relu_mask`), which frees mlp6's hidden layers' inputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from memtrain.errors import ConfigError, check_choice, check_range
from memtrain.kernels import bsr
from memtrain.methods.base import NO_CONTEXT, MethodContext, ProbeStep
from memtrain.methods.common.compact import MaskedReLUFn
from memtrain.methods.common.swap import (
    cond_conv_kernels,
    is_hf_conv1d,
    is_linear,
    is_timm_cond_conv2d,
    linear_of_conv1d,
    swap_modules,
)

LAYERS = ("linear", "conv1x1", "both")
BLOCK_SIZES = (16, 32, 64)
RELU_MASKS = ("bits", "bool", "none")


# ---------------------------------------------------------------- autograd: save, then grad_weight


def _save(ctx, x: torch.Tensor, weight: torch.Tensor, spec: bsr.PruneSpec, to_matrix,
          m: int) -> None:
    """Save W and the kept blocks of A = to_matrix(x) (or x itself when compression would not
    save memory: x, not a reshaped copy, so nothing beyond the baseline's storage is kept).
    A = to_matrix(x) has m rows."""
    ctx.spec, ctx.sparse, ctx.to_matrix = spec, False, to_matrix
    if not ctx.needs_input_grad[1]:  # frozen weight: A is not needed at all
        ctx.save_for_backward(weight)
        return
    k = weight.shape[1]  # in_features / C_in: A's columns
    if spec.keep_dense or bsr.compressed_elements(m, k, spec) >= m * k or (
            not spec.prune_shared and kept_by_producer(x)) or (
            not spec.compress_input and not ctx.needs_input_grad[0]):
        ctx.save_for_backward(weight, x)
        return
    bs = bsr.compress(to_matrix(x.detach()), spec)
    ctx.sparse, ctx.shape = True, bs.shape
    ctx.save_for_backward(weight, bs.values, bs.rows, bs.col_ptr)


def kept_by_producer(x: torch.Tensor) -> bool:
    """Does the op that made x (or x's base, for a view) keep its output, x's storage, for its own
    backward (ReLU, sigmoid, tanh)? Then blocks would be memory on top of a tensor that stays.

    Read from the node's `_raw_saved_result` attribute: nothing is unpacked, so saved-tensor
    hooks (checkpointing, accounting) see no extra access.
    """
    return any(t is not None and t.grad_fn is not None
               and hasattr(t.grad_fn, "_raw_saved_result") for t in (x, x._base))


def _grad_weight(ctx, g2d: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """[out, in] = G^T @ A (pruned), or None when the weight needs no gradient."""
    if not ctx.needs_input_grad[1]:
        return None
    if not ctx.sparse:
        return g2d.t().mm(ctx.to_matrix(saved[0]).to(g2d.dtype))
    values, rows, col_ptr = saved
    return bsr.grad_weight(g2d, bsr.BlockSparse(values, rows, col_ptr, ctx.shape),
                            ctx.spec.backend)


def _lin_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., F] -> [rows, F] (a copy only for non-contiguous views such as ResMLP's transposes)."""
    return t.reshape(-1, t.shape[-1])


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[N, C, H, W] -> [N*H*W, C]: a view for channels_last tensors, a copy otherwise."""
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])


def _conv_rows(t: torch.Tensor, stride: tuple[int, int]) -> torch.Tensor:
    """The pixels a strided 1x1 convolution reads, as [N*Ho*Wo, C]."""
    return _rows(t[:, :, ::stride[0], ::stride[1]] if stride != (1, 1) else t)


class PrunedLinearFn(torch.autograd.Function):
    """y = x W^T + b, saving W and x [..., in] viewed as [rows, in], block-pruned."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: bsr.PruneSpec):
        ctx.has_bias = bias is not None
        _save(ctx, x, weight, spec, _lin_rows, x.numel() // x.shape[-1])
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        weight, *saved = ctx.saved_tensors
        g2d = _lin_rows(grad_out)  # [rows, out]
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_b = g2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, _grad_weight(ctx, g2d, tuple(saved)), grad_b, None


def _conv_saved(ctx, x, weight, bias, spec: bsr.PruneSpec, stride: tuple[int, int],
                out: torch.Tensor) -> torch.Tensor:
    """A 1x1 convolution's forward, its output made: note what backward needs and save the
    weight and the pixels it read (`_save`); returns the output."""
    ctx.has_bias, ctx.x_shape, ctx.stride = bias is not None, x.shape, stride
    _save(ctx, x, weight, spec, partial(_conv_rows, stride=stride), out.numel() // out.shape[1])
    return out


def _unstrided(ctx, grad_x: torch.Tensor) -> torch.Tensor:
    """grad_input of a strided 1x1 convolution at the input's size: the pixels the stride
    skipped get no gradient."""
    if ctx.stride == (1, 1):
        return grad_x
    full = grad_x.new_zeros(ctx.x_shape)
    full[:, :, ::ctx.stride[0], ::ctx.stride[1]] = grad_x
    return full


class PrunedConv1x1Fn(torch.autograd.Function):
    """1x1 convolution (groups 1, no padding, any stride) as a matrix product over the pixels
    it reads: A = x[:, :, ::s, ::s] as [N*Ho*Wo, C_in]."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: bsr.PruneSpec, stride: tuple[int, int]):
        return _conv_saved(ctx, x, weight, bias, spec, stride, F.conv2d(x, weight, bias, stride))

    @staticmethod
    def backward(ctx, grad_out):
        weight, *saved = ctx.saved_tensors
        n, _, ho, wo = grad_out.shape
        g2d = _rows(grad_out)  # [N*Ho*Wo, out]
        grad_x = None
        if ctx.needs_input_grad[0]:  # exact: G @ W, back to [N, C, Ho, Wo] (channels_last strides)
            grad_x = g2d.mm(weight.flatten(1).to(g2d.dtype)).view(n, ho, wo, -1)
            grad_x = _unstrided(ctx, grad_x.permute(0, 3, 1, 2))
        grad_b = g2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_w = _grad_weight(ctx, g2d, tuple(saved))
        if grad_w is not None:
            grad_w = grad_w.reshape(weight.shape)
        return grad_x, grad_w, grad_b, None, None


def _grad_weight_per_sample(ctx, g2d: torch.Tensor, saved: tuple[torch.Tensor, ...], n: int,
                           out: int) -> torch.Tensor | None:
    """[n * out, in]: each sample's G_b^T @ A_b (A pruned), for a layer whose weight is each
    sample's own (CondConv2d). A's rows are sample-major, `p` of them a sample; each sample's
    product takes the kept blocks of the block rows its rows touch (a block across a boundary
    serves both samples, each with its own rows of G), so the products touch each block once
    (a straddling one twice); picking a sample's blocks scans the block indices once per
    sample."""
    if not ctx.needs_input_grad[1]:
        return None
    k, p = ctx.shape[1] if ctx.sparse else saved[0].shape[1], g2d.shape[0] // n
    if not ctx.sparse:
        a = ctx.to_matrix(saved[0]).to(g2d.dtype).view(n, p, -1)
        return torch.bmm(g2d.view(n, p, out).transpose(1, 2), a).reshape(n * out, -1)
    values, rows, col_ptr = saved
    b = values.shape[-1]
    if is_fake(values) or is_fake(g2d):  # the estimate: a shared weight's transient
        bsr.grad_weight(g2d, bsr.BlockSparse(values, rows, col_ptr, ctx.shape), ctx.spec.backend)
        return g2d.new_zeros(n * out, k)
    nbc = col_ptr.numel() - 1
    cols = torch.repeat_interleave(torch.arange(nbc, device=rows.device),
                                   (col_ptr[1:] - col_ptr[:-1]).long())
    grads = []
    for i in range(n):
        r0, r1 = i * p // b, -(-(i + 1) * p // b)  # the block rows sample i's rows touch
        sel = (rows >= r0) & (rows < r1)
        sub_cols = cols[sel]
        sub = bsr.BlockSparse(values[sel], (rows[sel] - r0).int(), torch.searchsorted(
            sub_cols, torch.arange(nbc + 1, device=rows.device, dtype=sub_cols.dtype)).int(),
            (min(r1 * b, ctx.shape[0]) - r0 * b, k))
        g = g2d.new_zeros(sub.shape[0], out)  # G's rows of sample i, zero for the neighbours'
        g[i * p - r0 * b:(i + 1) * p - r0 * b] = g2d[i * p:(i + 1) * p]
        grads.append(bsr.grad_weight(g, sub, ctx.spec.backend))
    return torch.cat(grads)


class PrunedCondConv1x1Fn(torch.autograd.Function):
    """A 1x1 convolution whose kernel is each sample's own (timm's CondConv2d: weight
    [n * out, in], the n samples' mixed kernels stacked), run as CondConv2d runs it (one
    convolution with groups n, so the output is its own bit for bit), saving that weight and
    x's pixels as A [n*Ho*Wo, in], block-pruned; grad_weight per sample."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: bsr.PruneSpec, stride: tuple[int, int]):
        n, c, h, w = x.shape
        y = F.conv2d(x.reshape(1, n * c, h, w), weight[..., None, None], bias, stride,
                     groups=n)
        y = y.permute(1, 0, 2, 3).view(n, -1, y.shape[-2], y.shape[-1])
        return _conv_saved(ctx, x, weight, bias, spec, stride, y)

    @staticmethod
    def backward(ctx, grad_out):
        weight, *saved = ctx.saved_tensors
        n, out, ho, wo = grad_out.shape
        g = grad_out.reshape(n, out, ho * wo)
        grad_x = None
        if ctx.needs_input_grad[0]:  # exact: each sample's W_b^T G_b
            w = weight.view(n, out, -1).to(g.dtype)
            grad_x = _unstrided(ctx, torch.bmm(w.transpose(1, 2), g).view(n, -1, ho, wo))
        grad_b = g.sum(2).reshape(-1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_w = _grad_weight_per_sample(ctx, _rows(grad_out), tuple(saved), n, out)
        return grad_x, grad_w, grad_b, None, None


# ---------------------------------------------------------------- modules


def _apply(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           spec: bsr.PruneSpec, *extra) -> torch.Tensor:
    """Run `fn` the way autocast would run the layer: inputs cast to the autocast dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(dev, enabled=False):
            return fn.apply(x, weight, bias, spec, *extra)
    return fn.apply(x, weight, bias, spec, *extra)


def _active(mod: nn.Module) -> bool:
    """Prune only when a gradient will be taken and there is something to prune."""
    return mod.prune_spec.sparsity > 0 and torch.is_grad_enabled() and mod.weight.requires_grad


def _storage(t: torch.Tensor) -> int:
    """The storage a tensor (or a view) lives in: who else saves it is counted per storage."""
    return t.untyped_storage()._cdata


def _dense_bytes(x: torch.Tensor, copies: bool) -> int:
    """What a layer call saves dense: x's storage, or under autocast its cast copy."""
    if copies:
        return x.numel() * torch.get_autocast_dtype(x.device.type).itemsize
    return x.untyped_storage().nbytes()


class _LayerCall(NamedTuple):
    """A prunable layer's call as the plan's probe saw it."""

    key: int  # the storage of its input
    copies: bool  # autocast: the layer saves a cast copy of its own, not the input
    alone: bool  # its blocks would take less than the input (and it may be pruned)
    pos: int  # its own save's index in the probe's tape (every tensor saved, in order)
    dense: int  # bytes of what it would save dense (the input's storage, or the cast copy)
    blocks: int  # bytes of its kept blocks and their indices


class _ReLUCall(NamedTuple):
    """A ReLU's call as the probe saw it: its output's storage and the tape entries of its mask."""

    key: int
    start: int
    end: int
    out: int  # bytes of its output's storage (what nn.ReLU would save)


class _Planned:
    """A module whose calls, numbered from the start of the model's forward, follow prune's plan
    (`PruneMethod.prepare`): `plan[i]` says what call i does. No plan (a model wrapped but never
    prepared) keeps the rules applied at run time alone. `log`, set while the plan is probed,
    collects what each call sees; `tape`, shared by every module while probing, is every tensor
    saved for backward, in order: (storage, bytes)."""

    plan: tuple[bool, ...] | None = None
    calls: int = 0
    log: list | None = None
    tape: list | None = None

    def _planned(self) -> bool | None:
        i, self.calls = self.calls, self.calls + 1
        if self.plan is None:
            return None
        return i < len(self.plan) and self.plan[i]


class _PrunedLayer(_Planned):
    """What PrunedLinear and PrunedConv1x1 share: the plan, then the function."""

    prune_spec: bsr.PruneSpec
    conv = False  # x is [N, C, H, W] with C the input features (else the last dimension)

    def _in_features(self) -> int:
        return self.weight.shape[1]

    def _run(self, x: torch.Tensor, fn, *extra, params=None) -> torch.Tensor | None:
        """fn on x with the layer's weight and bias (or `params()`'s, made only for a call that
        runs fn), pruned as planned; None where the layer's own forward should run."""
        planned = self._planned()
        if not _active(self):
            return None
        spec = self.prune_spec
        if self.log is not None:  # probing: save x as it is, note its storage and its size rule
            dev = x.device.type  # autocast: the layer saves a cast copy of its own
            copies = torch.is_autocast_enabled(dev) and x.dtype != torch.get_autocast_dtype(dev)
            blocks = self._blocks_bytes(x, copies)
            self.log.append(_LayerCall(_storage(x), copies, blocks > 0, len(self.tape),
                                       _dense_bytes(x, copies), blocks))
            spec = replace(spec, keep_dense=True)
        elif planned is False and not spec.prune_shared:
            return None  # someone else keeps x for backward: blocks would add memory
        weight, bias = (self.weight, self.bias) if params is None else params()
        return _apply(fn, x, weight, bias, spec, *extra)

    def _blocks_bytes(self, x: torch.Tensor, copies: bool) -> int:
        """The bytes of this call's kept blocks and their int32 indices, or 0 when they would
        take no less than the input or it may not be pruned (the batch, but with
        compress_input)."""
        k = self._in_features()
        m = x.numel() // x.shape[1 if x.dim() == 4 and self.conv else -1]
        if self.conv and self.stride != (1, 1):
            m = x.shape[0] * len(range(0, x.shape[2], self.stride[0])) * len(
                range(0, x.shape[3], self.stride[1]))
        spec, elements = self.prune_spec, bsr.compressed_elements(m, k, self.prune_spec)
        if elements >= m * k or not (spec.compress_input or x.requires_grad):
            return 0
        dtype = torch.get_autocast_dtype(x.device.type) if copies else x.dtype
        nnz = elements // spec.block_size ** 2
        return (elements * dtype.itemsize + 4 * nnz
                + 4 * (-(-k // spec.block_size) + 1))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, prune={self.prune_spec}"


class PrunedLinear(_PrunedLayer, nn.Linear):
    """nn.Linear whose saved input is block-pruned (the class of a swapped module, in place:
    parameters, state_dict keys and hooks stay those of the original)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._run(x, PrunedLinearFn)
        return super().forward(x) if out is None else out


class PrunedConv1x1(_PrunedLayer, nn.Conv2d):
    """A 1x1 nn.Conv2d (groups 1, no padding) whose saved input is block-pruned (swapped in
    place, as PrunedLinear)."""

    conv = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._run(x, PrunedConv1x1Fn, tuple(self.stride))
        return super().forward(x) if out is None else out


class PrunedCondConv1x1(_PrunedLayer, nn.Module):
    """timm's 1x1 CondConv2d (groups 1, no padding) whose saved input is block-pruned (recast
    in place: its experts, state_dict keys and settings). Each sample's kernel is mixed from
    the experts by its routing weights, as the module does, in autograd; PrunedCondConv1x1Fn
    takes the mixed kernels. Calls that prune nothing run the module's own forward."""

    conv = True
    plain_forward: Callable  # CondConv2d.forward (a function, called with self)

    def _in_features(self) -> int:
        return self.in_channels

    def forward(self, x: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        def mixed() -> tuple[torch.Tensor, torch.Tensor | None]:
            """The samples' mixed kernels as [n * out, in] (1x1, no groups), and biases."""
            weight, bias = cond_conv_kernels(self, routing_weights)
            return weight.flatten(1), bias

        out = self._run(x, PrunedCondConv1x1Fn, tuple(self.stride), params=mixed)
        if out is not None:
            return out
        return self.plain_forward(self, x, routing_weights)


class _PruneMask(_Planned):
    """An nn.ReLU or nn.ReLU6 whose planned calls keep a 1-bit (or bool) mask instead of their
    output (common/compact.py's MaskedReLUFn, exact): a call is planned so when only pruned
    layers save its output, which the blocks then replace (`method.relu_mask`). Other calls are
    torch's own (their output is kept for another op's backward anyway, so a mask would add)."""

    relu_mask: str = "bits"
    top: float | None = None  # ReLU6's upper bound, where the gradient stops too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        planned = self._planned() or self.log is not None
        if planned and self.training and torch.is_grad_enabled() and x.requires_grad:
            start = len(self.tape) if self.log is not None else 0
            out = MaskedReLUFn.apply(x, self.inplace, self.relu_mask, self.top)
            if self.log is not None:
                self.log.append(_ReLUCall(_storage(out), start, len(self.tape),
                                          out.untyped_storage().nbytes()))
            return out
        return super().forward(x)


class PruneReLU(_PruneMask, nn.ReLU):
    """nn.ReLU masked where planned (the class of a swapped module, in place)."""


class PruneReLU6(_PruneMask, nn.ReLU6):
    """nn.ReLU6 (MobileNetV2's) masked where planned: the mask marks 0 < x < 6."""

    @property
    def top(self) -> float:
        return self.max_val


_MASKED = {nn.ReLU: PruneReLU, nn.ReLU6: PruneReLU6}


def is_conv1x1(mod: nn.Module) -> bool:
    """A 1x1 convolution without padding or groups (any stride: ResNet's downsampling convs),
    what PrunedConv1x1Fn computes as a matrix product."""
    return (type(mod) is nn.Conv2d and mod.kernel_size == (1, 1)
            and mod.padding in ((0, 0), "valid") and mod.groups == 1)


def is_cond_conv1x1(mod: nn.Module) -> bool:
    """timm's CondConv2d as a 1x1 convolution without padding or groups (any stride; "SAME"
    padding pads nothing at 1x1): each sample's own kernel, PrunedCondConv1x1Fn's product."""
    return (is_timm_cond_conv2d(mod) and tuple(mod.kernel_size) == (1, 1)
            and tuple(mod.padding) == (0, 0) and mod.groups == 1)


# ---------------------------------------------------------------- the method


class PruneMethod:
    """Block-sparse activation pruning of Linear / 1x1-conv inputs for grad_weight.

    Args:
        sparsity: s in [0, 1): the fraction of b x b blocks dropped (0 = the baseline, bitwise).
        block_size: b, 16, 32 or 64.
        criterion: block score, l2 or l1 norm.
        layers: linear, conv1x1 or both.
        backend: auto (Triton on CUDA, torch elsewhere), triton or torch.
        prune_head: also prune the classifier's input (the last nn.Linear of the model); off by
            default: its input is a small pooled feature matrix, and its gradient feeds all else.
        prune_shared: also prune inputs that their producer keeps for its own backward (ReLU
            outputs); off by default since the blocks then add memory; on for accuracy studies.
        compress_input: also prune a layer's input that is the batch (needs no gradient: data
            from outside the graph, alive for the whole step); off by default, as prune_shared.
        relu_mask: bits (1 bit per element, packed), bool, or none: how an nn.ReLU (or ReLU6)
            call whose output only pruned layers save keeps what its backward needs. A ReLU
            keeps its output for backward, so without a mask the layers after ReLUs (mlp6's
            hidden layers, a bottleneck's 1x1 convs) could free nothing: their inputs stay
            dense (none).

    `prepare` (before the first step, on the run's first batch) probes one forward and plans
    every call: a layer prunes its input only when no other op saves that storage for backward,
    and a ReLU call keeps a mask only when its output is such an input. A model in which the plan
    prunes nothing (resnet18: its 1x1 convs read the inputs its 3x3 convs keep) is a one-line
    ConfigError: the run would be `none` under another name.
    """

    name = "prune"
    grads_exact = False  # grad_weight from the kept blocks of the input

    def __init__(self, sparsity: float = 0.5, block_size: int = 32, criterion: str = "l2",
                 layers: str = "both", backend: str = "auto", prune_head: bool = False,
                 prune_shared: bool = False, compress_input: bool = False,
                 relu_mask: str = "bits"):
        check_range("method.sparsity", sparsity, 0, 1, hi_open=True)
        check_choice("method.block_size", block_size, BLOCK_SIZES)
        check_choice("method.criterion", criterion, bsr.CRITERIA)
        check_choice("method.layers", layers, LAYERS)
        check_choice("method.backend", backend, bsr.BACKENDS)
        check_choice("method.prune_head", prune_head, (True, False))
        check_choice("method.prune_shared", prune_shared, (True, False))
        check_choice("method.compress_input", compress_input, (True, False))
        check_choice("method.relu_mask", relu_mask, RELU_MASKS)
        if backend == "triton" and not bsr.triton_available():
            raise ConfigError("method.backend=triton but triton is not installed; use "
                              "method.backend=auto or torch")
        self.spec = bsr.PruneSpec(float(sparsity), int(block_size), criterion, backend,
                                   prune_shared, compress_input)
        self.layers, self.prune_head, self.relu_mask = layers, prune_head, relu_mask
        self.pruned: list[str] = []
        self.planned: list[_Planned] = []

    def _match(self, head: str | None):
        def match(name: str, mod: nn.Module) -> bool:
            if name == head:
                return False
            if self.layers in ("linear", "both") and is_linear(mod):
                return True
            return self.layers in ("conv1x1", "both") and (is_conv1x1(mod)
                                                         or is_cond_conv1x1(mod))
        return match

    def _make(self, name: str, mod: nn.Module) -> nn.Module:
        if is_cond_conv1x1(mod):
            mod.plain_forward, mod.__class__ = type(mod).forward, PrunedCondConv1x1
        else:
            mod.__class__ = PrunedLinear if isinstance(mod, nn.Linear) else PrunedConv1x1
        mod.prune_spec = self.spec
        return mod

    def wrap(self, model: nn.Module) -> nn.Module:
        # transformers' Conv1D (GPT-2) is a linear layer with its weight stored transposed
        swap_modules(model, lambda _, m: is_hf_conv1d(m), lambda _, m: linear_of_conv1d(m))
        linears = [n for n, m in model.named_modules() if is_linear(m)]
        head = None if self.prune_head or not linears else linears[-1]
        self.pruned = swap_modules(model, self._match(head), self._make)
        if not self.pruned:
            raise ConfigError(f"method=prune found no layer to prune for method.layers="
                              f"{self.layers} in {type(model).__name__} (choices: linear, "
                              f"conv1x1, both; the classifier is pruned only with "
                              f"method.prune_head=true)")
        if self.relu_mask != "none":
            for mod in model.modules():
                if type(mod) in _MASKED:
                    mod.__class__, mod.relu_mask = _MASKED[type(mod)], self.relu_mask
        self.planned = [m for m in model.modules() if isinstance(m, _Planned)]
        model.register_forward_pre_hook(self._restart)
        return model

    def _restart(self, *_) -> None:
        """A forward of the whole model starts: number its calls from 0 again."""
        for mod in self.planned:
            mod.calls = 0

    def check_stack(self, names: list[str]) -> None:
        """In a stack (methods/stack.py): no recomputation around the planned calls."""
        if "checkpoint" in names:
            raise ConfigError("prune plans its calls in the order of one forward pass, and "
                              "checkpoint's recomputation calls them again out of that order "
                              "(the recomputed step would save other tensors); stack prune "
                              "with quantize or pool instead")

    def prepare(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast=None,
                carry=None, context: MethodContext = NO_CONTEXT) -> dict[str, int]:
        """Plan every call on the run's first batch (see the class); returns its columns."""
        return self.plan(model, x, autocast)

    def probe_steps(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, autocast,
                    num_classes: int, context: MethodContext = NO_CONTEXT) -> list[ProbeStep]:
        """The estimate measures the step the run measures: the planned one."""
        self.plan(model, x, autocast)
        return [ProbeStep(model, x, y)]

    def plan(self, model: nn.Module, x: torch.Tensor, autocast=None) -> dict[str, int]:
        """One forward on `x`, every tensor saved for backward counted per storage (each pruned
        layer saving its input as it is, each ReLU a mask), the model's buffers and the RNG
        restored afterwards; then per call: prune where the pruned layers are the only ones to
        save that storage (and each would take fewer bytes as blocks), mask the ReLU calls that
        produce such a storage."""
        if self.spec.sparsity == 0:  # the baseline's own ops, by definition (bitwise, tested)
            return {}
        tape: list[tuple[int, int]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            tape.append((_storage(t), t.untyped_storage().nbytes()))
            return t

        buffers = [(b, b.clone()) for b in model.buffers()]
        for mod in self.planned:
            mod.plan, mod.log, mod.tape = None, [], tape
        try:
            devices = [x.device] if x.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    (autocast() if autocast is not None else nullcontext()):
                out = model(x)
                del out
            logs = {mod: mod.log for mod in self.planned}
        finally:
            for mod in self.planned:
                mod.log = mod.tape = None
            with torch.no_grad():
                for b, old in buffers:
                    b.copy_(old)
        saves = Counter(key for key, _ in tape)
        users: dict[int, list[bool]] = {}  # per storage: the calls that save it as it is
        for mod, log in logs.items():
            if isinstance(mod, _PrunedLayer):
                for call in log:
                    users.setdefault(call.key, [])
                    if not call.copies:
                        users[call.key].append(call.alone)
        free = {key for key, alone in users.items() if saves[key] == len(alone) and all(alone)}
        calls = [c for m, log in logs.items() if isinstance(m, _PrunedLayer) for c in log]
        relus = [c for m, log in logs.items() if isinstance(m, _PruneMask) for c in log]
        outside = {_storage(t) for t in (x, *model.parameters(), *model.buffers())}
        kept = _below_the_peak(calls, relus, tape, free, outside)
        for mod, log in logs.items():
            if isinstance(mod, _PrunedLayer):  # a cast copy is the layer's own: free if small
                mod.plan = tuple(c in kept if c.copies else c.key in kept for c in log)
            else:
                mod.plan = tuple(c.key in kept for c in log)
        layers = sum(sum(m.plan) for m in self.planned if isinstance(m, _PrunedLayer))
        masked = sum(sum(m.plan) for m in self.planned if isinstance(m, _PruneMask))
        if not layers and not self.spec.prune_shared:
            peaked = len(free) + sum(c.copies and c.alone for c in calls)
            if peaked:  # there were inputs to free, but each would raise the peak
                raise ConfigError(
                    f"method=prune prunes nothing in {type(model).__name__}: the {peaked} "
                    f"input(s) it could free are alive at the activation peak (until the "
                    f"forward's end, as a classifier's input), where their blocks would be "
                    f"made beside them and raise it; the other prunable layers' inputs are "
                    f"kept by another op for backward, are the batch or would take no less as "
                    f"blocks, so the run would be "
                    f"method=none")
            raise ConfigError(
                f"method=prune prunes nothing in {type(model).__name__}: none of its "
                f"{len(self.pruned)} prunable layers' inputs could be freed (another op keeps "
                f"it for backward, it is the batch, or its {self.spec.block_size}x"
                f"{self.spec.block_size} blocks would take no less; method.relu_mask="
                f"{self.relu_mask}), so the run would be method=none; where blocks are the "
                f"reason, try a smaller method.block_size (16, 32, 64) or a larger batch")
        return {"prune_layer_calls": layers, "prune_relu_masked": masked}


def _below_the_peak(calls: list[_LayerCall], relus: list[_ReLUCall], tape: list[tuple[int, int]],
                    free: set[int], outside: set[int]) -> set:
    """Of the storages only pruned layers save (`free`), and the calls that prune a cast copy of
    their own, those whose pruning keeps the activation peak below none's.

    A pruned input's blocks are made while the input is alive, so at that call the memory is
    none's there, minus what the calls pruned earlier saved (`freed`), plus the blocks and the
    mask of the ReLU that made the input. none's activation peak is at the forward's end (every
    saved tensor; the probe's tape without ReLU masks, ReLU outputs in their place): what none
    saves after the call is its distance to that peak. A call whose blocks and mask exceed
    `freed` plus that distance would raise the peak: resnet18's classifier input with
    prune_head, alive at the end of the forward with nothing saved after it, pruned nothing
    while its blocks raised the activation peak by their size. Calls in forward order; a storage
    several layers read counts from its first call to its last. `outside`: the storages that
    are no activation (parameters, buffers, the batch)."""
    masks = {i for r in relus for i in range(r.start, r.end)}
    first: dict[int, tuple[int, int]] = {}  # storage -> (first save in none's order, bytes)
    for i, (key, nbytes) in enumerate(tape):
        if i not in masks and key not in outside:
            first.setdefault(key, (i, nbytes))
    for r in relus:  # none's ReLU saves its output where the masked one saved its mask
        if r.key not in first or first[r.key][0] > r.start:
            first[r.key] = (r.start, r.out)

    def after(pos: int, own: set) -> int:
        return sum(nbytes for key, (i, nbytes) in first.items() if i > pos and key not in own)

    mask_of = {}
    for r in relus:
        mask_of[r.key] = mask_of.get(r.key, 0) + sum(tape[i][1] for i in range(r.start, r.end))
    groups = []  # (first pos, last pos, dense, blocks + mask, what it keeps)
    by_key: dict[int, list[_LayerCall]] = {}
    for c in calls:
        if c.copies and c.alone:
            groups.append((c.pos, c.pos, c.dense, c.blocks, {c}))
        elif not c.copies and c.key in free:
            by_key.setdefault(c.key, []).append(c)
    for key, cs in by_key.items():
        groups.append((min(c.pos for c in cs), max(c.pos for c in cs), cs[0].dense,
                       sum(c.blocks for c in cs) + mask_of.get(key, 0), {key}))
    kept: set = set()
    done: list[tuple[int, int]] = []  # (last pos, bytes freed) of the groups kept so far
    for start, last, dense, cost, keys in sorted(groups, key=lambda g: g[:2]):
        freed = sum(f for end, f in done if end < start)
        # a storage several pruned layers read (a Llama layer's q, k and v projections) makes
        # blocks for each: kept only when they all take less than the storage they free
        if cost < dense and cost < freed + after(last, keys):
            kept |= keys
            done.append((last, dense - cost))
    return kept

