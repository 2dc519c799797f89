"""One run across processes: `trainer.strategy=ddp|fsdp` under torchrun (or SLURM's tasks).

    torchrun --nproc-per-node 2 -m memtrain model=mlp6 trainer=smoke trainer.strategy=fsdp

Every rank runs the same job (`runner.run`); this module is what they share:

- `session`: the process group of the job (gloo on the CPU, nccl on CUDA; torchrun's env://
  rendezvous, or a group of one when no launcher started the process), torn down at the end.
  `World.active` is the job's world while it runs (rank, size, strategy).
- `wrap`: the model under DDP, or under FSDP2's `fully_shard` per block (the blocks are the
  model's chain, `blocks_of`; models/chain.py registers the rule) and then the root, as
  torchtitan shards a transformer per block.
- `RankSplit`: `trainer.batch_size` stays the global batch: every rank draws the same global
  batch (the same samples and augmentation draws as one process) and keeps its own slice.
- `reduce_step`: one all-reduce per step for the loss (the global batch's mean, so every rank
  sees the same loss and a divergence on one is a divergence on all) and one for the stop flag
  (a signal that reaches one rank stops every rank at the same step boundary, where they save
  together).
- `gather_memory`: each rank measures its own step (measure.py); rank 0 writes one row with
  the highest rank's figures and every memory column's maximum and mean over the ranks.
- `failed` / `root_failure` / `finish`: a failure on any rank becomes the row's status. The
  failing rank records why in the group's key-value store, then (a failure the ranks did not
  agree on, on a rank other than 0) ends its process, so a rank blocked in a collective raises
  instead of waiting for it; rank 0 writes the row with the rank that failed first, and after
  an agreed stop the other ranks wait for that row before they exit. A rank's own failure
  counts before one that only follows from another's (`lost_peer`: a connection a rank's exit
  closed), and a rank that vanished without a word (kill -9, the kernel's out-of-memory
  killer, a crash) is found by its heartbeat in the store, which stopped (`Heartbeat`).

`fake_session` runs one rank of an N-rank world in one process (torch's fake process group:
collectives do nothing): the GPU-free estimate of one rank's peak (`estimate.py`) and the
accounting tests.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

import memtrain.methods.base as base
from memtrain.config.schema import STRATEGIES
from memtrain.data import Split
from memtrain.errors import ConfigError, check_choice
from memtrain.memory.measure import COMM_BUFFERS

log = logging.getLogger("memtrain")

__all__ = ["STRATEGIES", "World", "session", "fake_session", "wrap"]
PREFIX = "memtrain/"  # the job's keys in the process group's store
WAIT_S = 300  # how long a rank waits for another's record (its row, a failure)
BEAT_S = 0.5  # a rank's heartbeat in the store: one count up every BEAT_S seconds
GONE_S = 5.0  # a rank whose count stood still this long, with no failure recorded, is gone


def launched() -> tuple[int, int, int]:
    """(rank, world size, local rank) as the launcher set them (torchrun, or SLURM's tasks
    through submitit's TorchDistributedEnvironment); (0, 1, 0) in a plain process."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def is_launched() -> bool:
    """This process is one rank of several (torchrun or SLURM tasks started it)."""
    return launched()[1] > 1


@dataclass
class World:
    """The ranks of the job. `size` 1 with strategy single is an ordinary run."""

    strategy: str = "single"
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str = ""  # gloo, nccl, fake; "" without a process group
    owned: bool = False  # this job initialised the group (and tears it down)
    failed_store: Any = field(default=None, repr=False)  # kept when a failure left the group
    heartbeat: Heartbeat | None = field(default=None, repr=False)
    _mesh: Any = field(default=None, repr=False)

    active: ClassVar[World | None] = None  # the job in progress in this process

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """DDP or FSDP: the model is wrapped and the batch split, even on one rank."""
        return self.strategy in ("ddp", "fsdp")

    @property
    def collective(self) -> bool:
        """Several real ranks: collectives and the store carry data between processes."""
        return self.size > 1 and self.backend not in ("", "fake")

    def local_batch(self, batch_size: int) -> int:
        return batch_size // self.size if self.sharded else batch_size

    def device(self, name: str) -> torch.device:
        """The device of this rank: cuda:<local rank> when the job runs on CUDA."""
        if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if name not in ("auto", "cuda") and name != f"cuda:{self.local_rank}":
            raise ConfigError(f"trainer.device={name} under {self.size} ranks: each rank takes "
                              f"the GPU of its local rank; use trainer.device=auto or cuda")
        torch.cuda.set_device(self.local_rank)
        return torch.device(f"cuda:{self.local_rank}")

    def agree(self, obj: Any) -> Any:
        """Rank 0's value of `obj` on every rank."""
        if not self.collective:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mesh(self, device: torch.device):
        """The one-dimensional device mesh of the ranks, FSDP's (made outside any fake tensor
        mode: the estimate shards a fake model, and a mesh is made of real tensors)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is None:
            with unset_fake_temporarily(), torch.device("cpu"):
                self._mesh = init_device_mesh(device.type, (self.size,))
        return self._mesh

    def store(self):
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()


def _strategy(node: Any) -> str:
    """The strategy the trainer options name, checked as a value before any launch check (a
    bad one is no run of one process under torchrun)."""
    value = node.get("strategy", "single") if hasattr(node, "get") else "single"
    check_choice("trainer.strategy", value, STRATEGIES)
    return str(value)


def _backend(device: str) -> str:
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


@contextlib.contextmanager
def session(trainer: Any) -> Iterator[World]:
    """The job's world, from the raw trainer options (`strategy`, `device`) and the launcher's
    environment: a process group for ddp and fsdp (env:// under torchrun, a group of one
    otherwise), none for single. Sets `World.active` while it lasts; a group it made is left
    (after a barrier, when the job ended well) at the end."""
    import torch.distributed as dist

    strategy = _strategy(trainer)
    rank, size, local = launched()
    if dist.is_initialized():  # a group made by the caller (a fake one, in tests): its ranks
        rank, size = dist.get_rank(), dist.get_world_size()
    if size > 1 and strategy == "single":
        raise ConfigError(f"trainer.strategy=single in one of {size} ranks (torchrun or SLURM "
                          f"tasks): each rank would train its own copy; set "
                          f"trainer.strategy=ddp or trainer.strategy=fsdp")
    world = World(strategy, rank, size, local)
    probes_only = trainer.get("max_steps") == 0  # the estimate of N ranks needs none of them
    if world.sharded and not dist.is_initialized() and not probes_only:
        backend = _backend(str(trainer.get("device", "auto")))
        if size > 1:
            dist.init_process_group(backend)  # env:// from the launcher
        else:  # no launcher: a group of one in this process
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        world.backend, world.owned = backend, True
    elif world.sharded and dist.is_initialized():
        world.backend = dist.get_backend()
    if world.collective:
        world.heartbeat = Heartbeat(world.store(), world.rank)
    ok = False
    World.active = world
    try:
        yield world
        ok = True
    finally:
        World.active = None
        if world.heartbeat is not None:
            world.heartbeat.close()
        if world.owned:
            _leave(world, barrier=ok)


class Heartbeat:
    """A rank's sign of life: a thread that counts the rank's key in the group's store up every
    BEAT_S seconds, on a clone of the store's client (one client per thread, as torch's
    Store.clone is meant for). After a failure rank 0 tells a rank that is alive (its count
    moves) from one whose process vanished without recording why (`root_failure`). The store
    outlives the ranks: torchrun's agent holds it, or rank 0 (SLURM tasks)."""

    def __init__(self, store: Any, rank: int):
        self.store, self.key = store.clone(), beat_key(rank)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="memtrain-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while True:
            try:
                self.store.add(self.key, 1)
            except Exception:  # the store went with the launcher: nobody is asking any more
                return
            if self.stopped.wait(BEAT_S):
                return

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=2 * BEAT_S)


