"""The training loss of every task: cross-entropy over the last dimension at every position.

A classifier's logits [B, classes] against labels [B]; a language model's [B, T, vocab] against
next tokens [B, T] (the mean over every token, nanoGPT's loss). One function, so the loop, the
estimate, the probes and the methods' planners all train on the same loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy on `out` flattened to [N, classes] and `y` to [N] (views: no copy)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction=reduction)
