"""memtrain's OmegaConf resolvers, registered by memtrain's Hydra plugins when Hydra's plugin scan
imports them (whenever Hydra starts: in memtrain, and in any Hydra app, where the launcher
presets need them):

- `${memtrain_gpus:N}`: the CUDA devices of this machine, or N without one (the launchers'
  `gpus_per_node`, the `parallel` launcher's `n_jobs`);
- `${memtrain_tasks:STRATEGY,WORLD_SIZE,GPUS}`: SLURM tasks per job (the slurm preset's
  `tasks_per_node`);
- `${memtrain_run_id:}`: the job's run_id (memtrain's `hydra.sweep.subdir`).

Imports OmegaConf alone: a plugin module is imported by every Hydra app at startup; torch and
memtrain.config.loader are imported where a resolver needs them.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from omegaconf import OmegaConf

# where a Linux machine's GPU drivers show themselves (NVIDIA's, and ROCm's, which torch.cuda
# also counts); in a container with GPUs they are mounted too
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")


def gpu_count(default: Any = 0) -> int:
    """The CUDA devices here (torch's count), or `default` where there are none. A Linux machine
    with no GPU driver has none: known without importing torch, which would cost every Hydra
    app that resolves a preset seconds."""
    if sys.platform == "linux" and not any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
        return int(default)
    import torch

    return torch.cuda.device_count() or int(default)


def tasks(strategy: Any, world_size: Any, gpus: Any) -> int:
    """SLURM tasks per job, one per rank: a sharded run's `world_size`, else one per GPU; 1 for
    a run of one process (any strategy but ddp and fsdp: the job itself names a bad one)."""
    if str(strategy) not in ("ddp", "fsdp"):
        return 1
    return int(world_size) if world_size not in (None, "None", "null") else max(1, int(gpus))


def job_run_id(*, _root_: Any) -> str:
    """The run_id of the job's config: job folders named by what they run, so two sweeps (or a
    relaunch with other values) in one folder never share a job folder. A value that cannot be
    resolved (an unset `${oc.env:...}`) hashes as written: that job still gets a folder, and its
    row says what is missing."""
    from memtrain.config.loader import run_id

    try:
        return run_id(_root_)
    except Exception:  # omegaconf's resolution errors have no common public base
        return run_id(_root_, resolve=False)


def register() -> None:
    """Register the three resolvers (again: the same functions, so registering twice is no
    change)."""
    OmegaConf.register_new_resolver("memtrain_gpus", gpu_count, replace=True)
    OmegaConf.register_new_resolver("memtrain_tasks", tasks, replace=True)
    OmegaConf.register_new_resolver("memtrain_run_id", job_run_id, replace=True)
