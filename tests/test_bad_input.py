"""Bad input and broken files end in one line (or a row that says what is wrong), never in a
traceback or an `ok` row that measured nothing."""

import contextlib
import json

import numpy as np
import pytest
import torch
from conftest import job_dir, run_memtrain

from memtrain import api, data
from memtrain.config import loader
from memtrain.data import imagefolder
from memtrain.errors import ConfigError
from memtrain.report import command as report_cli
from memtrain.run import resume

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8"]
STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
         "t10k-labels-idx1-ubyte")


def _idx(a: np.ndarray) -> bytes:
    head = bytes([0, 0, 8, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape)
    return head + a.astype(np.uint8).tobytes()


def _mnist_folder(root, n=(10, 10, 4, 4), labels=None):
    """IDX files: images [n, 4, 4], labels 0..9 (or `labels` for the train split)."""
    y = labels if labels is not None else np.arange(n[1]) % 10
    arrays = (np.zeros((n[0], 4, 4)), y, np.zeros((n[2], 4, 4)), np.arange(n[3]) % 10)
    for stem, a in zip(STEMS, arrays, strict=True):
        (root / stem).write_bytes(_idx(np.asarray(a)))
    return root


def _one_line_error(fn, match: str) -> str:
    with pytest.raises(ConfigError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_good_idx_files_load(tmp_path):
    d = data.mnist(data_dir=str(_mnist_folder(tmp_path)))
    assert len(d.train) == 10 and len(d.test) == 4 and d.num_classes == 10


@pytest.mark.parametrize("damage,match", [
    (lambda b: b"garbage, not an IDX file" * 4, "is not an IDX file"),
    (lambda b: b[:-5], "is truncated or corrupt"),
    (lambda b: b + b"\0" * 3, "is truncated or corrupt"),
    (lambda b: b"", "is not an IDX file"),
])
def test_garbage_or_truncated_idx_is_one_line(tmp_path, damage, match):
    _mnist_folder(tmp_path)
    f = tmp_path / STEMS[0]
    f.write_bytes(damage(f.read_bytes()))
    msg = _one_line_error(lambda: data.mnist(data_dir=str(tmp_path)), match)
    assert str(f) in msg


def test_label_and_image_counts_must_match(tmp_path):
    _mnist_folder(tmp_path, n=(10, 9, 4, 4))
    _one_line_error(lambda: data.mnist(data_dir=str(tmp_path)), "do not match")


def test_labels_outside_the_classes_are_an_error(tmp_path):
    """A dataset's classes are its definition's, never inferred from the largest label: a
    label outside them is one line naming the file (EMNIST letters numbers 1-26)."""
    _mnist_folder(tmp_path)  # labels 0-9: 0 is no EMNIST letter
    msg = _one_line_error(lambda: data.emnist(split="letters", data_dir=str(tmp_path)),
                          r"label 0 is outside 1-26 \(emnist has 26 classes; 1 labels out")
    assert msg.startswith(str(tmp_path / STEMS[1]))
    _mnist_folder(tmp_path, labels=np.array([0, 1, 2, 3, 200, 5, 6, 7, 8, 9]))
    msg = _one_line_error(lambda: data.mnist(data_dir=str(tmp_path)),
                          r"label 200 is outside 0-9 \(mnist has 10 classes")
    assert msg.startswith(str(tmp_path / STEMS[1]))
    with pytest.raises(ConfigError, match=r"label 3 is outside 0-2"):
        data.check_labels("x", [torch.tensor([0, 3])], 3)


def test_the_class_count_is_the_datasets_not_the_files(tmp_path):
    """Labels 0-2 only are a 10-class Fashion-MNIST with 3 classes present, not a 3-class task;
    EMNIST letters' 1-26 train as classes 0-25."""
    _mnist_folder(tmp_path, labels=np.arange(10) % 3)
    d = data.fashion_mnist(data_dir=str(tmp_path))
    assert d.num_classes == 10 and int(d.train.labels.max()) == 2
    _mnist_folder(tmp_path, labels=np.arange(10) % 26 + 1)
    (tmp_path / STEMS[3]).write_bytes(_idx(np.array([1, 26, 3, 4])))
    d = data.emnist(split="letters", data_dir=str(tmp_path))
    assert d.num_classes == 26
    assert d.test.labels.tolist() == [0, 25, 2, 3] and int(d.train.labels.min()) == 0


def test_a_one_class_image_folder_is_refused(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        (tmp_path / split / "only").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / split / "only" / "x.png")
    _one_line_error(lambda: imagefolder.imagenet(data_dir=str(tmp_path), image_size=8),
                    "holds 1 class folder; a classifier needs at least 2")


def _image_folder(root, train_files: dict[str, bytes]):
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(root / split / cls / "ok.png")
    for name, raw in train_files.items():
        (root / "train" / "a" / name).write_bytes(raw)
    return root


def test_empty_image_folder_is_one_line(tmp_path):
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
    _one_line_error(lambda: imagefolder.imagenet(data_dir=str(tmp_path), image_size=8),
                    "dataset imagenet: Couldn't find any class folder")


@pytest.mark.parametrize("workers", [0, 1])
def test_unreadable_image_is_named_in_one_line(tmp_path, workers):
    _image_folder(tmp_path, {"bad.png": b"not a png"})
    d = imagefolder.imagenet(data_dir=str(tmp_path), image_size=8, workers=workers)
    msg = _one_line_error(lambda: list(d.train.batches(2, torch.device("cpu"))),
                          "cannot read image")
    assert "bad.png" in msg


@pytest.mark.slow
@pytest.mark.parametrize("make", ["file", "under_file"])
def test_run_dir_that_is_a_file_is_one_line(in_tmp, make):
    (in_tmp / "f").write_text("x")
    d = "f" if make == "file" else "f/sub"
    _one_line_error(lambda: loader.check_overrides([*TINY, f"hydra.run.dir={d}"]),
                    f"hydra.run.dir={d} cannot be used as the output folder")


def test_report_out_naming_a_file_exits_2(in_tmp, capsys):
    (in_tmp / "f").write_text("x")
    (in_tmp / "runs").mkdir()
    assert report_cli.main(["runs", "--out", "f"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "memtrain-report: error: --out f is a file, not a folder"


@pytest.mark.parametrize("overrides,match", [
    (["dataset.test_size=0"], "dataset.test_size must be >= 1, got 0"),
    (["dataset.train_size=0"], "dataset.train_size must be >= 1, got 0"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 runs the probes only, and none is asked"),
])
@pytest.mark.slow
def test_runs_that_would_measure_nothing_are_errors(in_tmp, overrides, match):
    """Refused before api.run writes anything: no run folder, no row a report would pick up."""
    row = None
    with pytest.raises(ConfigError, match=match):
        row = api.run([*TINY, *overrides], out_dir=in_tmp / "r")
    assert row is None and list(in_tmp.iterdir()) == []


@pytest.mark.slow
def test_a_bad_value_leaves_no_folder(in_tmp, cli_checks):
    """`memtrain trainer.batch_size=-4` from an empty folder: one line, exit 2, and no
    runs/<date>/<time>_.../summary.json (status error) for a later memtrain-report to pick up."""
    p = cli_checks("trainer.batch_size=-4")
    assert p.returncode == 2
    assert p.stderr.strip() == "memtrain: error: trainer.batch_size must be in [1, inf], got -4"
    assert list(in_tmp.iterdir()) == []


@pytest.mark.slow  # a `memtrain` process: its imports alone take ~5 s
def test_a_bad_value_leaves_no_folder_from_the_real_command(in_tmp):
    """The same in a real `memtrain` process: nothing but the one line, nothing written."""
    p = run_memtrain("trainer.batch_size=-4", cwd=in_tmp, timeout=300)
    assert (p.returncode, p.stdout, p.stderr.strip()) == (
        2, "", "memtrain: error: trainer.batch_size must be in [1, inf], got -4")
    assert list(in_tmp.iterdir()) == []


@pytest.mark.parametrize("args,refused", [
    (["-m", "trainer.seed=0,1", "trainer.batch_size=-4"], True),  # bad for every job
    (["-m", "trainer.batch_size=-4,8"], False),  # bad for one: its row, the sweep goes on
    (["-m", "hydra/sweeper=variants",
      "hydra.sweeper.variants=['trainer.batch_size=0','trainer.batch_size=-1']"], True),
    (["-m", "hydra/sweeper=variants",
      "hydra.sweeper.variants=['trainer.batch_size=0','method=pool']"], False),
    (["-m", "dataset.test_size=0,8"], False),
])
@pytest.mark.slow
def test_a_sweep_is_refused_when_every_job_would_be(in_tmp, monkeypatch, capsys, args, refused):
    """Before launch (exit 2, no folder) when each job's values are bad; a value bad for some
    jobs only reaches Hydra, whose jobs record their own rows."""
    import sys

    import hydra

    from memtrain import cli
    from memtrain.run import faults

    launched = []
    monkeypatch.setattr(hydra, "main", lambda **_: lambda task: lambda: launched.append(task))
    monkeypatch.setattr(faults.SweepStop, "install_main", staticmethod(lambda: None))
    monkeypatch.setattr(sys, "argv", ["memtrain", *args, *TINY])
    with pytest.raises(SystemExit) if refused else contextlib.nullcontext() as e:
        cli.main()
    err = capsys.readouterr().err.strip()
    if refused:
        assert e.value.code == 2 and not launched
        (line,) = err.splitlines()
        assert line.startswith("memtrain: error: trainer.batch_size must be in [1, inf], got ")
        assert line.endswith("(every job of the sweep is refused: nothing would run)")
    else:
        assert len(launched) == 1 and err == ""
    assert list(in_tmp.iterdir()) == []


@pytest.mark.slow
def test_corrupt_checkpoint_and_partial_files_fall_back_to_a_fresh_start(in_tmp):
    out = in_tmp / "r"
    out.mkdir()
    (out / "resume.pt").write_bytes(b"cut short by a kill")
    partial = out / ".resume.pt.x1y2.tmp"
    partial.write_bytes(b"half a checkpoint")
    row = api.run([*TINY, "trainer.resume=true"], out_dir=out)
    assert row["status"] == "ok" and row["steps"] == 4
    assert "unreadable checkpoint" in row["resume_warning"] and "resumed_at_step" not in row
    assert not partial.exists() and not (out / "resume.pt").exists()
    assert resume.clean_partial(out) == []


@pytest.mark.slow
def test_a_64_bit_seed_runs(in_tmp):
    big = 2**63 - 1
    row = api.run([*TINY, f"trainer.seed={big}", f"dataset.seed={big}"], out_dir=in_tmp / "r")
    assert row["status"] == "ok"


@pytest.mark.slow
def test_unset_env_in_a_sweep_is_that_jobs_row(in_tmp):
    p = run_memtrain("-m", *TINY, "trainer.seed=0,${oc.env:MEMTRAIN_TEST_UNSET_15}",
                     "hydra.sweep.dir=sw", "+hydra.callbacks.report.enabled=false",
                     cwd=in_tmp, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    rows = [json.loads((job_dir(in_tmp / "sw", i) / "summary.json").read_text()) for i in (0, 1)]
    assert rows[0]["status"] == "ok"
    assert rows[1]["status"] == "error"
    assert "MEMTRAIN_TEST_UNSET_15" in rows[1]["error"] and "not found" in rows[1]["error"]
    assert "memtrain: 2 jobs: ok 1, error 1" in p.stdout


# ---- one line where a traceback was (issue: the third round of bad inputs)


def test_a_preset_with_a_python_tag_is_one_line(in_tmp, cli_checks):
    (in_tmp / "mine" / "experiment").mkdir(parents=True)
    (in_tmp / "mine" / "experiment" / "t.yaml").write_text(
        "# @package _global_\ntrainer:\n  seed: !!python/object/apply:os.system ['touch pwned']\n")
    p = cli_checks("--config-dir", str(in_tmp / "mine"), "experiment=t", *TINY)
    assert p.returncode == 2
    (line,) = p.stderr.strip().splitlines()
    assert "t.yaml line 3" in line and "no YAML tags that build objects" in line
    assert not (in_tmp / "pwned").exists()


@pytest.mark.parametrize("multirun", [False, True])
@pytest.mark.slow
def test_a_default_output_folder_that_cannot_be_made_is_one_line(in_tmp, cli_checks, multirun):
    (in_tmp / "runs").write_text("a file where the runs folder goes")
    p = cli_checks(*(["-m"] if multirun else []), *TINY)
    assert p.returncode == 2
    (line,) = p.stderr.strip().splitlines()
    assert "cannot be made in runs: a file of that name is in the way" in line
    assert ("hydra.sweep.dir=PATH" if multirun else "hydra.run.dir=PATH") in line


@pytest.mark.slow
def test_slurm_without_slurm_is_one_line(in_tmp, cli_checks, monkeypatch):
    monkeypatch.setenv("PATH", str(in_tmp))  # no sbatch here
    p = cli_checks("-m", "hydra/launcher=slurm", *TINY, "hydra.sweep.dir=sw")
    assert p.returncode == 2
    assert p.stderr.strip() == ("memtrain: error: hydra/launcher=slurm needs SLURM: no sbatch on "
                                "PATH; run on a SLURM login node, or use hydra/launcher=local (or "
                                "parallel) on this machine")
    assert not (in_tmp / "sw").exists()


@pytest.mark.slow
def test_a_scheduler_that_refuses_is_one_line_and_leaves_no_folder(in_tmp):
    """sbatch present but refusing (no cluster configured): submitit's traceback was 28 lines
    and a sweep folder holding only multirun.yaml stayed behind."""
    from conftest import run_memtrain

    bin_dir = in_tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: no cluster' >&2\n"
                                    "echo 'sbatch: fatal: Could not establish a configuration "
                                    "source' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    import os

    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    p = run_memtrain("-m", "hydra/launcher=slurm", *TINY, "hydra.sweep.dir=sw", cwd=in_tmp,
                     env=env, timeout=300)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == ("memtrain: error: hydra/launcher=slurm: the scheduler refused the "
                                "jobs (sbatch: fatal: Could not establish a configuration source)"
                                "; run on a SLURM login node, or use hydra/launcher=local")
    assert not (in_tmp / "sw").exists()


@pytest.mark.parametrize("overrides,match", [
    (["optim.lr=1e300"], r"optim.lr must be in \(0, 3.4e\+38\], got 1e\+300"),
    (["optim.momentum=1.5"], r"optim.momentum must be in \[0, 1\], got 1.5"),
    (["dataset.image_size=100000"], r"dataset.image_size=100000 needs 1117.6 GiB for 10 class "
                                    r"templates of 3x100000x100000 fp32, more than this machine"),
])
def test_values_past_what_can_run_name_their_key(tmp_path, overrides, match):
    from memtrain import api

    with pytest.raises(ConfigError, match=match):
        api.run([*TINY, *overrides], out_dir=tmp_path)


def test_a_model_too_large_to_build_names_the_input_size():
    """Past the data's bound, the model's own allocation fails: the row names the input size
    (built on a shape alone, as the runner builds it: no 9000 px images are made)."""
    from omegaconf import OmegaConf

    from memtrain.data import Data
    from memtrain.run import runner

    cfg = OmegaConf.create({"model": {"_target_": "memtrain.models.mlp6"},
                            "method": {"_target_": "memtrain.methods.none.NoneMethod"}})
    data = Data(None, None, 10, (3, 9000, 9000), "synthetic")
    with pytest.raises(ConfigError, match=r"model=mlp6 for 3x9000x9000 inputs \(dataset.image_size"
                                          r"\) and 10 classes does not fit in memory"):
        runner.make_model(cfg, data)


@pytest.mark.parametrize("folder", ["runs/a(b),c", "runs/it's here", "runs/x=1,y=[2]",
                                    "runs/back\\slash", "runs/end\\", "plain/dir-1.2"])
def test_the_continue_command_names_any_folder_exactly(folder):
    """The printed continue command, read back by the shell and then by Hydra's own override
    parser, names the very folder (Hydra's quoting kept under the shell's)."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from memtrain.hydra_callbacks import continue_command

    parser = OverridesParser.create()
    given = OmegaConf.create({"task": ["trainer.seed=0,1"], "hydra": []})
    for kwargs, key in (({"sweep_dir": folder}, "hydra.sweep.dir"),
                        ({"run_dir": folder}, "hydra.run.dir")):
        words = shlex.split(continue_command(given, **kwargs))
        (line,) = [w for w in words if w.startswith(key + "=")]
        assert parser.parse_override(line).value() == folder


@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4672 vs 4566"),
    OSError(28, "No space left on device"),
])
def test_a_full_disk_is_named_with_the_file(tmp_path, monkeypatch, failure):
    """torch.save's zip writer on a full disk says only "unexpected pos 4672 vs 4566": the
    write says "no space left on device" and names the file, and leaves no temporary behind."""
    import shutil
    from collections import namedtuple

    from memtrain import record

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 0))

    def writer(f):
        f.write(b"partial")
        raise failure

    with pytest.raises(OSError,
                       match=r"no space left on device writing .*state\.pt \(0 MiB free\)"):
        record.atomic_write(tmp_path / "state.pt", writer)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("asked,reason", [
    (["trainer.account_memory=false"], "which trainer.account_memory=false leaves out"),
    (["trainer.max_steps=0", "trainer.estimate=true"], "which trainer.max_steps=0 leaves out"),
    (["method=checkpoint", "method.dry_run=true"], "with method.dry_run=true would record no "
                                                   "step"),
    (["method=checkpoint+quantize", "method.checkpoint.dry_run=true"],
     "with method.checkpoint.dry_run=true would record no step"),
])
@pytest.mark.slow
def test_a_timeline_that_would_not_be_recorded_is_refused(in_tmp, cli_checks, asked, reason):
    """trainer.memory_timeline=true where no accounting step would run ended ok with
    `memory_timeline: True` and no timeline: one line before anything runs instead."""
    p = cli_checks(*TINY, "trainer.memory_timeline=true", *asked)
    assert p.returncode == 2
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("memtrain: error: trainer.memory_timeline=true ") and reason in line
    assert list(in_tmp.iterdir()) == []
