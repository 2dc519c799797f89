"""Benchmarks: scripts that measure ratios against a baseline in the same process, run from a
checkout (`python -m benchmarks.<name>`, the Makefile's bench-* targets) and never installed.

What they share lives here, so every table is timed and labelled the same way: `timings` (how a
step is timed: `measure.StepTimer`, as memtrain's own loop does) and `kernel_ms` (a kernel's
time), `device_line` (the one description of the device and versions; `device_name` its first
part), `markdown` and `publish`; and the rows a table is made of, as CSV (`write_rows`,
`read_rows`): every row carries the device, the versions, the commit, the date and the command
that made it, so docs/results' tables are made from what a benchmark wrote
(tools/docs.py), not from its printed table.
"""

from __future__ import annotations

import csv
import datetime
import io
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from memtrain.memory import measure
from memtrain.record import atomic_write
from memtrain.run import provenance


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
    p = provenance.of_run(device)
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


# the columns write_rows adds to every row: who measured it, where, when and how
PROVENANCE = ("device", "torch", "git_commit", "date", "command")


def command(module: str, argv: Sequence[str] | None) -> str:
    """The command line that ran a benchmark: `python -m MODULE ARGS` (sys.argv when None)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python -m", module, *([shlex.join(args)] if args else [])])


def provenance_row(device: torch.device, cmd: str) -> dict[str, str]:
    """PROVENANCE's values for rows measured now on `device` by `cmd`."""
    p = provenance.of_run(device)
    return {"device": device_name(device), "torch": str(p["torch_version"]),
            "git_commit": str(p["git_commit"]), "date": datetime.date.today().isoformat(),
            "command": cmd}


def write_rows(rows: Sequence[dict], path: str | os.PathLike | None, device: torch.device,
               cmd: str, append: bool = False, key: Callable[[dict], Any] | None = None
               ) -> None:
    """The rows of a table as CSV (every key of every row, in order of appearance, then
    PROVENANCE), written atomically; `append` adds them to the file's rows (same columns
    first, new ones after), replacing the file's rows of the same `key` (a slice measured
    again)."""
    if not path:
        return
    prov = provenance_row(device, cmd)
    old = read_rows(path) if append and Path(path).exists() else []
    if key is not None:
        again = {key(r) for r in rows}
        old = [r for r in old if key(r) not in again]
    rows = [*old, *({**r, **prov} for r in rows)]
    cols: dict[str, None] = {}
    for r in rows:
        cols.update(dict.fromkeys(k for k in r if k not in PROVENANCE))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=[*cols, *PROVENANCE], lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_rows(path: str | os.PathLike) -> list[dict]:
    """write_rows's CSV as rows again: numbers as int or float (as written), text as text (the
    provenance always: a commit such as 66e581644680 reads as a float, infinite), an empty cell
    left out (as a row without that key)."""
    with open(path, encoding="utf-8", newline="") as f:
        return [{k: v if k in PROVENANCE else _value(v) for k, v in r.items() if v != ""}
                for r in csv.DictReader(f)]
