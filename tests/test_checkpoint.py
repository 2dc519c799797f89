"""Checkpointing: exact gradients and BatchNorm statistics against none, the planner against brute
force, the modelled activation peak against the tracker's, budgets respected."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from memtrain import api
from memtrain.errors import ConfigError
from memtrain.methods import _ckpt_plan as planner
from memtrain.methods.checkpoint import CheckpointMethod

# (model, image size, batch): small inputs that still exercise every segment kind.
MODELS = {
    "resnet18": (64, 2), "resnet34": (64, 2), "resnet50": (64, 2), "efficientnet_b0": (32, 2),
    "resmlp12": (32, 2), "resmlp24": (16, 2), "mlp6": (8, 4),
}
EAGER = ("uniform", "sqrt", "budget", "selective")


def _build(model: str, size: int):
    data, m, _ = api.build([f"model={model}", f"dataset.image_size={size}"])
    return data, m


def _batch(size: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,),
                                                                         generator=g)


def _step(model, x, y, seed=1):
    """One forward + backward in train mode, from a fixed RNG state (dropout, stochastic depth)."""
    model.train()
    torch.manual_seed(seed)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return float(loss.detach())


def _checkpointed(base, strategy, x, y, **kw):
    """A checkpointed copy of `base`, its method and its parameters and buffers in `base`'s order
    (the surgery moves modules, the tensors stay the same objects)."""
    model = copy.deepcopy(base)
    tensors = list(model.parameters()), list(model.buffers())
    method = CheckpointMethod(strategy=strategy, profile_repeats=1, **kw)
    model = method.wrap(model)
    if strategy in ("uniform", "sqrt", "budget"):
        method.prepare(model, x, y)
    return model, method, tensors


def _assert_same_step(ref, ref_loss, model, tensors, x, y, what):
    """One step of `model` gives `ref`'s loss, gradients and BatchNorm running statistics."""
    loss = _step(model, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-5), what
    params, buffers = tensors
    for (name, p_ref), p in zip(ref.named_parameters(), params, strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-7,
                                   msg=f"{what}: grad of {name}")
    for (name, b_ref), b in zip(ref.named_buffers(), buffers, strict=True):
        assert torch.equal(b, b_ref), f"{what}: buffer {name}"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_strategy_matches_none(model):
    size, batch = MODELS[model]
    _, base = _build(model, size)
    x, y = _batch(size, batch)
    ref = copy.deepcopy(base)
    ref_loss = _step(ref, x, y)
    for strategy in EAGER:
        got, method, tensors = _checkpointed(base, strategy, x, y, budget_fraction=0.7, every=2)
        if strategy != "selective":  # something really is recomputed
            assert method.plan.groups, strategy
        _assert_same_step(ref, ref_loss, got, tensors, x, y, f"{model}/{strategy}")
