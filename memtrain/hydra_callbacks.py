"""Hydra callbacks registered in conf/config.yaml (`hydra.callbacks.*`)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from memtrain.record import STATUSES, SUMMARY
from memtrain.resume import SKIPPED


def count_statuses(sweep_dir: Path) -> tuple[Counter, int]:
    """(jobs per status, jobs skipped as already done) over the run folders below sweep_dir.

    A folder with neither a readable summary.json nor a skip marker is a job that died without a
    record (killed hard, or the node lost): counted as `missing`.
    """
    counts: Counter = Counter()
    skipped = 0
    jobs = {p.parent for name in (".hydra", SUMMARY, SKIPPED) for p in sweep_dir.rglob(name)}
    for job in sorted(jobs):
        if (job / SKIPPED).is_file():
            skipped += 1
            if not (job / SUMMARY).is_file():
                counts["ok"] += 1
                continue
        try:
            status = json.loads((job / SUMMARY).read_text(encoding="utf-8")).get("status")
        except (OSError, ValueError, AttributeError):
            status = "missing"
        counts[status or "missing"] += 1
    return counts, skipped


def format_counts(counts: Counter, skipped: int = 0) -> str:
    order = [s for s in STATUSES if counts[s]] + sorted(set(counts) - set(STATUSES))
    parts = ", ".join(f"{s} {counts[s]}" for s in order) or "no records"
    extra = f" ({skipped} skipped: already done)" if skipped else ""
    return f"memtrain: {sum(counts.values())} jobs: {parts}{extra}"


class StatusCount(Callback):
    """Prints one closing line per multirun: how many jobs ended with each status.

    Reads the jobs' summary.json files, so it works with every launcher (the jobs may have run
    in other processes or on other machines)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        counts, skipped = count_statuses(sweep_dir)
        print(format_counts(counts, skipped), flush=True)
