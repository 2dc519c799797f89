"""The runner's own overhead: memtrain's training loop against a plain hand-written PyTorch loop.

Both loops train the same model (same initial weights) on the same batches (made once, up
front, on the device) with the same optimizer settings; each step is timed the same way
(synchronise, host clock, synchronise). The two loops alternate for several rounds so that drift
of the machine hits both alike; the figure is the ratio of median step times (goal <= 1.03).

    python -m benchmarks.overhead --model resnet18 --batch-size 64 --image-size 32
    python -m benchmarks.overhead --out docs/results/overhead_cpu.md
    python -m benchmarks.overhead --model mlp6 --csv docs/results/rows/overhead_cpu.csv
(--csv appends this invocation's row, with its provenance, to the CSV's rows)
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import statistics

import torch
import torch.nn.functional as F

import benchmarks as bench
from memtrain import api
from memtrain.config.schema import Trainer
from memtrain.data import Data, Split
from memtrain.optim import build_optimizer, build_scheduler
from memtrain.run.train import train


class FixedBatches(Split):
    """Pre-made batches, handed out in order: both loops see identical inputs."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]):
        self._batches = batches

    def __len__(self) -> int:
        return sum(y.shape[0] for _, y in self._batches)

    def batches(self, batch_size, device, shuffle=False, generator=None, drop_last=False):
        yield from self._batches


def plain_loop(model, batches, device, lr: float) -> list[float]:
    """What a researcher writes by hand: forward, loss, backward, step; timed per step."""
    opt = build_optimizer(model, lr=lr)
    sched = build_scheduler(opt, len(batches))
    model.train()
    it = iter(batches)

    def step():
        x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    return bench.timings(step, device, len(batches))


def memtrain_loop(model, batches, device, lr: float, batch_size: int, warmup: int) -> float:
    """memtrain's loop on the same batches: its median step time after `warmup` steps."""
    data = Data(FixedBatches(batches), FixedBatches(batches[:1]), 0, tuple(batches[0][0].shape[1:]))
    opt = build_optimizer(model, lr=lr)
    sched = build_scheduler(opt, len(batches))
    # no accounting step: every step after the warm-up is timed, as in the plain loop
    t = Trainer(batch_size=batch_size, epochs=1, max_steps=len(batches), warmup_steps=warmup,
                account_memory=False, progress=False, eval_max_batches=0, log_every=10)
    return train(model, data, opt, sched, trainer=t, device=device).summary["step_time_s_median"]


COLUMNS = {"model": "model", "image_size": "px", "batch_size": "batch",
           "plain_ms": "plain loop ms/step", "memtrain_ms": "memtrain ms/step",
           "ratio": "memtrain / plain", "rounds": "rounds", "steps": "timed steps per round",
           "threads": "torch threads"}


def table(rows: list[dict]) -> str:
    """The markdown table of result rows (as measured, or read back from --csv)."""
    shown = [{COLUMNS[k]: (f"{r[k]:.2f}" if k.endswith("_ms") else r[k]) for k in COLUMNS}
             for r in rows]
    return bench.markdown(shown)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per loop and round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before each loop")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", help="append a markdown table row set to this file")
    ap.add_argument("--csv", help="append this run's row to this CSV (with its provenance)")
    args = ap.parse_args(argv)

    device = bench.device(args.device)
    data, model, _ = api.build([f"model={args.model}", f"dataset.image_size={args.image_size}",
                                f"trainer.batch_size={args.batch_size}"])
    model.to(device)
    init = copy.deepcopy(model.state_dict())
    n = args.warmup + args.steps
    batches = list(data.train.batches(args.batch_size, device, drop_last=True))
    while len(batches) < n:
        batches += batches
    batches = batches[:n]
    lr = 0.01
    medians = {"plain": [], "memtrain": []}
    for _ in range(args.rounds):
        for name in ("plain", "memtrain"):
            model.load_state_dict(init)
            if name == "plain":
                t = plain_loop(model, batches, device, lr)
                medians[name].append(statistics.median(t[args.warmup:]))
            else:
                medians[name].append(memtrain_loop(model, batches, device, lr, args.batch_size,
                                                   args.warmup))
    plain = statistics.median(medians["plain"])
    mt = statistics.median(medians["memtrain"])
    result = {
        "device": bench.device_name(device), "model": args.model,
        "image_size": args.image_size, "batch_size": args.batch_size,
        "plain_step_s": plain, "memtrain_step_s": mt, "ratio": mt / plain,
        "plain_ms": plain * 1e3, "memtrain_ms": mt * 1e3,
        "rounds": args.rounds, "steps": args.steps, "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(f"device {result['device']} model {args.model} {args.image_size}px "
          f"batch {args.batch_size}: plain {plain * 1e3:.2f} ms/step, memtrain {mt * 1e3:.2f} "
          f"ms/step, ratio {mt / plain:.3f} (goal <= 1.03)")
    print("per round medians (ms):", {k: [round(v * 1e3, 2) for v in vs]
                                       for k, vs in medians.items()})
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(f"| {dt.date.today()} | {result['device']} | {args.model} | "
                    f"{args.image_size} | {args.batch_size} | {plain * 1e3:.2f} | "
                    f"{mt * 1e3:.2f} | {mt / plain:.3f} | {torch.__version__} |\n")
    bench.write_rows([{k: result[k] for k in COLUMNS}], args.csv, device,
                     bench.command("benchmarks.overhead", argv), append=True)
    return result


if __name__ == "__main__":
    main()
