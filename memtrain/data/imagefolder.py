"""ImageNet-style folders (torchvision ImageFolder) streamed through a DataLoader: the one
dataset builder that reads files lazily, so its broken inputs (no class folder, an unreadable
image) are turned into one-line ConfigErrors here."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from memtrain.data import Data, Split, _missing, check_folder, check_image_size, options_check
from memtrain.errors import ConfigError, check_range


class LoaderSplit(Split):
    """A torchvision ImageFolder streamed through a DataLoader with worker processes."""

    def __init__(self, dataset, workers: int):
        self.dataset, self.workers = dataset, workers

    def __len__(self) -> int:
        return len(self.dataset)

    def batches(self, batch_size, device, shuffle=False, generator=None, drop_last=False):
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=batch_size, shuffle=shuffle, generator=generator,
            drop_last=drop_last, num_workers=self.workers, pin_memory=device.type == "cuda",
            persistent_workers=False)
        try:
            for x, y in loader:
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        except ConfigError as e:  # _read_image's; from a worker with its traceback attached
            last = [ln for ln in str(e).splitlines() if ln.strip()][-1]
            raise ConfigError(last.removeprefix("memtrain.errors.ConfigError: ")) from None


def _read_image(path: str):
    """ImageFolder's loader, with an unreadable file named in one line."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except Exception as e:
        raise ConfigError(f"cannot read image {path}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from None


MAX_WORKERS = 256  # DataLoader worker processes (each a Python process with torch)


def _check_imagenet(data_dir: str | None = None, image_size: int = 224,
                    workers: int | None = None, download: bool = False, seed: int = 0, *,
                    here: bool = True) -> None:
    """imagenet's options; on this machine, its two folders and the memory of a batch of
    images at `image_size` (the files are read lazily, batch by batch)."""
    if not data_dir or data_dir == "???":  # ??? : conf/dataset/imagenet.yaml's required value
        raise ConfigError("dataset imagenet needs dataset.data_dir=PATH (a folder with train/ "
                          "and val/ subfolders, one folder per class)")
    check_folder(data_dir)
    if download:
        raise ConfigError("dataset imagenet cannot be downloaded; point dataset.data_dir at it")
    check_range("dataset.image_size", image_size, 1)
    if workers is not None:
        check_range("dataset.workers", workers, 0, MAX_WORKERS)
    if not here:
        return
    root = Path(data_dir).expanduser()
    tried = [root / "train", root / "val"]
    if not all(p.is_dir() for p in tried):
        raise _missing("imagenet", tried, " (ImageFolder layout: train/CLASS/*.jpg, val/CLASS/*)")
    check_image_size(image_size, 3, here)


@options_check(_check_imagenet)
def imagenet(data_dir: str | None = None, image_size: int = 224, workers: int | None = None,
             download: bool = False, seed: int = 0) -> Data:
    """An ImageFolder root with train/ and val/ subfolders (one folder per class)."""
    from torchvision import datasets
    from torchvision import transforms as T

    _check_imagenet(data_dir, image_size, workers, download, seed)
    root = Path(data_dir).expanduser()
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), T.ToTensor(),
                          norm])
    test_tf = T.Compose([T.Resize(math.ceil(image_size / 0.875)), T.CenterCrop(image_size),
                         T.ToTensor(), norm])
    try:
        tr = datasets.ImageFolder(str(root / "train"), transform=train_tf, loader=_read_image)
        te = datasets.ImageFolder(str(root / "val"), transform=test_tf, loader=_read_image)
    except FileNotFoundError as e:  # no class folder, or no image in them
        raise ConfigError(f"dataset imagenet: {str(e).splitlines()[0]}") from None
    if len(tr.classes) < 2:  # as synthetic data's num_classes < 2: nothing to classify
        raise ConfigError(f"dataset imagenet: {root / 'train'} holds {len(tr.classes)} class "
                          "folder; a classifier needs at least 2")
    if tr.classes != te.classes:
        raise ConfigError(f"dataset imagenet: {root / 'train'} and {root / 'val'} hold different "
                          f"class folders ({len(tr.classes)} and {len(te.classes)})")
    workers = workers if workers is not None else min(8, os.cpu_count() or 1)
    return Data(LoaderSplit(tr, workers), LoaderSplit(te, workers), len(tr.classes),
                (3, image_size, image_size), "imagenet")
