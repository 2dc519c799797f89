"""Benchmark of method synthetic: per-partition peak memory, time to a target accuracy and final
accuracy against `none`, for mlp6 and resnet18 with K in {2, 3, 4}.

Every row is one `api.run` (the CLI's code path, so the peak is CUDA's max_memory_allocated on a
GPU and the live-tensor tracker's peak on the CPU) in this process, `none` first on the same
model, data, seed and epochs. Time to target: the training time until the composed model's test
accuracy first reaches `target` x none's final accuracy, at epoch granularity (with
right_input=left the last partition's per-epoch evaluation is the composed model's); earlier
phases count whole.

    python -m benchmarks.synthetic              # GPU sizes when CUDA is present, else CPU
    python -m benchmarks.synthetic --cpu --out runs/bench/synthetic_cpu.md
    python -m benchmarks.synthetic --cpu --csv docs/results/rows/synthetic_cpu.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime
import sys
from pathlib import Path

import torch

import benchmarks as bench
from benchmarks import device_line, markdown, publish
from memtrain import api

MIB = 2**20


def suites(cpu: bool, fmnist: bool) -> dict[str, list[str]]:
    """Overrides per model: small enough for a shared CPU, the paper's sizes on a GPU."""
    if cpu:
        mlp = ["model=mlp6", "model.widths=[256,256,128,128,64]", "trainer.epochs=2"]
        res = ["model=resnet18", "dataset=synthetic", "dataset.image_size=16",
               "dataset.train_size=1024", "dataset.test_size=512", "trainer.batch_size=64",
               "trainer.epochs=3"]
    else:
        mlp = ["model=mlp6", "trainer.epochs=10"]
        res = ["model=resnet18", "dataset=synthetic", "dataset.image_size=32",
               "trainer.batch_size=128", "trainer.epochs=10"]
    mlp += ["dataset=fashion_mnist"] if fmnist else ["dataset=synthetic", "dataset.channels=1",
                                                     "dataset.image_size=28"]
    return {"mlp6": mlp, "resnet18": res}


def _epoch_acc(run_dir: Path, name: str) -> list[float]:
    """Test accuracy after each epoch of one phase, from metrics.csv."""
    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "test" and r["name"] == name]
    return [float(r["value"]) for r in sorted(rows, key=lambda r: int(r["epoch"]))]


def time_to(row: dict, run_dir: Path, target: float, k: int) -> float:
    """Training seconds until test accuracy >= target (epoch granularity); NaN if never."""
    if k == 0:
        before, last, accs = 0.0, row["train_time_s"], _epoch_acc(run_dir, "acc")
    else:
        before = sum(row[f"part{j}.train_time_s"] for j in range(k - 1))
        last, accs = row[f"part{k - 1}.train_time_s"], _epoch_acc(run_dir, f"part{k - 1}.acc")
    for e, acc in enumerate(accs):
        if acc >= target:
            return before + last * (e + 1) / len(accs)
    return float("nan")


def run_all(cpu: bool, ks: list[int], target_ratio: float, extra: list[str],
            runs: Path) -> list[dict]:
    fmnist = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").exists()
    device = "cpu" if cpu else "auto"
    rows = []
    for model, over in suites(cpu, fmnist).items():
        base = [*over, "optim=adamw", f"trainer.device={device}", "trainer.progress=false",
                "trainer.log_every=1000", *extra]
        none = api.run([*base, "method=none"], out_dir=runs / model / "none")
        target = target_ratio * none["test_acc"]
        rows.append(_row(model, 0, none, none, time_to(none, runs / model / "none",
                                                       target, 0)))
        for k in ks:
            d = runs / model / f"k{k}"
            syn = api.run([*base, "method=synthetic", f"method.partitions={k}"], out_dir=d)
            rows.append(_row(model, k, syn, none, time_to(syn, d, target, k)))
    return rows


def _row(model: str, k: int, r: dict, none: dict, tta: float) -> dict:
    peaks = [r[f"part{j}.mem_peak_alloc_bytes"] for j in range(k)] if k else \
        [r["mem_peak_alloc_bytes"]]
    return {
        "model": model, "dataset": r["dataset"], "method": r["method"], "K": k or "-",
        "part_peaks_mib": " / ".join(f"{p / MIB:.1f}" for p in peaks),
        "max_peak_vs_none": max(peaks) / none["mem_peak_alloc_bytes"],
        "train_s": r["train_time_s"], "time_to_target_s": tta,
        "test_acc": r["test_acc"], "acc_vs_none": r["test_acc"] - none["test_acc"],
        "device": r["device_name"], "peak_source": r["mem_peak_source"],
    }


COLUMNS = ["model", "dataset", "method", "K", "part_peaks_mib", "max_peak_vs_none", "train_s",
           "time_to_target_s", "test_acc", "acc_vs_none"]


def table(rows: list[dict]) -> str:
    """The markdown table of the rows (as measured, or read back from --csv)."""
    return markdown(rows, cols=COLUMNS)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="CPU sizes (default when no CUDA)")
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--target", type=float, default=0.97, help="fraction of none's final acc")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    p.add_argument("--runs", type=Path, default=Path("runs/bench_synthetic"),
                   help="run folders go below this folder")
    p.add_argument("--csv", type=Path, help="write the rows here (CSV, with provenance)")
    p.add_argument("overrides", nargs="*", help="extra memtrain overrides, e.g. trainer.threads=1")
    a = p.parse_args(argv)
    cpu = a.cpu or not torch.cuda.is_available()
    runs = a.runs / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    rows = run_all(cpu, a.k, a.target, a.overrides, runs)
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    device = torch.device("cpu" if cpu else "cuda")
    note = (f"Device: {device_line(device)}\n\n`python -m benchmarks.synthetic {cmd}`\n\n"
            f"target accuracy = {a.target} x none's final test_acc; peaks from "
            f"`{rows[0]['peak_source']}` on {rows[0]['device']}.")
    title = f"method synthetic benchmark ({'CPU' if cpu else 'GPU'})"
    publish(f"# {title}\n\n{note}\n\n{table(rows)}", a.out)
    bench.write_rows([{k: v for k, v in r.items() if k != "device"} for r in rows], a.csv,
                     device, bench.command("benchmarks.synthetic", argv))


if __name__ == "__main__":
    main()
