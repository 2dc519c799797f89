"""Resumable runs: training-state checkpoints (not to be confused with the activation
recomputation method `checkpoint`), finished-run lookup for `trainer.skip_done`.

A checkpoint holds everything the next step depends on: model, optimizer, scheduler and grad
scaler state, the global RNG states, the shuffle generator's state at the start of the current
epoch, the step, and the records gathered so far. A resumed run restores them, replays the
epoch's batch order up to the step (drawing the same random numbers), and continues bit for bit.
Files are written atomically and read with `torch.load(weights_only=True)`: plain tensors and
containers only, no pickled code.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memtrain import record
from memtrain.faults import StopSignals

log = logging.getLogger(__name__)

FORMAT = 1
WEIGHTS = "weights.pt"
SKIPPED = record.SKIPPED


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save, written atomically (`record.atomic_write`)."""
    record.atomic_write(path, lambda f: torch.save(obj, f))


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def clean_partial(run_dir: Path) -> list[Path]:
    """Remove what a kill during an atomic save leaves (`.<name>.*.tmp`: a checkpoint, the
    weights or a record half written); the files they were meant to replace are intact."""
    gone = []
    for p in Path(run_dir).glob(".*.tmp"):
        if p.name.startswith((".resume", f".{WEIGHTS}.", ".summary.json.", ".metrics.csv.",
                              f".{SKIPPED}.")):
            p.unlink(missing_ok=True)
            gone.append(p)
    if gone:
        log.warning("removed %d partial file(s) left by an interrupted save in %s", len(gone),
                    run_dir)
    return gone


def capture(model: nn.Module, optimizer, scheduler, scaler, *, step: int, epoch: int,
            epoch_shuffle: torch.Tensor, extra: dict) -> dict:
    """The training state at a step boundary, as plain tensors and containers."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "format": FORMAT, "step": step, "epoch": epoch,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "cuda": cuda, "epoch_shuffle": epoch_shuffle},
        "extra": extra,
    }


def restore(state: dict, model: nn.Module, optimizer, scheduler, scaler,
            shuffle_gen: torch.Generator) -> dict:
    """Load `state` into the objects (model already on its device); returns `extra`.

    The shuffle generator is set to its state at the start of the checkpoint's epoch: the caller
    replays that epoch's batches up to the step so every random draw repeats.
    """
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    shuffle_gen.set_state(rng["epoch_shuffle"])
    return state["extra"]


class Checkpointer:
    """Saves the training state every `every` steps and when a stop signal arrived; with
    `resume`, loads the last one. One file per train() call (`prefix` tells sub-runs apart).

    Args:
        run_dir: the run folder the checkpoint goes to.
        run_id: stored in the file; a checkpoint of another configuration is never loaded.
        every: steps between periodic checkpoints (0: only on a stop signal).
        resume: look for a checkpoint to continue from.
        search: further folders to look in when run_dir has none (newest first).
        stop: the signal flag the loop polls at each step boundary.
    """

    def __init__(self, run_dir: Path, run_id: str, every: int = 0, resume: bool = False,
                 search: list[Path] | None = None, stop: StopSignals | None = None):
        self.run_dir, self.run_id, self.every = Path(run_dir), run_id, int(every or 0)
        self.resume, self.search, self.stop = resume, list(search or []), stop
        self.resumed_from: Path | None = None
        self.warning: str | None = None  # a checkpoint that could not be read (the row says so)
        # What a method decided before training and must keep on resume (the checkpoint
        # method's plan): saved with every checkpoint, read back with `load()["carry"]`.
        self.carry: dict[str, Any] = {}

    def path(self, prefix: str = "", run_dir: Path | None = None) -> Path:
        name = f"resume{'_' + prefix.strip('_/.') if prefix else ''}.pt"
        return (run_dir or self.run_dir) / name

    def load(self, prefix: str = "") -> dict | None:
        """The checkpoint to continue from, or None (no resume asked, or nothing to resume)."""
        if not self.resume:
            return None
        for folder in [self.run_dir, *self.search]:
            p = self.path(prefix, folder)
            if not p.is_file():
                continue
            try:
                state = load(p)
                if not isinstance(state, dict) or "step" not in state:
                    raise ValueError("not a training-state checkpoint")
            except Exception as e:  # cut short or corrupt: start afresh rather than fail
                self.warning = (f"unreadable checkpoint {p} ignored ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}); started from "
                                f"step 0")
                log.warning("%s", self.warning)
                continue
            if state.get("run_id") != self.run_id or state.get("format") != FORMAT:
                log.warning("ignoring %s: written by another configuration", p)
                continue
            self.resumed_from = p.parent
            log.info("resuming from %s at step %d", p, state["step"])
            return state
        log.info("trainer.resume: no checkpoint for run_id %s; starting from step 0", self.run_id)
        return None

    def carried(self) -> dict[str, Any]:
        """What a method kept in `carry` in the checkpoint this run resumes from ({} if none)."""
        state = self.load()
        return dict((state or {}).get("carry", {}))

    def columns(self) -> dict[str, str]:
        """Summary columns: where the run resumed from, and an unreadable checkpoint's warning."""
        out = {}
        if self.resumed_from is not None:
            out["resumed_from"] = str(self.resumed_from)
        if self.warning is not None:
            out["resume_warning"] = self.warning
        return out

    def step_done(self, step: int, snapshot: Callable[[], dict], prefix: str = "") -> str | None:
        """Save when due; returns the signal name when the run must stop now (already saved)."""
        stop = self.stop.requested if self.stop is not None else None
        if stop or (self.every and step % self.every == 0):
            state = snapshot()
            state["run_id"] = self.run_id
            state["carry"] = self.carry
            atomic_save(state, self.path(prefix))
            log.info("checkpoint at step %d -> %s", step, self.path(prefix))
        return stop

    def clear(self) -> None:
        """A finished run needs no checkpoint: remove its own and the one it resumed from."""
        for folder in {self.run_dir, self.resumed_from or self.run_dir}:
            for p in folder.glob("resume*.pt"):
                p.unlink(missing_ok=True)


# ---------------------------------------------------------------- finished runs


def find_done(root: Path, run_id: str) -> Path | None:
    """A folder under `root` whose summary.json has this run_id and status ok, else None."""
    if not root.is_dir():
        return None
    for f in sorted(root.rglob("summary.json")):
        try:
            s = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(s, dict) and s.get("run_id") == run_id and s.get("status") == "ok":
            return f.parent
    return None


def find_checkpoints(root: Path) -> list[Path]:
    """Folders under `root` that hold a resume checkpoint, newest first."""
    if not root.is_dir():
        return []
    files = sorted(root.rglob("resume*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    return list(dict.fromkeys(p.parent for p in files))


def save_weights(model: nn.Module, run_dir: Path) -> Path:
    path = Path(run_dir) / WEIGHTS
    atomic_save(model.state_dict(), path)
    return path
