"""1-bit activation masks: pack `x > 0` into bytes, and apply the packed mask to a gradient.

Used by `method=pool` so that a ReLU keeps 1 bit per element for its backward instead of its
full-size output (the pool pitfall, docs/methods/pool.md). Bit j of byte b holds element 8*b + j
(little bit order, as numpy's `packbits(..., bitorder="little")`); the last byte is zero-padded.

Three implementations with one signature each:
- Triton kernels (`_pack_kernel`, `_masked_grad_kernel`) behind `pack_triton`, `masked_grad_triton`:
  CUDA, or the CPU under TRITON_INTERPRET=1 (tests).
- Plain-torch fallbacks `pack_torch` / `unpack_torch` / `masked_grad_torch`: any device.
- `pack` / `masked_grad` pick Triton on CUDA when it imports, else the fallback.
The eager oracle (numpy) lives in kernels/reference.py; the benchmark is
`python -m benchmarks.kernels bitmask`.
"""

from __future__ import annotations

import functools
import math

import torch
from memtrain.kernels import chunk_starts, is_fake, replayed_on_fake, triton_available

BLOCK_BYTES = 1024  # bytes per program in the pack kernel (8x as many elements)
BLOCK_ELEMS = 4096  # elements per program in the masked-gradient kernel

# ---------------------------------------------------------------- Triton kernels

triton = tl = None  # module globals, bound on first use: the kernels resolve `tl` through them


