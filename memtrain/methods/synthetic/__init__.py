"""method=synthetic: partitioned training with synthetic intermediate labels (`phases.py`;
docs/methods/synthetic.md).

The package re-exports `Synthetic` under the name conf/method/synthetic.yaml's `_target_` holds
(hashed into every run_id). Its modules: `cuts` (where the model is cut, the partitioned
model), `partition` (the synthetic labels, their loss, one partition's training phase),
`workers` (independent partitions in worker processes), `phases` (the method: its training
phases, partition by partition, then recovery). They import each other by full module name,
never from this package (which imports `phases`).
"""

from memtrain.methods.synthetic.phases import Synthetic

__all__ = ["Synthetic"]
