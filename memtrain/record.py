"""Run records: summary.json (one flat record) and metrics.csv (long form), written atomically.

A reader never sees a half-written file: each file is written to a temporary name in the same
folder, flushed to disk, then renamed over the final name (rename is atomic on POSIX). Every
column of a summary is checked against memtrain/columns.py, the one list of them.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from memtrain import columns

SUMMARY = "summary.json"
METRICS = "metrics.csv"
# a job skipped by trainer.skip_done leaves this marker (naming the folder that holds its row)
SKIPPED = "skipped.json"
METRIC_FIELDS = ("step", "epoch", "split", "name", "value")
STATUSES = ("ok", "oom", "diverged", "error", "interrupted")
# The config groups a run chooses an option of: the `method`, `model`, ... columns of every row
GROUPS = ("dataset", "model", "method", "optim", "trainer", "experiment")
# trainer options that drive a run without changing what it computes: left out of run_id (so a
# resumed or re-launched run keeps its id and skip_done finds it) and out of the report's settings
# (evaluation between steps draws no random numbers and runs outside the measured steps: the
# trained weights and every measured column are the same with or without it; the memory timeline
# records the accounting step, which no timed step or peak column includes)
DRIVING_OPTIONS = ("resume", "save_every", "save_weights", "skip_done", "search_dir",
                   "memory_snapshot", "memory_timeline", "progress", "logger",
                   "eval_every_steps")


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[IO[bytes]], None]) -> None:
    """Write `data` (text, bytes, or a function that writes to a binary file, e.g. torch.save)
    to a temporary file in the same folder, fsync, rename over `path`: never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except RuntimeError as e:  # torch.save's zip writer on a full disk: "unexpected pos"
        Path(tmp).unlink(missing_ok=True)
        if "unexpected pos" in str(e) or "file write failed" in str(e):
            raise _write_failed(path, e) from None
        raise
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise _write_failed(path, e) from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_failed(path: Path, e: BaseException) -> OSError:
    """A write that failed for want of space says so and names the file (torch's zip writer
    says only "unexpected pos 4672 vs 4566")."""
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = 0
    if isinstance(e, OSError) and e.errno == errno.ENOSPC or free < 64 * 2**20:
        return OSError(errno.ENOSPC, f"no space left on device writing {path} "
                                     f"({free / 2**20:.0f} MiB free)")
    return OSError(errno.EIO, f"writing {path} failed: {str(e).splitlines()[0]}")


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; readers turn null back into NaN
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "item") and callable(v.item):  # numpy / torch scalars
        return _jsonable(v.item())
    return v


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> Path:
    """summary.json, atomically, with the schema its columns mean (`schema_version`, set in
    `summary` where absent). A column memtrain/columns.py does not declare is a warning (an
    error under MEMTRAIN_STRICT_COLUMNS=1, as in the tests: columns.check)."""
    path = Path(run_dir) / SUMMARY
    summary.setdefault(columns.SCHEMA, columns.SCHEMA_VERSION)
    columns.check(summary, where=str(path))
    flat = {k: _jsonable(v) for k, v in summary.items()}
    atomic_write(path, json.dumps(flat, indent=1, sort_keys=False) + "\n")
    return path


def write_metrics(run_dir: str | os.PathLike, rows: list[dict[str, Any]]) -> Path:
    path = Path(run_dir) / METRICS
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=METRIC_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())
    return path


def read_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    with open(Path(run_dir) / SUMMARY, encoding="utf-8") as f:
        return json.load(f)
