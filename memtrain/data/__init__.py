"""Dataset builders: each returns a `Data` whose splits hand out ready-made batches on a device.

Every in-memory dataset (synthetic, the MNIST family, CIFAR) is held as one uint8 tensor that can
live on the GPU whole; batching, resizing, augmentation and normalisation then run on the device,
so input never bottlenecks a throughput figure. ImageNet-style folders stream through a DataLoader.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from memtrain.errors import ConfigError, check_choice, check_range

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]  # x: [B, C, H, W] float, y: [B] int64
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


class Split:
    """A train or test split: a length and a batch iterator on a device."""

    def __len__(self) -> int:
        raise NotImplementedError

    def batches(
        self, batch_size: int, device: torch.device, shuffle: bool = False,
        generator: torch.Generator | None = None, drop_last: bool = False,
    ) -> Iterator[Batch]:
        raise NotImplementedError

    def to(self, device: torch.device) -> Split:
        return self


def _batch_indices(n: int, batch_size: int, shuffle: bool, generator, drop_last: bool):
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    stop = n - n % batch_size if drop_last else n
    for i in range(0, stop, batch_size):
        yield order[i:i + batch_size]


def _augment(x: torch.Tensor, generator: torch.Generator | None, pad: int, flip: bool):
    """Random crop with zero padding and horizontal flip, batched, on x's device."""
    b, _, h, w = x.shape
    if pad > 0:
        xp = F.pad(x, (pad, pad, pad, pad))
        dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
        dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
        rows = (dy[:, None] + torch.arange(h, device=x.device)[None])  # [B, H]
        cols = (dx[:, None] + torch.arange(w, device=x.device)[None])  # [B, W]
        x = xp[torch.arange(b, device=x.device)[:, None, None, None],
               torch.arange(x.shape[1], device=x.device)[None, :, None, None],
               rows[:, None, :, None], cols[:, None, None, :]]
    if flip:
        mask = (torch.rand(b, generator=generator) < 0.5).to(x.device)
        x = torch.where(mask[:, None, None, None], x.flip(-1), x)
    return x


