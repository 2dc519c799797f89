"""CUDA-only checks (skipped without a GPU; `pytest -m gpu` on a GPU box): the measurement
protocol against a hand-written loop, the memory cap, find_max_batch, compile, and the Triton
kernels compiled (not interpreted) against the eager oracles."""

import os

import pytest
import torch

from memtrain import api

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]
TINY = ["trainer=smoke", "trainer.device=cuda", "trainer.max_steps=6", "trainer.warmup_steps=2"]


def test_cuda_peak_breakdown_against_independent_counts(in_tmp):
    over = [*TINY, "model=resnet18", "trainer.batch_size=32"]
    row = api.run(over, out_dir=in_tmp / "r")
    assert row["status"] == "ok" and row["mem_peak_source"] == "cuda"
    _, model, _ = api.build(over)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # each part the tracker saw at its peak against what this test counts itself: the
    # parameters, SGD's momentum buffers (one per parameter: optim=sgd), at most one gradient each
    assert row["mem_at_peak_params_bytes"] == row["mem_params_bytes"] == params
    assert row["mem_at_peak_optim_bytes"] == row["mem_optim_bytes"] == params
    assert 0 <= row["mem_at_peak_grads_bytes"] <= params
    assert row["mem_at_peak_act_bytes"] > 0
    # CUDA allocated at least what the tracker saw live: "other" is not clamped at 0, so a
    # tracker that overcounts shows here as a negative rest
    tracked = sum(row[f"mem_at_peak_{k}_bytes"] for k in ("params", "grads", "optim", "update",
                                                           "act"))
    assert row["mem_at_peak_other_bytes"] == row["mem_peak_alloc_bytes"] - tracked
    assert row["mem_at_peak_other_bytes"] >= 0, row
    assert row["mem_peak_reserved_bytes"] >= row["mem_peak_alloc_bytes"]


def test_checkpoint_rng_states_are_host_memory(in_tmp):
    """Checkpoint keeps, per recomputed group, the CPU RNG state and the GPU's (both host
    tensors) from its forward to its recomputation, and one more set while it recomputes: in
    `mem_rng_state_bytes`, in no GPU column."""
    over = [*TINY, "model=mlp6", "trainer.batch_size=32", "method=checkpoint",
            "method.strategy=uniform", "method.every=2"]
    row = api.run(over, out_dir=in_tmp / "r")
    assert row["status"] == "ok", row.get("error")
    groups = len(str(row["plan_groups"]).split(";"))
    one = torch.get_rng_state().untyped_storage().nbytes() + \
        torch.cuda.get_rng_state().untyped_storage().nbytes()
    assert row["mem_rng_state_bytes"] == (groups + 1) * one


def _plain_loop_peak(model: torch.nn.Module, batch: int, steps: int, shape) -> int:
    """max_memory_allocated of a hand-written SGD loop over random batches (no memtrain code)."""
    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, *shape, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")
    for i in range(steps):
        if i == 2:  # after warm-up: momentum buffers exist, as in memtrain's timed steps
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_cuda_peak_equals_a_plain_loop(in_tmp):
    over = [*TINY, "model=mlp6", "trainer.batch_size=256", "dataset.image_size=28",
            "optim=sgd", "optim.weight_decay=0", "optim.nesterov=false"]
    row = api.run(over, out_dir=in_tmp / "r")
    data, model, _ = api.build(over)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    plain = _plain_loop_peak(model, 256, 6, data.input_shape) - base
    # the same model, batch and optimizer: equal up to the batch tensors memtrain makes itself
    batch_bytes = 256 * (4 * int(torch.tensor(data.input_shape).prod()) + 8)
    assert abs(row["mem_peak_alloc_bytes"] - plain) <= 2 * batch_bytes + 2**20, (row, plain)


def test_memory_cap_is_honoured_and_oom_is_a_row(in_tmp):
    row = api.run([*TINY, "model=resnet50", "dataset.image_size=224", "trainer.batch_size=512",
                   "trainer.gpu_memory_gb=2"], out_dir=in_tmp / "r")
    assert row["status"] == "oom"
    assert row["gpu_memory_cap_bytes"] == 2 * 2**30 and row["gpu_memory_cap_applied"]
    ok = api.run([*TINY, "model=resnet18", "trainer.batch_size=8", "trainer.gpu_memory_gb=2"],
                 out_dir=in_tmp / "ok")
    assert ok["status"] == "ok" and ok["mem_peak_alloc_bytes"] <= 2 * 2**30


