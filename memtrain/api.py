"""Python API for notebooks, tests and benchmarks: the same conf/ and engine as the CLI.

    from memtrain import api
    row = api.run(["method=none", "model=mlp6", "trainer=smoke"])
    data, model, method = api.build(["model=resnet18"])
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from memtrain import config, runner
from memtrain.errors import ConfigError


def compose(overrides: list[str] | None = None) -> tuple[DictConfig, dict[str, str]]:
    """The composed config (hydra node removed) and the group choices."""
    return config.compose(overrides)


def build(overrides: list[str] | None = None):
    """(data, model, method) for the overrides, the method already applied to the model."""
    cfg, _ = compose(overrides)
    return runner.build(cfg)


def run(overrides: list[str] | None = None, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Train one run and return its summary record; the run folder is `out_dir` (default
    runs/api/<date>/<time>_<method>_<model>_<dataset>). Bad input the checks see in the values
    (types, ranges, the data's memory: config.check_overrides) raises its ConfigError before
    anything is written; bad input found while the job builds (a missing file) raises after its
    row is written; every other failure is the row's status."""
    cfg, choices = compose(overrides)
    if out_dir is None:
        stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
        out_dir = Path("runs/api") / f"{stamp}_{choices['method']}_{choices['model']}_" \
            f"{choices['dataset']}"
    out_dir = Path(out_dir)
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
