"""Triton kernels (installed as memtrain.kernels), each beside its torch fallback and an eager
oracle; a leaf package: it imports torch, triton and numpy only, never the rest of memtrain.

- `bitmask.py`: 1-bit ReLU masks (method pool): Triton kernels and their torch fallback.
- `block_sparse.py`: block scores, compaction and the block-sparse grad_weight (method prune),
  Triton; `bsr.py`: their storage format, the block selection, the torch fallback and the
  dispatch.
- `quant.py`: low-bit group quantization of saved activations (method quantize): fused Triton
  quantize+pack and unpack+dequantize, the vectorised torch path, the dispatch.
- `reference.py`: the eager oracles of all three, one section per method.
- `aot.py`: every kernel compiled ahead of time for sm_80/sm_90 (no GPU needed).

Kernels run on CUDA; on the CPU they run under TRITON_INTERPRET=1 (tests use small shapes), and
every caller has a plain-torch fallback for machines without Triton. The benchmarks live in
benchmarks/kernels.py (`python -m benchmarks.kernels prune|bitmask`).
"""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (it is optional at run time: the torch paths need none)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def is_fake(t) -> bool:
    """A tensor without data: fake (the memory estimate runs the step on FakeTensorMode) or meta.
    Launchers then only allocate their outputs and skip the kernel, so the estimate sees exactly
    what a kernel allocates and never hands Triton a pointer that is not there."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return t.device.type == "meta" or _is_fake(t)


def chunk_starts(total: int, step: int, fake: bool) -> range | tuple[int, ...]:
    """Where the chunks of `step` items start in `range(total)` for a torch fallback that works
    a chunk at a time. On tensors without data (`is_fake`: the estimate) every chunk but the last
    allocates and frees exactly what the first one does, so the first and the last stand for all
    of them: the same allocations and the same peak, without the per-chunk dispatch cost (the CPU
    estimate of a quantized ResNet ran its chunk loop under fake tensors for minutes)."""
    starts = range(0, total, step)
    return (starts[0], starts[-1]) if fake and len(starts) > 2 else starts
