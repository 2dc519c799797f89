"""memtrain as a user installs it: a regular (non-editable) wheel, run from a folder that is not
the repository. An editable install hides two things a wheel shows: where conf/ lives (the
installed `memtrain.conf`: `config.installed_conf_dir` once returned a MultiplexedPath whose
str() was no path, so every group had no options) and how Hydra finds memtrain's plugins (the
variants sweeper, the submitit launchers, their presets in Hydra's ConfigStore)."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_install_runs_a_variants_sweep(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                            str(wheels), str(ROOT)], capture_output=True, text=True, timeout=600)
    if build.returncode != 0:  # pip's isolated build needs setuptools from the package index
        pytest.skip(f"cannot build the wheel here: {build.stderr.strip().splitlines()[-1:]}")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    # the dependencies come from this environment (a plain path: its editable memtrain is not
    # activated, so `memtrain` below is the wheel's)
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    py = venv / "bin" / "python"
    # --ignore-installed: the dependencies' path holds the editable memtrain of the same
    # version, which pip would take as this wheel installed already (and must never remove)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--ignore-installed", *map(str, wheels.glob("*.whl"))], check=True,
                   timeout=300)
    where = subprocess.run([str(py), "-c", "import memtrain; print(memtrain.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path)
    assert where.stdout.strip().startswith(str(site)), where.stdout

    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [str(venv / "bin" / "memtrain"), "-m", "hydra/launcher=local", "hydra/sweeper=variants",
         'hydra.sweeper.variants=["method=none","method=prune method.sparsity=0.5"]',
         "model=mlp6", "trainer=smoke", "dataset.image_size=8", f"hydra.sweep.dir={sweep}",
         "trainer.batch_size=32"],  # prune's 32-row blocks need a batch of 32 (smoke's is 8)
        capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_csv(sweep / "summary.csv")
    assert sorted(rows["method"]) == ["none", "prune"] and set(rows["status"]) == {"ok"}
    assert (sweep / "report.md").is_file()
    shutil.rmtree(venv)


def test_every_package_folder_is_listed_in_pyproject():
    """pyproject names its packages one by one (kernels/ and conf/ install under other names),
    so a new package folder must be added there: an editable install finds it anyway, a wheel
    leaves it out."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
                 ["tool"]["setuptools"]["packages"])
    folders = {".".join(f.parent.relative_to(ROOT).parts)
               for f in (ROOT / "memtrain").rglob("__init__.py")}
    installed = {n.removeprefix("memtrain.") if n.startswith("memtrain.hydra_plugins.") else n
                 for n in folders}
    assert {"memtrain.methods.checkpoint", "memtrain.methods.common"} <= installed
    assert installed - listed == set()
