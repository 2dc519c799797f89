"""The 6-layer fully connected network of the synthetic-intermediate-labels paper."""

from __future__ import annotations

import math

import torch
from torch import nn

from memtrain.errors import ConfigError, check_range
from memtrain.models.chain import Chain, Segment, chain_rule


class MLP(nn.Sequential):
    """Flatten, then Linear-ReLU blocks, then a Linear classifier (`mlp_chain`: the blocks are
    its segments, so methods can cut or checkpoint it at layer boundaries)."""

    def __init__(self, in_features: int, widths: list[int], num_classes: int, dropout: float = 0.0):
        layers: list[nn.Module] = [nn.Flatten()]
        prev = in_features
        for width in widths:
            block = [nn.Linear(prev, width), nn.ReLU(inplace=True)]
            if dropout > 0:
                block.append(nn.Dropout(dropout))
            layers.append(nn.Sequential(*block))
            prev = width
        layers.append(nn.Linear(prev, num_classes))
        super().__init__(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C, H, W] -> [B, classes]
        return super().forward(x)


def mlp6(num_classes: int, input_shape: tuple[int, int, int],
         widths: list[int] | tuple[int, ...] = (1024, 1024, 512, 512, 256),
         dropout: float = 0.0) -> MLP:
    """Six linear layers: five hidden widths plus the classifier."""
    widths = [int(w) for w in widths]
    if len(widths) != 5 or min(widths) < 1:
        raise ConfigError(f"model.widths must list 5 positive hidden widths (6 linear layers), "
                          f"got {widths}")
    check_range("model.dropout", dropout, 0, 1, hi_open=True)
    return MLP(math.prod(input_shape), widths, num_classes, dropout)


@chain_rule("memtrain.models.mlp.MLP")
def mlp_chain(model: nn.Module) -> Chain:
    """Each Linear-ReLU block is a segment; entry: Flatten; head: the classifier."""
    kids = list(model.named_children())
    segs = [Segment(k, model, (k,)) for k, m in kids if isinstance(m, nn.Sequential)]
    return Chain(segs, entry=kids[0][1], head=kids[-1][1])
