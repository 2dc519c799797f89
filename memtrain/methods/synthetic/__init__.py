"""method=synthetic: partitioned training with synthetic intermediate labels (`method.py`;
docs/methods/synthetic.md).

The package re-exports `Synthetic` under the name conf/method/synthetic.yaml's `_target_` holds
(hashed into every run_id). Its modules: `cuts` (where the model is cut, the partitioned
model), `partition` (the synthetic labels, their loss, one partition's training phase),
`workers` (independent partitions in worker processes), `method`. They import each other by
full module name, never from this package (which imports `method`).
"""

from memtrain.methods.synthetic.method import Synthetic

__all__ = ["Synthetic"]
