"""The training loop: one flat loop that reads top to bottom (nanoGPT's train.py is the model).

What is measured on which step (warm-up, the accounting step, timed steps) and which peak a row
reports is `measure.Measurement`'s business; the loop only marks where a step, its forward pass
and its update are. Progress goes to `loggers` as it happens; the records come back in a
`TrainResult`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memtrain.config.schema import Trainer
from memtrain.data import Data, Split
from memtrain.errors import ConfigError
from memtrain.losses import cross_entropy
from memtrain.memory import measure
from memtrain.run import distributed, resume
from memtrain.run.faults import Fault
from memtrain.run.loggers import Logger

log = logging.getLogger(__name__)

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16,  # autocast dtype
              "bf16-true": None}  # no autocast: the model itself is bf16 (param_dtype)
PARAM_DTYPES = {"bf16-true": torch.bfloat16}  # Lightning's "bf16-true": weights, activations,
# gradients and optimizer state in bf16; everything else keeps fp32 parameters


def param_dtype(precision: str) -> torch.dtype | None:
    """The dtype the model's parameters and the input batches are cast to (None: left fp32)."""
    return PARAM_DTYPES.get(precision)


def cast_input(x: torch.Tensor, precision: str) -> torch.Tensor:
    """A floating batch in the model's dtype; token ids and fp32 models unchanged. Done where
    the batch is made, before a step: the cast copy is the batch, not an activation."""
    dtype = param_dtype(precision)
    return x.to(dtype) if dtype is not None and x.is_floating_point() else x


def autocast_factory(device_type: str,
                     precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A zero-argument factory of the autocast context for `precision` (fp32: a null context);
    a factory, because an autocast context object cannot be entered twice at once."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type, dtype=dtype)


class RunFailed(Exception):
    """A run that ended early for a reason a study records: oom, diverged or interrupted."""

    def __init__(self, status: str, message: str, step: int, summary: dict, metrics: list):
        super().__init__(message)
        self.status, self.step, self.summary, self.metrics = status, step, summary, metrics


@dataclass
class TrainResult:
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # long rows: step, epoch, split...


@torch.no_grad()
def evaluate(model: nn.Module, split: Split, device: torch.device, batch_size: int,
             autocast, max_batches: int | None = None, channels_last: bool = False,
             loss_fn: Callable | None = None) -> dict[str, float]:
    """Top-1, top-5 and mean loss over a split (a language model: over every next token)."""
    was_training = model.training
    model.eval()
    n = correct1 = correct5 = 0
    loss_sum = 0.0
    for i, (x, y) in enumerate(split.batches(batch_size, device)):
        if max_batches is not None and i >= max_batches:
            break
        if channels_last and x.ndim == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast():
            out = model(x)
        out = out.float()
        loss_sum += float((loss_fn or cross_entropy)(out, y, reduction="sum"))
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)  # a language model: per token
        top = out.topk(min(5, out.shape[-1]), dim=-1).indices  # [N, 5]
        hit = top == y[:, None]
        correct1 += int(hit[:, 0].sum())
        correct5 += int(hit.any(dim=-1).sum())
        n += y.shape[0]
    model.train(was_training)
    # several ranks: each evaluated its slice of every batch; the sums are the whole split's
    n, correct1, correct5, loss_sum = distributed.reduce_sums([n, correct1, correct5, loss_sum],
                                                              device)
    if n == 0:
        return {"acc": float("nan"), "acc5": float("nan"), "loss": float("nan")}
    return {"acc": correct1 / n, "acc5": correct5 / n, "loss": loss_sum / n}


class Records:
    """A run's summary columns and metric rows; each group of rows also goes to the loggers."""

    def __init__(self, prefix: str, loggers: Sequence[Logger]):
        self.prefix, self.loggers = prefix, loggers
        self.summary: dict[str, Any] = {}
        self.metrics: list[dict[str, Any]] = []

    def add(self, step: int, epoch: int, split: str, values: dict[str, float]) -> None:
        rows = [{"step": step, "epoch": epoch, "split": split, "name": self.prefix + k,
                 "value": v} for k, v in values.items()]
        self.metrics += rows
        for lg in self.loggers:
            lg.metrics(rows)

    def restore(self, rows: list[dict[str, Any]]) -> None:
        """Rows of a resumed run's earlier steps: kept, and handed to the loggers again (a live
        metrics.csv in a new folder holds the whole run)."""
        self.metrics += rows
        for lg in self.loggers:
            lg.metrics(rows)

    def failed(self, status: str, message: str, step: int) -> RunFailed:
        return RunFailed(status, message, step, self.summary, self.metrics)


