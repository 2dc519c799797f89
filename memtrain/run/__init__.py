"""The run: one job from a composed config to its row, and what keeps it going.

- `runner`: the engine (build, probes, prepare, train, record; the only module that reads the
  config and builds by `_target_`).
- `train`: the flat training loop; `loggers`: what reports while it runs.
- `distributed`: the ranks of one run (DDP, FSDP2, each rank's data).
- `resume`, `faults`: checkpoints, stop signals, the sweep's stop.
- `capacity`: the device claim and the GPU cap; `provenance`: the row's device, versions, commit.
- `probes`, `estimate`: the estimate and the batch search, run before training (the estimate
  runs the training step on fake tensors).
- `learned`: whether the run learned (the row's verdict).
"""
