"""What each rank holds under trainer.strategy=ddp and fsdp, measured on real ranks, beside the
GPU-free estimate of one rank.

For each strategy, one run of `--ranks` ranks (`torchrun --standalone --nproc-per-node N -m
memtrain ...`: gloo on the CPU, nccl on CUDA) on the same global batch, and one process on one
rank's share of it (strategy single, the batch / N): the row's per-rank memory columns (the
highest rank's, `rank_max.`), and the estimate of one rank of the same run in one process on
torch's fake process group (`trainer.estimate=true trainer.max_steps=0`, no ranks). One step's
accounting each (the loop's accounting step, after warm-up): exact on the CPU tracker, but the
peak of a real run depends on when its asynchronous collectives end, so it can differ from run
to run by a unit's gathered parameters and buffers; the estimate replays collectives that end
where they are issued.

    python -m benchmarks.ranks                        # mlp6 at 32 px, global batch 8, 2 ranks
    python -m benchmarks.ranks --csv docs/results/rows/ranks_cpu.csv
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import benchmarks as bench

MB = 1e6


def _run(args: list[str], out: Path, ranks: int = 1) -> dict:
    """One run's row: `python -m memtrain ARGS`, or torchrun of `ranks` ranks."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              f"--nproc-per-node={ranks}"] if ranks > 1 else [sys.executable]
    p = subprocess.run([*launch, "-m", "memtrain", *args, f"hydra.run.dir={out}"], text=True,
                       capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)}: {p.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def measure(base: list[str], ranks: int, batch: int, tmp: Path) -> list[dict]:
    rows = []
    for strategy in ("single", "ddp", "fsdp"):
        args = [*base, f"trainer.batch_size={batch}"]
        if strategy == "single":  # one process on one rank's share of the batch
            args = [*base, f"trainer.batch_size={batch // ranks}"]
            row = _run(args, tmp / strategy)
            est = _run([*args, "trainer.estimate=true", "trainer.max_steps=0"],
                       tmp / f"{strategy}-estimate")
            agg = ""
        else:
            args.append(f"trainer.strategy={strategy}")
            row = _run(args, tmp / strategy, ranks)
            est = _run([*args, "trainer.estimate=true", "trainer.max_steps=0",
                        f"trainer.world_size={ranks}"], tmp / f"{strategy}-estimate")
            agg = "rank_max."
        rows.append({
            "strategy": strategy, "ranks": ranks if strategy != "single" else 1,
            "global batch": batch if strategy != "single" else batch // ranks,
            "local batch": batch // ranks,
            "params MB": round(row[f"{agg}mem_params_bytes"] / MB, 3),
            "grads MB": round(row[f"{agg}mem_grads_bytes"] / MB, 3),
            "optim MB": round(row[f"{agg}mem_optim_bytes"] / MB, 3),
            "comm buffers MB": round(row.get(f"{agg}mem_comm_buffers_bytes", 0) / MB, 3),
            "act peak MB": round(row[f"{agg}mem_peak_act_bytes"] / MB, 3),
            "peak MB": round(row[f"{agg}mem_tracker_peak_bytes"] / MB, 3),
            "peak mean MB": round(row.get("rank_mean.mem_tracker_peak_bytes",
                                          row["mem_tracker_peak_bytes"]) / MB, 3),
            "estimate MB": round(est["mem_estimate_bytes"] / MB, 3),
            "estimate act MB": round(est["mem_estimate_act_bytes"] / MB, 3),
            "status": row["status"],
        })
    return rows


def table(rows: list[dict]) -> str:
    """The rows as the clusters page's table (docs/clusters.md)."""
    head = ["strategy", "ranks", "local batch", "params", "grads", "optimizer state",
            "DDP buckets", "activation peak", "peak per rank (max / mean)",
            "estimate of one rank"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        peak = f"{r['peak MB']:.1f} / {float(r['peak mean MB']):.1f}"
        out.append("| " + " | ".join([
            str(r["strategy"]), str(r["ranks"]), str(r["local batch"]),
            *(f"{float(r[k]):.1f} MB" for k in ("params MB", "grads MB", "optim MB",
                                                "comm buffers MB", "act peak MB")),
            f"{peak} MB", f"{float(r['estimate MB']):.1f} MB"]) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ranks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mlp6")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8, help="the global batch")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--csv", help="write the table's rows to this CSV (docs/results/rows/)")
    args = ap.parse_args(argv)
    base = [f"model={args.model}", "trainer=smoke", f"dataset.image_size={args.image_size}",
            f"trainer.device={args.device}", "trainer.threads=1"]
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(base, args.ranks, args.batch_size, Path(tmp))
    print(table(rows), end="")
    bench.write_rows(rows, args.csv, bench.device(args.device),
                     bench.command("benchmarks.ranks", argv))
    return rows


if __name__ == "__main__":
    main()
