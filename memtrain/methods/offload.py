"""method=offload: saved activations live in (pinned) host memory between forward and backward.

Every activation the forward keeps for backward (`is_activation`, methods/common/activations.py:
made by the step's ops, not a parameter, its cast or view, the batch or a buffer) on the run's
GPU, of at least `min_bytes`, is copied to host memory when it is saved and back when backward
needs it, as `torch.autograd.graph.save_on_cpu(pin_memory=True)` does, with two differences: a
storage saved twice is copied once, and the hooks compose (methods/common/hooks.py): around
quantize they move the quantized bytes, and memtrain's accounting sees the host copy
(`mem_act_saved_host_bytes`), not a device tensor.

`prefetch=true`: when backward unpacks saved tensor i, the copy back of the one saved just
before it (the next one backward needs) starts on a side stream, so it overlaps the backward
compute; unpacking it then waits for that copy's event only. The copies go through a `Mover`
(`CudaMover` on a GPU; tests drive the same logic on the CPU with `HostMover`).

There is nothing to offload to on a CPU run: the runner asks `check_device` before training and
the run ends with one line (exit 2). The GPU-free estimate (memtrain-willfit's rows) runs the
step on fake CPU tensors standing in for the GPU: there `HostMover` makes each host copy on
`meta`, which the estimate's tracker does not count. Unmeasured on CUDA so far: the code paths
follow torch's save_on_cpu and the CUDA stream semantics.

    memtrain method=offload method.prefetch=true
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from memtrain.errors import ConfigError, check_range
from memtrain.methods.common.activations import is_activation, memory_order
from memtrain.methods.common.hooks import ChainedHooks, around_forward, stands_in

# ---------------------------------------------------------------- moving bytes


class HostMover:
    """Copies to and from host memory synchronously; `device` is where tensors are offloaded
    from (the CPU in tests, where "host" is a second copy: the pack/unpack logic without a GPU)."""

    def __init__(self, device: str = "cpu", pin_memory: bool = False):
        self.device, self.pin = torch.device(device), pin_memory

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        if is_fake(t):  # the estimate: its device stands in for the GPU (`_host_like`)
            return _host_like(t, "meta")
        return _host_like(t, "cpu", self.pin).copy_(t, non_blocking=self.pin)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        if host.device.type == "meta":  # the estimate's host copy: back as a new device tensor
            return _host_like(host, self.device)
        return host.to(self.device, non_blocking=self.pin, copy=True)

    def prefetch(self, host: torch.Tensor) -> Any:
        """Start the copy back; `wait` turns the ticket into the device tensor."""
        return self.to_device(host)

    def wait(self, ticket: Any) -> torch.Tensor:
        return ticket


def _host_like(t: torch.Tensor, device: str | torch.device, pin: bool = False) -> torch.Tensor:
    """An empty tensor of t's size and dtype on `device`: t's strides when its memory is dense
    (channels_last stays so), else contiguous. The GPU-free estimate runs the step on fake
    tensors of the CPU standing in for the GPU, so a host copy there is made on `meta`: no
    memory of the device the estimate counts (its tracker counts that device only), as a real
    host copy is none of the GPU's."""
    if memory_order(t) is not None:
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device,
                                   pin_memory=pin)
    return torch.empty(t.size(), dtype=t.dtype, device=device, pin_memory=pin)


