"""End-to-end benchmark of method=prune: ResMLP-S24 at 224 px, prune at several sparsities against
none, in one process, through the same `api.run` as the CLI (so the same measurement protocol).

    python -m benchmarks.prune                      # CUDA: batch 64, bf16, 30 steps
    python -m benchmarks.prune --out runs/bench/prune_e2e_cpu.md     # CPU: batch 2, 4 steps
    python -m benchmarks.prune --csv docs/results/rows/prune_e2e_cpu.csv   # the rows, as CSV

Columns: peak memory (CUDA max_memory_allocated over the timed steps, or on the CPU the
live-tensor tracker's peak), saved-activation bytes, the activation peak with and without
backward's temporaries (the tracker's), throughput, each also as a ratio to none.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import benchmarks as bench
from benchmarks import device_line, markdown, publish
from memtrain import api

MIB = 2**20


def run_all(batch: int, steps: int, warmup: int, precision: str, sparsities: list[float],
            block: int, out_dir: Path) -> list[dict]:
    common = ["model=resmlp24", "dataset=synthetic", "dataset.image_size=224",
              f"dataset.train_size={batch * (steps + 1)}", f"dataset.test_size={batch}",
              f"trainer.batch_size={batch}", f"trainer.max_steps={steps}",
              f"trainer.warmup_steps={warmup}", f"trainer.precision={precision}",
              "trainer.eval_max_batches=1", "trainer.progress=false", "optim=adamw"]
    configs = [("none", ["method=none"])] + [
        (f"prune s={s} b={block}", ["method=prune", f"method.sparsity={s}",
                                    f"method.block_size={block}"]) for s in sparsities]
    rows = []
    for i, (label, over) in enumerate(configs):
        r = api.run(common + over, out_dir=out_dir / str(i))
        if r["status"] != "ok":
            raise SystemExit(f"{label}: status={r['status']} {r.get('error', '')}")
        rows.append({"config": label, "peak_MiB": r["mem_peak_alloc_bytes"] / MIB,
                     "act_saved_MiB": r["mem_act_saved_bytes"] / MIB,
                     "act_peak_MiB": r["mem_peak_act_bytes"] / MIB,
                     "act_temp_peak_MiB": r["mem_peak_act_temp_bytes"] / MIB,
                     "samples_s": r["throughput_samples_s"], "source": r["mem_peak_source"]})
    base = rows[0]
    for row in rows:
        row["peak_x_none"] = row["peak_MiB"] / base["peak_MiB"]
        row["act_saved_x_none"] = row["act_saved_MiB"] / base["act_saved_MiB"]
        row["act_peak_x_none"] = row["act_peak_MiB"] / base["act_peak_MiB"]
        row["act_temp_peak_x_none"] = row["act_temp_peak_MiB"] / base["act_temp_peak_MiB"]
        row["throughput_x_none"] = row["samples_s"] / base["samples_s"]
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table of the rows (as measured, or read back from --csv)."""
    return markdown([{k: v for k, v in r.items() if k not in bench.PROVENANCE} for r in rows])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="method=prune end to end: resmlp24, prune vs none")
    p.add_argument("--batch", type=int, default=None, help="default 64 on CUDA, 2 on the CPU")
    p.add_argument("--steps", type=int, default=None, help="default 30 on CUDA, 4 on the CPU")
    p.add_argument("--precision", default=None, help="default bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--sparsity", default="0.5,0.75,0.9")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--csv", default=None, help="write the rows here (CSV, with provenance)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    batch = args.batch or (64 if cuda else 2)
    steps = args.steps or (30 if cuda else 4)
    precision = args.precision or ("bf16" if cuda else "fp32")
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_all(batch, steps, max(1, min(5, steps // 3)), precision,
                       [float(s) for s in args.sparsity.split(",")], args.block, Path(tmp))
    device = torch.device("cuda" if cuda else "cpu")
    note = (f"Device: {device_line(device)}. resmlp24, synthetic 3x224x224, batch {batch}, "
            f"{precision}, {steps} steps (warm-up excluded), AdamW; one process, same protocol "
            f"as `memtrain` (peak source: {rows[0]['source']}).")
    publish(f"# prune end to end: resmlp24 ({device.type})\n\n{note}\n\n{table(rows)}", args.out)
    bench.write_rows(rows, args.csv, device, bench.command("benchmarks.prune", argv))


if __name__ == "__main__":
    main()
