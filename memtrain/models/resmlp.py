"""ResMLP (Touvron et al. 2021) built from timm's MlpMixer parts, with a configurable patch size.

timm's registered `resmlp_12_224`/`resmlp_24_224` fix patch_size=16, which leaves a 32 px image
with 4 tokens; here the same architecture (ResBlock, Affine norm, embed 384, mlp_ratio 4,
init_values 1e-4 / 1e-5) is assembled with the patch size as an option.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from memtrain.errors import ConfigError, check_range
from memtrain.models.chain import Chain, Segment, chain_rule, children


def _resmlp(name: str, depth: int, init_values: float, num_classes: int,
            input_shape: tuple[int, int, int], patch_size: int | None, embed_dim: int,
            drop_path_rate: float) -> nn.Module:
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock

    check_range("model.embed_dim", embed_dim, 1)
    check_range("model.drop_path_rate", drop_path_rate, 0, 1, hi_open=True)
    c, h, w = input_shape
    if h != w:
        raise ConfigError(f"model {name} needs square images, got {h}x{w}")
    # 16 px patches as in the paper at >= 128 px; 4 px patches give small images 64+ tokens.
    patch = patch_size or (16 if h >= 128 else 4)
    if patch < 1 or h % patch:
        raise ConfigError(f"model.patch_size={patch} must divide the image size {h}; choose a "
                          f"divisor of {h} or set dataset.image_size")
    return MlpMixer(num_classes=num_classes, img_size=h, in_chans=c, patch_size=patch,
                    num_blocks=depth, embed_dim=embed_dim, mlp_ratio=4,
                    block_layer=partial(ResBlock, init_values=init_values), norm_layer=Affine,
                    drop_path_rate=drop_path_rate)


def resmlp12(num_classes: int, input_shape: tuple[int, int, int], patch_size: int | None = None,
             embed_dim: int = 384, drop_path_rate: float = 0.0) -> nn.Module:
    """ResMLP-12 (S12): 12 residual blocks, width 384."""
    return _resmlp("resmlp12", 12, 1e-4, num_classes, input_shape, patch_size, embed_dim,
                   drop_path_rate)


def resmlp24(num_classes: int, input_shape: tuple[int, int, int], patch_size: int | None = None,
             embed_dim: int = 384, drop_path_rate: float = 0.0) -> nn.Module:
    """ResMLP-24 (S24): 24 residual blocks, width 384."""
    return _resmlp("resmlp24", 24, 1e-5, num_classes, input_shape, patch_size, embed_dim,
                   drop_path_rate)


# ---------------------------------------------------------------- chain (memtrain.models.chain)


class MixerHead(nn.Module):
    """timm MlpMixer's norm + forward_head as one module (the chain's head); shares the
    model's modules."""

    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.norm, self.head_drop, self.head = mixer.norm, mixer.head_drop, mixer.head
        self.global_pool = mixer.global_pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, C] -> [B, classes]
        x = self.norm(x)
        if self.global_pool == "avg":
            x = x.mean(dim=1)
        return self.head(self.head_drop(x))


@chain_rule("timm.models.mlp_mixer.MlpMixer")
def mixer_chain(model: nn.Module) -> Chain:
    """timm MlpMixer / ResMLP: the stem (patch embedding), every residual block; head: the
    final norm, token mean and classifier."""
    return Chain([Segment("stem", model, ("stem",)), *children("blocks", model.blocks)],
                 head=MixerHead(model))
