"""The training loop: one flat loop that reads top to bottom (nanoGPT's train.py is the model).

Step 0 .. warmup_steps-1 warm up (excluded from every figure). The next step is the accounting
step (unless account_memory is off): saved-activation bytes and the live-tensor peak are taken on
it (it trains like any other step). Every later step is timed, and the CUDA peak is the maximum
over those steps (evaluation excluded).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memtrain import measure, resume
from memtrain.data import Data, Split
from memtrain.errors import ConfigError
from memtrain.faults import Fault

log = logging.getLogger(__name__)

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


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
    step_times: list[float] = field(default_factory=list)  # seconds, timed steps only


@torch.no_grad()
def evaluate(model: nn.Module, split: Split, device: torch.device, batch_size: int,
             autocast, max_batches: int | None = None, channels_last: bool = False,
             loss_fn: Callable | None = None) -> dict[str, float]:
    """Top-1, top-5 and mean loss over a split."""
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
        loss_sum += float((loss_fn or F.cross_entropy)(out, y, reduction="sum"))
        top = out.topk(min(5, out.shape[-1]), dim=-1).indices  # [B, 5]
        hit = top == y[:, None]
        correct1 += int(hit[:, 0].sum())
        correct5 += int(hit.any(dim=-1).sum())
        n += y.shape[0]
    model.train(was_training)
    if n == 0:
        return {"acc": float("nan"), "acc5": float("nan"), "loss": float("nan")}
    return {"acc": correct1 / n, "acc5": correct5 / n, "loss": loss_sum / n}


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, dynamic_ncols=True, leave=False, unit="step")


def _mem_now(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f}G"
    return f"{measure.peak_rss_bytes() / 2**30:.2f}G rss"


def train(
    model: nn.Module,
    data: Data,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    *,
    device: torch.device,
    batch_size: int,
    epochs: int = 1,
    max_steps: int | None = None,
    warmup_steps: int = 5,
    precision: str = "fp32",
    channels_last: bool = False,
    compile: bool = False,
    seed: int = 0,
    eval_batch_size: int | None = None,
    eval_every: int = 1,
    eval_max_batches: int | None = None,
    log_every: int = 50,
    progress: bool = True,
    account_memory: bool = True,
    grad_clip: float | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    evaluate_fn: Callable[..., dict[str, float]] | None = None,
    metric_prefix: str = "",
    fault: Fault | None = None,
    checkpointer: resume.Checkpointer | None = None,
) -> TrainResult:
    """Train `model` on `data.train`, evaluating on `data.test`; returns summary and metrics.

    `loss_fn(output, y)` defaults to cross-entropy; methods that train on other targets (the
    synthetic-label partitions) pass their own and an `evaluate_fn` of the same signature as
    `evaluate`. `metric_prefix` namespaces the metric names of such sub-runs. `fault` injects a
    failure (a testing aid); `checkpointer` saves resumable state at step boundaries (on a stop
    signal, every N steps) and, when resuming, hands back the state to continue from.
    """
    loss_fn = loss_fn or F.cross_entropy
    evaluate_fn = evaluate_fn or evaluate
    steps_per_epoch = len(data.train) // batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"trainer.batch_size={batch_size} is larger than the training split "
                          f"({len(data.train)} samples); lower it or use a larger dataset")
    total_steps = max_steps if max_steps is not None else epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    # Short runs shrink the warm-up so that at least one step is accounted and one is timed.
    warmup_steps = min(warmup_steps, max(0, total_steps - 2))
    account_step = warmup_steps
    autocast = autocast_factory(device.type, precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    torch.manual_seed(seed)
    shuffle_gen = torch.Generator().manual_seed(seed)
    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    fwd = torch.compile(model) if compile else model
    model.train()

    timer = measure.StepTimer(device)
    summary: dict[str, Any] = {}
    metrics: list[dict[str, Any]] = []
    peak_cuda = {"mem_peak_alloc_bytes": 0, "mem_peak_reserved_bytes": 0}
    bar = _progress(total_steps, progress)
    step, t_start, loss_val = 0, time.perf_counter(), float("nan")
    start_epoch, replay = 0, 0
    state = checkpointer.load(metric_prefix) if checkpointer is not None else None
    if checkpointer is not None and checkpointer.warning:  # also on the row of a failed run
        summary["resume_warning"] = checkpointer.warning
    if state is not None:  # continue bit for bit: replay the epoch's batches up to the step
        extra = resume.restore(state, model, optimizer, scheduler, scaler, shuffle_gen)
        step, start_epoch = state["step"], state["epoch"]
        replay = step - start_epoch * steps_per_epoch
        summary.update(extra["summary"])
        metrics.extend(extra["metrics"])
        timer.times.extend(extra["times"])
        peak_cuda.update(extra["peak_cuda"])
        loss_val = extra["loss"]
        summary["resumed_at_step"] = step

    def record(split: str, name: str, value: float, epoch: int) -> None:
        metrics.append({"step": step, "epoch": epoch, "split": split,
                        "name": metric_prefix + name, "value": value})

    try:
        for epoch in range(start_epoch, epochs):
            epoch_shuffle = shuffle_gen.get_state()
            batches = data.train.batches(batch_size, device, shuffle=True,
                                         generator=shuffle_gen, drop_last=True)
            batches, replay = itertools.islice(batches, replay, None), 0
            for x, y in batches:
                if step >= total_steps:
                    break
                if channels_last and x.ndim == 4:
                    x = x.contiguous(memory_format=torch.channels_last)
                accounting = account_memory and step == account_step
                saved = measure.SavedBytes(measure.alive_before_step(model, x, y)) \
                    if accounting else None
                tracker = measure.PeakTracker(model, optimizer, x, y) if accounting else None
                timed = step >= warmup_steps and not accounting
                if timed:
                    timer.start()
                # ---- one training step: forward, backward, update
                with measure.maybe(tracker, accounting):
                    with measure.maybe(saved, accounting), autocast():
                        out = fwd(x)  # [B, num_classes]
                        loss = loss_fn(out, y)
                        if fault is not None:
                            loss = fault.inject(step, loss)
                    scaler.scale(loss).backward()
                    if grad_clip:
                        scaler.unscale_(optimizer)
                        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                    scaler.step(optimizer)
                    scaler.update()
                    if accounting:  # grads as they stand at the end of backward
                        summary["mem_grads_bytes"] = measure.tensor_bytes(
                            p.grad for p in model.parameters() if p.grad is not None)
                    optimizer.zero_grad(set_to_none=True)
                if scheduler is not None:
                    scheduler.step()
                if timed:
                    timer.stop()
                del out
                loss_val = float(loss.detach())
                if not math.isfinite(loss_val):
                    raise RunFailed("diverged", f"loss became {loss_val} at step {step}", step,
                                    summary, metrics)
                if accounting:
                    summary.update(_accounting(saved, tracker, model, optimizer))
                if step == account_step:
                    measure.reset_cuda_peak(device)
                if step % log_every == 0 or step == total_steps - 1:
                    record("train", "loss", loss_val, epoch)
                    record("train", "lr", optimizer.param_groups[0]["lr"], epoch)
                step += 1
                if checkpointer is not None:
                    snapshot = functools.partial(  # built only when a save is due
                        resume.capture, model, optimizer, scheduler, scaler, step=step, epoch=epoch,
                        epoch_shuffle=epoch_shuffle,
                        extra={"summary": summary, "metrics": metrics, "times": timer.times,
                               "peak_cuda": peak_cuda, "loss": loss_val})
                    stop = checkpointer.step_done(step, snapshot, metric_prefix)
                    if stop:
                        raise RunFailed("interrupted", f"stopped by {stop} after {step} steps; "
                                        "continue with trainer.resume=true", step, summary,
                                        metrics)
                if bar is not None:
                    sps = batch_size / timer.times[-1] if timer.times else float("nan")
                    bar.set_postfix_str(f"ep {epoch} loss {loss_val:.3f} {sps:.0f}/s "
                                        f"mem {_mem_now(device)}", refresh=False)
                    bar.update()
            # ---- end of epoch: evaluation (outside the peak window)
            if device.type == "cuda":
                for k, v in measure.cuda_peak(device).items():
                    peak_cuda[k] = max(peak_cuda[k], v)
            last = step >= total_steps or epoch == epochs - 1
            if last or (eval_every and (epoch + 1) % eval_every == 0):
                res = evaluate_fn(model, data.test, device, eval_batch_size or batch_size,
                                  autocast, eval_max_batches, channels_last)
                for k, v in res.items():
                    record("test", k, v, epoch)
                summary.update({f"test_{k}": v for k, v in res.items()})
                log.info("epoch %d step %d train_loss %.4f test_acc %.4f", epoch, step,
                         loss_val, res.get("acc", float("nan")))
            measure.reset_cuda_peak(device)
            if step >= total_steps:
                break
    except torch.cuda.OutOfMemoryError as e:
        if device.type == "cuda":  # the peak reached before the failing allocation
            summary.update(measure.cuda_peak(device))
            summary["mem_peak_source"] = "cuda"
        raise RunFailed("oom", str(e).splitlines()[0], step, summary, metrics) from e
    finally:
        if bar is not None:
            bar.close()

    summary.update(timer.summary(batch_size))
    summary.update({
        "train_loss": loss_val,
        "steps": step,
        "warmup_steps_used": warmup_steps,
        "epochs_done": epochs,
        "train_time_s": time.perf_counter() - t_start,
        "mem_peak_rss_bytes": measure.peak_rss_bytes(),
    })
    if device.type == "cuda":
        summary.update(peak_cuda)
        summary["mem_peak_source"] = "cuda"
        # The breakdown was taken at the tracker's peak; "other" absorbs what the allocator
        # holds beyond live tensors (workspaces, rounding) and what the tracker did not see.
        tracked = sum(summary.get(f"mem_at_peak_{k}_bytes", 0) for k in
                      ("params", "grads", "optim", "act"))
        summary["mem_at_peak_other_bytes"] = max(0, peak_cuda["mem_peak_alloc_bytes"] - tracked)
    elif "mem_tracker_peak_bytes" in summary:
        summary["mem_peak_alloc_bytes"] = summary["mem_tracker_peak_bytes"]
        summary["mem_peak_reserved_bytes"] = float("nan")
        summary["mem_peak_source"] = "tracker"
    return TrainResult(summary, metrics, timer.times)


def _accounting(saved: measure.SavedBytes, tracker: measure.PeakTracker, model: nn.Module,
                optimizer: torch.optim.Optimizer) -> dict[str, int]:
    at = tracker.at_peak
    return {
        "mem_act_saved_bytes": saved.bytes,
        "mem_act_saved_tensors": saved.count,
        "mem_peak_act_bytes": tracker.act_peak_bytes,
        "mem_tracker_peak_bytes": tracker.peak_bytes,
        "mem_params_bytes": measure.tensor_bytes(model.parameters()),
        "mem_buffers_bytes": measure.tensor_bytes(model.buffers()),
        "mem_optim_bytes": measure.optimizer_bytes(optimizer),
        "mem_at_peak_params_bytes": at["params"],
        "mem_at_peak_grads_bytes": at["grads"],
        "mem_at_peak_optim_bytes": at["optim"],
        "mem_at_peak_act_bytes": at["act"],
        "mem_at_peak_other_bytes": at["buffers"] + at["other"],
        **{f"mem_at_act_peak_{k}_bytes": v for k, v in tracker.at_act_peak.items()},
    }
