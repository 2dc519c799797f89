"""A decoder layer's saved activations against Korthikanti et al.'s formula (2022, section 4.1).

The formula counts one layer's saved bytes as s*b*h*(34 + 5*a*s/h) with 2-byte activations and
1-byte dropout masks (CUDA's fused dropout). With d bytes per activation element and m per mask
element it is s*b*h*(16*d + 2*m) + a*s^2*b*(2*d + m); torch's CPU dropout keeps its mask in the
activation dtype (m = d). A layer is measured as (a 4-layer model - a 2-layer model) / 2 saved
bytes (memtrain's `measure.SavedBytes`, once per storage), so embeddings and logits cancel. The
rows go to a CSV beside the Markdown table, which is generated from them.

    python -m memtrain.bench.transformer --out docs/results/transformer_formula_cpu.md
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

import torch

from memtrain import bench, measure
from memtrain.losses import cross_entropy
from memtrain.models.transformer import GPT
from memtrain.record import atomic_write

# (term, attention or MLP, bytes per s*b*h in units of d and m, bytes per a*s^2*b)
TERMS = (
    ("attention LayerNorm input", "attention", (1, 0), (0, 0)),
    ("QKV projection input", "attention", (1, 0), (0, 0)),
    ("Q, K (for QK^T) and V (for attention x V)", "attention", (3, 0), (0, 0)),
    ("softmax output", "attention", (0, 0), (1, 0)),
    ("attention dropout mask", "attention", (0, 0), (0, 1)),
    ("attention dropout output (for x V)", "attention", (0, 0), (1, 0)),
    ("output projection input", "attention", (1, 0), (0, 0)),
    ("residual dropout mask", "attention", (0, 1), (0, 0)),
    ("MLP LayerNorm input", "MLP", (1, 0), (0, 0)),
    ("first linear input", "MLP", (1, 0), (0, 0)),
    ("GELU input (4h)", "MLP", (4, 0), (0, 0)),
    ("second linear input (4h)", "MLP", (4, 0), (0, 0)),
    ("residual dropout mask", "MLP", (0, 1), (0, 0)),
)


def formula(s: int, b: int, h: int, a: int, d: int, m: int, dropout: bool = True) -> int:
    """One layer's saved bytes; without dropout no masks, and the softmax output is the tensor
    attention x V saves (counted once)."""
    if dropout:
        return s * b * h * (16 * d + 2 * m) + a * s * s * b * (2 * d + m)
    return s * b * h * 16 * d + a * s * s * b * d


def layer_bytes(s: int, b: int, h: int, a: int, dropout: float, attention: str,
                dtype: torch.dtype) -> float:
    """(saved bytes of a 4-layer model - of a 2-layer model) / 2, one forward in train mode."""
    out = []
    for layers in (4, 2):
        torch.manual_seed(0)
        model = GPT(256, s, layers, h, a, dropout, attention).to(dtype).train()
        x, y = torch.randint(0, 256, (b, s)), torch.randint(0, 256, (b, s))
        saved = measure.SavedBytes(measure.alive_before_step(model, x, y))
        with saved:
            cross_entropy(model(x), y)
        out.append(saved.bytes)
    return (out[0] - out[1]) / 2


CASES = (  # (s, attention, dropout, dtype)
    (256, "math", 0.1, torch.bfloat16), (128, "math", 0.1, torch.bfloat16),
    (512, "math", 0.1, torch.bfloat16), (256, "math", 0.0, torch.bfloat16),
    (256, "math", 0.1, torch.float32), (128, "sdpa", 0.0, torch.bfloat16),
    (256, "sdpa", 0.0, torch.bfloat16), (512, "sdpa", 0.0, torch.bfloat16),
)


COLS = ["seq_len", "attention", "dropout", "dtype", "measured_bytes", "measured_per_sbh",
        "formula_bytes", "measured_vs_formula"]


def rows(b: int = 2, h: int = 128, a: int = 4) -> list[dict]:
    out = []
    for s, attention, p, dtype in CASES:
        d = torch.finfo(dtype).bits // 8
        got = layer_bytes(s, b, h, a, p, attention, dtype)
        want = formula(s, b, h, a, d, d, p > 0) if attention == "math" else None
        row = {"seq_len": s, "attention": attention, "dropout": p,
               "dtype": str(dtype).removeprefix("torch."), "measured_bytes": int(got),
               "measured_per_sbh": round(got / (s * b * h), 3)}
        if want is not None:  # sdpa keeps no scores: no formula
            row.update(formula_bytes=want, measured_vs_formula=round(got / want, 4))
        out.append(row)
    return out


def terms(s: int = 256, b: int = 2, h: int = 128, a: int = 4, d: int = 2, m: int = 2) -> list:
    return [{"term": t, "block": blk,
             "bytes": (sd * d + sm * m) * s * b * h + (ad * d + am * m) * a * s * s * b}
            for t, blk, (sd, sm), (ad, am) in TERMS]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the Markdown table (its rows as CSV beside it)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    measured = rows()
    parts = terms()
    assert sum(p["bytes"] for p in parts) == formula(256, 2, 128, 4, 2, 2)
    note = (f"{bench.device_line(dev)}; gpt_nano's shape (width "
            "128, 4 heads), batch 2; one layer = (4-layer - 2-layer saved bytes) / 2; formula: "
            "s*b*h*(16d + 2m) + a*s^2*b*(2d + m) with the CPU's masks in the activation dtype "
            "(m = d; CUDA's fused dropout has m = 1: 34 + 5as/h at d = 2); sdpa rows have no "
            "formula (no s x s scores are saved). Command: python -m memtrain.bench.transformer "
            "--out docs/results/transformer_formula_cpu.md")
    text = bench.markdown(measured, cols=COLS,
                          title="A decoder layer's saved bytes against Korthikanti's "
                                "formula (CPU)", note=note)
    text += "\n" + bench.markdown(parts, None, "The formula term by term at s=256, b=2, h=128, "
                                              "a=4, bf16 (d = m = 2 bytes), CPU masks:")
    bench.publish(text, args.out)
    if args.out:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=COLS)
        w.writeheader()
        w.writerows(measured)
        atomic_write(Path(args.out).with_suffix(".csv"), buf.getvalue())


if __name__ == "__main__":
    main()
