"""The GPU-free estimate: what it sees of each method (plans, phases, sparsity, kernels on fake
tensors) and its logging. Its registry-wide claim, the estimate within 10% of the run's own
tracker for every method and variant, is tests/test_registry.py's."""

import logging

import pytest
import torch
from conftest import tiny_data

from memtrain import api
from memtrain.config.schema import Trainer
from memtrain.errors import ConfigError
from memtrain.methods.checkpoint import CheckpointMethod
from memtrain.methods.prune import PruneMethod
from memtrain.models.mlp import mlp6
from memtrain.run import estimate, probes

# make test-compat runs this file on the oldest torch: fake tensors and torch's MemTracker
pytestmark = pytest.mark.compat

SMALL = ["dataset=synthetic", "dataset.image_size=16", "dataset.train_size=32",
         "dataset.test_size=8", "trainer=smoke", "trainer.max_steps=3", "trainer.batch_size=16",
         "trainer.eval_max_batches=1", "trainer.seed=0", "trainer.estimate=true"]
# The registry-wide claim (the estimate within 10% of the tracked peaks for every method and
# variant) is tests/test_registry.py's, on the walker's cases.


@pytest.mark.slow
def test_the_estimate_sees_checkpoints_plan_not_the_baseline(in_tmp):
    """The plan is profiled and applied on the fake batch: fewer activation bytes than none."""
    base = ["model=resnet18", *SMALL, "trainer.max_steps=0"]
    none = api.run([*base, "method=none"], out_dir=in_tmp / "none")
    ckpt = api.run([*base, "method=checkpoint", "method.strategy=uniform"],
                   out_dir=in_tmp / "ckpt")
    assert ckpt["mem_estimate_act_bytes"] < 0.8 * none["mem_estimate_act_bytes"]


def test_probe_steps_of_synthetic_are_its_phases():
    from memtrain.methods.synthetic import Synthetic

    method = Synthetic(partitions=3, recovery_epochs=1)

    def make():
        return method.wrap(mlp6(10, (1, 8, 8))), method

    steps = estimate.probe_steps(make, 4, (1, 8, 8), 10, torch.device("cpu"))
    assert [s.name for s in steps] == ["part0", "part1", "part2", "recovery"]
    for s in steps[:3]:  # each phase trains its own partition on its own input
        assert s.module(s.x).shape[0] == 4
    assert steps[1].x.shape[1:] == steps[0].module(steps[0].x).shape[1:]


