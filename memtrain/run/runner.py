"""The engine: one job, from a composed config (config/loader.py composes and names it) to its run
folder.

    compose -> build (data, model, method) -> probes -> prepare -> train (or method.fit) -> record

`run` always leaves summary.json (and metrics.csv) behind and returns an `Outcome`; it never
exits and never raises for a failed run. cli.py (Hydra's entry point, exit codes) and api.py
(notebooks, tests, benchmarks) both call it. This is the only module that reads the config and
instantiates objects by their `_target_`: everything below it gets plain objects and the typed
trainer options (`schema.Trainer`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

import memtrain.methods.base as base
from memtrain import record
from memtrain.config.loader import identity
from memtrain.config.schema import Trainer
from memtrain.data import Data, cast_batches, place
from memtrain.errors import ConfigError
from memtrain.memory import measure
from memtrain.methods.base import Method  # the contract: what the runner asks of a method
from memtrain.optim import build_optimizer, build_scheduler
from memtrain.preflight import build_data, build_method, check, kwargs_of, target_of, trainer_of
from memtrain.run import capacity, distributed, faults, learned, loggers, probes, provenance, resume
from memtrain.run.train import RunFailed, TrainResult, autocast_factory, param_dtype, train

log = logging.getLogger("memtrain")


# ---------------------------------------------------------------- build










def build(cfg: DictConfig, trainer: Trainer | None = None,
          meta: bool = False) -> tuple[Data, torch.nn.Module, Method]:
    """(data, model, method) from a composed config; the method already applied to the model.
    `trainer`: the config's trainer options when the caller has them already (validated).
    `meta`: the model on the meta device (make_model), for a job that never trains it."""
    torch.manual_seed((trainer or trainer_of(cfg)).seed)
    data = build_data(cfg)
    model, method = make_model(cfg, data, meta)
    return data, model, method


def make_model(cfg: DictConfig, data: Data, meta: bool = False) -> tuple[torch.nn.Module, Method]:
    """The model for `data` with the method applied, and the method. Under
    trainer.precision=bf16-true both are made with bf16 as the default dtype (Lightning's
    bf16-true does the same): every parameter and buffer is created in bf16, nothing converted
    afterwards (a conversion of tied weights cannot run on the estimate's fake tensors).
    `meta`: made on the meta device, shapes without storage or initialisation (a job of probes
    alone counts its parameters; its probes make their own models on fake tensors), or made
    as usual where the model's or method's construction needs data (an op meta cannot run)."""
    if meta:
        try:
            with torch.device("meta"):
                return make_model(cfg, data)
        except (NotImplementedError, RuntimeError) as e:
            if "meta" not in str(e):
                raise
            log.debug("model on the meta device failed (%s): made on the CPU", e)
    precision = OmegaConf.select(cfg, "trainer.precision", default="fp32")  # a bare cfg: fp32
    with default_dtype(param_dtype(str(precision))):
        try:
            model = target_of(cfg.model, "model")(num_classes=data.num_classes,
                                                  input_shape=data.input_shape,
                                                  **kwargs_of(cfg.model))
        except (RuntimeError, MemoryError) as e:  # a model too large to build names its inputs
            if "alloc" not in str(e) and not isinstance(e, MemoryError):
                raise
            shape = "x".join(map(str, data.input_shape))
            raise ConfigError(f"model={cfg.model._target_.rsplit('.', 1)[-1]} for {shape} inputs "
                              f"(dataset.image_size) and {data.num_classes} classes does not fit "
                              f"in memory: {str(e).splitlines()[0][:160]}") from None
        if data.task != getattr(model, "task", "classify"):  # an image model on tokens
            name = cfg.model._target_.rsplit(".", 1)[-1]
            raise ConfigError(f"model={name} classifies images and dataset {data.name} holds "
                              f"token sequences for language models; use model=gpt_nano, "
                              f"model=gpt2_small or model=hf, or an image dataset")
        method = build_method(cfg.method)
        return method.wrap(model), method


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None):
    """torch's default floating dtype set to `dtype` inside (None: unchanged)."""
    if dtype is None:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)




# ---------------------------------------------------------------- one job


@dataclass
class Outcome:
    """What one job left behind: the row written to summary.json and, for a failure, the
    exception behind it (a ConfigError is bad input: the CLI exits 2 with its one line)."""

    summary: dict[str, Any]
    error: Exception | None = None

    @property
    def status(self) -> str:
        return self.summary["status"]