@dataclass
class TensorSplit(Split):
    """Images held as one uint8 tensor [N, C, H, W] with int64 labels; batches come normalised."""

    images: torch.Tensor
    labels: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    image_size: int | None = None
    augment: bool = False

    def __len__(self) -> int:
        return self.images.shape[0]

    def to(self, device: torch.device) -> TensorSplit:
        return TensorSplit(self.images.to(device), self.labels.to(device), self.mean, self.std,
                           self.image_size, self.augment)

    def transform(self, x: torch.Tensor, generator: torch.Generator | None = None):
        """uint8 [B, C, h, w] -> normalised float [B, C, S, S] on x's device."""
        x = x.float().div_(255)
        if self.image_size and x.shape[-1] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                              align_corners=False, antialias=self.image_size < x.shape[-1])
        if self.augment:
            x = _augment(x, generator, pad=max(1, x.shape[-1] // 8), flip=True)
        mean = torch.tensor(self.mean, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, -1, 1, 1)
        return (x - mean) / std

    def batches(self, batch_size, device, shuffle=False, generator=None, drop_last=False):
        for idx in _batch_indices(len(self), batch_size, shuffle, generator, drop_last):
            idx = idx.to(self.images.device)
            x = self.images[idx].to(device, non_blocking=True)
            y = self.labels[idx].to(device, non_blocking=True)
            yield self.transform(x, generator if self.augment else None), y

    def __getitem__(self, i: int) -> Batch:
        x, y = self.images[i:i + 1], self.labels[i]
        return self.transform(x)[0], y


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on every platform
        return 2**62


def check_fits(key: str, value, nbytes: int, what: str) -> None:
    """A value whose data cannot fit in this machine's memory is refused before the run, naming
    the key (the allocation would fail mid-run with a message that names no option, or the
    kernel would kill the process)."""
    check_memory({key: value}, nbytes, what)


def check_memory(options: dict[str, Any], nbytes: int, what: str) -> None:
    """`check_fits` for data whose size several options decide: the one line names them all."""
    if nbytes > host_memory_bytes():
        given = ", ".join(f"{k}={v}" for k, v in options.items())
        verb = "needs" if len(options) == 1 else "need"
        raise ConfigError(f"{given} {verb} {nbytes / 2**30:.1f} GiB for {what}, more than "
                          f"this machine's {host_memory_bytes() / 2**30:.1f} GiB of memory")


# ---------------------------------------------------------------- option checks

# A builder's options are checked, and the memory its data will take is counted, before it is
# built: by the builder itself, and by the command's checks before anything is written
# (`check_options`, from runner.check), so that a bad value is one line with exit status 2 and
# no run folder. A check takes the builder's keyword arguments and `here`: whether the data will
# be built on this machine (False for a SLURM job: its files and memory are the cluster node's).


def options_check(check: Callable[..., None]) -> Callable[[Callable], Callable]:
    """Mark a builder with the check of its options (`check(**options, here=...)`)."""
    def mark(build: Callable) -> Callable:
        build.check_options = check  # type: ignore[attr-defined]
        return build
    return mark


def check_options(build: Callable, options: dict[str, Any], here: bool = True) -> None:
    """A dataset builder's options checked without building it (a builder of a registered
    package without a check: nothing to check here, it checks when it builds)."""
    check = getattr(build, "check_options", None)
    if check is not None:
        check(**options, here=here)


def check_image_size(image_size, channels: int, here: bool) -> None:
    """An image size a dataset resizes to on the fly (None: the files' own): positive, and a
    batch of 128 fp32 images of that size must fit in memory."""
    if image_size is None:
        return
    check_range("dataset.image_size", image_size, 1)
    if here:
        check_fits("dataset.image_size", image_size, channels * image_size * image_size * 4 * 128,
                   f"a batch of 128 {channels}x{image_size}x{image_size} fp32 images")


def check_folder(data_dir) -> None:
    if data_dir is not None and not isinstance(data_dir, str):
        raise ConfigError(f"dataset.data_dir must be a folder path, got {data_dir!r}")


def check_labels(name: str, labels, num_classes: int, sources=None, first: int = 0) -> None:
    """Labels are a dataset's definition: `num_classes` classes numbered from `first` (EMNIST
    letters: 1-26, as torchvision defines it). Any other label would train on garbage, fail
    mid-run or, inferred, silently change the task: a ConfigError naming where it came from."""
    for i, y in enumerate(labels):
        if len(y) and (int(y.min()) < first or int(y.max()) >= first + num_classes):
            bad = y[(y < first) | (y >= first + num_classes)]
            where = sources[i] if sources else f"dataset {name}"
            raise ConfigError(f"{where}: label {int(bad[0])} is outside {first}-"
                              f"{first + num_classes - 1} ({name} has {num_classes} classes; "
                              f"{len(bad)} labels out of range)")


@dataclass
class Data:
    """What every model and method needs to know about a dataset."""

    train: Split
    test: Split
    num_classes: int  # language models: the vocabulary size
    input_shape: tuple[int, ...]  # (C, H, W) as the model sees it; token data: (seq_len,)
    name: str = ""
    task: str = "classify"  # or "lm": next-token prediction, x and y int64 [B, T]
    unigram_loss: float | None = None  # lm: the context-free model's loss (did it learn?)
    data_hash: str | None = None  # a corpus' content hash, when its content can vary
    data_source: str | None = None  # where a corpus came from (its Python version, files)


# ---------------------------------------------------------------- synthetic


def _hash_uniform(seed: int, index: torch.Tensor, numel: int) -> torch.Tensor:
    """Counter-based uniform noise in [0, 1): value k of sample i depends only on (seed, i, k).

    A vectorised integer hash (splitmix-style rounds on int64, wrapping) so that sample i is the
    same tensor on any device, in any batch and any order.
    """
    k = torch.arange(numel, device=index.device, dtype=torch.int64)
    # seed's term wrapped to int64 as the tensor arithmetic wraps (any 64-bit seed; unchanged
    # for the usual small ones)
    seed_term = (seed * 0xC2B2AE3D + 2**63) % 2**64 - 2**63
    z = index.to(torch.int64)[:, None] * 0x9E3779B1 + k[None, :] * 0x85EBCA77 + seed_term
    for mul in (0x7FEB352D, 0x846CA68B):
        z = z ^ (z >> 16)
        z = (z * mul) & 0xFFFFFFFF
    z = z ^ (z >> 15)
    return (z & 0xFFFFFF).float() / float(1 << 24)


class SyntheticSplit(Split):
    """Learnable synthetic images: a fixed smooth random template per class, shifted by a few
    pixels, plus per-sample uniform noise. Deterministic from the seed; nothing stored per sample,
    so any size (224 px included) costs no memory until a batch is made.
    """

    def __init__(self, templates: torch.Tensor, n: int, seed: int, offset: int,
                 noise: float, max_shift: int):
        self.templates = templates  # [K, C, H, W] float in [0, 1]
        self.n, self.seed, self.offset = n, seed, offset
        self.noise, self.max_shift = noise, max_shift

    def __len__(self) -> int:
        return self.n

    def labels_of(self, index: torch.Tensor) -> torch.Tensor:
        k = self.templates.shape[0]
        u = _hash_uniform(self.seed + 1, index + self.offset, 1)[:, 0]
        return (u * k).long().clamp_(max=k - 1)

    def make(self, index: torch.Tensor, device: torch.device) -> Batch:
        index = index.to(device)
        templates = self.templates.to(device)
        y = self.labels_of(index)
        x = templates[y]  # [B, C, H, W]
        b, c, h, w = x.shape
        if self.max_shift > 0:
            s = _hash_uniform(self.seed + 2, index + self.offset, 2)
            shifts = ((s * (2 * self.max_shift + 1)).long() - self.max_shift)  # [B, 2]
            rows = (torch.arange(h, device=device)[None] - shifts[:, :1]) % h  # [B, H]
            cols = (torch.arange(w, device=device)[None] - shifts[:, 1:]) % w  # [B, W]
            x = x[torch.arange(b, device=device)[:, None, None, None],
                  torch.arange(c, device=device)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]
        u = _hash_uniform(self.seed + 3, index + self.offset, c * h * w).view(b, c, h, w)
        x = x + self.noise * (2 * u - 1)
        return (x - 0.5) / 0.5, y

    def batches(self, batch_size, device, shuffle=False, generator=None, drop_last=False):
        for idx in _batch_indices(self.n, batch_size, shuffle, generator, drop_last):
            yield self.make(idx, device)

    def __getitem__(self, i: int) -> Batch:
        x, y = self.make(torch.tensor([i]), torch.device("cpu"))
        return x[0], y[0]


def _check_synthetic(seed: int = 0, num_classes: int = 10, channels: int = 3,
                     image_size: int = 32, train_size: int = 10000, test_size: int = 2000,
                     noise: float = 1.2, max_shift: int = 3, data_dir: str | None = None,
                     download: bool = False, *, here: bool = True) -> None:
    """synthetic's options; its memory: the class templates, and an epoch's sample order (a
    permutation of the training split's indices)."""
    if num_classes < 2:
        raise ConfigError(f"dataset.num_classes must be >= 2, got {num_classes}")
    if image_size < 4:
        raise ConfigError(f"dataset.image_size must be >= 4 for synthetic, got {image_size}")
    for key, value in (("train_size", train_size), ("test_size", test_size),
                       ("channels", channels)):  # test_size 0 would measure no accuracy
        if value < 1:
            raise ConfigError(f"dataset.{key} must be >= 1, got {value}")
    check_range("dataset.noise", noise, 0, 1e6)  # a noise std past the pixels' range x 1e6
    check_range("dataset.max_shift", max_shift, 0, image_size)
    if here:
        check_fits("dataset.image_size", image_size, num_classes * channels * image_size ** 2 * 4,
                   f"{num_classes} class templates of {channels}x{image_size}x{image_size} fp32")
        check_memory({"dataset.train_size": train_size, "dataset.test_size": test_size},
                     2 * 8 * max(train_size, test_size), "an epoch's sample order (int64)")


@options_check(_check_synthetic)
def synthetic(
    seed: int = 0, num_classes: int = 10, channels: int = 3, image_size: int = 32,
    train_size: int = 10000, test_size: int = 2000, noise: float = 1.2, max_shift: int = 3,
    data_dir: str | None = None, download: bool = False,
) -> Data:
    """The embedded default: learnable, deterministic, no files.

    Templates are low-frequency random images (a 4x4 random grid upsampled bicubically), so
    convolutions and MLPs can both learn them and the task does not get easier with resolution.
    """
    _check_synthetic(seed, num_classes, channels, image_size, train_size, test_size, noise,
                     max_shift, data_dir, download)
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(num_classes, channels, 4, 4, generator=g)
    templates = F.interpolate(coarse, size=(image_size, image_size), mode="bicubic",
                              align_corners=False).clamp_(0, 1)
    train = SyntheticSplit(templates, train_size, seed, 0, noise, max_shift)
    test = SyntheticSplit(templates, test_size, seed, train_size, noise, max_shift)
    return Data(train, test, num_classes, (channels, image_size, image_size), "synthetic")


# ---------------------------------------------------------------- MNIST family and CIFAR


def _missing(name: str, tried: list[Path], extra: str = "") -> ConfigError:
    where = ", ".join(str(p) for p in tried)
    return ConfigError(
        f"dataset {name} not found (looked in {where}); set dataset.data_dir=PATH to a folder "
        f"that holds it, or dataset.download=true to fetch it{extra}")


def _read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (the MNIST format, unsigned bytes), gzipped or not; a file that is not
    one, or is cut short, is a ConfigError naming it."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise ConfigError(f"cannot read the IDX file {path}: {e}") from None
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08" or raw[3] == 0:
        raise ConfigError(f"{path} is not an IDX file of unsigned bytes (bad header)")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    want = 4 + 4 * ndim + math.prod(dims)
    if len(raw) != want:
        raise ConfigError(f"{path} is truncated or corrupt: {len(raw)} bytes, its header "
                          f"{'x'.join(map(str, dims))} needs {want}")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims).copy()


def _find_idx(root: Path, stem: str) -> Path | None:
    for folder in (root, root / "raw"):
        for cand in (folder / stem, folder / f"{stem}.gz"):
            if cand.exists():
                return cand
    return None


def _mnist_like(name: str, tv_name: str, mean, std, data_dir, download, image_size, seed,
                augment=False, num_classes: int = 10, first: int = 0, **tv_kwargs) -> Data:
    from torchvision import datasets

    root = Path(data_dir).expanduser() if data_dir else Path("~/.cache/memtrain").expanduser()
    tried = [root / tv_name, root]
    if name == "fashion_mnist" and not data_dir:
        tried.insert(0, DEBIAN_FASHION_MNIST)
    # Plain IDX files (Debian's dataset-fashion-mnist, or a hand-made folder) need no torchvision.
    for folder in tried:
        files = [_find_idx(folder, f"{p}-{k}-idx{3 if k == 'images' else 1}-ubyte")
                 for p in ("train", "t10k") for k in ("images", "labels")]
        if all(files):
            xtr, ytr, xte, yte = (_read_idx(f) for f in files)
            for x, y, (fx, fy) in ((xtr, ytr, files[:2]), (xte, yte, files[2:])):
                if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
                    raise ConfigError(f"{fx} ({'x'.join(map(str, x.shape))}) and {fy} "
                                      f"({'x'.join(map(str, y.shape))}) do not match: need "
                                      f"N images of HxW and N labels")
            return _tensor_data(name, xtr[:, None], ytr, xte[:, None], yte, mean, std,
                                image_size, augment, num_classes, (files[1], files[3]), first)
    try:
        cls = getattr(datasets, tv_name)
        tr = cls(str(root), train=True, download=download, **tv_kwargs)
        te = cls(str(root), train=False, download=download, **tv_kwargs)
    except RuntimeError as e:
        if download:
            raise
        raise _missing(name, tried) from e
    return _tensor_data(name, tr.data.numpy()[:, None], tr.targets.numpy(),
                        te.data.numpy()[:, None], te.targets.numpy(), mean, std, image_size,
                        augment, num_classes, (f"{root} (train)", f"{root} (test)"), first)


def _tensor_data(name, xtr, ytr, xte, yte, mean, std, image_size, augment, num_classes: int,
                 sources=None, first: int = 0) -> Data:
    """Images and labels as Data; labels checked against the dataset's definition (`first` ..
    `first + num_classes - 1`) and numbered from 0."""
    xtr = torch.as_tensor(np.ascontiguousarray(xtr))
    xte = torch.as_tensor(np.ascontiguousarray(xte))
    ytr = torch.as_tensor(np.asarray(ytr), dtype=torch.int64)
    yte = torch.as_tensor(np.asarray(yte), dtype=torch.int64)
    size = image_size or xtr.shape[-1]
    check_image_size(size, xtr.shape[1], here=True)
    for split, x, y in (("train", xtr, ytr), ("test", xte, yte)):
        if len(y) == 0 or len(x) != len(y):
            raise ConfigError(f"dataset {name}: the {split} split has {len(x)} images and "
                              f"{len(y)} labels")
    check_labels(name, (ytr, yte), num_classes, sources, first)
    ytr, yte = ytr - first, yte - first
    train = TensorSplit(xtr, ytr, mean, std, size, augment)
    test = TensorSplit(xte, yte, mean, std, size, False)
    return Data(train, test, num_classes, (xtr.shape[1], size, size), name)


def _check_grey(data_dir: str | None = None, download: bool = False,
                image_size: int | None = None, seed: int = 0, augment: bool = False,
                split: str = "balanced", *, here: bool = True) -> None:
    """The MNIST family's options (grey images; EMNIST's split)."""
    check_folder(data_dir)
    check_image_size(image_size, 1, here)
    check_choice("dataset.split", split, EMNIST_SPLITS)


def _check_colour(data_dir: str | None = None, download: bool = False,
                  image_size: int | None = None, seed: int = 0, augment: bool = True, *,
                  here: bool = True) -> None:
    """CIFAR's options."""
    check_folder(data_dir)
    check_image_size(image_size, 3, here)


@options_check(_check_grey)
def fashion_mnist(data_dir: str | None = None, download: bool = False,
                  image_size: int | None = None, seed: int = 0, augment: bool = False) -> Data:
    _check_grey(data_dir, download, image_size, seed, augment)
    return _mnist_like("fashion_mnist", "FashionMNIST", (0.2860,), (0.3530,), data_dir,
                       download, image_size, seed, augment)


@options_check(_check_grey)
def mnist(data_dir: str | None = None, download: bool = False,
          image_size: int | None = None, seed: int = 0, augment: bool = False) -> Data:
    _check_grey(data_dir, download, image_size, seed, augment)
    return _mnist_like("mnist", "MNIST", (0.1307,), (0.3081,), data_dir, download, image_size,
                       seed, augment)


# classes of each split as torchvision defines them (letters numbers its labels 1-26)
EMNIST_SPLITS = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10,
                 "mnist": 10}


