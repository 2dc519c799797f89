"""Compile every Triton kernel ahead of time for NVIDIA targets, without a GPU.

`python -m memtrain.kernels.aot` lowers each kernel (the dtypes and constexprs memtrain launches)
through Triton's whole pipeline to a cubin for sm_80 (A100) and sm_90 (H100) with the ptxas that
ships in the Triton wheel, and prints the sizes. It catches what the interpreter cannot: a
construct compiled Triton of the installed version rejects. It must run with TRITON_INTERPRET
unset (the interpreter replaces `triton.jit` functions), so the test runs it in a subprocess.
"""

from __future__ import annotations

import os
import sys

ARCHS = (80, 90)


def _prune_specs(prune) -> list:
    specs = []
    for dt in ("fp32", "bf16", "fp16"):
        specs.append((prune._block_score_kernel,
                      {"a_ptr": f"*{dt}", "score_ptr": "*fp32", "M": "i32", "K": "i32",
                       "stride_am": "i32", "stride_ak": "i32", "n_col_blocks": "i32",
                       "B": "constexpr", "L1": "constexpr"}, {"B": 32, "L1": False}))
        specs.append((prune._block_compact_kernel,
                      {"a_ptr": f"*{dt}", "rows_ptr": "*i32", "cols_ptr": "*i32",
                       "val_ptr": f"*{dt}", "M": "i32", "K": "i32", "stride_am": "i32",
                       "stride_ak": "i32", "B": "constexpr"}, {"B": 32}))
        for split, out in ((1, dt), (4, "fp32")):
            sig = {"g_ptr": f"*{dt}", "val_ptr": f"*{dt}", "rows_ptr": "*i32",
                   "colptr_ptr": "*i32", "w_ptr": f"*{out}", "M": "i32", "N": "i32", "K": "i32",
                   "stride_gm": "i32", "stride_gn": "i32", "stride_ws": "i32",
                   "stride_wn": "i32", "stride_wk": "i32", "SPLIT": "constexpr",
                   "B": "constexpr", "BLOCK_N": "constexpr", "IEEE": "constexpr",
                   "UPCAST": "constexpr"}
            specs.append((prune._bsr_grad_weight_kernel, sig,
                          {"SPLIT": split, "B": 32, "BLOCK_N": 64, "IEEE": dt == "fp32",
                           "UPCAST": False}))
    return specs


def _bitmask_specs(bitmask) -> list:
    pack, masked = bitmask._kernels()
    specs = []
    for dt in ("fp32", "bf16", "fp16"):
        specs.append((pack, {"x_ptr": f"*{dt}", "bits_ptr": "*u8", "n": "i32", "n_bytes": "i32",
                             "BLOCK": "constexpr"}, {"BLOCK": bitmask.BLOCK_BYTES}))
        specs.append((masked, {"grad_ptr": f"*{dt}", "bits_ptr": "*u8", "out_ptr": f"*{dt}",
                               "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": bitmask.BLOCK_ELEMS}))
    return specs


def _quant_specs(quant) -> list:
    """Every dtype at 2 bits with tl.rand's noise and per-channel scaling (the training path),
    every bit width in fp32 with nearest rounding and no channels (NOISE=1, noise from a pointer,
    serves the interpreted tests only)."""
    qk, dk = quant._kernels()
    cells = [(dt, 2, 2, 1) for dt in ("fp32", "bf16", "fp16")] + \
        [("fp32", b, 0, 0) for b in (4, 8)]
    specs = []
    for dt, bits, noise, chan in cells:
        specs.append((qk, {"x_ptr": f"*{dt}", "codes_ptr": "*u8", "mn_ptr": "*fp32",
                           "scale_ptr": "*fp32", "noise_ptr": "*fp32", "cmin_ptr": "*fp32",
                           "cinv_ptr": "*fp32", "n": "i32", "seed": "i32", "inner": "i32",
                           "C": "i32", "G": "constexpr", "BITS": "constexpr",
                           "NOISE": "constexpr", "CHAN": "constexpr"},
                      {"G": 256, "BITS": bits, "NOISE": noise, "CHAN": chan}))
        specs.append((dk, {"codes_ptr": "*u8", "mn_ptr": "*fp32", "scale_ptr": "*fp32",
                           "cmin_ptr": "*fp32", "crng_ptr": "*fp32", "out_ptr": f"*{dt}",
                           "n": "i32", "inner": "i32", "C": "i32", "G": "constexpr",
                           "BITS": "constexpr", "CHAN": "constexpr"},
                      {"G": 256, "BITS": bits, "CHAN": chan}))
    return specs


def compile_all(archs: tuple[int, ...] = ARCHS) -> list[tuple[str, int, int]]:
    """(kernel name, arch, cubin bytes) for every kernel and dtype memtrain launches."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter cannot compile kernels")
    import triton
    from memtrain.kernels import bitmask, block_sparse, quant
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    done = []
    specs = _prune_specs(block_sparse) + _bitmask_specs(bitmask) + _quant_specs(quant)
    for fn, sig, consts in specs:
        for arch in archs:
            kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32))
            done.append((fn.__name__, arch, len(kernel.asm["cubin"])))
    return done


if __name__ == "__main__":
    import triton

    rows = compile_all()
    for name, arch, size in rows:
        print(f"{name:>26} sm_{arch}: cubin {size} bytes")
    print(f"triton {triton.__version__}: {len(rows)} kernels compiled", file=sys.stderr)
