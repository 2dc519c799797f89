"""The GPU-free estimate against the run's own tracker, registry-wide: every method under
conf/method (and the variants that change what a run measures: checkpoint's strategies,
synthetic's inputs and recovery) on mlp6 and resnet18, small sizes. The estimate claims to
predict the tracker's total peak (`mem_tracker_peak_bytes`, the CPU's `mem_peak_alloc_bytes`)
and its activation peak (`mem_peak_act_bytes`, recomputation included): both within 10%."""

import logging

import pytest
import torch
from conftest import conf_options

from memtrain import api, estimate, probes
from memtrain.errors import ConfigError
from memtrain.methods.checkpoint import CheckpointMethod
from memtrain.methods.prune import PruneMethod
from memtrain.models.mlp import mlp6
from memtrain.schema import Trainer

SMALL = ["dataset=synthetic", "dataset.image_size=16", "dataset.train_size=32",
         "dataset.test_size=8", "trainer=smoke", "trainer.max_steps=3", "trainer.batch_size=16",
         "trainer.eval_max_batches=1", "trainer.seed=0", "trainer.estimate=true"]
# Beyond each method's defaults: the options that change what its run measures.
VARIANTS = {
    "checkpoint": [["method.strategy=uniform"], ["method.strategy=sqrt"],
                   ["method.strategy=selective"]],
    "synthetic": [["method.right_input=left"],
                  ["method.recovery_epochs=1", "trainer.epochs=2", "dataset.train_size=64"]],
    "prune": [["method.sparsity=0.9", "method.block_size=16", "method.prune_shared=true"]],
    "pool": [["method.targets=conv+bn"]],
}
# checkpoint's default budget (half of none's activation peak) is infeasible on mlp6, whose
# smallest feasible plan keeps ~0.62 of it: the run refuses it, so the estimate has no row to match
DEFAULTS = {"checkpoint": ["method.budget_fraction=0.7"],
            # a stack: the probe must apply checkpoint's plan to the quantized model
            "checkpoint+quantize": ["method.checkpoint.strategy=uniform"]}
CASES = [(method, extra) for method in conf_options("method")
         for extra in [DEFAULTS.get(method, []), *VARIANTS.get(method, [])]]
PAIRS = {"mem_estimate_bytes": "mem_tracker_peak_bytes",
         "mem_estimate_act_bytes": "mem_peak_act_bytes"}
RATIOS: dict[str, float] = {}  # printed with -s: the figures the note quotes


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp6", "resnet18"])
@pytest.mark.parametrize("method,extra", CASES, ids=[" ".join([m, *e]) for m, e in CASES])
def test_estimate_is_within_10_percent_of_the_tracked_peak(tmp_path, model, method, extra):
    if method == "offload":  # its run refuses the CPU (nothing to offload to): tests/test_offload
        pytest.skip("offload runs on CUDA only; its hooks are tested on the CPU in test_offload")
    row = api.run([f"model={model}", f"method={method}", *SMALL, *extra],
                  out_dir=tmp_path / "r")
    assert row["status"] == "ok", row.get("error")
    assert "mem_estimate_error" not in row, row["mem_estimate_error"]
    if method == "synthetic":  # the row is the largest phase's, and so is the estimate
        assert row["mem_estimate_phase"] == row["synthetic_largest_phase"]
        assert row["mem_estimate_act_phase"] == row["synthetic_largest_act_phase"]
    for est, real in PAIRS.items():
        ratio = row[est] / row[real]
        RATIOS[f"{model} {method} {' '.join(extra)} {real}"] = ratio
        print(f"{model} {method} {' '.join(extra)}: {est}/{real} = {ratio:.4f}")
        assert abs(ratio - 1) < 0.10, (est, row[est], real, row[real])


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


def test_prune_estimate_uses_the_configured_sparsity():
    """The kept blocks are a shape: ceil((1 - s) n) blocks of b x b values plus their int32 block
    rows and column pointers, per pruned layer (mlp6's hidden layers; the first one's input is
    the batch and the classifier is skipped), on top of what s=0 (the baseline's path) saves."""
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

    dense = saved(0.0)
    for s in (0.5, 0.9):
        assert saved(s) - dense == blocks(s)


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


def test_each_probe_step_is_logged(in_tmp, caplog):
    caplog.set_level(logging.INFO, logger="memtrain")
    base = ["model=mlp6", "method=prune", *SMALL, "trainer.max_steps=0"]
    need = api.run(base, out_dir=in_tmp / "e")["mem_estimate_bytes"]  # batch 16
    row = api.run([*base, "trainer.find_max_batch=true", f"trainer.gpu_memory_gb={need / 2**30!r}"],
                  out_dir=in_tmp / "r")
    assert row["status"] == "ok" and 16 <= row["max_batch_size"] < 32
    lines = [r.getMessage() for r in caplog.records if "find_max_batch: batch" in r.message]
    assert any(line.startswith("find_max_batch: batch 16: estimate") and line.endswith(": fits")
               for line in lines)
    assert any(line.startswith("find_max_batch: batch 32: estimate")
               and line.endswith(": does not fit") for line in lines)
    assert "estimate: batch 16: peak" in caplog.text
    assert f"find_max_batch: largest batch that fits: {row['max_batch_size']}" in caplog.text


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


def test_triton_launchers_on_fake_tensors_only_allocate_their_outputs():
    """What pool's and prune's kernels allocate, with no launch (a fake tensor has no data)."""
    from memtrain.kernels import bitmask, bsr, is_fake, triton_available
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not triton_available():
        pytest.skip("triton is not installed")
    from memtrain.kernels import prune as kernels

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
