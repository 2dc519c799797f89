"""run_ids stay: a run's id is the hash of its config, and old sweeps find their runs by it
(trainer.resume, trainer.skip_done). The ids of every group choice (each with the others at
their defaults) are frozen in tests/run_ids.json; an option added later to an existing choice
keeps them only when listed in `loader.LATER_OPTIONS` with the value that reproduces the old
runs. A change of what a config computes (a default value, a `_target_` that moved without a
re-export) changes its id on purpose: freeze again with `python tests/test_run_ids.py --freeze`
and say so in the commit. (Mixed command lines are added to the file by hand, with the id the
code before a change computes.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import conf_options
from omegaconf import OmegaConf

from memtrain.config import loader

FROZEN = Path(__file__).with_name("run_ids.json")
GROUPS = ("dataset", "model", "method", "optim", "trainer", "recipe", "experiment")


def selections() -> list[list[str]]:
    """Every group choice alone, and the mixed command lines frozen beside them (a method with
    its options, a recipe's model on another dataset, driving options that stay out of the id:
    first stored when the runner was restructured)."""
    frozen = json.loads(FROZEN.read_text()) if FROZEN.exists() else {}
    own = [[]] + [[f"{g}={o}"] for g in GROUPS for o in conf_options(g)]
    mixed = [k.split() for k in frozen if k != "(defaults)" and k.split() not in own]
    return own + mixed


def current(selection_list: list[list[str]]) -> dict[str, str]:
    """run_id of each selection, composed as the CLI composes it (one Hydra session)."""
    from hydra import compose

    out = {}
    with loader.session():
        for sel in selection_list:
            cfg = compose("config", overrides=sel)
            cfg = OmegaConf.create({k: cfg[k] for k in cfg if k != "hydra"})
            try:
                rid = loader.run_id(cfg)
            except Exception:  # an unset ${oc.env:...}: hashed as written, as the launcher does
                rid = loader.run_id(cfg, resolve=False)
            out[" ".join(sel) or "(defaults)"] = rid
    return out


@pytest.mark.slow
def test_run_ids_of_existing_configs_are_unchanged():
    frozen = json.loads(FROZEN.read_text())
    now = current(selections())
    changed = {k: (frozen[k], v) for k, v in now.items() if k in frozen and frozen[k] != v}
    assert not changed, (
        f"run_id changed for {changed} (frozen -> now): an option added at its default must be "
        "listed in memtrain.loader.LATER_OPTIONS; a moved _target_ must stay importable by its "
        "old name; a changed default is a new run (freeze again: python tests/test_run_ids.py "
        "--freeze)")
    # every frozen choice still exists (a removed one orphans its sweeps: say so by freezing)
    assert set(frozen) <= set(now), sorted(set(frozen) - set(now))


@pytest.mark.parametrize("path,default,value", [
    ("trainer.toy_option", False, True),
    ("method.toy_bits", 8, 4),
    ("model.toy_width", 1.0, 2.0),
])
def test_an_option_added_at_its_default_keeps_old_run_ids(monkeypatch, path, default, value):
    """A toy option appears in the composed config (as it would once a YAML or the trainer
    schema gains it): unregistered, it renames the run; registered in LATER_OPTIONS, the old id
    stays at the default and a new one comes at any other value."""
    cfg, _ = loader.compose(["method=quantize", "model=mlp6"])
    old = loader.run_id(cfg)

    def with_option(v):
        c = OmegaConf.to_container(cfg)
        group, key = path.split(".")
        c[group][key] = v
        return OmegaConf.create(c)

    assert loader.run_id(with_option(default)) != old  # the reason the list exists
    monkeypatch.setitem(loader.LATER_OPTIONS, path, default)
    assert loader.run_id(with_option(default)) == old
    if isinstance(default, float):  # as the typed trainer node or a YAML may write it
        assert loader.run_id(with_option(int(default))) == old
    assert loader.run_id(with_option(value)) not in (old, loader.run_id(with_option(default)))
    assert loader.run_id(cfg) == old  # a config without the option at all: the same id


def test_a_true_option_is_not_its_default_of_one(monkeypatch):
    """True == 1 in Python; an option whose default is 1 set to True is another run."""
    cfg, _ = loader.compose(["model=mlp6"])
    c = OmegaConf.to_container(cfg)
    c["trainer"]["toy_flag"] = True
    monkeypatch.setitem(loader.LATER_OPTIONS, "trainer.toy_flag", 1)
    assert loader.run_id(OmegaConf.create(c)) != loader.run_id(cfg)


def test_find_max_batch_margin_changes_only_the_ids_of_runs_that_search():
    """The margin options tune find_max_batch only: without the probe any value keeps the id;
    with it, the values that reproduce the search before them (no headroom, no context, no
    rounding: LATER_OPTIONS) keep the id, and the defaults (headroom 0.1) are another run."""
    rid = lambda *o: loader.run_id(loader.compose(["model=mlp6", *o])[0])  # noqa: E731
    assert rid() == rid("trainer.max_batch_headroom=0.3", "trainer.max_batch_multiple=8",
                        "trainer.cuda_context_gb=1.5")
    search = ["trainer.find_max_batch=true", "trainer.gpu_memory_gb=2"]
    old = [*search, "trainer.max_batch_headroom=0", "trainer.cuda_context_gb=0"]
    cfg, _ = loader.compose(["model=mlp6", *search])
    before = OmegaConf.to_container(cfg)
    for k in ("max_batch_headroom", "max_batch_multiple", "cuda_context_gb"):
        del before["trainer"][k]  # a config composed before the options existed
    assert rid(*old) == loader.run_id(OmegaConf.create(before))
    assert rid(*search) != rid(*old)


if __name__ == "__main__" and sys.argv[1:] == ["--freeze"]:
    FROZEN.write_text(json.dumps(current(selections()), indent=1, sort_keys=True) + "\n")
    print(f"froze {FROZEN.name}")
