"""The method contract (memtrain/methods/base.py): every built-in method has its members with
their types and hooks that take the contract's arguments; an object that is no method is
refused in one line; a stack declares its gradients from its members'; the context reaches the
hooks that take it."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import conf_options
from omegaconf import OmegaConf

import memtrain.methods.base as base
from memtrain import api
from memtrain.errors import ConfigError
from memtrain.methods.checkpoint import CheckpointMethod
from memtrain.methods.none import NoneMethod
from memtrain.methods.offload import OffloadMethod
from memtrain.methods.quantize import QuantizeMethod
from memtrain.methods.stack import Stack
from memtrain.run import runner

# what each built-in method declares (the contract's docstring says why)
EXACT = {"none": True, "checkpoint": True, "offload": True, "pool": False, "prune": False,
         "quantize": False, "synthetic": False, "checkpoint+quantize": False}

ANY = object()  # a stand-in argument: binding checks the parameters, not the types
CALLS = {  # each hook as its caller calls it: positional arguments, keyword arguments
    "check_device": ((torch.device("cpu"),), {}),
    "check_strategy": (("ddp",), {}),
    "check_trainer": ((ANY,), {}),
    "prepare": ((ANY, ANY, ANY, ANY, {}, base.NO_CONTEXT), {}),
    "fit": ((ANY, ANY, ANY, ANY), dict(trainer=ANY, device=ANY, checkpointer=ANY, loggers=[])),
    "probe_steps": ((ANY, ANY, ANY), dict(autocast=ANY, num_classes=10,
                                          context=base.NO_CONTEXT)),
    "plan_rows": ((ANY,), {}),
    "hooks": ((), {}),
    "check_stack": ((["checkpoint", "quantize"],), {}),
}


def test_every_hook_of_the_contract_is_called_here():
    assert set(CALLS) == set(base.HOOKS)


@pytest.mark.parametrize("option", conf_options("method"))
def test_every_built_in_method_satisfies_the_contract(option):
    cfg, _ = api.compose([f"method={option}"])
    method = runner.build_method(cfg.method)
    assert base.problems(method) == []
    assert isinstance(method, base.Method)
    assert isinstance(method.name, str) and method.name == option
    assert isinstance(method.grads_exact, bool)
    if option in EXACT:
        assert method.grads_exact is EXACT[option]
    assert base.columns(method) == {"grads_exact": method.grads_exact}
    for hook in base.HOOKS:
        if base.has(method, hook):
            args, kwargs = CALLS[hook]
            inspect.signature(getattr(method, hook)).bind(*args, **kwargs)
    if base.recomputes(method):
        assert method.inside is None or callable(method.inside)


class _NoWrap:
    name = "nowrap"


class _NoName:
    def wrap(self, model):
        return model


class _NumberName(_NoName):
    name = 3


class _SaysMaybe(_NoName):
    name = "maybe"
    grads_exact = "maybe"


@pytest.mark.parametrize("obj,why", [
    (_NoWrap(), "no `wrap`"), (_NoName(), "no `name`"), (_NumberName(), "`name` is int"),
    (_SaysMaybe(), "`grads_exact` is 'maybe', not true or false"),
])
def test_an_object_that_is_no_method_is_refused_in_one_line(obj, why):
    with pytest.raises(ConfigError, match=f"method.x: {type(obj).__name__} is not a method: "
                                          f"{why}") as e:
        base.check(obj, "method.x")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=f"method.quantize: {type(obj).__name__} is not a "
                                          f"method: {why}"):  # a stack's member, built in code
        Stack(checkpoint=CheckpointMethod(strategy="uniform"), quantize=obj)


def test_a_config_that_builds_no_method_is_refused_where_it_is_built():
    """A preset naming a trusted class that is no method (here the contract's own context) is
    refused where the runner builds it (before `wrap` is called on anything)."""
    node = OmegaConf.create({"_target_": "memtrain.methods.base.MethodContext"})
    with pytest.raises(ConfigError, match=r"method._target_=memtrain.methods.base.MethodContext: "
                                          r"MethodContext is not a method: no `name`; no `wrap`"
                       ) as e:
        runner.build_method(node)
    assert "\n" not in str(e.value)


def test_a_stack_is_exact_only_where_every_member_is():
    exact = Stack(checkpoint=CheckpointMethod(strategy="uniform"), offload=OffloadMethod())
    assert exact.grads_exact is True
    approx = Stack(checkpoint=CheckpointMethod(strategy="uniform"), quantize=QuantizeMethod())
    assert approx.grads_exact is False
    undeclared = Stack(checkpoint=CheckpointMethod(strategy="uniform"), mine=_Mine())
    assert undeclared.grads_exact is None and base.columns(undeclared) == {}
    _Mine.grads_exact = False
    try:
        assert Stack(offload=OffloadMethod(), mine=_Mine()).grads_exact is False
    finally:
        del _Mine.grads_exact


class _Mine:
    """A user's method: no `grads_exact`, a `prepare` and `probe_steps` that record their
    context."""

    name = "mine"

    def __init__(self):
        self.seen: list[base.MethodContext] = []

    def wrap(self, model):
        return model

    def prepare(self, model, x, y, autocast, carry, context):
        self.seen.append(context)
        return {}

    def probe_steps(self, model, x, y, *, autocast, num_classes, context):
        self.seen.append(context)
        return [base.ProbeStep(model, x, y, name="mine")]


def test_the_context_reaches_the_hooks_and_a_stack_keeps_its_cache_to_itself(tmp_path):
    """The context is handed on as it is; a stack's members get it without the cache folder
    (a profile's key does not see what the other members change); a method without a hook gets
    the hook's default."""
    x, y, model = torch.zeros(2, 4), torch.zeros(2).long(), torch.nn.Linear(4, 3)
    context = base.MethodContext(cache_dir=tmp_path, model_config={"_target_": "m", "width": 4},
                                 sharding=base.Sharding("fsdp", 4))
    mine = _Mine()
    assert base.prepare(mine, model, x, y, None, {}, context) == {}
    (step,) = base.probe_steps(mine, model, x, y, autocast=None, num_classes=3, context=context)
    assert step.name == "mine" and mine.seen == [context, context]
    stacked = _Mine()
    stack = Stack(offload=OffloadMethod(), mine=stacked)
    stack.prepare(model, x, y, None, {}, context)
    stack.probe_steps(model, x, y, autocast=None, num_classes=3, context=context)
    without_cache = base.MethodContext(model_config=context.model_config,
                                       sharding=context.sharding)
    assert stacked.seen == [without_cache, context]
    plain = NoneMethod()
    assert base.prepare(plain, model, x, y, None, {}, context) == {}
    (step,) = base.probe_steps(plain, model, x, y, autocast=None, num_classes=3)
    assert step.module is model and step.name == "" and base.plan_rows(plain, model) == []
    assert base.training_loop(plain, runner.train) is runner.train


def test_a_name_that_is_no_hook_is_a_programming_error():
    with pytest.raises(ValueError, match="no hook of the method contract"):
        base.has(_Mine(), "prepar")
