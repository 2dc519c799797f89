"""The type of every option in conf/, and the one rule that checks a value against it.

A key's type is its builder's type hint: the `_target_`'s keyword argument (datasets, models,
methods), the `Optim` and `Trainer` dataclasses below (optim, trainer; tests keep them equal to
the builders and the YAML). A key without a hint takes the type of its default in conf/. The
rule: an integer option takes integers (not 2.5, not true), a number takes a finite number (NaN
and inf are bad input, never a training result), true/false a bool, a list a list whose elements
obey the same rule, and every integer fits torch's 64 bits. validate.py applies it to
command-line overrides before Hydra composes; `check_config` applies it to the composed,
resolved config of each job (presets, `${oc.env:...}` and the Python API included).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import types
import typing
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from memtrain.errors import ConfigError, check_choice, check_range

INT64 = (-(2**63), 2**63 - 1)  # torch's integers (seeds included) hold no more


# the valid values of the trainer's choice options, owned here (the config layer) and imported
# by the modules that act on them
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-true")  # train.autocast_factory, train.param_dtype
STRATEGIES = ("single", "ddp", "fsdp")  # distributed.py
LOGGERS = ("csv", "tensorboard", "wandb")  # loggers.py
FAULTS = ("oom", "nan", "error", "sigterm", "hang", "kill")  # faults.py
OPTIMIZERS = ("sgd", "adamw")  # optim.build_optimizer
SCHEDULES = ("cosine", "step", "constant")  # optim.build_scheduler


@dataclasses.dataclass
class Optim:
    """The keys of the optim group, typed (conf/optim/*.yaml, whose files set the defaults of
    each optimizer; these are build_optimizer's and build_scheduler's, which take exactly these
    keys: a test keeps the three equal). The config layer checks a node against it without
    importing the builders."""

    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = True
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: str = "cosine"
    warmup_steps: int = 0
    step_every: int = 0
    gamma: float = 0.1
    min_lr_ratio: float = 0.0


@dataclasses.dataclass
class Trainer:
    """The trainer options, typed: conf/trainer/default.yaml as a dataclass (a test keeps the two
    equal; the meaning of each key is in the YAML's comments). Built once per job from the
    composed config (`from_config`, which validates it) and handed to the training loop.
    Registered in Hydra's ConfigStore as `trainer/base_trainer` (the schema of the group)."""

    device: str = "auto"
    batch_size: int = 128
    eval_batch_size: int | None = None
    epochs: int = 10
    max_steps: int | None = None
    warmup_steps: int = 5
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    seed: int = 0
    eval_every: int = 1
    eval_max_batches: int | None = None
    log_every: int = 50
    progress: bool = True
    logger: str = "csv"
    eval_every_steps: int = 0
    account_memory: bool = True
    grad_clip: float | None = None
    data_on_device: bool = True
    data_on_device_max_gb: float = 8
    threads: int | None = None
    resume: bool = False
    save_every: int = 0
    save_weights: bool = False
    skip_done: bool = False
    search_dir: str | None = None
    fault: str | None = None
    fault_step: int = 0
    memory_snapshot: bool = False
    memory_timeline: bool = False
    gpu_memory_gb: float | None = None
    find_max_batch: bool = False
    max_batch_headroom: float = 0.1
    max_batch_multiple: int = 1
    cuda_context_gb: float | None = None
    estimate: bool = False
    strategy: str = "single"
    world_size: int | None = None
    fault_rank: int | None = None

    @classmethod
    def from_config(cls, node: DictConfig | dict[str, Any], here: bool = True) -> Trainer:
        """The options of `cfg.trainer` (resolved), validated (`check`; `here`: on the machine
        that will run the job)."""
        values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
            else dict(node)
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown trainer option trainer.{unknown[0]}")
        t = cls(**values)
        # Hydra reads a bare `nan` as a float: a fault's name is text, and null means none
        if t.fault is not None:
            t.fault = None if str(t.fault).lower() in ("", "null", "none") else str(t.fault).lower()
        t.check(here)
        return t

    def check(self, here: bool = True) -> None:
        """Ranges and choices, each a one-line ConfigError (types: `check_config`); with `here`
        (the job runs on this machine, not on a cluster's node) also a CUDA device where one is
        asked for (the packages of `trainer.logger`: `preflight.check`)."""
        check_range("trainer.batch_size", self.batch_size, 1)
        if self.eval_batch_size is not None:
            check_range("trainer.eval_batch_size", self.eval_batch_size, 1)
        check_range("trainer.epochs", self.epochs, 1)
        if self.max_steps is not None:  # 0: probes only
            check_range("trainer.max_steps", self.max_steps, 0)
        if self.max_steps == 0 and not (self.estimate or self.find_max_batch):
            raise ConfigError("trainer.max_steps=0 runs the probes only, and none is asked: set "
                              "trainer.estimate=true or trainer.find_max_batch=true, or "
                              "trainer.max_steps >= 1")
        check_range("trainer.warmup_steps", self.warmup_steps, 0)
        check_choice("trainer.precision", self.precision, PRECISIONS)
        check_range("trainer.log_every", self.log_every, 1)
        check_range("trainer.eval_every", self.eval_every, 0)
        check_range("trainer.eval_every_steps", self.eval_every_steps, 0)
        check_choice("trainer.logger", self.logger, LOGGERS)
        dev = str(self.device)
        if dev not in ("auto", "cpu") and not dev.startswith("cuda"):
            raise ConfigError(f"trainer.device must be auto, cpu, cuda or cuda:N, got {dev!r}")
        for name in ("eval_max_batches", "threads"):
            if getattr(self, name) is not None:
                check_range(f"trainer.{name}", getattr(self, name), 1)
        if self.grad_clip is not None:
            check_range("trainer.grad_clip", self.grad_clip, 0, None, lo_open=True)
        check_range("trainer.save_every", self.save_every, 0)
        if self.fault is not None:
            check_choice("trainer.fault", self.fault, FAULTS)
        check_range("trainer.fault_step", self.fault_step, 0)
        if self.fault_rank is not None:
            check_range("trainer.fault_rank", self.fault_rank, 0)
        if self.memory_timeline and (self.max_steps == 0 or not self.account_memory):
            off = "trainer.max_steps=0" if self.max_steps == 0 else "trainer.account_memory=false"
            raise ConfigError(f"trainer.memory_timeline=true records the accounting step, which "
                              f"{off} leaves out: the run would end with no timeline; drop one "
                              f"of them")
        check_choice("trainer.strategy", self.strategy, STRATEGIES)
        if self.world_size is not None:
            check_range("trainer.world_size", self.world_size, 1)
            if self.strategy == "single" and self.world_size > 1:
                raise ConfigError(f"trainer.world_size={self.world_size} with "
                                  f"trainer.strategy=single: several ranks need "
                                  f"trainer.strategy=ddp or trainer.strategy=fsdp")
        if self.gpu_memory_gb is not None:
            check_range("trainer.gpu_memory_gb", self.gpu_memory_gb, 0, None, lo_open=True)
        check_range("trainer.max_batch_headroom", self.max_batch_headroom, 0, 1, hi_open=True)
        check_range("trainer.max_batch_multiple", self.max_batch_multiple, 1)
        if self.cuda_context_gb is not None:
            check_range("trainer.cuda_context_gb", self.cuda_context_gb, 0)
        if dev.startswith("cuda") and here:
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"trainer.device={dev} but no CUDA device is available; use "
                                  f"trainer.device=cpu or auto")

    def schedule(self, n_train: int) -> tuple[int, int]:
        """(steps per epoch, steps of the run) on a training split of `n_train` samples: the one
        step count (the loop, the learning-rate schedule and a method's phases use it)."""
        per_epoch = n_train // self.batch_size
        total = self.max_steps if self.max_steps is not None else self.epochs * max(1, per_epoch)
        return per_epoch, total


def register_configs() -> None:
    """The structured configs in Hydra's ConfigStore: `trainer/base_trainer`, the schema a
    trainer YAML can extend (`defaults: [base_trainer, _self_]`) for typed keys."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="trainer", name="base_trainer", node=Trainer)


@functools.cache
def _hints_of(fn: Callable) -> dict[str, Any]:
    target = fn.__init__ if inspect.isclass(fn) and not dataclasses.is_dataclass(fn) else fn
    return typing.get_type_hints(target)


def hints(group: str, target: str | None) -> dict[str, Any]:
    """Type hints of the keys of a config group (target: its node's `_target_`, if any)."""
    if group == "trainer":
        return _hints_of(Trainer)
    if group == "optim":
        return _hints_of(Optim)
    if not target:
        return {}
    from hydra.utils import get_method

    try:
        return _hints_of(get_method(target))
    except Exception:  # an unimportable target is reported where it is instantiated
        return {}


def type_of_default(default: Any) -> Any:
    """The type a default stands for (None: anything, the builder checks)."""
    if default is None or isinstance(default, str):
        return None
    for t in (bool, int, float, list, dict):
        if isinstance(default, t):
            return t
    return None


def _strip_none(ann: Any) -> Any:
    """`int | None` -> int; `list[int] | tuple[int, ...]` -> its first member, the YAML form."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(ann) if a is not type(None))
    return ann


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann) or ann
    return {bool: "true or false", int: "an integer", float: "a number", list: "a list",
            tuple: "a list", dict: "a mapping", str: "text"}.get(origin, getattr(
                origin, "__name__", str(origin)))


def problem(key: str, ann: Any, value: Any) -> str | None:
    """The one-line message when `value` cannot stand for option `key` of type `ann`, else None."""
    optional = ann is None or ann is Any or type(None) in typing.get_args(ann)
    ann = _strip_none(ann)
    if value is None:  # null only where the option takes it (its hint or default is None)
        return None if optional else f"{key} cannot be null: it takes {_type_name(ann)}"
    if ann is None or ann is Any or ann is str:
        return None
    if isinstance(value, str) and "${" in value:  # an interpolation: checked once resolved
        return None
    origin = typing.get_origin(ann) or ann
    if origin is bool:
        return None if isinstance(value, bool) else f"{key} must be true or false, got {value!r}"
    if origin is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key} must be an integer, got {value!r}"
        if not INT64[0] <= value <= INT64[1]:
            return f"{key} must be an integer in [-2**63, 2**63-1], got {value}"
        return None
    if origin is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{key} must be a number, got {value!r}"
        if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
            return f"{key} must be a number within [-2**63, 2**63-1], got {value}"
        return None if math.isfinite(value) else f"{key} must be a finite number, got {value}"
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return f"{key} must be a list such as [1, 2], got {value!r}"
        args = [a for a in typing.get_args(ann) if a is not Ellipsis]
        for i, v in enumerate(value):
            msg = problem(f"{key}[{i}]", args[min(i, len(args) - 1)] if args else None, v)
            if msg:
                return msg
        return None
    if origin is dict:
        return None if isinstance(value, dict) else \
            f"{key} must be a mapping such as {{a: 1}}, got {value!r}"
    return None


def expected_type(group: str, key: str, node: DictConfig | dict, default: Any) -> Any:
    """The type option `group.key` takes: its builder's hint, else its default's type."""
    target = node.get("_target_") if isinstance(node, (DictConfig, dict)) else None
    hint = hints(group, target).get(key)
    return hint if hint is not None else type_of_default(default)


def accepted_keys(group: str, target: str | None) -> set[str] | None:
    """The keys a group's node may hold: its builder's keyword arguments (None: any, a builder
    that takes **kwargs or cannot be imported; checked where it is built)."""
    if group == "trainer":
        return {f.name for f in dataclasses.fields(Trainer)}
    if group == "optim":
        return {f.name for f in dataclasses.fields(Optim)}
    if not target:
        return None
    from hydra.utils import get_method

    try:
        params = inspect.signature(get_method(target)).parameters.values()
    except Exception:  # an unimportable target is reported where it is instantiated
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def unknown_key(group: str, key: str, accepted: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(accepted), n=1, cutoff=0.6)
    return (f"unknown option {group}.{key}"
            + (f"; did you mean {group}.{close[0]}?" if close else
               f"; {group} has: {', '.join(sorted(accepted))}"))


def check_config(cfg: DictConfig, groups: tuple[str, ...], resolve: bool = True) -> None:
    """Every option of the composed config against its type, and every key against the keys
    its builder takes (a preset's typo); ConfigError on the first problem.

    Values are resolved first (`resolve=False`: interpolations are left for the job): an unset
    `${oc.env:...}` is a one-line error here too.
    """
    for group in groups:
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        try:
            values = OmegaConf.to_container(node, resolve=resolve)
        except Exception as e:  # an interpolation that cannot be resolved, e.g. an unset env var
            msg = str(e).splitlines()[0]
            raise ConfigError(f"{group}: cannot resolve a value: {msg}") from None
        _check_node(group, group, values)


def _check_node(name: str, group: str, values: dict) -> None:
    """One node's keys and values (`name`: its path, `method.quantize` for a stack's member,
    whose own `_target_` types its keys)."""
    accepted = accepted_keys(group, values.get("_target_"))
    for key, value in values.items():
        if key == "_target_":
            continue
        if accepted is not None and key not in accepted:
            raise ConfigError(unknown_key(name, key, accepted))
        if isinstance(value, dict) and "_target_" in value:  # a stack's member
            _check_node(f"{name}.{key}", group, value)
            continue
        msg = problem(f"{name}.{key}", expected_type(group, key, values, value), value)
        if msg:
            raise ConfigError(msg)
