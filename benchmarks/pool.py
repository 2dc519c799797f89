"""Benchmark of method=pool against method=none in the same process: memory and speed.

GPU (the paper's setting): resnet50 at 224 px, batch 64 and 128, bf16 and fp32; peak allocated
memory (`torch.cuda.max_memory_allocated` over timed training steps, optimizer state included)
and throughput (`bench.timings`: synchronised host clocks, as memtrain times a step) of pool (k=2,
upsample and pooled) over none. Goals: peak ratio <= 0.71 (the paper's -29%), better <= 0.60;
throughput ratio >= 0.90.
CPU: saved-activation bytes per step (`measure.SavedBytes`) and step time, at small sizes.

    python -m benchmarks.pool                           # CUDA when present, else the CPU
    python -m benchmarks.pool --device cpu --models resnet18 --sizes 32 --batches 8
    python -m benchmarks.pool --out docs/results/pool_gpu.md
    python -m benchmarks.pool ... --csv docs/results/rows/pool_cpu.csv   # the rows, as CSV
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import benchmarks as bench
from memtrain import models
from memtrain.memory import measure
from memtrain.methods.none import NoneMethod
from memtrain.methods.pool import PoolMethod
from memtrain.run.train import PRECISIONS

VARIANTS = {  # label -> method factory
    "none": NoneMethod,
    "pool k2 upsample": lambda: PoolMethod(kernel_size=2, mode="upsample"),
    "pool k2 pooled": lambda: PoolMethod(kernel_size=2, mode="pooled"),
    "pool k2 upsample conv+bn": lambda: PoolMethod(kernel_size=2, targets="conv+bn"),
}


def _step(model, opt, x, y, dtype):
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure_one(model_name, size, batch, precision, variant, device, steps, warmup) -> dict:
    """One (model, size, batch, precision, method) cell: saved bytes, peak, step time."""
    torch.manual_seed(0)
    net = getattr(models, model_name)(num_classes=1000, input_shape=(3, size, size))
    net = VARIANTS[variant]().wrap(net).to(device).train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    dtype = PRECISIONS[precision]
    row = {"model": model_name, "size": size, "batch": batch, "precision": precision,
           "method": variant}
    try:
        for _ in range(warmup):
            _step(net, opt, x, y, dtype)
        saved = measure.SavedBytes(measure.alive_before_step(net, x, y))
        with saved, torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            out = net(x)
        del out
        row["saved_bytes"] = saved.bytes
        measure.reset_cuda_peak(device)
        times = bench.timings(lambda: _step(net, opt, x, y, dtype), device, steps)
        row["step_s"] = statistics.median(times)
        row["samples_s"] = batch / row["step_s"]
        if device.type == "cuda":
            row["peak_alloc_bytes"] = torch.cuda.max_memory_allocated(device)
    except torch.cuda.OutOfMemoryError:
        row["status"] = "oom"
    row.setdefault("status", "ok")
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each row's saved bytes, peak and throughput over `none` of the same cell."""
    base = {(r["model"], r["size"], r["batch"], r["precision"]): r for r in rows
            if r["method"] == "none"}
    for r in rows:
        b = base.get((r["model"], r["size"], r["batch"], r["precision"]), {})
        for key, name in (("saved_bytes", "saved_ratio"), ("peak_alloc_bytes", "peak_ratio"),
                          ("samples_s", "throughput_ratio")):
            if key in r and b.get(key):
                r[name] = r[key] / b[key]


COLUMNS = ["model", "size", "batch", "precision", "method", "status", "saved_bytes", "saved_ratio",
           "peak_alloc_bytes", "peak_ratio", "step_s", "samples_s", "throughput_ratio"]


def _cell(v) -> str:
    """Byte counts in MiB, the rest as every benchmark writes them."""
    return f"{v / 2**20:.1f} MiB" if isinstance(v, int) and v > 10**5 else bench.cell(v)


def table(rows: list[dict]) -> str:
    """The markdown table of the rows (as measured, or as read back from --csv)."""
    return bench.markdown(rows, cols=[c for c in COLUMNS if any(c in r for r in rows)],
                          fmt=_cell)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--models", default=None, help="comma list (cuda: resnet50)")
    p.add_argument("--sizes", default=None, help="comma list of image sizes (cuda: 224)")
    p.add_argument("--batches", default=None, help="comma list (cuda: 64,128)")
    p.add_argument("--precisions", default=None, help="comma list (cuda: bf16,fp32)")
    p.add_argument("--methods", default=",".join(VARIANTS), help="comma list of " +
                   "; ".join(VARIANTS))
    p.add_argument("--steps", type=int, default=None, help="timed steps (cuda 20, cpu 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (cuda 5, cpu 2)")
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--csv", default=None, help="write the rows here (CSV, with provenance)")
    a = p.parse_args(argv)
    device = bench.device(a.device)
    gpu = device.type == "cuda"
    split = lambda s, default: (s or default).split(",")
    grid = [(m, int(s), int(b), pr) for m in split(a.models, "resnet50" if gpu else "resnet18")
            for s in split(a.sizes, "224" if gpu else "32")
            for b in split(a.batches, "64,128" if gpu else "8")
            for pr in split(a.precisions, "bf16,fp32" if gpu else "fp32")]
    steps, warmup = a.steps or (20 if gpu else 3), a.warmup or (5 if gpu else 2)
    rows = []
    for cell in grid:
        for variant in a.methods.split(","):
            rows.append(measure_one(*cell, variant, device, steps, warmup))
            print(rows[-1], flush=True)
            if gpu:  # the next cell starts from an empty cache
                torch.cuda.empty_cache()
    add_ratios(rows)
    note = (f"Device: {bench.device_line(device)}. Median of {steps} timed steps after {warmup} "
            f"warm-up; saved bytes: one forward, per storage, parameters excluded.")
    bench.publish(f"# method=pool vs none ({device})\n\n{note}\n\n{table(rows)}", a.out)
    bench.write_rows(rows, a.csv, device, bench.command("benchmarks.pool", argv))


if __name__ == "__main__":
    main()
