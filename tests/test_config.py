"""Every conf option composes; bad input fails with one line that names the valid choices."""

import dataclasses

import hydra.utils
import pytest
import torch
import yaml
from conftest import CONF, conf_options
from omegaconf import OmegaConf

from memtrain import api
from memtrain.data import Data
from memtrain.errors import ConfigError
from memtrain.optim import build_optimizer, build_scheduler
from memtrain.run import runner

GROUPS = ["dataset", "model", "method", "optim", "trainer"]


# the synthetic data small enough that every model and method builds in a moment
SMALL = ["dataset.train_size=8", "dataset.test_size=8"]


def _instantiate(group: str, option: str, cfg):
    """Build what the option's node describes, the way a run builds it, and check its kind."""
    if group == "trainer":
        t = runner.trainer_of(cfg)
        yaml = OmegaConf.to_container(cfg.trainer, resolve=True)
        assert dataclasses.asdict(t) == yaml
    elif group == "optim":
        kw = runner.kwargs_of(cfg.optim)
        opt = build_optimizer(torch.nn.Linear(4, 2), **kw)
        assert type(opt).__name__.lower() == cfg.optim.name
        assert build_scheduler(opt, 10, **kw).get_last_lr()[0] > 0
    elif group == "dataset":
        try:
            data = runner.build_data(cfg)
        except ConfigError as e:  # a dataset that is not on this machine: the documented line
            assert f"dataset {option} not found" in str(e) or "is not a folder" in str(e), e
            return
        assert isinstance(data, Data) and len(data.train) > 0 and len(data.test) > 0
    else:  # model or method: built on data, applied, and one forward pass
        data, model, method = runner.build(cfg)
        assert isinstance(method, runner.Method)
        assert method.name == (option if group == "method" else "none")
        x, _ = next(iter(data.train.batches(2, torch.device("cpu"))))
        # a classifier's logits per sample, a language model's per token
        lm = data.task == "lm"
        assert model(x).shape == ((2, *data.input_shape) if lm else (2,)) + (data.num_classes,)


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in conf_options(g)])
def test_every_option_composes_and_builds(tmp_path, group, option, user_factory):
    overrides = [f"{group}={option}"]
    if group != "dataset" or option == "synthetic":  # the default dataset, made small
        overrides += SMALL
    if option == "imagenet":  # its folder is required (and checked before a run): a tiny one
        from PIL import Image

        for split in ("train", "val"):
            for cls in ("a", "b"):
                (tmp_path / split / cls).mkdir(parents=True)
                Image.new("RGB", (8, 8)).save(tmp_path / split / cls / "x.png")
        overrides += [f"dataset.data_dir={tmp_path}", "dataset.image_size=8", "dataset.workers=0"]
    if group == "method":  # a model every method applies to, small
        overrides += ["model=mlp6", "dataset.image_size=8"]
    cfg, choices = api.compose(overrides)
    assert choices[group] == option
    assert "_target_" in cfg.model and "_target_" in cfg.method and "_target_" in cfg.dataset
    _instantiate(group, option, cfg)