def run(cfg: DictConfig, run_dir: Path, choices: dict[str, str],
        search_dir: Path | None = None) -> Outcome:
    """Build, train and record one run; always leaves summary.json behind.

    Every failure is a row with its status (error, oom, diverged, interrupted) and, for bad input
    or an unexpected exception, the exception in `Outcome.error`. `search_dir` is where
    `trainer.skip_done`/`trainer.resume` look for earlier runs of the same config (default: the
    run folder's parent).

    Under `trainer.strategy=ddp|fsdp` every rank of the job calls this (distributed.py): rank 0
    decides the run folder and writes the row, the other ranks write nothing but their share of
    a sharded checkpoint, and wait for the row before they return.
    """
    with contextlib.ExitStack() as ranks:
        try:
            _check_values(cfg)  # a bad value is named as such, before any launch check
            world = ranks.enter_context(distributed.session(cfg.trainer))
        except Exception as e:  # bad strategy for this launch, no process group: a row
            return _not_started(cfg, run_dir, choices, e)
        run_dir = Path(world.agree(str(run_dir)))
        if search_dir is not None:
            search_dir = Path(world.agree(str(search_dir)))
        out = _run(cfg, run_dir, choices, search_dir, world)
        distributed.finish(world)
        return out


def _check_values(cfg: DictConfig) -> None:
    """Every trainer value checked before the launch is: `trainer.strategy=dpp` under torchrun
    says what the valid strategies are, not that a single run has several ranks. A value that
    cannot be resolved is left to the run's own row (`_run`)."""
    try:
        Trainer.from_config(cfg.trainer)
    except ConfigError:
        raise
    except Exception:  # omegaconf's resolution errors: said in the row, as before
        pass


def _not_started(cfg: DictConfig, run_dir: Path, choices: dict[str, str],
                 e: Exception) -> Outcome:
    """The row of a job whose ranks could not even start (no process group: the launcher's
    rank 0 writes it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        summary = identity(cfg, choices)
    except Exception:  # an unresolvable value: the config as written
        summary = identity(cfg, choices, resolve=False)
    error = e if isinstance(e, ConfigError) else ConfigError(
        f"{type(e).__name__}: {e}".splitlines()[0])
    summary.update(status="error", error=str(error))
    rank = distributed.launched()[0]
    return _finish(run_dir, summary, [], error, distributed.World(rank=rank))


def _run(cfg: DictConfig, run_dir: Path, choices: dict[str, str], search_dir: Path | None,
         world: distributed.World) -> Outcome:
    run_dir.mkdir(parents=True, exist_ok=True)
    if world.main:
        resume.clean_partial(run_dir)
    if world.sharded and cfg.trainer.get("world_size") is None:
        # the ranks it runs on are part of what a sharded run computes: in its run_id (a
        # resume or skip_done of 2 ranks never takes a run of 4's)
        with open_dict(cfg):
            cfg.trainer.world_size = world.size
    try:
        summary = identity(cfg, choices)
    except Exception as e:  # an unresolvable interpolation (an unset ${oc.env:...}): a row
        summary = identity(cfg, choices, resolve=False)
        error = ConfigError(f"cannot resolve the config: {str(e).splitlines()[0]}")
        summary.update(status="error", error=str(error))
        return _finish(run_dir, summary, [], error, world)
    search = Path(cfg.trainer.search_dir or search_dir or run_dir.parent)
    if cfg.trainer.skip_done:
        done = _already_done(search, run_dir, summary["run_id"], world)
        if done is not None:
            return Outcome(done)
    if not (cfg.trainer.resume or cfg.trainer.skip_done) and \
            (old := _finished_row(run_dir)) is not None:
        # a second sweep into a finished sweep's folder: never overwrite a row untold (with
        # skip_done a done row was kept above, and one that failed is meant to run again)
        error = ConfigError(
            f"{run_dir} already holds a finished run (status={old['status']}); add "
            "trainer.skip_done=true to keep it, trainer.resume=true to continue it, or choose "
            "another folder")
        return Outcome(old, error)  # the CLI says it (a sweep's job: a log line; a run: exit 2)
    kept = _Kept()  # every metric row as the loop logs it: what a run that fails keeps
    metrics: list[dict] = []
    error: Exception | None = None
    lost_peer = False
    t0 = time.perf_counter()
    # the run's signals stay deferred until a failed collective run's row is written: when one
    # rank leaves, torchrun stops the others (SIGTERM), and rank 0 writes the job's row first
    with faults.StopSignals() as stop:
        with contextlib.ExitStack() as stack:
            try:
                metrics = _job(cfg, run_dir, summary, stop, stack, search, world, kept)
                summary["status"] = "ok"
            except RunFailed as e:
                summary.update(e.summary)
                metrics = e.metrics
                summary.update(status=e.status, error=str(e), failed_step=e.step)
                if e.status == "interrupted":
                    summary["signal"] = stop.requested
                log.warning("run ended with status=%s at step %d: %s", e.status, e.step, e)
            except faults.Stopped as e:  # a stop signal before the first step: nothing to save
                summary.update(status="interrupted", error=str(e), signal=e.signal)
                log.warning("run ended with status=interrupted: %s", e)
            except torch.cuda.OutOfMemoryError as e:  # outside the loop: moving the model, probes
                summary.update(status="oom", error=str(e).splitlines()[0])
                log.warning("run ended with status=oom: %s", summary["error"])
                metrics = kept.rows
            except ConfigError as e:  # bad input, also when found mid-run
                summary.update(status="error", error=str(e))
                error, metrics = e, kept.rows
            except Exception as e:  # a sweep records the failure and goes on
                summary.update(status="error", error=f"{type(e).__name__}: {e}".splitlines()[0])
                log.error("run failed: %s\n%s", e, traceback.format_exc())
                error, metrics = e, kept.rows
                lost_peer = distributed.lost_peer(e)
        summary["wall_s"] = time.perf_counter() - t0
        if summary["status"] != "ok" and world.collective:
            # another rank's process ends here (bad input: exit status 2, as rank 0's)
            distributed.failed(world, summary["status"], summary.get("error", ""),
                               summary.get("failed_step"), lost_peer=lost_peer,
                               code=2 if isinstance(error, ConfigError) else 1)
            if world.main:
                # torchrun stops every rank (SIGTERM) once one has left: rank 0 writes the
                # job's row and says why first
                stop.ignore_after(signal.SIGTERM)
                _blame(summary, distributed.root_failure(world))
            return _finish(run_dir, summary, metrics, error, world)
    return _finish(run_dir, summary, metrics, error, world)


class _Kept(loggers.Logger):
    """A logger that keeps every metric row the loop hands its loggers, as it hands them: the
    loop's own records end with an exception that is not RunFailed (a RuntimeError, a
    ConfigError found mid-run, another rank that left the group), and the row of such a run
    keeps what it logged."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def metrics(self, rows: list[dict[str, Any]]) -> None:
        self.rows += rows


