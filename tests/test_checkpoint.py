"""Checkpointing: exact gradients and BatchNorm statistics against none, the planner against brute
force, the modelled activation peak against the tracker's, budgets respected."""

from __future__ import annotations

import copy
import logging
import random
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import deep_marks
from torch import nn

import memtrain.methods.checkpoint.ops as opplan
import memtrain.methods.checkpoint.plan as planner
from memtrain import api
from memtrain.errors import ConfigError
from memtrain.losses import cross_entropy
from memtrain.methods.base import MethodContext
from memtrain.methods.checkpoint import CheckpointMethod

# make test-compat runs this file on the oldest torch: torch.utils.checkpoint, selective
# checkpointing, compile, BatchNorm's statistics kernel
# one intra-op thread (conftest.one_thread): small convolutions on a loaded CPU
pytestmark = [pytest.mark.compat, pytest.mark.usefixtures("one_thread")]

# (model, image size, batch): small inputs that still exercise every segment kind.
MODELS = {
    "resnet18": (64, 2), "resnet34": (64, 2), "resnet50": (64, 2), "efficientnet_b0": (32, 2),
    "resmlp12": (32, 2), "resmlp24": (16, 2), "mlp6": (8, 4),
}
# (strategy, options): budget at both granularities
EAGER = (("uniform", {}), ("sqrt", {}), ("budget", {"granularity": "op"}),
         ("budget", {"granularity": "block"}), ("selective", {}))



def _build(model: str, size: int):
    data, m, _ = api.build([f"model={model}", f"dataset.image_size={size}"])
    return data, m


def _batch(size: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,),
                                                                         generator=g)


def _step(model, x, y, seed=1):
    """One forward + backward in train mode, from a fixed RNG state (dropout, stochastic depth)."""
    model.train()
    torch.manual_seed(seed)
    loss = cross_entropy(model(x), y)
    loss.backward()
    return float(loss.detach())


def _checkpointed(base, strategy, x, y, cache_dir=None, **kw):
    """A checkpointed copy of `base`, its method and its parameters and buffers in `base`'s order
    (the surgery moves modules, the tensors stay the same objects). The plan is not timed
    (`time_plan`): these tests read gradients and bytes, and timing runs the model again.
    `cache_dir`: the profile cache a sweep's jobs share (checkpoint/cache.py): the copies of one
    `base` on one batch are profiled once, as one sweep's jobs are."""
    model = copy.deepcopy(base)
    tensors = list(model.parameters()), list(model.buffers())
    method = CheckpointMethod(strategy=strategy, profile_repeats=1, **{"time_plan": False, **kw})
    model = method.wrap(model)
    if strategy in ("uniform", "sqrt", "budget"):
        method.prepare(model, x, y, context=MethodContext(cache_dir=cache_dir))
    return model, method, tensors


def _assert_same_step(ref, ref_loss, model, tensors, x, y, what):
    """One step of `model` gives `ref`'s loss, gradients and BatchNorm running statistics."""
    loss = _step(model, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-5), what
    params, buffers = tensors
    for (name, p_ref), p in zip(ref.named_parameters(), params, strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-7,
                                   msg=f"{what}: grad of {name}")
    for (name, b_ref), b in zip(ref.named_buffers(), buffers, strict=True):
        assert torch.equal(b, b_ref), f"{what}: buffer {name}"


# make test-fast: an MLP and a CNN with BatchNorm (the core claim); every model in make test
# (make test-compat: the two, and the transformers of the dropout test below)
@pytest.mark.parametrize("model", [m if m in ("mlp6", "resnet18")
                                   else pytest.param(m, marks=[pytest.mark.slow,
                                                               pytest.mark.breadth,
                                                               *deep_marks(m)])
                                   for m in sorted(MODELS)])