def beat_key(rank: int) -> str:
    return f"{PREFIX}beat/{rank}"


def _leave(world: World, barrier: bool) -> None:
    """Leave the process group: after a barrier when every rank ended well (gloo aborted a
    rank that left while another still used the group: 'terminate called without an active
    exception'), at once after a failure (a rank that failed broke the group already)."""
    import gc

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    gc.collect()  # a DDP reducer still holding the group
    if barrier and world.collective:
        with contextlib.suppress(Exception):
            dist.barrier()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_session(strategy: str, size: int, rank: int = 0) -> Iterator[World]:
    """Rank `rank` of a `size`-rank world in this process, on torch's fake process group
    (collectives return at once and move nothing): what one rank builds, holds and allocates,
    without the other ranks. For the estimate and the accounting tests."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise ConfigError("an estimate of several ranks runs in a process of its own (one "
                          "without a process group); not inside a distributed job")
    import torch.testing._internal.distributed.fake_pg as fake_pg  # registers the backend

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=size)
    world = World(strategy, rank, size, 0, "fake", owned=True)
    old, World.active = World.active, world
    try:
        yield world
    finally:
        World.active = old
        dist.destroy_process_group()


# ---------------------------------------------------------------- what runs where


def check(world: World, trainer: Any, world_size: int | None) -> None:
    """What cannot run in this world, as one-line ConfigErrors, before anything is built."""
    if world.sharded and trainer.batch_size % world.size:
        raise ConfigError(f"trainer.batch_size={trainer.batch_size} (the global batch) is not a "
                          f"multiple of the {world.size} ranks; use a multiple of {world.size}")
    if world_size is not None and world_size != world.size:
        if world.size == 1 and trainer.max_steps == 0 and trainer.estimate:
            return  # the estimate of N ranks, in one process: nothing runs on the ranks
        raise ConfigError(f"trainer.world_size={world_size} but this job has {world.size} "
                          f"rank(s): launch it with torchrun --nproc-per-node {world_size} (or "
                          f"{world_size} SLURM tasks), or leave trainer.world_size unset")
    if not world.sharded:
        return
    if world.strategy == "fsdp" and trainer.precision == "fp16":
        raise ConfigError("trainer.precision=fp16 with trainer.strategy=fsdp: the grad scaler "
                          "checks each rank's own shards for overflow, so ranks would skip "
                          "different steps; use trainer.precision=bf16 (or bf16-true)")
    if trainer.compile:
        raise ConfigError(f"trainer.compile=true with trainer.strategy={world.strategy}: "
                          f"compiling a DDP or FSDP model is not supported here yet; use "
                          f"trainer.compile=false")
    if trainer.find_max_batch:
        raise ConfigError(f"trainer.find_max_batch with trainer.strategy={world.strategy} is not "
                          f"supported yet: estimate one rank's peak at a batch instead "
                          f"(trainer.estimate=true trainer.world_size=N trainer.max_steps=0)")
    if trainer.estimate and (world.size > 1 or trainer.max_steps != 0):
        raise ConfigError(f"trainer.estimate with trainer.strategy={world.strategy} estimates one "
                          f"of trainer.world_size ranks without the ranks: run it in one process "
                          f"with trainer.max_steps=0 (not under torchrun, not before training)")


def check_method(method: Any, world: World) -> None:
    """A method that cannot run under the strategy refuses in one line (its own
    `check_strategy(strategy)`, methods/base.py; a stack asks its members)."""
    if world.sharded:
        base.check_strategy(method, world.strategy)


# ---------------------------------------------------------------- the model

BlockRule = Callable[[nn.Module], "list[list[nn.Module]] | None"]
_BLOCK_RULES: list[BlockRule] = []


def blocks_rule(rule: BlockRule) -> BlockRule:
    """Register `rule(model) -> [[modules of block 1], ...] or None`: the units FSDP shards
    one by one (models/chain.py registers the model's chain: its segments)."""
    _BLOCK_RULES.append(rule)
    return rule


def blocks_of(model: nn.Module) -> list[list[nn.Module]]:
    for rule in _BLOCK_RULES:
        found = rule(model)
        if found:
            return found
    return []


def wrap(model: nn.Module, world: World, device: torch.device) -> nn.Module:
    """The model as the strategy trains it: itself (single), DDP around it, or FSDP2's
    `fully_shard` on each block of its chain and then on the root (in place: the parameters
    become DTensors holding this rank's shard)."""
    if world.sharded and any(p.device != device for p in model.parameters()):
        model.to(device)  # (an estimate's fake model is made on its device: no move)
    if world.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        index = device.index if device.index is not None else torch.cuda.current_device() \
            if device.type == "cuda" else None
        ddp = DDP(model, device_ids=[index] if device.type == "cuda" else None)
        buckets = _Buckets(fake=world.backend == "fake")
        setattr(ddp, COMM_BUFFERS, buckets)  # where the measurement finds them
        ddp.register_comm_hook(buckets, _bucket_hook)
        return ddp
    if world.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks_of(model):
            # a unit per block of one module (a residual block, a transformer layer); a run
            # of modules (resnet's stem: conv, norm, in-place ReLU, pool) stays with the root:
            # FSDP2 wraps each module's input and output in views, which an in-place ReLU
            # after the norm would modify, and the root holds the little that is left
            if len(block) == 1 and any(p.requires_grad for p in block[0].parameters()):
                fully_shard(block[0], mesh=world.mesh(device))
        fully_shard(model, mesh=world.mesh(device))
    return model


def inner(model: nn.Module) -> nn.Module:
    """The trained module under a DDP wrapper (its state_dict keys are the model's own)."""
    return getattr(model, "module", model) if type(model).__name__ == \
        "DistributedDataParallel" else model


def full_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's whole state_dict, plain tensors on the CPU, under the plain model's keys: on
    rank 0 (FSDP gathers every shard: every rank calls it); None on the other ranks."""
    world = World.active
    if world is None or not world.sharded:
        return model.state_dict()
    if world.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    else:
        state = inner(model).state_dict()
    return state if world.main else None


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds); any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class _Buckets:
    """DDP's gradient buckets, as its reducer hands them to the communication hook: the
    reducer makes them when the model is wrapped (and again in the second step), outside any
    tracked step, so the tracker would see them only when an op first writes one, and file it
    as a backward temporary. Registered as the hook, this keeps the buckets for the tracker
    (`measure.comm_buffers`, tracked from the start of the accounting step as other memory) and then
    reduces them as DDP does without a hook (each rank's gradient / world size, summed: the
    same operations, in the same order)."""

    def __init__(self, fake: bool = False):
        self.buffers: dict[int, torch.Tensor] = {}
        self.fake = fake  # the fake process group's reduction gives no tensor back


def _bucket_hook(state: _Buckets, bucket):
    """DDP's communication hook (`_Buckets`): keep the bucket, reduce it as DDP would."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.buffers[bucket.index()] = bucket.buffer()
    if state.fake:  # one rank of a fake world: the bucket as it is (nothing to sum with)
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    return allreduce_hook(None, bucket)  # None: the default group, as DDP's own


def settle_steps(model: nn.Module) -> int:
    """Steps before a strategy's steps are alike: DDP allocates its gradient buckets again, in
    the order the first backward made the gradients, at the start of its second step (2 for
    DDP: the accounting step comes after that); 0 otherwise."""
    return 2 if type(model).__name__ == "DistributedDataParallel" else 0


# ---------------------------------------------------------------- the data


class RankSplit(Split):
    """This rank's part of every global batch: the inner split's batch of `batch_size` (the
    global batch, the same on every rank: same generator, same samples, same augmentation
    draws as one process) cut into `size` equal parts (torch.tensor_split: a short last batch
    gives some ranks one sample less), this rank's part copied out so the global batch is
    freed before the step."""

    def __init__(self, inner: Split, rank: int, size: int):
        self.inner, self.rank, self.size = inner, rank, size

    def __len__(self) -> int:
        return len(self.inner)

    def to(self, device: torch.device) -> RankSplit:
        return RankSplit(self.inner.to(device), self.rank, self.size)

    def batches(self, batch_size, device, shuffle=False, generator=None, drop_last=False):
        for x, y in self.inner.batches(batch_size, device, shuffle, generator, drop_last):
            yield (x.tensor_split(self.size)[self.rank].clone(),
                   y.tensor_split(self.size)[self.rank].clone())


def shard_data(data: Any, world: World) -> Any:
    """`data` with every split cut per rank (`RankSplit`); unchanged for one rank."""
    if not world.sharded or world.size == 1:
        return data
    import dataclasses

    return dataclasses.replace(data, train=RankSplit(data.train, world.rank, world.size),
                               test=RankSplit(data.test, world.rank, world.size))


# ---------------------------------------------------------------- every step


SIGNALS = {"SIGINT": 2, "SIGUSR2": 12, "SIGTERM": 15}


def reduce_step(loss: torch.Tensor, checkpointer: Any | None = None) -> float:
    """The loss of the global batch after one step: one process, its own; several ranks, the
    mean of their losses (equal local batches), so all of them see one loss and a divergence on
    one is a divergence on all. In the same collective, the ranks' stop flags: when a signal
    reached any rank, every rank's `checkpointer.agreed` (and its stop flag) names it, so all of
    them save at this step boundary together, or none does."""
    world = World.active
    stop = getattr(checkpointer, "stop", None)
    asked = stop.requested if stop is not None else None
    if world is None or not world.collective:
        return float(loss.detach())
    import torch.distributed as dist

    flat = torch.stack([loss.detach().float().reshape(()),
                        torch.tensor(float(SIGNALS.get(asked, 15) if asked else 0),
                                     device=loss.device)])
    parts = [torch.empty_like(flat) for _ in range(world.size)]
    dist.all_gather(parts, flat)  # one collective: every rank's loss and stop flag
    both = torch.stack(parts).cpu()
    loss_val = float(both[:, 0].mean())
    flags = [int(f) for f in both[:, 1]]
    if any(flags) and not asked:
        names = {v: k for k, v in SIGNALS.items()}
        first = next(r for r, f in enumerate(flags) if f)
        asked = names.get(flags[first], "SIGTERM")
        if stop is not None:
            stop.request(asked, f" (on rank {first})")
    if checkpointer is not None:
        checkpointer.agreed = asked
    return loss_val


def reduce_sums(values: list[float], device: torch.device) -> list[float]:
    """Sums over the ranks (an evaluation's counts); the values themselves in one process."""
    world = World.active
    if world is None or not world.collective:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


# ---------------------------------------------------------------- the row


def memory_columns(summary: dict[str, Any]) -> dict[str, Any]:
    """A rank's own measured figures: the memory columns of its row (numbers)."""
    from memtrain import columns

    return {k: v for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            and (col := columns.lookup(k)) is not None and col.kind == "memory"}


def gather_memory(world: World, summary: dict[str, Any]) -> dict[str, Any]:
    """On rank 0 of several: the memory columns of the rank with the highest peak (so its
    breakdown adds up), which rank that is (`mem_peak_rank`), and every memory column's
    maximum and mean over the ranks (`rank_max.<column>`, `rank_mean.<column>`). Every rank
    calls it (a collective); the others get {}."""
    if not world.collective:
        return {}
    import torch.distributed as dist

    from memtrain.columns import PEAK

    mine = memory_columns(summary)
    got: list[Any] = [None] * world.size if world.main else None
    dist.gather_object(mine, got, dst=0)
    if not world.main:
        return {}
    top = max(range(world.size), key=lambda r: got[r].get(PEAK, 0))
    out: dict[str, Any] = {**got[top], "mem_peak_rank": top}
    for k in sorted({k for g in got for k in g}):
        vals = [g[k] for g in got if k in g]
        out[f"rank_max.{k}"] = max(vals)
        out[f"rank_mean.{k}"] = sum(vals) / len(vals)
    return out


# what a rank meets when another rank's process is gone or stuck: gloo's and NCCL's words for
# a closed connection or an aborted communicator, a collective that timed out
PEER_LOST = ("closed by peer", "reset by peer", "broken pipe", "connection refused",
             "remote worker crash", "remote process exited", "communicator was aborted",
             "timed out")


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is one a rank meets because another rank left or stalls (a consequence,
    not the cause of a failed job): a network error of torch.distributed, or an error whose text
    says a connection was closed, reset or refused, or a collective timed out."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistNetworkError", ())):
        return True
    text = str(error).lower()
    return any(words in text for words in PEER_LOST)


