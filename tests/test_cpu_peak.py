"""The CPU's peak is the allocator's: every allocation of the accounting step, kernels' scratch
included (`mem_peak_source=allocator`), against a plain PyTorch step under torch's profiler.

The network is memtrain's (the method applied) and so is the optimizer's setting (conf/optim/
sgd.yaml: Nesterov, weight decay but on 1-D parameters), written here with torch's own SGD.
memtrain's `measure.Measurement` takes a warm-up step and the accounting step, as train.py's
loop does; then one more step of a loop written here, without memtrain code, runs under
`torch.profiler.profile(profile_memory=True)`. Its peak is what was alive before that step
(parameters, buffers, optimizer state, the batch: their storages' bytes, counted here) plus the
highest bytes the profiler's allocation events hold at once (each free paired with the
allocation at its address: the profiler's running total also carries allocations of earlier
profiles that were freed after them).

Also here: a whole run's row (its breakdown adds up, the estimate beside it); the optimizer
column holds optimizer state only, the update's temporaries their own column (a count by hand);
checkpoint's RNG states counted where they live (a count by hand).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_data

from memtrain import api
from memtrain.columns import ACT_TEMP_PEAK, PEAK, PEAK_SOURCE
from memtrain.memory import allocator, measure

BATCH, PX = 32, 32
# torch's profiler events and MemTracker's internals: make test-compat runs these on torch 2.11
pytestmark = pytest.mark.compat
PARTS = ("params", "grads", "optim", "update", "act", "other", "scratch")  # add up to the peak


@pytest.fixture(scope="module")
def mlp6_row(tmp_path_factory) -> dict:
    """mlp6's row: three steps (warm-up, the accounting step, a timed one), CPU, batch 32 at
    32 px, synthetic data, the estimate beside it."""
    row = api.run(["model=mlp6", "method=none", "trainer=smoke", f"trainer.batch_size={BATCH}",
                   "trainer.max_steps=3", "trainer.eval_max_batches=1", "trainer.estimate=true",
                   *tiny_data("mlp6", image_size=PX, train_size=3 * BATCH, test_size=BATCH)],
                  out_dir=tmp_path_factory.mktemp("mlp6"))
    assert row["status"] == "ok", row.get("error")
    return row


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _profiled_peak(prof) -> int:
    """The most bytes the profile's allocations held at once."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        if n.typed[0] == _EventType.Allocation:
            events.append((n.start_time_ns, n.typed[1].ptr, n.typed[1].alloc_size))
        stack.extend(n.children)
    live, now, peak = {}, 0, 0
    for _, ptr, size in sorted(events):
        if size > 0:
            live[ptr] = size
            now += size
        elif ptr in live:
            now -= live.pop(ptr)
        peak = max(peak, now)
    return peak


