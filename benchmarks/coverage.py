"""Coverage: every method on architectures memtrain has never seen, by name (a study, not a test).

    python -m benchmarks.coverage --csv runs/coverage/rows.csv --out runs/coverage/table.md
    python -m benchmarks.coverage --only convnext_atto,llama --methods none,checkpoint
    python -m benchmarks.coverage --methods pool --csv runs/coverage/rows.csv --append
    python -m benchmarks.coverage --table runs/coverage/rows.csv     # the table from the rows

For each architecture (`ARCHS`: timm families, torchvision's classics, transformers' causal LM
types) and each method at its defaults (conf/method: none, checkpoint, checkpoint+quantize,
offload, pool, prune, quantize, synthetic) plus checkpoint's `native` strategy, one run of two
training steps through `memtrain.api.run`, and a row: `ok` (the activation peak
`mem_peak_act_bytes` and saved bytes against none's on the same architecture), `refused` (the
ConfigError's line) or `failed` (the error's last line). The table is families x methods.

Sizes: images at 64 px (an architecture that needs its own size gets it in `ARCHS`), 10
classes; language models 2 layers of width 64, 16 tokens over a 64-token vocabulary; batch 2,
8 training and 4 test samples, 2 steps, one thread. Budget: about 5-10 s of wall clock per
run on one CPU core (the estimate, the plan's profile and two steps), so the full sweep (about
60 architectures x 9 methods) takes 45-90 minutes on the 2-core development machine; `--only`
and `--methods` take a slice.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

import benchmarks as bench
from memtrain import api
from memtrain.errors import ConfigError

IMAGES = ["dataset=synthetic", "dataset.train_size=8", "dataset.test_size=4"]
TOKENS = ["dataset=tokens", "dataset.seq_len=16", "dataset.vocab_size=64",
          "dataset.train_size=8", "dataset.test_size=4"]
STEPS = ["trainer=smoke", "trainer.batch_size=2", "trainer.max_steps=2",
         "trainer.warmup_steps=1", "trainer.eval_max_batches=1", "trainer.device=cpu",
         "trainer.threads=1"]
METHODS = {"none": ["method=none"], "checkpoint": ["method=checkpoint"],
           "native": ["method=checkpoint", "method.strategy=native"],
           "checkpoint+quantize": ["method=checkpoint+quantize"], "quantize": ["method=quantize"],
           "pool": ["method=pool"], "prune": ["method=prune"], "offload": ["method=offload"],
           "synthetic": ["method=synthetic"]}


def _timm(name: str, family: str, size: int = 64, *kwargs: str) -> tuple[str, str, list[str]]:
    return name, f"timm {family}", ["model=timm", f"model.name={name}", *IMAGES,
                                    f"dataset.image_size={size}", *kwargs]


def _tv(name: str, size: int = 64) -> tuple[str, str, list[str]]:
    return f"tv:{name}", "torchvision", ["model=torchvision", f"model.name={name}", *IMAGES,
                                         f"dataset.image_size={size}"]


def _hf(name: str) -> tuple[str, str, list[str]]:
    return f"hf:{name}", "transformers", ["model=hf", f"model.name={name}",
                                  "model.config.hidden_size=64",
                                  "model.config.num_hidden_layers=2", *TOKENS]


# (label, family, overrides): one or more architectures per family, each at a size it accepts;
# torchvision's labelled tv:<name>, transformers' hf:<type> (timm has names of the same)
ARCHS = [
    _timm("resnet18", "ResNet"), _timm("resnet10t", "ResNet"), _timm("resnext26ts", "ResNeXt"),
    _timm("regnetx_002", "RegNet"), _timm("regnety_002", "RegNet"),
    _timm("densenet121", "DenseNet"), _timm("efficientnet_b0", "EfficientNet"),
    _timm("tf_efficientnet_b0", "EfficientNet"), _timm("efficientnet_cc_b0_4e", "EfficientNet"),
    _timm("mobilenetv3_small_100", "MobileNetV3"),
    _timm("mobilenetv3_large_100", "MobileNetV3"), _timm("convnext_atto", "ConvNeXt"),
    _timm("convnextv2_atto", "ConvNeXt"), _timm("vit_tiny_patch16_224", "ViT"),
    _timm("deit_tiny_patch16_224", "DeiT"),
    _timm("swin_tiny_patch4_window7_224", "Swin", 64, "+model.kwargs.window_size=2"),
    _timm("maxvit_nano_rw_256", "MaxViT", 64), _timm("coatnet_nano_rw_224", "CoAtNet", 64),
    _timm("mixer_s16_224", "MLP-Mixer"), _timm("resmlp_12_224", "ResMLP"),
    _timm("poolformer_s12", "PoolFormer"), _timm("efficientformer_l1", "EfficientFormer", 224),
    _timm("levit_128s", "LeViT", 224), _timm("ghostnet_100", "GhostNet"),
    _timm("rexnet_100", "ReXNet"), _timm("dla34", "DLA"), _timm("cspresnet50", "CSPNet"),
    _timm("mnasnet_100", "MnasNet"), _timm("tinynet_e", "TinyNet"),
    _timm("fastvit_t8", "FastViT"), _timm("edgenext_xx_small", "EdgeNeXt"),
    _timm("mobilevit_xxs", "MobileViT"), _timm("repvit_m1", "RepViT"),
    _timm("ese_vovnet19b_dw", "VoVNet"), _timm("res2net50_14w_8s", "Res2Net"),
    _timm("resnest14d", "ResNeSt"), _timm("skresnet18", "SKNet"),
    _timm("nf_resnet26", "NFNet"), _timm("vgg11", "VGG"), _timm("pit_ti_224", "PiT"),
    _timm("cait_xxs24_224", "CaiT"), _timm("hrnet_w18_small", "HRNet"),
    _timm("dpn68", "DPN"), _timm("xcit_nano_12_p16_224", "XCiT"),
    _timm("convmixer_768_32", "ConvMixer"), _timm("inception_v3", "Inception", 96),
    _tv("resnet18"), _tv("mobilenet_v3_small"), _tv("efficientnet_b0"), _tv("vgg11"),
    _tv("densenet121"), _tv("squeezenet1_0"), _tv("shufflenet_v2_x0_5"), _tv("mnasnet0_5"),
    _tv("regnet_x_400mf"), _tv("convnext_tiny"), _tv("vit_b_16"), _tv("swin_t"),
    _hf("llama"), _hf("gpt2"), _hf("opt"), _hf("mistral"), _hf("qwen2"), _hf("gpt_neox"),
    _hf("phi"), _hf("gemma"),
]


def one(arch: str, family: str, overrides: list[str], method: str, out: Path) -> dict:
    """One run's row: ok (its memory columns), refused (the line) or failed (the last line)."""
    row = {"arch": arch, "family": family, "method": method}
    t0 = time.perf_counter()
    try:
        got = api.run([*METHODS[method], *overrides, *STEPS],
                      out_dir=out / f"{arch.replace(':', '_')}_{method}")
    except ConfigError as e:
        row.update(status="refused", reason=str(e).splitlines()[0])
    except Exception as e:  # a crash is a row, not the end of the sweep
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        row.update(status="failed", reason=last[:300])
    else:
        if got.get("status") == "ok":
            row.update(status="ok", **{k: got.get(k) for k in (
                "mem_peak_act_bytes", "mem_act_saved_bytes", "plan_segments", "params")})
        else:
            err = str(got.get("error") or got.get("status"))
            kind = "refused" if "ConfigError" in err else "failed"
            row.update(status=kind, reason=err.splitlines()[0][:300])
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def table(rows: Sequence[dict], methods: Sequence[str]) -> str:
    """Architectures x methods: `ok` with the activation peak against none's, `refused`,
    `FAILED`; then every refusal's and failure's line."""
    none = {r["arch"]: r.get("mem_peak_act_bytes") for r in rows
            if r["method"] == "none" and r["status"] == "ok"}
    order = {a: i for i, (a, _, _) in enumerate(ARCHS)}  # rows appended later find their place
    archs = sorted(dict.fromkeys(r["arch"] for r in rows), key=lambda a: order.get(a, len(order)))
    by = {(r["arch"], r["method"]): r for r in rows}
    lines = ["| family | architecture | " + " | ".join(methods) + " |",
             "| --- | --- | " + " | ".join("---" for _ in methods) + " |"]
    notes: dict[tuple[str, str, str], list[str]] = {}  # one line per method, status and reason
    for a in archs:
        fam = next(r["family"] for r in rows if r["arch"] == a)
        cells = []
        for m in methods:
            r = by.get((a, m))
            if r is None:
                cells.append("")
            elif r["status"] == "ok":
                base, peak = none.get(a), r.get("mem_peak_act_bytes")
                cells.append(f"ok {peak / base:.2f}" if base and peak is not None and m != "none"
                             else "ok")
            else:
                cells.append("refused" if r["status"] == "refused" else "FAILED")
                notes.setdefault((m, r["status"], r.get("reason", "")), []).append(a)
        lines.append(f"| {fam} | {a} | " + " | ".join(cells) + " |")
    counts = {m: sum(by.get((a, m), {}).get("status") == "ok" for a in archs) for m in methods}
    lines.append("")
    lines.append("ok per method: " + ", ".join(f"{m} {c}/{len(archs)}" for m, c in counts.items()))
    lines.append("")
    lines.append("`ok x`: the run's activation peak (`mem_peak_act_bytes`) / none's on the same "
                 "architecture.")
    def where(on: list[str]) -> str:
        return "every architecture" if len(on) == len(archs) > 1 else ", ".join(on)

    said = [f"- {where(on)} / {m}: {status}: {reason}"
            for (m, status, reason), on in notes.items()]
    return "\n".join(lines + ([""] + said if said else []))


