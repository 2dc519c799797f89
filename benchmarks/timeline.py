"""What `trainer.memory_timeline=true` costs, measured against the same work without it.

The timeline is recorded on the accounting step (the step the memory columns measure, which
trains like every other step and which no timed step includes), so it can slow only that step.
Two measurements, each alternating with and without (the order swapped every round, so drift of
a shared machine hits both alike), each reported as the median of the per-round ratios with
their range:

- the step: one training step of the same model on the same batch, in one process, as a plain
  step (what a timed step does), as the accounting step (tracker and saved-bytes hooks), and as
  the accounting step recording the timeline (`measure.TimelineRecorder` active: the tracker's
  events, the per-module saved bytes). `recording` = timeline / accounting: what the option
  adds to the step it records; `tracker` = accounting / plain: what accounting costs anyway;
  `writing`: once per run, after training, the table and the files beside the run (the
  timeline's parquet, PNG and PDF, saved_by_module.csv).
- the run: the same run (`api.run`, same config and seed) without and with the option:
  `timed` = its `step_time_s_median` with / without, which recording does not touch (its spread
  is the machine's noise), and `accounting` = its `mem_accounting_step_s` with / without.

    python -m benchmarks.timeline                       # resnet18 none and quantize, CPU
    python -m benchmarks.timeline --csv docs/results/rows/timeline_cost_cpu.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import benchmarks as bench
from memtrain import api
from memtrain.memory import by_module, measure, timeline

COLUMNS = ["date", "device", "model", "method", "image px", "batch", "events", "rounds",
           "plain step s", "accounting step s", "recording step s", "tracker ratio",
           "recording ratio", "recording ratio range", "writing s", "run rounds", "run timed ratio",
           "run timed ratio range", "run accounting ratio", "run accounting ratio range",
           "torch"]
MODES = ("plain", "accounting", "recording")


def _ratio(num: list[float], den: list[float]) -> tuple[float, str]:
    r = [a / b for a, b in zip(num, den)]
    return round(statistics.median(r), 3), f"{min(r):.3f}-{max(r):.3f}"


def step_times(overrides: list[str], batch: int, device: torch.device,
               rounds: int) -> tuple[dict[str, list[float]], int]:
    """Seconds of one training step per mode and round (the modes' order turned each round),
    and the timeline's events."""
    data, model, _ = api.build(overrides)
    model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = next(iter(data.train.batches(batch, device)))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    events, last = 0, None

    def step(mode: str) -> float:
        nonlocal events, last
        meas = measure.Measurement(device, 3, 0, mode != "plain", {})
        with measure.TimelineRecorder(mode == "recording") as rec:
            measure.sync(device)
            t0 = time.perf_counter()
            with meas.step(0, model, opt, x, y):
                with meas.forward():
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                meas.updating()
                opt.step()
                meas.update_done(model)
                opt.zero_grad(set_to_none=True)
            measure.sync(device)
            took = time.perf_counter() - t0
        if rec.steps:
            events, last = len(rec.steps[0][0]), rec
        return took

    step("plain")  # optimizer state, warm caches
    for i in range(rounds):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            times[mode].append(step(mode))
    # once per run, after training: the table, timeline.parquet/.png/.pdf, saved_by_module.csv
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        timeline.write(last.table(), Path(tmp))
        by_module.write_saved(last.saved, tmp)
        times["writing"] = [time.perf_counter() - t0]
    return times, events


def run_pairs(overrides: list[str], rounds: int) -> dict[str, dict[str, list[float]]]:
    """The same run without and with the timeline (the order swapped every round)."""
    out = {"timed": {"without": [], "with": []}, "accounting": {"without": [], "with": []}}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                key = "with" if on else "without"
                row = api.run([*overrides, f"trainer.memory_timeline={str(on).lower()}"],
                              out_dir=Path(tmp) / f"{i}_{key}")
                if row["status"] != "ok":
                    raise RuntimeError(f"{overrides}: {row.get('error')}")
                out["timed"][key].append(row["step_time_s_median"])
                out["accounting"][key].append(row["mem_accounting_step_s"])
    return out


def measure_one(model: str, method: str, image_size: int, batch: int, rounds: int,
                run_rounds: int, steps: int, device: str, threads: int) -> dict:
    base = [f"model={model}", f"method={method}", "dataset=synthetic",
            f"dataset.image_size={image_size}", f"trainer.batch_size={batch}",
            f"trainer.device={device}", f"trainer.threads={threads}"]
    dev = torch.device(device)
    times, events = step_times(base, batch, dev, rounds)
    rr, rrange = _ratio(times["recording"], times["accounting"])
    tr, _ = _ratio(times["accounting"], times["plain"])
    row = {"date": dt.date.today().isoformat(), "device": bench.device_name(dev),
           "model": model, "method": method, "image px": image_size, "batch": batch,
           "events": events, "rounds": rounds,
           **{f"{m} step s":
              round(statistics.median(times[m]), 3) for m in MODES},
           "tracker ratio": tr, "recording ratio": rr, "recording ratio range": rrange,
           "writing s": round(times["writing"][0], 3),
           "run rounds": run_rounds, "torch": torch.__version__}
    if run_rounds:
        runs = run_pairs([*base, f"trainer.max_steps={steps}", "trainer.warmup_steps=1",
                          "trainer.eval_max_batches=1", "trainer.progress=false"], run_rounds)
        for k in ("timed", "accounting"):
            row[f"run {k} ratio"], row[f"run {k} ratio range"] = _ratio(runs[k]["with"],
                                                                        runs[k]["without"])
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--methods", default="none,quantize")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6, help="rounds of the three steps")
    ap.add_argument("--run-rounds", type=int, default=2, help="pairs of runs (0: none)")
    ap.add_argument("--steps", type=int, default=6, help="per run: 1 warm-up, the accounting "
                                                         "step, the rest timed")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--csv", help="write the table's rows to this CSV (docs/results/rows/)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = [measure_one(a.model, m, a.image_size, a.batch_size, a.rounds, a.run_rounds,
                        a.steps, a.device, a.threads) for m in a.methods.split(",")]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    bench.publish(bench.markdown(rows, cols=COLUMNS, note=f"load average {load:.1f} at the "
                                 "end; medians, and of the per-round ratios"), None)
    if a.csv:
        with open(a.csv, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
