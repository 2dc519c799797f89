"""One checkpoint profile per sweep: the profile of a (model, input shape, batch, precision,
device, profiling options) is kept as JSON in the sweep folder, so every budget of a sweep plans
on the same measurements (a monotone frontier) and a sweep profiles once, not once per job.

A probe's profile (fake tensors: bytes without times) never enters the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

import memtrain.methods.checkpoint.ops as opplan
import memtrain.methods.checkpoint.plan as planner

log = logging.getLogger(__name__)
FOLDER = ".checkpoint-profiles"


def key(model: torch.nn.Module, names: list[str], x: torch.Tensor, autocast, **options) -> str:
    """A hash of what the profile depends on: the model's type, segments, parameter shapes and
    module tree as printed (dropout rates included), the batch's shape, dtype and device, the
    autocast dtype, the profiling options (the run's model options among them: what the
    printed tree does not show, such as a transformer's attention kernel), torch."""
    with autocast():
        dev = x.device.type
        amp = str(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else "off"
    device = torch.cuda.get_device_name(x.device) if dev == "cuda" else dev
    what = [type(model).__qualname__, names, [tuple(p.shape) for p in model.parameters()],
            repr(model),
            tuple(x.shape), str(x.dtype), device, amp, torch.__version__, sorted(options.items())]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]


def load(folder: Path, k: str) -> tuple[planner.Profile, opplan.OpProfile | None] | None:
    path = Path(folder) / FOLDER / f"{k}.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ops = None if d["ops"] is None else opplan.OpProfile(
        [[opplan.Op(**o) for o in seg] for seg in d["ops"]],
        [opplan.Compact(**c) for c in d.get("compact", [])])
    log.info("checkpoint profile reused from %s", path)
    return planner.Profile(**d["profile"]), ops


def save(folder: Path, k: str, prof: planner.Profile, ops: opplan.OpProfile | None) -> None:
    path = Path(folder) / FOLDER / f"{k}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # a sharded run's gathered parameters are its own, no measurement of the model
    d = {"profile": {**dataclasses.asdict(prof), "gathered": []},
         "ops": None if ops is None else [[dataclasses.asdict(o) for o in seg] for seg in ops.ops],
         "compact": [] if ops is None else [dataclasses.asdict(c) for c in ops.compact]}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(d))
    os.replace(tmp, path)  # parallel jobs of a sweep: the last identical profile wins
