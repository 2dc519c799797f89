"""A smaller GPU on a big one, the largest batch that fits, one GPU per job.

- `apply_gpu_cap`: `trainer.gpu_memory_gb` through torch.cuda.set_per_process_memory_fraction,
  so the caching allocator raises OutOfMemoryError where a card of that size would.
- `find_max_batch`: exponential growth then bisection over a `fits(batch_size)` predicate. On
  CUDA the predicate trains a couple of steps under the cap; on the CPU it compares the fake-tensor
  estimate with the cap; tests inject their own. Either way a batch fits when its peak plus the
  CUDA context stays within the cap less a headroom (`Margin`: `trainer.max_batch_headroom`,
  `trainer.cuda_context_gb`), and the result may be rounded down (`round_down`).
- `claim_device`: with several GPUs and `trainer.device=auto`, each job takes the first GPU whose
  lock file it can lock (flock), so parallel jobs (joblib, several submitit tasks, two shells)
  never share one. The lock dies with the process, so a killed job frees its GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from memtrain.errors import ConfigError, check_range

log = logging.getLogger(__name__)

GiB = 2**30


def apply_gpu_cap(device: torch.device, gb: float | None) -> dict:
    """Cap CUDA memory of this process at `gb` GiB; returns the summary columns."""
    if gb is None:
        return {}
    check_range("trainer.gpu_memory_gb", gb, 0, None, lo_open=True)
    cap = int(gb * GiB)
    if device.type != "cuda":
        log.warning("trainer.gpu_memory_gb=%s does not apply on device %s (CUDA only); the run "
                    "is not capped", gb, device)
        return {"gpu_memory_cap_bytes": cap, "gpu_memory_cap_applied": False}
    total = torch.cuda.get_device_properties(device).total_memory
    if cap > total:
        raise ConfigError(f"trainer.gpu_memory_gb must be in (0, {total / GiB:.1f}] on "
                          f"{torch.cuda.get_device_name(device)}, got {gb}")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    return {"gpu_memory_cap_bytes": cap, "gpu_memory_cap_applied": True}


def find_max_batch(fits: Callable[[int], bool], limit: int, start: int = 1) -> int:
    """Largest b in [1, limit] with fits(b), assuming fits is monotone; 0 if even 1 fails.

    Doubles from `start` until a failure (or the limit), then bisects between the last success
    and the first failure: O(log limit) probes.
    """
    check_range("batch size limit", limit, 1)
    b = max(1, min(start, limit))
    lo, hi = (b, None) if fits(b) else (0, b)
    while hi is None:  # grow: fits(lo)
        if lo >= limit:
            return lo
        b = min(2 * lo, limit)
        lo, hi = (b, None) if fits(b) else (lo, b)
    while hi - lo > 1:  # fits(lo) (or lo == 0), not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# The CUDA context a GPU-free search assumes when trainer.cuda_context_gb is not set: what
# PyTorch measured for a process's context with lazy module loading, CUDA's and PyTorch's
# default since 1.13 (pytorch/pytorch#86509: 287,047,680 bytes; 666,632,192 without lazy loading).
# Not measured by memtrain: it varies with the GPU, the driver and the CUDA version.
ASSUMED_CONTEXT_BYTES = 287_047_680


@dataclasses.dataclass
class Margin:
    """How much of a memory cap a batch may take: its peak plus the CUDA context at most
    (1 - headroom) x cap. `context_bytes` None: measured on CUDA at each probe (`cuda_context`),
    `ASSUMED_CONTEXT_BYTES` without a GPU. `context_source` says which (row column
    `max_batch_context_source`: set, measured or assumed); `context_seen` the largest counted."""

    cap_bytes: int
    headroom: float = 0.0
    context_bytes: int | None = None
    context_source: str = "set"
    context_seen: int = 0

    def budget(self, context: int) -> int:
        """The bytes a batch's peak may reach, with `context` counted against the cap."""
        self.context_seen = max(self.context_seen, context)
        return int((1 - self.headroom) * self.cap_bytes) - context

    def text(self, context: int) -> str:
        return (f"+ context {context / GiB:.2f} GiB, cap {self.cap_bytes / GiB:.4f} GiB x "
                f"{1 - self.headroom:.2f}")

    def columns(self) -> dict:
        return {"max_batch_budget_bytes": self.budget(self.context_seen),
                "max_batch_context_bytes": self.context_seen,
                "max_batch_context_source": self.context_source}


