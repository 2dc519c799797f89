"""The measurement of a step's memory: what memtrain counts and how.

- `measure`: the step windows, the accounting step and its memory columns, the timing.
- `tracker`: `PeakTracker`, torch's MemTracker extended (saved-tensor bytes, births, marks).
- `allocator`: the allocators' own histories (CUDA's snapshot, the CPU allocator's events).
- `timeline`: the accounting step's memory timeline, its table and figure.
- `by_module`: the per-module saved bytes and the checkpoint plan files.

`timeline` and `by_module` import no torch (the report reads their files where torch is not
installed), so this package's `__init__` imports nothing.
"""
