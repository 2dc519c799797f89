"""Python API for notebooks, tests and benchmarks: the same conf/ and engine as the CLI.

    from memtrain import api
    row = api.run(["method=none", "model=mlp6", "trainer=smoke"])
    data, model, method = api.build(["model=resnet18"])

Your own nn.Module (or a function that makes one), without packaging it:

    row = api.run(["method=quantize", "trainer=smoke"], model=MyNet())
    rows = api.sweep(["trainer=smoke"], model=make_net, methods=["none", "quantize", "pool"])

Will it fit: every method for a model, a batch and a card, on fake tensors (no GPU):

    found = api.will_fit(["model=resnet50", "trainer.batch_size=256"], card="rtx4090")
    print(found.answer)

A module runs as `model=module` (memtrain/models/user.py): deep-copied for every run, so each
starts from the same initial weights; its class and a hash of its architecture are the row's
`model.name` and `model.arch`, part of run_id.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from memtrain.config import loader
from memtrain.errors import ConfigError
from memtrain.run import runner

Model = nn.Module | Callable[..., nn.Module]


def compose(overrides: list[str] | None = None) -> tuple[DictConfig, dict[str, str]]:
    """The composed config (hydra node removed) and the group choices."""
    return loader.compose(overrides)


def build(overrides: list[str] | None = None, model: Model | None = None):
    """(data, model, method) for the overrides, the method already applied to the model;
    `model`: your module or factory instead of the config's."""
    cfg, _ = compose(with_module(overrides, model))
    return runner.build(cfg)


def with_module(overrides: list[str] | None, model: Model | None) -> list[str]:
    """The overrides that run `model` (a module or factory, registered in this process) as
    `model=module`; the overrides themselves when `model` is None."""
    overrides = list(overrides or [])
    if model is None:
        return overrides
    from memtrain.models import user

    chosen = [o for o in overrides if o.split("=")[0].lstrip("+~") == "model"]
    if chosen:
        raise ConfigError(f"{chosen[0]}: model= of the API runs your module; drop the override "
                          f"(or drop model= to run {chosen[0].split('=', 1)[-1]})")
    cfg, _ = compose([*overrides, "model=module"])
    kwargs = OmegaConf.to_container(cfg.model.kwargs, resolve=True) or {}
    shapes = (0, ())
    if not isinstance(model, nn.Module):  # a factory may take the data's classes and shape
        data = runner.build_data(cfg)
        shapes = (data.num_classes, data.input_shape)
    elif kwargs:
        raise ConfigError(f"model.kwargs.{next(iter(kwargs))}: a module is built already; "
                          f"pass a function that builds it to take keyword arguments")
    name, arch = user.register(model, *shapes, kwargs)
    return ["model=module", f"model.name={name}", f"model.arch={arch}", *overrides]


def run(overrides: list[str] | None = None, out_dir: str | Path | None = None,
        model: Model | None = None) -> dict[str, Any]:
    """Train one run and return its summary record; the run folder is `out_dir` (default
    runs/api/<date>/<time>_<method>_<model>_<dataset>). `model`: your nn.Module (deep-copied
    for the run) or a function that returns one, run as `model=module`. Bad input the checks
    see in the values (types, ranges, the data's memory: loader.check_overrides) raises its
    ConfigError before anything is written; bad input found while the job builds (a missing
    file) raises after its row is written; every other failure is the row's status."""
    cfg, choices = compose(with_module(overrides, model))
    if out_dir is None:
        stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
        out_dir = Path("runs/api") / f"{stamp}_{choices['method']}_{choices['model']}_" \
            f"{choices['dataset']}"
    return _run(cfg, choices, Path(out_dir))


def _run(cfg: DictConfig, choices: dict[str, str], out_dir: Path) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out_dir / "config.yaml")
    handler = logging.FileHandler(out_dir / "memtrain.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        out = runner.run(cfg, out_dir, choices)
    finally:
        root.removeHandler(handler)
        handler.close()
    if isinstance(out.error, ConfigError):
        raise out.error
    return out.summary


def sweep(overrides: list[str] | None = None, *, model: Model | None = None,
          methods: Sequence[str] = ("none",), params: dict[str, Sequence[Any]] | None = None,
          out_dir: str | Path | None = None, report: bool = True) -> list[dict[str, Any]]:
    """A multirun: every method of `methods` with every combination of `params` (key ->
    values, as `memtrain -m key=a,b`), each run in `<out_dir>/<num>_<run_id>` as the command
    line's sweep names its job folders; then, with `report`, the sweep's report in `out_dir`
    (summary.csv, report.md, figures/). A run that fails leaves its row and the sweep goes on.
    Returns the rows in job order. Bad input that every run would share (an unknown key, a
    model refused) raises before any run starts."""
    overrides = with_module(overrides, model)
    if out_dir is None:
        out_dir = Path("runs/api/multirun") / time.strftime("%Y-%m-%d/%H-%M-%S")
    out_dir = Path(out_dir)
    keys = list(params or {})
    jobs = [[f"method={m}", *(f"{k}={v}" for k, v in zip(keys, values))]
            for m in methods for values in itertools.product(*(params or {}).values())]
    composed = [compose([*overrides, *job]) for job in jobs]  # every job checked first
    rows = []
    for num, (cfg, choices) in enumerate(composed):
        job_dir = out_dir / f"{num}_{loader.run_id(cfg)}"
        try:
            rows.append(_run(cfg, choices, job_dir))
        except ConfigError:  # its row says why; the sweep goes on
            from memtrain import record

            rows.append(record.read_summary(job_dir))
    if report and rows:
        from memtrain.report.build import make_report

        make_report([out_dir], out_dir)
    return rows


def will_fit(overrides: list[str] | None = None, *, card: str | None = None,
             methods: Sequence[str] | None = None, out_dir: str | Path | None = None,
             figure: bool = True, defaults_only: bool = False):
    """What `memtrain-willfit` answers (memtrain/willfit.py, docs/willfit.md): for the
    overrides' model, batch, precision and optimizer on a card (`card`, a preset name, or
    `trainer.gpu_memory_gb`), every method and stack (`methods`: a few of them;
    `defaults_only`: each at its defaults only) estimated on fake tensors: its peak and
    breakdown, whether it fits, the largest batch that fits, the predicted step-time overhead
    and its source, exact or approximate gradients. Returns a `willfit.Answer` (`rows`,
    `answer`, `card`); with `out_dir`, willfit.csv, willfit.json and willfit.png are written
    there. Bad input raises a one-line ConfigError before anything is written."""
    from memtrain import willfit

    return willfit.will_fit(list(overrides or []), out_dir=out_dir, methods=methods, card=card,
                            figure=figure, defaults_only=defaults_only)
