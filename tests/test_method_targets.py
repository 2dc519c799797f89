"""What pool, prune and quantize act on in other libraries' models, found by what a module or
saved tensor is: timm's Conv2dSame, CondConv2d and BatchNormAct2d (pool; CondConv2d's 1x1s for
prune), and views with gaps such as the q, k and v split from one fused projection (quantize).
Tiny sizes; exact references where the method claims exactness, counts by hand elsewhere."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memtrain.methods.common.compact import MaskedReLU
from memtrain.methods.pool import PoolMethod, pool, upsample
from memtrain.methods.quantize import ActivationQuantizer, pack_tensor, unpack_tensor

timm_layers = pytest.importorskip("timm.layers")


def _same_pads(x, k, s, d):
    """TensorFlow's SAME padding, written out: (left, right, top, bottom)."""
    pads = []
    for size, kk, ss, dd in ((x.shape[3], k[1], s[1], d[1]), (x.shape[2], k[0], s[0], d[0])):
        out = -(-size // ss)
        total = max((out - 1) * ss + (kk - 1) * dd + 1 - size, 0)
        pads += [total // 2, total - total // 2]
    return pads


@pytest.mark.parametrize("hw,kernel,stride,dilation", [
    ((9, 10), 3, 2, 1), ((8, 8), (3, 5), (2, 1), (1, 2)), ((7, 11), 5, 1, 1)])
def test_pool_swaps_timm_conv2d_same_grad_input_exact(hw, kernel, stride, dilation):
    """Forward and grad_input as timm's own module; grad_weight from the pooled padded input,
    upsampled (pool's upsample mode)."""
    torch.manual_seed(0)
    conv = timm_layers.Conv2dSame(4, 6, kernel, stride=stride, dilation=dilation).double()
    net = PoolMethod(kernel_size=2).wrap(nn.Sequential(copy.deepcopy(conv)))
    assert type(net[0]).__name__ == "PooledConv2dSame"
    x = torch.randn(2, 4, *hw, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn_like(conv(x))
    conv(x).backward(g)
    out = net(x2)
    torch.testing.assert_close(out, conv(x.detach()), rtol=1e-12, atol=1e-12)
    out.backward(g)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-12, atol=1e-12)
    xp = F.pad(x.detach(), _same_pads(x, conv.kernel_size, conv.stride, conv.dilation))
    w = conv.weight.detach().clone().requires_grad_()
    F.conv2d(upsample(pool(xp, 2, "avg"), 2, xp.shape[-2:]), w, None, conv.stride, 0,
             conv.dilation).backward(g)
    torch.testing.assert_close(net[0].weight.grad, w.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(net[0].bias.grad, conv.bias.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("act", [nn.ReLU, nn.SiLU])
def test_pool_conv_bn_swaps_timm_batchnormact2d_exact_on_block_constant_input(act):
    """BatchNormAct2d at targets=conv+bn: its batch norm pooled, then its own activation (a ReLU
    masked); forward, running statistics and every gradient equal timm's module where the
    input is constant over each 2x2 window (pooling then loses nothing)."""
    torch.manual_seed(0)
    bn = timm_layers.BatchNormAct2d(3, act_layer=act).double()
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.normal_()
    net = PoolMethod(kernel_size=2, targets="conv+bn").wrap(nn.Sequential(copy.deepcopy(bn)))
    assert type(net[0]).__name__ == "PooledBatchNormAct2d"
    assert isinstance(net[0].act, MaskedReLU) == (act is nn.ReLU)
    small = torch.randn(4, 3, 3, 4, dtype=torch.float64) * 2 + 1
    x = small.repeat_interleave(2, 2).repeat_interleave(2, 3).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(4, 3, 6, 8, dtype=torch.float64)
    out_ref, out = bn(x), net(x2)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    out_ref.backward(g), out.backward(g)
    for a, b in [(x.grad, x2.grad), (bn.weight.grad, net[0].weight.grad),
                 (bn.bias.grad, net[0].bias.grad), (bn.running_mean, net[0].running_mean),
                 (bn.running_var, net[0].running_var)]:
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
    net.eval(), bn.eval()
    torch.testing.assert_close(net(x.detach()), bn(x.detach()), rtol=1e-12, atol=1e-12)


def test_pool_on_timm_tf_mobilenetv3_finds_every_conv_batchnorm_and_relu():
    """timm by name (TensorFlow padding: Conv2dSame where the pad depends on the size; every
    norm a BatchNormAct2d, ReLU inside): all counted by hand become pooled ones."""
    from memtrain.models import timm_model

    net = timm_model(10, (3, 32, 32), "tf_mobilenetv3_small_minimal_100")
    count = {name: sum(type(m).__name__ == name for m in net.modules())
             for name in ("Conv2d", "Conv2dSame", "BatchNormAct2d", "ReLU")}
    assert count["Conv2dSame"] > 0 and count["BatchNormAct2d"] > 0 and count["ReLU"] > 0
    PoolMethod(kernel_size=2, targets="conv+bn", relu_mask="bool").wrap(net)  # bool: no kernel
    after = {name: sum(type(m).__name__ == name for m in net.modules())
             for name in ("PooledConv2d", "PooledConv2dSame", "PooledBatchNormAct2d",
                          "MaskedReLU", "Conv2d", "Conv2dSame", "BatchNormAct2d", "ReLU")}
    assert after == {"PooledConv2d": count["Conv2d"], "PooledConv2dSame": count["Conv2dSame"],
                     "PooledBatchNormAct2d": count["BatchNormAct2d"],
                     "MaskedReLU": count["ReLU"], "Conv2d": 0, "Conv2dSame": 0,
                     "BatchNormAct2d": 0, "ReLU": 0}


@pytest.mark.slow  # a step of the whole network: seconds on a loaded CPU
def test_pool_trains_a_step_of_timm_tf_mobilenetv3():
    from memtrain.models import timm_model

    net = timm_model(10, (3, 32, 32), "tf_mobilenetv3_small_minimal_100")
    PoolMethod(kernel_size=2, targets="conv+bn").wrap(net).train()
    net(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def _cond_conv_by_hand(conv, x, r, pads=None):
    """CondConv2d's output written out: each sample's kernel and bias mixed from the experts
    by its routing weights, each sample convolved with its own (pads: F.pad's, else the
    module's padding)."""
    n = x.shape[0]
    w = (r @ conv.weight).view(n, conv.out_channels, conv.in_channels, *conv.kernel_size)
    b = r @ conv.bias
    if pads is not None:
        x = F.pad(x, pads)
    return torch.cat([F.conv2d(x[i:i + 1], w[i], b[i], conv.stride,
                               0 if pads is not None else conv.padding, conv.dilation)
                      for i in range(n)])


@pytest.mark.parametrize("hw,kernel,stride,padding", [
    ((9, 9), 3, 1, ""), ((9, 10), 3, 2, "same"), ((8, 7), 5, 1, "same")])
def test_pool_swaps_timm_cond_conv2d_keeping_only_the_pooled_input(hw, kernel, stride, padding):
    """timm's CondConv2d (static padding, and "SAME" where it depends on the size): forward
    and grad_input as timm's own module; the experts', the biases' and the routing's gradients
    those of the samples' mixed kernels correlated with the pooled padded input, upsampled;
    and what it keeps of the input is the pooled map, not the input."""
    torch.manual_seed(0)
    conv = timm_layers.CondConv2d(4, 6, kernel, stride=stride, padding=padding, bias=True,
                                  num_experts=3).double()
    assert conv.dynamic_padding == (stride == 2)  # "SAME" at stride 1 is a static padding
    net = PoolMethod(kernel_size=2).wrap(nn.Sequential(copy.deepcopy(conv)))
    assert type(net[0]).__name__ == "PooledCondConv2d"
    assert net.state_dict().keys() == nn.Sequential(conv).state_dict().keys()
    x = torch.randn(2, 4, *hw, dtype=torch.float64, requires_grad=True)
    r = torch.rand(2, 3, dtype=torch.float64, requires_grad=True)
    x2, r2 = (t.detach().clone().requires_grad_() for t in (x, r))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        out = net[0](x2, r2)
    ref = conv(x, r)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert (1, 8, *x.shape[-2:]) not in saved and x.shape not in saved
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-12, atol=1e-12)
    # "SAME" pads the input before the convolution (the padded map pooled); static padding
    # is the convolution's own (the input pooled)
    pads = _same_pads(x, conv.kernel_size, conv.stride, conv.dilation) if \
        conv.dynamic_padding else None
    xp = F.pad(x.detach(), pads) if pads else x.detach()
    by_hand = copy.deepcopy(conv)
    r3 = r.detach().clone().requires_grad_()
    _cond_conv_by_hand(by_hand, upsample(pool(xp, 2, "avg"), 2, xp.shape[-2:]), r3,
                       pads=[0, 0, 0, 0] if pads else None).backward(g)
    for got, want in [(net[0].weight.grad, by_hand.weight.grad),
                      (net[0].bias.grad, by_hand.bias.grad), (r2.grad, r3.grad)]:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_prune_swaps_timm_1x1_cond_conv2d_and_plans_it():
    """A 1x1 CondConv2d is prunable as a 1x1 convolution (the other sizes are not); the plan
    prunes its input, and a step gives its experts and the routing gradients."""
    from memtrain.methods.prune import PruneMethod

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 48, 3, padding=1)
            self.route = nn.Linear(48, 3)
            self.cc = timm_layers.CondConv2d(48, 8, 1, num_experts=3)
            self.cc3 = timm_layers.CondConv2d(8, 8, 3, num_experts=3)

        def forward(self, x):
            h = self.stem(x)  # saved by the cc alone (the mean saves nothing)
            r = torch.sigmoid(self.route(h.mean((2, 3))))
            return self.cc3(self.cc(h, r) * 1.0, r).sum((2, 3))

    torch.manual_seed(0)
    net = Net()
    method = PruneMethod(sparsity=0.5, block_size=16)
    method.wrap(net)
    assert type(net.cc).__name__ == "PrunedCondConv1x1"
    assert type(net.cc3).__name__ == "CondConv2d"
    x = torch.randn(3, 3, 6, 6)
    assert method.plan(net, x)["prune_layer_calls"] >= 1 and net.cc.plan == (True,)
    net(x).sum().backward()
    assert net.cc.weight.grad is not None and net.route.weight.grad is not None


@pytest.mark.parametrize("stride", [(1, 1), (2, 2)])
def test_pruned_cond_conv1x1_grads_per_sample_from_the_kept_blocks(stride):
    """Each sample's kernel: forward bit for bit CondConv2d's grouped convolution, grad_input
    and the biases' exact, each sample's kernel gradient G_b^T A_b with A's dropped blocks
    zero (a densified copy of the kept blocks, counted apart); 5x5 maps make 25 rows a sample,
    so 16-row blocks straddle samples."""
    from memtrain.kernels import bsr

    from memtrain.methods.prune import PrunedCondConv1x1Fn

    torch.manual_seed(0)
    n, c, out = 3, 40, 8
    x = torch.randn(n, c, 5, 5, requires_grad=True)
    w = torch.randn(n * out, c, requires_grad=True)
    b = torch.randn(n * out, requires_grad=True)
    spec = bsr.PruneSpec(0.5, 16, backend="torch")
    y = PrunedCondConv1x1Fn.apply(x, w, b, spec, stride)
    per_sample = torch.cat([F.conv2d(x[i:i + 1], w.view(n, out, c, 1, 1)[i], b.view(n, out)[i],
                                     stride) for i in range(n)])
    torch.testing.assert_close(y, per_sample, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, [x, w, b], g)
    gx0, gb0 = torch.autograd.grad(per_sample, [x, b], g)
    torch.testing.assert_close(gx, gx0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, gb0, rtol=1e-5, atol=1e-5)
    a = x.detach()[:, :, ::stride[0], ::stride[1]].permute(0, 2, 3, 1).reshape(-1, c)
    kept = bsr.compress(a, spec).to_torch_bsc().to_dense()[:a.shape[0], :c]
    assert 0 < (kept != 0).sum() < a.numel()
    p = a.shape[0] // n
    want = torch.bmm(g.reshape(n, out, p), kept.view(n, p, c)).reshape(n * out, c)
    torch.testing.assert_close(gw, want, rtol=1e-5, atol=1e-5)


def test_pool_leaves_other_conv_subclasses_and_says_so_in_one_line():
    """A convolution subclass that computes something else (timm's weight-standardised
    StdConv2d) is not a target: a model of only those is refused, in one line."""
    from memtrain.errors import ConfigError

    net = nn.Sequential(timm_layers.StdConv2d(3, 4, 3), nn.GELU())
    with pytest.raises(ConfigError, match="it has no convolution") as err:
        PoolMethod().wrap(net)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- quantize: views with gaps


def test_quantize_packs_a_view_with_gaps_from_its_own_elements():
    qkv = torch.randn(2, 5, 3 * 16, requires_grad=True) * 1.0
    q, k, v = qkv.split(16, dim=-1)
    k = k.view(2, 5, 2, 8).transpose(1, 2)  # gaps and a transpose, as attention heads
    for view in (q, k, v):
        p = pack_tensor(view, 8, 32, stochastic=False)
        assert p is not None and p.buf.numel() < view.numel() * 4
        back = unpack_tensor(p)
        assert back.shape == view.shape and back.dtype == view.dtype
        step = (view.max() - view.min()).item() / 255
        torch.testing.assert_close(back, view.detach(), atol=step, rtol=0)
    expanded = qkv[:, :1].expand(2, 5, 48)
    assert pack_tensor(expanded, 8, 32, False) is None  # overlapping memory: left as it is


def _gpt2():
    from memtrain.models import hf_model

    torch.manual_seed(0)
    return hf_model(64, (8,), "gpt2", {"num_hidden_layers": 1, "hidden_size": 32}, "eager")


@pytest.mark.slow  # building transformers' GPT-2 imports its modules: seconds on a loaded CPU
def test_quantize_on_transformers_gpt2_packs_every_activation_q_k_v_too():
    """GPT-2 splits q, k and v from one Conv1D output (views with gaps) for its attention:
    every activation saved is packed, so no float activation reaches the outer hooks, and the
    8-bit weight gradients stay close to the baseline's."""
    from memtrain.methods.common.activations import is_activation

    net, base = _gpt2(), None
    ref = copy.deepcopy(net)
    x = torch.randint(0, 64, (2, 8))
    torch.manual_seed(1)  # the same dropout masks in both steps
    ref(x).sum().backward()
    handed = []

    def outer(t):
        handed.append(is_activation(t) and t.is_floating_point())
        return t

    with torch.autograd.graph.saved_tensors_hooks(outer, lambda t: t), \
            ActivationQuantizer(8, 32, stochastic=False):
        torch.manual_seed(1)
        out = net(x)
    out.sum().backward()
    assert handed and not any(handed)
    for (name, a), (_, b) in zip(ref.named_parameters(), net.named_parameters()):
        if "c_attn.weight" in name:
            base = a.grad.norm()
            assert (b.grad - a.grad).norm() < 0.05 * base, name
    assert base is not None


# ---------------------------------------------------------------- prune: timm's Linear


def _mlp_with_timm_head():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         timm_layers.Linear(64, 10))


@pytest.mark.parametrize("prune_head,pruned", [(False, ["0", "2"]), (True, ["0", "2", "4"])])
def test_prune_counts_timm_linear_as_a_linear_and_as_the_head(prune_head, pruned):
    """timm's Linear (its classifier heads) is F.linear: a layer to prune, and the last linear
    is the head that prune leaves dense unless prune_head."""
    from memtrain.methods.prune import PruneMethod

    method = PruneMethod(sparsity=0.5, block_size=16, prune_head=prune_head)
    method.wrap(_mlp_with_timm_head())
    assert method.pruned == pruned


def test_prune_at_sparsity_0_on_timm_linear_is_the_baseline_bitwise():
    from memtrain.methods.prune import PruneMethod

    ref = _mlp_with_timm_head()
    net = PruneMethod(sparsity=0.0, block_size=16, prune_head=True).wrap(copy.deepcopy(ref))
    x = torch.randn(64, 32)
    for mdl in (ref, net):
        mdl(x).square().sum().backward()
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("mask", ["bits", "bool"])
def test_masked_relu6_is_torchs_relu6_and_keeps_only_its_mask(inplace, mask):
    """ReLU6 (MobileNetV2's) masked: output and gradient equal nn.ReLU6's at every value, the
    bounds 0 and 6 and NaN included, and the backward keeps a mask only (1 bit or 1 byte an
    element), not the output."""
    x = torch.tensor([-1.0, 0.0, 1e-7, 3.0, 6.0 - 1e-6, 6.0, 7.5, float("nan")] * 16)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    ref, got = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = nn.ReLU6(inplace)(ref * 1)  # * 1: an in-place op needs a non-leaf input
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = MaskedReLU(inplace, mask, top=6.0).train()(got * 1)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0, equal_nan=True)
    out_ref.backward(g), out.backward(g)
    torch.testing.assert_close(got.grad, ref.grad, rtol=0, atol=0)
    assert [t.dtype for t in kept] == [torch.uint8 if mask == "bits" else torch.bool]
    assert kept[0].numel() == (x.numel() // 8 if mask == "bits" else x.numel())


@pytest.mark.slow  # two MobileNetV2s built and stepped
def test_pool_and_quantize_mask_every_relu6_of_torchvisions_mobilenet_v2():
    """torchvision's MobileNetV2 has nn.ReLU6 only: pool and quantize each swap every one of
    them (counted by hand) for a masked ReLU6, and the network still steps."""
    from torchvision.models import mobilenet_v2

    from memtrain.methods.quantize import QuantizeMethod

    for method in (PoolMethod(kernel_size=2), QuantizeMethod(bits=8)):
        net = mobilenet_v2(num_classes=10, width_mult=0.25)
        relu6 = sum(type(m) is nn.ReLU6 for m in net.modules())
        assert relu6 == 35  # the stem, the last conv, 1 in the first block, 2 in each of 16
        net = method.wrap(net).train()
        masked = [m for m in net.modules() if isinstance(m, MaskedReLU)]
        assert len(masked) == relu6 and all(m.top == 6.0 for m in masked)
        assert not any(type(m) is nn.ReLU6 for m in net.modules())
        net(torch.randn(2, 3, 32, 32)).sum().backward()


def _masks_kept(net, x):
    """The dtypes and sizes of what `net`'s backward keeps, in order (parameters left out)."""
    params = {p.data_ptr() for p in net.parameters()}
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = net(x)
    return out, [(t.dtype, t.numel()) for t in kept if t.data_ptr() not in params]


def test_prune_masks_a_relu6_that_only_a_pruned_layer_keeps_with_its_exact_gradient():
    """prune on Linear -> ReLU6 -> Linear -> head: the ReLU6's output is kept only by the 2nd
    Linear, so it keeps a 1-bit mask of 0 < x < 6 (the blocks replace its output) and the
    gradient reaching the first layer equals nn.ReLU6's, with inputs past 6 in the batch."""
    from memtrain.methods.prune import PruneMethod, PruneReLU6

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 64), nn.ReLU6(), nn.Linear(64, 64), nn.Linear(64, 2))
    x = 20 * torch.randn(64, 64)
    assert (ref[1](ref[0](x)) == 6).float().mean() > 0.2  # the upper bound is reached
    method = PruneMethod(0.5, 16)
    net = method.wrap(copy.deepcopy(ref)).train()
    assert type(net[1]) is PruneReLU6
    assert method.plan(net, x) == {"prune_layer_calls": 1, "prune_relu_masked": 1}
    out, kept = _masks_kept(net, x)
    ref_out, ref_kept = _masks_kept(ref, x)
    # none keeps x, the ReLU6's input (hardtanh's backward reads it), its output (the 2nd
    # Linear's input) and the head's input; prune keeps the 1-bit mask and the 2nd Linear's
    # blocks in place of the middle two
    dense = (torch.float32, 64 * 64)
    assert ref_kept.count(dense) == 4 and kept.count(dense) == 2
    assert (torch.uint8, 64 * 64 // 8) in kept
    assert torch.equal(out, ref_out)
    out.square().sum().backward(), ref_out.square().sum().backward()
    torch.testing.assert_close(net[0].weight.grad, ref[0].weight.grad)


def test_checkpoint_compaction_swaps_relu6_for_a_masked_one_and_back():
    """checkpoint's compaction choices take nn.ReLU6 as they take nn.ReLU: the compacted module
    keeps a 1-bit mask (not its output), its output and gradient are nn.ReLU6's exactly, the
    choice is named relu6, and undoing the swap gives the module its class back."""
    from memtrain.methods.checkpoint import compaction
    from memtrain.models.chain import Segment

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU6(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(8 * 7 * 7, 2)).train()
    segments = [Segment("net.0", net, ("0", "1", "2")), Segment("net.3", net, ("3", "4"))]
    cands = compaction.candidates(segments)
    assert [[type(m) for m in ms] for ms in cands] == [[nn.ReLU6, nn.MaxPool2d], []]
    assert compaction._kinds(cands[0]) == "max_pool2d x1, relu6 x1"
    x = 4 * torch.randn(4, 3, 16, 16)
    ref = copy.deepcopy(net)
    with compaction.compacted(cands[0]):  # the stem's pattern: ReLU6 -> max-pool, both
        assert type(net[1]) is compaction.MaskedReLU6
        out, kept = _masks_kept(net, x)
        ref_out, ref_kept = _masks_kept(ref, x)
        assert torch.equal(out, ref_out)
        # plain: the ReLU6's input (hardtanh's backward reads it) and its output (the
        # max-pool's input); compacted: neither, a 1-bit mask instead
        plane = (torch.float32, 4 * 8 * 14 * 14)
        assert ref_kept.count(plane) == 2 and plane not in kept
        assert (torch.uint8, 4 * 8 * 14 * 14 // 8) in kept
        out.sum().backward(), ref_out.sum().backward()
        torch.testing.assert_close(net[0].weight.grad, ref[0].weight.grad, rtol=0, atol=0)
    assert type(net[1]) is nn.ReLU6
