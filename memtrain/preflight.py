"""A job's values checked before anything is built or written, and the small builders those checks
share with the runner: the typed trainer options, a config node's keyword arguments, the object a
`_target_` names (memtrain/config/trust.py), the method a conf/method node describes.

The command's and the API's checks (loader.check_overrides) call `check` on each job before Hydra
makes a folder; the runner calls it again where a job starts (launchers' jobs, presets). It never
imports config/loader.py, which imports it.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

import memtrain.methods.base as base
from memtrain.config import schema, trust
from memtrain.config.schema import Trainer
from memtrain.data import check_options
from memtrain.errors import ConfigError
from memtrain.record import GROUPS
from memtrain.run import loggers, probes


def kwargs_of(node: DictConfig) -> dict[str, Any]:
    """A config node's options, resolved, as keyword arguments of what it builds."""
    d = OmegaConf.to_container(node, resolve=True)
    d.pop("_target_", None)
    return d


def target_of(node: DictConfig, where: str):
    """What a node's `_target_` names, if a config may build it there (memtrain/config/trust.py)."""
    return trust.locate(node._target_, f"{where}._target_")


def build_data(cfg: DictConfig):
    """The run's dataset (`memtrain.data.Data`), built from the config's `dataset` node."""
    return target_of(cfg.dataset, "dataset")(**kwargs_of(cfg.dataset))


def trainer_of(cfg: DictConfig, here: bool = True) -> Trainer:
    """The typed trainer options, after every option of the config has been checked."""
    schema.check_config(cfg, GROUPS)
    return Trainer.from_config(cfg.trainer, here)


def check(cfg: DictConfig, here: bool = True) -> Trainer:
    """The checks of one job's values that need nothing built: every option's type (resolved),
    the trainer's ranges and probes, the logger's package, the dataset's options and the memory
    its data will take (memtrain/data's option checks), the method's options and the trainer
    options it cannot honour (its optional `check_trainer`). The first problem is a one-line
    ConfigError.

    The command's and the API's checks call it on each job before anything is written
    (loader.check_overrides), the runner again when a job starts (launchers' jobs, presets).
    `here`: the job runs on this machine (False: a cluster's node, whose devices, memory and
    files are not this machine's)."""
    t = trainer_of(cfg, here)
    if here:  # what this machine has: the probes' device, the logger's package
        probes.check(t)
        loggers.check(t.logger)
    if "_target_" in cfg.dataset:
        check_options(target_of(cfg.dataset, "dataset"), kwargs_of(cfg.dataset), here)
    method = build_method(cfg.method)
    base.check_trainer(method, t)  # trainer options the method cannot honour
    if t.strategy != "single":  # as distributed's check
        base.check_strategy(method, t.strategy)
    return t


def build_method(node: DictConfig, where: str = "method") -> base.Method:
    """The method a conf/method node describes; a stack's members (its keys whose node has a
    `_target_`, conf/method/checkpoint+quantize.yaml) are built first and passed by name, a
    member's refusal naming its options as `method.<member>.<option>`."""
    kwargs = {k: build_method(v, f"{where}.{k}") if isinstance(v, DictConfig) and "_target_" in v
              else (OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v)
              for k, v in node.items() if k != "_target_"}
    try:
        method = target_of(node, "method")(**kwargs)
    except ConfigError as e:
        if where == "method":
            raise
        raise ConfigError(str(e).replace("method.", f"{where}.")) from None
    base.check(method, f"{where}._target_={node._target_}")  # the contract's name and wrap
    return method
