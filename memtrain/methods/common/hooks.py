"""Saved-tensor hooks that compose: what quantize and offload share.

Nested `saved_tensors_hooks` do not chain: only the innermost pair runs. `ChainedHooks` reads the
hooks on top when it is entered (`torch._C._autograd._top_saved_tensors_default_hooks`, present
in torch 2.11 and 2.14) and hands what it keeps on to them, so an outer hook (memtrain's
accounting, an offloader around a quantizer) sees the bytes that are really kept. A storage saved
twice in one forward (a block input read by conv1 and the downsample) is packed once.

`around_forward(model, make)` enters a fresh `make()` around every training forward of the model.
Its pre-hook goes first (`prepend`) and its leave hook last, so a method wrapped later puts its
hooks around those of the methods wrapped before it: wrapping is innermost first.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

_WRAPPED: weakref.WeakSet = weakref.WeakSet()  # models with hooks from around_forward
_SUSPENDED = [0]
# what an inner hook hands on in place of an activation (quantize's packed buffer): an outer
# hook that treats activations apart (offload) still knows it for one
_STANDS_IN = WeakTensorKeyDictionary()


def stands_in(t: torch.Tensor) -> bool:
    """t is what an inner `ChainedHooks` keeps in place of a saved tensor it changed."""
    return t in _STANDS_IN


class ChainedHooks(torch.autograd.graph.saved_tensors_hooks):
    """Subclasses give `keep(t) -> (state, inner)` (inner: the tensor to hand on, t itself when
    nothing changes), `restore(state, inner) -> t` and optionally `again(state)`."""

    # Inside a checkpointed segment (a stack's `Checkpoint.inside`): every save gets its own
    # checkpoint holder (torch's checkpoint refuses a holder unpacked twice), and the segment's
    # input, a leaf that requires grad when backward recomputes, counts as the activation it was
    # in the forward (the two passes must save the same kinds of tensors)
    inside_checkpoint = False

    def __init__(self):
        self._outer: tuple | None = None
        self._seen = WeakTensorKeyDictionary()
        super().__init__(self._pack, self._unpack)

    def keep(self, t: torch.Tensor) -> tuple[Any, torch.Tensor]:
        raise NotImplementedError

    def restore(self, state: Any, inner: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def again(self, state: Any) -> None:
        """The storage behind `state` was saved once more (one more unpack will come)."""

    def __enter__(self):
        # the hooks on top now: ours replace them inside the `with`, so we call them ourselves
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._seen = WeakTensorKeyDictionary()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._seen = WeakTensorKeyDictionary()  # the next forward's tensors are new

    def _pack(self, t: torch.Tensor):
        hit = None if self.inside_checkpoint else self._seen.get(t)
        if hit is not None and hit[0] == t._version:  # saved twice (a block input, a residual)
            self.again(hit[1][0])
            return hit[1]
        state, inner = self.keep(t)
        if inner is not t:
            _STANDS_IN[inner] = True
        handle = (state, self._outer[0](inner) if self._outer else inner)
        self._seen[t] = (t._version, handle)
        return handle

    def _unpack(self, handle) -> torch.Tensor:
        state, inner = handle
        return self.restore(state, self._outer[1](inner) if self._outer else inner)


def around_forward(model: nn.Module, make: Callable[[], ChainedHooks]) -> nn.Module:
    """Enter `make()` around every training forward (grad enabled) of `model`."""
    active: list[ChainedHooks] = []

    def enter(module, args):
        if module.training and torch.is_grad_enabled() and not _SUSPENDED[0]:
            active.append(make())
            active[-1].__enter__()

    def leave(module, args, out):  # always_call: the hooks come off even when forward fails
        if active:
            active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter, prepend=True)
    model.register_forward_hook(leave, always_call=True)
    _WRAPPED.add(model)
    return model


def recomputed_input(t: torch.Tensor) -> bool:
    """A checkpointed segment's input as backward's recomputation sees it (a detached leaf that
    requires grad, not a parameter)."""
    return t.requires_grad and t.grad_fn is None and not isinstance(t, nn.Parameter)


def wrapped(model: nn.Module) -> bool:
    """Whether a method put saved-tensor hooks around the model's forward."""
    return model in _WRAPPED


@contextlib.contextmanager
def suspended():
    """Forwards inside run without the hooks, as a recomputation in backward does (checkpoint's
    planner profiles what a recomputed segment keeps this way)."""
    _SUSPENDED[0] += 1
    try:
        yield
    finally:
        _SUSPENDED[0] -= 1
