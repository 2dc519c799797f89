"""Operator-level checkpoint plans (granularity=op): the program against brute force, the plan's
policy refusing another op sequence, the modelled activation peak against the tracker's."""

from __future__ import annotations

import copy
import random
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import deep_marks

import memtrain.methods.checkpoint.ops as opplan
import memtrain.methods.checkpoint.plan as planner
from memtrain import api
from memtrain.memory import measure
from memtrain.methods.checkpoint import CheckpointMethod
from memtrain.methods.checkpoint.ops import Compact
from memtrain.methods.checkpoint.segments import discover

# make test-compat runs this file on the oldest torch (selective checkpointing): torch 2.11 routes
# no SAC-cached output through saved-tensor hooks, so op plans fall back to block there
# (CheckpointMethod warns; the row's plan_granularity says so)
pytestmark = [pytest.mark.compat, pytest.mark.usefixtures("one_thread"), pytest.mark.skipif(
    not opplan.sac_cache_is_counted(),
    reason=f"torch {torch.__version__}: selective checkpointing has no respect_saved_tensors_hooks;"
           f" granularity=op falls back to block")]



def _random_instance(rng: random.Random, n: int) -> tuple[planner.Profile, opplan.OpProfile]:
    kib = 1024
    ops = []
    for _ in range(n):
        seg = [opplan.Op(f"aten.op{k}.default", rng.randint(1, 24) * kib, rng.uniform(0.1, 2.0),
                         rng.uniform(0.1, 2.0), keepable=rng.random() < 0.8)
               for k in range(rng.randint(1, 3))]
        ops.append(seg)
    inner = [sum(o.nbytes for o in seg) + rng.randint(0, 8) * kib for seg in ops]
    p = planner.Profile([f"s{i}" for i in range(n)], inner,
                        [rng.randint(1, 16) * kib for _ in range(n)],
                        [rng.random() < 0.5 for _ in range(n)], [0.0] * n,
                        tail=rng.randint(0, 8) * kib, step_time=3.0 * n,
                        transient=[rng.randint(1, 96) * kib for _ in range(n)])
    # lossless compaction choices (checkpoint/compaction.py) on up to two segments
    compact = [Compact(i, rng.randint(1, max(1, inner[i] // kib)) * kib, rng.uniform(0.01, 0.5),
                       rng.uniform(0.01, 0.5), "relu x1", rng.randint(1, 96) * kib)
               for i in rng.sample(range(n), rng.randint(0, 2))]
    return p, opplan.OpProfile(ops, compact)


@pytest.mark.parametrize("seed", range(4))
def test_op_planner_equals_brute_force(seed):
    rng = random.Random(seed)
    p, ops = _random_instance(rng, 4)
    high = p.baseline_peak
    with pytest.raises(planner.Infeasible) as err:
        opplan.plan_budget(p, ops, 1)
    low = err.value.min_peak
    for frac in (0.2, 0.5, 0.8):
        budget = int(low + frac * (high - low))
        got = opplan.plan_budget(p, ops, budget)
        best = opplan.brute_force(p, ops, budget)
        assert got.peak <= budget
        cost = opplan.op_cost(ops, got.groups, set(map(tuple, got.extra["keep"])),
                              got.extra["compact"])
        assert cost == pytest.approx(opplan.op_cost(ops, best.groups, set(best.extra["keep"]),
                                                    best.extra["compact"]),
                                     rel=1e-9, abs=1e-12)
        # block granularity on the same costs is never cheaper
        block = opplan.plan_budget(p, ops, budget, ops=False)
        assert opplan.op_cost(ops, block.groups, set()) >= cost - 1e-12


def _resnet(size=32):
    _, model, _ = api.build(["model=resnet18", f"dataset.image_size={size}"])
    return model


@pytest.mark.slow
def test_plan_policy_refuses_another_op_sequence():
    model = _resnet()
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    method = CheckpointMethod(strategy="budget", budget_fraction=0.6, profile_repeats=1)
    model = method.wrap(model)
    method.prepare(model, x, y)
    assert method.plan.groups and method.plan.extra["keep"]
    # the profile names another op where the group's first convolution runs
    first = method.ops.ops[method.plan.groups[0][0]]
    first[0].name = "aten.mm.default"
    other = CheckpointMethod(strategy="budget", profile_repeats=1)
    model2 = other.wrap(_resnet())
    other.plan, other.ops = method.plan, method.ops
    other._apply(model2)
    with pytest.raises(RuntimeError, match="does not fit this forward"):
        F.cross_entropy(model2.train()(x), y)


# (model, size, batch, budget fraction): every conf/model at tiny sizes
PEAK_CASES = [("resnet18", 32, 4, 0.4), ("resnet34", 32, 4, 0.4), ("resnet50", 32, 4, 0.5),
              ("efficientnet_b0", 32, 2, 0.6), ("resmlp12", 16, 4, 0.5), ("resmlp24", 16, 4, 0.4),
              ("mlp6", 8, 8, 0.8)]


def _tracked_act_peak(model, x, y) -> int:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with measure.PeakTracker(model, opt, x, y) as tracker:
        F.cross_entropy(model(x), y).backward()
    return tracker.act_peak_bytes


def _step_matches_none(got, params, buffers, ref, ref_loss, x, y) -> None:
    """One step of `got` (seeded as the reference's): loss, every parameter's gradient and
    every buffer (BatchNorm statistics) equal the plain model's."""
    torch.manual_seed(1)
    loss = F.cross_entropy(got(x), y)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    for (name, p_ref), prm in zip(ref.named_parameters(), params, strict=True):
        torch.testing.assert_close(prm.grad, p_ref.grad, rtol=1e-5, atol=1e-7, msg=name)
    for (name, b_ref), b in zip(ref.named_buffers(), buffers, strict=True):
        assert torch.equal(b, b_ref), name


@pytest.mark.parametrize("model,size,batch,frac", [
    c if c[0] not in ("resnet34", "resnet50", "resmlp24")
    else pytest.param(*c, marks=[pytest.mark.slow, *deep_marks(c[0])]) for c in PEAK_CASES])
def test_op_plan_matches_none_and_predicts_its_peak(model, size, batch, frac):
    """Loss, gradients and BatchNorm statistics equal none's; the modelled activation peak
    within 5% of the tracker's."""
    _, base, _ = api.build([f"model={model}", f"dataset.image_size={size}"])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    ref = copy.deepcopy(base).train()
    torch.manual_seed(1)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    got = copy.deepcopy(base)
    params, buffers = list(got.parameters()), list(got.buffers())
    method = CheckpointMethod(strategy="budget", budget_fraction=frac, profile_repeats=1,
                              time_plan=False)  # gradients and bytes: the plan is not timed
    got = method.wrap(got).train()
    method.prepare(got, x, y)
    assert method.plan.groups
    # mlp6's segments are one linear + relu_ each: inside a recomputed group nothing is worth
    # keeping; every other model's plan keeps some ops (an op-level plan, not a block one)
    assert bool(method.plan.extra["keep"]) == (model != "mlp6")
    _step_matches_none(got, params, buffers, ref, ref_loss, x, y)
    measured = _tracked_act_peak(got, x, y)
    assert method.plan.peak == pytest.approx(measured, rel=0.05)


@pytest.mark.slow
def test_dry_run_table_lists_ops_and_solve_time():
    model = _resnet()
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    method = CheckpointMethod(strategy="budget", budget_fraction=0.5, profile_repeats=1,
                              dry_run=True)
    out = method.prepare(method.wrap(model), x, y)
    table = method.table()
    assert out["dry_run"] and out["plan_kept_ops"] > 0 and out["plan_recomputed_ops"] > 0
    assert "recompute" in table and "solve time" in table
    assert re.search(r"keep [^\n]*convolution x", table)
    # BatchNorm split (checkpoint/batchnorm.py): its statistics kept, its normalisation recomputed
    assert re.search(r"keep [^\n]*batch_norm_update_stats x", table)


@pytest.mark.slow
def test_a_sweep_profiles_once(tmp_path, monkeypatch):
    """Jobs of one sweep folder share one profile: a block job measures the segments, the first
    op job adds the ops, the next plans without profiling; one profile: a monotone frontier."""
    import memtrain.methods.checkpoint.cache as ckpt_cache

    args = ["trainer=smoke", "model=mlp6", "dataset.image_size=8", "trainer.threads=1",
            "method=checkpoint", "method.dry_run=true"]
    sweep = tmp_path / "sweep"
    block = api.run([*args, "method.granularity=block", "method.budget_fraction=0.9"],
                    out_dir=sweep / "0")

    def no_profile(*a, **k):
        raise AssertionError("profiled again")

    monkeypatch.setattr(planner, "profile", no_profile)
    first = api.run([*args, "method.budget_fraction=0.9"], out_dir=sweep / "1")
    monkeypatch.setattr(opplan, "profile_model", no_profile)
    second = api.run([*args, "method.budget_fraction=0.7"], out_dir=sweep / "2")
    assert len(list((sweep / ckpt_cache.FOLDER).glob("*.json"))) == 1
    assert second["plan_baseline_peak_bytes"] == first["plan_baseline_peak_bytes"] \
        == block["plan_baseline_peak_bytes"]
    assert second["plan_peak_bytes"] <= first["plan_peak_bytes"]
    assert second["plan_recompute_s"] >= first["plan_recompute_s"]


@pytest.mark.parametrize("which", ["all", "none"])
@pytest.mark.slow
def test_any_keep_set_is_exact(which):
    """Every keepable op kept (BatchNorm outputs that relu_ rectifies in place included: cached,
    then recomputed through the idempotent relu_) or none kept: none's gradients exactly."""
    base = _resnet()
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    ref = copy.deepcopy(base).train()
    F.cross_entropy(ref(x), y).backward()
    got = copy.deepcopy(base)
    params, buffers = list(got.parameters()), list(got.buffers())
    method = CheckpointMethod(strategy="budget", profile_repeats=1, dry_run=True)
    got = method.wrap(got).train()
    method.prepare(got, x, y)
    keep = set(method.ops.keys()) if which == "all" else set()
    assert which == "none" or any(method.ops.ops[i][j].relu_after for i, j in keep)
    method.plan = opplan.op_plan(method.profile, method.ops, [(0, method.profile.n - 1)], keep)
    method._apply(got)
    saved = measure.SavedBytes(measure.alive_before_step(got, x, y))
    with saved:  # the accounting step's count sees what the plan keeps
        loss = F.cross_entropy(got(x), y)
    kept = sum(method.ops.ops[i][j].nbytes for i, j in keep)
    assert kept <= saved.bytes <= kept + 64 * 1024  # + the group's input and the head's
    loss.backward()
    for (name, p_ref), p in zip(ref.named_parameters(), params, strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-7, msg=name)
    for (name, b_ref), b in zip(ref.named_buffers(), buffers, strict=True):
        assert torch.equal(b, b_ref), name


@pytest.mark.slow
def test_op_plans_recompute_batchnorm_from_kept_statistics():
    """On resnet18 at a tight budget the op plan keeps every recomputed BatchNorm's statistics
    (tiny) and recomputes its normalisation (one elementwise pass) rather than the whole op.
    Priced on the roofline (FLOPs and bytes), not on this machine's clock: a plan on measured op
    times follows the load of the moment (under a loaded CPU it once recomputed a whole
    BatchNorm), and the claim is the planner's, not the clock's."""
    _, model, _ = api.build(["model=resnet18", "dataset.image_size=32"])
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    method = CheckpointMethod(strategy="budget", budget_fraction=0.4, profile_repeats=1,
                              dry_run=True, cost="roofline")
    method.prepare(method.wrap(model), x, y)
    ops, keep = method.ops.ops, set(method.plan.extra["keep"])
    inside = [(i, j) for a, e in method.plan.groups for i in range(a, e + 1)
              for j in range(len(ops[i]))]
    stats = [k for k in inside if opplan.short(ops[k[0]][k[1]].name) == "batch_norm_update_stats"]
    assert stats and all(k in keep for k in stats)
    assert not any("native_batch_norm" in ops[i][j].name for i, j in inside)


def _least_peak(p, ops) -> int:
    with pytest.raises(planner.Infeasible) as err:
        opplan.plan_budget(p, ops, 1)
    return err.value.min_peak


@pytest.mark.parametrize("how", ["planned", "forced"])
@pytest.mark.slow
def test_compacted_stem_is_exact_and_predicted(how, tmp_path):
    """resnet18 at 64 px (ImageNet stem: ReLU -> max-pool): the stem's compaction (1-bit ReLU
    mask, uint8 max-pool offsets) is a measured choice; below the least peak without it the plan
    keeps the stem compacted (or a plan is given it); loss, gradients and BatchNorm statistics
    equal none's, the modelled peak is the tracker's within 5%, the dry-run table names the
    choice, the sweep cache keeps it, and a compaction inside a recomputed group is dropped."""
    import memtrain.methods.checkpoint.cache as ckpt_cache
    from memtrain.methods.base import MethodContext

    _, base, _ = api.build(["model=resnet18", "dataset.image_size=64"])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, 64, 64, generator=g), torch.randint(0, 10, (2,), generator=g)
    ref = copy.deepcopy(base).train()
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    got = copy.deepcopy(base)
    params, buffers = list(got.parameters()), list(got.buffers())
    method = CheckpointMethod(strategy="budget", budget_fraction=0.9, profile_repeats=1,
                              dry_run=True)
    got = method.wrap(got).train()
    method.prepare(got, x, y, context=MethodContext(cache_dir=tmp_path))
    p, ops = method.profile, method.ops
    assert [(c.seg, c.what) for c in ops.compact] == [(0, "max_pool2d x1, relu x1")]
    assert 0 < ops.compact[0].saves < p.inner[0]
    loaded = ckpt_cache.load(tmp_path, next((tmp_path / ckpt_cache.FOLDER).glob("*")).stem)
    opplan.price(loaded[1], method.cost, "cpu")  # the cache keeps what is measured, unpriced
    assert loaded[1].compact == ops.compact
    plain = opplan.OpProfile(ops.ops)
    least = _least_peak(p, ops)
    assert least < _least_peak(p, plain)
    assert opplan.op_plan(p, ops, [(0, 1)], set(), [0]).extra["compact"] == []
    if how == "planned":
        method.plan = opplan.plan_budget(p, ops, (least + _least_peak(p, plain)) // 2)
        assert method.plan.extra["compact"] == [0]
        assert all(a > 0 for a, _ in method.plan.groups)
    else:  # the stem kept and compacted, the rest recomputed as one group
        method.plan = opplan.op_plan(p, ops, [(1, p.n - 1)], set(), [0])
        alone = opplan.op_plan(p, ops, [(1, p.n - 1)], set())
        assert method.plan.peak < alone.peak
    assert f"compact ({ops.compact[0].what}" in method.table()
    assert method.summary_columns()["plan_compact_segments"] == 1
    method._apply(got)
    _step_matches_none(got, params, buffers, ref, ref_loss, x, y)
    assert method.plan.peak == pytest.approx(_tracked_act_peak(got, x, y), rel=0.05)
    # a replaced plan without compaction gives the stem its plain modules back
    method.plan = opplan.op_plan(p, ops, [(1, p.n - 1)], set())
    method._apply(got)
    assert type(got.relu) is torch.nn.ReLU and type(got.maxpool) is torch.nn.MaxPool2d


@pytest.mark.slow
def test_frontier_table_names_the_compactions():
    """`python -m benchmarks.checkpoint --frontier`: one row per budget, the op plan's
    compacted segments in their column, the least peak with and without compaction."""
    from benchmarks.checkpoint import FRONTIER, frontier

    text = frontier("resnet18", 64, 2, 2, torch.device("cpu"))
    rows = [ln for ln in text.splitlines() if ln.startswith("| 0.")]
    assert len(rows) == len(FRONTIER) and all(r.count("|") == 10 for r in rows)
    m = re.search(r"least modelled peak: op ([\d.]+)x \(without compaction ([\d.]+)x\), block "
                  r"([\d.]+)x; compaction choices: stem", text)
    assert m and float(m[1]) < float(m[2]) <= float(m[3])


@pytest.mark.slow
@pytest.mark.parametrize("model,size,batch", [("resnet18", 64, 2), ("resnet50", 64, 2)])
def test_least_feasible_peak_is_what_a_step_measures(model, size, batch):
    """At the least feasible budget the modelled peak is the tracker's within 5%: the forward of a
    recomputed segment makes more at once than it keeps (resnet's stem: convolution, BatchNorm
    and ReLU outputs together), which the transient rows model (`transients`, checkpoint/plan.py);
    without them a compacted stem claimed 0.22x of resnet18's peak where a step measures 0.30x."""
    _, base, _ = api.build([f"model={model}", f"dataset.image_size={size}"])
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    method = CheckpointMethod(strategy="budget", budget_fraction=0.9, profile_repeats=1,
                              dry_run=True)
    got = method.wrap(base).train()
    method.prepare(got, x, y)
    p, ops = method.profile, method.ops
    assert len(p.transient) == p.n and all(t > 0 for t in p.transient)
    method.plan = opplan.plan_budget(p, ops, _least_peak(p, ops))
    method._apply(got)
    assert method.plan.peak == pytest.approx(_tracked_act_peak(got, x, y), rel=0.05)


def test_transients_count_fresh_storages_only():
    """mlp6's segment is one linear + relu_: its forward makes its output and nothing else (the
    transposed weight is a view of a parameter, relu_ writes in place)."""
    _, model, _ = api.build(["model=mlp6", "dataset.image_size=8"])
    x = torch.randn(8, 3, 8, 8)
    p = planner.profile(model.train(), discover(model), x, lambda out: out.float().sum(),
                        repeats=1)
    assert p.transient == p.out


# ---------------------------------------------------------------- transformers


def _decoder_plan_inputs(cost: str, layers: int = 3, seq: int = 128):
    """A gpt_nano-shaped decoder (width 64, 4 heads), math attention, bf16-true, dropout 0.1,
    batch 2, profiled by a checkpoint dry run whose op plans are priced by `cost`."""
    data, model, method = api.build([
        "model=gpt_nano", f"model.layers={layers}", "model.width=64", "model.heads=4",
        "model.dropout=0.1", "trainer.precision=bf16-true", f"dataset.seq_len={seq}",
        "dataset.train_size=2", "dataset.test_size=2", "method=checkpoint",
        "method.dry_run=true", "method.profile_repeats=1", f"method.cost={cost}"])
    x, y = next(data.train.batches(2, torch.device("cpu")))
    method.prepare(model.train(), x, y)
    return method, 4 * seq * seq * 2 * 2  # the bytes of one s x s bf16 tensor of 4 heads


@pytest.mark.slow  # ~3 s: a decoder profiled
def test_op_planner_finds_selective_recomputation():
    """Korthikanti et al.'s selective recomputation, found by the op planner priced in FLOPs
    (method.cost=flops, the paper's own measure), at the activation peak of keeping only the
    matmuls' outputs but QK^T's: every layer recomputes its attention core (scale, mask,
    softmax and dropout, whose s x s outputs it keeps none of, and QK^T, whose product it keeps
    only where one fits under that peak anyway: the last layer's) and keeps the output of every
    other matmul (the four linears', attention x V's). In selective checkpointing a kept output
    is what spares an op's recomputation, so it keeps the linears' outputs where the paper keeps
    their inputs; those inputs (LayerNorm, GELU, a copy) come back by FLOP-free ops. The paper's
    plan as selective checkpointing holds it (every output but the attention core's and
    attention x V's kept) holds more bytes and recomputes more FLOPs (attention x V too)."""
    method, s2 = _decoder_plan_inputs("flops")
    p, ops = method.profile, method.ops
    layers = range(p.n)
    core = {(i, j) for i in layers for j, o in enumerate(ops.ops[i])
            if o.keepable and o.nbytes == s2}
    matmuls = {(i, j) for i in layers for j, o in enumerate(ops.ops[i]) if o.flops > 0}
    bmm = [[j for j, o in enumerate(ops.ops[i]) if opplan.short(o.name) == "bmm"]
           for i in layers]
    qk, att_v = {(i, bmm[i][0]) for i in layers}, {(i, bmm[i][-1]) for i in layers}
    assert qk <= core and len(core) == 5 * p.n  # QK^T, scale, mask, softmax, dropout's apply
    assert len(matmuls) == 6 * p.n  # four linears, QK^T, attention x V
    selective = opplan.op_plan(p, ops, [(i, i) for i in layers], matmuls - qk)
    plan = opplan.plan_budget(p, ops, selective.peak)
    keep = set(plan.extra["keep"])
    assert {i for a, e in plan.groups for i in range(a, e + 1)} == set(layers)
    assert not keep & (core - qk)  # scale, mask, softmax, dropout: recomputed in every layer
    assert keep & core <= {(p.n - 1, bmm[-1][0])}
    assert keep & matmuls >= matmuls - qk  # no linear, no attention x V recomputed
    flops = opplan.recompute_flops(ops, plan.groups, keep)
    assert 0 < flops <= opplan.recompute_flops(ops, selective.groups, matmuls - qk)
    # the paper's plan, as selective checkpointing holds it
    paper_keep = set(ops.keys()) - core - att_v
    paper = opplan.op_plan(p, ops, [(i, i) for i in layers], paper_keep)
    assert plan.peak <= selective.peak < paper.peak
    assert flops < opplan.recompute_flops(ops, paper.groups, paper_keep)


@pytest.mark.slow  # ~3 s: a decoder profiled
def test_op_plan_at_a_third_of_a_decoders_activations_recomputes_a_fraction_of_blocks():
    """The mechanics of the gpt2_small figure (docs/results/transformer_checkpoint_cpu.md) on a
    decoder with its a*s/h (16: width 64, 4 heads, 256 tokens), six layers, batch 1, math
    attention, one profile (`bench.checkpoint.profiled`): priced in FLOPs, the op plan at 0.35x
    of none's activation peak recomputes at most half the FLOPs of the block plan at the same
    budget (measured here: ~0.25), and the row reports both plans' solve times."""
    from benchmarks import checkpoint as bench

    method, _, step_flops = bench.profiled(
        "gpt_nano", 256, 1, 1, torch.device("cpu"),
        ["model.layers=6", "model.width=64", "model.heads=4", "method.profile_repeats=1"])
    (row,) = bench.frontier_rows(method, step_flops, torch.device("cpu"), [0.35], ["flops"])
    assert row["op_peak"] <= 0.35 and row["block_peak"] <= 0.35
    assert row["op_flops_overhead"] <= 0.5 * row["block_flops_overhead"], row
    assert row["op_solve_s"] >= 0 and row["block_solve_s"] >= 0
