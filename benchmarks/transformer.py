"""A decoder layer's saved activations against Korthikanti et al.'s formula (2022, section 4.1).

The formula counts one layer's saved bytes as s*b*h*(34 + 5*a*s/h) with 2-byte activations and
1-byte dropout masks (CUDA's fused dropout). With d bytes per activation element and m per mask
element it is s*b*h*(16*d + 2*m) + a*s^2*b*(2*d + m); torch's CPU dropout keeps its mask in the
activation dtype (m = d). A layer is measured as (a 4-layer model - a 2-layer model) / 2 saved
bytes (memtrain's `measure.SavedBytes`, once per storage), so embeddings and logits cancel; one
layer alone is also measured term by term (`measured_terms`: each tensor its autograd node
saves, named by the formula's term). The rows go to CSVs under docs/results/rows/, from which
`make results-docs` renders docs/results/transformer_formula_cpu.md.

    python -m benchmarks.transformer
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

import torch

from memtrain.losses import cross_entropy
from memtrain.memory import measure
from memtrain.models.transformer import GPT, DecoderLayer
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
    ("attention residual dropout mask", "attention", (0, 1), (0, 0)),
    ("MLP LayerNorm input", "MLP", (1, 0), (0, 0)),
    ("first linear input", "MLP", (1, 0), (0, 0)),
    ("GELU input (4h)", "MLP", (4, 0), (0, 0)),
    ("second linear input (4h)", "MLP", (4, 0), (0, 0)),
    ("MLP residual dropout mask", "MLP", (0, 1), (0, 0)),
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


# (autograd node, saved attribute) -> the TERMS each occurrence in a layer's forward order is;
# the dropout masks: the CPU's `input * mask` (MulBackward0) or CUDA's fused NativeDropout
_MASKS = ("attention dropout mask", "attention residual dropout mask",
          "MLP residual dropout mask")
TERM_OF = {
    ("NativeLayerNormBackward0", "_saved_input"): ("attention LayerNorm input",
                                                   "MLP LayerNorm input"),
    ("AddmmBackward0", "_saved_mat1"): ("QKV projection input", "output projection input",
                                        "first linear input", "second linear input (4h)"),
    ("BmmBackward0", "_saved_self"): ("Q, K (for QK^T) and V (for attention x V)",
                                      "attention dropout output (for x V)"),
    ("BmmBackward0", "_saved_mat2"): ("Q, K (for QK^T) and V (for attention x V)",) * 2,
    ("SoftmaxBackward0", "_saved_result"): ("softmax output",),
    ("GeluBackward0", "_saved_self"): ("GELU input (4h)",),
    ("MulBackward0", "_saved_other"): _MASKS,
    ("NativeDropoutBackward0", "_saved_result1"): _MASKS,
}
BEYOND = "LayerNorm mean and rstd (not in the formula)"


def measured_terms(s: int = 256, b: int = 2, h: int = 128, a: int = 4, dropout: float = 0.1,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """One decoder layer's saved bytes by Korthikanti's term: the layer alone, on an input made
    inside the step (so its LayerNorm saves it, as the next layer's would), its autograd graph
    walked for every saved tensor (`_saved_*`), each storage once, owned by the earliest node
    in forward order that saves it, parameters and buffers left out; each (node, attribute)
    occurrence named by `TERM_OF`, LayerNorm's statistics apart (`BEYOND`)."""
    torch.manual_seed(0)
    layer = DecoderLayer(h, a, s, dropout, "math").to(dtype).train()
    x0 = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    alive = {measure.storage_key(t) for t in measure.alive_before_step(layer, x0)}
    out = layer(x0 * 1)
    owner: dict = {}
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(f for f, _ in node.next_functions)
        for attr in (a for a in dir(node) if a.startswith("_saved_")):
            t = getattr(node, attr)
            if not isinstance(t, torch.Tensor) or t.dim() == 0:  # a wrapped Python scalar
                continue
            k = measure.storage_key(t)
            if k not in alive and (k not in owner or owner[k][0] > node._sequence_nr()):
                owner[k] = (node._sequence_nr(), node.name(), attr,
                            t.untyped_storage().nbytes())
    counts: dict = {}
    got: dict[str, int] = {}
    for _, name, attr, nbytes in sorted(owner.values()):
        if name == "NativeLayerNormBackward0" and attr != "_saved_input":
            term = BEYOND
        else:
            k = counts[name, attr] = counts.get((name, attr), -1) + 1
            term = TERM_OF[name, attr][k]
        got[term] = got.get(term, 0) + nbytes
    return got


def term_rows(s: int = 256, b: int = 2, h: int = 128, a: int = 4) -> list[dict]:
    """Per term of the formula, one bf16 layer with dropout 0.1: the bytes measured on the CPU
    (`measured_terms`), the formula's with the CPU's 2-byte masks, and with CUDA's 1-byte
    masks (what the same layer saves on a GPU); LayerNorm's statistics last."""
    got = measured_terms(s, b, h, a)
    cpu, cuda = terms(s, b, h, a, 2, 2), terms(s, b, h, a, 2, 1)
    rows = [{"term": c["term"], "block": c["block"], "measured_bytes": got.get(c["term"], 0),
             "formula_cpu_bytes": c["bytes"], "formula_cuda_bytes": g["bytes"]}
            for c, g in zip(cpu, cuda, strict=True)]
    rows.append({"term": BEYOND, "block": "both", "measured_bytes": got.get(BEYOND, 0),
                 "formula_cpu_bytes": 0, "formula_cuda_bytes": 0})
    rows.append({"term": "total", "block": "", **{k: sum(r[k] for r in rows) for k in
                 ("measured_bytes", "formula_cpu_bytes", "formula_cuda_bytes")}})
    return rows


ROWS = Path("docs/results/rows")


def _write(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=Path, default=ROWS,
                    help="where the CSVs go (transformer_formula_cpu.csv, "
                         "transformer_formula_terms_cpu.csv); `make results-docs` renders them")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    measured = rows()
    parts = term_rows()
    assert parts[-1]["formula_cpu_bytes"] == formula(256, 2, 128, 4, 2, 2)
    _write(args.rows / "transformer_formula_cpu.csv", measured)
    _write(args.rows / "transformer_formula_terms_cpu.csv", parts)


if __name__ == "__main__":
    main()
