"""Memory-saving methods. A method is any object that satisfies `Method`; one module plus one
conf/method/*.yaml adds a method, nothing else is edited."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import nn


@dataclass
class FitResult:
    """What a method's own `fit` hands back to the recorder: summary columns and metric rows."""

    summary: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)


@runtime_checkable
class Method(Protocol):
    name: str

    def wrap(self, model: nn.Module) -> nn.Module:
        """Module surgery, hooks or segmentation; returns the model to train."""
        ...


def params_of(method: Any) -> dict[str, Any]:
    """The method's parameters as summary columns (`method.<key>`), from its `params()`."""
    params = method.params() if hasattr(method, "params") else {}
    return {f"method.{k}": v for k, v in params.items()}
