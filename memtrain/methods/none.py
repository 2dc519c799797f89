"""The baseline: plain training, every activation kept as PyTorch keeps it."""

from __future__ import annotations

from torch import nn


class NoneMethod:
    name = "none"
    grads_exact = True

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def params(self) -> dict:
        return {}
