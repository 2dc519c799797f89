"""Hydra's own flags reach Hydra untouched, and a user's presets (--config-dir,
hydra.searchpath) are found and checked like the built-in ones: real `memtrain` subprocesses."""

from __future__ import annotations

import json

import pytest
from conftest import NO_REPORT, run_memtrain

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8"]


def _preset(folder, name: str, body: str):
    (folder / "experiment").mkdir(parents=True, exist_ok=True)
    (folder / "experiment" / f"{name}.yaml").write_text("# @package _global_\n" + body)
    return folder


@pytest.mark.parametrize("flags,expected", [
    (["--cfg", "job"], "batch_size: 128"),
    (["--cfg", "hydra"], "sweeper:"),
    (["--cfg", "job", "-p", "method"], "_target_: memtrain.methods.none.NoneMethod"),
    (["--info", "defaults"], "method/none"),
    (["-sc", "install=bash"], "COMP_LINE"),
    (["--cfg", "job", "--resolve", "trainer.batch_size=7"], "batch_size: 7"),
])
@pytest.mark.slow
def test_hydra_flags_pass_through(in_tmp, flags, expected):
    p = run_memtrain(*flags, cwd=in_tmp, timeout=300)
    assert p.returncode == 0, p.stderr
    assert expected in p.stdout, p.stdout[-2000:]
    assert not (in_tmp / "runs").exists()  # shown, not run


def test_cfg_job_still_checks_the_overrides(in_tmp, cli_checks):
    p = cli_checks("--cfg", "job", "trainer.batchsize=3")
    assert p.returncode == 2
    assert p.stderr.strip() == ("memtrain: error: unknown option trainer.batchsize; did you mean "
                                "trainer.batch_size?")


@pytest.mark.slow
def test_user_preset_in_config_dir_runs(in_tmp):
    mine = _preset(in_tmp / "myconf", "mine",
                   "defaults:\n  - override /model: mlp6\n  - override /trainer: smoke\n"
                   "dataset:\n  image_size: 8\ntrainer:\n  seed: 3\n")
    out = in_tmp / "r"
    p = run_memtrain("--config-dir", str(mine), "experiment=mine", f"hydra.run.dir={out}",
                     cwd=in_tmp, timeout=300)
    assert p.returncode == 0, p.stderr
    s = json.loads((out / "summary.json").read_text())
    assert (s["status"], s["model"], s["experiment"], s["trainer.seed"]) == \
        ("ok", "mlp6", "mine", 3)
    # the same preset through hydra.searchpath composes the same job
    p = run_memtrain("--cfg", "job", f"hydra.searchpath=[file://{mine}]", "experiment=mine",
                     cwd=in_tmp, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "seed: 3" in p.stdout and "widths:" in p.stdout  # mlp6's keys


@pytest.mark.parametrize("body,expected", [
    ("trainer:\n  batchsize: 3\n", "unknown option trainer.batchsize; did you mean "
                                   "trainer.batch_size?"),
    ("method:\n  sparsty: 0.5\n", "unknown option method.sparsty; did you mean method.sparsity?"),
    ("trainer:\n  batch_size: many\n",
     "trainer.batch_size must be an integer, got 'many' (in experiment/bad)"),
    ("trainer:\n  compile: maybe\n", "trainer.compile must be true or false, got 'maybe' (in "
                                     "experiment/bad)"),
    ("optim:\n  lr: .nan\n", "optim.lr must be a finite number, got nan"),
])
def test_user_preset_is_checked_like_built_in_ones(in_tmp, cli_checks, body, expected):
    if "sparsty" in body:
        body = "defaults:\n  - override /method: prune\n" + body
    mine = _preset(in_tmp / "myconf", "bad", body)
    p = cli_checks("--config-dir", str(mine), "experiment=bad", *TINY)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], p.stderr
    assert not (in_tmp / "runs").exists()


def test_unknown_preset_and_missing_config_dir_are_one_line(in_tmp, cli_checks):
    p = cli_checks("experiment=mine", *TINY)
    assert p.returncode == 2 and "unknown experiment 'mine'" in p.stderr
    p = cli_checks("--config-dir", str(in_tmp / "nope"), *TINY)
    assert p.returncode == 2
    assert p.stderr.strip() == f"memtrain: error: --config-dir {in_tmp / 'nope'}: no such folder"


@pytest.mark.slow
def test_long_multirun_flag(in_tmp):
    p = run_memtrain("--multirun", *TINY, "trainer.seed=0,1", "hydra.sweep.dir=sw", NO_REPORT,
                     cwd=in_tmp, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(f.read_text()) for f in sorted((in_tmp / "sw").glob("*/summary.json"))]
    assert [(r["status"], r["trainer.seed"]) for r in rows] == [("ok", 0), ("ok", 1)]


@pytest.mark.slow
def test_p_alone_prints_the_package_and_trains_nothing(in_tmp):
    """Hydra reads -p only with --cfg: `memtrain -p method` alone trained resnet18 for 10
    epochs. It prints the composed package, as `--cfg job -p method` does."""
    p = run_memtrain("-p", "method", "method=pool", cwd=in_tmp, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("# @package method\n_target_: memtrain.methods.pool.PoolMethod")
    assert not (in_tmp / "runs").exists()
