"""Memory accounting against hand-computed values."""

import pytest
import torch
from torch import nn

from memtrain.memory import measure

F32 = 4


# make test-compat runs this file on the oldest torch: saved-tensor hooks and torch's MemTracker
pytestmark = pytest.mark.compat

class Tiny(nn.Module):
    """Linear(8->16) -> ReLU -> Linear(16->4): saves x, relu_out (used by ReLU's backward and the
    second Linear's), nothing else."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_saved_bytes_equal_hand_count():
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(5, 8, requires_grad=False)
    counter = measure.SavedBytes(exclude=model.parameters())
    with counter:
        model(x).sum().backward()
    # fc1 saves x [5, 8]; relu saves its output [5, 16]; fc2 saves its input, the same storage.
    assert counter.bytes == (5 * 8 + 5 * 16) * F32
    assert counter.count == 2


def test_tensor_saved_twice_counts_once_and_views_count_their_storage():
    a = torch.randn(10, 10, requires_grad=True)
    w = torch.randn(10, 10)
    counter = measure.SavedBytes()
    with counter:
        b = a * 2  # saves nothing of a (scalar mul), b: new storage
        c = b @ w  # saves b and w
        d = b.sin()  # saves b again: same storage
        e = b[:5].exp()  # exp saves its output, a new [5, 10] storage
    del c, d, e
    assert counter.bytes == (100 + 100 + 50) * F32  # b, w, exp's output


def test_parameters_and_their_views_are_excluded():
    lin = nn.Linear(6, 6)
    x = torch.randn(3, 6)
    counter = measure.SavedBytes(exclude=lin.parameters())
    with counter:
        lin(x).sum()
    assert counter.bytes == 3 * 6 * F32  # only x; the weight (saved as a view) is excluded


@pytest.mark.slow
def test_tracker_activation_peak_close_to_saved_bytes_for_plain_model():
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))

    def step(saved=None, tracker=None):
        with measure.maybe(tracker, tracker is not None):
            with measure.maybe(saved, saved is not None):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on
    saved = measure.SavedBytes(measure.alive_before_step(model, x, y))
    tracker = measure.PeakTracker(model, opt, x, y)
    step(saved, tracker)
    assert saved.bytes > 0
    rel = tracker.act_peak_bytes / saved.bytes
    assert 0.9 <= rel <= 1.1, (tracker.act_peak_bytes, saved.bytes)
    # the breakdown at the peak adds up to the peak
    assert sum(tracker.at_peak.values()) == tracker.peak_bytes
    assert tracker.at_peak["params"] == measure.tensor_bytes(model.parameters())
    assert tracker.at_peak["optim"] == measure.optimizer_bytes(opt)


def test_the_members_the_tracker_replaces_are_torchs():
    """PeakTracker replaces private members of torch's MemTracker and FSDPMemTracker
    (memtrain/memory/tracker.py, one function each): a torch that renames one or changes what it is
    called with fails here, by name, not as a wrong number in a row."""
    import inspect

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    def params(fn):
        return list(inspect.signature(fn).parameters)

    assert params(MemTracker._update_snap) == ["self", "u_type", "winfo", "old_mem_consumed",
                                               "old_reftype"]
    assert params(MemTracker._update_peak_stats) == ["self", "peak_state"]
    assert params(MemTracker._track) == ["self", "reftype", "t"]
    assert params(MemTracker._update_and_maybe_create_winfos) == ["self", "t", "reftype",
                                                                  "update_existing"]
    for name in ("_fsdp_state_pre_forward", "_fsdp_state_post_forward",
                 "_fsdp_param_group_pre_backward", "_fsdp_param_group_post_backward"):
        assert params(getattr(FSDPMemTracker, name))[:2] == ["self", "fsdp_mod"], name
        assert len(params(getattr(FSDPMemTracker, name))) == 3, name
    tracker = measure.PeakTracker(nn.Linear(2, 2), births=True)
    for name in ("_update_snap", "_update_peak_stats", "_track",
                 "_update_and_maybe_create_winfos"):
        assert name in vars(tracker._mt), name  # replaced on the instance, torch's class intact


def test_step_timer_summary():
    t = measure.StepTimer(torch.device("cpu"))
    t.times = [0.1, 0.2, 0.3, 0.4, 1.0]
    s = t.summary(batch_size=10)
    assert s["step_time_s_median"] == 0.3
    assert abs(s["throughput_samples_s"] - 10 / 0.3) < 1e-9
    assert 0.4 < s["step_time_s_p90"] <= 1.0


def test_the_commit_is_read_without_touching_the_users_index(tmp_path):
    """A row's git_commit reads the checkout without git's optional locks: a plain `git status`
    refreshes a stale index under .git/index.lock, and one cut off by the timeout on a loaded
    machine left the lock behind (the user's next commit failed)."""
    import os
    import shutil
    import subprocess

    from memtrain.run.provenance import git_commit

    if shutil.which("git") is None:
        pytest.skip("git not installed")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        if cmd[0] == "add":
            (tmp_path / "f.txt").write_text("a")
        subprocess.run(["git", *cmd], cwd=tmp_path, check=True, env=env)
    index = tmp_path / ".git" / "index"
    before = index.stat().st_mtime_ns
    os.utime(tmp_path / "f.txt", ns=(before + 10**9, before + 10**9))  # stat-dirty, same text
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=tmp_path,
                          capture_output=True, text=True).stdout.strip()
    assert git_commit(tmp_path) == head  # same content: not dirty
    assert index.stat().st_mtime_ns == before  # the index was not rewritten (no lock taken)
    (tmp_path / "f.txt").write_text("b")
    assert git_commit(tmp_path) == head + "-dirty"



class Cyclic(nn.Module):
    """Keeps a 4 KiB copy of its input in a reference cycle that only the cycle collector
    frees (as some of torch's own machinery does): the tracked peak must not depend on when a
    collection runs."""

    def forward(self, x):
        box = type("Box", (), {})()
        box.copy, box.me = x.repeat(8, 1), box  # 32 x 32 float32: 4 KiB, one per call
        return torch.relu(x)


@pytest.mark.slow
def test_tracked_peak_holds_cycle_garbage_to_the_steps_end_whatever_the_collector():
    import gc

    model, x = nn.Sequential(*[Cyclic() for _ in range(4)]), torch.randn(4, 32)

    def peak(threshold: int) -> int:
        old = gc.get_threshold()
        gc.collect()
        gc.set_threshold(threshold)  # 10: a young-generation collection every few objects
        try:
            with measure.PeakTracker(model, x) as t:
                model(x).sum()
        finally:
            gc.set_threshold(*old)
        return t.peak_bytes - x.numel() * F32

    peaks = {peak(threshold) for threshold in (10, 50, 100_000)}
    assert len(peaks) == 1, peaks  # unpaused, the three differ
    assert peaks.pop() >= 4 * 32 * 32 * F32  # all four cycles' copies alive at once
    assert gc.isenabled()
