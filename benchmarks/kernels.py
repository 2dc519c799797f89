"""Kernel benchmarks: `python -m benchmarks.kernels prune|bitmask [--batch 64] [--out FILE]`
(the command's stable name; the code lives here, with the other benchmarks).

On CUDA, times are `triton.testing.do_bench` medians (ms); on the CPU (no Triton), the fastest of
wall-clock repeats of the torch backend, at small batch sizes only (`bench.kernel_ms`). Every
ratio is against the plain torch operation measured in the same process on the same tensors.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
from memtrain.kernels import bitmask, bsr

import benchmarks as bench
from benchmarks import device_line, kernel_ms, markdown, publish

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}

# ================================================================ prune


def resmlp_s24_shapes(batch: int) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of grad_weight = G^T [N, M] @ A [M, K] for ResMLP-S24's layers at 224 px:
    196 tokens, width 384, hidden 1536."""
    tokens, dim, hidden = 196, 384, 1536
    return {"linear_tokens": (batch * dim, tokens, tokens),
            "fc1": (batch * tokens, dim, hidden),
            "fc2": (batch * tokens, hidden, dim)}


def _torch_bsr_product(bs: bsr.BlockSparse, g: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """torch's own path: the pruned, padded A^T as a sparse BSR tensor, times G (rows padded to
    the block grid); None where torch does not support it for this device and dtype."""
    try:
        padded = bs.to_torch_bsc().to_dense()  # [Mp, Kp], pruned blocks zero
        a_t = padded.t().contiguous().to_sparse_bsr(bs.block)  # [Kp, Mp]
        g_p = torch.nn.functional.pad(g, (0, 0, 0, padded.shape[0] - g.shape[0]))
        fn = lambda: a_t @ g_p  # [Kp, N] = (G^T A)^T
        fn()
        return fn
    except (RuntimeError, NotImplementedError) as e:
        print(f"torch bsr product unavailable: {str(e).splitlines()[0]}")
        return None


def _prune_case(a: torch.Tensor, g: torch.Tensor, b: int, s: float, backend: str,
                dense_ms: float) -> dict:
    """Times of one (matrix, b, s): our grad_weight, torch's BSR product and compression."""
    spec = bsr.PruneSpec(s, b, "l2", backend)
    bs = bsr.compress(a, spec)
    kernel = kernel_ms(lambda: bsr.grad_weight(g, bs, backend), a.device)
    compress = kernel_ms(lambda: bsr.compress(a, spec), a.device)
    sparse_fn = _torch_bsr_product(bs, g)
    torch_bsr = kernel_ms(sparse_fn, a.device) if sparse_fn else float("nan")
    return {"b": b, "s": s, "dense_ms": dense_ms, "kernel_ms": kernel,
            "kernel_x_dense": kernel / dense_ms, "torch_bsr_x_dense": torch_bsr / dense_ms,
            "compress_ms": compress, "compress_x_dense": compress / dense_ms}


def bench_prune(batch: int, dtypes: list[torch.dtype], sparsities: list[float],
                blocks: list[int], device: torch.device) -> list[dict]:
    backend = "triton" if device.type == "cuda" else "torch"
    rows = []
    for layer, (m, k, n) in resmlp_s24_shapes(batch).items():
        for dtype in dtypes:
            gen = torch.Generator(device=device).manual_seed(0)
            a = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
            g = torch.randn(m, n, device=device, dtype=dtype, generator=gen)
            dense = kernel_ms(partial(torch.matmul, g.t(), a), device)
            head = {"layer": layer, "M": m, "K": k, "N": n,
                    "dtype": str(dtype).removeprefix("torch.")}
            rows += [{**head, **_prune_case(a, g, b, s, backend, dense)}
                     for b in blocks for s in sparsities]
    return rows


# ================================================================ bitmask (pool's ReLU masks)


def bench_bitmask(batch: int, dtypes: list[torch.dtype], device: torch.device) -> list[dict]:
    """Packing a ReLU output of ResNet-50's stem (batch x 64 x 112 x 112) into 1-bit masks, and
    ReLU's backward from them, against ReLU's own backward (`torch.where(x > 0, g, 0)`)."""
    rows = []
    for dtype in dtypes:
        x = torch.randn(batch, 64, 112, 112, device=device, dtype=dtype)
        bits = bitmask.pack(x)
        plain = kernel_ms(lambda x=x: torch.where(x > 0, x, 0), device)
        cases = {"pack": lambda x=x: bitmask.pack(x),
                 "masked_grad": lambda x=x, bits=bits: bitmask.masked_grad(x, bits)}
        for name, fn in cases.items():
            ms = kernel_ms(fn, device)
            rows.append({"op": name, "dtype": str(dtype).removeprefix("torch."),
                         "elements": x.numel(), "ms": ms, "relu_backward_ms": plain,
                         "x_relu_backward": ms / plain,
                         "read_GB_s": x.numel() * x.element_size() / ms / 1e6})
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table of the rows (as measured, or read back from --csv)."""
    return markdown([{k: v for k, v in r.items() if k not in bench.PROVENANCE} for r in rows])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("which", choices=["prune", "bitmask"])
    p.add_argument("--batch", type=int, default=None, help="default 64 on CUDA, 2 on the CPU")
    p.add_argument("--dtypes", default=None, help="default bf16,fp32 on CUDA, fp32 on the CPU")
    p.add_argument("--sparsity", default="0.5,0.75,0.9")
    p.add_argument("--blocks", default="16,32,64")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1)")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--csv", default=None, help="write the rows here (CSV, with provenance)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    dtypes = [DTYPES[d] for d in (args.dtypes or ("bf16,fp32" if cuda else "fp32")).split(",")]
    batch = args.batch or (64 if cuda else 2)
    what = "Triton kernel (do_bench median)" if cuda else "torch backend (fastest of 25 runs)"
    if args.which == "bitmask":
        rows = bench_bitmask(batch, dtypes, device)
        note = (f"Device: {device_line(device)}. A batch-{batch} ResNet-50 stem ReLU output; the "
                f"{what} against ReLU's own backward.")
    else:
        rows = bench_prune(batch, dtypes, [float(s) for s in args.sparsity.split(",")],
                           [int(b) for b in args.blocks.split(",")], device)
        note = (f"Device: {device_line(device)}. ResMLP-S24 layer shapes at batch {batch}; "
                f"grad_weight = G^T A_pruned by the {what} against dense torch.matmul(G^T, A) "
                f"and torch's to_sparse_bsr product (pruned A^T as BSR @ G); compress = scoring + "
                f"top-k + compaction. Ratios < 1 are faster than dense.")
    title = f"{args.which} kernels ({device.type})" if args.which == "bitmask" else \
        f"prune kernels: grad_weight and compaction ({device.type})"
    publish(f"# {title}\n\n{note}\n\n{table(rows)}", args.out)
    bench.write_rows(rows, args.csv, device, bench.command("benchmarks.kernels", argv))


if __name__ == "__main__":
    main()
