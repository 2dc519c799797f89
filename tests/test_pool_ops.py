"""method=pool, operator level: each autograd function against an exact or independent reference,
and the Triton mask kernels against the numpy oracle (TRITON_INTERPRET=1 on the CPU)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels compile (lazily, on use)

import pytest
import torch
import torch.nn.functional as F
from memtrain.kernels import bitmask
from memtrain.kernels import reference as ref
from torch import nn

from memtrain.methods.common.compact import CompactMaxPool2d, CompactMaxPool2dFn
from memtrain.methods.pool import PooledBatchNormFn, PooledConv2dFn

# (in_ch, out_ch, kernel, stride, padding, dilation, groups, H, W)
# make test-compat runs this file on the oldest torch: pool's Triton kernels and autograd Functions
pytestmark = pytest.mark.compat

CONVS = {
    "3x3": (4, 6, 3, 1, 1, 1, 1, 8, 8),
    "3x3_s2_odd": (4, 6, 3, 2, 1, 1, 1, 9, 7),
    "1x1_s2": (4, 8, 1, 2, 0, 1, 1, 8, 10),
    "7x7_s2_stem": (3, 4, 7, 2, 3, 1, 1, 16, 16),
    "dilated": (4, 4, 3, 1, 2, 2, 2, 11, 8),
    "depthwise": (6, 6, 3, 1, 1, 1, 6, 10, 9),
    "5x5_s2_depthwise": (4, 4, 5, 2, 2, 1, 4, 13, 13),
}


def _conv_case(name, bias=True, seed=0):
    cin, cout, k, s, p, d, g, h, w = CONVS[name]
    torch.manual_seed(seed)
    x = torch.randn(2, cin, h, w, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(cout, cin // g, k, k, dtype=torch.float64, requires_grad=True)
    b = torch.randn(cout, dtype=torch.float64, requires_grad=True) if bias else None
    return x, weight, b, ((s, s), (p, p), (d, d), g)


def _grads(out, inputs, seed=1):
    gout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return gout, torch.autograd.grad(out, [t for t in inputs if t is not None], gout)


def _upsample_by_index(xp, k, size):
    """Nearest upsampling written as gathers: element (i, j) reads xp[i // k, j // k]."""
    rows = torch.arange(size[0]) // k
    cols = torch.arange(size[1]) // k
    return xp[..., rows, :][..., cols]


@pytest.mark.parametrize("pool_type", ["avg", "max"])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_grad_input_exact_and_grad_weight_upsample_matches_independent(name, k, pool_type):
    x, w, b, (s, p, d, g) = _conv_case(name)
    out = PooledConv2dFn.apply(x, w, b, s, p, d, g, k, pool_type, "upsample")
    ref_out = F.conv2d(x, w, b, s, p, d, g)
    assert torch.equal(out, ref_out)  # the forward is the plain convolution
    gout, (gx, gw, gb) = _grads(out, (x, w, b))
    _, (rx, _, rb) = _grads(ref_out, (x, w, b))
    torch.testing.assert_close(gx, rx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gb, rb, rtol=1e-12, atol=1e-12)
    # independent grad_weight: conv2d_weight on the gather-upsampled pooled input
    pooled = (F.max_pool2d if pool_type == "max" else F.avg_pool2d)(x.detach(), k, k,
                                                                     ceil_mode=True)
    x_up = _upsample_by_index(pooled, k, x.shape[-2:])
    expect = torch.nn.grad.conv2d_weight(x_up, w.shape, gout, s, p, d, g)
    torch.testing.assert_close(gw, expect, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_kernel_size_1_is_the_baseline_bitwise(name):
    x, w, b, (s, p, d, g) = _conv_case(name)
    for mode in ("upsample", "pooled"):
        _, got = _grads(PooledConv2dFn.apply(x, w, b, s, p, d, g, 1, "avg", mode), (x, w, b))
        _, want = _grads(F.conv2d(x, w, b, s, p, d, g), (x, w, b))
        for a, e in zip(got, want):
            assert torch.equal(a, e)


@pytest.mark.parametrize("hw", [(8, 8), (9, 7)])
@pytest.mark.parametrize("k", [2, 4])
def test_pooled_mode_exact_for_1x1_stride_1_avg(k, hw):
    """For a 1x1 stride-1 conv, correlating pooled maps (rescaled) equals grad_weight from the
    upsampled pooled input on divisible sizes; on odd sizes the partial windows weigh in by the
    element-count ratio, so it is checked on divisible sizes only against the upsample mode."""
    x = torch.randn(2, 4, *hw, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, 1, 1, dtype=torch.float64, requires_grad=True)
    conf = ((1, 1), (0, 0), (1, 1), 1, k, "avg")
    _, (gx_p, gw_p) = _grads(PooledConv2dFn.apply(x, w, None, *conf, "pooled"), (x, w))
    _, (gx_u, gw_u) = _grads(PooledConv2dFn.apply(x, w, None, *conf, "upsample"), (x, w))
    _, (gx_ref, gw_ref) = _grads(F.conv2d(x, w), (x, w))
    torch.testing.assert_close(gx_p, gx_ref, rtol=1e-12, atol=1e-12)
    if hw[0] % k == 0 and hw[1] % k == 0:
        torch.testing.assert_close(gw_p, gw_u, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(gw_u, gw_ref)  # pooling did lose information


def test_both_modes_exact_on_block_constant_input():
    """When x is constant on k x k blocks (and grad_output too, for `pooled`), nothing is lost."""
    k = 2
    base = torch.randn(2, 4, 4, 4, dtype=torch.float64)
    x = base.repeat_interleave(k, -2).repeat_interleave(k, -1).requires_grad_()
    w = torch.randn(6, 4, 1, 1, dtype=torch.float64, requires_grad=True)
    gout = torch.randn(2, 6, 4, 4, dtype=torch.float64).repeat_interleave(k, -2) \
        .repeat_interleave(k, -1)
    conf = ((1, 1), (0, 0), (1, 1), 1, k, "avg")
    want = torch.autograd.grad(F.conv2d(x, w), w, gout)[0]
    for mode in ("upsample", "pooled"):
        got = torch.autograd.grad(PooledConv2dFn.apply(x, w, None, *conf, mode), w, gout)[0]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["3x3", "3x3_s2_odd", "7x7_s2_stem", "depthwise", "dilated"])
def test_pooled_mode_grad_weight_close_to_exact_on_smooth_input(name):
    """A coarser approximation, still pointing the right way on a smooth input."""
    cin, cout, kk, s, p, d, g, h, w_ = CONVS[name]
    torch.manual_seed(0)
    smooth = F.interpolate(torch.randn(2, cin, 3, 3, dtype=torch.float64), size=(h, w_),
                           mode="bilinear", align_corners=True).requires_grad_()
    w = torch.randn(cout, cin // g, kk, kk, dtype=torch.float64, requires_grad=True)
    gout, (_, gw) = _grads(PooledConv2dFn.apply(smooth, w, None, (s, s), (p, p), (d, d), g, 2,
                                                "avg", "pooled"), (smooth, w))
    exact = torch.nn.grad.conv2d_weight(smooth.detach(), w.shape, gout, (s, s), (p, p), (d, d), g)
    cos = F.cosine_similarity(gw.flatten(), exact.flatten(), dim=0)
    assert cos > 0.3, float(cos)


def test_conv_saves_pooled_input_not_int64_indices():
    x, w, b, (s, p, d, g) = _conv_case("3x3")
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        PooledConv2dFn.apply(x, w, b, s, p, d, g, 2, "max", "upsample")
    shapes = sorted(tuple(t.shape) for t in seen)
    assert shapes == sorted([(2, 4, 4, 4), tuple(w.shape)])
    assert all(t.dtype == torch.float64 for t in seen)


# ---------------------------------------------------------------- batch norm


def _bn_reference(x, weight, bias, momentum):
    bn = nn.BatchNorm2d(x.shape[1], momentum=momentum).double()
    bn.weight.data.copy_(weight)
    bn.bias.data.copy_(bias)
    return bn


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_forward_and_running_stats_as_nn_batchnorm(momentum):
    from memtrain.methods.pool import PoolMethod

    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 5, dtype=torch.float64) * 3 + 1
    ref_bn = _bn_reference(x, torch.rand(3), torch.randn(3), momentum)
    net = PoolMethod(targets="conv+bn").wrap(nn.Sequential(_bn_reference(x, ref_bn.weight.data,
                                                                         ref_bn.bias.data,
                                                                         momentum)))
    for _ in range(3):
        xi = x.clone().requires_grad_()
        torch.testing.assert_close(net(xi), ref_bn(xi), rtol=1e-12, atol=1e-12)
    pooled_bn = net[0]
    assert type(pooled_bn).__name__ == "PooledBatchNorm2d"
    torch.testing.assert_close(pooled_bn.running_mean, ref_bn.running_mean)
    torch.testing.assert_close(pooled_bn.running_var, ref_bn.running_var)
    assert int(pooled_bn.num_batches_tracked) == int(ref_bn.num_batches_tracked) == 3
    net.eval(), ref_bn.eval()
    torch.testing.assert_close(net(x), ref_bn(x), rtol=1e-12, atol=1e-12)


def test_batchnorm_backward_exact_on_block_constant_input_and_saves_pooled():
    k = 2
    torch.manual_seed(0)
    x = torch.randn(2, 3, 3, 4, dtype=torch.float64).repeat_interleave(k, -2) \
        .repeat_interleave(k, -1).requires_grad_()
    weight = torch.rand(3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        out = PooledBatchNormFn.apply(x, weight, bias, None, None, 0.1, 1e-5, k, "avg")
    assert max(t.numel() for t in seen) == x.numel() // k**2
    _, got = _grads(out, (x, weight, bias))
    _, want = _grads(F.batch_norm(x, None, None, weight, bias, True, 0.1, 1e-5),
                     (x, weight, bias))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- max-pool


@pytest.mark.parametrize("conf", [
    dict(kernel_size=3, stride=2, padding=1),  # the ResNet stem
    dict(kernel_size=2, stride=2, padding=0, ceil_mode=True),
    dict(kernel_size=3, stride=1, padding=1, dilation=2),
    dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 1)),
])
def test_compact_maxpool_exact(conf):
    pair = nn.modules.utils._pair
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 9, requires_grad=True)
    pool = CompactMaxPool2d(**conf)
    out = pool(x)
    want_out = F.max_pool2d(x, **conf)
    assert torch.equal(out, want_out)
    _, got = _grads(out, (x,))
    _, want = _grads(want_out, (x,))
    assert torch.equal(got[0], want[0])
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        CompactMaxPool2dFn.apply(x, pair(conf["kernel_size"]), pair(conf["stride"]),
                                 pair(conf["padding"]), pair(conf.get("dilation", 1)),
                                 conf.get("ceil_mode", False))
    assert [t.dtype for t in seen] == [torch.uint8] and seen[0].shape == out.shape