def test_every_strategy_matches_none(model, tmp_path):
    """Every strategy's step gives none's loss, gradients and BatchNorm statistics; the
    strategies plan on one profile (the segments profiled by the first, the ops by the first
    op plan), as a sweep's jobs do."""
    size, batch = MODELS[model]
    _, base = _build(model, size)
    x, y = _batch(size, batch)
    ref = copy.deepcopy(base)
    ref_loss = _step(ref, x, y)
    for strategy, kw in EAGER:
        got, method, tensors = _checkpointed(base, strategy, x, y, cache_dir=tmp_path,
                                             budget_fraction=0.7, every=2, **kw)
        if strategy != "selective":  # something really is recomputed
            assert method.plan.groups, strategy
        _assert_same_step(ref, ref_loss, got, tensors, x, y, f"{model}/{strategy} {kw}")


# Transformers with dropout 0.1 (attention and residual): 3 layers, so every strategy has
# something to recompute; a decoder on tokens and a ViT on images.
DROPOUT = {"gpt_nano": ["dataset=tokens", "dataset.seq_len=16", "dataset.train_size=4"],
           "vit_tiny": ["dataset.image_size=16", "dataset.train_size=4"]}


@pytest.mark.parametrize("model", sorted(DROPOUT))
@pytest.mark.slow
def test_recomputed_dropout_replays_its_mask(model):
    """Recomputation replays the forward's dropout masks (the RNG state is restored for the
    recomputed ops), so every strategy's gradients equal none's with model.dropout=0.1 (torch
    issue #190758 reports wrong gradients where a recomputation draws new masks)."""
    data, base = api.build([f"model={model}", "model.dropout=0.1", "model.layers=3",
                            *DROPOUT[model]])[:2]
    x, y = next(data.train.batches(2, torch.device("cpu")))
    ref = copy.deepcopy(base)
    ref_loss = _step(ref, x, y)
    other = copy.deepcopy(base)  # dropout is on: another seed draws other masks
    assert _step(other, x, y, seed=2) != pytest.approx(ref_loss, rel=1e-6)
    for strategy, kw in EAGER:
        got, method, tensors = _checkpointed(base, strategy, x, y, budget_fraction=0.7, every=2,
                                             **kw)
        if strategy != "selective":
            assert method.plan.groups, strategy
        _assert_same_step(ref, ref_loss, got, tensors, x, y, f"{model}/{strategy} {kw}")


@pytest.fixture
def scalar_kernels():
    """Inductor's C++ kernels without vector instructions, for the tests that compile on the
    CPU: what they check is which values backward keeps, recomputes and draws again, not the
    kernels' speed, and building vectorised kernels (with the compiler's check of each vector
    ISA) was most of these tests' time."""
    import torch._inductor.config as inductor

    with inductor.patch({"cpp.vec_isa_ok": False}):
        yield


