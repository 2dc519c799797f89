"""Memory-saving methods. A method is any object that satisfies `Method`; one module plus one
conf/method/*.yaml adds a method, nothing else is edited."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class Method(Protocol):
    name: str

    def wrap(self, model: nn.Module) -> nn.Module:
        """Module surgery, hooks or segmentation; returns the model to train."""
        ...
