"""Every option of the conf tree, fed hostile values: refused in one line or accepted as valid.

Generated from conf/ (each option of each group choice, the walker's registry), so a new option
is covered the day it lands. Each value goes the way a command-line value goes, in-process and
without training: Hydra's override parser, memtrain's type check against the option's default
(`validate._type_error`, as `memtrain` runs it before Hydra), then the builder that takes the
option when a job starts (the trainer's checks, the optimizer and schedule, the dataset, the
model on a tiny input, the method applied to a tiny model). Each must either raise one
ConfigError line (the CLI's exit 2) or accept the value; anything else (a traceback, a message
of several lines, an error that names no option) fails here.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import BY_NAME, conf_options, language_model
from omegaconf import DictConfig, ListConfig, OmegaConf
from walker import METHODS, MODELS

from memtrain import optim
from memtrain.config import loader, validate
from memtrain.errors import ConfigError
from memtrain.run import runner

HOSTILE = ["nan", "inf", "-inf", "1e300", "-1", "0", "''", "[]", "[1,2]", "{a: 1}", "true",
           "null", "'$(touch pwned)'", "'; rm -rf ~'", "'ünïcødé ✓'", "'../../../etc/passwd'",
           "99999999999999999999"]
SMALL = ["dataset.train_size=8", "dataset.test_size=4", "dataset.image_size=8", "model=mlp6",
         "trainer=smoke"]
# dataset choices that need files: their options are walked on the synthetic default's builder
# (the file-backed builders' own bad input has its tests in test_bad_input.py)
DATASETS = ["synthetic"]


LM_DATASETS = ["tokens", "text"]
# model=hf's `config` is walked key by key: the node as a whole set to null is the type's
# published size (llama: 7B parameters, built for real here)
BY_KEY = {("hf", "model.config")}
# the full-size transformers' options are walked on one layer (and a ViT-B/16 on 16 px images,
# which its 16 px patches divide)
SHRINK = {"gpt2_small": ["model.layers=1"], "vit_b16": ["model.layers=1"]}


def _base(model: str) -> tuple[str, ...]:
    """The tiny selection a model's options are walked on."""
    if language_model(model):
        return ("dataset=tokens", "dataset.seq_len=8", "dataset.train_size=8",
                "dataset.test_size=4", "trainer=smoke", *SHRINK.get(model, []))
    size = ["dataset.image_size=16"] if model == "vit_b16" else \
        ["dataset.image_size=32"] if model in BY_NAME else []  # timm's ConvNeXt: >= 32 px
    return (*SMALL, *size, *SHRINK.get(model, []))


@functools.cache
def composed(selection: tuple[str, ...]) -> DictConfig:
    """The config `loader.compose` gives for a selection, without its checks: the selections
    are valid (test_config composes and checks every option), and the cases are enumerated
    at collection, where every worker composes each of them (with the checks, 20 s a worker)."""
    with loader.session():
        cfg = loader.hydra_compose("config", list(selection), shared=True)  # read only here
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))


def _leaves(node, prefix: str) -> list[str]:
    out = []
    for k, v in node.items():
        if k == "_target_":
            continue
        key = f"{prefix}.{k}"
        out += _leaves(v, key) if isinstance(v, DictConfig) and "_target_" in v else [key]
    return out


def cases() -> list[tuple[tuple[str, ...], str]]:
    """(selection, key) for every option: trainer and optim on the defaults, each method's and
    each model's own options with that choice."""
    out = []
    base = tuple(SMALL)
    cfg = composed(base)
    for group in ("trainer", "optim", "dataset"):
        out += [(base, k) for k in _leaves(cfg[group], group)]
    for group, options in (("method", METHODS), ("model", [*MODELS, *BY_NAME]),
                           ("optim", conf_options("optim"))):
        for option in options:
            sel = (*_base(option if group == "model" else "mlp6"), f"{group}={option}")
            for k in _leaves(composed(sel)[group], group):
                node = OmegaConf.select(composed(sel), k)
                out += [(sel, f"{k}.{c}") for c in node] if (option, k) in BY_KEY else [(sel, k)]
    for dataset in LM_DATASETS:  # token data: walked with a language model
        sel = ("model=gpt_nano", "model.layers=1", "trainer=smoke", f"dataset={dataset}",
               "dataset.seq_len=8")
        out += [(sel, k) for k in _leaves(composed(sel)["dataset"], "dataset")]
    return sorted(set(out))


# The random draws of weight initialisation (a uniform or normal fill of every weight), replaced
# by zeros here: what a value does to a build is its shapes, checks and wiring, never the
# weights' values, and the draws were about two fifths of this file's time (ResNet-50 and the
# transformers built once per value of each of their options).
_DRAWN = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
          "xavier_uniform_", "xavier_normal_", "orthogonal_")


def _zeros(tensor, *args, **kwargs):
    with torch.no_grad():
        return tensor.zero_()


@pytest.fixture(autouse=True)
def _weights_not_drawn(monkeypatch):
    for name in _DRAWN:
        monkeypatch.setattr(torch.nn.init, name, _zeros)


def build_without_training(cfg: DictConfig) -> None:
    """What a job builds before its first step, on tiny sizes: raises what the job would."""
    t = runner.trainer_of(cfg)
    from memtrain.run import probes

    probes.check(t)
    data, model, method = runner.build(cfg, t)
    kwargs = runner.kwargs_of(cfg.optim)
    opt = optim.build_optimizer(model, **kwargs)
    optim.build_scheduler(opt, 4, **kwargs)
    x, _ = next(iter(data.train.batches(2, torch.device("cpu"))))
    if t.max_steps != 0:
        model(x)


def outcome(selection: tuple[str, ...], key: str, text: str) -> str:
    """'refused: <line>' or 'accepted'; raises on anything the CLI would not turn into one
    line."""
    line = f"{key}={text}"
    try:
        (o,) = validate.parse([line])
        cfg = composed(selection)
        default = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
        if isinstance(default, (DictConfig, ListConfig)):
            default = OmegaConf.to_container(default, resolve=False)
        msg = validate._type_error(cfg, key, default, o.value())
        if msg:
            raise ConfigError(msg)
        cfg = copy.deepcopy(cfg)
        value = o.value()
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
        build_without_training(cfg)
    except ConfigError as e:
        assert "\n" not in str(e), (line, str(e))
        return f"refused: {e}"
    return "accepted"


def _id(v) -> str:
    """A case's id: the key, after the choice it is walked with (method=pool: method.pool...)."""
    if isinstance(v, str):
        return v
    chosen = [s.split("=")[1] for s in v if s.startswith(("method=", "optim="))]
    return chosen[-1] if chosen else next(s.split("=")[1] for s in reversed(v)
                                          if s.startswith("model="))


@pytest.mark.parametrize("selection,key", cases(), ids=_id)
def test_hostile_values_are_refused_in_one_line_or_valid(selection, key):
    torch.manual_seed(0)
    for text in HOSTILE:
        outcome(selection, key, text)
