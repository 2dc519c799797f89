"""Building a library's model where the estimate runs: on fake tensors.

The GPU-free estimate (memtrain/run/estimate.py) builds its models inside torch's FakeTensorMode.
memtrain's own builders run there as they are; a library's often do not: timm's initialisers
read values (`torch.linspace(0, drop_path_rate, depth).tolist()`), which a fake tensor has none
of. `build(make)` runs `make()` under the active fake mode where it can, and otherwise builds
the model for real (on the CPU, the global RNG untouched) and turns every parameter, buffer and
tensor attribute into a fake tensor of the same shape, dtype and sharing (tied weights stay
one parameter). Outside a fake mode it is `make()`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def active_mode():
    """The FakeTensorMode in force here, or None."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode()


def build(make: Callable[[], nn.Module]) -> nn.Module:
    """`make()`, on fake tensors when a fake mode is active (see the module)."""
    mode = active_mode()
    if mode is None:
        return make()
    from torch._subclasses import fake_tensor as ft

    from memtrain.errors import ConfigError

    try:
        return make()
    except ConfigError:
        raise
    except Exception:  # a value read, a real tensor copied: build it for real below
        pass
    with ft.unset_fake_temporarily(), torch.random.fork_rng(devices=[]), torch.device("cpu"):
        model = make()
    return to_fake(model, mode)


def to_fake(model: nn.Module, mode) -> nn.Module:
    """`model` with every parameter, buffer and plain tensor attribute replaced by a fake tensor
    of `mode` (one fake per real tensor: shared tensors stay shared), in place."""
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            f = mode.from_tensor(t)
            memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) \
                if isinstance(t, nn.Parameter) else f
        return memo[id(t)]

    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for k, t in list(store.items()):
                if t is not None:
                    store[k] = fake(t)
        for k, v in list(vars(mod).items()):  # tensors kept as plain attributes
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                setattr(mod, k, fake(v))
    return model
