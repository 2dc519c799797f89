"""Shared fixtures: tiny runs, the memtrain command, conf discovery."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"

# Under pytest-xdist (make test runs one worker per core) each worker gets one thread: more
# would oversubscribe the cores and small convolutions get many times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def conf_options(group: str) -> list[str]:
    """Every option of a config group: the folder is the registry."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def run_memtrain(*args: str, cwd: Path, timeout: float = 600,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the `memtrain` console entry point in a subprocess, as a user would."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "memtrain", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout, env=full_env)


def saved_bytes(model: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Saved-for-backward bytes of one forward pass (no backward); the inputs, parameters and
    buffers are not counted (`measure.alive_before_step`), as on a run's accounting step."""
    from memtrain import measure

    counter = measure.SavedBytes(exclude=measure.alive_before_step(model, *inputs))
    with counter:
        out = model(*inputs)
    del out
    return counter.bytes


def job_dir(sweep: Path, num: int) -> Path:
    """Job `num`'s folder in a sweep folder: `<num>_<run_id>` (conf/config.yaml)."""
    (found,) = Path(sweep).glob(f"{num}_*")
    return found


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run inside a temporary folder so runs/ lands there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def fashion_mnist_available() -> bool:
    return Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").exists()


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu need CUDA; on a machine without it they are skipped, saying why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
