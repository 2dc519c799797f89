"""The `memtrain` command: the only place that reads the config and instantiates objects.

config -> data, model -> method.wrap(model) -> optimizer -> train (or method.fit) -> records.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from memtrain import capacity, estimate, faults, measure, record, resume, schema
from memtrain.errors import ConfigError, check_choice, check_range

log = logging.getLogger("memtrain")

GROUPS = ("dataset", "model", "method", "optim", "trainer", "experiment")


def _gpu_count(default: int = 0) -> int:
    """`${memtrain_gpus:N}` in conf/hydra/launcher/*.yaml: the CUDA devices here, or N."""
    return torch.cuda.device_count() or int(default)


OmegaConf.register_new_resolver("memtrain_gpus", _gpu_count, replace=True)


def _job_run_id(*, _root_: DictConfig) -> str:
    """`${memtrain_run_id:}` in hydra.sweep.subdir: job folders named by what they run, so two
    sweeps (or a relaunch with other values) in one folder never share a job folder. A value
    that cannot be resolved (an unset `${oc.env:...}`) hashes as written: that job still gets a
    folder, and its row says what is missing."""
    try:
        return run_id(_root_)
    except Exception:  # omegaconf's resolution errors have no common public base
        return run_id(_root_, resolve=False)


OmegaConf.register_new_resolver("memtrain_run_id", _job_run_id, replace=True)


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
    """Reject bad overrides before Hydra does, with a one-line message: unknown groups, options
    and keys (did-you-mean), wrong types, bad syntax (memtrain/validate.py)."""
    from memtrain import validate

    validate.check(overrides, conf_dir(), group_options)


def check_trainer(t: DictConfig) -> None:
    check_range("trainer.batch_size", t.batch_size, 1)
    if t.eval_batch_size is not None:
        check_range("trainer.eval_batch_size", t.eval_batch_size, 1)
    check_range("trainer.epochs", t.epochs, 1)
    if t.max_steps is not None:  # 0: probes only
        check_range("trainer.max_steps", t.max_steps, 0)
    if t.max_steps == 0 and not (t.estimate or t.find_max_batch):
        raise ConfigError("trainer.max_steps=0 runs the probes only, and none is asked: set "
                          "trainer.estimate=true or trainer.find_max_batch=true, or "
                          "trainer.max_steps >= 1")
    check_range("trainer.warmup_steps", t.warmup_steps, 0)
    from memtrain.train import PRECISIONS

    check_choice("trainer.precision", t.precision, tuple(PRECISIONS))
    check_range("trainer.log_every", t.log_every, 1)
    check_range("trainer.eval_every", t.eval_every, 0)
    dev = str(t.device)
    if dev not in ("auto", "cpu") and not dev.startswith("cuda"):
        raise ConfigError(f"trainer.device must be auto, cpu, cuda or cuda:N, got {dev!r}")
    for name in ("eval_max_batches", "threads"):
        if t[name] is not None:
            check_range(f"trainer.{name}", t[name], 1)
    if t.grad_clip is not None:
        check_range("trainer.grad_clip", t.grad_clip, 0, None, lo_open=True)
    check_range("trainer.save_every", t.save_every, 0)
    faults.Fault.from_options(t.fault, t.fault_step)
    if t.gpu_memory_gb is not None:
        check_range("trainer.gpu_memory_gb", t.gpu_memory_gb, 0, None, lo_open=True)
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
    schema.check_config(cfg, GROUPS)
    check_trainer(cfg.trainer)
    torch.manual_seed(cfg.trainer.seed)
    data = _target(cfg.dataset)(**_kwargs(cfg.dataset))
    model, method = _make_model(cfg, data, with_method=True)
    return data, model, method


def _make_model(cfg: DictConfig, data, with_method: bool = False):
    """The model with the method applied (and the method, when asked)."""
    model = _target(cfg.model)(num_classes=data.num_classes, input_shape=data.input_shape,
                               **_kwargs(cfg.model))
    method = _target(cfg.method)(**_kwargs(cfg.method))
    model = method.wrap(model)
    return (model, method) if with_method else model


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


# How a run is driven, not what it computes: left out of run_id (record.DRIVING_OPTIONS).
NOT_IN_RUN_ID = record.DRIVING_OPTIONS


def run_id(cfg: DictConfig, resolve: bool = True) -> str:
    """A hash of the resolved config (hydra's own settings and NOT_IN_RUN_ID excluded): same
    config, same id."""
    # key by key: resolving `hydra` here would recurse when its sweep subdir names the run_id
    c = {k: OmegaConf.to_container(cfg[k], resolve=resolve) if OmegaConf.is_config(cfg[k])
         else cfg[k] for k in cfg if k != "hydra"}
    for k in NOT_IN_RUN_ID:
        c.get("trainer", {}).pop(k, None)
    blob = json.dumps(c, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def identity(cfg: DictConfig, choices: dict[str, str], resolve: bool = True) -> dict[str, Any]:
    """The columns that say what a run is: choices, run_id and every option flattened
    (`resolve=False`: as written, for a config whose interpolations cannot be resolved)."""
    row: dict[str, Any] = {
        "run_id": run_id(cfg, resolve),
        "status": "running",
        "method": choices.get("method", ""),
        "model": choices.get("model", ""),
        "dataset": choices.get("dataset", ""),
        "optim": choices.get("optim", ""),
        "trainer": choices.get("trainer", ""),
        "experiment": choices.get("experiment") or "",
    }
    c = OmegaConf.to_container(cfg, resolve=resolve)
    for group in ("method", "trainer", "dataset", "model", "optim"):
        row.update(_flatten(group, c.get(group, {})))
    return row


# ---------------------------------------------------------------- one job


def execute(cfg: DictConfig, run_dir: Path, choices: dict[str, str],
            search_dir: Path | None = None) -> dict[str, Any]:
    """Build, train and record one run; always leaves summary.json behind.

    Returns the summary. A ConfigError is re-raised after the row is written, so a single run
    can exit with the message; every other failure is a row with its status (oom, diverged,
    interrupted, error). `search_dir` is where `trainer.skip_done`/`trainer.resume` look for
    earlier runs of the same config (default: the run folder's parent).
    """
    from memtrain.train import RunFailed

    run_dir.mkdir(parents=True, exist_ok=True)
    resume.clean_partial(run_dir)
    try:
        summary = identity(cfg, choices)
    except Exception as e:  # an unresolvable interpolation (an unset ${oc.env:...}): a row
        summary = identity(cfg, choices, resolve=False)
        return _failed_early(run_dir, summary, ConfigError(
            f"cannot resolve the config: {str(e).splitlines()[0]}"))
    search = Path(cfg.trainer.search_dir or search_dir or run_dir.parent)
    if cfg.trainer.skip_done:
        done = _already_done(search, run_dir, summary["run_id"])
        if done is not None:
            return done
    metrics: list[dict] = []
    t0 = time.perf_counter()
    error: BaseException | None = None
    with faults.StopSignals() as stop, contextlib.ExitStack() as stack:
        try:
            metrics = _run(cfg, run_dir, summary, stop, stack, search)
            summary["status"] = "ok"
        except RunFailed as e:
            summary.update(e.summary)
            metrics = e.metrics
            summary.update(status=e.status, error=str(e), failed_step=e.step)
            if e.status == "interrupted":
                summary["signal"] = stop.requested
            log.warning("run ended with status=%s at step %d: %s", e.status, e.step, e)
        except torch.cuda.OutOfMemoryError as e:  # outside the loop: moving the model, a probe
            summary.update(status="oom", error=str(e).splitlines()[0])
            log.warning("run ended with status=oom: %s", summary["error"])
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
    # the report keeps a run_id's latest row (an interrupted run resumed in another folder)
    summary["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    record.write_metrics(run_dir, metrics)
    record.write_summary(run_dir, summary)
    if isinstance(error, ConfigError):
        raise error
    if error is not None:
        summary["_exception"] = error
    return summary


def _failed_early(run_dir: Path, summary: dict[str, Any], error: ConfigError) -> dict:
    """Record a job that could not start (status=error) and re-raise its one-line error."""
    summary.update(status="error", error=str(error), test_acc=float("nan"),
                   test_acc5=float("nan"), run_dir=str(run_dir))
    record.write_metrics(run_dir, [])
    record.write_summary(run_dir, summary)
    raise error


def _already_done(search: Path, run_dir: Path, rid: str) -> dict[str, Any] | None:
    """`trainer.skip_done`: the earlier ok summary of this run_id under `search`, or None."""
    done = resume.find_done(search, rid)
    if done is None:
        return None
    log.info("skipped: run_id %s already finished ok in %s (trainer.skip_done)", rid, done)
    # a marker for the closing count, not a second summary.json (a second row in the report)
    record.atomic_write(run_dir / resume.SKIPPED,
                        json.dumps({"run_id": rid, "done_in": str(done)}) + "\n")
    return {**record.read_summary(done), "skipped": True}


def _run(cfg: DictConfig, run_dir: Path, summary: dict[str, Any], stop: faults.StopSignals,
         stack: contextlib.ExitStack, search: Path) -> list[dict]:
    """The body of one job: device, build, probes, training; fills `summary`, returns metrics."""
    from memtrain.optim import build_optimizer, build_scheduler
    from memtrain.train import train

    t = cfg.trainer
    schema.check_config(cfg, GROUPS)  # before the device and the memory cap use any value
    check_trainer(t)
    if t.threads:
        torch.set_num_threads(int(t.threads))
    device = stack.enter_context(capacity.claim_device(str(t.device)))
    summary.update(measure.provenance(device))
    summary.update(capacity.apply_gpu_cap(device, t.gpu_memory_gb))
    data, model, method = build(cfg)
    for split in ("train", "test"):  # an empty test split would end ok with no accuracy
        if len(getattr(data, split)) == 0:
            raise ConfigError(f"dataset {data.name or cfg.dataset._target_}: the {split} split "
                              f"is empty; nothing would be measured")
    if device.type == "cuda" and t.data_on_device:
        from memtrain.data import place

        data = place(data, device, int(t.data_on_device_max_gb * 2**30))
    summary.update({"num_classes": data.num_classes,
                    "input_shape": "x".join(map(str, data.input_shape)),
                    "params": sum(p.numel() for p in model.parameters())})
    steps_per_epoch = max(1, len(data.train) // t.batch_size)
    total = t.max_steps if t.max_steps is not None else t.epochs * steps_per_epoch
    summary.update(_probes(cfg, data, device))
    if total == 0:
        log.info("trainer.max_steps=0: probes only, no training")
        return []
    optimizer = build_optimizer(model, **_kwargs(cfg.optim))
    scheduler = build_scheduler(optimizer, total, **_kwargs(cfg.optim))
    ckpt = resume.Checkpointer(run_dir, summary["run_id"], t.save_every, t.resume,
                               resume.find_checkpoints(search) if t.resume else [], stop)
    train_kwargs = dict(
        device=device, batch_size=t.batch_size, epochs=t.epochs, max_steps=t.max_steps,
        warmup_steps=t.warmup_steps, precision=t.precision, channels_last=t.channels_last,
        compile=t.compile, seed=t.seed, eval_batch_size=t.eval_batch_size,
        eval_every=t.eval_every, eval_max_batches=t.eval_max_batches, log_every=t.log_every,
        progress=t.progress and sys.stderr.isatty(), account_memory=t.account_memory,
        grad_clip=t.grad_clip, fault=faults.Fault.from_options(t.fault, t.fault_step),
        checkpointer=ckpt)
    with faults.MemorySnapshot(t.memory_snapshot, device, run_dir) as snapshot:
        if hasattr(method, "fit"):
            result = method.fit(model, data, optimizer, scheduler, **train_kwargs)
        else:
            result = train(model, data, optimizer, scheduler, **train_kwargs)
    summary.update(result.summary)
    if snapshot.enabled:
        summary["memory_snapshot"] = str(snapshot.path)
    if ckpt.resumed_from is not None:
        summary["resumed_from"] = str(ckpt.resumed_from)
    if ckpt.warning is not None:
        summary["resume_warning"] = ckpt.warning
    ckpt.clear()
    if t.save_weights:
        resume.save_weights(model, run_dir)
    return result.metrics


def _probes(cfg: DictConfig, data, device: torch.device) -> dict[str, Any]:
    """`trainer.estimate` and `trainer.find_max_batch`: fresh models, never the run's own."""
    from memtrain.optim import build_optimizer

    t, out = cfg.trainer, {}
    if not (t.estimate or t.find_max_batch):
        return out
    make_model = lambda: _make_model(cfg, data)
    make_opt = lambda m: build_optimizer(m, **_kwargs(cfg.optim))
    est_dev = estimate.estimate_device(device)

    def predict(b: int) -> dict[str, Any]:
        return estimate.estimate_peak(make_model, make_opt, data.input_shape, data.num_classes,
                                      b, t.precision, est_dev)

    if t.estimate:
        try:
            out.update(predict(t.batch_size))
            log.info("estimated peak %.3f GiB (activations %.3f GiB)",
                     out["mem_estimate_bytes"] / 2**30, out["mem_estimate_act_bytes"] / 2**30)
        except Exception as e:  # a kernel without a fake implementation: say so, train anyway
            out["mem_estimate_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            log.warning("trainer.estimate failed: %s", out["mem_estimate_error"])
    if t.find_max_batch:
        out["max_batch_size"] = _find_max_batch(cfg, data, device, make_model, make_opt, predict)
    return out


def _find_max_batch(cfg, data, device, make_model, make_opt, predict) -> int:
    t = cfg.trainer
    if device.type == "cuda":
        def make_step(b: int):
            model = make_model().to(device)
            opt = make_opt(model)
            x, y = estimate.random_batch(b, data.input_shape, data.num_classes, device)
            return lambda: estimate.training_step(model, opt, x, y, t.precision)

        fits = capacity.cuda_fits(make_step, device)
    else:
        if t.gpu_memory_gb is None:
            raise ConfigError("trainer.find_max_batch on the CPU compares the estimate with a "
                              "cap: set trainer.gpu_memory_gb")
        fits = capacity.estimate_fits(lambda b: predict(b)["mem_estimate_bytes"],
                                      int(t.gpu_memory_gb * capacity.GiB))
    best = capacity.find_max_batch(fits, limit=len(data.train), start=t.batch_size)
    log.info("find_max_batch: largest batch that fits: %d", best)
    return best


# ---------------------------------------------------------------- entry points


def _hydra_task(cfg: DictConfig) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    # a launcher's worker process (joblib, submitit): an interrupted job is a row, not an exit
    # that would take the worker pool and its sibling jobs down; the main process ends the sweep
    worker = multirun and faults.SweepStop.install_worker()
    run_dir = Path(hc.runtime.output_dir)
    search = Path(hc.sweep.dir) if multirun else None
    try:
        summary = execute(cfg, run_dir, dict(hc.runtime.choices), search)
    except ConfigError as e:
        if hc.verbose:
            traceback.print_exc()
        if multirun:  # the row says status=error; the sweep goes on
            log.error("config error: %s", e)
            return {"status": "error", "error": str(e)}
        print(f"memtrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    exc = summary.pop("_exception", None)
    status = summary["status"]
    line = (f"{'skipped (done) ' if summary.get('skipped') else ''}{status}: {summary['method']} "
            f"{summary['model']} {summary['dataset']} "
            f"test_acc={summary.get('test_acc', float('nan')):.4f} -> {run_dir}")
    log.info(line)
    if status == "interrupted" and not worker:  # the user or the cluster wants it to stop
        print(f"memtrain: interrupted ({summary.get('error')}); checkpoint saved in {run_dir}; "
              f"continue with: {_resume_command(hc, multirun, run_dir)}", file=sys.stderr)
        sys.exit(128 + (2 if summary.get("signal") == "SIGINT" else 15))
    if not multirun and status != "ok":
        msg = summary.get("error") or (str(exc) if exc else status)
        print(f"memtrain: run ended with status={status}: {msg} (log: "
              f"{run_dir / 'memtrain.log'})", file=sys.stderr)
        sys.exit(1)
    return summary


def _resume_command(hc, multirun: bool, run_dir: Path) -> str:
    """The command that continues this run (or, for a multirun, the whole sweep)."""
    from memtrain.hydra_callbacks import continue_command

    if multirun:  # the sweep's own overrides (multirun.yaml), not this job's values
        saved = Path(hc.sweep.dir) / "multirun.yaml"
        over = OmegaConf.load(saved).hydra.overrides if saved.is_file() else hc.overrides
        return continue_command(over, hc.sweep.dir)
    return continue_command(hc.overrides, run_dir=run_dir)


def main() -> None:
    """Console entry point: validate group choices, then hand over to Hydra."""
    import hydra

    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    if {"-m", "--multirun"} & set(sys.argv[1:]):  # SIGTERM stops every job, leaving rows
        faults.SweepStop.install_main()
        from hydra_plugins import memtrain_launcher

        memtrain_launcher.register()  # hydra/launcher=slurm, local
    try:
        check_overrides(args)
    except ConfigError as e:
        if any(a.startswith("hydra.verbose=") and not a.endswith("=false") for a in args):
            traceback.print_exc()
        print(f"memtrain: error: {e}", file=sys.stderr)
        sys.exit(2)
    task = hydra.main(version_base="1.3", config_path=str(conf_dir()),
                      config_name="config")(_hydra_task)
    task()


if __name__ == "__main__":
    main()
