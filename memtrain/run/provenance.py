"""A run's provenance: who measured what, where, with which software (the columns every row
carries, `columns.COLUMNS`' provenance kind): the device, the software's versions, memtrain's
commit, the machine and the SLURM job."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch


def git_commit(here: Path | None = None) -> str:
    """The checkout's commit, `-dirty` when tracked files differ. Read without git's optional
    locks: `git status` otherwise refreshes the index under .git/index.lock, and a status cut
    off by the timeout (a loaded machine) leaves that lock behind, blocking the user's next
    commit."""
    here = here or Path(__file__).resolve().parent.parent
    git = ["git", "--no-optional-locks"]
    try:
        out = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], cwd=here,
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.cache
def own_commit() -> str:
    """memtrain's commit (`git_commit`), read once per process: what a process runs is the code
    it imported, and the two git commands cost tens of ms a run where the index is stale (a
    fresh clone's, which git cannot refresh without its lock)."""
    return git_commit()


def of_run(device: torch.device) -> dict[str, str | int]:
    """Who measured what, where: the columns every row carries."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        gpu_mem = torch.cuda.get_device_properties(device).total_memory
    else:
        name, cap, gpu_mem = platform.processor() or platform.machine(), "", 0
    return {
        "device": str(device),
        "device_name": name,
        "device_capability": cap,
        "device_total_memory_bytes": gpu_mem,
        "cpu_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "",
        "cudnn_version": str(torch.backends.cudnn.version() or "") if device.type == "cuda" else "",
        "triton_version": triton_version,
        "python_version": platform.python_version(),
        "git_commit": own_commit(),
        "hostname": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
    }