def record_failure(store: Any, rank: int, status: str, error: str, step: int | None,
                   lost_peer: bool = False) -> None:
    """One rank's failure in the store, numbered in the order failures were recorded."""
    n = store.add(PREFIX + "failures", 1)
    store.set(f"{PREFIX}failure/{n}", json.dumps(
        {"rank": rank, "status": status, "error": error, "step": step, "lost_peer": lost_peer}))


def failed(world: World, status: str, error: str, step: int | None, *,
           lost_peer: bool = False, code: int = 1) -> None:
    """This rank failed: record why in the group's store (`lost_peer`: the error only follows
    from another rank's exit). A failure the ranks did not agree on (every one but diverged
    and interrupted, which the per-step all-gather makes happen on all ranks at one step)
    leaves the group at once, so a rank waiting in a collective for this one raises instead of
    hanging until the group's timeout: rank 0 leaves after it wrote the row (its process
    ends), any other rank here, by ending its process with status `code` (2: bad input).
    Nothing short of that closes gloo's connections: the group lives on in whatever still
    holds it (a DDP reducer, a device mesh), and aborting it is no promise."""
    if not world.collective:
        return
    store = None
    try:
        store = world.store()
        record_failure(store, world.rank, status, error, step, lost_peer)
    except Exception as e:  # the store went with the launcher: nothing to tell
        log.warning("rank %d: could not record its failure: %s", world.rank, e)
    world.failed_store = store  # kept: the group goes, the store stays reachable
    if status not in ("diverged", "interrupted") and not world.main:
        log.error("rank %d ends its process: rank 0 writes the job's row", world.rank)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


