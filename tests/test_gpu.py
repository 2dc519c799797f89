"""CUDA-only checks of the measurement protocol (skipped without a GPU)."""

import pytest

from memtrain import api

pytestmark = pytest.mark.gpu


def test_cuda_peak_and_breakdown(in_tmp):
    row = api.run(["trainer=smoke", "model=resnet18", "trainer.device=cuda",
                   "trainer.batch_size=32", "trainer.max_steps=6"], out_dir=in_tmp / "r")
    assert row["status"] == "ok" and row["mem_peak_source"] == "cuda"
    parts = sum(row[f"mem_at_peak_{k}_bytes"] for k in ("params", "grads", "optim", "act",
                                                        "other"))
    assert parts >= row["mem_peak_alloc_bytes"]  # other absorbs what the tracker did not see
    assert row["mem_peak_reserved_bytes"] >= row["mem_peak_alloc_bytes"]
    # the CUDA peak holds at least the weights, their momentum and the saved activations
    assert row["mem_peak_alloc_bytes"] >= (row["mem_params_bytes"] + row["mem_optim_bytes"]
                                           + 0.5 * row["mem_act_saved_bytes"])
