"""Smaller-GPU simulation, the largest batch that fits, one GPU per job, the GPU-free estimate."""

import logging

import pytest
import torch

from memtrain import api
from memtrain.errors import ConfigError
from memtrain.run import capacity

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


def test_a_batch_the_method_refuses_does_not_fit():
    """The GPU-free search (trainer.find_max_batch on the CPU): a batch whose estimate the
    method refuses (prune below the rows its blocks need) does not fit, and the search goes on
    (the refusal ended the run before)."""
    def estimate(b: int) -> int:
        if b < 32:
            raise ConfigError("method=prune prunes nothing")
        return 100 * b

    fits = capacity.estimate_fits(estimate, cap_bytes=10_000)
    assert not fits(16) and fits(64) and not fits(101)
    assert capacity.find_max_batch(fits, limit=1000, start=64) == 100
    assert capacity.find_max_batch(capacity.estimate_fits(estimate, 1_000), limit=1000,
                                   start=64) == 0


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


def test_cuda_fits_holds_the_reserved_peak_and_the_measured_context_to_the_margin(monkeypatch):
    """On CUDA a try fits when the allocator's reserved peak (here 100 b bytes) plus the
    context, measured after the steps as the device's used memory less the allocator's
    reserved (1000 bytes here), is within (1 - headroom) x cap: by hand, 100 b + 1000 <= 9000
    -> 80; a context set instead of measured (2000) -> 70."""
    state = {"b": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 100 * state["b"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 500)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (10**9 - 1500, 10**9))

    def make_step(b):
        state["b"] = b
        return lambda: None

    for context, want in ((None, 80), (2000, 70)):
        m = capacity.Margin(10_000, 0.1, context, "measured" if context is None else "set")
        fits = capacity.cuda_fits(make_step, torch.device("cpu"), margin=m)
        assert capacity.find_max_batch(fits, 1000, start=8) == want
        assert m.columns()["max_batch_context_bytes"] == (context or 1000)


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
    base.append("trainer.cuda_context_gb=0")  # the assumed 0.27 GiB would fill these caps
    small = api.run([*base, "trainer.gpu_memory_gb=0.04"], out_dir=in_tmp / "a")
    big = api.run([*base, "trainer.gpu_memory_gb=0.08", "trainer.estimate=true"],
                  out_dir=in_tmp / "b")
    assert small["status"] == big["status"] == "ok" and "steps" not in big  # probes only
    assert 1 <= small["max_batch_size"] < big["max_batch_size"]
    assert big["mem_estimate_bytes"] > 0


@pytest.mark.slow
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


@pytest.mark.slow
def test_memory_snapshot_on_cpu_is_a_noted_no_op(in_tmp, caplog):
    caplog.set_level(logging.INFO)
    row = api.run([*TINY, "trainer.memory_snapshot=true"], out_dir=in_tmp / "r")
    assert row["status"] == "ok" and "memory_snapshot" not in row
    assert not (in_tmp / "r" / "memory_snapshot.pickle").exists()
    assert "memory_snapshot: CUDA only, no snapshot on device cpu" in caplog.text


def test_margin_holds_the_peak_and_the_context_under_the_headroom():
    """A made-up estimate (1000 + 100 b bytes) against a 10,000-byte cap: the largest batch
    with 1000 + 100 b + context <= (1 - headroom) x cap, counted by hand."""
    est = lambda b: 1000 + 100 * b  # noqa: E731
    cases = [  # (headroom, context, largest by hand)
        (0.0, 0, 90),  # the cap alone: 1000 + 100 * 90 = 10,000
        (0.1, 0, 80),  # 9,000
        (0.1, 500, 75),  # 8,500
        (0.05, 2000, 65),  # 9,500 - 2,000 = 7,500 -> 65
    ]
    for headroom, context, want in cases:
        m = capacity.Margin(10_000, headroom, context)
        got = capacity.find_max_batch(capacity.estimate_fits(est, 10_000, m), 1000, start=4)
        assert got == want, (headroom, context)
        assert m.columns() == {"max_batch_budget_bytes": int((1 - headroom) * 10_000) - context,
                               "max_batch_context_bytes": context,
                               "max_batch_context_source": "set"}
    assert [capacity.round_down(b, 8) for b in (75, 72, 8, 7, 0)] == [72, 72, 8, 7, 0]
    assert capacity.round_down(75, 1) == 75


@pytest.mark.slow
def test_find_max_batch_row_keeps_its_margin_and_rounds(in_tmp):
    """End to end on the CPU: the row's batch is the largest whose own estimate (a separate
    probe run at that batch) + the context fits (1 - headroom) x cap, rounded down to 8; the
    assumed context when none is set."""
    base = [*TINY, "trainer.max_steps=0"]
    est = lambda b: api.run([*base, "trainer.estimate=true", f"trainer.batch_size={b}"],  # noqa
                            out_dir=in_tmp / f"e{b}")["mem_estimate_bytes"]
    cap = 0.05
    row = api.run([*base, "trainer.find_max_batch=true", f"trainer.gpu_memory_gb={cap}",
                   "trainer.cuda_context_gb=0.01", "trainer.max_batch_multiple=8"],
                  out_dir=in_tmp / "r")
    budget = int(0.9 * int(cap * 2**30)) - int(0.01 * 2**30)
    assert row["max_batch_budget_bytes"] == budget and row["max_batch_context_source"] == "set"
    best = row["max_batch_size"]
    assert best % 8 == 0 and best >= 8
    assert est(best) <= budget
    assert est(best + 8) > budget  # the next multiple of 8 would not fit
    assumed = api.run([*base, "trainer.find_max_batch=true", "trainer.gpu_memory_gb=0.5"],
                      out_dir=in_tmp / "a")
    assert assumed["max_batch_context_source"] == "assumed"
    assert assumed["max_batch_context_bytes"] == capacity.ASSUMED_CONTEXT_BYTES
