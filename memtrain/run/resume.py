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
from memtrain.run.faults import StopSignals

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


def _sharded() -> bool:
    from memtrain.run import distributed

    return distributed.World.active is not None and distributed.World.active.sharded


def capture(model: nn.Module, optimizer, scheduler, scaler, *, step: int, epoch: int,
            epoch_shuffle: torch.Tensor, extra: dict) -> dict:
    """The training state at a step boundary, as plain tensors and containers. A sharded run
    (ddp, fsdp) keeps the model and optimizer themselves under "live": the checkpointer saves
    them with torch.distributed.checkpoint, every rank its shards."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    sharded = _sharded()
    return {
        "format": FORMAT, "step": step, "epoch": epoch,
        **({"live": (model, optimizer)} if sharded else {}),
        "model": None if sharded else model.state_dict(),
        "optimizer": None if sharded else optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "cuda": cuda, "epoch_shuffle": epoch_shuffle},
        "extra": extra,
    }


def restore(state: dict, model: nn.Module, optimizer, scheduler, scaler,
            shuffle_gen: torch.Generator) -> dict:
    """Load `state` into the objects (model already on its device); returns `extra`.

    The shuffle generator is set to its state at the start of the checkpoint's epoch: the caller
    replays that epoch's batches up to the step so every random draw repeats. A sharded
    checkpoint (`dcp`): every rank loads its shards (torch.distributed.checkpoint).
    """
    if state.get("dcp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, optimizer)
        box = {"model": msd, "optim": osd}
        dcp.load(box, checkpoint_id=state["dcp_path"])
        set_state_dict(model, optimizer, model_state_dict=box["model"],
                       optim_state_dict=box["optim"])
    else:
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
        self.agreed: str | None = None  # several ranks: the stop all agreed on at this step

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
            if state.get("dcp"):  # sharded: this rank's own records and random state
                try:
                    state = _rank_state(state, p.parent)
                except Exception as e:  # every rank must resume, or none: no silent restart
                    from memtrain.errors import ConfigError

                    raise ConfigError(f"trainer.resume: the sharded checkpoint {p} cannot be "
                                      f"resumed here: {type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''}") from None
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
        """Save when due; returns the signal name when the run must stop now (already saved).
        Several ranks: the stop they agreed on at this step (`agreed`, distributed.reduce_step;
        a signal arriving since waits for the next step: every rank saves, or none)."""
        stop = self.agreed if self.world_collective() else (
            self.stop.requested if self.stop is not None else None)
        if stop or (self.every and step % self.every == 0):
            state = snapshot()
            state["run_id"] = self.run_id
            state["carry"] = self.carry
            if "live" in state:
                self._save_sharded(state, prefix, step)
            else:
                atomic_save(state, self.path(prefix))
            log.info("checkpoint at step %d -> %s", step, self.path(prefix))
        return stop

    def _save_sharded(self, state: dict, prefix: str, step: int) -> None:
        """A sharded run's checkpoint, every rank together: the model's and optimizer's shards
        with torch.distributed.checkpoint into `<name>.dcp.<step>/` (collective), each rank's
        own random state and records beside them (`rank<r>.pt`), then, once every rank's file
        is written, rank 0's `<name>.pt` naming that folder (the checkpoint a resume finds: an
        interrupted save leaves the previous one whole) and the previous folders removed."""
        import shutil

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from memtrain.run import distributed

        world = distributed.World.active
        model, optimizer = state.pop("live")
        msd, osd = get_state_dict(model, optimizer)
        name = f"{self.path(prefix).stem}.dcp.{step}"
        folder = self.run_dir / name
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder))
        atomic_save({"rng": state["rng"], "extra": state["extra"]},
                    folder / f"rank{world.rank}.pt")
        if world.collective:
            dist.barrier()
        if world.main:
            atomic_save({**state, "dcp": name, "world_size": world.size}, self.path(prefix))
            for old in self.run_dir.glob(f"{self.path(prefix).stem}.dcp.*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def world_collective() -> bool:
        from memtrain.run import distributed

        return distributed.World.active is not None and distributed.World.active.collective

    def clear(self) -> None:
        """A finished run needs no checkpoint: remove its own and the one it resumed from."""
        import shutil

        for folder in {self.run_dir, self.resumed_from or self.run_dir}:
            for p in folder.glob("resume*.pt"):
                p.unlink(missing_ok=True)
            for p in folder.glob("resume*.dcp.*"):  # a sharded run's shards
                shutil.rmtree(p, ignore_errors=True)


def _rank_state(state: dict, folder: Path) -> dict:
    """A sharded checkpoint's state as this rank resumes it: the folder of its shards, and its
    own random state and records (rank 0's file holds rank 0's; every rank has its own)."""
    from memtrain.run import distributed

    world = distributed.World.active
    rank = world.rank if world is not None else 0
    if state.get("world_size", 1) != (world.size if world is not None else 1):
        raise ValueError(f"saved by {state.get('world_size')} ranks, resumed by "
                         f"{world.size if world is not None else 1}")
    shards = folder / state["dcp"]
    mine = load(shards / f"rank{rank}.pt")
    return {**state, "dcp_path": str(shards), "rng": mine["rng"], "extra": mine["extra"]}


# ---------------------------------------------------------------- finished runs


def done_runs(root: Path) -> dict[str, Path]:
    """run_id -> the first folder under `root` whose summary.json has it with status ok: one
    pass over the folder for a whole sweep (the launcher checks every job against it)."""
    found: dict[str, Path] = {}
    if not root.is_dir():
        return found
    for f in sorted(root.rglob(record.SUMMARY)):
        try:
            s = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(s, dict) and s.get("status") == "ok" and isinstance(s.get("run_id"), str):
            found.setdefault(s["run_id"], f.parent)
    return found


def find_done(root: Path, run_id: str) -> Path | None:
    """A folder under `root` whose summary.json has this run_id and status ok, else None."""
    return done_runs(root).get(run_id)


def find_checkpoints(root: Path) -> list[Path]:
    """Folders under `root` that hold a resume checkpoint, newest first."""
    if not root.is_dir():
        return []
    files = sorted(root.rglob("resume*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    return list(dict.fromkeys(p.parent for p in files))


def save_weights(model: nn.Module, run_dir: Path) -> Path:
    """weights.pt: the model's whole state_dict (several ranks: gathered, written by rank 0)."""
    from memtrain.run import distributed

    path = Path(run_dir) / WEIGHTS
    state = distributed.full_state(model)
    if state is not None:
        atomic_save(state, path)
    return path
