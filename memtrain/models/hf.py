"""Causal language models by transformers' model type (`model=hf model.name=llama`): the type's
config class (`AutoConfig.for_model`) at the sizes the config node gives, then
`AutoModelForCausalLM.from_config`: random weights, nothing fetched (memtrain/config/offline.py).

The data sets the vocabulary (`vocab_size`: dataset.vocab_size) and the context
(`max_position_embeddings`: dataset.seq_len). conf/model/hf.yaml declares the sizes, by
transformers' common names (a type's own names, gpt2's `n_embd` or opt's `ffn_dim`, are mapped):

    num_hidden_layers, hidden_size     null: the type's own default (its published size)
    num_attention_heads                null: hidden_size / the type's own head size (at least 1,
                                       a divisor of hidden_size where the type has no head_dim)
    num_key_value_heads                null: num_attention_heads (where the type has it)
    head_dim                           null: hidden_size / num_attention_heads (where it has it)
    intermediate_size                  null: hidden_size times the type's own MLP ratio

Any other key of the type's config is free-form: `+model.config.rope_theta=10000`; a key the
type's config does not have is refused with the closest it has. An inconsistent set (heads that
do not divide the hidden size, key-value heads that do not divide the heads) is refused in one
line naming the keys.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import memtrain.models.fake as fake
from memtrain.config import offline
from memtrain.errors import ConfigError
from memtrain.models.chain import remember_input

INSTALL = "pip install 'memtrain[hf]' (transformers>=5,<6)"
# run-set keys: where each comes from
RESERVED = {"vocab_size": "dataset.vocab_size", "max_position_embeddings": "dataset.seq_len",
            "n_positions": "dataset.seq_len", "model_type": "model.name",
            "dtype": "trainer.precision", "torch_dtype": "trainer.precision",
            "use_cache": "off while training", "architectures": "model.name"}
MLP_KEYS = ("intermediate_size", "n_inner", "ffn_dim")  # a type's name for the MLP width
ATTENTION = ("eager", "sdpa")


class CausalLM(nn.Module):
    """A transformers causal LM as memtrain's loop calls a model: token ids [B, T] in, logits
    [B, T, vocab] out (no cache, no loss: the loop computes the loss)."""

    task = "lm"

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.arch_name = type(lm).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, vocab]
        return self.lm(input_ids=x, use_cache=False).logits


def transformers_module():
    """transformers, or the one-line refusal that says how to install it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model=hf needs transformers, which is not installed: "
                          f"{INSTALL}") from None
    return transformers


def hf_model(num_classes: int, input_shape: tuple[int, ...], name: str = "llama",
             config: dict[str, Any] | None = None, attn_implementation: str = "sdpa"
             ) -> nn.Module:
    """A causal LM of transformers' model type `name` (see the module)."""
    config = offline.check_kwargs("model.config", config, RESERVED)  # before any import
    name = hf_name(name)
    _check_attention(attn_implementation)
    if len(input_shape) != 1:
        raise ConfigError(f"model=hf is a language model and needs token data "
                          f"(dataset=tokens or dataset=text), got {input_shape} inputs")
    transformers = transformers_module()
    default = transformers.AutoConfig.for_model(name)
    kw = sizes(name, default, config)
    kw.update(vocab_size=num_classes, max_position_embeddings=input_shape[0])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids the vocabulary lacks
        if key not in config and _out_of(getattr(default, key, None), num_classes):
            kw[key] = None
    try:
        cfg = transformers.AutoConfig.for_model(name, **kw)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model=hf model.name={name}: {str(e).splitlines()[0]}") from None

    def make() -> nn.Module:
        return transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation=attn_implementation, dtype=torch.get_default_dtype())

    try:
        return remember_input(CausalLM(fake.build(make)), input_shape, num_classes)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model=hf model.name={name}: {str(e).splitlines()[0]}") from None


def precheck(node: dict[str, Any]) -> None:
    """The checks of `hf_model` that need no data (offline.precheck): the type, the keys the
    run sets, the attention, the sizes."""
    config = offline.check_kwargs("model.config", node.get("config"), RESERVED)
    name = hf_name(node.get("name"))
    _check_attention(node.get("attn_implementation", "sdpa"))
    sizes(name, transformers_module().AutoConfig.for_model(name), config)


