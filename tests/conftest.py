"""Shared fixtures: tiny runs, the memtrain command, conf discovery."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from zygote import Zygote

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"

# Every summary.json the suite writes (in this process, in the `memtrain` commands and launcher
# jobs it starts, which inherit the environment) is checked against memtrain/columns.py: a column
# written but not declared there fails the test that wrote it (a user's run only warns).
os.environ["MEMTRAIN_STRICT_COLUMNS"] = "1"
# `model=module` builds the factory MEMTRAIN_MODEL names: a test that wants one sets it
# (the `user_factory` fixture); one set in the shell would change model=module's run_id
os.environ.pop("MEMTRAIN_MODEL", None)
# Inductor's compiled kernels go to a folder of this process, removed when it ends: each run
# compiles afresh, as a clean machine (CI) does, rather than reading what an earlier run left
# in the user's temporary folder (the suite's time measured here is then CI's).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="mt-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

# Under pytest-xdist (make test runs one worker per core) each worker gets one thread: more
# would oversubscribe the cores and small convolutions get many times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (its module asks with `usefixtures`): on a shared,
    loaded CPU two spinning threads run small convolutions many times slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _workers_folder(tmp_path_factory) -> Path:
    """The session's temporary folder that its xdist workers share (each has one below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


_RANKS_LOCKS: list = []  # this test's (gate, hold) lock files, for `ranks_alone`


@pytest.fixture(autouse=True)
def _ranks_alone(request, tmp_path_factory):
    """A test marked `ranks` starts the processes of a job of several ranks (torchrun: two ranks
    and its agent), which run with no other test beside them: two ranks beside a busy test
    worker on two cores slow gloo's collectives to a crawl. make test runs `--dist worksteal`,
    which ignores xdist groups (they need `--dist loadgroup`), so the workers share two lock
    files in the session's temporary folder: every test holds the lock shared; a `ranks` test
    holds it alone (and the gate first, so that tests that start meanwhile wait behind it),
    only while it starts its ranks where it asks for `ranks_alone`, else for the whole test.
    MEMTRAIN_TEST_LOCKS names another folder for them: make test gives its two sessions one."""
    import fcntl

    root = Path(os.environ.get("MEMTRAIN_TEST_LOCKS") or _workers_folder(tmp_path_factory))
    alone = request.node.get_closest_marker("ranks") is not None and \
        "ranks_alone" not in request.fixturenames
    mode = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
    with open(root / "ranks.gate", "a") as gate, open(root / "ranks.lock", "a") as hold:
        fcntl.flock(gate, mode)
        fcntl.flock(hold, mode)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        _RANKS_LOCKS[:] = [gate, hold]
        try:
            yield
        finally:
            _RANKS_LOCKS.clear()