@functools.cache
def _kernels():
    """Define the kernels on first use: importing this module never needs Triton, and
    TRITON_INTERPRET (read when a kernel is defined) may be set until then."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def _pack_kernel(
        x_ptr,  # *T     input, n elements, contiguous
        bits_ptr,  # *u8  output, ceil(n / 8) bytes
        n,  # number of elements of x
        n_bytes,  # ceil(n / 8)
        BLOCK: tl.constexpr,  # bytes per program
    ):
        pid = tl.program_id(0).to(tl.int64)
        byte = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] byte index
        bit = tl.arange(0, 8)  # [8] bit index within a byte
        idx = byte[:, None] * 8 + bit[None, :]  # [BLOCK, 8] element index
        x = tl.load(x_ptr + idx, mask=idx < n, other=0)
        weights = (x > 0).to(tl.int32) << bit[None, :]  # bits never overlap: sum == or
        packed = tl.sum(weights, axis=1)  # [BLOCK] in 0..255
        tl.store(bits_ptr + byte, packed.to(tl.uint8), mask=byte < n_bytes)

    @triton.jit
    def _masked_grad_kernel(
        grad_ptr,  # *T   incoming gradient, n elements, contiguous
        bits_ptr,  # *u8  packed mask from _pack_kernel
        out_ptr,  # *T    grad where the mask bit is set, else 0
        n,  # number of elements
        BLOCK: tl.constexpr,  # elements per program
    ):
        pid = tl.program_id(0).to(tl.int64)
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        inside = idx < n
        byte = tl.load(bits_ptr + idx // 8, mask=inside, other=0).to(tl.int32)
        keep = ((byte >> (idx % 8).to(tl.int32)) & 1) != 0
        g = tl.load(grad_ptr + idx, mask=inside, other=0)
        tl.store(out_ptr + idx, tl.where(keep, g, tl.zeros_like(g)), mask=inside)

    return _pack_kernel, _masked_grad_kernel


def n_bytes(n: int) -> int:
    return (n + 7) // 8


def pack_triton(x: torch.Tensor) -> torch.Tensor:
    """Packed `x > 0` (uint8, ceil(numel / 8) bytes) computed by the Triton kernel."""
    x = x.contiguous()
    n = x.numel()
    bits = torch.empty(n_bytes(n), dtype=torch.uint8, device=x.device)
    if n and not is_fake(x):
        pack_kernel, _ = _kernels()
        grid = (_cdiv(n_bytes(n), BLOCK_BYTES),)
        pack_kernel[grid](x, bits, n, n_bytes(n), BLOCK=BLOCK_BYTES)
    return bits


def masked_grad_triton(grad: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """`grad` where the packed mask is set, else 0 (shape and dtype of grad), by Triton."""
    grad = grad.contiguous()
    out = torch.empty_like(grad)
    n = grad.numel()
    if n and not is_fake(grad):
        _, masked_kernel = _kernels()
        masked_kernel[(_cdiv(n, BLOCK_ELEMS),)](grad, bits, out, n, BLOCK=BLOCK_ELEMS)
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- torch fallback

_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    # Under fake tensors (the estimate) a fresh one: a cached tensor of one mode breaks the other
    # (the estimate's fake weights in the real run after it, or real weights in the next estimate)
    if torch._guards.detect_fake_mode() is not None:
        return torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=device)
    if device not in _BIT_WEIGHTS:
        w = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=device)
        if is_fake(w):  # made under the estimate's FakeTensorMode: no use to a real step
            return w
        _BIT_WEIGHTS[device] = w
    return _BIT_WEIGHTS[device]


PACK_CHUNKS = 16  # pack_torch works on ~1/16 of a tensor at a time


@replayed_on_fake(lambda x: (tuple(x.shape), x.stride(), x.dtype))
def pack_torch(x: torch.Tensor) -> torch.Tensor:
    """Packed `x > 0` with plain torch ops (any device). Its temporaries (a bool and a uint8
    copy of the mask, 2 bytes per element) are made one slice of the batch at a time, so they
    stay a fraction of the packed tensor's input rather than setting the activation peak."""
    n = x.numel()
    bits = torch.empty(n_bytes(n), dtype=torch.uint8, device=x.device)
    if n == 0:
        return bits
    rows = x.reshape(1, *x.shape) if x.dim() == 0 else x
    per_row = n // rows.shape[0]
    step = 8 // math.gcd(per_row, 8)  # rows per chunk a multiple of this: chunks start on a byte
    size = max(step, -(-rows.shape[0] // PACK_CHUNKS) // step * step)
    # on fake tensors (the estimate) the first and last chunk stand for all (chunk_starts)
    for start in chunk_starts(rows.shape[0], size, is_fake(x)):
        part = _pack_flat(rows[start:start + size].reshape(-1))  # a copy only of a strided slice
        first = start * per_row // 8
        bits[first:first + part.numel()] = part
    return bits


def _pack_flat(flat: torch.Tensor) -> torch.Tensor:
    m = flat > 0
    pad = (-m.numel()) % 8
    if pad:
        m = torch.cat([m, m.new_zeros(pad)])
    return (m.view(-1, 8).to(torch.uint8) * _weights(flat.device)).sum(1, dtype=torch.uint8)


def unpack_torch(bits: torch.Tensor, n: int) -> torch.Tensor:
    """The bool mask of `n` elements (flat) held in `bits`."""
    m = (bits[:, None] & _weights(bits.device)) != 0  # [n_bytes, 8]
    return m.reshape(-1)[:n]


@replayed_on_fake(lambda grad, bits: (tuple(grad.shape), grad.stride(), grad.dtype,
                                     tuple(bits.shape), bits.stride()))
def masked_grad_torch(grad: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    mask = unpack_torch(bits, grad.numel()).view(grad.shape)
    return torch.where(mask, grad, grad.new_zeros(()))


# ---------------------------------------------------------------- dispatch


def _use_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and triton_available()


def pack(x: torch.Tensor) -> torch.Tensor:
    """Packed `x > 0`: Triton on CUDA, plain torch elsewhere."""
    return pack_triton(x) if _use_triton(x) else pack_torch(x)


def masked_grad(grad: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """`grad` where the packed mask is set, else 0: Triton on CUDA, plain torch elsewhere."""
    return masked_grad_triton(grad, bits) if _use_triton(grad) else masked_grad_torch(grad, bits)
