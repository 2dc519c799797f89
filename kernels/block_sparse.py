"""Block-sparse activation pruning: Triton kernels (method `prune`).

An activation A [M, K] (rows = batch x tokens, cols = features) is tiled into B x B blocks; the
kernels here
  1. score every block by its L2 or L1 norm (`_block_score_kernel`, `block_scores`),
  2. gather the kept blocks into a compact buffer (`_block_compact_kernel`, `compact_blocks`),
  3. compute grad_weight = G^T @ A_pruned, looping only over the kept blocks with `tl.dot` tiles
     (`_bsr_grad_weight_kernel`, `bsr_grad_weight`).
The top-k choice between 1 and 2 is a sort on the (small) score vector, done in torch
(kernels/bsr.py), as is the autograd wrapper (memtrain/methods/prune.py).

Storage (`BlockSparse` in kernels/bsr.py): values [nnz, B, B] in A's dtype, each block as
it sits in A (zero-padded past the edges of A), ordered by block column and, within a column, by
block row; `rows` int32 [nnz] = the block row of each kept block; `col_ptr` int32 [n_col_blocks + 1]
= where each block column starts. This is the BSR layout of A^T (torch's BSC layout of A), the
order in which grad_weight consumes the blocks: each output tile W[:, c*B:(c+1)*B] is the sum over
the kept blocks of block column c only.

Runs on CUDA; on the CPU under TRITON_INTERPRET=1 (set before this module is imported). Eager
oracles: kernels/reference.py, section "prune".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from memtrain.kernels import is_fake


@triton.jit
def _block_score_kernel(
    a_ptr,  # A [M, K], any strides
    score_ptr,  # out: fp32 [n_row_blocks, n_col_blocks], row-major
    M, K,  # A's shape
    stride_am, stride_ak,  # A's strides
    n_col_blocks,  # ceil(K / B)
    B: tl.constexpr,  # block size
    L1: tl.constexpr,  # True: sum |a|; False: sqrt(sum a^2)
):
    rb = tl.program_id(0).to(tl.int64)  # block row
    cb = tl.program_id(1).to(tl.int64)  # block column
    offs_m = rb * B + tl.arange(0, B)
    offs_k = cb * B + tl.arange(0, B)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak, mask=mask,
                other=0.0).to(tl.float32)
    if L1:
        score = tl.sum(tl.sum(tl.abs(a), axis=1), axis=0)
    else:
        score = tl.sqrt(tl.sum(tl.sum(a * a, axis=1), axis=0))
    tl.store(score_ptr + rb * n_col_blocks + cb, score)


@triton.jit
def _block_compact_kernel(
    a_ptr,  # A [M, K], any strides
    rows_ptr,  # block row of each kept block, int32 [nnz]
    cols_ptr,  # block column of each kept block, int32 [nnz]
    val_ptr,  # out: values [nnz, B, B], contiguous, A's dtype
    M, K,  # A's shape
    stride_am, stride_ak,  # A's strides
    B: tl.constexpr,  # block size
):
    j = tl.program_id(0).to(tl.int64)  # one program per kept block
    r = tl.load(rows_ptr + j).to(tl.int64)
    c = tl.load(cols_ptr + j).to(tl.int64)
    offs = tl.arange(0, B)
    offs_m = r * B + offs
    offs_k = c * B + offs
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    # zero padding past A's edges: padded blocks are plain B x B blocks for the product
    a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak, mask=mask,
                other=0.0)
    tl.store(val_ptr + j * B * B + offs[:, None] * B + offs[None, :], a)


@triton.jit
def _bsr_grad_weight_kernel(
    g_ptr,  # grad_out G [M, N], any strides
    val_ptr,  # kept blocks of A [nnz, B, B], grouped by block column
    rows_ptr,  # block row of each kept block, int32 [nnz]
    colptr_ptr,  # start of each block column in values, int32 [n_col_blocks + 1]
    w_ptr,  # out: grad_weight [N, K] (or fp32 partial sums [SPLIT, N, K] when SPLIT > 1)
    M, N, K,  # G is [M, N], A is [M, K]
    stride_gm, stride_gn,  # G's strides
    stride_ws, stride_wn, stride_wk,  # out's strides (split, row, col)
    SPLIT: tl.constexpr,  # programs sharing one block column (split-K over the kept blocks)
    B: tl.constexpr,  # block size
    BLOCK_N: tl.constexpr,  # rows of grad_weight per program
    IEEE: tl.constexpr,  # full fp32 products (no TF32), as torch.matmul without allow_tf32
    UPCAST: tl.constexpr,  # fp32 operands: only under TRITON_INTERPRET (see bsr_grad_weight)
):
    pid_n = tl.program_id(0)
    c = tl.program_id(1)  # block column of A = column tile of grad_weight
    s = tl.program_id(2)  # which share of the column's kept blocks
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = tl.arange(0, B)
    start = tl.load(colptr_ptr + c)
    end = tl.load(colptr_ptr + c + 1)
    chunk = tl.cdiv(end - start, SPLIT)
    lo = start + s * chunk
    hi = tl.minimum(end, lo + chunk)
    acc = tl.zeros((BLOCK_N, B), dtype=tl.float32)
    v_ptrs = val_ptr + lo.to(tl.int64) * B * B + offs[:, None] * B + offs[None, :]
    # Only the kept blocks of this column. A `while` rather than `for j in range(lo, hi)`: bounds
    # loaded from memory are fine for compiled Triton, but Triton 3.6's interpreter converts them
    # with int() on a 1-element array, which NumPy >= 2.4 refuses (triton-lang/triton#9171).
    j = lo
    while j < hi:
        r = tl.load(rows_ptr + j).to(tl.int64)
        offs_m = r * B + offs
        g = tl.load(g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn,
                    mask=(offs_m[:, None] < M) & (offs_n[None, :] < N), other=0.0)  # [B, BLOCK_N]
        v = tl.load(v_ptrs)  # [B, B]
        v_ptrs += B * B
        if UPCAST:
            g = g.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            acc += tl.dot(tl.trans(g), v, input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(g), v)
        j += 1
    offs_k = c * B + offs
    ptrs = w_ptr + s * stride_ws + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    tl.store(ptrs, acc.to(w_ptr.dtype.element_ty),
             mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


# ---------------------------------------------------------------- launchers


def block_scores(a: torch.Tensor, block: int, criterion: str = "l2") -> torch.Tensor:
    """fp32 [ceil(M/B), ceil(K/B)] norms of A's B x B blocks (zero-padded at the edges)."""
    m, k = a.shape
    nbr, nbc = triton.cdiv(m, block), triton.cdiv(k, block)
    scores = torch.empty(nbr, nbc, device=a.device, dtype=torch.float32)
    if is_fake(a):  # the estimate: the output's size is all it needs
        return scores
    _block_score_kernel[(nbr, nbc)](a, scores, m, k, a.stride(0), a.stride(1), nbc, B=block,
                                    L1=criterion == "l1")
    return scores


