"""Where `make results` runs: DEVICE picks the device and its sizes, a CUDA study without CUDA
is a one-line error, and the GPU run's one call (scripts/gpu-results.sh) installs the carried
wheels, then runs the parts in priority order within what the installs left of its deadline."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.study import results
from tools.study import study_plan as results_plan

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-results.sh"
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _make(*args: str) -> subprocess.CompletedProcess:
    """`make results` with this Python (also under the compat venv), dry-run: nothing runs."""
    return subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "results",
                           f"PY={sys.executable}", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
@needs_make
def test_device_picks_the_device_and_its_sizes():
    cpu = _make("DEVICE=cpu", "ARGS=--dry-run")
    assert cpu.returncode == 0, cpu.stderr
    assert "trainer.device=cpu" in cpu.stdout and "trainer.device=cuda" not in cpu.stdout
    r = results_plan.PROFILES["cpu"]["resnet50"]
    assert f"dataset.image_size={r['image_size']} " in cpu.stdout
    gpu = _make("ARGS=--dry-run")  # DEVICE defaults to cuda and the GPU sizes
    assert gpu.returncode == 0, gpu.stderr
    assert "trainer.device=cuda" in gpu.stdout and "dataset.image_size=224 " in gpu.stdout
    bad = _make("DEVICE=tpu", "ARGS=--dry-run")
    assert bad.returncode != 0 and "invalid choice: 'tpu'" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="would run the study")
def test_a_cuda_study_without_cuda_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        results.main(["--parts", "pool", "--runs", str(tmp_path / "r"),
                      "--out", str(tmp_path / "v")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0] and "DEVICE=cpu" in err[0]
    assert not (tmp_path / "r").exists()  # nothing started


def test_the_wheel_folder_is_git_ignored_and_the_recipe_carries_it():
    if shutil.which("git") is None or subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    assert subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q",
                           ".whl/hydra_core-1.3.8-py3-none-any.whl"]).returncode == 0
    recipe = (ROOT / "docs" / "results" / "study.md").read_text()
    assert "`.whl/` folder" in recipe and "bash scripts/gpu-results.sh" in recipe
    assert "make gpu-rehearsal" in recipe
    assert ".venv-rehearsal" in (ROOT / ".gitignore").read_text()


def _fake_python(tmp_path: Path) -> Path:
    """A `python3` for the script: pip calls are written down (nothing installed here), the
    rest runs on this Python."""
    fake = tmp_path / "python3"
    fake.write_text(f'#!/usr/bin/env bash\nif [ "$1 $2" = "-m pip" ]; then echo "$@" >> '
                    f'"{tmp_path}/pip.log"; exit 0; fi\nexec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    return fake


def _script(tmp_path: Path, whl: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PY": str(_fake_python(tmp_path)), "WHL": str(whl),
           "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_gpu_call_installs_the_carried_wheels_then_runs_its_parts(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    whl = tmp_path / "whl"
    whl.mkdir()
    (whl / "hydra_core-1.3.8-py3-none-any.whl").write_bytes(b"")
    p = _script(tmp_path, whl, "2030-01-01_h100", "--", "--dry-run", "--committed",
                str(tmp_path / "none"))
    assert p.returncode == 0, p.stdout + p.stderr
    wheels, editable = (tmp_path / "pip.log").read_text().splitlines()
    assert "--no-deps" in wheels and f"--target {whl}/site" in wheels
    assert wheels.endswith("hydra_core-1.3.8-py3-none-any.whl")
    assert "--no-deps" in editable and editable.endswith("-e .")
    log = (tmp_path / "out" / "study.log").read_text()
    assert "gpu-results: torch" in log  # the imports were checked before the study
    order = [log.index(f"## {p}") for p in results_plan.PARTS]
    assert order == sorted(order)  # priority parts first
    assert "trainer.device=cuda" in log and "the study gets" in log


def test_gpu_call_without_wheels_or_with_a_wrong_call_stops_at_once(tmp_path):
    (tmp_path / "empty").mkdir()
    for args, why in ((["name"], "no wheels in"), (["--name"], "usage:")):
        p = _script(tmp_path, tmp_path / "empty", *args)
        assert p.returncode == 2 and why in p.stderr and len(p.stderr.splitlines()) == 1
    assert not (tmp_path / "pip.log").exists()
