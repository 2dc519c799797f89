"""Eager oracles for the Triton kernels in kernels/: slow, obviously correct, independent of the
kernels they check. Each method keeps its own self-contained section."""

from __future__ import annotations

import numpy as np
import torch

# ================================================================ pool: 1-bit ReLU masks
# kernels/bitmask.py packs `x > 0` little-endian within each byte, zero-padded at the end:
# exactly numpy's packbits(bitorder="little").


def pool_pack_mask(x: torch.Tensor) -> torch.Tensor:
    """Packed `x > 0` as uint8 bytes (ceil(numel / 8))."""
    m = (x.detach().float() > 0).reshape(-1).cpu().numpy()
    return torch.from_numpy(np.packbits(m, bitorder="little")).to(x.device)


def pool_unpack_mask(bits: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` bits of `bits` as a flat bool tensor."""
    m = np.unpackbits(bits.cpu().numpy(), count=n, bitorder="little").astype(bool)
    return torch.from_numpy(m).to(bits.device)


def pool_masked_grad(grad: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """ReLU's backward from the packed mask: grad where the bit is set, else 0."""
    mask = pool_unpack_mask(bits, grad.numel()).view(grad.shape)
    return torch.where(mask, grad, torch.zeros_like(grad))