def compact_blocks(a: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                   block: int) -> torch.Tensor:
    """values [nnz, B, B]: block (rows[j], cols[j]) of A, zero-padded past A's edges."""
    m, k = a.shape
    values = torch.empty(rows.numel(), block, block, device=a.device, dtype=a.dtype)
    if rows.numel() and not is_fake(a):
        _block_compact_kernel[(rows.numel(),)](a, rows, cols, values, m, k, a.stride(0),
                                               a.stride(1), B=block)
    return values


def _auto_split(device: torch.device, programs: int, max_per_column: int) -> int:
    """Split-K factor: enough programs to fill the GPU, at least 8 blocks per program."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(2 * sms, max(programs, 1))
    return int(max(1, min(want, max_per_column // 8, 64)))


def bsr_grad_weight(g: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                    col_ptr: torch.Tensor, k: int, split: int | None = None,
                    block_n: int = 64) -> torch.Tensor:
    """grad_weight [N, K] = G^T @ A_pruned for G [M, N] and A's kept blocks.

    `split` > 1 splits each block column's kept blocks over that many programs (split-K) whose
    fp32 partial sums are added afterwards in a fixed order (deterministic); None picks it from
    the GPU's size. The output has G's dtype; products accumulate in fp32.
    """
    m, n = g.shape
    block = values.shape[-1]
    nbc = col_ptr.numel() - 1
    grid_n = triton.cdiv(n, block_n)
    if split is None:
        counts = col_ptr[1:] - col_ptr[:-1]
        # a fake tensor (the estimate) has no data: the most blocks a column can hold
        max_per_col = (triton.cdiv(m, block) if is_fake(col_ptr)
                       else int(counts.max()) if nbc else 0)
        split = _auto_split(g.device, grid_n * nbc, max_per_col)
    if split > 1:
        out = torch.empty(split, n, k, device=g.device, dtype=torch.float32)
        strides = out.stride()
    else:
        out = torch.empty(n, k, device=g.device, dtype=g.dtype)
        strides = (0, *out.stride())
    ieee = g.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    # Triton 3.8's interpreter returns garbage for a bf16/fp16 tl.dot; bf16 x bf16 products are
    # exact in fp32 and both paths accumulate in fp32, so fp32 operands compute the same sums.
    upcast = g.device.type != "cuda" and g.dtype != torch.float32
    if is_fake(g):
        return out.sum(0).to(g.dtype) if split > 1 else out
    _bsr_grad_weight_kernel[(grid_n, nbc, split)](
        g, values, rows, col_ptr, out, m, n, k, g.stride(0), g.stride(1), *strides,
        SPLIT=split, B=block, BLOCK_N=block_n, IEEE=ieee, UPCAST=upcast)
    return out.sum(0).to(g.dtype) if split > 1 else out
