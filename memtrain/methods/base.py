"""The method contract: everything memtrain asks of a method, and the one place that asks.

A method is any object (there is no base class to inherit) that conf/method/<name>.yaml's
`_target_` builds from the YAML's other keys, or that a user's code builds. The runner
(runner.py), the probes (estimate.py, probes.py), the strategies (distributed.py) and a stack of
methods (methods/stack.py) reach it only through the functions of this module, which are the
only code that looks an optional hook up.

Required (`check` refuses an object without them, in one line):

- `name: str`: the method's name, the row's `method` column.
- `wrap(model) -> model`: module surgery, saved-tensor hooks or segmentation, before training;
  also applied to every fresh model the probes build.

Declared (every built-in method; a method that does not declare it leaves its rows without
the column, rather than claim either):

- `grads_exact: bool`: True when training computes the gradients plain training computes, up to
  floating-point rounding (none, checkpoint, offload); False when the method approximates them
  or trains towards other targets (pool, prune, quantize, synthetic; a stack when any member
  does). The row's `grads_exact` column (`columns`).

Optional hooks, each called only where the method has it:

- `check_device(device)`: before the probes and training, on the run's device; a one-line
  ConfigError for a device the method cannot use (offload on the CPU).
- `check_trainer(trainer)`: before anything is written (memtrain/preflight.py); a one-line
  ConfigError for trainer options the method would leave undone (synthetic's parallel workers
  and `trainer.memory_timeline`), never silently ignored.
- `check_strategy(strategy)`: a sharded run (`ddp` or `fsdp`) only, before training; a one-line
  ConfigError for a strategy the method cannot run under (synthetic: its own loop per phase).
- `prepare(model, x, y, autocast, carry, context) -> dict`: once before the first step, on the
  run's first batch (`x`, `y`) and device (checkpoint profiles and plans here); `autocast()`
  enters the run's autocast. `carry` is saved with every resumable checkpoint and holds, on
  resume, what the method put there (a plan to keep). `context`: a `MethodContext`. Returns
  row columns, each declared in memtrain/columns.py (`dry_run: True` among them stops the run
  before training).
- `fit(model, data, optimizer, scheduler, *, trainer, device, checkpointer, loggers)
  -> TrainResult`: replaces `train.train` (the same signature) for a method that changes the
  training procedure (synthetic: it calls `train` for each phase).
- `probe_steps(model, x, y, *, autocast, num_classes, context) -> list[ProbeStep]`: for the
  estimate and find_max_batch (on fake tensors, or real ones on CUDA), the steps a run of the
  method measures when they are not one step of the wrapped model (checkpoint: its plan
  applied; synthetic: one step per phase).
- `plan_rows(model) -> list[dict]`: the plan the method applied, one row per segment
  (memtrain/memory/by_module.py's plan.csv), written with `trainer.memory_timeline`.

Between a stack and its members (methods/stack.py):

- `hooks() -> methods.common.hooks.ChainedHooks`: a fresh set of the method's saved-tensor
  hooks (quantize, offload), which a stack enters inside a recomputing member too.
- `inside`: an attribute of a method that recomputes (checkpoint), None by default; a stack
  sets it to a factory of a context manager that the method enters around each recomputation.
- `check_stack(names)`: `names` lists the stack's members outermost first; a one-line
  ConfigError for a stack this method cannot stand in (checkpoint strategy=compile).

The smallest method (tests/test_new_method.py runs it from a package of a user's own):

    class Toy:
        name = "toy"

        def __init__(self, note: str = "hello"):  # the YAML's keys
            self.note = note

        def wrap(self, model):
            return model
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

from memtrain.errors import ConfigError
from memtrain.losses import cross_entropy

REQUIRED = ("name", "wrap")
HOOKS = ("check_device", "check_strategy", "check_trainer", "prepare", "fit", "probe_steps",
         "plan_rows", "hooks", "check_stack")
GRADS_EXACT = "grads_exact"  # the declared attribute, and the row's column of the same name


@runtime_checkable
class Method(Protocol):
    """The required members (the module docstring lists the optional ones)."""

    name: str

    def wrap(self, model: nn.Module) -> nn.Module: ...


class Sharding(NamedTuple):
    """A sharded run, as one rank sees it."""

    strategy: str  # ddp or fsdp
    world_size: int  # the ranks


@dataclass(frozen=True)
class MethodContext:
    """What a run knows beyond the batch, for the hooks that take it (`prepare`,
    `probe_steps`). Every field has a default: a field added later leaves a method that does not
    read it as it was.

    Attributes:
        cache_dir: the sweep's folder, shared by its jobs (checkpoint keeps one profile per
            model there); None: no cache (the probes, a stack's members).
        model_config: the run's model options (conf/model's keys, `_target_` included); None
            for a model built without a config (a user's nn.Module).
        sharding: the strategy and ranks of a sharded run; None for one process.
    """

    cache_dir: Path | None = None
    model_config: Mapping[str, Any] | None = None
    sharding: Sharding | None = None


NO_CONTEXT = MethodContext()


@dataclass
class ProbeStep:
    """One training step as a run's accounting step measures it: the module that trains, its
    input batch and targets, its loss. `name` is the phase (synthetic: part0, part1, recovery;
    "" for a method that trains the whole model in one loop)."""

    module: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    name: str = ""
    resident: tuple[nn.Module, ...] = ()  # on the device beside `module` (counted in the peak)


# ---------------------------------------------------------------- what a method is


def problems(obj: Any) -> list[str]:
    """What keeps `obj` from being a method; [] for a method."""
    out = [f"no `{m}`" for m in REQUIRED if not hasattr(obj, m)]
    if hasattr(obj, "name") and not isinstance(obj.name, str):
        out.append(f"`name` is {type(obj.name).__name__}, not text")
    if hasattr(obj, "wrap") and not callable(obj.wrap):
        out.append("`wrap` cannot be called")
    exact = getattr(obj, GRADS_EXACT, None)
    if exact is not None and not isinstance(exact, bool):
        out.append(f"`{GRADS_EXACT}` is {exact!r}, not true or false")
    out += [f"`{h}` cannot be called" for h in HOOKS
            if getattr(obj, h, None) is not None and not callable(getattr(obj, h))]
    return out


def check(obj: Any, where: str) -> None:
    """A one-line ConfigError naming `where` (the config key that built it) unless `obj` is a
    method."""
    found = problems(obj)
    if found:
        raise ConfigError(f"{where}: {type(obj).__qualname__} is not a method: "
                          f"{'; '.join(found)} (a method has `name` and `wrap(model) -> model`; "
                          f"memtrain/methods/base.py)")


def has(method: Any, hook: str) -> bool:
    """Whether the method has the optional hook (one of `HOOKS`)."""
    if hook not in HOOKS:
        raise ValueError(f"{hook!r} is no hook of the method contract: {', '.join(HOOKS)}")
    return callable(getattr(method, hook, None))


def grads_exact(method: Any) -> bool | None:
    """The method's `grads_exact`; None where it does not declare it."""
    return getattr(method, GRADS_EXACT, None)


def columns(method: Any) -> dict[str, Any]:
    """The row's columns the method declares (`grads_exact`, where declared)."""
    exact = grads_exact(method)
    return {} if exact is None else {GRADS_EXACT: exact}


# ---------------------------------------------------------------- the hooks, called


def check_device(method: Any, device: torch.device) -> None:
    if has(method, "check_device"):
        method.check_device(device)


def check_strategy(method: Any, strategy: str) -> None:
    if has(method, "check_strategy"):
        method.check_strategy(strategy)


def check_trainer(method: Any, trainer: Any) -> None:
    if has(method, "check_trainer"):
        method.check_trainer(trainer)


def check_stack(method: Any, names: list[str]) -> None:
    if has(method, "check_stack"):
        method.check_stack(names)


def prepare(method: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
            autocast: Callable[[], AbstractContextManager] | None, carry: dict[str, Any],
            context: MethodContext = NO_CONTEXT) -> dict[str, Any]:
    """The method's `prepare`: its row columns; {} without one."""
    if not has(method, "prepare"):
        return {}
    return method.prepare(model, x, y, autocast, carry, context)


def training_loop(method: Any, default: Callable[..., Any]) -> Callable[..., Any]:
    """The method's `fit`, else `default` (train.train)."""
    return method.fit if has(method, "fit") else default


def probe_steps(method: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                autocast: Callable[[], AbstractContextManager], num_classes: int,
                context: MethodContext = NO_CONTEXT) -> list[ProbeStep]:
    """The method's `probe_steps`, else the one step of the wrapped model."""
    if not has(method, "probe_steps"):
        return [ProbeStep(model, x, y)]
    return method.probe_steps(model, x, y, autocast=autocast, num_classes=num_classes,
                              context=context)


def plan_rows(method: Any, model: nn.Module) -> list[dict]:
    """The method's `plan_rows`; [] without one."""
    return method.plan_rows(model) if has(method, "plan_rows") else []


def saved_tensor_hooks(method: Any) -> Callable[[], AbstractContextManager] | None:
    """The method's `hooks` (a factory of fresh saved-tensor hooks), or None."""
    return method.hooks if has(method, "hooks") else None


def recomputes(method: Any) -> bool:
    """Whether the method has an `inside` for a stack to set (it recomputes)."""
    return hasattr(method, "inside")
