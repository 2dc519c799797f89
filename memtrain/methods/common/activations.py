"""Which saved tensors are activations (what quantize and offload act on), and a tensor's memory
order."""

from __future__ import annotations

import torch
from torch import nn

# autograd nodes that only cast or reshape their one input: a chain of them down to a parameter
# is a weight copy (autocast's, linear's weight.t()), not an activation
_PASS_THROUGH = ("ToCopyBackward", "TBackward", "ViewBackward", "TransposeBackward",
                 "PermuteBackward", "UnsafeViewBackward", "ExpandBackward", "ReshapeAlias",
                 "UnsqueezeBackward", "SqueezeBackward", "CloneBackward")


def memory_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation that makes x contiguous (its memory order), or None when x's memory has
    gaps or overlaps (an expanded view), which reading it flat cannot reproduce."""
    perm = tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.shape[d])))
    return perm if x.permute(perm).is_contiguous() else None


def without_overlap(x: torch.Tensor) -> bool:
    """x's elements sit at distinct addresses (a view with gaps, as a split of a fused qkv
    projection, qualifies; an expanded view does not): each stride, in increasing order, steps
    over the whole extent of the dims below it (sufficient, not necessary)."""
    reach = 1
    for stride, size in sorted((x.stride(d), x.shape[d]) for d in range(x.dim()) if x.shape[d] > 1):
        if stride < reach:
            return False
        reach = stride * size
    return True


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
