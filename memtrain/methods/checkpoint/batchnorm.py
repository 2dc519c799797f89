"""Training-mode BatchNorm as two ops, so an op-level checkpoint plan can keep the statistics and
recompute only the normalisation.

Native training-mode BatchNorm is one aten op that computes the batch statistics (a reduction
pass over its input) and applies them (an elementwise pass); selective checkpointing keeps or
recomputes an op's outputs whole, so a recomputed BatchNorm reruns both passes although its mean
and 1/std are two per-channel vectors. Split, the statistics come from `batch_norm_update_stats`
(native BatchNorm's statistics kernel, which also updates the running statistics; tiny outputs,
which a plan keeps) and the normalisation is one `addcmul` with the per-channel scale and shift,
in the form CPU BatchNorm applies them (x * w/std + (b - mean * w/std), fused multiply-adds): on
the CPU output, gradients and running statistics are bitwise native BatchNorm's, and
recomputing it is one elementwise pass (MONeT's operator choices do the same). Backward is
`native_batch_norm_backward` on the same saved input, mean and 1/std that native BatchNorm saves:
the same formula, the same saved bytes. The running statistics are updated inside the forward, so
`segments.shield_batchnorm` shields a recompute's update. The split costs its ~10 small
per-channel ops per layer: measured on one CPU core, resnet50 112 px batch 8, forward +3.4% and
a training step +2.2% against native BatchNorm.

Only fp32 inputs are split (the statistics of a bf16/fp16 input need fp32 accumulation, which
native BatchNorm does internally); other dtypes, eval mode and non-affine layers run natively.
"""

from __future__ import annotations

import torch
from torch import nn

from memtrain.methods.checkpoint.segments import batchnorms

_LIBRARIES = []  # a torch.library.Library drops its kernels when it is collected


def _meta_update_stats() -> None:
    """A meta kernel for aten::batch_norm_update_stats where torch has none: without one, fake
    tensors (the estimate, the planner's probes) run the real kernel on zeros of the input's
    size, seconds a call at ImageNet sizes. The op stays the op (a plan of ops sees the same
    sequence); its two [C] outputs take the running statistics' dtype, else the input's, as
    the CPU kernel's do."""
    name = "batch_norm_update_stats"
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
        return

    def meta(x, running_mean, running_var, momentum):
        dtype = x.dtype if running_mean is None else running_mean.dtype
        return x.new_empty(x.shape[1], dtype=dtype), x.new_empty(x.shape[1], dtype=dtype)

    lib = torch.library.Library("aten", "IMPL")
    lib.impl(name, meta, "Meta")
    _LIBRARIES.append(lib)


_meta_update_stats()


class SplitBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum: float, eps: float):
        # native BatchNorm's own statistics kernel and running-statistics update (bitwise the
        # same mean, biased variance and running buffers); 1/std as it computes it, in double
        mean, var = torch.batch_norm_update_stats(x, running_mean, running_var, momentum)
        invstd = var.double().add_(eps).sqrt_().reciprocal_().to(var.dtype)
        scale = invstd * weight
        shape = [1, -1] + [1] * (x.dim() - 2)
        # x * scale + (bias - mean * scale), each a fused multiply-add as CPU BatchNorm applies it
        shift = torch.addcmul(bias, mean, scale, value=-1)
        y = torch.addcmul(shift.view(shape), x, scale.view(shape))
        ctx.eps = eps
        ctx.save_for_backward(x, weight, mean, invstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, invstd = ctx.saved_tensors
        mask = [bool(m) for m in ctx.needs_input_grad[:3]]
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad, x, weight, None, None, mean, invstd, True, ctx.eps, mask)
        return gx, gw, gb, None, None, None, None


def _forward(bn: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    if not (bn.training and bn.affine and x.dtype == torch.float32
            and (bn.track_running_stats or bn.running_mean is None)):
        return type(bn).forward(bn, x)
    bn._check_input_dim(x)
    momentum = 0.0 if bn.momentum is None else bn.momentum
    if bn.track_running_stats and bn.num_batches_tracked is not None:  # as nn.BatchNorm does
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:  # a cumulative average
            momentum = 1.0 / float(bn.num_batches_tracked)
    return SplitBatchNormFn.apply(x, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                  momentum, bn.eps)


def split_batchnorms(modules: list[nn.Module]) -> int:
    """Every BatchNorm under `modules` runs split (an instance forward over its class's);
    returns how many. The state_dict is unchanged."""
    # only BatchNorm's own forward: a subclass's (timm's BatchNormAct2d: BatchNorm, dropout
    # and activation) does more than the split would
    todo = [bn for bn in batchnorms(modules) if "forward" not in vars(bn)
            and type(bn).forward is nn.modules.batchnorm._BatchNorm.forward]
    for bn in todo:
        bn.forward = _forward.__get__(bn)
    return len(todo)
