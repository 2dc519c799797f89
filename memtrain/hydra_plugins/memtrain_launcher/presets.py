"""memtrain's launcher presets in Hydra's ConfigStore, as Hydra's own submitit and joblib plugins
register theirs: `hydra/launcher=local|parallel|slurm` in any Hydra app where memtrain is
installed (Hydra's plugin scan imports this module and registers memtrain's resolvers with it).

    memtrain -m hydra/launcher=local method=none trainer.batch_size=64,128
    python my_app.py -m hydra/launcher=parallel hydra.launcher.n_jobs=4 lr=0.1,0.01

Each setting can come from the command line (`hydra.launcher.<key>=...`) or, where the preset
reads one, from the environment (MEMTRAIN_LOCAL_TIMEOUT_MIN, MEMTRAIN_PARALLEL_JOBS,
MEMTRAIN_SLURM_*).
"""

# no `from __future__ import annotations`: Hydra's plugin scan runs this module before it is
# in sys.modules, where dataclasses cannot read string annotations
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf

from memtrain.config import resolvers

resolvers.register()

# a typed field may hold an interpolation: OmegaConf checks the value it resolves to


@dataclass
class LocalConf(LocalQueueConf):
    """hydra/launcher=local: submitit on this machine, every job in its own process, all at
    once. Each job sees every GPU and claims a free one through a lock file
    (trainer.device=auto), so jobs beyond the GPU count wait for one; on a CPU-only machine the
    jobs share the cores. Jobs already done are not submitted (trainer.skip_done), and a job
    that leaves no result is a row (memtrain's LocalLauncher)."""

    _target_: str = "hydra_plugins.memtrain_launcher.LocalLauncher"
    timeout_min: int = "${oc.decode:${oc.env:MEMTRAIN_LOCAL_TIMEOUT_MIN,240}}"
    gpus_per_node: int | None = "${memtrain_gpus:0}"
    tasks_per_node: int = 1


@dataclass
class ParallelConf(JobLibLauncherConf):
    """hydra/launcher=parallel: Hydra's joblib launcher, worker processes on this machine, one
    job per GPU at a time (n_jobs: the GPU count; a job claims a free GPU through a lock file,
    trainer.device=auto); without a GPU, MEMTRAIN_PARALLEL_JOBS workers (default 2) share the
    cores."""

    n_jobs: int = "${memtrain_gpus:${oc.decode:${oc.env:MEMTRAIN_PARALLEL_JOBS,2}}}"


@dataclass
class SlurmConf(SlurmQueueConf):
    """hydra/launcher=slurm: each job one task of a SLURM job array (submitit), one GPU each.
    `signal_delay_s` before the time limit SLURM signals the job: a memtrain run stops after its
    step with a checkpoint (status interrupted); with MEMTRAIN_SLURM_MAX_NUM_TIMEOUT>0 the job is
    requeued and, with trainer.resume=true, continues from it. Jobs already done are not
    submitted (trainer.skip_done), a job that leaves no result is a row. Without GPUs:
    MEMTRAIN_SLURM_GPUS_PER_NODE=0 MEMTRAIN_SLURM_CPUS_PER_TASK=1 MEMTRAIN_SLURM_MEM_GB=1.

    `tasks_per_node`: one task per GPU for memtrain's trainer.strategy=ddp|fsdp (each task a
    rank: trainer.world_size of them when set, else gpus_per_node), one task otherwise, and in
    an app without memtrain's trainer keys. Sharded runs sweep one world size at a time (a job
    array's tasks are one number for all its jobs):
    `memtrain -m hydra/launcher=slurm trainer.strategy=fsdp trainer.world_size=4 method=...`."""

    _target_: str = "hydra_plugins.memtrain_launcher.SlurmLauncher"
    partition: str | None = "${oc.env:MEMTRAIN_SLURM_PARTITION,null}"
    account: str | None = "${oc.env:MEMTRAIN_SLURM_ACCOUNT,null}"
    qos: str | None = "${oc.env:MEMTRAIN_SLURM_QOS,null}"
    gpus_per_node: int | None = (
        "${oc.decode:${oc.env:MEMTRAIN_SLURM_GPUS_PER_NODE,1}}")
    tasks_per_node: int = ("${memtrain_tasks:${oc.select:trainer.strategy,single},"
                           "${oc.select:trainer.world_size,null},${.gpus_per_node}}")
    cpus_per_task: int | None = (
        "${oc.decode:${oc.env:MEMTRAIN_SLURM_CPUS_PER_TASK,8}}")
    mem_gb: int | None = "${oc.decode:${oc.env:MEMTRAIN_SLURM_MEM_GB,64}}"
    timeout_min: int = "${oc.decode:${oc.env:MEMTRAIN_SLURM_TIMEOUT_MIN,240}}"
    array_parallelism: int = (
        "${oc.decode:${oc.env:MEMTRAIN_SLURM_ARRAY_PARALLELISM,16}}")
    max_num_timeout: int = "${oc.decode:${oc.env:MEMTRAIN_SLURM_MAX_NUM_TIMEOUT,0}}"
    signal_delay_s: int = 120


for _name, _node in (("local", LocalConf), ("parallel", ParallelConf), ("slurm", SlurmConf)):
    ConfigStore.instance().store(group="hydra/launcher", name=_name, node=_node,
                                 provider="memtrain")
