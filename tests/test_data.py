"""Datasets: the synthetic default is deterministic and learnable; real data loads offline."""

import pytest
import torch
from conftest import fashion_mnist_available

from memtrain import api
from memtrain import data as D
from memtrain.data import tokens
from memtrain.errors import ConfigError

CPU = torch.device("cpu")


def test_synthetic_is_deterministic_and_index_stable():
    a = D.synthetic(seed=3, train_size=50, test_size=10)
    b = D.synthetic(seed=3, train_size=50, test_size=10)
    xa, ya = a.train.make(torch.tensor([5, 7, 9]), CPU)
    xb, yb = b.train.make(torch.tensor([9, 7, 5]), CPU)
    assert torch.equal(xa, xb.flip(0)) and torch.equal(ya, yb.flip(0))
    c = D.synthetic(seed=4, train_size=50, test_size=10)
    assert not torch.equal(xa, c.train.make(torch.tensor([5, 7, 9]), CPU)[0])
    # train and test are different samples of the same classes
    xt, _ = a.test.make(torch.tensor([5]), CPU)
    assert not torch.equal(xa[0], xt[0])


def test_synthetic_shapes_and_classes():
    d = D.synthetic(seed=0, num_classes=7, channels=1, image_size=20, train_size=70)
    x, y = next(d.train.batches(70, CPU))
    assert x.shape == (70, 1, 20, 20) and d.input_shape == (1, 20, 20)
    assert set(y.tolist()) == set(range(7))
    assert abs(float(x.mean())) < 0.5


@pytest.mark.slow
def test_synthetic_is_learnable(in_tmp):
    row = api.run(["model=mlp6", "trainer.max_steps=200", "trainer.batch_size=64",
                   "optim.lr=0.05", "trainer.progress=false", "dataset.image_size=16",
                   "trainer.eval_max_batches=16"])
    assert row["status"] == "ok"
    assert row["test_acc"] > 0.5  # chance is 0.1


def test_batches_cover_the_split_once():
    d = D.synthetic(train_size=37, test_size=5)
    n = sum(y.shape[0] for _, y in d.train.batches(8, CPU, shuffle=True,
                                                    generator=torch.Generator().manual_seed(0)))
    assert n == 37
    n = sum(y.shape[0] for _, y in d.train.batches(8, CPU, drop_last=True))
    assert n == 32