@options_check(_check_grey)
def emnist(split: str = "balanced", data_dir: str | None = None, download: bool = False,
           image_size: int | None = None, seed: int = 0, augment: bool = False) -> Data:
    _check_grey(data_dir, download, image_size, seed, augment, split)
    return _mnist_like("emnist", "EMNIST", (0.1751,), (0.3332,), data_dir, download, image_size,
                       seed, augment, num_classes=EMNIST_SPLITS[split],
                       first=1 if split == "letters" else 0, split=split)


def _cifar(name, tv_name, mean, std, data_dir, download, image_size, augment,
           num_classes: int) -> Data:
    from torchvision import datasets

    root = Path(data_dir).expanduser() if data_dir else Path("~/.cache/memtrain").expanduser()
    try:
        cls = getattr(datasets, tv_name)
        tr = cls(str(root), train=True, download=download)
        te = cls(str(root), train=False, download=download)
    except RuntimeError as e:
        if download:
            raise
        raise _missing(name, [root]) from e
    to_nchw = lambda a: np.ascontiguousarray(a.transpose(0, 3, 1, 2))
    return _tensor_data(name, to_nchw(tr.data), tr.targets, to_nchw(te.data), te.targets,
                        mean, std, image_size, augment, num_classes,
                        (f"{root} (train)", f"{root} (test)"))


