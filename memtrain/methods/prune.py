"""Method `prune`: block-sparse pruning of the activations that nn.Linear and 1x1 convolutions
keep for backward (Barley & Froening, arXiv 2311.16883).

The forward pass and grad_input are exact; only grad_weight = G^T @ A sees the pruned input. The
input A, viewed as a matrix (Linear: [rows, in_features]; 1x1 conv: [N*H*W, C_in]), is tiled into
b x b blocks, and the ceil((1 - s) n) blocks of largest norm (over the whole matrix) are kept
as values [nnz, b, b] plus int32 block indices (memtrain/methods/bsr.py, kernels/prune.py).

Exactness: at sparsity 0 the swapped layers run the baseline's own autograd path (bitwise equal).
Three cases keep the dense input (and so an exact gradient), because blocks would only add memory:
a matrix whose kept blocks (padding included) take at least as much as the matrix itself (tiny
matrices, e.g. squeeze-excitation convs on 1x1 maps), an input whose producer keeps that same
tensor for its own backward anyway (a ReLU's output: ResNet's 1x1 convs, mlp6's hidden layers),
and the network's input: data from outside the autograd graph (the batch or a view of it, told
at run time by needing no gradient), which the loop keeps for the whole step
(`method.compress_input=true` prunes it anyway, for accuracy studies).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.errors import ConfigError, check_choice, check_range
from memtrain.kernels import bsr
from memtrain.methods.common.swap import swap_modules

LAYERS = ("linear", "conv1x1", "both")
BLOCK_SIZES = (16, 32, 64)


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
    if bsr.compressed_elements(m, k, spec) >= m * k or (
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


class PrunedConv1x1Fn(torch.autograd.Function):
    """1x1 convolution (groups 1, no padding, any stride) as a matrix product over the pixels
    it reads: A = x[:, :, ::s, ::s] as [N*Ho*Wo, C_in]."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: bsr.PruneSpec, stride: tuple[int, int]):
        out = F.conv2d(x, weight, bias, stride)
        ctx.has_bias, ctx.x_shape, ctx.stride = bias is not None, x.shape, stride
        _save(ctx, x, weight, spec, partial(_conv_rows, stride=stride),
              out.numel() // out.shape[1])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, *saved = ctx.saved_tensors
        n, _, ho, wo = grad_out.shape
        g2d = _rows(grad_out)  # [N*Ho*Wo, out]
        grad_x = None
        if ctx.needs_input_grad[0]:  # exact: G @ W, back to [N, C, Ho, Wo] (channels_last strides)
            grad_x = g2d.mm(weight.flatten(1).to(g2d.dtype)).view(n, ho, wo, -1)
            grad_x = grad_x.permute(0, 3, 1, 2)
            if ctx.stride != (1, 1):  # the pixels the stride skipped get no gradient
                full = grad_x.new_zeros(ctx.x_shape)
                full[:, :, ::ctx.stride[0], ::ctx.stride[1]] = grad_x
                grad_x = full
        grad_b = g2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_w = _grad_weight(ctx, g2d, tuple(saved))
        if grad_w is not None:
            grad_w = grad_w.view_as(weight)
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


class PrunedLinear(nn.Linear):
    """nn.Linear whose saved input is block-pruned (the class of a swapped module, in place:
    parameters, state_dict keys and hooks stay those of the original)."""

    prune_spec: bsr.PruneSpec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _active(self):
            return super().forward(x)
        return _apply(PrunedLinearFn, x, self.weight, self.bias, self.prune_spec)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, prune={self.prune_spec}"


class PrunedConv1x1(nn.Conv2d):
    """A 1x1 nn.Conv2d (groups 1, no padding) whose saved input is block-pruned (swapped in
    place, as PrunedLinear)."""

    prune_spec: bsr.PruneSpec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _active(self):
            return super().forward(x)
        return _apply(PrunedConv1x1Fn, x, self.weight, self.bias, self.prune_spec,
                      tuple(self.stride))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, prune={self.prune_spec}"


def is_conv1x1(mod: nn.Module) -> bool:
    """A 1x1 convolution without padding or groups (any stride: ResNet's downsampling convs),
    what PrunedConv1x1Fn computes as a matrix product."""
    return (type(mod) is nn.Conv2d and mod.kernel_size == (1, 1)
            and mod.padding in ((0, 0), "valid") and mod.groups == 1)


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
    """

    name = "prune"

    def __init__(self, sparsity: float = 0.5, block_size: int = 32, criterion: str = "l2",
                 layers: str = "both", backend: str = "auto", prune_head: bool = False,
                 prune_shared: bool = False, compress_input: bool = False):
        check_range("method.sparsity", sparsity, 0, 1, hi_open=True)
        check_choice("method.block_size", block_size, BLOCK_SIZES)
        check_choice("method.criterion", criterion, bsr.CRITERIA)
        check_choice("method.layers", layers, LAYERS)
        check_choice("method.backend", backend, bsr.BACKENDS)
        check_choice("method.prune_head", prune_head, (True, False))
        check_choice("method.prune_shared", prune_shared, (True, False))
        check_choice("method.compress_input", compress_input, (True, False))
        if backend == "triton" and not bsr.triton_available():
            raise ConfigError("method.backend=triton but triton is not installed; use "
                              "method.backend=auto or torch")
        self.spec = bsr.PruneSpec(float(sparsity), int(block_size), criterion, backend,
                                   prune_shared, compress_input)
        self.layers, self.prune_head = layers, prune_head
        self.pruned: list[str] = []

    def _match(self, head: str | None):
        def match(name: str, mod: nn.Module) -> bool:
            if name == head:
                return False
            if self.layers in ("linear", "both") and type(mod) is nn.Linear:
                return True
            return self.layers in ("conv1x1", "both") and is_conv1x1(mod)
        return match

    def _make(self, name: str, mod: nn.Module) -> nn.Module:
        mod.__class__ = PrunedLinear if isinstance(mod, nn.Linear) else PrunedConv1x1
        mod.prune_spec = self.spec
        return mod

    def wrap(self, model: nn.Module) -> nn.Module:
        linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
        head = None if self.prune_head or not linears else linears[-1]
        self.pruned = swap_modules(model, self._match(head), self._make)
        if not self.pruned:
            raise ConfigError(f"method=prune found no layer to prune for method.layers="
                              f"{self.layers} in {type(model).__name__} (choices: linear, "
                              f"conv1x1, both; the classifier is pruned only with "
                              f"method.prune_head=true)")
        return model
