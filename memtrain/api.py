"""Python API for notebooks and tests: the same conf/ and code path as the CLI.

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

from memtrain import cli


def compose(overrides: list[str] | None = None) -> tuple[DictConfig, dict[str, str]]:
    """The composed config (hydra node removed) and the group choices."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = list(overrides or [])
    cli.check_overrides(overrides)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(cli.conf_dir()), version_base="1.3"):
        cfg = hcompose("config", overrides=overrides, return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    with_hydra = OmegaConf.to_container(cfg, resolve=False)
    with_hydra.pop("hydra", None)
    return OmegaConf.create(with_hydra), choices


def build(overrides: list[str] | None = None):
    """(data, model, method) for the overrides, the method already applied to the model."""
    cfg, _ = compose(overrides)
    return cli.build(cfg)


def run(overrides: list[str] | None = None, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Train one run and return its summary record; the run folder is `out_dir` (default
    runs/api/<date>/<time>_<method>_<model>_<dataset>)."""
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
        summary = cli.execute(cfg, out_dir, choices)
    finally:
        root.removeHandler(handler)
        handler.close()
    summary.pop("_exception", None)
    return summary
