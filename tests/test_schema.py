"""Every numeric option in conf/ rejects NaN and inf, every integer option non-integers.

The cases are generated from the conf tree (every option file of every group, every key whose
type, from its builder's hint or its default, is a number or a list of numbers): a new option
is covered without editing this file.
"""

import dataclasses
import functools
import typing

import pytest
from conftest import CONF, conf_options
from omegaconf import OmegaConf

from memtrain.config import loader, schema, validate
from memtrain.errors import ConfigError

NUMERIC = (int, float)


def _numeric_keys() -> list[tuple[str, str, str, bool]]:
    """(group, option, key, is_list) for every numeric option in conf/."""
    out = []
    for group in ("dataset", "model", "method", "optim", "trainer"):
        for option in conf_options(group):
            node = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"))
            node.pop("defaults", None)
            for key in node:
                if key == "_target_":
                    continue
                ann = schema._strip_none(schema.expected_type(group, key, node, node[key]))
                elem = typing.get_args(ann)[0] if typing.get_origin(ann) in (list, tuple) else None
                if ann in NUMERIC or elem in NUMERIC:
                    out.append((group, option, key, elem is not None))
    return out


KEYS = _numeric_keys()


@functools.cache
def _compose(overrides: tuple[str, ...]):
    from hydra import compose

    with loader.session():
        return compose("config", overrides=list(overrides))


def test_the_generated_cases_cover_known_options():
    names = {f"{g}.{k}" for g, _, k, _ in KEYS}
    # null defaults get their type from the builder's hint, or the Trainer schema
    for key in ("method.sparsity", "method.budget_bytes", "method.kappa", "optim.lr",
                "optim.momentum", "optim.betas", "trainer.max_steps", "trainer.gpu_memory_gb",
                "trainer.grad_clip", "dataset.noise", "model.widths", "model.dropout"):
        assert key in names


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("group,option,key,is_list", KEYS,
                         ids=[f"{g}={o}:{k}" for g, o, k, _ in KEYS])
def test_every_numeric_option_rejects_non_finite(group, option, key, is_list, bad):
    value = f"[{bad}]" if is_list else bad
    parsed = validate.parse([f"{group}={option}", f"{group}.{key}={value}"])
    with pytest.raises(ConfigError) as e:
        validate.check_values(parsed, lambda o: _compose(tuple(o)))
    assert f"{group}.{key}" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("override", ["trainer.max_steps=2.5", "trainer.max_steps=range(0,2,0.5)",
                                      "trainer.seed=18446744073709551616", "trainer.epochs=true",
                                      "method=synthetic method.cuts=[1.5]"])
def test_integer_options_reject_non_integers(override):
    with pytest.raises(ConfigError, match="must be an integer"):
        loader.check_overrides(override.split())


def test_trainer_schema_matches_its_yaml():
    yaml = OmegaConf.to_container(OmegaConf.load(CONF / "trainer" / "default.yaml"))
    assert yaml.pop("defaults") == ["base_trainer", "_self_"]  # typed by the schema in Hydra
    fields = {f.name: f.default for f in dataclasses.fields(schema.Trainer)}
    assert fields == yaml


def test_composed_config_is_checked_too():
    """Values from presets, interpolations or the API never pass the override check."""
    cfg = OmegaConf.create({"method": {"_target_": "memtrain.methods.prune.PruneMethod",
                                       "sparsity": float("nan")},
                            "trainer": {"max_steps": 2.5}})
    with pytest.raises(ConfigError, match="method.sparsity must be a finite number, got nan"):
        schema.check_config(cfg, ("method", "trainer"))
    with pytest.raises(ConfigError, match="trainer.max_steps must be an integer, got 2.5"):
        schema.check_config(cfg, ("trainer",))


def test_cli_nan_in_a_sweep_exits_2_before_training(in_tmp, cli_checks):
    p = cli_checks("-m", "trainer=smoke", "model=mlp6", "method=prune",
                   "method.sparsity=0.5,nan", "hydra.sweep.dir=sw")
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip() == "memtrain: error: method.sparsity must be a finite number, got nan"
    assert not (in_tmp / "sw").exists()
