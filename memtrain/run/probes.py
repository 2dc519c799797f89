"""The probes a job runs before training (`trainer.estimate`, `trainer.find_max_batch`), each on
fresh models built for it, never the run's own.

Both see a method as its run measures it (`estimate.probe_steps`): checkpoint's recomputation,
synthetic's phases. Every probe step is logged: the batch tried, its estimate (or real steps on
CUDA) and whether it fits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memtrain.config.schema import Trainer
from memtrain.data import Data
from memtrain.errors import ConfigError
from memtrain.run import capacity, estimate

log = logging.getLogger("memtrain")

MakeModel = Callable[[], tuple[nn.Module, Any]]  # a fresh model, the method applied; the method


def check(t: Trainer) -> None:
    """Probe options that cannot work on this machine, as a one-line ConfigError, before a job
    starts (the CLI calls it before Hydra makes a run folder)."""
    if not t.find_max_batch or t.gpu_memory_gb is not None:
        return
    dev = str(t.device)
    if dev == "cpu" or (dev == "auto" and not torch.cuda.is_available()):
        raise ConfigError("trainer.find_max_batch on the CPU compares the estimate with a "
                          "memory cap: set trainer.gpu_memory_gb (GiB), or run on a GPU")


def run(t: Trainer, data: Data, device: torch.device, make: MakeModel,
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> dict[str, Any]:
    """The probes' summary columns (none asked: {})."""
    out: dict[str, Any] = {}
    if not (t.estimate or t.find_max_batch):
        return out
    check(t)
    est_dev = estimate.estimate_device(device)

    def predict(b: int) -> dict[str, Any]:  # a sharded run: one rank of trainer.world_size
        return estimate.estimate_peak(make, make_optimizer, data.input_shape, data.num_classes,
                                      b, t.precision, est_dev, data.task, t.strategy,
                                      t.world_size or 1)

    if t.estimate:
        # a large model, or a method that plans (checkpoint profiles, quantize packs every saved
        # tensor), takes a minute or more here: say what is going on before it starts
        log.info("estimate: batch %d on fake tensors (%s): building the model, applying the "
                 "method, running one training step ...", t.batch_size, est_dev)
        started = time.perf_counter()
        try:
            out.update(predict(t.batch_size))
            phase = out.get("mem_estimate_phase")
            log.info("estimate: batch %d: peak %.4f GiB, activations %.4f GiB%s (%s, fake "
                     "tensors; %.1f s)", t.batch_size, out["mem_estimate_bytes"] / capacity.GiB,
                     out["mem_estimate_act_bytes"] / capacity.GiB,
                     f", largest phase {phase}" if phase else "", est_dev,
                     time.perf_counter() - started)
        except ConfigError:  # bad input (prune on a model it cannot prune): the run's refusal
            raise
        except Exception as e:  # an op without a fake implementation: say so, train anyway
            out["mem_estimate_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            log.warning("trainer.estimate failed: %s", out["mem_estimate_error"])
    if t.find_max_batch:
        out.update(_find_max_batch(t, data, device, make, make_optimizer, predict))
    return out


def margin(t: Trainer, device: torch.device) -> capacity.Margin:
    """find_max_batch's margin: the cap (`trainer.gpu_memory_gb`, else the GPU's memory), the
    headroom kept free, and the CUDA context counted against the cap (`trainer.cuda_context_gb`;
    unset: measured at each probe on CUDA, `capacity.ASSUMED_CONTEXT_BYTES` without a GPU)."""
    if t.gpu_memory_gb is not None:
        cap = int(t.gpu_memory_gb * capacity.GiB)
    else:  # CUDA without a cap (check() refuses the CPU without one)
        cap = torch.cuda.get_device_properties(device).total_memory
    if t.cuda_context_gb is not None:
        context, source = int(t.cuda_context_gb * capacity.GiB), "set"
    elif device.type == "cuda":
        context, source = None, "measured"
    else:
        context, source = capacity.ASSUMED_CONTEXT_BYTES, "assumed"
        log.info("find_max_batch: the CUDA context is assumed %.2f GiB (PyTorch's lazy-loading "
                 "figure, pytorch/pytorch#86509; not measured here): set "
                 "trainer.cuda_context_gb to your GPU's", context / capacity.GiB)
    return capacity.Margin(cap, t.max_batch_headroom, context, source)


def _find_max_batch(t: Trainer, data: Data, device: torch.device, make: MakeModel,
                    make_optimizer, predict) -> dict[str, Any]:
    """The largest batch whose peak + CUDA context stays within (1 - headroom) x cap, rounded
    down to `trainer.max_batch_multiple`; and the margin it was held to (row columns)."""
    m = margin(t, device)
    if device.type == "cuda":
        def make_step(b: int):
            steps = estimate.probe_steps(make, b, data.input_shape, data.num_classes, device,
                                         t.precision, data.task)

            def run_steps():  # every phase in turn, each with its own optimizer
                for s in steps:
                    opt = make_optimizer(s.module)
                    estimate.training_step(s.module, opt, s.x, s.y, t.precision,
                                           loss_fn=s.loss_fn)
            return run_steps

        fits = capacity.cuda_fits(make_step, device, margin=m)
    else:
        if t.gpu_memory_gb is None:  # check() said so already; kept for direct callers
            raise ConfigError("trainer.find_max_batch on the CPU needs trainer.gpu_memory_gb")
        fits = capacity.estimate_fits(lambda b: predict(b)["mem_estimate_bytes"], m.cap_bytes, m)
    best = capacity.find_max_batch(fits, limit=len(data.train), start=t.batch_size)
    rounded = capacity.round_down(best, t.max_batch_multiple)
    log.info("find_max_batch: largest batch that fits: %d%s", rounded,
             f" (rounded down from {best} to a multiple of {t.max_batch_multiple})"
             if rounded != best else "")
    return {"max_batch_size": rounded, **m.columns()}
