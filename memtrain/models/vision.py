"""Image classifiers by name: any timm architecture (`model=timm model.name=convnext_atto`) or
torchvision classification model (`model=torchvision model.name=mobilenet_v3_small`), built
offline with random weights (memtrain/config/offline.py).

The data sets what the run fixes: the classes (`num_classes`), the channels (timm's `in_chans`;
torchvision's first convolution is rebuilt for them) and, where the architecture takes an input
size (timm's `img_size`, torchvision's `image_size`: ViTs, Swin, MLP-Mixers), the image size.
Every other keyword argument of the library's builder comes from `model.kwargs` (free-form:
`+model.kwargs.drop_path_rate=0.1`). An architecture that cannot take the data's image size is
refused in one line naming the size it was made for: a forward of one sample on the meta device
(shapes only, no arithmetic) finds out when the model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import memtrain.models.fake as fake
from memtrain.config import offline
from memtrain.errors import ConfigError
from memtrain.models.chain import remember_input

TIMM_RESERVED = {"num_classes": "dataset.num_classes", "in_chans": "dataset.channels",
                 "img_size": "dataset.image_size"}
TV_RESERVED = {"num_classes": "dataset.num_classes", "image_size": "dataset.image_size"}
AUX_LOGITS = ("googlenet", "inception_v3")  # torchvision's models with auxiliary classifiers


def timm_model(num_classes: int, input_shape: tuple[int, int, int], name: str = "convnext_atto",
               kwargs: dict[str, Any] | None = None) -> nn.Module:
    """timm's `create_model(name, pretrained=False, num_classes, in_chans[, img_size], **kwargs)`
    (timm.list_models() lists the names)."""
    kwargs = offline.check_kwargs("model.kwargs", kwargs, TIMM_RESERVED)  # before any import
    name = timm_name(name)
    c, h, w = _image(input_shape, "timm")
    import timm

    fixed = dict(pretrained=False, num_classes=num_classes, in_chans=c)

    def create(**sized) -> nn.Module:
        return timm.create_model(name, **fixed, **sized, **kwargs)

    model = _build(name, create, {"img_size": h if h == w else (h, w)}, kwargs)
    _check_size(model, name, input_shape, _timm_own_size(model))
    return remember_input(model, input_shape)


def torchvision_model(num_classes: int, input_shape: tuple[int, int, int],
                      name: str = "mobilenet_v3_small",
                      kwargs: dict[str, Any] | None = None) -> nn.Module:
    """torchvision's `get_model(name, weights=None, num_classes[, image_size], **kwargs)` for a
    classification model (torchvision.models.list_models(module=torchvision.models)); the first
    convolution takes the data's channels."""
    kwargs = offline.check_kwargs("model.kwargs", kwargs, TV_RESERVED)  # before any import
    name = torchvision_name(name)
    c, h, w = _image(input_shape, "torchvision")
    from torchvision import models

    if name in AUX_LOGITS:  # the loop trains the main logits: no auxiliary heads' tuple
        kwargs.setdefault("aux_logits", False)

    def create(**sized) -> nn.Module:
        return models.get_model(name, weights=None, num_classes=num_classes, **sized, **kwargs)

    model = _build(name, create, {"image_size": h}, kwargs)  # square: torchvision's ViTs
    if c != 3:
        _first_conv_for(model, c, name)
    _check_size(model, name, input_shape, (224, 224))
    return remember_input(model, input_shape)


def _timm_precheck(node: dict[str, Any]) -> None:
    """The checks of `timm_model` that need no data (offline.precheck)."""
    offline.check_kwargs("model.kwargs", node.get("kwargs"), TIMM_RESERVED)
    timm_name(node.get("name"))


def _torchvision_precheck(node: dict[str, Any]) -> None:
    """The checks of `torchvision_model` that need no data (offline.precheck)."""
    offline.check_kwargs("model.kwargs", node.get("kwargs"), TV_RESERVED)
    torchvision_name(node.get("name"))


timm_model.precheck = _timm_precheck
torchvision_model.precheck = _torchvision_precheck


