"""kernels/quant.py: the Triton kernels (TRITON_INTERPRET=1 on the CPU) and the torch path against
the eager oracle (kernels/reference.py), byte for byte, on odd sizes and fp32/bf16/fp16; the
rounding's statistics (stochastic: unbiased; nearest: within half a step)."""

import os

import numpy as np
import pytest
import torch
from memtrain.kernels import quant, reference

# make test-compat runs this file on the oldest torch: the Triton quantize kernels
pytestmark = [pytest.mark.compat,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                 not torch.cuda.is_available(),
                                 reason="Triton kernels need CUDA or TRITON_INTERPRET=1")]

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
@pytest.mark.slow
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


CHAN = (3, 7)  # [outer 4, C 3, inner 7]: 84 elements, groups of 32 straddle channels


def _x_chan(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Channels of very different ranges (x1, x1000, constant), as NCHW maps below a group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 7, generator=g)
    x[:, 1] = x[:, 1] * 1000 + 5
    x[:, 2] = -0.25  # a constant channel: range 0
    return x.reshape(-1).to(dtype)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", quant.BITS)
def test_per_channel_quantize_and_dequantize_equal_the_oracle(impl, rounding, dtype, bits):
    """The channel stats, codes and group stats byte for byte; the round trip value for value."""
    group_size, n = 32, 84
    x = _x_chan(dtype)
    noise = torch.rand(n, generator=torch.Generator().manual_seed(1)) \
        if rounding == "stochastic" else None
    q = quant.quantize_triton if impl == "triton" else quant.quantize_torch
    dq = quant.dequantize_triton if impl == "triton" else quant.dequantize_torch
    buf = q(x, bits, group_size, stochastic=noise is not None, noise=noise, chan=CHAN)
    assert buf.numel() == quant.buffer_bytes(n, bits, group_size, CHAN[0])
    codes, mn, scale = _split(buf, n, bits, group_size)
    cmin, crng = (t.numpy() for t in quant.split_channels(buf, n, bits, group_size, CHAN[0]))
    ref = reference.quant_ref(x, bits, group_size, noise, chan=CHAN)
    for got, want in zip((codes, mn, scale, cmin, crng), ref):
        np.testing.assert_array_equal(got, want)
    assert crng[2] == 0 and crng[1] > 1000 * crng[0] / 10
    out = dq(buf, n, bits, group_size, dtype, chan=CHAN)
    want = reference.dequant_ref(codes, mn, scale, n, bits, group_size, CHAN, cmin, crng)
    torch.testing.assert_close(out, _cast(want, dtype, impl), rtol=0, atol=0)
    assert torch.all(out.view(4, 3, 7)[:, 2] == x.view(4, 3, 7)[:, 2])  # constant: exact


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.slow
def test_per_channel_steps_follow_each_channel_and_stay_unbiased(bits):
    """With channels every element's error is below its own channel's step (range / L), where
    plain groups give the small channel its large neighbour's step; stochastic rounding stays
    unbiased through the per-channel map."""
    group_size, n, trials = 32, 84, 1000
    x = _x_chan(torch.float32)
    levels = (1 << bits) - 1
    step = (x.view(4, 3, 7).amax((0, 2)) - x.view(4, 3, 7).amin((0, 2))) / levels  # [C]
    small = torch.zeros(4, 3, 7, dtype=torch.bool)
    small[:, 0] = True
    small = small.reshape(-1)
    torch.manual_seed(0)
    total = torch.zeros(n, dtype=torch.float64)
    worst = 0.0
    for _ in range(trials):
        buf = quant.quantize_torch(x, bits, group_size, stochastic=True, chan=CHAN)
        y = quant.dequantize_torch(buf, n, bits, group_size, torch.float32, chan=CHAN)
        worst = max(worst, ((y - x)[small].abs().max() / step[0]).item())
        total += y
    assert worst <= 1 + 1e-4  # within one of the small channel's own steps
    err = (total / trials - x).view(4, 3, 7).abs().amax((0, 2))
    assert torch.all(err <= 5 * (step / 2) / trials ** 0.5 + 1e-6), (err, step)
    plain = quant.dequantize_torch(quant.quantize_torch(x, bits, group_size, stochastic=True),
                                   n, bits, group_size, torch.float32)
    assert (plain - x)[small].abs().max() > 10 * step[0]  # the old grouping: neighbour's step