def _check_attention(attn_implementation: Any) -> None:
    if attn_implementation not in ATTENTION:
        raise ConfigError(f"model.attn_implementation must be one of {', '.join(ATTENTION)}, "
                          f"got {attn_implementation!r}")


def hf_name(name: Any) -> str:
    """`name` if it is a transformers model type with a causal LM class, else the one-line
    refusal: the closest types, or how to install transformers."""
    name = offline.check_name("model.name", name, "transformers")
    offline.offline()
    transformers_module()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if name in causal:
        return name
    if name in CONFIG_MAPPING:
        raise ConfigError(f"model.name={name}: transformers' {name} has no causal LM class; "
                          f"types that have one: {', '.join(causal[:12])}, ... ({len(causal)})")
    raise offline.unknown("model.name", name, CONFIG_MAPPING.keys(), "transformers' model types",
                          "transformers' CONFIG_MAPPING lists them")


def _out_of(ids: Any, vocab: int) -> bool:
    ids = ids if isinstance(ids, list) else [ids]
    return any(isinstance(i, int) and not 0 <= i < vocab for i in ids)


def sizes(name: str, default: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The config keys to set: `given` (model.config) with null sizes derived and every key
    mapped to the type's own name; ConfigError for a key the type lacks or an inconsistent set."""
    own = {**default.to_dict(), **{k: None for k in getattr(default, "attribute_map", {})}}
    mlp = next((k for k in MLP_KEYS if k in own), None)
    out: dict[str, Any] = {}
    for key, value in given.items():
        if key in MLP_KEYS and mlp is not None:
            key = mlp
        if key not in own:
            if value is None:  # a declared size this type has no key for, left unset
                continue
            import difflib

            close = difflib.get_close_matches(key, sorted(own), n=3, cutoff=0.6)
            raise ConfigError(f"model.config.{key}: transformers' {name} config has no such "
                              f"key" + (f"; closest: {', '.join(close)}" if close else ""))
        if value is not None:
            _check_size_value(key, value)
            out[key] = value
    hidden = out.get("hidden_size")
    if hidden is None:
        return out  # the type's own sizes, and whatever else was given
    h0 = getattr(default, "hidden_size", None)
    heads0 = getattr(default, "num_attention_heads", None)
    hd0 = getattr(default, "head_dim", None) if "head_dim" in own else None
    head_size = hd0 or (h0 // heads0 if h0 and heads0 else 64)
    has_head_dim = "head_dim" in own
    heads = out.get("num_attention_heads")
    if heads is None and "num_attention_heads" in own:
        heads = max(1, hidden // min(head_size, hidden))
        if not has_head_dim:
            while hidden % heads:
                heads -= 1
        out["num_attention_heads"] = heads
    if heads is not None and has_head_dim and "head_dim" not in out:
        if hidden % heads:
            raise ConfigError(f"model.config.hidden_size={hidden} is not a multiple of "
                              f"model.config.num_attention_heads={heads}: choose heads that "
                              f"divide it, or set model.config.head_dim")
        out["head_dim"] = hidden // heads
    elif heads is not None and not has_head_dim and hidden % heads:
        raise ConfigError(f"model.config.hidden_size={hidden} is not a multiple of "
                          f"model.config.num_attention_heads={heads} ({name} has no head_dim)")
    if "num_key_value_heads" in own and heads is not None:
        kv = out.setdefault("num_key_value_heads", heads)
        if heads % kv:
            raise ConfigError(f"model.config.num_key_value_heads={kv} must divide "
                              f"model.config.num_attention_heads={heads}")
    i0 = getattr(default, mlp, None) if mlp else None
    if mlp and mlp not in out and i0 and h0:
        out[mlp] = max(1, round(i0 * hidden / h0))
    return out


def _check_size_value(key: str, value: Any) -> None:
    sized = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", *MLP_KEYS)
    if key in sized and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"model.config.{key} must be a positive integer, got {value!r}")


hf_model.precheck = precheck
