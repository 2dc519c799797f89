"""The wall time of one `memtrain-willfit` call (memtrain/willfit.py): every method's estimate,
its largest batch verified, the answer, for a model, a batch and a card.

    python -m benchmarks.willfit model=resnet50 dataset.image_size=224 trainer.batch_size=256 \\
        card=rtx4090 settings=defaults --csv docs/results/rows/willfit_cpu.csv --append
    python -m benchmarks.willfit model=gpt2_small dataset.seq_len=1024 trainer.batch_size=8 \\
        card=rtx4090 settings=defaults --csv docs/results/rows/willfit_cpu.csv --append

The arguments other than --csv and --append are the command's own.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import benchmarks as bench


def measure(args: list[str]) -> dict:
    """One call of the command, timed; its card, settings and answer."""
    from memtrain import willfit

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        found = willfit.will_fit(args, out_dir=tmp)
        wall = time.perf_counter() - t0
    card = found.card
    ok = [r for r in found.rows if r["status"] == "ok"]
    return {"model": card["model"], "batch": card["batch_size"],
            "card_gib": card["gpu_memory_gb"], "precision": card["precision"],
            "settings": len(found.rows), "estimated": len(ok),
            "estimates": sum(r["estimates"] for r in ok),
            "verified": sum(bool(r.get("max_batch_verified")) for r in ok),
            "answer": found.answer, "wall_s": round(wall, 1),
            "args": " ".join(args)}


def table(rows: list[dict]) -> str:
    """The rows as docs/willfit.md's table."""
    head = ["model", "batch", "card (GiB)", "settings (estimated)", "full estimates",
            "largest batch verified", "wall time (s)", "answer"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        out.append(f"| {r['model']} | {r['batch']} | {r['card_gib']:g} | {r['settings']} "
                   f"({r['estimated']}) | {r['estimates']} | {r['verified']} of {r['estimated']} | "
                   f"{r['wall_s']:.0f} | {r['answer']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.willfit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", help="write the row to this CSV (docs/results/rows/)")
    ap.add_argument("--append", action="store_true", help="add the row to the CSV's rows")
    args, rest = ap.parse_known_args(argv)
    torch.set_num_threads(1)
    rows = [measure(rest)]
    print(table(rows), end="")
    bench.write_rows(rows, args.csv, torch.device("cpu"),
                     bench.command("benchmarks.willfit", argv), append=args.append)
    return rows


if __name__ == "__main__":
    main()