def _targets(node) -> set[str]:
    if isinstance(node, dict):
        own = {node["_target_"]} if isinstance(node.get("_target_"), str) else set()
        return own.union(*(_targets(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_targets(v) for v in node))
    return set()


def test_the_optim_schema_is_what_the_builders_take():
    """schema.Optim (what the config layer checks an optim node against) lists exactly the
    keyword arguments of build_optimizer and build_scheduler, with their types and defaults
    (each builder takes the other's keys through **kwargs), and each conf/optim file sets only
    those keys."""
    import inspect
    import typing

    from memtrain.config.schema import Optim

    fields = {f.name: f for f in dataclasses.fields(Optim)}
    taken = {}
    for fn in (build_optimizer, build_scheduler):
        hints = typing.get_type_hints(fn)
        for p in inspect.signature(fn).parameters.values():
            if p.kind is p.KEYWORD_ONLY or p.default is p.empty or p.kind is p.VAR_KEYWORD:
                continue  # the model, the optimizer, the step count, the other's **kwargs
            taken[p.name] = (hints[p.name], p.default)
    assert {k: (typing.get_type_hints(Optim)[k], f.default if f.default is not dataclasses.MISSING
                else f.default_factory()) for k, f in fields.items()} == taken
    for path in sorted((CONF / "optim").glob("*.yaml")):
        assert set(yaml.safe_load(path.read_text())) <= set(fields), path.name


def test_every_target_in_conf_resolves():
    """Every `_target_` in conf/ (methods, models, datasets, Hydra plugins and callbacks) names
    something importable. The strings are hashed into each run's run_id, so code that moves
    keeps them working (a package re-exports its class) instead of editing the YAMLs."""
    targets = set().union(*(_targets(yaml.safe_load(f.read_text(encoding="utf-8")))
                            for f in sorted(CONF.rglob("*.yaml"))))
    assert {"memtrain.methods.checkpoint.CheckpointMethod",
            "memtrain.methods.synthetic.Synthetic", "memtrain.methods.stack.Stack"} <= targets
    for t in sorted(targets):
        assert callable(hydra.utils.get_method(t)), t


@pytest.mark.parametrize("exp", conf_options("experiment"))
def test_every_experiment_composes(exp):
    cfg, choices = api.compose([f"experiment={exp}"])
    assert choices["experiment"] == exp


# Unknown options are refused before Hydra runs (in this process: cli_checks); the trainer's
# ranges are checked on the composed config, inside Hydra's task (a real command).
@pytest.mark.parametrize("override,expected", [
    ("model=nosuch", "unknown model 'nosuch'; choose one of: efficientnet_b0"),
    ("method=nosuch", "unknown method 'nosuch'; choose one of:"),
    ("dataset=imagenette", "unknown dataset 'imagenette'; choose one of: cifar10"),
])
def test_unknown_option_is_one_line_error(in_tmp, cli_checks, override, expected):
    _one_line_exit_2(cli_checks(override, "trainer=smoke"), expected)


@pytest.mark.parametrize("override,expected", [
    ("trainer.batch_size=0", "trainer.batch_size must be in [1, inf], got 0"),
    ("trainer.precision=fp8",
     "trainer.precision must be one of fp32, bf16, fp16, bf16-true, got 'fp8'"),
    ("trainer.epochs=0", "trainer.epochs must be in [1, inf], got 0"),
])
@pytest.mark.slow
def test_bad_trainer_value_is_one_line_error(in_tmp, override, expected):
    """The trainer's ranges (schema.Trainer) are checked before api.run writes anything (the
    job's own check, runner.check, run by loader.check_overrides): no run folder; the same
    through the real command is test_validate.py::test_cli_exits_2_with_one_line."""
    with pytest.raises(ConfigError) as e:
        api.run([override, "trainer=smoke"], out_dir=in_tmp / "run")
    msg = str(e.value)
    assert expected in msg and "\n" not in msg, msg
    assert list(in_tmp.iterdir()) == []


def _one_line_exit_2(p, expected: str) -> None:
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip()
    assert expected in err, err
    assert "Traceback" not in p.stderr + p.stdout
    assert len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_missing_dataset_folder_names_the_path(in_tmp):
    """In process (the job's ConfigError; exit 2 and one line from the real command:
    test_validate.py::test_cli_exits_2_with_one_line holds that path)."""
    with pytest.raises(ConfigError) as e:
        api.run(["dataset=cifar10", f"dataset.data_dir={in_tmp}/nodata", "trainer=smoke"],
                out_dir=in_tmp / "run")
    msg = str(e.value)
    assert "dataset cifar10 not found (looked in" in msg and "nodata" in msg, msg
    assert "dataset.download=true" in msg and "\n" not in msg, msg


@pytest.mark.slow
def test_composed_configs_are_cached_but_follow_the_files_and_are_copies(tmp_path, monkeypatch):
    """loader.hydra_compose caches a composition within a process (each api.run composes ~7
    times): an edited preset, a new preset file, another folder (hydra.runtime.cwd, where the
    hydra node is asked for) or an edited structured config composes afresh, and each caller
    gets its own copy to change."""
    from hydra.core.config_store import ConfigStore

    from memtrain.config import loader

    mine = tmp_path / "mine" / "trainer"
    mine.mkdir(parents=True)
    preset = mine / "mine.yaml"
    preset.write_text("defaults:\n  - smoke\n  - _self_\nbatch_size: 3\n")

    def batch(overrides=("trainer=mine",)):
        with loader.session(config_dir=str(tmp_path / "mine")):
            return loader.hydra_compose("config", list(overrides), return_hydra_config=True)

    first = batch()
    assert first.trainer.batch_size == 3
    first.trainer.batch_size = 99  # the caller's copy: the cache keeps its own
    assert batch().trainer.batch_size == 3
    preset.write_text("defaults:\n  - smoke\n  - _self_\nbatch_size: 5\n")  # same size, new bytes
    assert batch().trainer.batch_size == 5
    (mine / "other.yaml").write_text("defaults:\n  - smoke\n  - _self_\nbatch_size: 6\n")
    assert batch(["trainer=other"]).trainer.batch_size == 6
    assert batch().hydra.runtime.cwd != str(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert batch().hydra.runtime.cwd == str(tmp_path)  # another folder: composed there
    with loader.session():
        assert "hydra" not in loader.hydra_compose("config", ["trainer=smoke"])
        assert loader.hydra_compose("config", ["trainer=smoke"]).trainer.batch_size == 8
        one, two = (loader.hydra_compose("config", ["trainer=smoke"], shared=True)
                    for _ in range(2))
        assert one is two and "hydra" not in one  # the readers' object: one, never changed
        assert loader.hydra_compose("config", ["trainer=smoke"]) is not one
    monkeypatch.chdir(mine)  # without the hydra node a config is the same in any folder
    with loader.session():
        assert loader.hydra_compose("config", ["trainer=smoke"], shared=True) is one
        cwd = loader.hydra_compose("config", ["trainer=smoke"], return_hydra_config=True)
        assert cwd.hydra.runtime.cwd == str(mine)

    cs = ConfigStore.instance()
    node = cs.repo["trainer"]["base_trainer.yaml"]
    with loader.session():
        before = loader._session_state()
    try:  # a structured config stored again (a plugin, a test): the key changes
        cs.store(group="trainer", name="base_trainer", node=node.node, provider=node.provider)
        with loader.session():
            assert loader._session_state() != before
    finally:
        cs.repo["trainer"]["base_trainer.yaml"] = node
    with loader.session():
        assert loader._session_state() == before


def test_compositions_of_the_same_options_share_a_defaults_list_and_merge(tmp_path):
    """Compositions that choose the same options with other values reuse one defaults list and
    one merge of its files (loader._parse_once), and equal Hydra's composition without them;
    other options, another option order or a config's own search path make their own."""
    from memtrain.config import loader

    extra = tmp_path / "extra" / "trainer"
    extra.mkdir(parents=True)
    (extra / "mine.yaml").write_text("defaults:\n  - smoke\n  - _self_\nbatch_size: 3\n")
    commands = [["trainer=smoke", "trainer.seed=3"],
                ["trainer=smoke", "trainer.seed=4", "method.budget_fraction=0.25",
                 "method=checkpoint"],
                ["method=checkpoint", "trainer=smoke", "hydra.job.name=x"],
                ["trainer=smoke", "trainer.batch_size=5", "method=checkpoint",
                 "+trainer.note=1", "hydra/launcher=parallel"],
                ["trainer=smoke", f"hydra.searchpath=[file://{tmp_path / 'extra'}]",
                 "trainer=mine"]]

    def composed(overrides, cold):
        if cold:  # every cache of the loader emptied: Hydra's own composition
            for cache in (loader._composed, loader._anywhere, loader._defaults, loader._merged):
                cache.clear()
        cfg = loader.hydra_compose("config", overrides, return_hydra_config=True)
        return OmegaConf.to_container(cfg, resolve=False)

    with loader.session():
        cold = [composed(o, cold=True) for o in commands]
        loader._defaults.clear(), loader._merged.clear()
        warm = [composed(o, cold=False) for o in commands]
        # smoke; smoke + checkpoint in two orders; those with the launcher: four defaults
        # lists, three merges (both orders list the same files); the searchpath's repository
        # has more than the session's: composed anew
        assert (len(loader._defaults), len(loader._merged)) == (4, 3)
        assert [composed(o, cold=False) for o in commands] == warm  # the same, from the cache
    assert warm == cold
    assert [c["trainer"]["seed"] for c in warm[:2]] == [3, 4]
    assert warm[1]["method"]["budget_fraction"] == 0.25 and warm[2]["hydra"]["job"]["name"] == "x"
    assert warm[3]["trainer"]["note"] == 1 and warm[4]["trainer"]["batch_size"] == 3
    assert warm[3]["hydra"]["runtime"]["choices"]["hydra/launcher"] == "parallel"


def test_each_config_file_is_parsed_once_per_bytes_and_handed_out_as_a_copy(tmp_path,
                                                                             monkeypatch):
    """Across compositions that miss hydra_compose's cache (other overrides), a file Hydra loads
    is parsed once for its bytes (loader._parse_once): an edited file is parsed again, and what
    Hydra gets is a copy it may change (it takes the defaults list out of what it loads)."""
    from omegaconf import OmegaConf

    from memtrain.config import loader

    mine = tmp_path / "trainer"
    mine.mkdir()
    preset = mine / "mine.yaml"
    preset.write_text("defaults:\n  - smoke\n  - _self_\nbatch_size: 3\n")
    parsed = []
    load = OmegaConf.load

    def counted(f):
        parsed.append(getattr(f, "name", f))
        return load(f)

    monkeypatch.setattr(OmegaConf, "load", counted)
    monkeypatch.setattr(loader, "_parsed", {})

    def compose(*overrides):
        with loader.session(config_dir=str(tmp_path)):
            return loader.hydra_compose("config", ["trainer=mine", *overrides])

    one = compose()
    assert one.trainer.batch_size == 3
    first = list(parsed)
    assert str(preset) in first and len(first) > 5  # the preset, conf/ and Hydra's own
    parsed.clear()
    two = compose("trainer.seed=1")  # another composition, of the same files
    assert parsed == []  # none parsed again, and their defaults lists applied as before
    assert {k: v for k, v in two.trainer.items() if k != "seed"} == \
        {k: v for k, v in one.trainer.items() if k != "seed"}
    preset.write_text("defaults:\n  - smoke\n  - _self_\nbatch_size: 4\n")  # same size
    assert compose("trainer.seed=2").trainer.batch_size == 4
    assert parsed == [str(preset)]
