"""Checkpoint segments: where a model can be cut, and the wrapper that recomputes a group.

A segment is a run of sibling modules (`parent.<attr>` for each attr) that the model's forward
calls one after the other; a model's segments (its chain, `memtrain/models/chain.py`) form a
pure chain: segment i's output is segment i+1's input and nothing else happens in between. That
invariant lets a group of consecutive segments run inside one checkpoint: the group's first
module runs every module of the group (`CheckpointGroup`), the others pass their input through;
no module moves, so the state_dict keys are the plain model's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain.models.chain import Segment, chain_of

__all__ = ["CheckpointGroup", "Segment", "apply_groups", "discover", "group_of"]


def discover(model: nn.Module, sample=None) -> list[Segment]:
    """The model's checkpointable segments, in forward order: its chain's
    (`memtrain.models.chain_of`: its registered rule's, else found on `sample`); ConfigError
    for a model without a chain."""
    return chain_of(model, "method checkpoint", sample).segments


# ---------------------------------------------------------------- BatchNorm during recompute


@contextlib.contextmanager
def shield_batchnorm(bns: list[nn.modules.batchnorm._BatchNorm]):
    """Point the BatchNorm running statistics at throwaway copies while a segment is recomputed.

    A training-mode BatchNorm updates its running statistics in every forward, so a recomputed
    forward would update them a second time (torch.utils.checkpoint does not guard them). The
    copies take that second update; the real buffers are never written (no in-place change, so
    no version bump either), and the batch statistics the recomputation uses are the same as
    the first forward's.
    """
    names = ("running_mean", "running_var", "num_batches_tracked")
    saved = [(bn, [getattr(bn, k) for k in names]) for bn in bns if bn.track_running_stats]
    for bn, bufs in saved:
        for k, b in zip(names, bufs):
            if b is not None:
                setattr(bn, k, b.clone())
    try:
        yield
    finally:
        for bn, bufs in saved:
            for k, b in zip(names, bufs):
                setattr(bn, k, b)


# ---------------------------------------------------------------- the wrapper


def batchnorms(modules: list[nn.Module]) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for top in modules for m in top.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class _OwnForward(nn.Module):
    """A group's first module's own forward, called as a module of its own (not registered in
    the model): the first module's forward attribute is the group's, so the group cannot call
    it through the module, and what follows module forwards sees this one run inside the
    checkpoint. torch's MemTracker files the tensors a recomputation makes as activations only
    inside a module's forward: called bare, a recomputed stem's convolution output (resnet's
    first module is that leaf) counted as a backward temporary, and `mem_peak_act_bytes` was
    2 MiB low (resnet18 64 px b8, groups 0-1 and 2-3)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class CheckpointGroup:
    """Runs a group of consecutive modules (one or more segments) under non-reentrant
    checkpointing, without moving them: every module stays where the model registered it, so
    parameter and buffer names (the state_dict) are the plain model's under any plan.

    The first module's `forward` (an instance attribute over its class's) runs the whole group
    inside one checkpoint; the others' pass their input through outside it and run their own
    forward inside it (module hooks still fire). Only the group's input is kept; the body's
    activations are recomputed in backward with the RNG state of the first forward (dropout and
    stochastic depth match) and BatchNorm shielded. `policy` switches to selective
    checkpointing: a `torch.utils.checkpoint` policy deciding per op what to save.
    """

    def __init__(self, body: list[nn.Module], policy: Callable | None = None,
                 make_contexts: Callable | None = None,
                 inside: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.modules = body
        self._make_contexts = make_contexts  # () -> (forward, recompute) contexts: op plans
        self._make_inside = inside  # fresh hooks for inside the checkpoint (a stack's quantize)
        self.forwards = [m.forward for m in body]  # the modules' own forwards
        self._first = _OwnForward(self.forwards[0])
        self._policy = policy
        self._bns = batchnorms(body)
        self._inside = False
        self._own = [m.__dict__.get("forward") for m in body]  # instance forwards before ours
        body[0].forward = self.forward
        for i, m in enumerate(body[1:], 1):
            m.forward = functools.partial(self._member, i)

    def remove(self) -> None:
        """Undo the group: every module runs its own forward again (a plan replaced)."""
        for m, own in zip(self.modules, self._own, strict=True):
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own

    def _member(self, i: int, *args, **kwargs):
        if self._inside:
            return self.forwards[i](*args, **kwargs)
        return args[0]  # already computed by the group's first module

    def _body(self, x: torch.Tensor, *side, **side_kw) -> torch.Tensor:
        """The group's modules in turn, each on the previous one's output and the side inputs
        the first was called with (a found chain's: the same for every module)."""
        self._inside = True
        try:
            x = self._first(x, *side, **side_kw)
            for m in self.modules[1:]:
                x = m(x, *side, **side_kw)
            return x
        finally:
            self._inside = False

    def _contexts(self):
        shield = shield_batchnorm(self._bns)
        if self._make_contexts is not None:  # an op-level plan's policy
            fwd, recompute = self._make_contexts()
            recompute = _both(shield, recompute)
        elif self._policy is None:
            fwd, recompute = contextlib.nullcontext(), shield
        else:
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            fwd, recompute = create_selective_checkpoint_contexts(self._policy)
            recompute = _both(shield, recompute)  # the shield's copies are no recomputed ops
        if self._make_inside is None:
            return fwd, recompute
        # entered inside checkpoint's own hooks in both passes: what the segment's ops save is
        # kept as the inner hooks keep it, in the forward (then dropped) and in the recompute
        return _both(fwd, self._make_inside()), _both(recompute, self._make_inside())

    def forward(self, x: torch.Tensor, *side, **side_kw) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return self._body(x, *side, **side_kw)
        return checkpoint(self._body, x, *side, use_reentrant=False, preserve_rng_state=True,
                          context_fn=self._contexts, **side_kw)


def group_of(module: nn.Module) -> CheckpointGroup | None:
    """The CheckpointGroup whose first module `module` is, if any."""
    fwd = module.__dict__.get("forward")
    owner = getattr(fwd, "__self__", None)
    return owner if isinstance(owner, CheckpointGroup) else None


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


def apply_groups(model: nn.Module, segments: list[Segment], groups: list[tuple[int, int]],
                 policy: Callable | None = None,
                 contexts: list[Callable] | None = None,
                 inside: Callable[[], contextlib.AbstractContextManager] | None = None
                 ) -> list[CheckpointGroup]:
    """Checkpoint each group (first, last) of consecutive segment indices, in place; module
    names, parameters and buffers are unchanged. `contexts[g]`: group g's selective-checkpoint
    context factory (an op-level plan's `PlanPolicy.make`); `inside`: hooks entered inside each
    checkpoint (forward and recompute)."""
    contexts = contexts or [None] * len(groups)
    return [CheckpointGroup([m for s in segments[first:last + 1] for m in s.modules()], policy,
                            make, inside)
            for (first, last), make in zip(groups, contexts, strict=True)]
