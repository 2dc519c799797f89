"""Block-sparse storage of an activation matrix for method `prune`: selection, compaction and the
grad_weight product, with two backends (the Triton kernels' torch fallback lives here).

- `triton`: the kernels of kernels/block_sparse.py (CUDA, or the CPU under TRITON_INTERPRET=1).
- `torch`: the same operations in vectorised torch (a strided block view, one gather, one scatter
  and one matmul): the CPU fallback and the second implementation the tests compare against.
The eager oracles of both: kernels/reference.py, section prune.

Selection is the same for both: block scores (fp32), then the top ceil((1 - s) * n_blocks) blocks
over the whole matrix (global selection, as the paper's magnitude criterion on the BSR matrix),
ties broken by the lower block index (row-major), via a stable descending sort of the scores.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from memtrain.kernels import triton_available

BACKENDS = ("auto", "triton", "torch")
CRITERIA = ("l2", "l1")


@dataclass(frozen=True)
class PruneSpec:
    """How one layer stores its input: s, b, criterion and backend (validated by the method)."""

    sparsity: float
    block_size: int = 32
    criterion: str = "l2"
    backend: str = "auto"
    prune_shared: bool = False  # also prune inputs their producer keeps anyway (adds memory)
    compress_input: bool = False  # also prune the batch itself (alive anyway: adds memory)
    keep_dense: bool = False  # save the input as it is (prune's plan probe counts who saves it)


class BlockSparse(NamedTuple):
    """Kept blocks of A [M, K]: values [nnz, b, b], `rows` int32 [nnz] (block row of each),
    `col_ptr` int32 [n_col_blocks + 1] (grouped by block column: BSR of A^T, torch's BSC of A)."""

    values: torch.Tensor
    rows: torch.Tensor
    col_ptr: torch.Tensor
    shape: tuple[int, int]

    @property
    def block(self) -> int:
        return self.values.shape[-1]

    def to_torch_bsc(self) -> torch.Tensor:
        """torch's own sparse BSC tensor of the padded matrix (for checks and benchmarks); torch
        checks the format's invariants on the way."""
        b, (m, k) = self.block, self.shape
        size = (math.ceil(m / b) * b, math.ceil(k / b) * b)
        with warnings.catch_warnings():  # "sparse BSC support is in beta state"
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_bsc_tensor(self.col_ptr.long(), self.rows.long(), self.values,
                                           size, check_invariants=True)


def n_kept(n_blocks: int, sparsity: float) -> int:
    """ceil((1 - s) * n_blocks), computed so that s=0 keeps exactly every block."""
    return min(n_blocks, math.ceil(round((1.0 - sparsity) * n_blocks, 9)))


def resolve_backend(backend: str, device: torch.device) -> str:
    """auto -> triton on CUDA (when Triton imports), torch elsewhere."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("method.backend=triton on a CPU tensor needs TRITON_INTERPRET=1 "
                           "(or use method.backend=torch|auto)")
    return backend


def _kernels():
    from memtrain.kernels import block_sparse as kernels

    return kernels


# ---------------------------------------------------------------- torch backend


def _block_view(a: torch.Tensor, b: int) -> torch.Tensor:
    """[nbr, nbc, b, b] view of A zero-padded to multiples of b (a copy only when padding)."""
    m, k = a.shape
    pm, pk = -m % b, -k % b
    if pm or pk:
        a = F.pad(a, (0, pk, 0, pm))
    return a.unflatten(0, (-1, b)).unflatten(2, (-1, b)).transpose(1, 2)


def block_scores_torch(blocks: torch.Tensor, criterion: str = "l2") -> torch.Tensor:
    """fp32 [nbr, nbc] norms of the blocks of `_block_view`."""
    return torch.linalg.vector_norm(blocks, ord=1 if criterion == "l1" else 2, dim=(2, 3),
                                    dtype=torch.float32)


def compact_torch(blocks: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """values [nnz, b, b]: one gather out of the block view."""
    return blocks[rows.long(), cols.long()]


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def strip_rows(m: int, k: int, b: int, nnz: int) -> int:
    """The b x b blocks a strip of grad_weight_torch may hold: its dense copy stays within half
    of what the blocks save against the dense input (m x k), one block at least, so backward's
    transient never takes back what the forward saved."""
    saved = m * k - nnz * b * b
    return max(1, saved // 2 // (b * b))


def grad_weight_torch(g: torch.Tensor, bs: BlockSparse) -> torch.Tensor:
    """G^T @ A_pruned a strip at a time: kept blocks scattered into a dense strip (zero
    elsewhere), one addmm into the strip's columns of the result. A strip holds `strip_rows`
    block rows' worth of blocks: as many whole block columns as fit, or one column's rows a
    part at a time. The transient is a strip, never the dense matrix A (which would take back
    in backward what the blocks saved in forward: mlp6's activation + temporaries peak read
    1.14x none's when this densified A whole)."""
    (m, k), b = bs.shape, bs.block
    nbr, nbc = math.ceil(m / b), bs.col_ptr.numel() - 1
    per = strip_rows(m, k, b, bs.values.shape[0])
    # strips add up in fp32 when G is half precision (one rounding, as one mm)
    low = g.dtype in (torch.float16, torch.bfloat16) and per < nbr  # a column in parts
    out = g.new_zeros(g.shape[1], nbc * b, dtype=torch.float32 if low else g.dtype)
    group = min(nbc, per // nbr)  # whole block columns per strip (0: a column in parts)
    if _is_fake(g) or _is_fake(bs.values):  # the estimate: no data to index by; one strip's
        strip = bs.values.new_zeros(nbr * b * group * b if group else per * b * b)  # as below
        del strip
        return (out.to(g.dtype) if low else out)[:, :k]
    ptr, rows = bs.col_ptr.tolist(), bs.rows.long()
    if group:  # whole block columns, `group` of them a strip
        cols = torch.repeat_interleave(torch.arange(nbc, device=g.device),
                                       (bs.col_ptr[1:] - bs.col_ptr[:-1]).long())
        for c0 in range(0, nbc, group):
            c1 = min(nbc, c0 + group)
            lo, hi = ptr[c0], ptr[c1]
            if lo == hi:
                continue
            strip = bs.values.new_zeros(nbr, b, c1 - c0, b, dtype=out.dtype)
            strip[rows[lo:hi], :, cols[lo:hi] - c0, :] = bs.values[lo:hi].to(out.dtype)
            out[:, c0 * b:c1 * b].addmm_(g.t().to(out.dtype),
                                         strip.view(nbr * b, (c1 - c0) * b)[:m])
        return out[:, :k]
    for c in range(nbc):  # one block column, `per` block rows a strip
        if ptr[c] == ptr[c + 1]:
            continue
        r_c, v_c = rows[ptr[c]:ptr[c + 1]], bs.values[ptr[c]:ptr[c + 1]]  # rows ascending
        cuts = torch.searchsorted(r_c, torch.arange(0, nbr + per, per, device=r_c.device))
        cuts = cuts.tolist()
        for i, ra in enumerate(range(0, nbr, per)):
            lo, hi = cuts[i], cuts[i + 1]
            if lo == hi:
                continue
            rb = min(nbr, ra + per)
            strip = v_c.new_zeros(rb - ra, b, b, dtype=out.dtype)
            strip[r_c[lo:hi] - ra] = v_c[lo:hi].to(out.dtype)
            n = min(rb * b, m) - ra * b  # the padding rows past m are left out (zero in A)
            out[:, c * b:(c + 1) * b].addmm_(g[ra * b:ra * b + n].t().to(out.dtype),
                                             strip.view(-1, b)[:n])
    return (out.to(g.dtype) if low else out)[:, :k]


# ---------------------------------------------------------------- both backends


def select_blocks(scores: torch.Tensor, sparsity: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """(rows, cols, col_ptr) of the kept blocks, int32, grouped by block column then row.

    Global top-k: the highest ceil((1 - s) * n) scores over the whole matrix; a stable descending
    sort keeps ties deterministic (the lower row-major index wins).
    """
    nbr, nbc = scores.shape
    keep = n_kept(nbr * nbc, sparsity)
    order = torch.sort(scores.flatten(), descending=True, stable=True).indices[:keep]
    r, c = order // nbc, order % nbc
    key = torch.sort(c * nbr + r).values  # column-major: the order grad_weight consumes them
    rows, cols = (key % nbr).int(), (key // nbr).int()
    # cols is sorted: column c's blocks start at the first index with cols >= c. A fixed output
    # shape (bincount's depends on the data), so fake tensors (the estimate) run it too.
    col_ptr = torch.searchsorted(cols, torch.arange(nbc + 1, device=cols.device,
                                                    dtype=cols.dtype)).int()
    return rows, cols, col_ptr


def compress(a: torch.Tensor, spec: PruneSpec) -> BlockSparse:
    """Score, select and compact A [M, K] into its kept b x b blocks."""
    b = spec.block_size
    if resolve_backend(spec.backend, a.device) == "triton":
        kern = _kernels()
        rows, cols, col_ptr = select_blocks(kern.block_scores(a, b, spec.criterion), spec.sparsity)
        values = kern.compact_blocks(a, rows, cols, b)
    else:
        blocks = _block_view(a, b)  # padded once, shared by scoring and the gather
        rows, cols, col_ptr = select_blocks(block_scores_torch(blocks, spec.criterion),
                                            spec.sparsity)
        values = compact_torch(blocks, rows, cols)
    return BlockSparse(values, rows, col_ptr, tuple(a.shape))


def grad_weight(g: torch.Tensor, bs: BlockSparse, backend: str = "auto") -> torch.Tensor:
    """grad_weight [N, K] = G^T @ A_pruned for grad_out G [M, N]."""
    if bs.values.dtype != g.dtype:
        bs = bs._replace(values=bs.values.to(g.dtype))
    if resolve_backend(backend, g.device) == "triton":
        return _kernels().bsr_grad_weight(g, bs.values, bs.rows, bs.col_ptr, bs.shape[1])
    return grad_weight_torch(g, bs)


def compressed_elements(m: int, k: int, spec: PruneSpec) -> int:
    """Elements the kept blocks take (padding included): the size check against dense storage."""
    b = spec.block_size
    return n_kept(math.ceil(m / b) * math.ceil(k / b), spec.sparsity) * b * b
