"""Stacks: several methods on one model, e.g. checkpoint with quantize.

A stack is a conf/method option whose keys are its members, each a method's own config composed
from conf/method by Hydra's defaults list (`/method@<name>: <name>`), listed outermost first:

    # conf/method/checkpoint+quantize.yaml
    defaults:
      - /method@checkpoint: checkpoint
      - /method@quantize: quantize
      - _self_
    _target_: memtrain.methods.stack.Stack

    memtrain method=checkpoint+quantize method.checkpoint.budget_fraction=0.5 method.quantize.bits=4
    memtrain -m method=checkpoint+quantize method.checkpoint.budget_fraction=0.3,0.5
    memtrain -m --config-dir mine method=checkpoint+quantize,checkpoint+pool   # a user's stack

(A member option beside a sweep over methods is refused by Hydra, which composes a multirun's
first config with the default method: set it in the stack files, or use hydra/sweeper=variants.)

The runner builds every member (a node with a `_target_`) and passes them by name; the row's
`method` is the option's name and the members' options are `method.<member>.<key>` columns.

Order: the first member is the outermost. `wrap` applies the members innermost first (the
outer one wraps what the inner ones made); hook-based members enter their saved-tensor hooks
outermost first (methods/common/hooks.py), so an inner method hands what it keeps to the outer one
(offload around quantize moves the quantized bytes). Allowed orders, outermost first: checkpoint
(it recomputes whatever the methods inside its segments would save; its planner profiles the
model with them applied, so its budget is a fraction of *their* activation peak), then offload
(it moves whatever the inner methods keep), then the methods that change what layers save
(pool, prune, quantize; among them wrap order only). Checkpoint enters the innermost hook
members (quantize) inside each checkpoint too, so a recomputation keeps what they keep
(the contract's `inside`, methods/base.py). Every impossible combination is refused, in one line,
before anything is built: the rules of any stack here, a member's own by its `check_stack`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import memtrain.methods.base as base
from memtrain.errors import ConfigError
from memtrain.methods.base import NO_CONTEXT, MethodContext, ProbeStep

# outermost first: a member may only stand inside members of a lower rank
RANK = {"checkpoint": 0, "offload": 1}
INNER = 2  # pool, prune, quantize and any other method that changes what layers save


class Stack:
    """Members applied to one model (see the module docstring); `members` by method name,
    outermost first."""

    def __init__(self, **members: Any):
        self.members = list(members.values())
        self.keys = list(members)  # each member's key under `method`
        for key, m in members.items():
            base.check(m, f"method.{key}")
        self.name = "+".join(m.name for m in self.members)
        _check(members, self.name)

    @property
    def grads_exact(self) -> bool | None:
        """Approximate when any member is; None when a member does not say and none is."""
        found = [base.grads_exact(m) for m in self.members]
        return False if False in found else None if None in found else True

    def wrap(self, model: nn.Module) -> nn.Module:
        # checkpoint enters the hook members that change what is kept (quantize) inside each
        # checkpoint too: its recomputation keeps what they keep, not full precision
        hooks = [h for m in self.members if RANK.get(m.name, INNER) == INNER
                 and (h := base.saved_tensor_hooks(m)) is not None]
        for m in self.members:
            if hooks and base.recomputes(m):
                m.inside = functools.partial(_inside, hooks)
        for m in reversed(self.members):  # innermost first: the outer wraps what it made
            model = m.wrap(model)
        return model

    def check_device(self, device: torch.device) -> None:
        for m in self.members:
            base.check_device(m, device)

    def check_trainer(self, trainer: Any) -> None:
        for key, m in zip(self.keys, self.members, strict=True):
            try:
                base.check_trainer(m, trainer)
            except ConfigError as e:  # a member names its options as `method.<option>`
                raise ConfigError(str(e).replace("method.", f"method.{key}.")) from None

    def check_strategy(self, strategy: str) -> None:
        for m in self.members:
            base.check_strategy(m, strategy)

    def prepare(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast=None,
                carry: dict[str, Any] | None = None,
                context: MethodContext = NO_CONTEXT) -> dict[str, Any]:
        """Every member's `prepare`, innermost first (checkpoint, the outermost, profiles the
        model with the others in place); their summary columns together. The members get the
        run's context but its cache: a profile's key does not see what the other members
        change in the model."""
        out: dict[str, Any] = {}
        context = dataclasses.replace(context, cache_dir=None)
        carry = {} if carry is None else carry
        for key, m in reversed(list(zip(self.keys, self.members, strict=True))):
            try:
                out.update(base.prepare(m, model, x, y, autocast, carry, context))
            except ConfigError as e:  # a member names its options as `method.<option>`
                raise ConfigError(str(e).replace("method.", f"method.{key}.", 1)) from None
        return out

    def plan_rows(self, model: nn.Module) -> list[dict]:
        """The plan of the member that has one (checkpoint's segments), else none."""
        for m in self.members:
            if base.has(m, "plan_rows"):
                return base.plan_rows(m, model)
        return []

    def probe_steps(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, autocast,
                    num_classes: int, context: MethodContext = NO_CONTEXT) -> list[ProbeStep]:
        """The member's own probe steps (checkpoint: its plan applied to the stacked model),
        else the one step of the stacked model."""
        for m in self.members:  # at most one member has them (_check)
            if base.has(m, "probe_steps"):
                return base.probe_steps(m, model, x, y, autocast=autocast,
                                        num_classes=num_classes, context=context)
        return [ProbeStep(model, x, y)]


@contextlib.contextmanager
def _inside(factories: list) -> Iterator[None]:
    """Fresh hooks of the members, entered outermost first, marked as inside a checkpoint."""
    with contextlib.ExitStack() as stack:
        for make in factories:
            hooks = make()
            hooks.inside_checkpoint = True
            stack.enter_context(hooks)
        yield


def _check(members: dict[str, Any], name: str) -> None:
    """One-line ConfigError for every stack that cannot work: the rules of every stack, then
    each member's own (`check_stack`)."""
    where = f"method={name}"
    if len(members) < 2:
        raise ConfigError(f"{where}: a stack needs at least two methods, got "
                          f"{len(members)} (members are method.<name> nodes)")
    for key, m in members.items():
        kind = m.name
        if key != kind:
            raise ConfigError(f"{where}: method.{key} holds method {kind}; a member's key is its "
                              f"method's name (so a method appears once)")
        if isinstance(m, Stack):
            raise ConfigError(f"{where}: stacks do not nest; list the members of {kind}")
        if kind == "none":
            raise ConfigError(f"{where}: none adds nothing to a stack")
        if base.has(m, "fit"):
            raise ConfigError(f"{where}: {kind} changes the training procedure (its own "
                              f"training loop) and stacks with nothing")
    ranks = [RANK.get(k, INNER) for k in members]
    for (a, ra), (b, rb) in zip(zip(members, ranks), zip(list(members)[1:], ranks[1:])):
        if rb < ra:
            raise ConfigError(f"{where}: {b} must come before {a} (outermost first: "
                              f"checkpoint, offload, then pool/prune/quantize)")
    for m in members.values():
        try:
            base.check_stack(m, list(members))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
