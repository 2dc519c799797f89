"""A GPU-free peak-memory estimate: the configured training step run on fake tensors.

Under torch's FakeTensorMode every tensor has a shape, dtype and storage size but no data, so
building the model (the method applied), the optimizer and a batch, and running two training
steps costs no memory and little time. torch's MemTracker (`measure.PeakTracker`) follows the
second step, as it does on a real run's accounting step, and its peak is the estimate.

Every method is estimated as its run measures it (`probe_steps`): checkpoint with its
recomputation plan (profiled and solved on the fake batch: bytes and FLOPs need no data),
synthetic per phase (the largest phase is the row's), prune with the configured sparsity (the
number of kept blocks is ceil((1 - s) n), a shape, not data), pool's and prune's Triton
kernels as the outputs they allocate (`kernels.is_fake`: the launch is skipped).

What it cannot see, so what the estimate leaves out: the CUDA caching allocator's rounding and
fragmentation, cuDNN/cuBLAS workspaces and the CPU kernels' scratch (no kernel runs), the CUDA
context, and ops with no fake implementation (the estimate then fails and says so). Fake
tensors are made on the CPU when no GPU is present, so autocast follows the CPU's op policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import memtrain.methods.base as base
from memtrain.losses import cross_entropy
from memtrain.memory import measure
from memtrain.methods.base import ProbeStep
from memtrain.run import distributed
from memtrain.run.train import autocast_factory, cast_input

log = logging.getLogger(__name__)


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                  y: torch.Tensor, precision: str = "fp32",
                  saved: measure.SavedBytes | None = None,
                  loss_fn: Callable = cross_entropy) -> None:
    """Forward, backward, update: the memory-relevant part of train.train's step, which also
    keeps the output alive until the update is done (a partition's output is no small logit)."""
    with measure.maybe(saved, saved is not None), autocast_factory(x.device.type, precision)():
        out = model(x)
        loss = loss_fn(out, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del out


def random_batch(batch_size: int, input_shape: tuple[int, ...], num_classes: int,
                 device: torch.device, task: str = "classify",
                 precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of the run's shapes and dtypes: images [B, C, H, W] and labels [B], or a
    language model's token ids and next tokens, both [B, T]."""
    if task == "lm":
        x = torch.randint(0, num_classes, (batch_size, *input_shape), device=device)
        return x, torch.randint(0, num_classes, (batch_size, *input_shape), device=device)
    x = torch.randn(batch_size, *input_shape, device=device)
    y = torch.randint(0, num_classes, (batch_size,), device=device)
    return cast_input(x, precision), y


def probe_steps(make: Callable[[], tuple[nn.Module, Any]], batch_size: int,
                input_shape: tuple[int, ...], num_classes: int, device: torch.device,
                precision: str = "fp32", task: str = "classify",
                sharding: tuple[str, int] | None = None) -> list[ProbeStep]:
    """The steps a run of this model and method measures, on a batch of `batch_size`.

    `make()` returns a fresh model with the method applied, and the method, whose
    `probe_steps` (methods/base.py) says what its run measures when that is not one step of
    the wrapped model (checkpoint: its recomputation plan applied; synthetic: one step per
    phase). `sharding`: (strategy, world size) of one rank of a sharded run (checkpoint plans
    as its run's rank does).
    """
    model, method = make()
    # a real probe (fake: made there; `cuda:0` is the device `cuda` asked for, and moving a
    # model with tied weights onto itself fails on fake tensors: GPT's embedding)
    if any(p.device.type != device.type for p in model.parameters()):
        model.to(device)
    model.train()
    x, y = random_batch(batch_size, input_shape, num_classes, device, task, precision)
    context = base.MethodContext(sharding=None if sharding is None else base.Sharding(*sharding))
    return base.probe_steps(method, model, x, y, autocast=autocast_factory(device.type, precision),
                            num_classes=num_classes, context=context)


def _optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer state a first step leaves, without that step's forward and backward (on
    fake tensors they cost as much as the tracked step): every trainable parameter gets a
    gradient of zeros, the optimizer steps, the gradients go."""
    for p in module.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tracked(step: ProbeStep, optimizer: torch.optim.Optimizer, precision: str,
             reached: set[int]) -> tuple[measure.PeakTracker, measure.SavedBytes]:
    """The tracked step, and the ids of the parameters it gave a gradient (`reached`)."""
    trainable = [p for p in step.module.parameters() if p.requires_grad]
    hooks = [p.register_post_accumulate_grad_hook(lambda p: reached.add(id(p)))
             for p in trainable]
    saved = measure.SavedBytes(measure.alive_before_step(step.module, step.x, step.y),
                               model=step.module)
    try:
        # the step's device only, as a run's tracker: offload's host copies are no memory of it
        with measure.PeakTracker(step.module, optimizer, step.x, step.y, *step.resident,
                                 device=step.x.device) as tracker:
            training_step(step.module, optimizer, step.x, step.y, precision, saved,
                          step.loss_fn)
    finally:
        for h in hooks:
            h.remove()
    return tracker, saved


def _step_peak(step: ProbeStep, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
               precision: str, world: distributed.World | None = None) -> dict[str, int]:
    """The optimizer state a first step leaves (`_optimizer_state`), then the tracked step.
    A parameter the step gives no gradient has no state after a real first step: then the
    state comes from a real first step instead, and the step is tracked again. `world`: one
    rank of a sharded run (its fake process group, whose wrappers set up on their first step:
    a real first step): FSDP shards the module as the run does; DDP's gradient buckets, made
    when a run wraps its model and held through every step, are added to the peak as other
    memory (one bucket byte per gradient byte)."""
    comm = 0
    if world is not None and world.strategy == "fsdp":
        step.module = distributed.wrap(step.module, world, step.x.device)
    elif world is not None and world.strategy == "ddp":
        comm = sum(p.numel() * p.element_size() for p in step.module.parameters()
                   if p.requires_grad)
    optimizer = make_optimizer(step.module)
    reached: set[int] = set()
    if world is None:
        _optimizer_state(step.module, optimizer)
        tracker, saved = _tracked(step, optimizer, precision, reached)
    if world is not None or any(p.requires_grad and id(p) not in reached
                                for p in step.module.parameters()):
        optimizer = make_optimizer(step.module)
        training_step(step.module, optimizer, step.x, step.y, precision, loss_fn=step.loss_fn)
        tracker, saved = _tracked(step, optimizer, precision, reached)
    out = {"mem_estimate_bytes": tracker.peak_bytes,
           "mem_estimate_act_bytes": tracker.act_peak_bytes,
           "mem_estimate_act_temp_bytes": tracker.act_temp_peak_bytes,
           "mem_estimate_saved_bytes": saved.bytes}
    out.update({f"mem_estimate_at_peak_{k}_bytes": v for k, v in tracker.at_peak.items()})
    out.update({f"mem_estimate_at_act_peak_{k}_bytes": v for k, v in tracker.at_act_peak.items()})
    if comm:
        out["mem_estimate_bytes"] += comm
        out["mem_estimate_at_peak_other_bytes"] += comm
    return out


def estimate_peak(make: Callable[[], tuple[nn.Module, Any]],
                  make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                  input_shape: tuple[int, ...], num_classes: int, batch_size: int,
                  precision: str = "fp32", device: str = "cpu",
                  task: str = "classify", strategy: str = "single",
                  world_size: int = 1) -> dict[str, int | str]:
    """Predicted memory of one training step after warm-up (optimizer state allocated).

    Predicts what the run's accounting step's tracker reports: `mem_estimate_bytes` the peak of
    live tensors (`mem_tracker_peak_bytes`; the CPU's `mem_peak_alloc_bytes` adds kernels'
    scratch, which fake tensors do not run), `mem_estimate_act_bytes` the peak of activation
    memory (`mem_peak_act_bytes`, recomputation included), `mem_estimate_act_temp_bytes` the
    peak of activations + backward temporaries (`mem_tracker_act_temp_bytes`),
    `mem_estimate_saved_bytes` the bytes saved for backward (`mem_act_saved_bytes`), and the
    breakdown at the peak (optimizer state apart from the update's temporaries). A method with
    several phases (synthetic) is estimated per phase and the row gets the phase with the
    largest peak (`mem_estimate_phase`), its activation figures the phase with the largest
    activation peak (`mem_estimate_act_phase`), and the largest phase's activations +
    temporaries peak, as its run's row does.

    `strategy` ddp or fsdp with `world_size` N: the peak of one rank (rank 0, whose shards are
    the largest) of an N-rank run, without the ranks: on its batch (`batch_size` is the global
    one), in torch's fake process group of N ranks (`distributed.fake_session`), FSDP's shards
    and what its hooks gather tracked as a run's rank tracks them.
    """
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    dev = torch.device(device)
    sharded = strategy in ("ddp", "fsdp")
    session = distributed.fake_session(strategy, world_size) if sharded else \
        contextlib.nullcontext(None)
    # factories that name no device make the estimate's device's tensors: a device context,
    # unless it is the default device already (a context sees every torch call of the step)
    where = contextlib.nullcontext() if dev == torch.get_default_device() else dev
    with session as world, FakeTensorMode(), where:
        steps = probe_steps(make, batch_size // world_size if sharded else batch_size,
                            input_shape, num_classes, dev, precision, task,
                            (strategy, world_size) if sharded else None)
        peaks = [(s.name, _step_peak(s, make_optimizer, precision, world)) for s in steps]
    name, out = max(peaks, key=lambda p: p[1]["mem_estimate_bytes"])
    out = {**out, "mem_estimate_device": dev.type}
    if name:  # the activation figures from the phase with the largest activation peak
        act_name, act = max(peaks, key=lambda p: p[1]["mem_estimate_act_bytes"])
        out.update({k: act[k] for k in ("mem_estimate_act_bytes", "mem_estimate_saved_bytes")
                    if k in act})
        # the largest of every phase's own, as the run's row takes it
        out["mem_estimate_act_temp_bytes"] = max(p["mem_estimate_act_temp_bytes"]
                                                 for _, p in peaks)
        out.update(mem_estimate_phase=name, mem_estimate_act_phase=act_name)
    return out


def estimate_device(device: torch.device) -> str:
    """Fake CUDA tensors need a CUDA runtime for backward; without one, estimate on the CPU."""
    return "cuda" if device.type == "cuda" and torch.cuda.is_available() else "cpu"
