"""kernels/quant.py: the Triton kernels (TRITON_INTERPRET=1 on the CPU) and the torch path against
the eager oracle (kernels/reference.py), byte for byte, on odd sizes and fp32/bf16/fp16; the
rounding's statistics (stochastic: unbiased; nearest: within half a step)."""

import os

import numpy as np
import pytest
import torch
from memtrain.kernels import quant, reference

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 37, 200]  # one element, a partial group, several groups with a partial last


def _x(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3 + 1
    if n > 40:  # a constant group (scale 0) and a group of one sign
        x[32:64] = 0.75
    return x.to(dtype)


def _split(buf, n, bits, group_size):
    codes, mn, scale = quant.split(buf, n, bits, group_size)
    return codes.numpy(), mn.numpy(), scale.numpy()


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", quant.BITS)
def test_quantize_equals_the_oracle(impl, rounding, dtype, bits):
    group_size = 32
    fn = quant.quantize_triton if impl == "triton" else quant.quantize_torch
    for n in SIZES:
        x = _x(n, dtype)
        before = x.clone()
        noise = torch.rand(n, generator=torch.Generator().manual_seed(1)) \
            if rounding == "stochastic" else None
        buf = fn(x, bits, group_size, stochastic=noise is not None, noise=noise)
        assert buf.numel() == quant.buffer_bytes(n, bits, group_size)
        assert torch.equal(x, before)  # the input is read, never written
        codes, mn, scale = _split(buf, n, bits, group_size)
        ref_codes, ref_mn, ref_scale = reference.quant_ref(x, bits, group_size, noise)
        np.testing.assert_array_equal(mn, ref_mn)
        np.testing.assert_array_equal(scale, ref_scale)
        np.testing.assert_array_equal(codes, ref_codes)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", quant.BITS)
def test_dequantize_equals_the_oracle(impl, dtype, bits):
    group_size = 64
    fn = quant.dequantize_triton if impl == "triton" else quant.dequantize_torch
    for n in SIZES:
        buf = quant.quantize_torch(_x(n, dtype, seed=n), bits, group_size, stochastic=False)
        out = fn(buf, n, bits, group_size, dtype)
        assert out.dtype == dtype and out.shape == (n,)
        ref = reference.dequant_ref(*_split(buf, n, bits, group_size), n, bits, group_size)
        torch.testing.assert_close(out, _cast(ref, dtype, impl), rtol=0, atol=0)


def _cast(ref: torch.Tensor, dtype: torch.dtype, impl: str) -> torch.Tensor:
    """fp32 -> dtype as the kernel stores it. Triton's interpreter casts fp32 to bf16 by
    truncation (its cast_impl drops the rounding mode; a GPU rounds to nearest even)."""
    if impl == "triton" and dtype == torch.bfloat16 and not torch.cuda.is_available():
        return (ref.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact: low bits 0
    return ref.to(dtype)


@pytest.mark.parametrize("bits", quant.BITS)
def test_triton_stochastic_rounding_picks_a_neighbouring_level(bits):
    """With tl.rand's noise every value lands on the level just below or just above it."""
    n, group_size = 150, 32
    x = _x(n, torch.float32)
    torch.manual_seed(0)
    buf = quant.quantize_triton(x, bits, group_size, stochastic=True)
    _, mn, scale = quant.split(buf, n, bits, group_size)
    y = quant.dequantize_triton(buf, n, bits, group_size, torch.float32)
    step = scale.repeat_interleave(group_size)[:n]
    assert torch.all((y - x).abs() <= step * (1 + 1e-5) + 1e-6)
    torch.manual_seed(0)
    again = quant.quantize_triton(x, bits, group_size, stochastic=True)
    assert torch.equal(buf, again)  # the seed comes from torch's generator


@pytest.mark.parametrize("bits", [2, 4])
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(bits):
    """The mean of many stochastic round trips approaches x (error ~ step / sqrt(trials));
    nearest rounding keeps its deterministic error whatever the number of trials."""
    group_size, trials = 32, 2000
    x = torch.linspace(-1, 1, group_size)  # the group's min and max are -1 and 1: known levels
    torch.manual_seed(0)
    total = torch.zeros(group_size, dtype=torch.float64)
    for _ in range(trials):
        buf = quant.quantize_torch(x, bits, group_size, stochastic=True)
        total += quant.dequantize_torch(buf, group_size, bits, group_size, torch.float32)
    step = 2 / ((1 << bits) - 1)
    mean_err = (total / trials - x).abs().max().item()
    # one round trip has a std of at most step / 2: 5 standard errors of the mean
    assert mean_err < 5 * (step / 2) / trials ** 0.5
    buf = quant.quantize_torch(x, bits, group_size, stochastic=False)
    nearest = quant.dequantize_torch(buf, group_size, bits, group_size, torch.float32)
    nearest_err = (nearest - x).abs()
    assert nearest_err.max() <= step / 2 + 1e-6
    assert nearest_err.max() > 10 * mean_err  # the bias that averaging cannot remove
