"""Eager oracles for the Triton kernels in kernels/: slow, obviously correct, independent of the
kernels they check. Each method keeps its own self-contained section (pool, prune, quantize)."""

from __future__ import annotations

import math

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


# ================================================================ prune (kernels/block_sparse.py)
# Written block by block in Python loops on purpose: independent of the vectorised torch backend
# (kernels/bsr.py) and of the kernels, for small test shapes only.


def prune_block_scores_ref(a: torch.Tensor, b: int, criterion: str = "l2") -> torch.Tensor:
    """fp32 [ceil(M/b), ceil(K/b)]: the L2 (or L1) norm of each b x b block, computed in fp64."""
    m, k = a.shape
    nbr, nbc = math.ceil(m / b), math.ceil(k / b)
    out = torch.zeros(nbr, nbc, dtype=torch.float64)
    for i in range(nbr):
        for j in range(nbc):
            blk = a[i * b:(i + 1) * b, j * b:(j + 1) * b].double()
            out[i, j] = blk.abs().sum() if criterion == "l1" else blk.square().sum().sqrt()
    return out.float()


def prune_topk_ref(scores: torch.Tensor, sparsity: float) -> list[tuple[int, int]]:
    """The kept (row, col) blocks: the ceil((1-s) n) largest scores, ties to the lower index."""
    nbr, nbc = scores.shape
    n = nbr * nbc
    keep = min(n, math.ceil(round((1.0 - sparsity) * n, 9)))
    flat = scores.flatten().tolist()
    order = sorted(range(n), key=lambda i: (-flat[i], i))[:keep]
    return sorted(((i // nbc, i % nbc) for i in order), key=lambda rc: (rc[1], rc[0]))


def prune_compact_ref(a: torch.Tensor, kept: list[tuple[int, int]], b: int) -> torch.Tensor:
    """values [nnz, b, b]: each kept block copied out of A, zero-padded past A's edges."""
    out = torch.zeros(len(kept), b, b, dtype=a.dtype)
    for n, (i, j) in enumerate(kept):
        blk = a[i * b:(i + 1) * b, j * b:(j + 1) * b]
        out[n, :blk.shape[0], :blk.shape[1]] = blk
    return out


def prune_mask_ref(shape: tuple[int, int], kept: list[tuple[int, int]], b: int) -> torch.Tensor:
    """Boolean [M, K]: True on the elements of the kept blocks."""
    mask = torch.zeros(shape, dtype=torch.bool)
    for i, j in kept:
        mask[i * b:(i + 1) * b, j * b:(j + 1) * b] = True
    return mask


def prune_grad_weight_ref(g: torch.Tensor, a: torch.Tensor, kept: list[tuple[int, int]],
                          b: int) -> torch.Tensor:
    """grad_weight = G^T @ (A with every pruned block zeroed), in fp64."""
    mask = prune_mask_ref(tuple(a.shape), kept, b)
    return g.double().t() @ (a.double() * mask)


# ================================================================ quantize (kernels/quant.py)
# Group by group and element by element in numpy fp32, the formula of kernels/quant.py written
# out plainly: independent of the vectorised torch path and of the kernels, small shapes only.


def quant_ref(x: torch.Tensor, bits: int, group_size: int, noise: torch.Tensor | None = None,
              chan: tuple[int, int] | None = None):
    """(codes uint8 [groups * G * bits / 8], mn fp32 [groups], scale fp32 [groups]) of x read
    flat; `noise` (uniform [0, 1), x's numel) for stochastic rounding, None for nearest. With
    `chan` = (C, inner) every element is first scaled by its channel's (i // inner) % C min and
    range, and (cmin fp32 [C], crng fp32 [C]) follow in the tuple."""
    flat = x.detach().float().reshape(-1).cpu().numpy()
    u = None if noise is None else noise.float().reshape(-1).cpu().numpy()
    levels = np.float32((1 << bits) - 1)
    if chan is not None:
        channels, inner = chan
        cmins, crngs = np.zeros(channels, np.float32), np.zeros(channels, np.float32)
        for c in range(channels):
            vals = [flat[i] for i in range(flat.size) if (i // inner) % channels == c]
            cmins[c] = min(vals)
            crngs[c] = np.float32(max(vals) - cmins[c])
        cinvs = [np.float32(np.float32(1) / r) if r > 0 else np.float32(0) for r in crngs]
        flat = np.array([np.float32(np.float32(v - cmins[(i // inner) % channels]) *
                                    cinvs[(i // inner) % channels])
                         for i, v in enumerate(flat)], dtype=np.float32)
    groups = math.ceil(flat.size / group_size)
    codes = np.zeros(groups * group_size, dtype=np.uint8)
    mns, scales = np.zeros(groups, np.float32), np.zeros(groups, np.float32)
    for g in range(groups):
        lo_i, hi_i = g * group_size, min((g + 1) * group_size, flat.size)
        grp = flat[lo_i:hi_i]
        mn, mx = grp.min(), grp.max()
        rng = np.float32(mx - mn)
        inv = np.float32(levels / rng) if rng > 0 else np.float32(0)
        for i in range(lo_i, hi_i):
            r = np.float32(0.5) if u is None else u[i]
            q = np.floor(np.float32(np.float32(flat[i] - mn) * inv) + r)
            codes[i] = int(min(max(q, 0), levels))
        mns[g], scales[g] = mn, np.float32(rng / levels)
    packed = np.zeros(codes.size * bits // 8, dtype=np.uint8)
    for i, c in enumerate(codes):  # element i: byte i * bits // 8, bit (i * bits) % 8
        packed[i * bits // 8] |= np.uint8(int(c) << (i * bits % 8))
    if chan is not None:
        return packed, mns, scales, cmins, crngs
    return packed, mns, scales


def dequant_ref(codes: np.ndarray, mns: np.ndarray, scales: np.ndarray, n: int, bits: int,
                group_size: int, chan: tuple[int, int] | None = None,
                cmins: np.ndarray | None = None, crngs: np.ndarray | None = None) -> torch.Tensor:
    """The first n values (fp32, flat) of packed codes: code * scale + mn per group, then (with
    `chan` = (C, inner)) * crng + cmin of the element's channel (i // inner) % C."""
    out = np.zeros(n, dtype=np.float32)
    for i in range(n):
        c = (int(codes[i * bits // 8]) >> (i * bits % 8)) & ((1 << bits) - 1)
        g = i // group_size
        out[i] = np.float32(np.float32(c) * scales[g]) + mns[g]
        if chan is not None:
            ch = (i // chan[1]) % chan[0]
            out[i] = np.float32(np.float32(out[i] * crngs[ch]) + cmins[ch])
    return torch.from_numpy(out)
