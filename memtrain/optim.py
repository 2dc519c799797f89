"""Optimizer and learning-rate schedule builders; keyword arguments are the conf/optim keys."""

from __future__ import annotations

import math

import torch
from torch import nn

from memtrain.config.schema import OPTIMIZERS, SCHEDULES
from memtrain.errors import ConfigError, check_choice, check_range

FP32_MAX = float(torch.finfo(torch.float32).max)


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # No weight decay on biases and norm scales (1-D tensors), as usual for both SGD and AdamW.
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim > 1 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, name: str = "sgd", lr: float = 0.1, momentum: float = 0.9,
                    weight_decay: float = 5e-4, nesterov: bool = True,
                    betas: tuple[float, float] = (0.9, 0.999),
                    **_schedule) -> torch.optim.Optimizer:
    check_choice("optim.name", name, OPTIMIZERS)
    # the parameters are fp32 at most: a factor past fp32's range overflows in the first step
    check_range("optim.lr", lr, 0, FP32_MAX, lo_open=True)
    check_range("optim.weight_decay", weight_decay, 0, FP32_MAX)
    check_range("optim.momentum", momentum, 0, 1)
    if len(betas) != 2:
        raise ConfigError(f"optim.betas must list two numbers [beta1, beta2], got {list(betas)}")
    for i, b in enumerate(betas):
        check_range(f"optim.betas[{i}]", b, 0, 1, hi_open=True)
    groups = _param_groups(model, weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas))


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, schedule: str = "cosine",
                    warmup_steps: int = 0, step_every: int = 0, gamma: float = 0.1,
                    min_lr_ratio: float = 0.0, **_optim) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step schedule: linear warm-up, then cosine decay, step decay or constant."""
    check_choice("optim.schedule", schedule, SCHEDULES)
    if warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps must be >= 0, got {warmup_steps}")
    total = max(1, total_steps)
    every = step_every or max(1, total // 3)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine":
            t = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
        if schedule == "step":
            return gamma ** (step // every)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
