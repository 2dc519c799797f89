"""Hydra's own test suites for memtrain's Hydra plugins, as Hydra's joblib and submitit plugins run
them (hydra.test_utils.launcher_common_tests): the `local` and `parallel` launcher presets
(LauncherTestSuite, IntegrationTestSuite) and the `variants` sweeper (the launcher suite through
it, and BatchedSweeperTestSuite), on Hydra's own test app, not memtrain's.

Not collected with the rest of the tests (its name): tests/test_launchers.py runs this file with
pytest in a process of its own, without conftest.py, where memtrain.config.loader (memtrain's own
app: its config tree, its checks) is never imported. The plugins stand on their own, found by
Hydra's plugin scan, as in any Hydra app where memtrain is installed.
"""

import inspect
import os
import sys

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.test_utils.launcher_common_tests import (
    BatchedSweeperTestSuite,
    IntegrationTestSuite,
    LauncherTestSuite,
)


def test_memtrain_config_is_not_imported_before():
    assert "memtrain.config.loader" not in sys.modules


def test_discovery():
    """Hydra's plugin scan finds memtrain's launchers and sweeper (in an editable install too)."""
    launchers = {f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Launcher)}
    assert {"hydra_plugins.memtrain_launcher.LocalLauncher",
            "hydra_plugins.memtrain_launcher.SlurmLauncher"} <= launchers
    sweepers = {f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Sweeper)}
    assert "hydra_plugins.memtrain_sweeper.VariantSweeper" in sweepers


def test_split_arguments_is_the_basic_sweepers():
    """The variants sweeper keeps Hydra's contract: split_arguments a static method."""
    from hydra_plugins.memtrain_sweeper import VariantSweeper

    assert isinstance(inspect.getattr_static(VariantSweeper, "split_arguments"), staticmethod)


@pytest.mark.parametrize("launcher_name, overrides", [("local", []), ("parallel", [])])
class TestLaunchers(LauncherTestSuite):
    pass


@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [
    ({}, ["-m", "hydra/job_logging=disabled", "hydra/launcher=local"]),
])
class TestLaunchersIntegration(IntegrationTestSuite):
    """On `local`, memtrain's own launcher class. `parallel` is Hydra's joblib launcher, whose
    own plugin runs this suite on it: memtrain adds a preset (LauncherTestSuite above runs it),
    whose part a fresh app can get wrong is its resolved values (the test below)."""


def test_parallel_preset_in_a_fresh_app(tmp_path):
    """A fresh Hydra app's multirun on `parallel`: the plugin scan registers memtrain's resolvers
    before the preset's `n_jobs` (MEMTRAIN_PARALLEL_JOBS, or the GPU count) is read in a job."""
    from hydra.test_utils.test_utils import integration_test

    from memtrain.config import resolvers

    integration_test(
        tmpdir=tmp_path, task_config={},
        overrides=["-m", "hydra/job_logging=disabled", "hydra/launcher=parallel", "+x=1,2"],
        prints=["str(HydraConfig.get().launcher.n_jobs)",
                "HydraConfig.get().launcher._target_.rsplit('.', 1)[-1]"],
        expected_outputs=[str(resolvers.gpu_count(3)), "JoblibLauncher"],
        env_override={"MEMTRAIN_PARALLEL_JOBS": "3"})


@pytest.mark.parametrize("launcher_name, overrides", [("basic", ["hydra/sweeper=variants"])])
class TestVariantsSweeper(LauncherTestSuite):
    pass


@pytest.mark.parametrize("launcher_name, overrides", [
    ("basic", ["hydra/sweeper=variants", "hydra.sweeper.max_batch_size=2"])])
class TestVariantsSweeperBatches(BatchedSweeperTestSuite):
    pass


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_variants_sweep_in_any_app(hydra_sweep_runner, tmpdir):
    """A baseline and a variant with its own sweep, on Hydra's test app (foo: 10, bar: 100):
    one job, then two, in batches of two; each job's config as its overrides say."""
    variants = 'hydra.sweeper.variants=["foo=1","foo=2 bar=3,4"]'
    sweep = hydra_sweep_runner(
        calling_file=None, calling_module="hydra.test_utils.a_module", task_function=None,
        config_path="configs", config_name="compose.yaml", temp_dir=tmpdir,
        overrides=["hydra/sweeper=variants", variants, "hydra.sweeper.max_batch_size=2"])
    with sweep:
        assert [[r.overrides for r in batch] for batch in sweep.returns] == [
            [["foo=1"], ["foo=2", "bar=3"]], [["foo=2", "bar=4"]]]
        assert [dict(r.cfg) for batch in sweep.returns for r in batch] == [
            {"foo": 1, "bar": 100}, {"foo": 2, "bar": 3}, {"foo": 2, "bar": 4}]
    assert BasicSweeper.split_arguments  # the basic sweeper's own, unchanged


def test_slurm_preset_composes_without_memtrain_trainer_keys():
    """The slurm preset in an app that has no `trainer.strategy`: one task per job."""
    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig

    with initialize_config_module("hydra.test_utils.configs", version_base="1.3"):
        cfg = compose("compose", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        assert cfg.hydra.launcher.tasks_per_node == 1
        assert cfg.hydra.launcher._target_ == "hydra_plugins.memtrain_launcher.SlurmLauncher"


def test_memtrain_config_is_not_imported_after():
    """Neither Hydra's scan nor the launchers and sweeps above needed memtrain.config.loader; and on
    a machine without a GPU driver, resolving the presets needed no torch either (every Hydra
    app imports the plugins' modules at startup)."""
    from memtrain.config import resolvers

    assert "memtrain.config.loader" not in sys.modules
    if sys.platform == "linux" and not any(map(os.path.exists, resolvers.GPU_DRIVER_PATHS)):
        assert "torch" not in sys.modules
