"""A config builds only memtrain's own classes (memtrain/config/trust.py), and a row names what ran.

Every hostile `_target_` is refused in one line with exit 2 before anything is imported or
trained: from the command line (set, `+`added, swept) and from a preset under --config-dir, in
each slot that builds something (method, model, dataset, Hydra's callbacks, launcher, sweeper
and logging). A package of the user's, registered under the `memtrain.trusted` entry point,
still runs (tests/test_registry.py's toy method does)."""

from __future__ import annotations

import pytest

from memtrain.config import trust
from memtrain.errors import ConfigError
from memtrain.run import runner

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8"]
HOSTILE = ["os.system", "builtins.exec", "subprocess.run", "memtrain.record.atomic_write",
           "memtrain.methods.none.nn.Module", "memtrain.data.torch.load", "posix.system"]
SLOTS = ["method", "model", "dataset", "hydra.callbacks.evil", "hydra.launcher", "hydra.sweeper"]


def _one_line_refusal(p, key: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"memtrain: error: {key}="), p.stderr


@pytest.mark.parametrize("slot", SLOTS)
@pytest.mark.parametrize("target", HOSTILE[:3])
def test_a_hostile_target_on_the_command_line_is_refused(in_tmp, cli_checks, slot, target):
    key = f"{slot}._target_"
    add = "+" if slot.startswith("hydra.callbacks") else ""
    p = cli_checks(f"{add}{key}={target}", "+method.command=touch pwned", *TINY)
    _one_line_refusal(p, key)
    assert not (in_tmp / "pwned").exists() and not (in_tmp / "runs").exists()


@pytest.mark.parametrize("target", HOSTILE)
def test_a_target_resolving_outside_memtrain_is_refused(cli_checks, target):
    """A trusted prefix is not enough: what the path resolves to must be defined there
    (memtrain.data.torch.load is torch's), and a slot takes only its own package
    (memtrain.record.atomic_write writes files: no method)."""
    p = cli_checks(f"method._target_={target}", *TINY)
    _one_line_refusal(p, "method._target_")


def test_logging_factories_and_swept_targets_are_checked(cli_checks):
    _one_line_refusal(cli_checks("hydra.job_logging.handlers.console.class=logging.os.system",
                                 *TINY), "hydra.job_logging.handlers.console.class")
    _one_line_refusal(cli_checks("-m", "method._target_=memtrain.methods.none.NoneMethod,"
                                 "subprocess.run", *TINY), "method._target_")


LOG = "hydra.job_logging"
WRITES_ANYWHERE = [  # a log file of the config's choosing, whose lines a shell would run
    f"+{LOG}.handlers.x.class=logging.FileHandler", f"+{LOG}.handlers.x.filename={{target}}",
    f"+{LOG}.formatters.evil.format='touch PWNED #%(message)s'",
    f"+{LOG}.handlers.x.formatter=evil",
    f"{LOG}.root.handlers=[console,file,x]"]


def test_a_log_file_of_the_configs_choosing_is_refused(in_tmp, cli_checks):
    """The issue's command: exit 2, one line naming the key, no file written anywhere."""
    target = in_tmp / "home" / ".bashrc"
    target.parent.mkdir()
    p = cli_checks(*TINY, "trainer.max_steps=1",
                   *(a.format(target=target) for a in WRITES_ANYWHERE))
    _one_line_refusal(p, f"{LOG}.handlers.x.filename")
    assert "must be ${hydra.runtime.output_dir}/NAME.log" in p.stderr
    assert not target.exists() and sorted(in_tmp.iterdir()) == [target.parent]


def test_logging_config_file_loader_is_refused(in_tmp, cli_checks):
    """logging.config.fileConfig runs code from its INI file: no handler memtrain uses."""
    (in_tmp / "evil.ini").write_text("[loggers]\nkeys=root\n")
    p = cli_checks(*TINY, f"+{LOG}.handlers.y.class=logging.config.fileConfig",
                   f"+{LOG}.handlers.y.fname=evil.ini")
    _one_line_refusal(p, f"{LOG}.handlers.y.class")
    assert "logging.StreamHandler (the console) or logging.FileHandler" in p.stderr
    assert sorted(p.name for p in in_tmp.iterdir()) == ["evil.ini"]


