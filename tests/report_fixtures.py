"""Fabricated run folders for the report tests. TEST DATA ONLY: every number here is made up
to exercise tables and figures; none of it was measured."""

from __future__ import annotations

import json
import math
from pathlib import Path

from memtrain import record

MiB = 2**20
PARAMS_MIB = {"resnet18": 42.6, "resmlp12": 57.1}  # made up, plausible sizes
ACT_MIB = {"resnet18": 610.0, "resmlp12": 380.0}


def write_run(folder: Path, *, method: str = "none", model: str = "resnet18",
              dataset: str = "cifar10", seed: int = 0, status: str = "ok",
              peak: float = 100 * MiB, act: float = 50 * MiB, saved: float | None = None,
              throughput: float = 1000.0, step_time: float | None = None,
              test_acc: float | None = 0.9, accs: list[float] | None = None,
              at_peak: dict[str, float] | None = None, source: str = "tracker",
              at_act_peak: dict[str, float] | None = None,
              batch_size: int = 128, precision: str = "fp32", params: dict | None = None,
              extra: dict | None = None, foreign: dict | None = None) -> Path:
    """One run folder with a summary.json (and a metrics.csv when `accs` is given; the breakdown
    at the activation peak only when `at_act_peak` is given, as in summaries written before
    the trainer recorded it). `foreign`: columns no part of memtrain writes (a hand edit,
    another tool), added to the file after the record's check."""
    folder.mkdir(parents=True, exist_ok=True)
    at_peak = at_peak or {"params": peak * 0.2, "grads": peak * 0.2, "optim": peak * 0.2,
                          "act": peak * 0.3, "other": peak * 0.1}
    row = {
        "run_id": f"{method}-{model}-{seed}-{folder.name}", "status": status, "method": method,
        "model": model, "dataset": dataset, "optim": "sgd", "trainer": "default",
        "trainer.batch_size": batch_size, "trainer.precision": precision, "trainer.seed": seed,
        "mem_peak_alloc_bytes": peak, "mem_peak_source": source, "mem_peak_act_bytes": act,
        "mem_peak_act_temp_bytes": act,  # no backward temporaries in these made-up rows
        "mem_act_saved_bytes": act if saved is None else saved,
        "mem_params_bytes": at_peak["params"], "mem_grads_bytes": at_peak["grads"],
        "mem_optim_bytes": at_peak["optim"],
        **{f"mem_at_peak_{k}_bytes": v for k, v in at_peak.items()},
        **{f"mem_at_act_peak_{k}_bytes": v for k, v in (at_act_peak or {}).items()},
        "throughput_samples_s": throughput,
        "step_time_s_median": step_time if step_time is not None else batch_size / throughput,
        "test_acc": test_acc, "test_acc5": None if test_acc is None else min(1.0, test_acc + .05),
        "train_loss": 0.5,
        **{f"method.{k}": v for k, v in (params or {}).items()},
        **(extra or {}),
    }
    # through the record boundary: a made-up row declares its columns as a run's must
    record.write_summary(folder, row)
    if foreign:
        f = folder / "summary.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), **foreign}, indent=1))
    if accs is not None:
        lines = ["step,epoch,split,name,value"]
        for e, a in enumerate(accs):
            lines += [f"{(e + 1) * 10},{e},train,loss,{1.0 / (e + 1)}",
                      f"{(e + 1) * 10},{e},test,acc,{a}"]
        (folder / "metrics.csv").write_text("\n".join(lines) + "\n")
    return folder


def _breakdown(model: str, act_mib: float, other_frac: float = 0.05) -> dict[str, float]:
    p = PARAMS_MIB[model] * MiB
    parts = {"params": p, "grads": p, "optim": p, "act": act_mib * MiB}
    parts["other"] = other_frac * sum(parts.values())
    return parts


# (method, params, activation factor vs none, time factor vs none, accuracy drop in points)
STUDY = [
    ("none", {}, 1.0, 1.0, 0.0),
    ("pool", {"kernel_size": 2, "mode": "upsample"}, 0.42, 1.08, 0.6),
    ("pool", {"kernel_size": 4, "mode": "upsample"}, 0.22, 1.11, 2.9),
    ("prune", {"sparsity": 0.5}, 0.63, 1.15, 0.3),
    ("prune", {"sparsity": 0.9}, 0.31, 1.21, 1.8),
    ("checkpoint", {"strategy": "budget", "budget_fraction": 0.25}, 0.33, 1.32, 0.0),
    ("checkpoint", {"strategy": "budget", "budget_fraction": 0.5}, 0.55, 1.19, 0.0),
    ("checkpoint", {"strategy": "budget", "budget_fraction": 0.75}, 0.78, 1.08, 0.0),
]
BASE_ACC = {"resnet18": 0.912, "resmlp12": 0.861}
BASE_SPS = {"resnet18": 2150.0, "resmlp12": 3100.0}


def fabricate_study(root: Path, seeds=(0, 1, 2), epochs: int = 6, source: str = "cuda") -> Path:
    """A made-up multi-method study (2 models x 8 settings x seeds) with two kinds of failure:
    prune sparsity=0.9 diverges on resmlp12 (every seed), pool kernel_size=4 ooms for seed 2
    on resnet18. Deterministic."""
    n = 0
    for model in ("resnet18", "resmlp12"):
        for method, params, fa, ft, drop in STUDY:
            for seed in seeds:
                jitter = ((seed * 7 + n) % 5 - 2) / 1000  # +-0.2 points, deterministic
                act = ACT_MIB[model] * fa
                parts = _breakdown(model, act)
                peak = sum(parts.values())
                acc = BASE_ACC[model] - drop / 100 + jitter
                sps = BASE_SPS[model] / ft * (1 + jitter)
                curve = [acc * (1 - 0.6 * 0.55 ** e) for e in range(epochs)]
                status = "ok"
                if model == "resmlp12" and method == "prune" and params.get("sparsity") == 0.9:
                    status, acc, curve = "diverged", math.nan, curve[:2]
                if model == "resnet18" and params.get("kernel_size") == 4 and seed == 2:
                    status, acc, curve = "oom", math.nan, []
                write_run(root / f"{n:03d}", method=method, model=model, seed=seed,
                          status=status, peak=peak, act=act * MiB, throughput=sps,
                          test_acc=acc, accs=curve, at_peak=parts, source=source,
                          params=params)
                n += 1
    return root
