"""Benchmarks: scripts that measure ratios against a baseline in the same run."""

from __future__ import annotations

import os

from memtrain.record import atomic_write


def publish(text: str, out: str | os.PathLike | None) -> None:
    """Print a result table and, when `out` is given, write it atomically (never half-written)."""
    print(text)
    if out:
        atomic_write(out, text)
