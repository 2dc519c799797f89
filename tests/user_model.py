"""A user's own model file, as `MEMTRAIN_MODEL=tests/user_model.py:make_net memtrain model=module`
builds it (memtrain/models/user.py): a small CNN in plain PyTorch, nothing of memtrain's."""

from torch import nn


class TinyNet(nn.Module):
    """conv-BN-ReLU, max-pool, conv-ReLU, global pooling, linear classifier."""

    def __init__(self, channels: int = 3, num_classes: int = 10, width: int = 8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x):  # [B, C, H, W] -> [B, classes]
        return self.head(self.features(x))


def make_net(num_classes: int, input_shape: tuple[int, int, int], width: int = 8) -> TinyNet:
    """The factory: the data's classes and channels, `width` from model.kwargs."""
    return TinyNet(input_shape[0], num_classes, width)