class CudaMover(HostMover):
    """Pinned host buffers, non-blocking copies; prefetches on a side stream.

    The device-to-host copy is ordered on the current stream, so the device tensor's memory is
    not reused before it is read. A prefetch first makes the side stream wait for the current
    one (the host copy is complete there), copies, and records an event; `wait` makes the
    current stream wait for that event and hands the tensor to it (`record_stream`), so the
    allocator does not reuse its memory while the side stream still owns it.
    """

    def __init__(self, device: torch.device, pin_memory: bool = True):
        super().__init__(str(device), pin_memory)
        self._stream: torch.cuda.Stream | None = None

    def prefetch(self, host: torch.Tensor) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            t = host.to(self.device, non_blocking=True, copy=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return t, done

    def wait(self, ticket: Any) -> torch.Tensor:
        t, done = ticket
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        t.record_stream(current)
        return t


# ---------------------------------------------------------------- saved-tensor hooks


@dataclass(eq=False)
class Offloaded:
    """One saved storage in host memory. `uses`: unpacks still to come (a storage saved by two
    ops, a ReLU's output that the next convolution reads, is copied once and, once back, kept
    on the device until its last user has it, as it would be without offloading)."""

    host: torch.Tensor
    index: int
    uses: int = 1
    fetched: bool = False
    ticket: Any = field(default=None, repr=False)  # a prefetch in flight
    back: torch.Tensor | None = field(default=None, repr=False)  # on the device, uses left


class Offloader(ChainedHooks):
    """Saved-tensor hooks that keep activations in host memory (see the module docstring).

    Saved storages are numbered in the order they are packed; backward mostly unpacks them in
    reverse. With `prefetch`, unpacking storage i starts the copy back of the highest-numbered
    storage below i that has not come back yet, unless that one is already in flight (one copy
    ahead at a time). Only weak references are listed, so a storage whose users have all run
    (their graph nodes freed it) is neither kept nor fetched.
    """

    def __init__(self, mover: HostMover, min_bytes: int = 0, prefetch: bool = False):
        self.mover, self.min_bytes, self.prefetch = mover, min_bytes, prefetch
        self._order: list[weakref.ref] = []
        super().__init__()

    def __enter__(self):
        self._order = []
        return super().__enter__()

    def offloads(self, t: torch.Tensor) -> bool:
        return (t.device == self.mover.device and (is_activation(t) or stands_in(t))
                and t.untyped_storage().nbytes() >= self.min_bytes)

    def keep(self, t: torch.Tensor) -> tuple[Offloaded | None, torch.Tensor]:
        if not self.offloads(t):
            return None, t
        off = Offloaded(self.mover.to_host(t), len(self._order))
        self._order.append(weakref.ref(off))
        return off, off.host

    def again(self, off: Offloaded | None) -> None:
        if off is not None:
            off.uses += 1

    def restore(self, off: Offloaded | None, inner: torch.Tensor) -> torch.Tensor:
        if off is None:
            return inner
        if off.back is not None:
            t = off.back
        elif off.ticket is not None:
            t, off.ticket = self.mover.wait(off.ticket), None
        else:
            t = self.mover.to_device(inner)
        off.fetched, off.uses = True, off.uses - 1
        off.back = t if off.uses > 0 else None
        if self.prefetch:
            self._prefetch_before(off.index)
        return t

    def _prefetch_before(self, index: int) -> None:
        for ref in reversed(self._order[:index]):
            nxt = ref()
            if nxt is None or nxt.fetched:
                continue
            if nxt.ticket is None:
                nxt.ticket = self.mover.prefetch(nxt.host)
            return


# ---------------------------------------------------------------- the method


class OffloadMethod:
    """An `Offloader` around every training forward of the model; CUDA runs only."""

    name = "offload"
    grads_exact = True  # the saved tensors come back as they were

    def __init__(self, prefetch: bool = False, pin_memory: bool = True, min_bytes: int = 65536):
        if not isinstance(prefetch, bool) or not isinstance(pin_memory, bool):
            raise ConfigError("method.prefetch and method.pin_memory must be true or false")
        check_range("method.min_bytes", min_bytes, 0, 2**62)
        self.prefetch, self.pin_memory, self.min_bytes = prefetch, pin_memory, min_bytes
        self.mover: HostMover | None = None

    def check_device(self, device: torch.device) -> None:
        """Before training: offloading needs a GPU to move saved tensors off."""
        if device.type != "cuda":
            raise ConfigError(f"method=offload moves saved activations from GPU to host memory; "
                              f"this run is on {device.type}, whose tensors already live in "
                              f"host memory: nothing to offload to (use trainer.device=cuda)")
        self.mover = CudaMover(device, self.pin_memory)

    def hooks(self) -> Offloader:
        """A fresh offloader (for stacks and custom loops). Its mover: the run's (`check_device`),
        else the current GPU's when there is one (the probes' fresh models), else a `HostMover`
        that offloads CPU tensors (the tests' stand-in)."""
        mover = self.mover
        if mover is None:
            mover = CudaMover(torch.device("cuda", torch.cuda.current_device()), self.pin_memory) \
                if torch.cuda.is_available() else HostMover("cpu", pin_memory=False)
        return Offloader(mover, self.min_bytes, self.prefetch)

    def wrap(self, model: nn.Module) -> nn.Module:
        return around_forward(model, self.hooks)
