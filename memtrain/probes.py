"""The probes a job runs before training (`trainer.estimate`, `trainer.find_max_batch`), each on
fresh models built for it, never the run's own."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memtrain import capacity, estimate
from memtrain.data import Data
from memtrain.errors import ConfigError
from memtrain.schema import Trainer

log = logging.getLogger("memtrain")


def run(t: Trainer, data: Data, device: torch.device, make_model: Callable[[], nn.Module],
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> dict[str, Any]:
    """The probes' summary columns (none asked: {})."""
    out: dict[str, Any] = {}
    if not (t.estimate or t.find_max_batch):
        return out
    est_dev = estimate.estimate_device(device)

    def predict(b: int) -> dict[str, Any]:
        return estimate.estimate_peak(make_model, make_optimizer, data.input_shape,
                                      data.num_classes, b, t.precision, est_dev)

    if t.estimate:
        try:
            out.update(predict(t.batch_size))
            log.info("estimated peak %.3f GiB (activations %.3f GiB)",
                     out["mem_estimate_bytes"] / 2**30, out["mem_estimate_act_bytes"] / 2**30)
        except Exception as e:  # a kernel without a fake implementation: say so, train anyway
            out["mem_estimate_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            log.warning("trainer.estimate failed: %s", out["mem_estimate_error"])
    if t.find_max_batch:
        out["max_batch_size"] = _find_max_batch(t, data, device, make_model, make_optimizer,
                                                predict)
    return out


def _find_max_batch(t: Trainer, data: Data, device: torch.device, make_model, make_optimizer,
                    predict) -> int:
    if device.type == "cuda":
        def make_step(b: int):
            model = make_model().to(device)
            opt = make_optimizer(model)
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