@options_check(_check_colour)
def cifar10(data_dir: str | None = None, download: bool = False, image_size: int | None = None,
            seed: int = 0, augment: bool = True) -> Data:
    _check_colour(data_dir, download, image_size, seed, augment)
    return _cifar("cifar10", "CIFAR10", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616),
                  data_dir, download, image_size, augment, 10)


@options_check(_check_colour)
def cifar100(data_dir: str | None = None, download: bool = False, image_size: int | None = None,
             seed: int = 0, augment: bool = True) -> Data:
    _check_colour(data_dir, download, image_size, seed, augment)
    return _cifar("cifar100", "CIFAR100", (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762),
                  data_dir, download, image_size, augment, 100)


class CastSplit(Split):
    """A split whose floating batches come out in `dtype` (trainer.precision=bf16-true): cast
    where the batch is made, so the cast copy is the step's batch, not an activation."""

    def __init__(self, inner: Split, dtype: torch.dtype):
        self.inner, self.dtype = inner, dtype

    def __len__(self) -> int:
        return len(self.inner)

    def to(self, device: torch.device) -> CastSplit:
        return CastSplit(self.inner.to(device), self.dtype)

    def batches(self, batch_size, device, shuffle=False, generator=None, drop_last=False):
        for x, y in self.inner.batches(batch_size, device, shuffle, generator, drop_last):
            yield (x.to(self.dtype) if x.is_floating_point() else x), y


def cast_batches(data: Data, dtype: torch.dtype | None) -> Data:
    """`data` with floating batches in `dtype` (None: unchanged)."""
    if dtype is None:
        return data
    return dataclasses.replace(data, train=CastSplit(data.train, dtype),
                               test=CastSplit(data.test, dtype))


def place(data: Data, device: torch.device, max_bytes: int) -> Data:
    """Move in-memory splits onto the device whole when they fit under max_bytes."""
    for attr in ("train", "test"):
        split = getattr(data, attr)
        size = split.images.numel() if isinstance(split, TensorSplit) else getattr(
            split, "nbytes", None)  # token windows say their size
        if size is not None and size <= max_bytes:
            setattr(data, attr, split.to(device))
    return data