@pytest.mark.parametrize("overrides,key", [
    ([f"{LOG}.handlers.file.filename=${{hydra.runtime.output_dir}}/../up.log"],
     f"{LOG}.handlers.file.filename"),
    ([f"{LOG}.handlers.file.filename=${{hydra.runtime.output_dir}}/summary.json"],
     f"{LOG}.handlers.file.filename"),
    ([f"{LOG}.handlers.file.filename=${{oc.env:HOME}}/x.log"], f"{LOG}.handlers.file.filename"),
    (["hydra.job.name=../../escaped"], "hydra.job.name"),
    ([f"{LOG}.handlers.console.stream=ext://antigravity"], f"{LOG}.handlers.console.stream"),
    ([f"{LOG}.handlers.console.class=logging.handlers.SysLogHandler"],
     f"{LOG}.handlers.console.class"),
    ([f"+{LOG}.formatters.simple.class=logging.BufferingFormatter"],
     f"{LOG}.formatters.simple.class"),
    ([f"+{LOG}.formatters.simple.style='{{'"], f"{LOG}.formatters.simple.style"),
    ([f"{LOG}.formatters.simple.format=${{oc.env:HOME}}"], f"{LOG}.formatters.simple.format"),
    ([f"{LOG}.root.handlers=[console,nowhere]"], f"{LOG}.root.handlers"),
    (["+hydra.hydra_logging.handlers.f.class=logging.FileHandler",
      "+hydra.hydra_logging.handlers.f.filename=${hydra.runtime.output_dir}/h.log"],
     "hydra.hydra_logging.handlers.f.class"),
    (["hydra/hydra_logging=hydra_debug"], "hydra.hydra_logging.handlers.file.class"),
    (["-m", "trainer.seed=0,1", f"{LOG}.handlers.file.filename="
      "${hydra.runtime.output_dir}/a.log,/tmp/b.log"], f"{LOG}.handlers.file.filename"),
    (["-m", "hydra/sweeper=variants", "hydra.sweeper.variants=['method=none',"
      f"'{LOG}.handlers.file.filename=/tmp/c.log']"], "hydra.sweeper.variants[1]"),
])
def test_logging_may_only_use_memtrains_handlers(in_tmp, cli_checks, overrides, key):
    """Anything in a logging config but the console, a .log file in the run folder, plain
    formatters and filters and plain values: one line, exit 2, nothing written."""
    flags = [a for a in overrides if a.startswith("-")]  # before the overrides, as argparse's
    p = cli_checks(*flags, *TINY, *(a for a in overrides if a not in flags))
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"memtrain: error: {key}"), line
    assert list(in_tmp.iterdir()) == []


@pytest.mark.slow
def test_a_logging_preset_is_checked_and_memtrains_own_pass(in_tmp, cli_checks):
    """A preset of the user's (hydra/job_logging=<name> under --config-dir) is held to the same
    rule; Hydra's presets memtrain uses and a second .log file in the run folder pass."""
    folder = in_tmp / "mine" / "hydra" / "job_logging"
    folder.mkdir(parents=True)
    (folder / "evil.yaml").write_text(
        "version: 1\nhandlers:\n  f:\n    class: logging.FileHandler\n"
        "    filename: /tmp/evil.log\nroot:\n  handlers: [f]\n")
    (folder / "props.yaml").write_text(  # dictConfig's `.`: attributes set after building
        "version: 1\nhandlers:\n  c:\n    class: logging.StreamHandler\n"
        "    .:\n      baseFilename: /tmp/evil.log\nroot:\n  handlers: [c]\n")
    (folder / "filter.yaml").write_text(  # a filter's factory may be any callable
        "version: 1\nfilters:\n  f:\n    (): memtrain.report.command.main\n"
        "root:\n  filters: [f]\n")
    for name, key in (("evil", "handlers.f.filename"), ("props", "handlers.c.."),
                      ("filter", "filters.f.()")):
        p = cli_checks("--config-dir", str(in_tmp / "mine"), f"hydra/job_logging={name}", *TINY)
        _one_line_refusal(p, f"{LOG}.{key}")
    from memtrain.config import loader

    for ok in ([], ["hydra/job_logging=stdout"], ["hydra/job_logging=disabled"],
               [f"{LOG}.root.level=DEBUG", "hydra.verbose=true"],
               [f"+{LOG}.handlers.x.class=logging.FileHandler",
                f"+{LOG}.handlers.x.filename=${{hydra.runtime.output_dir}}/extra.log",
                f"{LOG}.root.handlers=[console,file,x]"]):
        loader.check_overrides([*TINY, *ok])


