"""A GPU-free peak-memory estimate: the configured training step run on fake tensors.

Under torch's FakeTensorMode every tensor has a shape, dtype and storage size but no data, so
building the model (the method applied), the optimizer and a batch, and running two training
steps costs no memory and little time. torch's MemTracker (`measure.PeakTracker`) follows the
second step, as it does on a real run's accounting step, and its peak is the estimate.

What it cannot see, so what the estimate leaves out: the CUDA caching allocator's rounding and
fragmentation, cuDNN/cuBLAS workspaces, the CUDA context, and kernels with no fake
implementation (a Triton kernel without a registered fake: the estimate then fails and says so).
Fake tensors are made on the CPU when no GPU is present, so autocast follows the CPU's op policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memtrain import measure
from memtrain.train import autocast_factory

log = logging.getLogger(__name__)


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                  y: torch.Tensor, precision: str = "fp32",
                  saved: measure.SavedBytes | None = None) -> None:
    """Forward, backward, update: the memory-relevant part of train.train's step."""
    with measure.maybe(saved, saved is not None), autocast_factory(x.device.type, precision)():
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def random_batch(batch_size: int, input_shape: tuple[int, ...], num_classes: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, *input_shape, device=device)  # [B, C, H, W]
    y = torch.randint(0, num_classes, (batch_size,), device=device)  # [B]
    return x, y


class FakeSavedBytes(measure.SavedBytes):
    """SavedBytes for fake tensors: they have no data pointer, so storages are told apart by
    their C++ object."""

    def storage_id(self, t: torch.Tensor) -> tuple[str, int]:
        return (str(t.device), t.untyped_storage()._cdata)


def estimate_peak(make_model: Callable[[], nn.Module],
                  make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                  input_shape: tuple[int, ...], num_classes: int, batch_size: int,
                  precision: str = "fp32", device: str = "cpu") -> dict[str, int | str]:
    """Predicted memory of one training step after warm-up (optimizer state allocated).

    Returns `mem_estimate_bytes` (the peak of live tensors), `mem_estimate_act_bytes` (the peak
    of activation memory, as `mem_peak_act_bytes`), `mem_estimate_saved_bytes` (saved for
    backward, as `mem_act_saved_bytes`) and the breakdown at the peak.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev = torch.device(device)
    with FakeTensorMode(), torch.device(dev):
        model = make_model()
        optimizer = make_optimizer(model)
        x, y = random_batch(batch_size, input_shape, num_classes, dev)
        model.train()
        training_step(model, optimizer, x, y, precision)  # warm-up: optimizer state exists
        saved = FakeSavedBytes(measure.alive_before_step(model, x, y))
        with measure.PeakTracker(model, optimizer, x, y) as tracker:
            training_step(model, optimizer, x, y, precision, saved)
    out: dict[str, int | str] = {
        "mem_estimate_bytes": tracker.peak_bytes,
        "mem_estimate_act_bytes": tracker.act_peak_bytes,
        "mem_estimate_saved_bytes": saved.bytes,
        "mem_estimate_device": dev.type,
    }
    out.update({f"mem_estimate_at_peak_{k}_bytes": v for k, v in tracker.at_peak.items()})
    out.update({f"mem_estimate_at_act_peak_{k}_bytes": v for k, v in tracker.at_act_peak.items()})
    return out


def estimate_device(device: torch.device) -> str:
    """Fake CUDA tensors need a CUDA runtime for backward; without one, estimate on the CPU."""
    return "cuda" if device.type == "cuda" and torch.cuda.is_available() else "cpu"
