"""Launcher presets: they compose, a 2-job multirun through submitit's local launcher runs, and
memtrain's Hydra plugins pass Hydra's own test suites in an app that is not memtrain's."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NO_REPORT, job_dir, run_memtrain

from memtrain import api

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8", "trainer.threads=1"]


@pytest.mark.parametrize("launcher,target,key,value", [
    ("slurm", "SlurmLauncher", "partition", "gpu-test"),
    ("local", "LocalLauncher", "timeout_min", 240),
    ("parallel", "JoblibLauncher", "n_jobs", 2),
])
@pytest.mark.slow
def test_launcher_presets_compose(monkeypatch, launcher, target, key, value):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from memtrain.config import loader

    monkeypatch.setenv("MEMTRAIN_SLURM_PARTITION", "gpu-test")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(loader.conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"],
                      return_hydra_config=True)
    GlobalHydra.instance().clear()
    assert cfg.hydra.launcher._target_.endswith(target)
    assert cfg.hydra.launcher[key] == value  # from the environment or the preset
    assert "status_count" in cfg.hydra.callbacks
    api.compose([f"hydra/launcher={launcher}"])  # memtrain's own checks accept it


@pytest.mark.slow
def test_two_jobs_through_submitit_local(in_tmp):
    p = run_memtrain("-m", "hydra/launcher=local", *TINY, "trainer.seed=0,1",
                     "hydra.sweep.dir=sw", NO_REPORT, cwd=in_tmp, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads((job_dir(in_tmp / "sw", i) / "summary.json").read_text()) for i in (0, 1)]
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert {r["trainer.seed"] for r in rows} == {0, 1}
    assert (in_tmp / "sw" / ".submitit").is_dir()  # it really went through submitit
    assert "memtrain: 2 jobs: ok 2" in p.stdout


@pytest.mark.slow
def test_hydra_suites_pass_in_any_hydra_app(tmp_path):
    """tests/hydra_suites.py (Hydra's LauncherTestSuite for `local` and `parallel`, its
    IntegrationTestSuite for `local`, its sweeper suites for `variants`) in one pytest process
    of its own, without conftest.py: memtrain.config.loader is never imported there, so the
    plugins' own modules register what they need and Hydra's scan finds them. Slow: the
    launchers start their jobs in processes, and the integration suite an app per test."""
    suites = Path(__file__).with_name("hydra_suites.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "--noconftest", "-p",
                        "no:cacheprovider", str(suites)], cwd=tmp_path, env=env, text=True,
                       capture_output=True, timeout=1800)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    summary = p.stdout.strip().splitlines()[-1]
    # 9 launcher tests x 3 (local, parallel, basic through variants), 11 integration tests
    # (local), 1 batched sweeper test, and the plugin's own 7: nothing skipped or left out
    assert re.fullmatch(r"=* ?46 passed in .*", summary), summary