def _image(input_shape: tuple[int, ...], family: str) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError(f"model={family} classifies images and the dataset holds token "
                          f"sequences (one sample: {input_shape}); use model=hf for a language "
                          f"model, or an image dataset")
    return input_shape


def timm_name(name: Any) -> str:
    """`name` if it is one of timm's architectures, else the one-line refusal with the closest."""
    name = offline.check_name("model.name", name, "timm")
    offline.offline()
    import timm

    if "." in name:
        raise ConfigError(f"model.name={name}: name the architecture ({name.split('.')[0]}); a "
                          f"tag only chooses pretrained weights, which memtrain never loads")
    known = timm.list_models()
    if name not in known:
        raise offline.unknown("model.name", name, known, "timm", "timm.list_models() lists them")
    return name


def torchvision_name(name: Any) -> str:
    """`name` if it is one of torchvision's classification models, else the refusal."""
    name = offline.check_name("model.name", name, "torchvision")
    offline.offline()
    from torchvision import models

    known = models.list_models(module=models)
    if name not in known:
        raise offline.unknown("model.name", name, known, "torchvision's classification models",
                              "torchvision.models.list_models(module=torchvision.models)")
    return name


def _build(name: str, create: Callable[..., nn.Module], sized: dict[str, Any],
           kwargs: dict[str, Any]) -> nn.Module:
    """`create(**sized)` where the architecture takes an input size, else `create()`; the
    library's own argument errors as one line."""
    def make() -> nn.Module:
        try:
            return create(**sized)
        except TypeError as e:
            key = next(iter(sized))
            if f"'{key}'" not in str(e):
                raise
            return create()  # a fully convolutional architecture: any size

    try:
        return fake.build(make)
    except TypeError as e:  # an unknown keyword argument: the library's words
        bad = next((k for k in kwargs if f"'{k}'" in str(e)), None)
        where = f"model.kwargs.{bad}" if bad else f"model.name={name}"
        raise ConfigError(f"{where}: {name} does not take it ({str(e).splitlines()[0]})"
                          if bad else f"{where}: {str(e).splitlines()[0]}") from None
    except (AssertionError, ValueError) as e:  # the library's checks of its own arguments
        raise ConfigError(f"model={name}: {str(e).splitlines()[0] or type(e).__name__}") \
            from None


def _timm_own_size(model: nn.Module) -> tuple[int, int] | None:
    size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size")
    return tuple(size[1:]) if size else None


def _check_size(model: nn.Module, name: str, input_shape: tuple[int, int, int],
                own: tuple[int, int] | None) -> None:
    """One sample through the model on the meta device (eval mode: nothing updated); an
    architecture that cannot take `input_shape` is a one-line ConfigError. Skipped on fake
    tensors (the run's own model was checked) and where the meta device cannot follow."""
    if fake.active_mode() is not None:
        return
    from torch.func import functional_call

    meta = {n: t.to("meta") for n, t in [*model.named_parameters(), *model.named_buffers()]}
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            functional_call(model, meta, (torch.empty(1, *input_shape, device="meta"),))
    except (RuntimeError, AssertionError, ValueError, IndexError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "meta" in msg.lower():  # an op the meta device cannot run: the run will tell
            return
        size = "x".join(map(str, input_shape[1:]))
        made = f"; it was made for {own[0]}x{own[1]} (dataset.image_size={own[0]})" \
            if own else ""
        raise ConfigError(f"model.name={name} cannot take {size} images: {msg[:200]}"
                          f"{made}") from None
    finally:
        model.train(training)


def _first_conv_for(model: nn.Module, channels: int, name: str) -> None:
    """The first 3-channel convolution (the stem) rebuilt for `channels` input channels."""
    for parent in model.modules():
        for key, conv in parent.named_children():
            if isinstance(conv, nn.Conv2d) and conv.in_channels == 3:
                setattr(parent, key, nn.Conv2d(
                    channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                    conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode))
                return
    raise ConfigError(f"model.name={name}: found no 3-channel convolution to take "
                      f"{channels}-channel images; use dataset.channels=3")