# ---------------------------------------------------------------- 1-bit masks


SIZES = [1, 7, 8, 9, 63, bitmask.BLOCK_ELEMS - 1, bitmask.BLOCK_ELEMS + 13,
         8 * bitmask.BLOCK_BYTES + 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_mask_kernels_match_reference(n, dtype):
    torch.manual_seed(n)
    x = torch.randn(n).to(dtype)
    x[::5] = 0  # exact zeros are "not positive", as ReLU's backward treats them
    want = ref.pool_pack_mask(x)
    assert want.numel() == bitmask.n_bytes(n)
    assert torch.equal(bitmask.pack_triton(x), want)
    assert torch.equal(bitmask.pack_torch(x), want)
    assert torch.equal(bitmask.unpack_torch(want, n), ref.pool_unpack_mask(want, n))
    g = torch.randn(n).to(dtype)
    expect = ref.pool_masked_grad(g, want)
    assert torch.equal(expect, torch.where(x > 0, g, torch.zeros_like(g)))
    assert torch.equal(bitmask.masked_grad_triton(g, want), expect)
    assert torch.equal(bitmask.masked_grad_torch(g, want), expect)


def test_mask_kernels_on_a_4d_activation():
    x = torch.randn(2, 3, 5, 7)
    bits = bitmask.pack_triton(x)
    g = torch.randn_like(x)
    out = bitmask.masked_grad_triton(g, bits)
    assert out.shape == g.shape and torch.equal(out, torch.where(x > 0, g, 0.0))