def train(model: nn.Module, data: Data, optimizer: torch.optim.Optimizer,
          scheduler: torch.optim.lr_scheduler.LRScheduler | None, *, trainer: Trainer,
          device: torch.device, checkpointer: resume.Checkpointer | None = None,
          loggers: Sequence[Logger] = (), loss_fn: Callable | None = None,
          evaluate_fn: Callable[..., dict[str, float]] | None = None,
          metric_prefix: str = "", eval_name: str = "test_acc",
          resident: Sequence[nn.Module] = ()) -> TrainResult:
    """Train `model` on `data.train` as `trainer` says, evaluating on `data.test`.

    `loss_fn(output, y)` defaults to cross-entropy; methods that train on other targets (the
    synthetic-label partitions) pass their own and an `evaluate_fn` of `evaluate`'s signature;
    `metric_prefix` namespaces the metric names of such sub-runs; `eval_name` is what the log
    line calls the evaluation's accuracy (a sub-run graded on its own targets is not test_acc);
    `resident`: modules whose tensors stay beside `model` (synthetic: the whole partitioned
    model), counted in the accounting step's peak; `checkpointer` saves resumable state at step
    boundaries. Raises RunFailed (oom, diverged, interrupted) with the records so far.
    """
    t, loss_fn, evaluate_fn = trainer, loss_fn or cross_entropy, evaluate_fn or evaluate
    steps_per_epoch, total_steps, epochs = _schedule(t, len(data.train))
    autocast = autocast_factory(device.type, t.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    fwd, shuffle_gen = _ready(model, t, device)
    update = functools.partial(_update, model, optimizer, scheduler, scaler, t.grad_clip)
    fault = _fault(t)

    rec, t_start = Records(metric_prefix, loggers), time.perf_counter()
    meas = measure.Measurement(device, total_steps, t.warmup_steps, t.account_memory, rec.summary,
                               resident, metric_prefix.rstrip("."), distributed.settle_steps(model))
    step, start_epoch, loss_val = _resume(checkpointer, metric_prefix, model, optimizer,
                                          scheduler, scaler, shuffle_gen, rec, meas)
    replay = step - start_epoch * steps_per_epoch  # resumed: skip the epoch's batches done
    evaluated_at = -1

    def run_eval(at: int, epoch: int) -> None:
        nonlocal evaluated_at
        res = evaluate_fn(model, data.test, device, t.eval_batch_size or t.batch_size, autocast,
                          t.eval_max_batches, t.channels_last)
        rec.add(at, epoch, "test", res)
        rec.summary.update({f"test_{k}": v for k, v in res.items()})
        log.info("%sepoch %d step %d train_loss %.4f %s", metric_prefix, epoch, at, loss_val,
                 _quality(res, data.task, eval_name))
        evaluated_at = at

    for lg in loggers:
        lg.start(total_steps, metric_prefix)
    try:
        for epoch in range(start_epoch, epochs):
            epoch_shuffle = shuffle_gen.get_state()
            batches = data.train.batches(t.batch_size, device, shuffle=True,
                                         generator=shuffle_gen, drop_last=True)
            batches, replay = itertools.islice(batches, replay, None), 0
            for x, y in batches:
                if step >= total_steps:
                    break
                x = _layout(x, t.channels_last)
                # ---- one training step: forward, backward, update
                with meas.step(step, model, optimizer, x, y):
                    with meas.forward(), autocast():
                        out = fwd(x)  # [B, num_classes]
                        loss = loss_fn(out, y)
                        if fault is not None:
                            loss = fault.inject(step, loss)
                    scaler.scale(loss).backward()
                    update(meas)
                loss_val = distributed.reduce_step(loss, checkpointer)  # several ranks: agreed
                # nothing of this step outlives it: a tensor of it freed in the next step would
                # be memory the next step's allocator count did not see allocated
                del out, loss
                if not math.isfinite(loss_val):
                    raise rec.failed("diverged", f"loss became {loss_val} at step {step}", step)
                if step % t.log_every == 0 or step == total_steps - 1:
                    rec.add(step, epoch, "train", {"loss": loss_val, "lr": optimizer.param_groups[
                        0]["lr"], **meas.series(t.batch_size)})  # + memory and samples/s
                step += 1
                for lg in loggers:
                    lg.step(step, epoch, loss_val, meas.samples_s(t.batch_size), meas.memory_now)
                if t.eval_every_steps and step % t.eval_every_steps == 0 and step < total_steps:
                    with meas.outside_window():  # the last step's evaluation is the epoch end's
                        run_eval(step, epoch)
                if checkpointer is not None:
                    _save_point(checkpointer, metric_prefix, rec, meas, step, epoch,
                                epoch_shuffle, loss_val, model, optimizer, scheduler, scaler)
            # ---- end of epoch: evaluation (outside the peak window)
            last = step >= total_steps or epoch == epochs - 1
            due = last or (t.eval_every and (epoch + 1) % t.eval_every == 0)
            if due and evaluated_at != step:  # not twice at one step (eval_every_steps)
                with meas.outside_window():
                    run_eval(step, epoch)
            if step >= total_steps:
                break
    except torch.cuda.OutOfMemoryError as e:
        rec.summary.update(meas.at_oom())
        raise rec.failed("oom", str(e).splitlines()[0], step) from e
    finally:
        for lg in loggers:
            lg.end()

    rec.summary.update(_end_columns(meas, t.batch_size, loss_val, step, epochs, t_start))
    return TrainResult(rec.summary, rec.metrics)


def _layout(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """An image batch in channels-last memory format when the trainer asks for it."""
    if channels_last and x.ndim == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x


def _fault(t: Trainer) -> Fault | None:
    """`trainer.fault` on this rank (`trainer.fault_rank`: one rank of several; null: all)."""
    world = distributed.World.active
    if not t.fault or t.fault_rank not in (None, world.rank if world else 0):
        return None
    return Fault(t.fault, t.fault_step)


def _quality(res: dict[str, float], task: str, eval_name: str) -> str:
    """An evaluation in a log line: a language model's loss per token and perplexity, or the
    accuracy under the name of what it measures."""
    if task == "lm":
        return f"val_loss {res['loss']:.4f} ppl {math.exp(min(res['loss'], 700)):.2f}"
    return f"{eval_name} {res.get('acc', float('nan')):.4f}"


def _end_columns(meas: measure.Measurement, batch_size: int, loss_val: float, step: int,
                 epochs: int, t_start: float) -> dict[str, Any]:
    """A finished run's columns: timing, the last loss and counts, then the memory figures."""
    return {**meas.timing(batch_size), "train_loss": loss_val, "steps": step,
            "warmup_steps_used": meas.warmup, "epochs_done": epochs,
            "train_time_s": time.perf_counter() - t_start,
            "mem_peak_rss_bytes": measure.peak_rss_bytes(), **meas.memory()}


def _schedule(t: Trainer, n_train: int) -> tuple[int, int, int]:
    """(steps per epoch, total steps, epochs) of a run over `n_train` samples."""
    steps_per_epoch, total_steps = t.schedule(n_train)
    if steps_per_epoch == 0:
        raise ConfigError(f"trainer.batch_size={t.batch_size} is larger than the training split "
                          f"({n_train} samples); lower it or use a larger dataset")
    return steps_per_epoch, total_steps, math.ceil(total_steps / steps_per_epoch)


def _ready(model: nn.Module, t: Trainer, device: torch.device) -> tuple[Callable, torch.Generator]:
    """Seed, place and lay out the model; (what runs the forward pass, the shuffle generator)."""
    torch.manual_seed(t.seed)
    shuffle_gen = torch.Generator().manual_seed(t.seed)
    model.to(device)
    if t.channels_last:
        model.to(memory_format=torch.channels_last)
    fwd = torch.compile(model) if t.compile else model
    model.train()
    return fwd, shuffle_gen


def _update(model: nn.Module, optimizer, scheduler, scaler, grad_clip: float,
            meas: measure.Measurement) -> None:
    """The update after backward: clip, optimizer step (through the fp16 scaler), zero grads."""
    meas.updating()
    if grad_clip:
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    meas.update_done(model)
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()


def _save_point(checkpointer: resume.Checkpointer, prefix: str, rec: Records,
                meas: measure.Measurement, step: int, epoch: int, epoch_shuffle: torch.Tensor,
                loss_val: float, model, optimizer, scheduler, scaler) -> None:
    """A step boundary: save resumable state when due; a stop signal ends the run here."""
    snapshot = functools.partial(  # built only when a save is due
        resume.capture, model, optimizer, scheduler, scaler, step=step, epoch=epoch,
        epoch_shuffle=epoch_shuffle,
        extra={"summary": rec.summary, "metrics": rec.metrics, **meas.state(), "loss": loss_val})
    if stop := checkpointer.step_done(step, snapshot, prefix):
        raise rec.failed("interrupted", f"stopped by {stop} after {step} steps; "
                         "continue with trainer.resume=true", step)


def _resume(checkpointer: resume.Checkpointer | None, prefix: str, model, optimizer, scheduler,
            scaler, shuffle_gen, rec: Records,
            meas: measure.Measurement) -> tuple[int, int, float]:
    """Where the run starts: (step, epoch, last loss), from the saved state when there is one
    (loaded into the run: continue bit for bit), else (0, 0, nan). A warning about the
    checkpoint goes on the row (a failed run's too)."""
    state = checkpointer.load(prefix) if checkpointer is not None else None
    if checkpointer is not None and checkpointer.warning:
        rec.summary["resume_warning"] = checkpointer.warning
    if state is None:
        return 0, 0, float("nan")
    return _restore(state, model, optimizer, scheduler, scaler, shuffle_gen, rec, meas)


def _restore(state: dict, model, optimizer, scheduler, scaler, shuffle_gen, rec: Records,
             meas: measure.Measurement) -> tuple[int, int, float]:
    """Load a checkpoint's training state and records; returns (step, epoch, last loss)."""
    extra = resume.restore(state, model, optimizer, scheduler, scaler, shuffle_gen)
    rec.summary.update(extra["summary"])
    rec.restore(extra["metrics"])
    meas.restore(extra)
    rec.summary["resumed_at_step"] = state["step"]
    return state["step"], state["epoch"], extra["loss"]