def test_find_max_batch_on_cuda_fits_and_double_does_not(in_tmp):
    over = [*TINY, "model=resnet18", "dataset.image_size=64", "trainer.gpu_memory_gb=1"]
    row = api.run([*over, "trainer.find_max_batch=true", "trainer.max_steps=0"],
                  out_dir=in_tmp / "probe")
    best = row["max_batch_size"]
    assert best >= 1
    assert api.run([*over, f"trainer.batch_size={best}"], out_dir=in_tmp / "a")["status"] == "ok"
    assert api.run([*over, f"trainer.batch_size={2 * best}"],
                   out_dir=in_tmp / "b")["status"] == "oom"


def test_compile_budget_lowers_the_cuda_peak(in_tmp):
    base = [*TINY, "model=resnet18", "dataset.image_size=64", "trainer.batch_size=64",
            "method=checkpoint", "method.strategy=compile"]
    full = api.run([*base, "method.budget_fraction=1.0"], out_dir=in_tmp / "full")
    low = api.run([*base, "method.budget_fraction=0.2"], out_dir=in_tmp / "low")
    assert full["status"] == low["status"] == "ok"
    assert low["mem_peak_alloc_bytes"] < full["mem_peak_alloc_bytes"]


def test_bf16_prune_path_trains_and_saves_memory(in_tmp):
    base = [*TINY, "model=resmlp12", "trainer.precision=bf16", "trainer.batch_size=64"]
    none = api.run([*base, "method=none"], out_dir=in_tmp / "none")
    pruned = api.run([*base, "method=prune", "method.sparsity=0.9", "method.backend=triton"],
                     out_dir=in_tmp / "prune")
    assert none["status"] == pruned["status"] == "ok"
    assert pruned["mem_act_saved_bytes"] < none["mem_act_saved_bytes"]
    assert pruned["mem_peak_alloc_bytes"] < none["mem_peak_alloc_bytes"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_prune_kernels_equal_the_oracles(dtype):
    from memtrain.kernels import bsr
    from memtrain.kernels import reference as ref

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(300, 200, generator=gen).to(dtype)
    g = torch.randn(300, 96, generator=gen).to(dtype)
    for s in (0.0, 0.5, 0.9):
        spec = bsr.PruneSpec(s, 32, "l2", "triton")
        bs = bsr.compress(a.cuda(), spec)
        gw = bsr.grad_weight(g.cuda(), bs, "triton").cpu()
        counts = (bs.col_ptr[1:] - bs.col_ptr[:-1]).long().cpu()
        cols = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        kept = list(zip(bs.rows.cpu().tolist(), cols.tolist()))
        assert kept == ref.prune_topk_ref(ref.prune_block_scores_ref(a, 32), s)
        want = ref.prune_grad_weight_ref(g, a, kept, 32)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
        torch.testing.assert_close(gw.double(), want, rtol=tol, atol=tol * want.abs().max())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only")
def test_compiled_bitmask_kernels_equal_the_oracle():
    from memtrain.kernels import bitmask
    from memtrain.kernels import reference as ref

    x = torch.randn(10_007, device="cuda")
    bits = bitmask.pack_triton(x)
    assert torch.equal(bits.cpu(), ref.pool_pack_mask(x.cpu()))
    grad = torch.randn_like(x)
    assert torch.equal(bitmask.masked_grad_triton(grad, bits).cpu(),
                       ref.pool_masked_grad(grad.cpu(), bits.cpu()))


def test_cuda_memory_series_end_at_the_rows_peak(in_tmp):
    """metrics.csv on CUDA: allocated memory at every logged step, the allocator's peak from
    the first timed step on (the window the row's peak covers), its last value the row's."""
    import csv

    row = api.run([*TINY, "model=mlp6", "trainer.log_every=1"], out_dir=in_tmp / "r")
    with open(in_tmp / "r" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "train"]
    named = lambda n: [(int(r["step"]), float(r["value"])) for r in rows  # noqa: E731
                       if r["name"] == n]
    assert [s for s, _ in named("mem_alloc_bytes")] == list(range(6))
    peak = named("mem_peak_alloc_bytes")
    assert [s for s, _ in peak] == list(range(2, 6))  # warm-up 0-1 outside the window
    assert peak[-1][1] == row["mem_peak_alloc_bytes"]
    assert named("mem_peak_reserved_bytes")[-1][1] == row["mem_peak_reserved_bytes"]


def test_the_cuda_estimate_of_gpt2_small_is_the_formula():
    """The estimate of gpt2_small (1024 tokens, batch 8, bf16-true, math attention,
    dropout 0.1) for CUDA, backward included: its saved bytes are 12 layers of Korthikanti's
    s*b*h*(34 + 5*a*s/h) (CUDA's 1-byte dropout masks) within 5%."""
    from memtrain.data import tokens
    from memtrain.run import estimate, runner

    cfg, _ = api.compose(["model=gpt2_small", "model.dropout=0.1", "dataset.seq_len=1024",
                          "dataset.train_size=8", "dataset.test_size=8",
                          "trainer.precision=bf16-true", "trainer.device=cuda"])
    data = tokens.tokens(seq_len=1024, train_size=8, test_size=8)
    out = estimate.estimate_peak(lambda: runner.make_model(cfg, data),
                                 lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                                 data.input_shape, data.num_classes, 8, "bf16-true", "cuda",
                                 "lm")
    s, b, h, a = 1024, 8, 768, 12
    assert out["mem_estimate_device"] == "cuda"
    assert out["mem_estimate_saved_bytes"] == pytest.approx(12 * s * b * h * (34 + 5 * a * s / h),
                                                            rel=0.05)


def test_offloads_gpu_free_estimate_against_its_cuda_run(in_tmp):
    """memtrain-willfit's offload rows come from the estimate on a machine without a GPU: fake
    tensors of the CPU standing in for the card, the host copies none of its memory. Against a
    CUDA run of the same step: the card's saved bytes within 5%, the activation peak and the
    tracker's peak within 10% (the registry's bar for every other method's estimate)."""
    from memtrain.optim import build_optimizer
    from memtrain.preflight import build_data, kwargs_of
    from memtrain.run import estimate, runner

    over = [*TINY, "model=resnet18", "trainer.batch_size=32", "method=offload"]
    row = api.run(over, out_dir=in_tmp / "r")
    assert row["status"] == "ok" and row["mem_act_saved_host_bytes"] > 0, row.get("error")
    cfg, _ = api.compose(over)
    data, optim = build_data(cfg), kwargs_of(cfg.optim)
    est = estimate.estimate_peak(lambda: runner.make_model(cfg, data),
                                 lambda m: build_optimizer(m, **optim), data.input_shape,
                                 data.num_classes, 32, "fp32", "cpu")
    assert est["mem_estimate_saved_bytes"] == pytest.approx(row["mem_act_saved_bytes"], rel=0.05)
    assert est["mem_estimate_act_bytes"] == pytest.approx(row["mem_peak_act_bytes"], rel=0.10)
    assert est["mem_estimate_bytes"] == pytest.approx(row["mem_tracker_peak_bytes"], rel=0.10)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_gpu_row_of_each_strategy(in_tmp, strategy):
    """trainer.strategy=ddp|fsdp on one GPU without a launcher (nccl, a group of one): an ok
    row whose loss is one process's, the CUDA peak beside the tracker's breakdown, the whole
    model state on the one rank; offload (CUDA only) composes with the strategy."""
    over = [*TINY, "model=resnet18", "trainer.batch_size=16", "trainer.save_weights=true"]
    one = api.run(over, out_dir=in_tmp / "one")
    row = api.run([*over, f"trainer.strategy={strategy}"], out_dir=in_tmp / strategy)
    assert row["status"] == "ok" and row["mem_peak_source"] == "cuda", row.get("error")
    assert row["world_size"] == 1 and row["local_batch_size"] == 16
    assert row["mem_params_bytes"] == one["mem_params_bytes"]
    assert row["train_loss"] == pytest.approx(one["train_loss"], rel=1e-4)
    off = api.run([*over, f"trainer.strategy={strategy}", "method=offload"],
                  out_dir=in_tmp / "offload")
    assert off["status"] == "ok", off.get("error")
    assert off["mem_act_saved_host_bytes"] > 0
    assert off["mem_peak_act_bytes"] < row["mem_peak_act_bytes"]
