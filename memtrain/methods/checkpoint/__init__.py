"""method=checkpoint: activation checkpointing (`strategies.py`;
docs/methods/checkpoint-planner.md).

The package re-exports `CheckpointMethod` under the name conf/method/checkpoint.yaml's `_target_`
holds (hashed into every run_id). Its modules, each importing only those listed before it:
`segments` (the model's segments, the `CheckpointGroup` wrapper, the BatchNorm shield), `plan`
(profiler, peak model, 0-1 program), `ops` (operator granularity, the compaction choices' record
`Compact`), `compaction` (measures the lossless compaction choices), `batchnorm` (BatchNorm as two
ops), `cache` (one profile per sweep), `strategies` (the method: its strategies and budgets).
They import each other by full module name, never from this package (which imports
`strategies`).
"""

from memtrain.methods.checkpoint.strategies import CheckpointMethod

__all__ = ["CheckpointMethod"]
