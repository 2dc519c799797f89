"""Independent partitions in worker processes (`method.parallel=true`).

One spawned process per partition. With several CUDA devices, partition j runs on device
j mod n and up to n workers run at once; on one device (a single GPU or the CPU) the workers run
one after another, so each partition's memory is measured alone in its own process. A worker
gets its phase and the data (CPU tensors, shared memory) and returns its summary, metrics and
trained state as bytes; a worker that dies or fails becomes an error of the run.
"""

from __future__ import annotations

import io
import queue as queue_mod
import traceback

import torch
from torch import nn

from memtrain.data import Data
from memtrain.errors import ConfigError
from memtrain.methods.synthetic.partition import Phase, run_phase
from memtrain.run.train import RunFailed, TrainResult

POLL_S = 1.0


def state_bytes(module: nn.Module) -> bytes:
    """A module's state on the CPU, serialised: how a worker hands its partition back."""
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, buf)
    return buf.getvalue()


def _on(data: Data, device: torch.device) -> Data:
    return Data(data.train.to(device), data.test.to(device), data.num_classes, data.input_shape,
                data.name)


def _worker(index: int, phase: Phase, data: Data, data_on_device: bool, threads: int,
            out) -> None:
    try:
        torch.set_num_threads(threads)
        device = phase.train_kwargs["device"]
        if device.type == "cuda":
            torch.cuda.set_device(device)
            if data_on_device:
                data = _on(data, device)
        res = run_phase(phase, data)
        out.put((index, ("ok", res.summary, res.metrics, state_bytes(phase.module))))
    except RunFailed as e:
        out.put((index, ("failed", e.status, str(e), e.step, e.summary, e.metrics)))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        kind = "config" if isinstance(e, ConfigError) else "error"
        out.put((index, (kind, f"{type(e).__name__}: {e}", traceback.format_exc())))


def _devices(device: torch.device) -> list[torch.device]:
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        return [torch.device("cuda", j) for j in range(torch.cuda.device_count())]
    return [device]


def _collect(procs: dict[int, object], out) -> dict[int, tuple]:
    got: dict[int, tuple] = {}
    while len(got) < len(procs):
        try:
            i, payload = out.get(timeout=POLL_S)
            got[i] = payload
        except queue_mod.Empty:
            dead = [i for i, p in procs.items() if i not in got and not p.is_alive()]
            if dead and out.empty():
                code = procs[dead[0]].exitcode
                raise RuntimeError(f"partition {dead[0]}'s worker process exited with code "
                                   f"{code} before reporting") from None
    return got


def run_parallel(phases: list[Phase], data: Data, device: torch.device) -> list[tuple[str, object]]:
    """Train every phase in its own process; modules are updated in place with the results."""
    ctx = torch.multiprocessing.get_context("spawn")
    devices = _devices(device)
    on_device = device.type == "cuda"
    cpu_data = _on(data, torch.device("cpu"))
    out = ctx.Queue()
    results: list[tuple[str, object]] = []
    for start in range(0, len(phases), len(devices)):
        wave = phases[start:start + len(devices)]
        procs = {}
        for j, phase in enumerate(wave):
            phase.module.cpu()
            # A worker trains its partition from scratch with the trainer options alone: the
            # checkpointer holds the parent's stop signal, the loggers its terminal.
            phase.train_kwargs = {"trainer": phase.train_kwargs["trainer"], "device": devices[j]}
            p = ctx.Process(target=_worker, daemon=True,
                            args=(start + j, phase, cpu_data, on_device, torch.get_num_threads(),
                                  out))
            p.start()
            procs[start + j] = p
        got = _collect(procs, out)
        for p in procs.values():
            p.join()
        for i in sorted(got):
            kind, *rest = got[i]
            if kind == "failed":
                status, msg, step, summary, metrics = rest
                raise RunFailed(status, f"{phases[i].name}: {msg}", step, summary, metrics)
            if kind != "ok":
                msg, tb = rest
                if kind == "config":
                    raise ConfigError(msg)
                raise RuntimeError(f"{phases[i].name} failed in its worker: {msg}\n{tb}")
            summary, metrics, blob = rest
            phases[i].module.load_state_dict(torch.load(io.BytesIO(blob), map_location="cpu"))
            results.append((phases[i].name, TrainResult(summary, metrics)))
    return results
