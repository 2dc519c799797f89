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
every caller has a plain-torch fallback for machines without Triton. This module: `is_fake`,
`chunk_starts` and `replayed_on_fake`, what the fallbacks do on the estimate's fake tensors.
The benchmarks live in benchmarks/kernels.py (`python -m benchmarks.kernels prune|bitmask`).
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


# ---------------------------------------------------------------- fake tensors: replayed

# A torch fallback runs dozens of ops per call; on fake tensors (the estimate) each is dispatched
# through the fake mode and the estimate's trackers, though all the estimate reads of it is what
# it allocates and frees. Where that depends only on the arguments' metadata, the first call of a
# key is run and its allocations and frees recorded in order; later calls on fake tensors make the
# same allocations and frees in the same order (one op each) and return the output. The trackers
# see the same bytes at the same points of the call: the same peak and the same live set after.
_traces: dict[tuple, _Trace | None] = {}
_TRACES_MAX = 4096


class _Trace:
    """What one call allocated and freed: `events`, (k, nbytes) for the k-th allocation and
    (k, None) for its free, in order; the output is allocation `out`, of `shape` and `dtype`."""

    def __init__(self, events, out: int, shape: tuple[int, ...], dtype):
        self.events, self.out, self.shape, self.dtype = events, out, shape, dtype

    def replay(self, like):
        """The allocations and frees again, as new tensors of `like`'s kind; returns the
        output."""
        import torch

        live, out = {}, None
        for k, nbytes in self.events:
            if nbytes is None:
                del live[k]
            elif k == self.out:
                live[k] = out = like.new_empty(self.shape, dtype=self.dtype)
            else:
                live[k] = like.new_empty(nbytes, dtype=torch.uint8)
        return out


def _record(fn, args, kwargs, inputs) -> tuple[object, _Trace | None]:
    """fn(*args, **kwargs) and its _Trace (None where its output is not one allocation of its
    own, exactly: nothing to replay it by)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    events: list[tuple[int, int | None]] = []
    alive: dict[int, int] = {}  # a storage's address -> its allocation k, while it lives
    refs, done = [], [False]
    for t in inputs:  # what the call is given is no allocation of its own
        alive[t.untyped_storage()._cdata] = -1

    def note(t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st._cdata in alive:
            return
        k, key = len(refs), st._cdata
        alive[key] = k
        events.append((k, st.nbytes()))

        def freed(_, k=k, key=key):
            if not done[0]:
                alive.pop(key, None)
                events.append((k, None))
        refs.append(weakref.ref(st, freed))

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    note(t)
            return out

    with Recorder():
        out = fn(*args, **kwargs)
    done[0] = True
    k = alive.get(out.untyped_storage()._cdata, -1)
    kept = {v for v in alive.values() if v >= 0} - {k}  # alive after: kept by fn itself
    exact = (k >= 0 and not kept and out.is_contiguous() and out.storage_offset() == 0
             and out.numel() * out.element_size() == out.untyped_storage().nbytes())
    return out, _Trace(tuple(events), k, tuple(out.shape), out.dtype) if exact else None


def replayed_on_fake(key):
    """Decorate a torch fallback `fn(first, ...)` whose allocations on tensors without data
    depend only on `key(*args, **kwargs)` (shapes, dtypes, options: a tuple): on fake tensors
    its calls after the first of a key replay the first's allocations (`_Trace`)."""

    def wrap(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if not is_fake(args[0]):
                return fn(*args, **kwargs)
            import torch

            k = (fn.__module__, fn.__qualname__, args[0].device, *key(*args, **kwargs))
            if k in _traces:
                trace = _traces[k]
                return trace.replay(args[0]) if trace is not None else fn(*args, **kwargs)
            inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            out, _traces[k] = _record(fn, args, kwargs, inputs)
            while len(_traces) > _TRACES_MAX:
                _traces.pop(next(iter(_traces)))
            return out
        return wrapped
    return wrap