def page(rows: Sequence[dict], csv_name: str, methods: Sequence[str] | None = None) -> str:
    """docs/results/coverage_cpu.md: the provenance of the rows (each run that made them) and
    the table over `methods` (None: those the rows hold, in METHODS' order)."""
    def uniq(key: str) -> str:  # rows made by several runs (--append) name each
        return ", ".join(dict.fromkeys(str(r.get(key)) for r in rows))

    if methods is None:
        methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    made = " and ".join(f"`{c}`" for c in dict.fromkeys(str(r.get("command")) for r in rows))
    head = ("# Coverage: methods on architectures by name\n\nGenerated by `python -m "
            f"benchmarks.coverage --table` from [its rows](rows/{csv_name}): "
            f"{uniq('device')}; torch {uniq('torch')}; git {uniq('git_commit')}; "
            f"{uniq('date')}; made by {made}. Two training steps per run at "
            "the sizes the module's docstring states; `checkpoint` is its defaults (the "
            "budget planner at half of none's modelled activation peak), `native` the "
            "model's own checkpointing.")
    return f"{head}\n\n{table(rows, methods)}\n"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated architectures (default: every one)")
    ap.add_argument("--methods", help="comma-separated methods (default: every one; with "
                    "--table, those the rows hold)")
    ap.add_argument("--csv", help="write the rows here (CSV)")
    ap.add_argument("--append", action="store_true",
                    help="add the rows to those --csv holds (a slice of methods run later; "
                    "rows of an architecture and method measured again replace the old)")
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--table", help="only make the table from rows written before (CSV)")
    args = ap.parse_args(argv)
    methods = [m for m in (args.methods or ",".join(METHODS)).split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown method {unknown[0]}; choose from {', '.join(METHODS)}")
    if args.table:
        bench.publish(page(bench.read_rows(args.table), Path(args.table).name,
                           methods if args.methods else None), args.out)
        return
    torch.set_num_threads(1)
    only = set(args.only.split(",")) if args.only else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:  # each run's folder: its label and method
        for arch, family, overrides in ARCHS:
            if only is not None and arch not in only and arch.split(":")[-1] not in only:
                continue
            for m in methods:
                rows.append(one(arch, family, overrides, m, Path(tmp)))
                r = rows[-1]
                print(f"{arch:32s} {m:20s} {r['status']:8s} {r['wall_s']:6.1f}s "
                      f"{r.get('reason', '')[:100]}", flush=True)
    device = torch.device("cpu")
    cmd = "python -m benchmarks.coverage" + (f" --only {args.only}" if args.only else "") + \
        f" --methods {','.join(methods)}"
    bench.write_rows(rows, args.csv, device, cmd, append=args.append,
                     key=lambda r: (r["arch"], r["method"]))
    bench.publish(f"Coverage ({bench.device_line(device)})\n\n{table(rows, methods)}", args.out)


if __name__ == "__main__":
    main()
