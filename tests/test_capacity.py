"""Smaller-GPU simulation, the largest batch that fits, one GPU per job, the GPU-free estimate."""

import logging

import pytest
import torch

from memtrain import api, capacity
from memtrain.errors import ConfigError

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8"]


@pytest.mark.parametrize("limit,largest,start", [
    (1000, 37, 1), (1000, 37, 128), (1000, 0, 1), (1000, 1000, 4), (64, 64, 64), (1000, 1, 8),
])
def test_find_max_batch_with_an_injected_oom(limit, largest, start):
    tried = []

    def fits(b):  # an OOM predicate: batches above `largest` run out of memory
        tried.append(b)
        return b <= largest

    assert capacity.find_max_batch(fits, limit, start) == largest
    assert len(tried) <= 2 * (limit.bit_length() + 1)  # logarithmic, not a scan
    assert all(1 <= b <= limit for b in tried)


def test_cuda_fits_frees_and_reports_oom_as_false(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def make_step(b):
        def step():
            if b > 10:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return step

    fits = capacity.cuda_fits(make_step, torch.device("cpu"))
    assert capacity.find_max_batch(fits, 100) == 10


def test_gpu_cap_on_cpu_is_recorded_as_not_applied():
    assert capacity.apply_gpu_cap(torch.device("cpu"), 8) == {
        "gpu_memory_cap_bytes": 8 * 2**30, "gpu_memory_cap_applied": False}
    assert capacity.apply_gpu_cap(torch.device("cpu"), None) == {}
    with pytest.raises(ConfigError, match=r"trainer.gpu_memory_gb must be in \(0, inf\]"):
        capacity.apply_gpu_cap(torch.device("cpu"), 0)


def test_gpu_slots_never_collide(tmp_path):
    with capacity.claim_slot(2, tmp_path) as a, capacity.claim_slot(2, tmp_path) as b:
        assert {a, b} == {0, 1}
        with pytest.raises(TimeoutError), capacity.claim_slot(2, tmp_path, 0.01, 0.05):
            pass
    with capacity.claim_slot(2, tmp_path) as c:  # released on exit
        assert c == 0


@pytest.mark.slow
def test_find_max_batch_on_cpu_uses_the_estimate_under_the_cap(in_tmp):
    base = [*TINY, "trainer.max_steps=0", "trainer.find_max_batch=true"]
    with pytest.raises(ConfigError, match="set trainer.gpu_memory_gb"):
        api.run(base, out_dir=in_tmp / "nocap")
    small = api.run([*base, "trainer.gpu_memory_gb=0.04"], out_dir=in_tmp / "a")
    big = api.run([*base, "trainer.gpu_memory_gb=0.08", "trainer.estimate=true"],
                  out_dir=in_tmp / "b")
    assert small["status"] == big["status"] == "ok" and "steps" not in big  # probes only
    assert 1 <= small["max_batch_size"] < big["max_batch_size"]
    assert big["mem_estimate_bytes"] > 0


def test_estimate_matches_the_saved_bytes_accounting(in_tmp):
    """On fake tensors, no data: activations within 10% of the real step's saved bytes."""
    args = ["trainer=smoke", "model=resnet18", "dataset.image_size=8", "trainer.batch_size=16",
            "trainer.max_steps=2", "trainer.eval_max_batches=1", "trainer.estimate=true"]
    row = api.run(args, out_dir=in_tmp / "r")
    assert row["status"] == "ok" and row["mem_estimate_device"] == "cpu"
    for est, real in (("mem_estimate_act_bytes", "mem_act_saved_bytes"),
                      ("mem_estimate_saved_bytes", "mem_act_saved_bytes"),
                      ("mem_estimate_act_bytes", "mem_peak_act_bytes"),
                      ("mem_estimate_bytes", "mem_peak_alloc_bytes")):
        assert abs(row[est] / row[real] - 1) < 0.10, (est, row[est], real, row[real])


@pytest.mark.slow
def test_pool_estimate_and_real_steps_share_a_process(in_tmp):
    """pool's bit-mask weights were cached across modes: the estimate's fake tensor broke the
    real steps after it (and a real one the next estimate): `make results`' probes found it."""
    args = [*TINY, "method=pool", "trainer.estimate=true", "trainer.max_steps=2"]
    first = api.run(args, out_dir=in_tmp / "a")  # estimate, then real steps
    again = api.run(args, out_dir=in_tmp / "b")  # after real steps, an estimate again
    assert first["status"] == again["status"] == "ok", (first.get("error"), again.get("error"))
    assert first["mem_estimate_bytes"] == again["mem_estimate_bytes"] > 0


def test_memory_snapshot_on_cpu_is_a_noted_no_op(in_tmp, caplog):
    caplog.set_level(logging.INFO)
    row = api.run([*TINY, "trainer.memory_snapshot=true"], out_dir=in_tmp / "r")
    assert row["status"] == "ok" and "memory_snapshot" not in row
    assert not (in_tmp / "r" / "memory_snapshot.pickle").exists()
    assert "memory_snapshot: CUDA only, no snapshot on device cpu" in caplog.text
