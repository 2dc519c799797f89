"""`method.strategy=native`: the model's own activation checkpointing, switched on as its library
says, the peer a plan is measured against on the same model.

- timm: `model.set_grad_checkpointing(True)` (its forward then runs `checkpoint_seq` over its
  blocks or stages; non-reentrant unless TIMM_REENTRANT_CKPT says otherwise);
- transformers: `activation_checkpointing_enable({"use_reentrant": False})` (before 5.x's
  rename: `gradient_checkpointing_enable`): every decoder layer recomputed in backward.

Found on the model or, for a wrapper (memtrain's hf.py CausalLM, a user's module around a
library's model), on the first of its submodules that has one. A model with neither, or whose
library refuses (an architecture timm or transformers does not checkpoint), is refused in one
line.
"""

from __future__ import annotations

from torch import nn

from memtrain.errors import ConfigError
from memtrain.models.chain import model_class

TIMM = "set_grad_checkpointing"
HF = "gradient_checkpointing_enable"
HF_NEW = "activation_checkpointing_enable"  # transformers' name since its deprecation of HF


def owner(model: nn.Module) -> tuple[nn.Module, str] | None:
    """(module, method name): the outermost module with its own checkpointing switch."""
    for m in model.modules():
        for name in (HF_NEW, HF, TIMM):
            if callable(getattr(m, name, None)):
                return m, name
    return None


def enable(model: nn.Module) -> None:
    """Switch the model's own checkpointing on, in place; ConfigError where it has none."""
    cls = model_class(model)
    what = f"{cls.__name__} ({cls.__module__}.{cls.__qualname__})"
    found = owner(model)
    if found is None:
        raise ConfigError(f"method.strategy=native uses the model's own checkpointing (timm's "
                          f"{TIMM}(), transformers' {HF}()); {what} has neither: use "
                          f"method.strategy=budget (or uniform, sqrt, selective)")
    module, name = found
    try:
        if name == HF_NEW:
            module.activation_checkpointing_enable({"use_reentrant": False})
        elif name == HF:
            module.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            module.set_grad_checkpointing(True)
    except (AssertionError, ValueError, NotImplementedError, TypeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"method.strategy=native: {what} does not checkpoint itself "
                          f"({name}: {msg}); use method.strategy=budget") from None
