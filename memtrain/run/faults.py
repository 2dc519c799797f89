"""Failures as data: injected faults (a testing aid), graceful stop on SIGTERM/Ctrl-C, and torch's
CUDA memory snapshot.

`trainer.fault=oom|nan|error|sigterm|hang|kill` with `trainer.fault_step=N` makes step N fail the
way a real run would (a CUDA out-of-memory error, a NaN loss, an exception, a SIGTERM sent to
this process, a run that outlives its time limit, a process that vanishes as under kill -9 or the
kernel's out-of-memory killer), so every failure path of a sweep can be tested on a CPU. It is not
meant for studies.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import torch

from memtrain.memory.allocator import History

log = logging.getLogger(__name__)

HANG_LIMIT_S = 900
SNAPSHOT = "memory_snapshot.pickle"


class Fault:
    """Makes training step `step` fail with `kind` (one of `schema.FAULTS`, as `schema.Trainer`
    checks); call `inject(step, loss)` after the loss."""

    def __init__(self, kind: str, step: int = 0):
        self.kind, self.step = kind, int(step)
        self.fired = False

    def inject(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss, poisoned for `nan`; raises for `oom`/`error`; signals itself for `sigterm`
        and `kill` (SIGKILL: the process ends here); for `hang`, waits until the run is told to
        stop (SIGTERM, Ctrl-C, a SLURM time limit), as a run too long for its time limit does,
        and the step then ends with its checkpoint; after HANG_LIMIT_S without one it raises (a
        job nobody stops ends)."""
        if step != self.step or self.fired:
            return loss
        self.fired = True
        log.warning("injecting fault %s at step %d (trainer.fault)", self.kind, step)
        if self.kind == "oom":
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory (injected by trainer.fault=oom at step {step})")
        if self.kind == "error":
            raise RuntimeError(f"injected failure (trainer.fault=error at step {step})")
        if self.kind == "sigterm":  # a real signal, through the real handler
            os.kill(os.getpid(), signal.SIGTERM)
            return loss
        if self.kind == "kill":  # gone without a word: no handler, no row, no record
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            deadline = time.monotonic() + HANG_LIMIT_S  # an orphaned test job ends after all
            while not (StopSignals.active and StopSignals.active.requested):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"trainer.fault=hang: no stop signal in {HANG_LIMIT_S} s")
                time.sleep(0.05)
            return loss
        return loss * float("nan")


class SweepStop:
    """A SIGTERM that arrived while no run was active: in a sweep's main process, or in a
    launcher's worker between two jobs. The next run starts stopped (it saves a checkpoint after
    its first step and ends `interrupted`), so every job of a stopped sweep gets a row.

    The main process forwards the signal to the workers that registered in `MEMTRAIN_WORKERS`
    (a folder of pid files), so none of them trains on as an orphan.
    """

    requested: str | None = None
    ENV = "MEMTRAIN_WORKERS"
    STOP = "stop"

    @classmethod
    def stopped(cls) -> str | None:
        """The signal that stopped this sweep (in this process or its main process), if any."""
        folder = os.environ.get(cls.ENV)
        marker = Path(folder) / cls.STOP if folder else None
        if cls.requested is None and marker is not None and marker.is_file():
            return marker.read_text().strip() or "SIGTERM"
        return cls.requested

    @classmethod
    def _handle(cls, signum, frame) -> None:
        cls.requested = StopSignals.SIGNALS.get(signum, str(signum))
        log.warning("%s received between runs: the sweep stops", cls.requested)
        folder = os.environ.get(cls.ENV)
        if folder and os.getpid() == cls.main_pid():
            # for the jobs not started yet, whichever worker they land on
            with contextlib.suppress(OSError):
                (Path(folder) / cls.STOP).write_text(cls.requested)
            for f in Path(folder).glob("*.pid"):
                with contextlib.suppress(ValueError, OSError):
                    os.kill(int(f.stem), signum)

    @staticmethod
    def main_pid() -> int:
        return int(os.environ.get("MEMTRAIN_MAIN_PID", os.getpid()))

    @classmethod
    def install_main(cls) -> None:
        """In the process that launches a sweep: catch SIGTERM, forward it to the workers."""
        os.environ["MEMTRAIN_MAIN_PID"] = str(os.getpid())
        folder = Path(tempfile.mkdtemp(prefix="memtrain-workers-"))
        os.environ[cls.ENV] = str(folder)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        signal.signal(signal.SIGTERM, cls._handle)

    @classmethod
    def install_worker(cls) -> bool:
        """In a launcher's worker process (once): keep SIGTERM between jobs instead of dying, and
        register for forwarding. Returns whether this is a worker (not the launching process)."""
        if os.getpid() == cls.main_pid():
            return False
        if signal.getsignal(signal.SIGTERM) != cls._handle:
            with contextlib.suppress(ValueError):  # not the main thread: stays default
                signal.signal(signal.SIGTERM, cls._handle)
            folder = os.environ.get(cls.ENV)
            if folder and Path(folder).is_dir():
                (Path(folder) / f"{os.getpid()}.pid").touch()
        return True


