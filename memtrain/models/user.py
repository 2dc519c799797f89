"""Your own nn.Module, without packaging it (`model=module`).

Two ways to hand memtrain a module, neither of them a config value (a preset written by someone
else must never name code to run):

- the Python API: `memtrain.api.run(model=MyNet(), ...)` or `model=make_net` (a factory). The
  API registers it in this process (`register`) under its architecture's fingerprint and runs
  `model=module model.name=<class> model.arch=<fingerprint>`; a module is deep-copied for every
  run (the same initial weights each time), a factory called.
- the command line: the environment variable MEMTRAIN_MODEL names a factory,
  `package.module:function` (importable from the current folder) or `path/to/file.py:function`,
  and `memtrain model=module` builds what it returns. Only the shell that starts memtrain sets
  it: a config that sets it (`hydra.job.env_set`) is refused (offline.check_command).

A factory takes no arguments, or any of `num_classes`, `input_shape` (the data's) and the keys
of `model.kwargs`. A module that is a language model says so with `task = "lm"` (logits
[B, T, vocab] for token ids [B, T]); otherwise it classifies images ([B, C, H, W] -> [B, classes]).

run_id: `model.name` and `model.arch` are part of the config, so two modules never share a run
(skip_done and resume never mix them): from the API, the class and a hash of the module tree
(its repr) and every parameter's and buffer's name, shape and dtype; from the command line
(filled in when the run is named, loader.run_id), the factory's name and a hash of its source
file.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memtrain.models.fake as fake
from memtrain.config import offline
from memtrain.errors import ConfigError
from memtrain.models.chain import remember_input

ENV = offline.ENV_MODEL
_REGISTERED: dict[str, Callable[..., nn.Module]] = {}  # arch -> factory (this process)


def fingerprint(module: nn.Module) -> str:
    """A hash of the module's architecture: its class, its tree (repr) and the name and shape
    of every parameter and buffer (not their values or dtypes: the same architecture at other
    weights, or in bf16 under trainer.precision=bf16-true, is the same model)."""
    h = hashlib.sha1(f"{type(module).__module__}.{type(module).__qualname__}\n".encode())
    h.update(repr(module).encode())
    for n, t in [*module.named_parameters(), *module.named_buffers()]:
        h.update(f"\n{n} {tuple(t.shape)}".encode())
    return h.hexdigest()[:12]


def _factory_of(model: nn.Module | Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    if isinstance(model, nn.Module):
        original = model
        return lambda **_: copy.deepcopy(original)  # the same initial weights every run
    if callable(model):
        return model
    raise ConfigError(f"model= takes an nn.Module or a function that returns one, got "
                      f"{type(model).__name__}")


def call(factory: Callable[..., nn.Module], num_classes: int, input_shape: tuple[int, ...],
         kwargs: dict[str, Any] | None = None) -> nn.Module:
    """`factory(...)` with the arguments it names (see the module); its result checked."""
    offered = {"num_classes": num_classes, "input_shape": tuple(input_shape), **(kwargs or {})}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    args = offered if takes_all else {k: v for k, v in offered.items() if k in params}
    unused = sorted(set(kwargs or {}) - set(args))
    if unused:
        raise ConfigError(f"model.kwargs.{unused[0]}: the factory {_name(factory)} takes no "
                          f"such argument")
    module = fake.build(lambda: factory(**args))
    if not isinstance(module, nn.Module):
        raise ConfigError(f"the model factory {_name(factory)} returned "
                          f"{type(module).__name__}, not an nn.Module")
    dtype = torch.get_default_dtype()
    if dtype != torch.float32:  # trainer.precision=bf16-true: a module made before, in fp32
        module.to(dtype)
    lm = getattr(module, "task", "classify") == "lm"  # token ids below num_classes
    return remember_input(module, input_shape, num_classes if lm else None)


def _name(factory: Callable) -> str:
    return getattr(factory, "__qualname__", None) or type(factory).__name__


def register(model: nn.Module | Callable[..., nn.Module], num_classes: int,
             input_shape: tuple[int, ...], kwargs: dict[str, Any] | None = None
             ) -> tuple[str, str]:
    """Register a module or factory for this process; (name, arch): the class of the module it
    makes (with `kwargs`, model.kwargs) and its fingerprint, the `model.name` and `model.arch` of
    its runs."""
    factory = _factory_of(model)
    module = model if isinstance(model, nn.Module) else \
        call(factory, num_classes, input_shape, kwargs)
    arch = fingerprint(module)
    _REGISTERED[arch] = factory
    return type(module).__name__, arch


def user_module(num_classes: int, input_shape: tuple[int, ...], name: str | None = None,
                arch: str | None = None, kwargs: dict[str, Any] | None = None) -> nn.Module:
    """The registered module of fingerprint `arch` (the API), else the factory MEMTRAIN_MODEL
    names (the command line)."""
    if arch is not None and arch in _REGISTERED:
        module = call(_REGISTERED[arch], num_classes, input_shape, kwargs)
        if fingerprint(module) != arch:
            raise ConfigError(f"model=module: the factory for {name} built another "
                              f"architecture this time (fingerprint {fingerprint(module)}, "
                              f"registered {arch}); a factory must build the same model")
        return module
    spec = os.environ.get(ENV)
    if not spec:
        raise ConfigError(f"model=module builds the nn.Module handed to memtrain.api.run("
                          f"model=...) or the factory the environment variable {ENV} names "
                          f"(e.g. {ENV}=my_models.py:make_net); neither is given here")
    return call(load(spec), num_classes, input_shape, kwargs)


def load(spec: str) -> Callable[..., nn.Module]:
    """The factory `package.module:function` or `path/to/file.py:function` names."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(f"{ENV}={spec}: name a factory as package.module:function or "
                          f"path/to/file.py:function")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"{ENV}={spec}: no such file {path}")
        name = f"memtrain_user_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        module = sys.modules.get(name)
        if module is None:
            loader = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[name] = module
            loader.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` would find it
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(f"{ENV}={spec}: cannot import {where}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{ENV}={spec}: {where} has no function {attr!r}")
    return factory