@pytest.mark.slow
def test_prune_estimate_uses_the_configured_sparsity():
    """The kept blocks are a shape: ceil((1 - s) n) blocks of b x b values plus their int32 block
    rows and column pointers, per pruned layer (mlp6's hidden layers; the first one's input is
    the batch and the classifier is skipped): the estimate's saved bytes at two sparsities differ
    by exactly the kept blocks' difference."""
    from memtrain.kernels import bsr

    def saved(s: float) -> int:
        method = PruneMethod(sparsity=s, block_size=16, prune_shared=True)
        out = estimate.estimate_peak(lambda: (method.wrap(mlp6(10, (1, 32, 32))), method),
                                     lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                                     (1, 32, 32), 10, 64)
        return out["mem_estimate_saved_bytes"]

    def blocks(s: float) -> int:  # A is [64, K]: 4 block rows of K / 16 block columns
        return sum(bsr.n_kept(4 * k // 16, s) * (16 * 16 * 4 + 4) + (k // 16 + 1) * 4
                   for k in (1024, 1024, 512, 512))

    # between two sparsities only the kept blocks differ (the ReLU masks prune keeps before its
    # pruned layers, relu_mask=bits, are the same; at s=0 nothing would be freed: refused)
    assert saved(0.5) - saved(0.9) == blocks(0.5) - blocks(0.9)
    assert saved(0.5) - saved(0.75) == blocks(0.5) - blocks(0.75)


def test_checkpoint_probe_plans_without_printing(capsys):
    method = CheckpointMethod(strategy="uniform", dry_run=True)
    model = method.wrap(mlp6(10, (1, 8, 8)))
    (step,) = method.probe_steps(model, torch.randn(4, 1, 8, 8), torch.zeros(4).long(),
                                 autocast=None, num_classes=10)
    assert method.plan is not None and method.plan.groups and step.module is model
    assert capsys.readouterr().out == ""


def test_find_max_batch_on_the_cpu_without_a_cap_is_refused_up_front():
    with pytest.raises(ConfigError, match="set trainer.gpu_memory_gb"):
        probes.check(Trainer(find_max_batch=True, device="cpu"))
    probes.check(Trainer(find_max_batch=True, device="cpu", gpu_memory_gb=1.0))
    probes.check(Trainer(device="cpu"))


@pytest.mark.slow
def test_each_probe_step_is_logged(in_tmp, caplog):
    caplog.set_level(logging.INFO, logger="memtrain")
    base = ["model=mlp6", "method=prune", "method.block_size=16", *SMALL, "trainer.max_steps=0"]
    need = api.run(base, out_dir=in_tmp / "e")["mem_estimate_bytes"]  # batch 16
    row = api.run([*base, "trainer.find_max_batch=true", f"trainer.gpu_memory_gb={need / 2**30!r}",
                   "trainer.max_batch_headroom=0", "trainer.cuda_context_gb=0"],  # no margin
                  out_dir=in_tmp / "r")
    assert row["status"] == "ok" and 16 <= row["max_batch_size"] < 32
    lines = [r.getMessage() for r in caplog.records if "find_max_batch: batch" in r.message]
    assert any(line.startswith("find_max_batch: batch 16: estimate") and line.endswith(": fits")
               for line in lines)
    assert any(line.startswith("find_max_batch: batch 32: estimate")
               and line.endswith(": does not fit") for line in lines)
    assert "estimate: batch 16: peak" in caplog.text
    assert f"find_max_batch: largest batch that fits: {row['max_batch_size']}" in caplog.text


@pytest.mark.slow
def test_cli_find_max_batch_on_the_cpu_without_a_cap_is_one_line_and_no_folder(tmp_path):
    from conftest import run_memtrain

    if torch.cuda.is_available():
        pytest.skip("trainer.device=auto is a GPU here")
    p = run_memtrain("model=mlp6", "trainer=smoke", "trainer.max_steps=0",
                     "trainer.find_max_batch=true", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "memtrain: error: trainer.find_max_batch on the CPU compares the estimate with a memory "
        "cap: set trainer.gpu_memory_gb (GiB), or run on a GPU"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("model,extra", [
    # per-channel stats, ReLU masks, BatchNorm's inputs (the decoder holds it on the old torch)
    pytest.param("resnet18", ["method.bits=2"], marks=pytest.mark.breadth),
    ("gpt_nano", ["model.layers=2", "trainer.precision=bf16"])])
def test_quantize_estimate_is_the_same_with_its_kernels_replayed(tmp_path, monkeypatch, model,
                                                                 extra):
    """memtrain.kernels.replayed_on_fake stands in for the torch path's ops on fake tensors: the
    estimate of a quantized step, every column of it, is the one the ops themselves give."""
    import memtrain.kernels as kernels

    class Never(dict):  # every call runs the torch path's ops
        def __setitem__(self, key, value):
            super().__setitem__(key, None)

    cmd = [f"model={model}", "method=quantize", *tiny_data(model, image_size=8), "trainer=smoke",
           "trainer.max_steps=0", "trainer.batch_size=4", "trainer.estimate=true", *extra]
    rows = {}
    for name, traces in (("replayed", {}), ("ran", Never())):
        monkeypatch.setattr(kernels, "_traces", traces)
        rows[name] = api.run(cmd, out_dir=tmp_path / name)
        assert rows[name]["status"] == "ok", rows[name].get("error")
    assert kernels._traces and all(t is None for t in kernels._traces.values())
    cols = {k for k in rows["ran"] if k.startswith("mem_estimate") and k.endswith("_bytes")}
    assert len(cols) > 8, cols
    assert {k: rows["replayed"][k] for k in cols} == {k: rows["ran"][k] for k in cols}


def test_triton_launchers_on_fake_tensors_only_allocate_their_outputs():
    """What pool's and prune's kernels allocate, with no launch (a fake tensor has no data)."""
    from memtrain.kernels import bitmask, bsr, is_fake, triton_available
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not triton_available():
        pytest.skip("triton is not installed")
    from memtrain.kernels import block_sparse as kernels

    with FakeTensorMode():
        x = torch.randn(4, 33)
        bits = bitmask.pack_triton(x)
        assert is_fake(bits) and bits.shape == (bitmask.n_bytes(132),)
        assert bitmask.masked_grad_triton(x, bits).shape == x.shape
        a = torch.randn(40, 70)  # 3 x 5 blocks of 16
        scores = kernels.block_scores(a, 16)
        rows, cols, col_ptr = bsr.select_blocks(scores, 0.5)
        values = kernels.compact_blocks(a, rows, cols, 16)
        assert scores.shape == (3, 5) and values.shape == (bsr.n_kept(15, 0.5), 16, 16)
        assert col_ptr.shape == (6,)
        grad_w = kernels.bsr_grad_weight(torch.randn(40, 24), values, rows, col_ptr, 70)
        assert grad_w.shape == (24, 70)


def test_the_estimate_says_what_it_does_before_and_how_long_after(tmp_path, caplog):
    """A probe that can take a minute (resnet50's quantize estimate: 88 s) is not silent: a line
    before it starts, and its time with the result."""
    from memtrain import api

    with caplog.at_level("INFO", logger="memtrain"):
        api.run(["model=mlp6", "trainer=smoke", "dataset.image_size=8", "trainer.estimate=true",
                 "trainer.max_steps=0"], out_dir=tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("estimate:")]
    assert len(lines) == 2, lines
    assert lines[0].endswith("building the model, applying the method, running one training "
                             "step ...")
    assert " s)" in lines[1] and "peak" in lines[1]


class _Unused(torch.nn.Module):
    """An MLP with a trainable layer its forward never calls: a real first step leaves that
    layer's parameters without gradients, so without optimizer state."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 10))
        self.spare = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.body(x.flatten(1))


@pytest.mark.parametrize("build", [lambda: mlp6(10, (1, 4, 8)), _Unused], ids=["mlp6", "unused"])
def test_the_estimates_optimizer_state_is_a_real_first_steps(monkeypatch, build):
    """The estimate gives the optimizer its state without a first forward and backward
    (`_optimizer_state`); with momentum and Adam, the tracked step is the one a real first step
    leaves, also when a parameter gets no gradient (then the real first step is run instead)."""
    for make_opt in (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                     lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)):
        def peak(make_opt=make_opt):
            torch.manual_seed(0)
            return estimate.estimate_peak(lambda: (build(), None), make_opt, (1, 4, 8), 10, 8)

        steps, step = [], estimate.training_step
        monkeypatch.setattr(estimate, "training_step", lambda *a, steps=steps, step=step, **k:
                            steps.append(1) or step(*a, **k))
        quick = peak()
        monkeypatch.undo()
        # the tracked step alone; where a parameter got no gradient, a real first step and
        # the tracked step again
        assert len(steps) == (1 if build is not _Unused else 3)
        monkeypatch.setattr(estimate, "_optimizer_state", lambda module, opt: estimate
                            .training_step(module, opt, *estimate.random_batch(8, (1, 4, 8), 10,
                                                                                torch.device("cpu"))))
        real = peak()
        monkeypatch.undo()
        assert quick == real
        model = build()
        used = [p for n, p in model.named_parameters() if not n.startswith("spare.")]
        # by hand: SGD's momentum, or Adam's two moments and its fp32 step count, for the
        # parameters that get gradients only
        adam = isinstance(make_opt(model), torch.optim.AdamW)
        state = sum((2 if adam else 1) * p.numel() * 4 + (4 if adam else 0) for p in used)
        assert quick["mem_estimate_at_peak_optim_bytes"] == state


def test_batchnorm_statistics_on_fake_tensors_run_no_real_kernel():
    """checkpoint's split BatchNorm calls aten::batch_norm_update_stats, which torch has no meta
    kernel for: fake tensors ran the real kernel on zeros of the input's size. With memtrain's
    meta kernel an input of 2^40 elements (4 TiB, never allocatable) is estimated, and the
    outputs' shapes and dtypes are the real kernel's in each dtype case."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import memtrain.methods.checkpoint.batchnorm  # noqa: F401  (registers the kernel)

    with FakeTensorMode():
        x = torch.empty(2 ** 20, 64, 128, 128)
        mean, var = torch.batch_norm_update_stats(x, torch.zeros(64), torch.ones(64), 0.1)
        assert mean.shape == var.shape == (64,)
    for dtype, running in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                           (torch.bfloat16, None)):
        x = torch.randn(4, 3, 5, 5).to(dtype)
        stats = () if running is None else (torch.zeros(3, dtype=running),
                                            torch.ones(3, dtype=running))
        real = torch.batch_norm_update_stats(x, *(stats or (None, None)), 0.1)
        with FakeTensorMode() as fake:
            faked = torch.batch_norm_update_stats(fake.from_tensor(x),
                                                  *[fake.from_tensor(s) for s in stats]
                                                  or (None, None), 0.1)
        assert [(t.shape, t.dtype) for t in faked] == [(t.shape, t.dtype) for t in real]
