"""Benchmark of method=quantize against method=none: saved bytes, activation peak, accuracy.

`saved`: resnet50 and resmlp24 at 224 px, batch 2, fp32 (the acceptance goal: bits=8 <= 0.30x
and bits=2 <= 0.12x on resnet50, bits=2 <= 0.15x on resmlp24): saved-activation bytes of one
training step (`measure.SavedBytes`, per storage; parameters and batch excluded, as every run
counts them) and the tracked activation peaks of that step (`measure.PeakTracker`: activations
alone, and with backward's temporaries, the dequantized copies among them), same weights, batch
and seed as none, in this process.
`accuracy`: test accuracy after the same steps (memtrain runs through `api.run`: the CLI's path)
for mlp6 on Fashion-MNIST (SGD, its recipe's lr 0.01) and resnet18 at 16 px on the synthetic
data (the `quantize_accuracy` experiment's recipe; that preset runs the same study as a sweep,
seeds side by side), none and bits 8/4/2, per seed; the acceptance: bits=4 within 1 point of
none, bits=2 within 3.

    python -m benchmarks.quantize saved --out runs/bench/quantize_saved_cpu.md
    python -m benchmarks.quantize accuracy --seeds 0 1 --out runs/bench/quantize_acc_cpu.md
    python -m benchmarks.quantize saved --csv docs/results/rows/quantize_saved_cpu.csv
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import benchmarks as bench
from memtrain import api, models
from memtrain.memory import measure
from memtrain.methods.none import NoneMethod
from memtrain.methods.quantize import QuantizeMethod

BITS = (8, 4, 2)
MIB = 2**20


def _variants() -> dict:
    return {"none": NoneMethod, **{f"quantize bits={b}": (lambda b=b: QuantizeMethod(bits=b))
                                   for b in BITS}}


def saved_one(model_name: str, size: int, batch: int, variant: str, peak: bool = True) -> dict:
    """Saved bytes and (`peak`) the activation peak of one fp32 CPU training step."""
    torch.manual_seed(0)
    net = getattr(models, model_name)(num_classes=1000, input_shape=(3, size, size))
    net = _variants()[variant]().wrap(net).train()
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 1000, (batch,))
    saved = measure.SavedBytes(measure.alive_before_step(net, x, y))
    row = {"model": model_name, "size": size, "batch": batch, "method": variant}
    if not peak:  # the forward alone: what it saves
        with saved:
            net(x)
        return {**row, "saved_mib": saved.bytes / MIB}
    with measure.PeakTracker(x, y) as tracker:
        with saved:
            loss = F.cross_entropy(net(x), y)
        loss.backward()
    return {**row, "saved_mib": saved.bytes / MIB, "act_peak_mib": tracker.act_peak_bytes / MIB,
            "act_temp_peak_mib": tracker.act_temp_peak_bytes / MIB}


def saved_all(cells: list[tuple[str, int, int]], peak: bool = True) -> list[dict]:
    rows = []
    for cell in cells:
        group = [saved_one(*cell, v, peak) for v in _variants()]
        for r in group:
            r["saved_vs_none"] = r["saved_mib"] / group[0]["saved_mib"]
            if peak:
                r["act_peak_vs_none"] = r["act_peak_mib"] / group[0]["act_peak_mib"]
                r["act_temp_peak_vs_none"] = (r["act_temp_peak_mib"]
                                              / group[0]["act_temp_peak_mib"])
            print(r, flush=True)
        rows += group
    return rows


SUITES = {  # CPU-sized: a shared 2-core machine trains these in minutes
    "mlp6 fashion_mnist": ["model=mlp6", "dataset=fashion_mnist",
                           "trainer.batch_size=128", "trainer.max_steps=200"],
    # conf/experiment/quantize_accuracy.yaml: trained to convergence, accuracy plateau ~68%
    "resnet18 synthetic 16px": ["experiment=quantize_accuracy"],
}


def accuracy_all(seeds: list[int], bits: list[int], runs: Path,
                 extra: list[str]) -> list[dict]:
    rows = []
    for suite, over in SUITES.items():
        variants = {"none": ["method=none"],
                    **{f"quantize bits={b}": ["method=quantize", f"method.bits={b}"]
                       for b in bits}}
        accs: dict[str, list[float]] = {}
        for label, method in variants.items():
            for seed in seeds:
                row = api.run([*over, *method, f"trainer.seed={seed}", "trainer.device=cpu",
                               "trainer.progress=false", "trainer.log_every=10000", *extra],
                              out_dir=runs / suite.replace(" ", "_") / f"{label[-6:]}_{seed}")
                assert row["status"] == "ok", row.get("error")
                accs.setdefault(label, []).append(100 * row["test_acc"])
                print(suite, label, seed, row["test_acc"], row.get("steps"), flush=True)
        for label, a in accs.items():
            rows.append({"suite": suite, "method": label, "seeds": len(a),
                         "test_acc_pct": statistics.mean(a),
                         "per_seed": " / ".join(f"{v:.2f}" for v in a),
                         "vs_none_points": statistics.mean(a) - statistics.mean(accs["none"])})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["saved", "accuracy"])
    p.add_argument("--cells", default="resnet50:224:2,resmlp24:224:2",
                   help="saved: comma list of model:size:batch")
    p.add_argument("--no-peak", action="store_true", help="saved: forward only, no tracker")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--bits", type=int, nargs="+", default=list(BITS), help="accuracy: bit widths")
    p.add_argument("--runs", type=Path, default=Path("runs/bench_quantize"))
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--csv", default=None, help="write the rows here (CSV, with provenance)")
    p.add_argument("overrides", nargs="*", help="accuracy: extra memtrain overrides")
    a = p.parse_args(argv)
    device = torch.device("cpu")
    if a.part == "saved":
        cells = [(m, int(s), int(b)) for m, s, b in (c.split(":") for c in a.cells.split(","))]
        rows = saved_all(cells, not a.no_peak)
        note = (f"Device: {bench.device_line(device)}. One fp32 training step per row, same "
                f"weights, batch and seed; saved bytes per storage (parameters and batch "
                f"excluded)" + ("." if a.no_peak else "; activation peak tracked live "
                                "(MemTracker)."))
        title = "method=quantize vs none: saved activations"
    else:
        runs = a.runs / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        rows = accuracy_all(a.seeds, a.bits, runs, a.overrides)
        note = (f"Device: {bench.device_line(device)}. Test accuracy (%) after the same steps; "
                f"suites: " + "; ".join(f"{k}: `{' '.join(v)}`" for k, v in SUITES.items()))
        title = "method=quantize vs none: accuracy"
    bench.publish(f"# {title}\n\n{note}\n\n{table(rows)}", a.out)
    bench.write_rows(rows, a.csv, device, bench.command("benchmarks.quantize", argv))


def table(rows: list[dict]) -> str:
    """The markdown table of the rows (as measured, or read back from --csv)."""
    return bench.markdown([{k: v for k, v in r.items() if k not in bench.PROVENANCE}
                           for r in rows])


if __name__ == "__main__":
    main()