def _blame(summary: dict[str, Any], root: dict[str, Any] | None) -> None:
    """Rank 0's row after a failure: the rank that failed first (distributed.root_failure:
    what rank 0 met itself may only follow from it, such as a connection another rank's exit
    closed)."""
    if root is None or (root["status"] == summary["status"] and
                        root["status"] in ("diverged", "interrupted")):
        return  # every rank ended so at the same step (agreed each step): rank 0's row
    if root["status"] == summary["status"] and root["error"] == summary.get("error"):
        return  # the same failure on every rank (bad input): the job's, no rank's
    summary["failed_rank"] = root["rank"]
    if root["rank"] != 0:
        error = f"rank {root['rank']}: {root['error']}"
        if root.get("gone"):  # it said nothing: what rank 0 met after it, for the record
            error += f"; rank 0 then met: {summary.get('error', '')}"
        summary.update(status=root["status"], error=error)
        if root.get("step") is not None:
            summary["failed_step"] = root["step"]


def task_columns(data: Data) -> dict[str, Any]:
    """What a row's quality metric is: a classifier's test accuracy (higher is better) or a
    language model's validation loss per token (lower is better), and where the data came from."""
    cols: dict[str, Any] = {"task": data.task}
    if data.task == "lm":
        cols.update(metric="test_loss", metric_higher_better=False,
                    unigram_loss=data.unigram_loss)
    else:
        cols.update(metric="test_acc", metric_higher_better=True)
    cols.update({k: v for k, v in (("data_hash", data.data_hash),
                                   ("data_source", data.data_source)) if v is not None})
    return cols


def _finished_row(run_dir: Path) -> dict[str, Any] | None:
    """The row a folder holds when its run ended (any status but running or interrupted)."""
    try:
        old = record.read_summary(run_dir)
    except (OSError, ValueError):  # no row, or an unreadable one: nothing finished to keep
        return None
    return old if old.get("status") not in (None, "running", "interrupted") else None


