"""The `memtrain` command: the only place that reads the config and instantiates objects.

config -> data, model -> method.wrap(model) -> optimizer -> train (or method.fit) -> records.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from memtrain import measure, record
from memtrain.errors import ConfigError, check_choice, check_range

log = logging.getLogger("memtrain")

GROUPS = ("dataset", "model", "method", "optim", "trainer", "experiment")


def conf_dir() -> Path:
    """conf/ beside the package in a source checkout, else the installed memtrain.conf."""
    here = Path(__file__).resolve().parent.parent / "conf"
    if (here / "config.yaml").exists():
        return here
    from importlib import resources

    return Path(str(resources.files("memtrain.conf")))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


# ---------------------------------------------------------------- validation


def check_overrides(overrides: list[str]) -> None:
    """Reject unknown group options before Hydra does, with a one-line message."""
    for ov in overrides:
        key, sep, value = ov.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in GROUPS or not value or value == "null":
            continue
        if any(c in value for c in "()[]{}*"):  # sweep functions: leave to Hydra
            continue
        valid = group_options(key)
        for choice in value.split(","):
            if choice not in valid:
                raise ConfigError(f"unknown {key} {choice!r}; choose one of: {', '.join(valid)}")


def check_trainer(t: DictConfig) -> None:
    check_range("trainer.batch_size", t.batch_size, 1)
    if t.eval_batch_size is not None:
        check_range("trainer.eval_batch_size", t.eval_batch_size, 1)
    check_range("trainer.epochs", t.epochs, 1)
    if t.max_steps is not None:
        check_range("trainer.max_steps", t.max_steps, 1)
    check_range("trainer.warmup_steps", t.warmup_steps, 0)
    check_choice("trainer.precision", t.precision, ("fp32", "bf16", "fp16"))
    check_range("trainer.log_every", t.log_every, 1)
    check_range("trainer.eval_every", t.eval_every, 0)
    dev = str(t.device)
    if dev not in ("auto", "cpu") and not dev.startswith("cuda"):
        raise ConfigError(f"trainer.device must be auto, cpu, cuda or cuda:N, got {dev!r}")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={dev} but no CUDA device is available; use "
                          f"trainer.device=cpu or auto")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ---------------------------------------------------------------- building


def _kwargs(node: DictConfig) -> dict[str, Any]:
    d = OmegaConf.to_container(node, resolve=True)
    d.pop("_target_", None)
    return d


def _target(node: DictConfig):
    from hydra.utils import get_method

    return get_method(node._target_)


def build(cfg: DictConfig):
    """(data, model, method) from a composed config; the method already applied to the model."""
    check_trainer(cfg.trainer)
    torch.manual_seed(cfg.trainer.seed)
    data = _target(cfg.dataset)(**_kwargs(cfg.dataset))
    model = _target(cfg.model)(num_classes=data.num_classes, input_shape=data.input_shape,
                               **_kwargs(cfg.model))
    method = _target(cfg.method)(**_kwargs(cfg.method))
    model = method.wrap(model)
    return data, model, method


def _flatten(prefix: str, node: Any) -> dict[str, Any]:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k != "_target_":
                out.update(_flatten(f"{prefix}.{k}", v))
        return out
    if isinstance(node, list):
        return {prefix: json.dumps(node)}
    return {prefix: node}


def run_id(cfg: DictConfig) -> str:
    """A hash of the resolved config (hydra's own settings excluded): same config, same id."""
    c = OmegaConf.to_container(cfg, resolve=True)
    c.pop("hydra", None)
    blob = json.dumps(c, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def identity(cfg: DictConfig, choices: dict[str, str]) -> dict[str, Any]:
    """The columns that say what a run is: choices, run_id and every option flattened."""
    row: dict[str, Any] = {
        "run_id": run_id(cfg),
        "status": "running",
        "method": choices.get("method", ""),
        "model": choices.get("model", ""),
        "dataset": choices.get("dataset", ""),
        "optim": choices.get("optim", ""),
        "trainer": choices.get("trainer", ""),
        "experiment": choices.get("experiment") or "",
    }
    c = OmegaConf.to_container(cfg, resolve=True)
    for group in ("method", "trainer", "dataset", "model", "optim"):
        row.update(_flatten(group, c.get(group, {})))
    return row


# ---------------------------------------------------------------- one job


def execute(cfg: DictConfig, run_dir: Path, choices: dict[str, str]) -> dict[str, Any]:
    """Build, train and record one run; always leaves summary.json behind.

    Returns the summary. A ConfigError is re-raised after the row is written, so a single run
    can exit with the message; every other failure is a row with its status.
    """
    from memtrain.optim import build_optimizer, build_scheduler
    from memtrain.train import RunFailed, train

    run_dir.mkdir(parents=True, exist_ok=True)
    summary = identity(cfg, choices)
    metrics: list[dict] = []
    t0 = time.perf_counter()
    error: BaseException | None = None
    try:
        if cfg.trainer.threads:
            torch.set_num_threads(int(cfg.trainer.threads))
        device = resolve_device(str(cfg.trainer.device))
        summary.update(measure.provenance(device))
        data, model, method = build(cfg)
        if device.type == "cuda" and cfg.trainer.data_on_device:
            from memtrain.data import place

            data = place(data, device, int(cfg.trainer.data_on_device_max_gb * 2**30))
        summary.update({"num_classes": data.num_classes,
                        "input_shape": "x".join(map(str, data.input_shape)),
                        "params": sum(p.numel() for p in model.parameters())})
        t = cfg.trainer
        steps_per_epoch = max(1, len(data.train) // t.batch_size)
        total = t.max_steps if t.max_steps is not None else t.epochs * steps_per_epoch
        optimizer = build_optimizer(model, **_kwargs(cfg.optim))
        scheduler = build_scheduler(optimizer, total, **_kwargs(cfg.optim))
        train_kwargs = dict(
            device=device, batch_size=t.batch_size, epochs=t.epochs, max_steps=t.max_steps,
            warmup_steps=t.warmup_steps, precision=t.precision, channels_last=t.channels_last,
            compile=t.compile, seed=t.seed, eval_batch_size=t.eval_batch_size,
            eval_every=t.eval_every, eval_max_batches=t.eval_max_batches, log_every=t.log_every,
            progress=t.progress and sys.stderr.isatty(), account_memory=t.account_memory,
            grad_clip=t.grad_clip)
        if hasattr(method, "fit"):
            result = method.fit(model, data, optimizer, scheduler, **train_kwargs)
        else:
            result = train(model, data, optimizer, scheduler, **train_kwargs)
        summary.update(result.summary)
        metrics = result.metrics
        summary["status"] = "ok"
    except RunFailed as e:
        summary.update(e.summary)
        metrics = e.metrics
        summary.update(status=e.status, error=str(e), failed_step=e.step)
        log.warning("run ended with status=%s at step %d: %s", e.status, e.step, e)
    except ConfigError as e:
        summary.update(status="error", error=str(e))
        error = e
    except Exception as e:  # a sweep records the failure and goes on
        summary.update(status="error", error=f"{type(e).__name__}: {e}".splitlines()[0])
        log.error("run failed: %s\n%s", e, traceback.format_exc())
        error = e
    summary["wall_s"] = time.perf_counter() - t0
    summary["test_acc"] = summary.pop("test_acc", float("nan"))
    summary.setdefault("test_acc5", float("nan"))
    summary["run_dir"] = str(run_dir)
    record.write_metrics(run_dir, metrics)
    record.write_summary(run_dir, summary)
    if isinstance(error, ConfigError):
        raise error
    if error is not None:
        summary["_exception"] = error
    return summary


# ---------------------------------------------------------------- entry points


def _hydra_task(cfg: DictConfig) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    run_dir = Path(hc.runtime.output_dir)
    try:
        summary = execute(cfg, run_dir, dict(hc.runtime.choices))
    except ConfigError as e:
        if multirun:  # the row says status=error; the sweep goes on
            log.error("config error: %s", e)
            return {"status": "error", "error": str(e)}
        print(f"memtrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    exc = summary.pop("_exception", None)
    line = (f"{summary['status']}: {summary['method']} {summary['model']} {summary['dataset']} "
            f"test_acc={summary.get('test_acc', float('nan')):.4f} -> {run_dir}")
    log.info(line)
    if not multirun and summary["status"] != "ok":
        msg = summary.get("error") or (str(exc) if exc else summary["status"])
        print(f"memtrain: run ended with status={summary['status']}: {msg} (log: "
              f"{run_dir / 'memtrain.log'})", file=sys.stderr)
        sys.exit(1)
    return summary


def main() -> None:
    """Console entry point: validate group choices, then hand over to Hydra."""
    import hydra

    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    try:
        check_overrides(args)
    except ConfigError as e:
        print(f"memtrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    task = hydra.main(version_base="1.3", config_path=str(conf_dir()),
                      config_name="config")(_hydra_task)
    task()


if __name__ == "__main__":
    main()