GONE = ("its process ended without recording a failure (killed: kill -9 or the kernel's "
        "out-of-memory killer, or it crashed)")


def root_failure(world: World, gone_s: float = GONE_S) -> dict[str, Any] | None:
    """On rank 0 after a failure: the failure of the rank that failed first. A rank's own
    failure comes before what others met because of it (`lost_peer`). Unless another rank
    recorded a failure of its own, a rank that recorded none and whose heartbeat stood still
    for `gone_s` seconds vanished first, and is the cause (its record: `gone` true, no step):
    while rank 0 lives nothing it did ends another rank's process, and a live rank's count
    moves within a beat, so only a gone rank costs the wait."""
    if not world.collective:
        return None
    store = getattr(world, "failed_store", None) or world.store()
    try:
        store.wait([f"{PREFIX}failure/1"], datetime.timedelta(seconds=WAIT_S))
        records = _failures(store)
    except Exception as e:
        log.warning("no failure record of the other ranks: %s", e)
        return None
    own = [r for r in records if not r.get("lost_peer")]
    if not any(r["rank"] != world.rank for r in own):
        told = {r["rank"] for r in records}
        gone = _gone(store, [r for r in range(world.size) if r not in told], gone_s)
        if gone:
            return {"rank": gone[0], "status": "error", "error": GONE, "step": None,
                    "gone": True}
    return (own or records)[0]