@pytest.mark.parametrize("preset,body,key", [
    ("method/evil", "_target_: os.system\ncommand: touch pwned\n", "method._target_"),
    ("model/evil", "_target_: builtins.exec\nsource: '1'\n", "model._target_"),
    ("dataset/evil", "_target_: subprocess.run\nargs: [touch, pwned]\n", "dataset._target_"),
    ("experiment/evil", "# @package _global_\nhydra:\n  callbacks:\n    x:\n"
     "      _target_: os.system\n      command: touch pwned\n", "hydra.callbacks.x._target_"),
    ("experiment/logs", "# @package _global_\nhydra:\n  job_logging:\n    formatters:\n"
     "      x:\n        (): os.system\n        command: touch pwned\n",
     "hydra.job_logging.formatters.x.()"),
    ("experiment/sneaky", "# @package _global_\nmethod:\n"
     "  _target_: memtrain.methods.quantize.QuantizeMethod\n", "method._target_"),
])
def test_a_hostile_preset_is_refused(in_tmp, cli_checks, preset, body, key):
    group, name = preset.split("/")
    (in_tmp / "mine" / group).mkdir(parents=True)
    (in_tmp / "mine" / group / f"{name}.yaml").write_text(body)
    rest = [a for a in TINY if not a.startswith((f"{group}=", f"{group}."))]
    p = cli_checks("--config-dir", str(in_tmp / "mine"), f"{group}={name}", *rest)
    _one_line_refusal(p, key)
    assert not (in_tmp / "pwned").exists()


@pytest.mark.parametrize("override,key", [
    ("method._target_=memtrain.methods.quantize.QuantizeMethod", "method._target_"),
    ("model._target_=memtrain.models.resnet18", "model._target_"),
    ("dataset._target_=memtrain.data.mnist", "dataset._target_"),
])
def test_a_row_names_what_ran(cli_checks, override, key):
    """`method=none method._target_=...quantize...` would run quantize and record method=none
    (the report's baseline): refused; the row's method, model and dataset are the options whose
    classes run."""
    p = cli_checks("method=none", override, *TINY)
    _one_line_refusal(p, key)
    assert "builds" in p.stderr


def test_the_runner_refuses_too(tmp_path):
    """The API and a launcher's jobs build through the runner, which checks again."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"_target_": "os.system", "command": "touch pwned"})
    with pytest.raises(ConfigError, match="method._target_=os.system"):
        runner.build_method(cfg)
    cfg = OmegaConf.create({"_target_": "memtrain.methods.none.nn.Module"})
    with pytest.raises(ConfigError, match="defined outside memtrain"):
        runner.build_method(cfg)
    assert type(runner.build_method(OmegaConf.create(
        {"_target_": "memtrain.methods.none.NoneMethod"}))).__name__ == "NoneMethod"


@pytest.mark.slow
def test_every_built_in_target_is_trusted():
    """The conf tree's own targets pass the rule they are held to (each in its slot)."""
    from conftest import conf_options
    from hydra import compose
    from omegaconf import OmegaConf

    from memtrain.config import loader

    with loader.session():
        for group in ("method", "model", "dataset"):
            for option in conf_options(group):
                cfg = compose("config", overrides=[f"{group}={option}"],
                              return_hydra_config=True)
                trust.check_config(OmegaConf.to_container(cfg, resolve=False))
        # the launcher presets are Hydra's ConfigStore's (memtrain's plugin and Hydra's own)
        launchers = loader.group_options("hydra/launcher", "config", [])
        assert {"local", "parallel", "slurm"} <= set(launchers), launchers
        for launcher in launchers:
            cfg = compose("config", overrides=[f"hydra/launcher={launcher}",
                                               "hydra/sweeper=variants"],
                          return_hydra_config=True)
            trust.check_config(OmegaConf.to_container(cfg, resolve=False))


def test_a_registered_package_is_trusted(tmp_path, monkeypatch):
    """The `memtrain.trusted` entry point of an installed package extends every slot."""
    pkg = tmp_path / "mymethods"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("class Mine:\n    name = 'mine'\n")
    dist = tmp_path / "mymethods-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mymethods\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[memtrain.trusted]\nmine = mymethods\n")
    with pytest.raises(ConfigError, match="may name only memtrain.methods.*"):
        trust.locate("mymethods.Mine", "method._target_")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert trust.registered() == ("mymethods",)
    assert trust.locate("mymethods.Mine", "method._target_").name == "mine"
    with pytest.raises(ConfigError):  # registered: its own classes, not its imports
        trust.locate("mymethods.os.system", "method._target_")


# ---------------------------------------------------------------- models by name fetch nothing