class Stopped(Exception):
    """A stop signal that arrived before the run's first step (`StopSignals.at_once`): there is
    no step's end to wait for and nothing to save, so the run ends at once, `interrupted`."""

    def __init__(self, signal_name: str, doing: str):
        super().__init__(f"{signal_name} received while {doing}; stopped before training")
        self.signal = signal_name


class StopSignals:
    """While active, SIGTERM and the first Ctrl-C only set `requested`; the training loop stops
    at the end of the current step, saves a checkpoint and reports `status=interrupted`. Inside
    `at_once` (building the data and the model, the probes: before the first step) a signal
    raises `Stopped` at once instead, so a long build is no reason to be killed.

    A second Ctrl-C raises KeyboardInterrupt at once. Only the main thread may install handlers;
    elsewhere (a joblib worker thread) this is a no-op.
    """

    SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
    active: StopSignals | None = None  # the run in progress in this process

    def __init__(self):
        self.requested: str | None = SweepStop.stopped()  # the sweep was stopped before us
        self._old: dict = {}
        self._doing: str | None = None  # inside `at_once`: what the run is doing

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        name = self.SIGNALS.get(signum, str(signum))
        if self._doing is not None:
            self.requested = name
            raise Stopped(name, self._doing)
        self.request(name)

    @contextlib.contextmanager
    def at_once(self, doing: str):
        """Inside, a stop signal raises `Stopped` (naming `doing`) where the run is, instead of
        waiting for a step's end: before training there is none. A stop asked for before (a
        stopped sweep's next job) still trains its one step and saves its checkpoint."""
        self._doing = doing
        try:
            yield
        finally:
            self._doing = None

    def request(self, name: str, why: str = "") -> None:
        """Stop at the end of the current step (a signal, or a launcher that caught one)."""
        self.requested = name
        log.warning("%s received%s: stopping after this step (Ctrl-C again to abort now)",
                    name, why)

    def ignore_after(self, signum: int) -> None:
        """After this scope, ignore `signum` rather than restore the handler before it: rank 0
        of a job whose other rank failed, which the launcher stops (SIGTERM) while it still
        writes the job's row and says why."""
        if signum in self._old:
            self._old[signum] = signal.SIG_IGN

    def __enter__(self) -> StopSignals:
        StopSignals.active = self
        try:
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread
            self._old.clear()
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
        StopSignals.active = None



def exit_code(signal_name: str | None) -> int:
    """The exit status of a run stopped by `signal_name` (the shell's 128 + signal number);
    SIGTERM unless it was the user's Ctrl-C."""
    return 128 + (signal.SIGINT if signal_name == "SIGINT" else signal.SIGTERM)


class MemorySnapshot:
    """`trainer.memory_snapshot=true`: record CUDA allocator history through the run and dump it
    (open it at https://pytorch.org/memory_viz) on OOM or at the end, when the history holds the
    peak. CUDA only; on other devices it logs a note and does nothing. The recorder is the
    process's one (`allocator.History`): `trainer.memory_timeline` cuts its step out of the same
    history, and the snapshot keeps every entry."""

    def __init__(self, enabled: bool, device: torch.device, run_dir: Path,
                 max_entries: int = 100_000):
        self.enabled = enabled and device.type == "cuda"
        self.path = Path(run_dir) / SNAPSHOT
        self.max_entries = max_entries
        if enabled and not self.enabled:
            log.info("trainer.memory_snapshot: CUDA only, no snapshot on device %s", device)

    def __enter__(self) -> MemorySnapshot:
        if self.enabled:  # the process's one recorder: a step's timeline shares it
            History.hold(self.max_entries, context="all")
        return self

    def dump(self) -> str:
        if not self.enabled:
            return ""
        torch.cuda.memory._dump_snapshot(str(self.path))
        log.info("memory snapshot written to %s", self.path)
        return str(self.path)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            try:
                self.dump()
            finally:
                History.release()