def _accounted_then_plain(model: str, method: str) -> tuple[dict, int]:
    """(memtrain's columns of the accounting step, the plain step's peak: module docstring)."""
    _, net, _ = api.build([f"model={model}", f"method={method}",
                           *tiny_data(model, image_size=PX)])
    net.train()
    decay = [p for p in net.parameters() if p.ndim > 1]
    rest = [p for p in net.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4},
                           {"params": rest, "weight_decay": 0.0}],
                          lr=0.1, momentum=0.9, nesterov=True)
    x, y = torch.randn(BATCH, 3, PX, PX), torch.randint(0, 10, (BATCH,))
    summary: dict = {}
    meas = measure.Measurement(torch.device("cpu"), 3, 1, True, summary)
    for step in range(2):  # warm-up, the accounting step: train.py's loop
        with meas.step(step, net, opt, x, y):
            with meas.forward():
                out = net(x)
                loss = F.cross_entropy(out, y)
            loss.backward()
            meas.updating()
            opt.step()
            meas.update_done(net)
            opt.zero_grad(set_to_none=True)
        del out, loss
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    before = _storage_bytes([*net.parameters(), *net.buffers(), *state, x, y])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        out = net(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return summary, before + _profiled_peak(prof)


CASES = [pytest.param("mlp6", "none"),
         pytest.param("mlp6", "quantize", marks=pytest.mark.slow),  # ~6-9 s: quantize's ops
         pytest.param("resnet18", "none", marks=pytest.mark.slow),  # three steps
         # quantize's CPU path (bit packing in torch ops) makes a step several times none's
         pytest.param("resnet18", "quantize", marks=pytest.mark.slow)]


@pytest.mark.parametrize("model,method", CASES)
def test_cpu_peak_is_a_plain_steps_allocator_peak(model, method):
    row, reference = _accounted_then_plain(model, method)
    assert row[PEAK_SOURCE] == "allocator"
    assert row[PEAK] == pytest.approx(reference, rel=0.02), (row[PEAK], reference)
    assert sum(row[f"mem_at_peak_{k}_bytes"] for k in PARTS) == row[PEAK]
    if model == "mlp6":  # no kernel scratch: the allocator's peak is the tracker's, to the byte
        assert row[PEAK] == row["mem_tracker_peak_bytes"]
        assert row["mem_at_peak_scratch_bytes"] == 0
        assert row[ACT_TEMP_PEAK] >= row["mem_tracker_act_temp_bytes"]
    else:  # convolution and batch-norm scratch: in the peak, no tensor holds it
        assert row["mem_scratch_peak_bytes"] > 0
        assert row[PEAK] > row["mem_tracker_peak_bytes"]
        assert row[ACT_TEMP_PEAK] > row["mem_tracker_act_temp_bytes"]


@pytest.mark.slow
def test_a_runs_row_has_the_allocators_peak(mlp6_row):
    """Through the runner: the row says where its peak came from and its breakdown adds up."""
    row = mlp6_row
    assert row[PEAK_SOURCE] == "allocator" and row["schema_version"] == 2
    assert row[PEAK] == row["mem_tracker_peak_bytes"]  # mlp6: no kernel scratch
    assert sum(row[f"mem_at_peak_{k}_bytes"] for k in PARTS) == row[PEAK]


def test_optimizer_state_apart_from_the_updates_temporaries(mlp6_row):
    """mlp6's peak is its SGD step (Nesterov, weight decay): optimizer state is the momentum
    buffers, one per parameter (optimizer.state, counted here); the update's temporaries at the
    peak are two copies of the largest weight's gradient (weight decay's `grad + wd * p`, then
    Nesterov's `grad + momentum * buf`, made one parameter at a time on the CPU). The estimate
    files them the same way."""
    row = mlp6_row
    _, net, _ = api.build(["model=mlp6", *tiny_data("mlp6", image_size=PX)])
    state = sum(p.numel() * 4 for p in net.parameters())  # one fp32 momentum buffer each
    largest = max(p.numel() * 4 for p in net.parameters())
    assert row["mem_optim_bytes"] == row["mem_at_peak_optim_bytes"] == state
    assert row["mem_at_peak_update_bytes"] == 2 * largest
    assert row["mem_estimate_at_peak_optim_bytes"] == state
    assert row["mem_estimate_at_peak_update_bytes"] == 2 * largest


def test_cpu_peaks_replays_marks_and_scratch():
    """`allocator.cpu_peaks` on a made-up step: a storage found at the start and freed in the
    step leaves at its mark; a tensor's allocation is its category from the moment it was made;
    an allocation no birth finds is scratch; a birth that finds no allocation is a storage made
    before the step, counted from its mark."""
    A, B, FR = allocator.ALLOC, allocator.BORN, allocator.FREED
    start = [(1, 100, "params"), (2, 40, "other")]
    births = [(0xA, 64, "act", 11), (0xC, 8, "optim", 13)]
    events = [(A, 0xA, 64),  # an output is made
              (A, 0xB, 1000),  # scratch inside the same op
              (A, 0xB, -1000),
              (B, 0, 0),  # the tracker sees the output
              (FR, 2, 0),  # the batch found at the start goes
              (B, 1, 0),  # a storage from before the step, first used now
              (A, 0xA, -64), (FR, 11, 0), (FR, 13, 0)]
    p = allocator.cpu_peaks(events, start, births)
    assert p.peak_bytes == 100 + 40 + 64 + 1000
    assert p.at_peak["act"] == 64 and p.at_peak[allocator.SCRATCH] == 1000
    assert p.scratch_peak_bytes == 1000
    assert p.act_temp_peak_bytes == 1064


def test_rng_states_are_counted_where_they_live():
    """Checkpoint keeps one CPU RNG state (`torch.get_rng_state()`) per recomputed group from
    its forward to its recomputation, and makes one more while it recomputes
    (`torch.random.fork_rng`): G + 1 at once at the first recomputation. On the CPU they are
    the step's memory: the tracker files them as other (they are its births, so the CPU
    allocator's count finds them), and `mem_rng_state_bytes` holds their most."""
    from memtrain.methods.checkpoint.segments import apply_groups
    from memtrain.models import chain_of
    from memtrain.models.mlp import MLP

    torch.manual_seed(0)
    net = MLP(16, [16, 16, 16, 16], 4)  # Flatten, four Linear-ReLU segments, the head
    segments = chain_of(net, "test").segments
    groups = [(0, 1), (2, 3)]
    apply_groups(net, segments, groups)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    one = torch.get_rng_state().untyped_storage().nbytes()
    summary: dict = {}
    meas = measure.Measurement(torch.device("cpu"), 2, 0, True, summary)  # step 0: accounted
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with meas.step(0, net, opt, x, y):
        with meas.forward():
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert summary["mem_rng_state_bytes"] == (len(groups) + 1) * one
    with measure.PeakTracker(net, x, y, timeline=True) as tracker:
        F.cross_entropy(net(x), y).backward()
    assert tracker.rng_peak_bytes == (len(groups) + 1) * one
    other = [dict(zip(("params", "buffers", "optim", "update", "grads", "act", "temp", "other"),
                      e[4:]))["other"] for e in tracker.events]
    batch = x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    assert max(other) - batch == (len(groups) + 1) * one