def _finish(run_dir: Path, summary: dict[str, Any], metrics: list[dict],
            error: Exception | None, world: distributed.World | None = None) -> Outcome:
    """Complete the row and write both records (atomically); in a job of several ranks, rank 0
    alone writes."""
    summary["test_acc"] = summary.pop("test_acc", float("nan"))
    summary.setdefault("test_acc5", float("nan"))
    summary["run_dir"] = str(run_dir)
    # the report keeps a run_id's latest row (an interrupted run resumed in another folder)
    summary["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    if world is None or world.main:
        record.write_metrics(run_dir, metrics)
        record.write_summary(run_dir, summary)
    return Outcome(summary, error)


def _already_done(search: Path, run_dir: Path, rid: str,
                  world: distributed.World) -> dict[str, Any] | None:
    """`trainer.skip_done`: the earlier ok summary of this run_id under `search`, or None."""
    done = resume.find_done(search, rid)
    if done is None:
        return None
    log.info("skipped: run_id %s already finished ok in %s (trainer.skip_done)", rid, done)
    # a marker for the closing count, not a second summary.json (a second row in the report)
    if world.main:
        record.atomic_write(run_dir / resume.SKIPPED,
                            json.dumps({"run_id": rid, "done_in": str(done)}) + "\n")
    return {**record.read_summary(done), "skipped": True}


def _job(cfg: DictConfig, run_dir: Path, summary: dict[str, Any], stop: faults.StopSignals,
         stack: contextlib.ExitStack, search: Path,
         world: distributed.World | None = None, kept: _Kept | None = None) -> list[dict]:
    """The body of one job: device, build, probes, training; fills `summary`, returns metrics
    (`kept`: a logger beside the run's own, handed every metric row as it is made)."""
    world = world or distributed.World()
    t = check(cfg)  # before the device and the memory cap use any value
    distributed.check(world, t, t.world_size)
    if t.threads:
        torch.set_num_threads(t.threads)
    device = world.device(t.device) if world.size > 1 else \
        stack.enter_context(capacity.claim_device(t.device))
    summary.update(provenance.of_run(device))
    summary.update(capacity.apply_gpu_cap(device, t.gpu_memory_gb))
    with stop.at_once("building the data, the model and the method"):
        data, model, method = build(cfg, t, meta=t.max_steps == 0)  # probes alone: no training
    summary.update(base.columns(method))  # what it declares: whether its gradients are exact
    base.check_device(method, device)  # a method that needs a device kind (offload)
    distributed.check_method(method, world)  # a method that cannot run sharded: one line
    for split in ("train", "test"):  # an empty test split would end ok with no accuracy
        if len(getattr(data, split)) == 0:
            raise ConfigError(f"dataset {data.name or cfg.dataset._target_}: the {split} split "
                              f"is empty; nothing would be measured")
    if device.type == "cuda" and t.data_on_device:
        data = place(data, device, int(t.data_on_device_max_gb * 2**30))
    data = cast_batches(data, param_dtype(t.precision))  # bf16-true: bf16 batches
    data = distributed.shard_data(data, world)  # each rank: its slice of every global batch
    summary.update({"num_classes": data.num_classes,
                    "input_shape": "x".join(map(str, data.input_shape)),
                    "params": sum(p.numel() for p in model.parameters()),
                    **task_columns(data)})
    if world.sharded or t.world_size is not None:
        summary.update(world_size=t.world_size or world.size,
                       local_batch_size=t.batch_size // (t.world_size or world.size))
    optim = kwargs_of(cfg.optim)
    with stop.at_once("running the probes"):
        summary.update(probes.run(t, data, device, lambda: make_model(cfg, data),
                                  lambda m: build_optimizer(m, **optim)))
    total_steps = t.schedule(len(data.train))[1]
    if total_steps == 0:
        log.info("trainer.max_steps=0: probes only, no training")
        return []
    ckpt = resume.Checkpointer(run_dir, summary["run_id"], t.save_every, t.resume,
                               resume.find_checkpoints(search) if t.resume else [], stop)
    planned = _prepare(method, model, data, t, device, ckpt, search,
                       OmegaConf.to_container(cfg.model, resolve=True), world)
    summary.update(planned)
    # the method in place and planned on the whole model: now the strategy's wrapper (DDP, or
    # FSDP2's shards), and the optimizer over the parameters it trains (FSDP: the shards)
    model = distributed.wrap(model, world, device)
    optimizer = build_optimizer(model, **optim)
    scheduler = build_scheduler(optimizer, total_steps, **optim)
    live = loggers.build(t, device, run_dir, tty=sys.stderr.isatty(),
                         hparams=loggers.hparams_of(summary)) if world.main else []
    if kept is not None:
        live.append(kept)
    for lg in live:
        if hasattr(lg, "close"):  # once the row is final: `run` sets its status before
            stack.callback(_close_logger, lg, summary)
    # a method that changes the training procedure (synthetic) replaces the loop
    loop = base.training_loop(method, train)
    with faults.MemorySnapshot(t.memory_snapshot and world.main, device, run_dir) as snapshot, \
            measure.TimelineRecorder(t.memory_timeline and world.main) as timeline:
        if planned.get("dry_run"):  # the method was asked for its plan only
            result = TrainResult()
        else:
            result = loop(model, data, optimizer, scheduler, trainer=t, device=device,
                          checkpointer=ckpt, loggers=live)
    summary.update(result.summary)
    summary.update(distributed.gather_memory(world, result.summary))  # rank 0: every rank's
    if (table := timeline.table()) is not None:
        summary.update(_write_timeline(timeline, table, method, model, run_dir, summary))
    if not planned.get("dry_run"):
        n_test = len(data.test) if t.eval_max_batches is None else min(
            len(data.test), t.eval_max_batches * (t.eval_batch_size or t.batch_size))
        if data.task == "lm":
            summary.update(learned.language_model(summary.get("test_loss"), data.unigram_loss))
        else:
            summary.update(learned.classifier(summary.get("test_acc"), summary.get("train_loss"),
                                              data.num_classes, n_test))
    if snapshot.enabled:
        summary["memory_snapshot"] = str(snapshot.path)
    summary.update(ckpt.columns())
    if world.main:
        ckpt.clear()
    if t.save_weights:
        resume.save_weights(model, run_dir)
    return result.metrics


def _write_timeline(recorder: measure.TimelineRecorder, table, method: Method,
                    model: torch.nn.Module, run_dir: Path, summary: dict[str, Any]
                    ) -> dict[str, Any]:
    """`trainer.memory_timeline`: the accounting step's timeline (timeline.parquet, .png,
    .pdf), the bytes each module saved (saved_by_module.csv) and the plan the method applied,
    where it has one (plan.csv: checkpoint's segments); returns the row's columns."""
    from memtrain.memory import by_module
    from memtrain.memory import timeline as timeline_file

    title = f"{summary.get('method', '')} on {summary.get('model', '')}: one training step"
    out = timeline_file.write(table, run_dir, title, source=recorder.source)
    # recorded on the accounting step: the step the memory columns measure, which trains like
    # every other step and which no timed step includes (step_time_s, throughput)
    out.update({"mem_timeline_step": "accounting", **recorder.columns})
    out.update(by_module.write_saved(recorder.saved, run_dir))
    # a method with a per-segment plan (checkpoint): plan.csv; none without rows
    out.update(by_module.write_plan(base.plan_rows(method, model), run_dir))
    return out


def _close_logger(logger: Any, summary: dict[str, Any]) -> None:
    """A live logger's `close(row)` with the run's final row (TensorBoard's hparams, W&B's
    summary); a logger that fails there is a warning, never the run's failure."""
    try:
        logger.close(summary)
    except Exception as e:  # the row is what the run leaves; a logger's end is a courtesy
        log.warning("trainer.logger: closing %s failed: %s", type(logger).__name__,
                    f"{type(e).__name__}: {e}".splitlines()[0])


def _prepare(method: Method, model: torch.nn.Module, data: Data, t: Trainer,
             device: torch.device, ckpt: resume.Checkpointer,
             search: Path | None = None, model_config: dict | None = None,
             world: distributed.World | None = None) -> dict[str, Any]:
    """`method.prepare` (optional, methods/base.py): on the run's first batch, on the run's
    device, before the first step (checkpoint profiles and plans here). Returns its summary
    columns. Its context: the sweep folder (`search`: checkpoint keeps its profile there), the
    run's model options, and (strategy, world size) of a sharded run.

    Several ranks: before the model is wrapped (no collective runs while a method profiles),
    on this rank's batch; rank 0 prepares first and every other rank then prepares with rank
    0's `carry` (the plan it chose), so that every rank runs the same plan (under FSDP the
    ranks' recomputations gather the same parameters in the same order)."""
    if not base.has(method, "prepare"):
        return {}
    world = world or distributed.World()
    model.to(device).train()
    x, y = next(iter(data.train.batches(t.batch_size, device)))
    if t.channels_last and x.ndim == 4:
        model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    ckpt.carry.update(ckpt.carried())
    if world.collective and not world.main:
        ckpt.carry.update(world.agree(None))  # rank 0's plan, kept as a resumed run keeps one
    context = base.MethodContext(
        cache_dir=search, model_config=model_config,
        sharding=base.Sharding(world.strategy, world.size) if world.sharded else None)
    out = base.prepare(method, model, x, y, autocast_factory(device.type, t.precision),
                       ckpt.carry, context)
    if world.collective and world.main:
        world.agree(dict(ckpt.carry))
    return out