def _failures(store: Any) -> list[dict[str, Any]]:
    """Every failure recorded so far, in order (a record still being written: left out)."""
    out = []
    for n in range(1, int(store.add(PREFIX + "failures", 0)) + 1):
        key = f"{PREFIX}failure/{n}"
        with contextlib.suppress(Exception):
            store.wait([key], datetime.timedelta(seconds=5))
            out.append(json.loads(store.get(key)))
    return out


def _gone(store: Any, ranks: list[int], gone_s: float) -> list[int]:
    """Of `ranks`, those whose heartbeat does not move in `gone_s` seconds and that record no
    failure meanwhile (a live rank answers within a beat: only a gone one costs the wait)."""
    first = {r: int(store.add(beat_key(r), 0)) for r in ranks}
    deadline = time.monotonic() + gone_s
    while first and time.monotonic() < deadline:
        time.sleep(BEAT_S / 2)
        told = {r["rank"] for r in _failures(store)}
        first = {r: n for r, n in first.items()
                 if r not in told and int(store.add(beat_key(r), 0)) == n}
    return sorted(first)


def finish(world: World) -> None:
    """After rank 0 wrote the row: it says so; the other ranks wait for that before they go
    (a rank that exits with an error status makes torchrun stop the others, rank 0 with them,
    perhaps before its row is written)."""
    if not world.collective:
        return
    key = PREFIX + "row_written"
    try:
        store = getattr(world, "failed_store", None) or world.store()
        if world.main:
            store.set(key, "1")
        else:
            store.wait([key], datetime.timedelta(seconds=WAIT_S))
    except Exception as e:
        log.warning("rank %d: the end of the job was not confirmed: %s", world.rank, e)