@pytest.fixture
def ranks_alone(_ranks_alone, request):
    """`with ranks_alone():` the machine to this test alone (a `ranks` test, while its ranks
    run): the shared hold given up, the gate and the lock taken alone, the hold shared again
    after. The test's checks in this process run beside the other worker's tests."""
    import contextlib
    import fcntl

    assert request.node.get_closest_marker("ranks") is not None, "mark the test `ranks`"

    @contextlib.contextmanager
    def alone():
        gate, hold = _RANKS_LOCKS
        fcntl.flock(hold, fcntl.LOCK_UN)
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(hold, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(hold, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)

    return alone


def conf_options(group: str) -> list[str]:
    """Every option of a config group: the folder is the registry."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# Models named in a library's registry (conf/model/{hf,timm,torchvision}.yaml) and the user's
# own module (conf/model/module.yaml): no chain of theirs is registered, so the registry-wide
# tests of chains, of every method's walk and of the recipes take memtrain's own architectures
# (`own_models`); tests/test_models_by_name.py walks these.
BY_NAME = ("hf", "timm", "torchvision")
USER_MODULE = "module"
# The factory `model=module` builds in the tests (MEMTRAIN_MODEL, memtrain/models/user.py)
USER_FACTORY = f"{Path(__file__).with_name('user_model.py')}:make_net"


# A deeper twin of a model: the same blocks, more of them, its options the twin's but for the
# class (tests/test_models.py holds it). A claim about a model's blocks (the registry walk,
# every checkpoint strategy and plan) holds on the twin in make test; on the deeper model it
# runs in make check-studies (marker `deep`: `deep_marks`).
TWINS = {"resnet34": "resnet18", "resmlp24": "resmlp12"}


def deep_marks(model: str) -> list:
    """The marks of a case of `model`: `deep` for a deeper twin (TWINS), else none."""
    return [pytest.mark.deep] if model in TWINS else []


def own_models() -> list[str]:
    """memtrain's own architectures: conf/model but the by-name families and the module."""
    return [m for m in conf_options("model") if m not in (*BY_NAME, USER_MODULE)]


@pytest.fixture
def user_factory(monkeypatch):
    """MEMTRAIN_MODEL names tests/user_model.py's factory: `model=module` builds its net."""
    monkeypatch.setenv("MEMTRAIN_MODEL", USER_FACTORY)
    return USER_FACTORY


def language_model(model: str) -> bool:
    """A model whose conf picks token data (conf/model/<model>.yaml overrides the dataset)."""
    return "dataset: tokens" in (CONF / "model" / f"{model}.yaml").read_text()


def layered(model: str) -> bool:
    """A model whose conf sets its number of layers (`model.layers`: the transformers)."""
    return any(line.startswith("layers:")
               for line in (CONF / "model" / f"{model}.yaml").read_text().splitlines())


def shallow(model: str) -> list[str]:
    """`model.layers=2` for a model with a number of layers (the transformers), else nothing:
    every layer is the same module, so two hold any per-layer claim (a chain of more than one
    block) that twelve would, at a sixth of the build and the step."""
    return ["model.layers=2"] if layered(model) else []


def tiny_data(model: str, image_size: int = 16, train_size: int = 8, test_size: int = 8,
              seq_len: int = 8) -> list[str]:
    """Dataset overrides of a tiny run of `model`: synthetic images, or a language model's
    synthetic tokens."""
    if language_model(model):
        return ["dataset=tokens", f"dataset.seq_len={seq_len}", f"dataset.train_size={train_size}",
                f"dataset.test_size={test_size}"]
    if model in BY_NAME:  # timm's default, ConvNeXt-atto, halves its maps five times: >= 32 px
        image_size = max(image_size, 32)
    return ["dataset=synthetic", f"dataset.image_size={image_size}",
            f"dataset.train_size={train_size}", f"dataset.test_size={test_size}"]


# a sweep whose report no assertion reads (tests/test_sweeps.py checks the report of a sweep)
NO_REPORT = "+hydra.callbacks.report.enabled=false"


_ZYGOTE = Zygote()


_SHARED: list[Path] = []  # the folder the session's workers share (`_shared_rows`)


@pytest.fixture(autouse=True, scope="session")
def _shared_rows(tmp_path_factory):
    """`shared_row`'s folder: the one the session's workers share (the lock files' of
    `_ranks_alone`)."""
    _SHARED[:] = [_workers_folder(tmp_path_factory) / "rows"]
    yield
    _SHARED.clear()


def shared_row(key: tuple, make):
    """The row `make()` returns, made once for the session's workers: a baseline row that
    several tests of either xdist worker need (a `none` run of a model) is made under a lock
    by the first that asks, kept whole (written, then renamed) and read by the others. Outside
    a session, made."""
    import fcntl
    import hashlib
    import pickle

    if not _SHARED:
        return make()
    folder = _SHARED[0]
    folder.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    kept = folder / f"{name}.pkl"
    with open(folder / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a worker that asks meanwhile waits, not makes it
        if kept.exists():
            return pickle.loads(kept.read_bytes())
        row = make()
        part = kept.with_suffix(".part")
        part.write_bytes(pickle.dumps(row))
        part.replace(kept)
        return row


@pytest.fixture(autouse=True, scope="session")
def _zygote_closed():
    yield
    _ZYGOTE.close()


def run_memtrain(*args: str, cwd: Path, timeout: float = 600,
                 env: dict | None = None, module: str = "memtrain") -> subprocess.CompletedProcess:
    """Run `python -m memtrain ARGS` (or another of zygote.MODULES) in a process of its own, as
    a user would: forked from the worker's warm interpreter (tests/zygote.py: the same process
    but for the imports already made), or a fresh interpreter where forking would differ from
    one."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if _ZYGOTE.usable(full_env):
        return _ZYGOTE.run(list(args), Path(cwd), full_env, timeout, module=module)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout, env=full_env)


def warm_python() -> str:
    """The interpreter for a test that starts `python -m memtrain ...` itself (a process it
    signals, torchrun's `PYTHON_EXEC`): the zygote's stand-in, which forks the command from the
    warm interpreter and is signalled and exits as the process would (tests/zygote.py), or
    the real interpreter where the zygote cannot serve."""
    return _ZYGOTE.python()


@dataclass
class Checked:
    """What `memtrain ARGS` did before Hydra took over: its exit status, stdout and stderr."""
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli_checks(monkeypatch, capsys):
    """`cli_checks(*args)`: the `memtrain` command's checks (`cli.main` up to Hydra) in this
    process, for the many tests of bad input that must stop there with one line and exit 2;
    a subprocess costs a fresh interpreter, torch and Hydra (~4 s) per call. Reaching Hydra
    fails the test (the input was not refused); tests/test_validate.py keeps the same check in
    a real subprocess, where a traceback or a wrong exit status would show."""
    import hydra

    from memtrain import cli
    from memtrain.run import faults

    def reached_hydra(*args, **kwargs):
        raise AssertionError("memtrain handed these overrides to Hydra: they were not refused")

    def check(*args: str) -> Checked:
        monkeypatch.setattr(sys, "argv", ["memtrain", *args])
        monkeypatch.setattr(hydra, "main", reached_hydra)
        # a multirun's SIGTERM handler is the sweep's, not this test process's
        monkeypatch.setattr(faults.SweepStop, "install_main", staticmethod(lambda: None))
        capsys.readouterr()
        try:
            cli.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        out = capsys.readouterr()
        return Checked(code, out.out, out.err)

    return check


def saved_bytes(model: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Saved-for-backward bytes of one forward pass (no backward); the inputs, parameters and
    buffers are not counted (`measure.alive_before_step`), as on a run's accounting step."""
    from memtrain.memory import measure

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


@pytest.fixture
def study_dir(request, tmp_path):
    """`study_dir(name)`: the folder a study's runs go to. With --studies (make check-studies)
    the runs are kept, one folder per study under --studies-dir, for memtrain-report; otherwise
    (a study's guard in make test) a temporary one."""
    def folder(name: str) -> Path:
        if request.config.getoption("--studies"):
            return Path(request.config.getoption("--studies-dir")) / name
        return tmp_path / name
    return folder


def fashion_mnist_available() -> bool:
    return Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").exists()


def pytest_addoption(parser):
    parser.addoption("--studies", action="store_true",
                     help="run the multi-seed accuracy studies (marked study; make check-studies)")
    parser.addoption("--studies-dir", default=str(ROOT / "runs" / "studies"),
                     help="with --studies: where the studies' runs are kept (for memtrain-report)")


def pytest_collection_modifyitems(config, items):
    """Studies (marked study) and the claims on deeper twins (marked deep) run only with
    --studies: they are deselected otherwise, so that `-m slow` or `-k` never pulls one into
    make test. Tests marked gpu need CUDA; on a machine
    without it they are skipped, saying why."""
    if not config.getoption("--studies"):
        studies = [item for item in items
                   if item.get_closest_marker("study") or item.get_closest_marker("deep")]
        if studies:
            config.hook.pytest_deselected(items=studies)
            items[:] = [item for item in items if item not in studies]
    _ranks_last(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker, not the keyword: keywords hold folder names too (a checkout in gpu/)
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def _ranks_last(items) -> None:
    """The `ranks` tests last, the others in their order. A ranks test has the machine alone
    (`_ranks_alone`): its worker idles until the other worker's test ends, and make test's
    SLURM session beside (whose tests share the lock) runs its jobs in the first minutes; at
    the end of the session both have finished their long tests or are at their last ones.
    (First, a ranks test waited on the SLURM session's tests: 70 s in a fresh-clone run.)"""
    items.sort(key=lambda item: item.get_closest_marker("ranks") is not None)  # stable


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before each test, what earlier tests and imports left alive is moved out of the cycle
    collector's reach (after one collection of what is new since the last test): a full
    collection in a worker then walks only what the test makes, not the hundreds of thousands
    of objects of torch, pandas, Hydra and the models loaded so far (a third of a second each).
    What was alive before a test and dies later in a reference cycle is never collected: the
    workers' peak memory grows by about a tenth."""
    import gc

    gc.collect()
    gc.freeze()
