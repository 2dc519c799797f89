"""Every model x dataset shape builds, runs forward and backward, and trains every parameter."""

import pytest
import torch
from conftest import TWINS, conf_options, language_model, shallow

from memtrain import api
from memtrain.errors import ConfigError
from memtrain.losses import cross_entropy

# make test-compat runs this file on the oldest torch: torchvision's and timm's models
pytestmark = pytest.mark.compat

SHAPES = {  # dataset override -> expected input shape
    "synthetic": ["dataset=synthetic", "dataset.image_size=32", "dataset.train_size=64"],
    "grey28": ["dataset=synthetic", "dataset.channels=1", "dataset.image_size=28",
               "dataset.num_classes=47", "dataset.train_size=64"],
    "rgb64": ["dataset=synthetic", "dataset.image_size=64", "dataset.num_classes=100",
              "dataset.train_size=64"],
}


# timm's default, ConvNeXt-atto, halves its maps five times with unpadded 2x2 convolutions:
# 28 px leaves nothing for the last one
TOO_SMALL = {("timm", "grey28"): "model.name=convnext_atto cannot take 28x28 images"}
TOKENS = ["dataset=tokens", "dataset.seq_len=16", "dataset.vocab_size=50", "dataset.train_size=8"]


@pytest.mark.parametrize("model,shape", [
    (m, s) for m in conf_options("model") for s in (["tokens"] if language_model(m) else
                                                     sorted(SHAPES))])
@pytest.mark.slow
def test_model_forward_backward_every_param_gets_grad(model, shape, user_factory):
    """Each model on each input shape: its output's shape, and a gradient for every parameter
    (a transformer at two of its layers: every layer is the same module; test_config.py builds
    each at its own size)."""
    over = [f"model={model}", *shallow(model), *SHAPES.get(shape, TOKENS)]
    cfg, _ = api.compose(over)
    patch, size = cfg.model.get("patch_size"), cfg.dataset.get("image_size")
    if patch and size % patch:  # a fixed patch that does not divide the image: refused
        with pytest.raises(ConfigError, match=f"model.patch_size={patch} must divide"):
            api.build([f"model={model}", *SHAPES[shape]])
        return
    if (model, shape) in TOO_SMALL:  # an architecture that cannot take the size: one line
        with pytest.raises(ConfigError, match=TOO_SMALL[model, shape]):
            api.build([f"model={model}", *SHAPES[shape]])
        return
    data, net, _ = api.build(over)
    x, y = next(data.train.batches(2, torch.device("cpu")))
    assert x.shape[1:] == data.input_shape
    out = net(x)
    # a classifier's logits per sample, a language model's per token
    lm = shape == "tokens"
    assert out.shape == ((2, *data.input_shape) if lm else (2,)) + (data.num_classes,)
    cross_entropy(out, y).backward()
    missing = [n for n, p in net.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing


def test_resnet_small_stem_only_for_small_images():
    _, small, _ = api.build(["model=resnet18", "dataset.image_size=32"])
    _, big, _ = api.build(["model=resnet18", "dataset.image_size=64"])
    assert small.conv1.kernel_size == (3, 3) and isinstance(small.maxpool, torch.nn.Identity)
    assert big.conv1.kernel_size == (7, 7)


@pytest.mark.slow
def test_resmlp_matches_timm_s24_at_224():
    import timm

    _, net, _ = api.build(["model=resmlp24", "dataset.image_size=224", "dataset.train_size=8",
                           "dataset.num_classes=1000"])
    ref = timm.create_model("resmlp_24_224", num_classes=1000)
    assert sum(p.numel() for p in net.parameters()) == sum(p.numel() for p in ref.parameters())


@pytest.mark.slow  # builds four models
@pytest.mark.any_torch  # composes and counts modules: no version-dependent op
def test_a_deeper_twin_is_its_twin_with_more_of_the_same_blocks():
    """conftest.TWINS, whose block claims make test holds on the twin: the deeper model's
    options (optimizer, recipe, data, model options) are the twin's but for the class, and its
    blocks are the twin's kinds, more of them."""
    from collections import Counter

    for deep, twin in TWINS.items():
        (a, ca), (b, cb) = api.compose([f"model={deep}"]), api.compose([f"model={twin}"])
        assert a.optim == b.optim and a.dataset == b.dataset and ca["recipe"] == \
            cb["recipe"].replace(twin, deep)
        assert {k: v for k, v in a.model.items() if k != "_target_"} == \
            {k: v for k, v in b.model.items() if k != "_target_"}
        assert a.model._target_ != b.model._target_
        kinds = [Counter(type(m).__name__ for m in api.build([f"model={name}",
                                                              "dataset.image_size=16"])[1]
                         .modules()) for name in (deep, twin)]
        assert set(kinds[0]) == set(kinds[1]) and kinds[0] > kinds[1], (deep, twin)
