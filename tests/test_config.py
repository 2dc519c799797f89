"""Every conf option composes; bad input fails with one line that names the valid choices."""

import pytest
from conftest import conf_options, run_memtrain

from memtrain import api

GROUPS = ["dataset", "model", "method", "optim", "trainer"]


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in conf_options(g)])
def test_every_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if option == "imagenet":
        overrides.append("dataset.data_dir=/nonexistent")
    cfg, choices = api.compose(overrides)
    assert choices[group] == option
    assert "_target_" in cfg.model and "_target_" in cfg.method and "_target_" in cfg.dataset


@pytest.mark.parametrize("exp", conf_options("experiment"))
def test_every_experiment_composes(exp):
    cfg, choices = api.compose([f"experiment={exp}"])
    assert choices["experiment"] == exp


@pytest.mark.parametrize("override,expected", [
    ("model=nosuch", "unknown model 'nosuch'; choose one of: efficientnet_b0"),
    ("method=nosuch", "unknown method 'nosuch'; choose one of:"),
    ("dataset=imagenette", "unknown dataset 'imagenette'; choose one of: cifar10"),
    ("trainer.batch_size=0", "trainer.batch_size must be in [1, inf], got 0"),
    ("trainer.precision=fp8", "trainer.precision must be one of fp32, bf16, fp16, got 'fp8'"),
    ("trainer.epochs=0", "trainer.epochs must be in [1, inf], got 0"),
])
def test_bad_override_is_one_line_error(in_tmp, override, expected):
    p = run_memtrain(override, "trainer=smoke", cwd=in_tmp, timeout=120)
    assert p.returncode != 0
    err = p.stderr.strip()
    assert expected in err, err
    assert "Traceback" not in p.stderr + p.stdout
    assert len(err.splitlines()) == 1, err


def test_missing_dataset_folder_names_the_path(in_tmp):
    p = run_memtrain("dataset=cifar10", f"dataset.data_dir={in_tmp}/nodata", "trainer=smoke",
                     cwd=in_tmp, timeout=120)
    assert p.returncode == 2
    assert "dataset cifar10 not found (looked in" in p.stderr and "nodata" in p.stderr
    assert "dataset.download=true" in p.stderr
    assert "Traceback" not in p.stderr
