"""Module surgery shared by the methods: swap submodules, recast one as another class."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap_modules(model: nn.Module, match: Callable[[str, nn.Module], bool],
                 make: Callable[[str, nn.Module], nn.Module]) -> list[str]:
    """Replace every submodule for which `match(qualified_name, module)` holds with
    `make(qualified_name, module)`, in place; returns the names replaced.

    The walk collects first and swaps afterwards, so a replacement is never itself visited.
    """
    targets = [(name, mod) for name, mod in model.named_modules() if name and match(name, mod)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(name, mod))
    return [name for name, _ in targets]


def recast(module: nn.Module, cls: type, **attrs) -> nn.Module:
    """A `cls` instance sharing `module`'s parameters, buffers and settings (same state_dict
    keys, same Parameter objects) plus `attrs`."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    new.__dict__.update(attrs)
    return new
