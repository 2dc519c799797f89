"""Benchmarks: scripts that measure ratios against a baseline in the same process.

What they share lives here, so every table is timed and labelled the same way: `timings` (how a
step is timed: `measure.StepTimer`, as memtrain's own loop does) and `kernel_ms` (a kernel's
time), `device_line` (the one description of the device and versions; `device_name` its first
part), `markdown` and `publish`.
"""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memtrain import measure
from memtrain.record import atomic_write


def device(name: str = "auto") -> torch.device:
    """`auto`: CUDA when present, else the CPU; any other name as torch spells it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def timings(fn: Callable[[], object], device: torch.device, reps: int,
            warmup: int = 0) -> list[float]:
    """Seconds of each of `reps` calls of fn after `warmup` untimed ones, timed as memtrain times
    a training step (`measure.StepTimer`: synchronise, host clock, synchronise)."""
    for _ in range(warmup):
        fn()
    timer = measure.StepTimer(device)
    for _ in range(reps):
        timer.start()
        fn()
        timer.stop()
    return timer.times


def kernel_ms(fn: Callable[[], object], device: torch.device, reps: int = 25) -> float:
    """A kernel's time in ms: triton.testing.do_bench's median on CUDA; on the CPU the fastest
    of `reps` calls (a shared CPU adds scheduling delays to every other statistic)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median"))
    return min(timings(fn, device, reps, warmup=1)) * 1e3


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {cpu_name()}, {torch.get_num_threads()} threads"


def device_line(device: torch.device) -> str:
    """The device, the versions, the commit and the date: one line every table carries."""
    p = measure.provenance(device)
    versions = f"torch {p['torch_version']}" + \
        (f", triton {p['triton_version']}" if p["triton_version"] else "")
    return (f"{device_name(device)}; {versions}; git {p['git_commit']}; "
            f"{datetime.date.today().isoformat()}")


def cell(v: Any) -> str:
    """A table cell: floats to 3 decimals (1 from 100 up), anything else as text."""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def markdown(rows: Sequence[dict], title: str | None = None, note: str | None = None,
             cols: Sequence[str] | None = None, fmt: Callable[[Any], str] = cell) -> str:
    """A markdown table of `rows` (columns: `cols`, default the first row's keys), under an
    optional title and note; a missing value is an empty cell."""
    cols = list(cols or rows[0])
    lines = [f"# {title}", ""] if title else []
    lines += [note, ""] if note else []
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) if c in r else "" for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def publish(text: str, out: str | os.PathLike | None) -> None:
    """Print a result table and, when `out` is given, write it atomically (never half-written)."""
    print(text)
    if out:
        atomic_write(out, text)
