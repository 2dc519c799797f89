"""Datasets: the synthetic default is deterministic and learnable; real data loads offline."""

import pytest
import torch
from conftest import fashion_mnist_available

from memtrain import api
from memtrain import data as D
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
