"""Convolutional models from torchvision, adapted to the data's channels, size and classes."""

from __future__ import annotations

from torch import nn

from memtrain.errors import ConfigError, check_range
from memtrain.models.chain import Chain, Segment, chain_rule, children

SMALL_INPUT_MAX = 32  # images of 32 px and below get the CIFAR-style stem


def _tvm():
    """torchvision's models, imported when one is built: importing torchvision imports torch's
    compiler stack (seconds), which a run of another model never needs."""
    from torchvision import models

    return models


def _resnet(factory, num_classes: int, input_shape: tuple[int, int, int],
            small_input: bool | None, zero_init_residual: bool) -> nn.Module:
    c, h, w = input_shape
    small = min(h, w) <= SMALL_INPUT_MAX if small_input is None else small_input
    if not small and min(h, w) < 32:
        raise ConfigError(f"model resnet with the ImageNet stem needs images of >= 32 px, got "
                          f"{h}x{w}; use model.small_input=true or a larger dataset.image_size")
    model = factory(num_classes=num_classes, zero_init_residual=zero_init_residual)
    if small:
        # 3x3 stride-1 stem, no max-pool: 32 px images keep 32x32 maps in the first stage.
        model.conv1 = nn.Conv2d(c, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif c != 3:
        model.conv1 = nn.Conv2d(c, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def resnet18(num_classes: int, input_shape: tuple[int, int, int], small_input: bool | None = None,
             zero_init_residual: bool = False) -> nn.Module:
    """ResNet-18 (torchvision); `small_input` None picks the small stem for <= 32 px images."""
    return _resnet(_tvm().resnet18, num_classes, input_shape, small_input, zero_init_residual)


def resnet34(num_classes: int, input_shape: tuple[int, int, int], small_input: bool | None = None,
             zero_init_residual: bool = False) -> nn.Module:
    return _resnet(_tvm().resnet34, num_classes, input_shape, small_input, zero_init_residual)


def resnet50(num_classes: int, input_shape: tuple[int, int, int], small_input: bool | None = None,
             zero_init_residual: bool = False) -> nn.Module:
    return _resnet(_tvm().resnet50, num_classes, input_shape, small_input, zero_init_residual)


def efficientnet_b0(num_classes: int, input_shape: tuple[int, int, int], dropout: float = 0.2,
                    stochastic_depth_prob: float = 0.2) -> nn.Module:
    """EfficientNet-B0 (torchvision); the stem takes the data's channel count, the classifier
    nn.Linear's init (see below)."""
    c, h, w = input_shape
    if min(h, w) < 8:
        raise ConfigError(f"model efficientnet_b0 needs images of >= 8 px, got {h}x{w}")
    check_range("model.dropout", dropout, 0, 1, hi_open=True)
    check_range("model.stochastic_depth_prob", stochastic_depth_prob, 0, 1, hi_open=True)
    model = _tvm().efficientnet_b0(num_classes=num_classes, dropout=dropout,
                                stochastic_depth_prob=stochastic_depth_prob)
    # torchvision draws the classifier from U(+-1/sqrt(num_classes)), a range made for 1000
    # classes: with 10 the first logits are ~10x too large (measured: initial loss ~15 instead
    # of ln 10 and a model that stayed at chance). nn.Linear's own init scales with its 1280
    # inputs instead.
    model.classifier[-1].reset_parameters()
    if c != 3:
        old = model.features[0][0]
        model.features[0][0] = nn.Conv2d(c, old.out_channels, old.kernel_size, old.stride,
                                         old.padding, bias=False)
    return model


# ---------------------------------------------------------------- chains (memtrain.models.chain)


@chain_rule("torchvision.models.resnet.ResNet")
def resnet_chain(model: nn.Module) -> Chain:
    """Stem (conv1, bn1, relu, maxpool), every residual block; head: pooling and fc."""
    segs = [Segment("stem", model, ("conv1", "bn1", "relu", "maxpool"))]
    for stage in ("layer1", "layer2", "layer3", "layer4"):
        segs += children(stage, getattr(model, stage))
    return Chain(segs, head=nn.Sequential(model.avgpool, nn.Flatten(1), model.fc))


@chain_rule("torchvision.models.efficientnet.EfficientNet")
def efficientnet_chain(model: nn.Module) -> Chain:
    """features[0] (stem), every MBConv block of features[1..-2], features[-1] (the 1x1 head
    convolution); head: pooling and classifier."""
    f = model.features
    n = len(f)
    segs = [Segment("features.0", f, ("0",))]
    for i in range(1, n - 1):
        segs += children(f"features.{i}", f[i])
    segs.append(Segment(f"features.{n - 1}", f, (str(n - 1),)))
    return Chain(segs, head=nn.Sequential(model.avgpool, nn.Flatten(1), model.classifier))
