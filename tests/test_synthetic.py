"""Method synthetic: cuts, label matrices, partition independence, composed accuracy, memory."""

import copy
import itertools

import pytest
import torch
from conftest import fashion_mnist_available

from memtrain import api, runner
from memtrain.errors import ConfigError
from memtrain.methods._partition import (
    NearestColumn,
    balanced_cuts,
    label_matrix,
    run_phase,
)
from memtrain.methods.synthetic import Synthetic
from memtrain.models import mlp6, resmlp12, resmlp24, resnet18, resnet50
from memtrain.optim import build_optimizer, build_scheduler

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8", "trainer.device=cpu"]
SYN = [*TINY, "method=synthetic"]


@pytest.fixture
def one_thread():
    """Runs here pass trainer.threads=1: two threads are far slower on a shared, loaded CPU."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _fit(overrides: list[str]):
    """What runner.run does for a fit method, returning the objects as well as the result."""
    cfg, _ = api.compose(overrides)
    t = runner.trainer_of(cfg)
    data, model, method = runner.build(cfg, t)
    optim = runner._kwargs(cfg.optim)
    opt = build_optimizer(model, **optim)
    sched = build_scheduler(opt, t.schedule(len(data.train))[1], **optim)
    return data, model, method, opt, sched, dict(trainer=t, device=torch.device("cpu"))


# ---------------------------------------------------------------- labels and cuts


def test_label_matrix_deterministic_and_separated():
    s = label_matrix(seed=3, cut=0, dim=512, num_classes=10, kappa=2.0)
    assert s.shape == (512, 10)
    assert torch.equal(s, label_matrix(3, 0, 512, 10, 2.0))
    assert not torch.equal(s, label_matrix(4, 0, 512, 10, 2.0))
    assert not torch.equal(s, label_matrix(3, 1, 512, 10, 2.0))
    assert float(s.min()) >= 0 and float(s.max()) <= 2.0
    # two independent kappa*U(0,1) vectors are kappa*sqrt(dim/6) apart on average
    dist = torch.cdist(s.t(), s.t())
    expected = 2.0 * (512 / 6) ** 0.5
    off = dist[~torch.eye(10, dtype=torch.bool)]
    assert float(off.min()) > 0.8 * expected, (float(off.min()), expected)
    # noisy labels (noise std 0.3 kappa per entry) still decode to their own class
    y = torch.arange(10).repeat(20)
    noisy = s.t()[y] + 0.6 * torch.randn(200, 512, generator=torch.Generator().manual_seed(0))
    decoded = NearestColumn(torch.nn.Identity(), s)(noisy).argmax(1)
    assert torch.equal(decoded, y)


def test_balanced_cuts_match_brute_force():
    sizes = [0, 803840, 1049600, 524800, 262400, 131328, 2570, 7, 0, 90000]
    for k in (2, 3, 4):
        cuts = balanced_cuts(sizes, k)
        bounds = [0, *cuts, len(sizes)]
        largest = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = min(max(sum(sizes[a:b]) for a, b in zip((0, *c), (*c, len(sizes))))
                   for c in itertools.combinations(range(1, len(sizes)), k - 1)
                   if all(sum(sizes[a:b]) for a, b in zip((0, *c), (*c, len(sizes)))))
        assert best <= largest <= 1.02 * best, (k, cuts)
    with pytest.raises(ConfigError, match="method.partitions=5 is more than this model allows"):
        balanced_cuts([0, 5, 5, 0, 5, 5], 5)


@pytest.mark.parametrize("build,shape,k", [
    *[(b, s, k) for b, s in [(mlp6, (1, 12, 12)), (resnet18, (3, 16, 16)), (resmlp12, (3, 16, 16))]
      for k in (2, 3, 4)],
    (resnet50, (3, 16, 16), 3), (resmlp24, (3, 16, 16), 2)])
def test_partitions_compose_to_the_model(build, shape, k):
    torch.manual_seed(0)
    model = build(num_classes=10, input_shape=shape).eval()
    x = torch.randn(2, *shape)
    ref = model(x)
    parts = Synthetic(partitions=k, kappa=1.0).wrap(copy.deepcopy(model)).eval()
    assert len(parts) == k and all(sum(p.numel() for p in m.parameters()) for m in parts)
    assert sum(p.numel() for p in parts.parameters()) == sum(p.numel() for p in model.parameters())
    # the composed model with the cut standardisation folded out is exactly the model
    h = x
    for j, part in enumerate(parts):
        h = part[1:](h) if j else part(h)
    torch.testing.assert_close(h, ref)


@pytest.mark.parametrize("kwargs,msg", [
    ({"partitions": 1}, "method.partitions must be in [2, inf], got 1"),
    ({"right_input": "right"}, "method.right_input must be one of left, synthetic, got 'right'"),
    ({"parallel": True, "right_input": "left"},
     "method.parallel=true needs method.right_input=synthetic"),
    ({"cuts": [2, 4]}, "method.cuts lists 2 boundaries, so it needs method.partitions=3, got 2"),
    ({"kappa": 0}, "method.kappa must be in (0, inf], got 0"),
    ({"noise": -1}, "method.noise must be in [0, inf], got -1"),
])
def test_bad_options_are_config_errors(kwargs, msg):
    with pytest.raises(ConfigError) as e:
        Synthetic(**kwargs)
    assert msg in str(e.value)


def test_bad_cuts_and_epochs_fail_at_run_time(in_tmp):
    with pytest.raises(ConfigError, match=r"strictly increasing unit indices in \[1, 6\]"):
        api.build([*SYN, "method.cuts=[7]"])
    with pytest.raises(ConfigError, match="leaves partition 0 without parameters"):
        api.build([*SYN, "method.cuts=[1]"])
    with pytest.raises(ConfigError, match="method.recovery_epochs=2 leaves no epochs"):
        api.run([*SYN, "trainer.epochs=2", "trainer.max_steps=null", "method.recovery_epochs=2"],
                out_dir=in_tmp / "r")
    with pytest.raises(ConfigError, match="method synthetic cuts nn.Sequential models"):
        Synthetic().wrap(torch.nn.Linear(3, 3))


# ---------------------------------------------------------------- training


def test_composed_model_predicts_argmax_right_of_left(one_thread):
    data, model, method, opt, sched, kw = _fit([*SYN, "method.partitions=3"])
    result = method.fit(model, data, opt, sched, **kw)
    model.eval()
    hits = n = 0
    with torch.no_grad():
        for i, (x, y) in enumerate(data.test.batches(8, torch.device("cpu"))):
            if i >= 2:  # the run evaluates eval_max_batches=2 test batches
                break
            h = x
            for part in model:  # left, middle, right, each on the previous one's output
                h = part(h)
            torch.testing.assert_close(model(x), h)
            hits += int((h.argmax(1) == y).sum())
            n += y.numel()
    assert result.summary["test_acc"] == hits / n
    assert result.summary["steps"] == 3 * 4  # three partitions of trainer.max_steps=4 each


def test_synthetic_input_partitions_are_independent(one_thread):
    over = [*SYN, "method.right_input=synthetic", "method.partitions=3", "trainer.max_steps=6"]
    data, model, method, opt, sched, kw = _fit(over)
    init = copy.deepcopy(model.state_dict())
    for phase in method.plan(model, data, opt, sched, **kw):
        run_phase(phase, data)
    data, other, method, opt, sched, kw = _fit(over)  # the same initial weights (same seed)
    for phase in reversed(method.plan(other, data, opt, sched, **kw)):
        run_phase(phase, data)
    trained, reordered = model.state_dict(), other.state_dict()
    for k in trained:
        assert not torch.equal(trained[k], init[k]), k  # every partition did train
        assert torch.equal(trained[k], reordered[k]), k


@pytest.mark.slow
def test_parallel_workers_match_sequential(in_tmp, one_thread):
    over = [*SYN, "method.right_input=synthetic", "trainer.threads=1"]
    seq = api.run(over, out_dir=in_tmp / "seq")
    par = api.run([*over, "method.parallel=true"], out_dir=in_tmp / "par")
    assert par["status"] == "ok", par.get("error")
    for k in ("part0.train_loss", "part1.train_loss", "part0.mem_act_saved_bytes",
              "part1.mem_optim_bytes", "test_acc", "test_loss"):
        assert par[k] == seq[k], k


def _footprint(row: dict, prefix: str = "") -> int:
    return sum(row[f"{prefix}mem_{k}_bytes"] for k in ("act_saved", "params", "grads", "optim"))


@pytest.mark.parametrize("model,k", [("mlp6", 2), ("mlp6", 4), ("resnet18", 3), ("resmlp12", 2)])
def test_each_partition_is_smaller_than_the_whole_model(in_tmp, one_thread, model, k):
    over = ["trainer=smoke", f"model={model}", "dataset.image_size=16", "trainer.threads=1",
            "optim=adamw", "trainer.device=cpu"]
    none = api.run([*over, "method=none"], out_dir=in_tmp / "none")
    syn = api.run([*over, "method=synthetic", f"method.partitions={k}"], out_dir=in_tmp / "syn")
    assert syn["status"] == "ok", syn.get("error")
    whole = _footprint(none)
    for j in range(k):
        part = _footprint(syn, f"part{j}.")
        assert 0 < part < whole, (j, part, whole)
        assert syn[f"part{j}.mem_peak_alloc_bytes"] < none["mem_peak_alloc_bytes"]
    # the usual columns report the largest partition
    largest = syn["synthetic_largest_phase"]
    assert syn["mem_peak_alloc_bytes"] == max(syn[f"part{j}.mem_peak_alloc_bytes"]
                                              for j in range(k))
    assert syn["mem_params_bytes"] == syn[f"{largest}.mem_params_bytes"]


@pytest.mark.slow
@pytest.mark.data
@pytest.mark.skipif(not fashion_mnist_available(),
                    reason="Fashion-MNIST not installed (/usr/share/datasets/fashion-mnist)")
def test_fashion_mnist_matches_none_within_two_points(in_tmp, one_thread):
    # Six linear layers (narrower than the default so the pair runs in about a minute), cut after
    # the second hidden layer as the default widths' balanced cut is; AdamW, 2 epochs for both.
    over = ["model=mlp6", "model.widths=[256,256,128,128,64]", "dataset=fashion_mnist",
            "optim=adamw", "trainer.epochs=2", "trainer.threads=1", "trainer.progress=false",
            "trainer.device=cpu"]
    none = api.run([*over, "method=none"], out_dir=in_tmp / "none")
    syn = api.run([*over, "method=synthetic", "method.cuts=[3]"], out_dir=in_tmp / "syn")
    assert syn["status"] == "ok", syn.get("error")
    assert none["test_acc"] > 0.8
    assert syn["test_acc"] >= none["test_acc"] - 0.02, (syn["test_acc"], none["test_acc"])
