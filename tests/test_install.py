"""memtrain as a user installs it: a regular (non-editable) wheel, run from a folder that is not
the repository. An editable install hides two things a wheel shows: where conf/ lives (the
installed `memtrain.conf`: `config.installed_conf_dir` once returned a MultiplexedPath whose
str() was no path, so every group had no options) and how Hydra finds memtrain's plugins (the
variants sweeper, the submitit launchers, their presets in Hydra's ConfigStore). The wheel holds
the product only: memtrain/, kernels/ and conf/, never the tools beside them (benchmarks/,
tools/)."""

import importlib.metadata
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
# what the wheel is built from: the package's sources and the tools beside them (present, so a
# package list that took them in would show it)
SOURCES = ("memtrain", "kernels", "conf", "benchmarks", "tools")


def _setuptools_builds_offline() -> bool:
    """setuptools 70.1 on builds a wheel without the `wheel` package (pyproject's dev extra)."""
    try:
        major, minor = importlib.metadata.version("setuptools").split(".")[:2]
    except importlib.metadata.PackageNotFoundError:
        return False
    return (int(major), int(minor)) >= (70, 1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel . --no-deps` makes, built offline by this environment's setuptools
    (its PEP 517 backend, as `pip wheel --no-build-isolation` calls it) from a copy of the
    checkout's sources, so that the build's build/ and egg-info stay out of the checkout."""
    if not _setuptools_builds_offline():
        pytest.skip("building the wheel offline needs setuptools >= 70.1 (make install)")
    tmp = tmp_path_factory.mktemp("wheel")
    src, out = tmp / "src", tmp / "out"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in SOURCES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; "
         "build_meta.build_wheel(sys.argv[1])", str(out)],
        cwd=src, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (whl,) = out.glob("*.whl")
    return whl


def test_the_wheel_holds_the_product_only(wheel):
    """Every module of memtrain/ (its Hydra plugins under hydra_plugins/), kernels/ as
    memtrain.kernels and every config of conf/ as memtrain.conf, and nothing else: no
    benchmark, study or doc-generator module."""
    names = set(zipfile.ZipFile(wheel).namelist())
    py = {n for n in names if n.endswith(".py")}
    assert not {n for n in names if n.split("/")[0] in ("benchmarks", "tools")
                or n.startswith(("memtrain/bench/", "memtrain/study/"))}
    expected = set()
    for f in (ROOT / "memtrain").rglob("*.py"):
        rel = f.relative_to(ROOT / "memtrain")
        plugin = rel.parts[0] == "hydra_plugins"  # installed as the hydra_plugins namespace
        expected.add(rel.as_posix() if plugin else f"memtrain/{rel.as_posix()}")
    expected |= {f"memtrain/kernels/{f.relative_to(ROOT / 'kernels').as_posix()}"
                 for f in (ROOT / "kernels").rglob("*.py")}
    expected |= {f"memtrain/conf/{f.relative_to(ROOT / 'conf').as_posix()}"
                 for f in (ROOT / "conf").rglob("*.py")}  # conf/ is a package (pkg://)
    assert py == expected, (sorted(py - expected), sorted(expected - py))
    conf = {f"memtrain/conf/{f.relative_to(ROOT / 'conf').as_posix()}"
            for f in (ROOT / "conf").rglob("*.yaml")}
    assert conf == {n for n in names if n.startswith("memtrain/conf/") and n.endswith(".yaml")}
    (top,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert set(zipfile.ZipFile(wheel).read(top).decode().split()) == {"hydra_plugins",
                                                                       "memtrain"}


# In the installed environment: where memtrain and each plugin class Hydra's scan finds come from
_WHERE = """
import sys
import memtrain
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
print("memtrain", memtrain.__file__)
for kind in (Launcher, Sweeper):
    for c in Plugins.instance().discover(kind):
        print(f"{c.__module__}.{c.__name__}", sys.modules[c.__module__].__file__)
"""


@pytest.mark.slow
def test_wheel_install_runs_a_variants_sweep(wheel, tmp_path):
    venv = tmp_path / "venv"
    # no pip of its own (ensurepip takes seconds): this environment's pip installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=300)
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    # the dependencies come from this environment's site folders, those it chains to included
    # (plain paths: their .pth files, the editable memtrain's among them, are not run, so
    # `memtrain` below is the wheel's)
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"],
                          *(p for p in sys.path if p.endswith("site-packages"))])
    (site / "zz_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    py = venv / "bin" / "python"
    # --ignore-installed: the dependencies' path holds the editable memtrain of the same
    # version, which pip would take as this wheel installed already (and must never remove)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", "--no-index", "--ignore-installed", str(wheel)], check=True,
                   timeout=300)
    # memtrain, and the plugins Hydra's scan finds (launchers, sweeper), come from the wheel
    where = subprocess.run([str(py), "-c", _WHERE], capture_output=True, text=True, check=True,
                           cwd=tmp_path)
    found = dict(line.split(" ", 1) for line in where.stdout.splitlines())
    assert {"memtrain", "hydra_plugins.memtrain_launcher.LocalLauncher",
            "hydra_plugins.memtrain_launcher.SlurmLauncher",
            "hydra_plugins.memtrain_sweeper.VariantSweeper"} <= found.keys(), found
    assert all(f.startswith(str(site)) for k, f in found.items()
               if k == "memtrain" or "memtrain_" in k), found

    # the sweep on Hydra's default launcher, as `memtrain -m` runs (its jobs in this process:
    # the launchers' own jobs are test_launchers.py's)
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [str(venv / "bin" / "memtrain"), "-m", "hydra/sweeper=variants",
         'hydra.sweeper.variants=["method=none","method=prune method.sparsity=0.5"]',
         "model=mlp6", "trainer=smoke", "dataset.image_size=8", f"hydra.sweep.dir={sweep}",
         "+hydra.callbacks.report.formats=[png]",  # the report's tables are read, no PDF
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
