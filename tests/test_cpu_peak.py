"""The CPU's peak is the allocator's: every allocation of the accounting step, kernels' scratch
included (`mem_peak_source=allocator`), against a plain PyTorch step under torch's profiler.

The reference shares nothing with memtrain's measurement: the same network (as memtrain builds
it, the method applied) trained by a loop written here, with torch's own SGD, one warm-up step,
then one step under `torch.profiler.profile(profile_memory=True)`. Its peak is what was alive
before that step (parameters, buffers, optimizer state, the batch: their storages' bytes, counted
here) plus the highest bytes the profiler's allocation events hold at once (each free paired
with the allocation at its address: the profiler's running total also carries allocations of
earlier profiles that were freed after them).

Also here: the optimizer column holds optimizer state only, the update's temporaries their own
column (a count by hand); checkpoint's RNG states counted where they live (a count by hand).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_data

from memtrain import allocator, api, measure
from memtrain.columns import ACT_TEMP_PEAK, PEAK, PEAK_SOURCE

BATCH, PX = 32, 32
# torch's profiler events and MemTracker's internals: make test-compat runs these on torch 2.11
pytestmark = pytest.mark.compat


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """memtrain's rows, each run once: `rows(model, method)`, three steps (warm-up, the
    accounting step, a timed one), CPU, batch 32 at 32 px, synthetic data; mlp6's with the
    estimate beside it."""
    done: dict[tuple[str, str], dict] = {}

    def row(model: str, method: str) -> dict:
        if (model, method) not in done:
            out = tmp_path_factory.mktemp(f"{model}_{method}")
            estimate = str(model == "mlp6").lower()
            done[model, method] = api.run([
                f"model={model}", f"method={method}", "trainer=smoke",
                f"trainer.batch_size={BATCH}", "trainer.max_steps=3",
                "trainer.eval_max_batches=1", f"trainer.estimate={estimate}",
                *tiny_data(model, image_size=PX, train_size=3 * BATCH, test_size=BATCH)],
                out_dir=out)
        assert done[model, method]["status"] == "ok", done[model, method].get("error")
        return done[model, method]

    return row


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _plain_step_peak(model: str, method: str) -> int:
    """The reference (module docstring)."""
    from torch._C._profiler import _EventType

    _, net, _ = api.build([f"model={model}", f"method={method}",
                           *tiny_data(model, image_size=PX)])
    net.train()
    decay = [p for p in net.parameters() if p.ndim > 1]  # conf/optim/sgd.yaml, no decay on 1-D
    rest = [p for p in net.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4},
                           {"params": rest, "weight_decay": 0.0}],
                          lr=0.1, momentum=0.9, nesterov=True)
    x, y = torch.randn(BATCH, 3, PX, PX), torch.randint(0, 10, (BATCH,))

    def step():
        out = net(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    before = _storage_bytes([*net.parameters(), *net.buffers(), *state, x, y])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        step()
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
    return before + peak


CASES = [pytest.param("mlp6", "none"),  # its row is also the optimizer test's
         pytest.param("mlp6", "quantize", marks=pytest.mark.slow),  # a run and a plain step
         pytest.param("resnet18", "none", marks=pytest.mark.slow),
         pytest.param("resnet18", "quantize", marks=pytest.mark.slow)]


@pytest.mark.parametrize("model,method", CASES)
def test_cpu_peak_is_a_plain_steps_allocator_peak(rows, model, method):
    row = rows(model, method)
    assert row[PEAK_SOURCE] == "allocator"
    reference = _plain_step_peak(model, method)
    assert row[PEAK] == pytest.approx(reference, rel=0.02), (row[PEAK], reference)
    # the breakdown at the peak adds up to it
    parts = ("params", "grads", "optim", "update", "act", "other", "scratch")
    assert sum(row[f"mem_at_peak_{k}_bytes"] for k in parts) == row[PEAK]
    if model == "mlp6":  # no kernel scratch: the allocator's peak is the tracker's, to the byte
        assert row[PEAK] == row["mem_tracker_peak_bytes"]
        assert row["mem_at_peak_scratch_bytes"] == 0
        assert row[ACT_TEMP_PEAK] >= row["mem_tracker_act_temp_bytes"]
    else:  # convolution and batch-norm scratch: in the peak, no tensor holds it
        assert row["mem_scratch_peak_bytes"] > 0
        assert row[PEAK] > row["mem_tracker_peak_bytes"]
        assert row[ACT_TEMP_PEAK] > row["mem_tracker_act_temp_bytes"]


def test_optimizer_state_apart_from_the_updates_temporaries(rows):
    """mlp6's peak is its SGD step (Nesterov, weight decay): optimizer state is the momentum
    buffers, one per parameter (optimizer.state, counted here); the update's temporaries at the
    peak are two copies of the largest weight's gradient (weight decay's `grad + wd * p`, then
    Nesterov's `grad + momentum * buf`, made one parameter at a time on the CPU). The estimate
    files them the same way."""
    row = rows("mlp6", "none")
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
    with measure.PeakTracker(net, x, y, timeline=True) as tracker:
        F.cross_entropy(net(x), y).backward()
    assert tracker.rng_peak_bytes == (len(groups) + 1) * one
    other = [dict(zip(("params", "buffers", "optim", "update", "grads", "act", "temp", "other"),
                      e[4:]))["other"] for e in tracker.events]
    batch = x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    assert max(other) - batch == (len(groups) + 1) * one