def cuda_context(device: torch.device) -> int:
    """Device memory this process uses outside PyTorch's caching allocator: the CUDA context,
    the loaded kernels and libraries (and any other process on the same GPU, which a search on
    a shared GPU counts too): the device's used memory less what the allocator reserved."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def cuda_fits(make_step: Callable[[int], Callable[[], None]], device: torch.device,
              steps: int = 2, margin: Margin | None = None) -> Callable[[int], bool]:
    """A fits(batch) predicate that runs `steps` training steps: it fits when none runs out of
    memory and, with a `margin`, the allocator's reserved peak plus the context (measured after
    the steps, once they have loaded their kernels) is within the margin's budget.

    `make_step(b)` builds a fresh model, optimizer and batch of size b and returns one training
    step; everything is dropped and the cache emptied before the next probe.
    """

    def fits(b: int) -> bool:
        if margin is not None:  # the try's own reserved peak
            torch.cuda.reset_peak_memory_stats(device)
        why = ""
        try:
            step = make_step(b)
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
            ok = True
            if margin is not None:
                context = cuda_context(device) if margin.context_bytes is None \
                    else margin.context_bytes
                peak = torch.cuda.max_memory_reserved(device)
                ok = peak <= margin.budget(context)
                why = f" (reserved {peak / GiB:.4f} GiB {margin.text(context)})"
        except torch.cuda.OutOfMemoryError:
            ok, why = False, " (out of memory)"
        step = None  # noqa: F841 (free the probe's model and batch before emptying the cache)
        torch.cuda.empty_cache()
        log.info("find_max_batch: batch %d: %d real training steps%s: %s", b, steps, why,
                 "fits" if ok else "does not fit")
        return ok

    return fits


def estimate_fits(estimate_bytes: Callable[[int], int], cap_bytes: int,
                  margin: Margin | None = None) -> Callable[[int], bool]:
    """A fits(batch) predicate from a memory estimate and a cap (GPU-free): the estimate plus
    the margin's context within its budget (no margin: within the cap)."""
    margin = margin or Margin(cap_bytes, 0.0, 0)

    def fits(b: int) -> bool:
        try:
            need = estimate_bytes(b)
        except ConfigError as e:  # the method refuses this batch (prune's blocks need rows)
            log.info("find_max_batch: batch %d: refused, so it does not fit: %s", b, e)
            return False
        context = margin.context_bytes or 0
        ok = need <= margin.budget(context)
        log.info("find_max_batch: batch %d: estimate %.4f GiB %s: %s", b, need / GiB,
                 margin.text(context), "fits" if ok else "does not fit")
        return ok

    return fits


def round_down(batch: int, multiple: int) -> int:
    """`batch` down to a multiple of `multiple`; a batch below one multiple stays as it is (it
    fits, and 0 would say nothing does)."""
    if multiple <= 1 or batch < multiple:
        return batch
    return batch - batch % multiple


# ---------------------------------------------------------------- one GPU per job


def lock_dir() -> Path:
    return Path(os.environ.get("MEMTRAIN_GPU_LOCK_DIR")
                or Path(tempfile.gettempdir()) / f"memtrain-gpu-locks-{os.getuid()}")


@contextlib.contextmanager
def claim_slot(count: int, folder: Path, poll_s: float = 1.0,
               timeout_s: float | None = None) -> Iterator[int]:
    """Hold an exclusive lock on the first free `folder/gpu<i>.lock`, i < count; waits (polling)
    while all are taken."""
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    while True:
        for i in range(count):
            f = open(folder / f"gpu{i}.lock", "w")  # noqa: SIM115 (held for the whole job)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            try:
                f.write(f"{os.getpid()}\n")
                f.flush()
                yield i
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            return
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"all {count} GPU slots in {folder} are taken")
        time.sleep(poll_s)


@contextlib.contextmanager
def claim_device(name: str) -> Iterator[torch.device]:
    """The device for `trainer.device=name`; `auto` on a machine with several GPUs claims a free
    one for as long as the job runs."""
    if name != "auto":
        yield torch.device(name)
        return
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n <= 1:
        yield torch.device("cuda" if n else "cpu")
        return
    with claim_slot(n, lock_dir()) as i:
        log.info("claimed GPU %d of %d (lock files in %s)", i, n, lock_dir())
        torch.cuda.set_device(i)
        yield torch.device(f"cuda:{i}")
