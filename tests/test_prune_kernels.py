"""method=prune, kernel level: Triton kernels (TRITON_INTERPRET=1 on the CPU) and the torch backend
against the eager oracles of kernels/reference.py."""

import os

import pytest
import torch
from memtrain.kernels import bsr
from memtrain.kernels import reference as ref

# make test-compat runs this file on the oldest torch: the Triton prune kernels
pytestmark = pytest.mark.compat

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRET, reason="Triton on the CPU needs TRITON_INTERPRET=1 (make test sets it)"))]

# (M, K, N, b): non-divisible, divisible, b larger than K, a column with one row of blocks
SHAPES = [(50, 70, 24, 16), (64, 48, 32, 16), (33, 20, 17, 32), (96, 130, 40, 32)]


def _case(m, k, n, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(dtype)
    g = torch.randn(m, n, generator=gen).to(dtype)
    return a, g


def _run(a, g, spec):
    bs = bsr.compress(a, spec)
    return bs, bsr.grad_weight(g, bs, spec.backend)


def _kept(bs):
    """(row, col) of every kept block, in storage order."""
    counts = (bs.col_ptr[1:] - bs.col_ptr[:-1]).long()
    cols = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    return list(zip(bs.rows.tolist(), cols.tolist()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("criterion", ["l2", "l1"])
@pytest.mark.parametrize("m,k,n,b", SHAPES)
def test_scores_selection_values_and_grad_weight_equal_reference(m, k, n, b, criterion, backend):
    a, g = _case(m, k, n)
    scores = ref.prune_block_scores_ref(a, b, criterion)
    if backend == "triton":
        from memtrain.kernels import block_sparse as kernels

        got = kernels.block_scores(a, b, criterion)
    else:
        got = bsr.block_scores_torch(bsr._block_view(a, b), criterion)
    torch.testing.assert_close(got, scores, rtol=1e-5, atol=1e-5)
    n_blocks = scores.numel()
    # all kept, half, a single block left
    for s, count in ((0.0, n_blocks), (0.5, -(-n_blocks // 2)), (1 - 0.5 / n_blocks, 1)):
        bs, gw = _run(a, g, bsr.PruneSpec(s, b, criterion, backend))
        kept = ref.prune_topk_ref(scores, s)
        assert _kept(bs) == kept
        assert len(kept) == count
        assert bs.rows.dtype == bs.col_ptr.dtype == torch.int32
        assert torch.equal(bs.values, ref.prune_compact_ref(a, kept, b))
        torch.testing.assert_close(gw.double(), ref.prune_grad_weight_ref(g, a, kept, b),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_values_bitwise_and_grad_weight_within_bf16_rounding(backend):
    a, g = _case(50, 70, 24, torch.bfloat16)
    bs, gw = _run(a, g, bsr.PruneSpec(0.5, 16, "l2", backend))
    kept = ref.prune_topk_ref(ref.prune_block_scores_ref(a, 16), 0.5)
    assert _kept(bs) == kept
    assert bs.values.dtype == gw.dtype == torch.bfloat16
    assert torch.equal(bs.values, ref.prune_compact_ref(a, kept, 16))
    exact = ref.prune_grad_weight_ref(g, a, kept, 16)
    # products of bf16 are exact in fp32; the only rounding left is the bf16 result (2^-8 rel.)
    torch.testing.assert_close(gw.double(), exact, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparsity_zero_gives_the_dense_grad_weight(backend):
    a, g = _case(64, 96, 40)
    bs, gw = _run(a, g, bsr.PruneSpec(0.0, 32, "l2", backend))
    assert bs.values.numel() == a.numel()
    dense = g.t().mm(a)
    # a different summation order (torch: a block at a time, since at s=0 the blocks save
    # nothing and a strip may be one block; Triton: its tiles): fp32 rounding only
    torch.testing.assert_close(gw, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_split_k_partial_sums_equal_single_pass():
    from memtrain.kernels import block_sparse as kernels

    a, g = _case(160, 48, 20)
    bs = bsr.compress(a, bsr.PruneSpec(0.25, 16, "l2", "triton"))
    one = kernels.bsr_grad_weight(g, bs.values, bs.rows, bs.col_ptr, 48, split=1)
    three = kernels.bsr_grad_weight(g, bs.values, bs.rows, bs.col_ptr, 48, split=3)
    torch.testing.assert_close(three, one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_blocks_are_the_planted_high_norm_blocks(backend):
    a = torch.full((64, 64), 0.01)
    planted = [(0, 3), (1, 1), (2, 0), (3, 2)]  # b=16: a 4 x 4 block grid
    for i, j in planted:
        a[i * 16:(i + 1) * 16, j * 16:(j + 1) * 16] = -3.0  # large by norm, negative by sign
    bs = bsr.compress(a, bsr.PruneSpec(0.75, 16, "l1", backend))
    assert sorted(_kept(bs)) == sorted(planted)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_keep_the_lowest_row_major_indices(backend):
    a = torch.ones(48, 48)  # 3 x 3 equal blocks at b=16, keep ceil(0.5 * 9) = 5
    bs = bsr.compress(a, bsr.PruneSpec(0.5, 16, "l2", backend))
    assert sorted(_kept(bs)) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


def test_storage_is_torch_bsc_of_the_masked_padded_matrix():
    a, _ = _case(50, 70, 1)
    bs = bsr.compress(a, bsr.PruneSpec(0.6, 16, "l2", "torch"))
    dense = bs.to_torch_bsc().to_dense()
    assert dense.shape == (64, 80)
    mask = ref.prune_mask_ref((50, 70), _kept(bs), 16)
    assert torch.equal(dense[:50, :70], a * mask)
    assert not dense[50:].any() and not dense[:, 70:].any()


def test_n_kept_is_ceil_and_keeps_all_at_zero():
    assert bsr.n_kept(10, 0.0) == 10
    assert bsr.n_kept(10, 0.5) == 5
    assert bsr.n_kept(10, 0.55) == 5  # ceil(4.5)
    assert bsr.n_kept(10, 0.9) == 1
    assert bsr.n_kept(7, 0.99) == 1
    assert bsr.n_kept(100, 0.7) == 30  # (1 - 0.7) * 100 is 30.000000000000004 in floats


def test_torch_grad_weight_never_densifies_the_matrix(monkeypatch):
    """The torch backend's transient in backward is a strip of at most half what the blocks
    saved (`strip_rows`), never the dense A: otherwise backward takes back what forward saved.
    Every allocation of the product is recorded and held to that bound, and the result equals
    the reference (the kept blocks scattered into A, one mm)."""
    a, g = _case(250, 32, 24)  # 8 x 1 blocks of 32 (6 padding rows): at s=0.75, 2 kept
    bs = bsr.compress(a, bsr.PruneSpec(0.75, 32, "l2", "torch"))
    per = bsr.strip_rows(250, 32, 32, bs.values.shape[0])
    saved = (250 * 32 - bs.values.numel()) * 4
    assert per * 32 * 32 * 4 <= saved // 2 and per == 2  # several strips per column here
    sizes = []
    real = torch.Tensor.new_zeros

    def spy(self, *shape, **kw):
        t = real(self, *shape, **kw)
        sizes.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(torch.Tensor, "new_zeros", spy)
    gw = bsr.grad_weight_torch(g, bs)
    monkeypatch.undo()
    out, *strips = sizes
    assert out == 24 * 32 * 4 and strips and max(strips) <= saved // 2
    torch.testing.assert_close(gw, ref.prune_grad_weight_ref(g, a, _kept(bs), 32).float(),
                               rtol=1e-5, atol=1e-4)