@pytest.mark.slow  # two Inductor compilations on the CPU
@pytest.mark.usefixtures("scalar_kernels")
def test_compile_budget_replays_dropout_masks():
    """strategy=compile with model.dropout=0.1: the partitioner at a budget of ~0 recomputes
    the dropouts in backward, and the gradients equal those of budget 1 (nothing recomputed)
    from the same seed. Inductor draws its own masks (from philox seeds, which the recompute
    reuses), not eager's, so the reference is the compiled model without recomputation. (With
    eager's generator, `torch._inductor.config.fallback_random=True`, which memtrain never
    sets, a recomputed dropout drew new masks: gradients off by up to 0.2, measured.)"""
    data, base = api.build(["model=gpt_nano", "model.dropout=0.1", "model.layers=1",
                            "model.width=32", "model.heads=2", *DROPOUT["gpt_nano"]])[:2]
    x, y = next(data.train.batches(2, torch.device("cpu")))
    grads = {}
    for frac in (1.0, 1e-3):
        got, _, (params, _) = _checkpointed(base, "compile", x, y, budget_fraction=frac)
        grads[frac] = (_step(got, x, y), [p.grad for p in params])
    assert grads[1e-3][0] == grads[1.0][0]
    for g, ref in zip(grads[1e-3][1], grads[1.0][1], strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- the planner


def _random_profile(rng: random.Random, n: int) -> planner.Profile:
    kib = 1024
    return planner.Profile(
        names=[f"s{i}" for i in range(n)],
        inner=[rng.randint(0, 64) * kib for _ in range(n)],
        out=[rng.randint(1, 16) * kib for _ in range(n)],
        out_saved=[rng.random() < 0.5 for _ in range(n)],
        time=[rng.uniform(0.1, 2.0) for _ in range(n)],
        tail=rng.randint(0, 8) * kib, step_time=3.0 * n,
        # a segment's forward transient (checkpointed: nothing saved) can pass what it keeps
        transient=[rng.randint(1, 96) * kib for _ in range(n)])


@pytest.mark.any_torch  # the planner is plain Python over a made-up profile: no torch op
@pytest.mark.parametrize("seed", [s if s % 3 != 2 else pytest.param(s, marks=pytest.mark.slow)
                                  for s in range(6)])  # 12 segments (seeds 2, 5): slow
def test_planner_equals_brute_force(seed):
    rng = random.Random(seed)
    n = 10 + seed % 3
    prof = _random_profile(rng, n)
    low, high = planner.min_peak(prof), prof.baseline_peak
    # one pass over every plan: none fits under the planner's smallest peak and one reaches it
    # (it is every plan's least), and the best plan within each of three budgets
    budgets = [int(low + frac * (high - low)) for frac in (0.1, 0.5, 0.9)]
    below, at, *best_plans = planner.brute_force(prof, [low - 1, low, *budgets])
    assert below is None and at is not None and at.peak == low
    for budget, best in zip(budgets, best_plans, strict=True):
        got = planner.plan_budget(prof, budget)
        assert got.peak <= budget
        assert got.recompute_s == pytest.approx(best.recompute_s, rel=1e-9, abs=1e-12)
    with pytest.raises(planner.Infeasible) as err:
        planner.plan_budget(prof, low - 1)
    assert err.value.min_peak == low


def test_peak_model_by_hand():
    # three segments, inner 10/20/30, outputs 1/2/3 (the last saved by its own op), tail 5
    p = planner.Profile(["a", "b", "c"], [10, 20, 30], [1, 2, 3], [False, False, True],
                        [1.0, 1.0, 1.0], tail=5)
    assert p.baseline_peak == 5 + 60 + 6
    # recompute b alone: forward end = 5 + 10 + 30 + 6; its recompute = (10 + 1) + 20 = 31
    assert planner.peak_bytes(p, [(1, 1)]) == 51
    # a+b as one group: output of a hidden; recompute = 10 + 20 + 1 = 31; forward = 5+30+2+3
    assert planner.peak_bytes(p, [(0, 1)]) == 40
    # everything in one group: forward = 5 + 3; recompute = 60 + 1 + 2 + 3 (c saves its output)
    assert planner.peak_bytes(p, [(0, 2)]) == 66


# ---------------------------------------------------------------- measured runs

RUN = ["trainer=smoke", "trainer.threads=1", "trainer.batch_size=4", "trainer.max_steps=2",
       "trainer.warmup_steps=1"]


def _run(tmp_path, name, *overrides):
    s = api.run([*RUN, *overrides], out_dir=tmp_path / name)
    assert s["status"] == "ok", s.get("error")
    return s


@pytest.mark.slow
def test_budget_respected_and_peak_predicted(tmp_path):
    model = ["model=resnet18", "dataset.image_size=64"]
    none = _run(tmp_path, "none", *model)
    for frac in (0.5, 0.8):
        s = _run(tmp_path, f"b{frac}", *model, "method=checkpoint",
                 f"method.budget_fraction={frac}", "method.time_plan=false")  # bytes, not time
        assert s["mem_peak_act_bytes"] <= (frac + 0.05) * none["mem_peak_act_bytes"]
        assert s["plan_peak_bytes"] == pytest.approx(s["mem_peak_act_bytes"], rel=0.10)
        assert s["plan_peak_bytes"] <= s["plan_budget_bytes"]
        # the baseline the fraction refers to is none's measured activation peak
        assert s["plan_baseline_peak_bytes"] == pytest.approx(none["mem_peak_act_bytes"],
                                                              rel=0.05)
        assert s["train_loss"] == pytest.approx(none["train_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("model,size,strategy,extra,fraction", [
    *(pytest.param(*p, marks=pytest.mark.breadth) for p in [
        ("resnet50", 64, "sqrt", [], 1.0), ("efficientnet_b0", 32, "uniform", [], 1.0),
        ("resmlp12", 32, "budget", [], 0.5)]),
    # autocast caches its bf16 weight copies until the forward ends, recomputed segment or not
    # (at 8 px they are most of the activation peak: the claim at its sharpest, and the CPU's
    # slow bf16 convolutions on the smallest maps)
    ("resnet18", 8, "budget", ["trainer.precision=bf16"], 0.8)])
def test_predicted_peak_within_ten_percent(tmp_path, model, size, strategy, extra, fraction):
    args = [f"model={model}", f"dataset.image_size={size}", *extra]
    s = _run(tmp_path, strategy, *args, "method=checkpoint", f"method.strategy={strategy}",
             f"method.budget_fraction={fraction}", "method.time_plan=false")  # bytes, not time
    assert s["plan_peak_bytes"] == pytest.approx(s["mem_peak_act_bytes"], rel=0.10)
    if strategy == "sqrt":  # Chen et al.'s sqrt(n) groups at least halve the activation peak
        none = _run(tmp_path, "none", *args)  # the only case that reads none's row
        assert s["mem_peak_act_bytes"] <= 0.5 * none["mem_peak_act_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["block", "op"])
@pytest.mark.parametrize("model,data", [("gpt_nano", "dataset.seq_len=16"),
                                        ("vit_tiny", "dataset.image_size=32")])
def test_a_transformers_plan_predicts_its_peak_to_the_byte(tmp_path, model, data, granularity):
    """On a transformer the plan's modelled peak is the tracker's: the chain's input the
    entry made (the first block, recomputed, still holds it through backward), the model's
    output (the training step keeps it until the update: a decoder's logits) and the loss's
    saves (its log-softmax) are in the model's rows. Each block recomputed: the peak is the
    last one's recompute, at its MLP. An op plan's kept output that no op saves (the MLP's
    last projection, read by the residual add alone) is held beside that recompute until it
    reaches the op: counted, the op plan keeps only what fits."""
    s = _run(tmp_path, model, f"model={model}", "model.layers=2", data, "trainer.batch_size=8",
             "method=checkpoint", f"method.granularity={granularity}", "method.time_plan=false",
             "method.cost=flops")  # the plan from FLOPs, not a shared clock: the same every run
    assert s["plan_groups"] == "0-0;1-1"
    assert s["plan_peak_bytes"] == pytest.approx(s["mem_peak_act_bytes"], rel=1e-3)


@pytest.mark.slow
def test_infeasible_budget_is_raised_to_the_smallest_with_a_warning(tmp_path, caplog):
    """A budget below the smallest feasible peak plans at that peak (the default 0.5
    did not fit mlp6): the warning names the peak, the row keeps the budget asked for and the
    one planned for, and that plan is the least any budget gets (a budget at it, asked
    directly, gives the same plan, raising nothing)."""
    base = [*RUN, "model=mlp6", "dataset.image_size=8", "method=checkpoint"]
    with caplog.at_level(logging.WARNING, logger="memtrain.methods.checkpoint.strategies"):
        low = api.run([*base, "method.budget_fraction=0.1"], out_dir=tmp_path / "x")
    assert low["status"] == "ok", low.get("error")
    least = low["plan_budget_raised_to_bytes"]
    assert low["plan_budget_bytes"] == int(0.1 * low["plan_baseline_peak_bytes"]) < least
    assert low["plan_peak_bytes"] <= least
    assert re.search(rf"smallest feasible activation peak, {least} bytes .*planned at that "
                     r"peak instead", caplog.text)
    exact = api.run([*base, f"method.budget_bytes={least}"], out_dir=tmp_path / "y")
    assert "plan_budget_raised_to_bytes" not in exact
    assert (exact["plan_groups"], exact["plan_peak_bytes"]) == \
        (low["plan_groups"], low["plan_peak_bytes"])


def test_row_carries_predicted_and_measured_overhead_and_their_error(tmp_path):
    """`plan_overhead` leaves out checkpointing's fixed costs, so the row
    also carries the plan's measured extra time and the prediction's error."""
    s = api.run([*RUN, "model=mlp6", "dataset.image_size=8", "method=checkpoint",
                 "method.budget_fraction=0.8"], out_dir=tmp_path / "x")
    assert s["status"] == "ok", s.get("error")
    assert s["plan_measured_overhead"] > -1  # a ratio of two measured times, minus one
    assert s["plan_overhead_error"] == s["plan_overhead"] - s["plan_measured_overhead"]


def test_measured_overhead_alternates_and_takes_medians():
    """`planner.measured_overhead` on a fake clock: passes alternate without / with the plan,
    the first of each is left out, the plan is on at the end, and the result is median with /
    median without - 1."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4)
    calls, state = [], {"on": False}

    def plan_off():
        calls.append("off")
        state["on"] = False

    def plan_on():
        calls.append("on")
        state["on"] = True

    # seconds per pass, in order: without, with; the first pair is the warm-up
    durations = iter([9.0, 9.0, 1.0, 1.5, 3.0, 2.0, 1.0, 1.4])
    clock = {"t": 0.0, "start": True}

    def perf_counter():
        if not clock["start"]:
            clock["t"] += next(durations)
        clock["start"] = not clock["start"]
        return clock["t"]

    got = planner.measured_overhead(model, x, lambda out: out.sum(), None, plan_off, plan_on,
                                    repeats=3, clock=perf_counter)
    assert calls == ["off", "on"] * 4 and state["on"]
    assert got == pytest.approx(1.5 / 1.0 - 1)  # medians of (1.5, 2.0, 1.4) and (1.0, 3.0, 1.0)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("key,value", [("strategy", "best"), ("every", 0),
                                       ("budget_fraction", 0), ("budget_fraction", 1.5)])
def test_bad_options_are_config_errors(key, value):
    with pytest.raises(ConfigError, match=f"method.{key}"):
        CheckpointMethod(**{key: value})


def test_a_model_without_a_chain_is_a_config_error():
    """No rule registered and none found on the batch (tests/test_chains.py finds them)."""
    method = CheckpointMethod()
    model = method.wrap(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="found no chain of blocks in Linear"):
        method.prepare(model, torch.randn(2, 2), torch.zeros(2, dtype=torch.long))


@pytest.mark.slow
@pytest.mark.any_torch  # the command's printing and its row; the profile is held on both torches
def test_dry_run_prints_plan_and_does_not_train(in_tmp):
    from conftest import run_memtrain

    p = run_memtrain("trainer=smoke", "model=resnet18", "dataset.image_size=32",
                     "method=checkpoint", "method.dry_run=true", "trainer.threads=1",
                     cwd=in_tmp, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "layer4.1" in p.stdout and p.stdout.count("activation peak: baseline") == 1
    (summary,) = in_tmp.glob("runs/*/*_checkpoint_*/summary.json")
    s = __import__("json").loads(summary.read_text())
    assert s["dry_run"] is True and s["steps"] == 0 and s["plan_peak_bytes"] > 0
    assert "mem_peak_act_bytes" not in s


@pytest.mark.slow
@pytest.mark.usefixtures("scalar_kernels")
def test_compile_strategy_matches_none():
    # Inductor compiles on the CPU in tens of seconds per model: one small MLP shows the
    # budgeted compile trains the same function (the partitioner only changes what is saved).
    _, base = _build("mlp6", 8)
    x, y = _batch(8, 4)
    ref = copy.deepcopy(base)
    ref_loss = _step(ref, x, y)
    for frac in (0.0, 1.0):
        got, _, tensors = _checkpointed(base, "compile", x, y, budget_fraction=frac or 1e-3)
        _assert_same_step(ref, ref_loss, got, tensors, x, y, f"compile {frac}")


# ---------------------------------------------------------------- state_dict and resume

CKPT_RUN = ["trainer=smoke", "model=mlp6", "dataset.image_size=8", "trainer.threads=1",
            "method=checkpoint", "method.strategy=budget", "method.budget_fraction=0.7"]


@pytest.mark.slow
def test_budget_weights_load_strictly_into_the_plain_model(tmp_path):
    from memtrain import api

    row = api.run([*CKPT_RUN, "trainer.save_weights=true"], out_dir=tmp_path / "r")
    assert row["status"] == "ok" and row["plan_groups"]  # something is recomputed
    _, plain, _ = api.build(["model=mlp6", "dataset.image_size=8", "method=none"])
    state = torch.load(tmp_path / "r" / "weights.pt", weights_only=True)
    plain.load_state_dict(state, strict=True)  # raises on any renamed or missing key
    assert set(state) == set(plain.state_dict())


@pytest.mark.slow
def test_compiled_model_keeps_the_plain_state_dict_keys():
    # No compilation here (torch.compile is lazy): the wrapper's keys and a round trip through it.
    from memtrain import api
    from memtrain.methods.checkpoint.strategies import CompiledBudget

    _, plain, _ = api.build(["model=resnet18", "dataset.image_size=8", "method=none"])
    wrapped = CompiledBudget(copy.deepcopy(plain), 0.5)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    other = {k: torch.randn_like(v) if v.is_floating_point() else v
             for k, v in plain.state_dict().items()}
    wrapped.load_state_dict(other, strict=True)
    for k, v in wrapped.state_dict().items():
        assert torch.equal(v, other[k]), k
    outer = torch.nn.Sequential(wrapped)  # nested (a stack's member): keys under its prefix
    assert list(outer.state_dict()) == [f"0.{k}" for k in plain.state_dict()]
    outer.load_state_dict(outer.state_dict(), strict=True)


@pytest.mark.slow
@pytest.mark.usefixtures("scalar_kernels")
def test_compile_weights_load_strictly_and_resume(tmp_path):
    # Inductor on the CPU (a C compiler): weights of strategy=compile load into method=none's
    # model, and a run stopped after step 2 resumes to the uninterrupted run's weights.
    from memtrain import api

    args = ["trainer=smoke", "model=mlp6", "dataset.image_size=8", "trainer.threads=1",
            "method=checkpoint", "method.strategy=compile", "trainer.max_steps=4",
            "trainer.save_weights=true"]
    full = api.run(args, out_dir=tmp_path / "full")
    assert full["status"] == "ok", full.get("error")
    _, plain, _ = api.build(["model=mlp6", "dataset.image_size=8", "method=none"])
    state = torch.load(tmp_path / "full" / "weights.pt", weights_only=True)
    plain.load_state_dict(state, strict=True)  # raises on any renamed or missing key
    assert list(state) == list(plain.state_dict())
    stop = [*args, "trainer.fault=sigterm", "trainer.fault_step=2"]  # same run_id on resume
    part = api.run(stop, out_dir=tmp_path / "p")
    assert part["status"] == "interrupted"
    again = api.run([*stop, "trainer.resume=true"], out_dir=tmp_path / "p")
    assert again["status"] == "ok" and again["resumed_at_step"] > 0, again.get("error")
    resumed = torch.load(tmp_path / "p" / "weights.pt", weights_only=True)
    assert list(resumed) == list(state)
    for k in state:
        torch.testing.assert_close(resumed[k], state[k], rtol=1e-5, atol=1e-6, msg=k)


def test_every_plan_keeps_the_plain_state_dict_keys():
    from torchvision.models import resnet18

    from memtrain.methods.checkpoint.segments import apply_groups, discover

    model = resnet18(num_classes=10)
    keys = list(model.state_dict())
    segs = discover(model)
    apply_groups(model, segs, [(0, 2), (4, 4), (5, len(segs) - 1)])
    assert list(model.state_dict()) == keys
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()  # and it still trains
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.slow
def test_resumed_budget_run_keeps_its_plan(tmp_path, monkeypatch):
    from memtrain import api

    args = [*CKPT_RUN, "trainer.max_steps=6"]
    part = api.run([*args, "trainer.fault=sigterm", "trainer.fault_step=2"],
                   out_dir=tmp_path / "p")
    assert part["status"] == "interrupted"
    # a new profile that would plan differently (noise on a shared machine): recompute all
    monkeypatch.setattr(opplan, "plan_budget",
                        lambda p, ops, b, g=None: opplan.op_plan(p, ops, [(0, p.n - 1)], set()))
    again = api.run([*args, "trainer.fault=sigterm", "trainer.fault_step=2",
                     "trainer.resume=true"], out_dir=tmp_path / "p")
    assert again["status"] == "ok" and again["resumed_at_step"] > 0
    assert again["plan_groups"] == part["plan_groups"] != f"0-{part['plan_segments'] - 1}"
    # the op decisions too (absent where op plans fall back to block: torch without
    # respect_saved_tensors_hooks, opplan.sac_cache_is_counted)
    assert again.get("plan_kept_ops") == part.get("plan_kept_ops")
    assert again["plan_granularity"] == part["plan_granularity"]


@pytest.mark.slow
def test_same_profile_gives_the_same_plan():
    """Block plans minimise FLOPs: clock noise between two profiles (timings distorted 5x) does
    not change them. Op plans minimise the profile's measured times (method.cost=time), so
    two profiles may choose other ops at equal cost; one profile always gives one plan (a sweep
    plans every budget on one cached profile)."""
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    plans = []
    for slow in (1.0, 5.0):
        m = CheckpointMethod(strategy="budget", budget_fraction=0.5, dry_run=True)
        m.wrap(model)
        m.prepare(model, x, y)
        m.profile.time = [t * (slow if i % 2 else 1) for i, t in enumerate(m.profile.time)]
        plans.append(planner.plan_budget(m.profile, 0.5 * m.profile.baseline_peak).groups)
        assert m.profile.flops and all(f > 0 for f in m.profile.flops)
        if m.ops is not None:  # op level (not where op plans fall back to block)
            again = [opplan.plan_budget(m.profile, m.ops, 0.5 * m.profile.baseline_peak)
                     for _ in range(2)]
            assert again[0].groups == again[1].groups
            assert again[0].extra["keep"] == again[1].extra["keep"]
    assert plans[0] == plans[1]


def test_plan_table_of_a_small_model_reads_in_its_unit():
    """mlp6 at batch 8: KiB, not rows of 0.00 MiB; its zero inner bytes are explained."""
    data, model, method = api.build(["model=mlp6", "method=checkpoint", "method.strategy=uniform",
                                     "dataset.image_size=8", "trainer=smoke"])
    x, y = next(iter(data.train.batches(8, torch.device("cpu"))))
    method.prepare(model, x, y)
    lines = method.table().splitlines()
    assert lines[0].split()[2:6] == ["inner", "KiB", "out", "KiB"]
    rows = [ln.split() for ln in lines[1:] if ln.split()[0].isdigit()]
    assert rows and all(float(r[3]) > 0 for r in rows)  # every output shows
    assert "inner 0 in every segment" in method.table()


@pytest.mark.parametrize("case", ["2d", "channels_last", "1d", "cumulative", "untracked"])
def test_split_batchnorm_is_native_batchnorm(case):
    """BatchNorm split into statistics + normalisation (checkpoint/batchnorm.py, what an op plan
    recomputes apart) gives native BatchNorm's output, gradients and running statistics, bitwise
    on the CPU, over two training steps."""
    from memtrain.methods.checkpoint.batchnorm import split_batchnorms

    torch.manual_seed(0)
    shape = (6, 24) if case == "1d" else (4, 8, 5, 3)
    kind = nn.BatchNorm1d if case == "1d" else nn.BatchNorm2d
    bn = kind(shape[1], momentum=None if case == "cumulative" else 0.1,
              track_running_stats=case != "untracked")
    nn.init.normal_(bn.weight)
    nn.init.normal_(bn.bias)
    split = copy.deepcopy(bn)
    assert split_batchnorms([split]) == 1 and "forward" in vars(split)
    x = torch.randn(shape) * 3 + 2
    if case == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    for _ in range(2):
        ya, yb = bn(a), split(b)
        g = torch.randn_like(ya)
        (ya * g).sum().backward()
        (yb * g).sum().backward()
        assert torch.equal(ya, yb) and ya.stride() == yb.stride()
        assert torch.equal(a.grad, b.grad)
        for p, q in zip(bn.parameters(), split.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        for u, v in zip(bn.buffers(), split.buffers(), strict=True):
            assert torch.equal(u, v)
    split.eval()  # eval mode and other dtypes run natively
    assert torch.equal(split(x), bn.eval()(x))
    split.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = x.bfloat16()
        assert torch.equal(split(z), kind.forward(split, z))



@pytest.mark.slow
def test_tracked_peak_counts_a_recomputed_first_module():
    """A group that starts at resnet's stem recomputes conv1 (a leaf, the group's first module)
    in backward; the CPU tracker files recomputed tensors as activations only inside a module's
    forward, so the group runs that forward as a module (`_OwnForward`, checkpoint/segments.py):
    the tracked activation peak is the modelled recompute peak (before: 2 MiB, conv1's output,
    low)."""
    from memtrain.memory import measure

    _, model, _ = api.build(["model=resnet18", "dataset.image_size=64"])
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    method = CheckpointMethod(strategy="budget", granularity="block", profile_repeats=1,
                              budget_fraction=0.9)
    model = method.wrap(model).train()
    method.prepare(model, x, y)
    method.plan = planner.make_plan(method.profile, [(0, 1), (2, 3)])
    method._apply(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with measure.PeakTracker(model, opt, x, y) as tracker:
        out = model(x)  # kept through backward, as the training step keeps it
        F.cross_entropy(out, y).backward()
    # the stem's group sets the peak in backward, with nothing kept before it but the output
    assert method.plan.peak == planner._recompute_bytes(method.profile, 0, 1) + \
        method.profile.output
    assert tracker.act_peak_bytes == pytest.approx(method.plan.peak, rel=1e-3)


@pytest.mark.slow
def test_time_plan_false_skips_the_timing_and_its_columns(tmp_path):
    """`method.time_plan=false`: the plan is not timed before training, and the row has no
    measured overhead (nor its error) rather than a made-up one; the plan and its memory are
    the same."""
    args = ["model=mlp6", "method=checkpoint", "method.strategy=uniform", "dataset.image_size=8"]
    timed = _run(tmp_path, "timed", *args)
    untimed = _run(tmp_path, "untimed", *args, "method.time_plan=false")
    assert "plan_measured_overhead" in timed and "plan_overhead_error" in timed
    assert "plan_measured_overhead" not in untimed and "plan_overhead_error" not in untimed
    for k in ("plan_groups", "plan_peak_bytes", "mem_act_saved_bytes", "mem_peak_act_bytes"):
        assert untimed[k] == timed[k], k