def test_idx_reader_and_missing_folder(tmp_path):
    import gzip

    import numpy as np

    imgs = (np.arange(3 * 28 * 28) % 256).astype(np.uint8).reshape(3, 28, 28)
    labels = np.array([0, 1, 9], dtype=np.uint8)
    for prefix in ("train", "t10k"):
        with gzip.open(tmp_path / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
            f.write(b"\x00\x00\x08\x03" + (3).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
                    + imgs.tobytes())
        with gzip.open(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(b"\x00\x00\x08\x01" + (3).to_bytes(4, "big") + labels.tobytes())
    d = D.mnist(data_dir=str(tmp_path), image_size=32)
    assert d.num_classes == 10 and d.input_shape == (1, 32, 32) and len(d.train) == 3
    assert torch.equal(d.train.images[1], torch.from_numpy(imgs[1:2].copy()))
    with pytest.raises(ConfigError, match="dataset mnist not found"):
        D.mnist(data_dir=str(tmp_path / "absent"))


@pytest.mark.data
@pytest.mark.skipif(not fashion_mnist_available(), reason="Debian's dataset-fashion-mnist absent")
def test_real_fashion_mnist_loads_from_debian_package():
    d = D.fashion_mnist()
    assert (len(d.train), len(d.test), d.num_classes) == (60000, 10000, 10)
    x, y = next(d.test.batches(16, CPU))
    assert x.shape == (16, 1, 28, 28)


# ---------------------------------------------------------------- what building costs


def test_every_dataset_builder_checks_its_options_before_building():
    """Each conf/dataset option's builder has an option check (ranges, and on this machine the
    memory its data takes) that the command runs before anything is written."""
    import yaml
    from conftest import CONF

    from memtrain.config import trust

    for path in sorted((CONF / "dataset").glob("*.yaml")):
        options = yaml.safe_load(path.read_text())
        build = trust.locate(options.pop("_target_"), "dataset._target_")
        assert callable(getattr(build, "check_options", None)), path.name
        if path.stem == "imagenet":  # its folder is required: data_dir: ???
            with pytest.raises(ConfigError, match="needs dataset.data_dir=PATH"):
                D.check_options(build, options, here=False)
        else:
            D.check_options(build, options, here=False)


def test_the_token_chain_is_linear_in_the_vocabulary(monkeypatch):
    """Above PERMUTED_VOCAB one permutation of the vocabulary is drawn, not one per token (V^2
    draws, and V^2 x 8 bytes while each slice kept its permutation); each token's successors
    are distinct and in range."""
    drawn, real = [], torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda n, **kw: drawn.append(n) or real(n, **kw))
    v = tokens.PERMUTED_VOCAB * 8
    d = tokens.tokens(vocab_size=v, seq_len=16, train_size=8, test_size=8)
    assert drawn == [v] and d.num_classes == v
    assert int(d.train.windows.max()) < v and d.train.windows.shape == (8, 17)
    succ = tokens.successors(v, 7, torch.Generator().manual_seed(1))
    assert succ.shape == (v, 7) and int(succ.min()) >= 0 and int(succ.max()) < v
    assert bool((succ.sort(dim=1).values.diff(dim=1) > 0).all())  # distinct in every row


def test_a_small_vocabulary_keeps_its_chain_and_frees_each_permutation(monkeypatch):
    """Up to PERMUTED_VOCAB the chain is the one the dataset has always drawn (the default's
    windows hash as before this bound existed), and no token's permutation is alive when the
    table is stacked (its slice is copied out)."""
    import hashlib
    import weakref

    d = tokens.tokens()
    digest = hashlib.sha256(d.train.windows.numpy().tobytes() + d.test.windows.numpy().tobytes())
    assert digest.hexdigest()[:16] == "a0d0ebc73efd8afa"
    made, alive, real_perm, real_stack = [], [], torch.randperm, torch.stack

    def perm(n, **kw):
        out = real_perm(n, **kw)
        made.append(weakref.ref(out))
        return out

    def stack(xs, *a, **kw):
        alive.append(sum(r() is not None for r in made))
        return real_stack(xs, *a, **kw)

    monkeypatch.setattr(torch, "randperm", perm)
    monkeypatch.setattr(torch, "stack", stack)
    tokens.successors(300, 4, torch.Generator().manual_seed(0))
    assert len(made) == 300 and alive == [0]


@pytest.mark.slow
def test_data_that_cannot_fit_is_refused_by_its_keys_before_anything(in_tmp, monkeypatch):
    """The memory a dataset's options ask for is counted before it is built: past this
    machine's memory, one line naming the keys, no folder, nothing drawn."""
    monkeypatch.setattr(D, "host_memory_bytes", lambda: 2**20)
    monkeypatch.setattr(tokens, "successors", lambda *a: pytest.fail("the chain was drawn"))
    with pytest.raises(ConfigError) as e:
        api.run(["model=gpt_nano", "dataset=tokens", "dataset.vocab_size=100000",
                 "dataset.seq_len=16", "dataset.train_size=8"], out_dir=in_tmp / "r")
    assert str(e.value).startswith(
        "dataset.train_size=8, dataset.test_size=200, dataset.seq_len=16, "
        "dataset.vocab_size=100000, dataset.branching=4 need ")
    assert "more than this machine's 0.0 GiB of memory" in str(e.value)
    assert list(in_tmp.iterdir()) == []


@pytest.mark.slow
def test_sigterm_while_the_data_is_built_ends_the_run_interrupted(in_tmp, monkeypatch):
    """A stop signal before the first step ends the run at once: a row with status
    interrupted, no step done, not a build that goes on until the kernel kills it."""
    import os
    import signal
    import time

    finished = []

    def slow_split(*args, **kwargs):  # a build that takes long after the signal arrives
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)
        finished.append(True)

    monkeypatch.setattr(D, "SyntheticSplit", slow_split)
    row = api.run(["trainer=smoke", "model=mlp6", "dataset.image_size=8"], out_dir=in_tmp / "r")
    assert not finished
    assert (row["status"], row["signal"]) == ("interrupted", "SIGTERM")
    assert row["error"] == ("SIGTERM received while building the data, the model and the "
                            "method; stopped before training")
    assert "failed_step" not in row and "steps" not in row


def test_text_from_a_folder_names_the_folder(tmp_path):
    """`dataset.data_dir`: the row's data_source is the folder read (with the corpus' content
    hash), not the running Python's standard library."""
    import shutil

    for name in tokens.STDLIB_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tokens.stdlib_root() / name, tmp_path / name)
    own = tokens.text(seq_len=64)
    copied = tokens.text(seq_len=64, data_dir=str(tmp_path))
    assert own.data_source.startswith("python3.")
    assert copied.data_source.startswith(f"{tmp_path.resolve()}, {len(tokens.STDLIB_FILES)} "
                                         "files, ")
    assert copied.data_hash == own.data_hash