FETCHES = [  # (overrides, the key its one line starts with)
    (["model=timm", "+model.kwargs.pretrained=true"], "model.kwargs.pretrained"),
    (["model=timm", "+model.kwargs.checkpoint_path=/tmp/w.pth"], "model.kwargs.checkpoint_path"),
    (["model=timm", "+model.kwargs.pretrained_cfg_overlay.file=w.bin"],
     "model.kwargs.pretrained_cfg_overlay"),
    (["model=timm", "+model.kwargs.cache_dir=/tmp/hub"], "model.kwargs.cache_dir"),
    (["model=timm", "model.name=hf-hub:timm/resnet18.a1_in1k"], "model.name"),
    (["model=timm", "model.name=hf_hub:timm/resnet18"], "model.name"),
    (["model=timm", "model.name=../weights/resnet18"], "model.name"),
    (["model=timm", "+model.kwargs.act_layer=https://example.org/x.py"],
     "model.kwargs.act_layer"),
    (["model=torchvision", "+model.kwargs.weights=DEFAULT"], "model.kwargs.weights"),
    (["model=torchvision", "+model.kwargs.weights_backbone=DEFAULT"],
     "model.kwargs.weights_backbone"),
    (["model=hf", "+model.config.trust_remote_code=true"], "model.config.trust_remote_code"),
    (["model=hf", "+model.config._name_or_path=org/repo"], "model.config._name_or_path"),
    (["model=hf", "+model.config.auto_map.AutoModelForCausalLM=repo--modeling.Net"],
     "model.config.auto_map"),
    (["model=hf", "+model.config.local_files_only=false"], "model.config.local_files_only"),
    (["-m", "model=timm", "+model.kwargs.pretrained=false,true"], "model.kwargs.pretrained"),
    (["-m", "model=timm", "model.name=resnet18,hf-hub:timm/resnet18"], "model.name"),
    (["model=module", "+hydra.job.env_set.MEMTRAIN_MODEL=evil.py:run"],
     "hydra.job.env_set.MEMTRAIN_MODEL"),
]


@pytest.mark.parametrize("args,key", FETCHES, ids=lambda a: a if isinstance(a, str) else
                         a[-1].split("=")[0])
def test_a_model_by_name_never_fetches_from_the_command_line(in_tmp, cli_checks, args, key):
    """Weights, code and files are never loaded: every key or name that would (timm's
    pretrained, checkpoint_path, pretrained_cfg_overlay, hub names; torchvision's weights;
    transformers' remote code and hub paths) is refused in one line before anything runs, and
    a config never names the user's module (MEMTRAIN_MODEL)."""
    p = cli_checks(*args, *TINY[:1])
    _one_line_refusal(p, key)
    assert not (in_tmp / "runs").exists()


@pytest.mark.parametrize("preset,body,args,key", [
    ("model/mine", "_target_: memtrain.models.timm_model\nname: resnet18\nkwargs:\n"
     "  pretrained: true\n", ["model=mine"], "model.kwargs.pretrained"),
    ("experiment/fetch", "# @package _global_\nmodel:\n  kwargs:\n    checkpoint_path: w.pth\n",
     ["model=timm", "experiment=fetch"], "model.kwargs.checkpoint_path"),
    ("model/hub", "_target_: memtrain.models.hf_model\nname: llama\nconfig:\n"
     "  trust_remote_code: true\n", ["model=hub"], "model.config.trust_remote_code"),
])
def test_a_model_by_name_never_fetches_from_a_preset(in_tmp, cli_checks, preset, body, args,
                                                     key):
    group, name = preset.split("/")
    (in_tmp / "mine" / group).mkdir(parents=True)
    (in_tmp / "mine" / group / f"{name}.yaml").write_text(body)
    p = cli_checks("--config-dir", str(in_tmp / "mine"), *args, *TINY[:1])
    _one_line_refusal(p, key)


def test_a_model_by_name_never_fetches_where_it_is_built():
    """The API and a launcher's jobs build through the builders, which refuse too; the hub
    clients are told to stay offline."""
    import os

    from memtrain.config import offline
    from memtrain.models import hf_model, timm_model, torchvision_model

    with pytest.raises(ConfigError, match="model.kwargs.pretrained=True: memtrain builds"):
        timm_model(10, (3, 32, 32), "resnet18", {"pretrained": True})
    with pytest.raises(ConfigError, match="model.name=hf-hub:timm/resnet18: a name from"):
        timm_model(10, (3, 32, 32), "hf-hub:timm/resnet18")
    with pytest.raises(ConfigError, match="model.kwargs.weights=DEFAULT"):
        torchvision_model(10, (3, 32, 32), "resnet18", {"weights": "DEFAULT"})
    with pytest.raises(ConfigError, match="model.config.trust_remote_code=True"):
        hf_model(64, (16,), "llama", {"trust_remote_code": True})
    assert all(os.environ.get(k) == "1" for k in offline.OFFLINE_ENV)
