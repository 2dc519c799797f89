"""Chains found, not registered (memtrain/models/discover.py), and checkpoint on them: the blocks
a traced forward finds against a module's known structure, side inputs carried, the one-line
refusal where no chain exists, the same loss and gradients as none and less activation memory on
a timm model, a transformers llama and a user's module; `method.strategy=native`, the model's own
checkpointing, against none, and its refusal."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from test_models_by_name import MODELS, STEPS
from torch import nn

import memtrain.methods.checkpoint.ops as opplan
from memtrain import api
from memtrain.errors import ConfigError
from memtrain.losses import cross_entropy
from memtrain.methods.checkpoint import CheckpointMethod
from memtrain.methods.checkpoint.segments import discover
from memtrain.methods.synthetic import Synthetic
from memtrain.models import chain_of
from memtrain.models.chain import remember_input

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread



class Block(nn.Module):
    """A residual block that reads a mask and position embeddings beside its input."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, mask, pos=None):
        return x + torch.relu(self.fc(x * mask + pos))


class Decoder(nn.Module):
    """A decoder's shape: embed, blocks in a ModuleList called with the same side inputs
    (computed in the forward, as transformers computes its causal mask), norm, head."""

    task = "classify"

    def __init__(self, d: int = 8, n: int = 3, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.embed(x.flatten(1)[:, :4])
        mask, pos = torch.ones_like(h), torch.linspace(0, 1, h.shape[1])
        for b in self.blocks:
            h = b(h, mask, pos=pos)
        return self.head(self.norm(h))


class Branches(nn.Module):
    """No chain: two branches joined by a concatenation outside any module."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(8, 2)

    def forward(self, x):
        return self.c(torch.cat([self.a(x), self.b(x)], 1))


class Collects(nn.Module):
    """Blocks in sequence whose every output is also summed outside them: grouped, the
    intermediate outputs would be missing."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        feats = []
        for b in self.blocks:
            x = b(x)
            feats.append(x)
        return torch.stack(feats).sum(0)


def test_the_blocks_are_found_with_their_side_inputs_and_kept():
    model = Decoder()
    chain = chain_of(model, sample=torch.randn(5, 4))
    assert [s.name for s in chain.segments] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [s.modules() for s in chain.segments] == [[b] for b in model.blocks]
    assert chain.found and chain.side and not chain.whole
    assert chain.cuttable() and "side inputs" in chain.cuttable()
    assert chain_of(model) is chain  # the same chain on every call, no batch needed again
    # a registered rule wins: nn.Sequential's children, untraced
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert not chain_of(seq, sample=torch.randn(2, 4)).found


def test_fsdp_shards_a_found_chain_block_by_block():
    """trainer.strategy=fsdp on a model no rule registers: FSDP's units are the blocks the
    trace found (one fully_shard per block, then the root), on one rank of a fake two-rank
    world, and each block holds half of its parameters."""
    from torch.distributed.fsdp import FSDPModule

    from memtrain.run import distributed

    model = Decoder(d=8, n=3)
    whole = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    remember_input(model, (4,))  # what a builder notes: the trace's sample
    assert distributed.blocks_of(model) == [[b] for b in model.blocks]
    with distributed.fake_session("fsdp", 2) as world:
        distributed.wrap(model, world, torch.device("cpu"))
        assert all(isinstance(m, FSDPModule) for m in (*model.blocks, model))
        assert not isinstance(model.head, FSDPModule)  # with the root, not a unit
        assert [sum(p.to_local().numel() for p in b.parameters()) for b in model.blocks] == \
            [n // 2 for n in whole]


class Staged(nn.Module):
    """A stem with an in-place activation, stages of layers (one an identity), a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True))
        self.stages = nn.Sequential(nn.Sequential(nn.Identity(), nn.Linear(8, 8)),
                                    nn.Sequential(nn.Linear(8, 8), nn.GELU()))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))


def test_containers_are_replaced_by_their_blocks_and_identities_dropped():
    chain = chain_of(Staged(), sample=torch.randn(2, 4))
    # the in-place ReLU joins the Linear before it (a group cannot start on an overwritten
    # input); nn.Identity hands its input back and is no segment
    assert [(s.name, s.attrs) for s in chain.segments] == [
        ("stem.0+1", ("0", "1")), ("stages.0.1", ("1",)), ("stages.1.0", ("0",)),
        ("stages.1.1", ("1",)), ("head", ("head",))]
    assert chain.whole and chain.cuttable() is None


class TwoRuns(nn.Module):
    """A stem of two wide convolutions whose output then goes two ways (an HRNet's branches),
    and deep in one branch a longer run of small layers (more ops, far fewer bytes)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1))
        self.small = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
        self.side = nn.Conv2d(32, 4, 1)

    def forward(self, x):
        y = self.stem(x)
        z = self.small(y.mean((2, 3))[:, :4])
        return self.side(y).mean((2, 3)) + z


def test_the_chain_that_makes_the_most_bytes_wins_over_the_longest():
    """Of the chains found, the one whose segments make the most bytes outside its largest
    segment wins (what a plan can free), not the one of the most ops: the wide stem, not the
    six small Linears."""
    chain = chain_of(TwoRuns(), sample=torch.randn(2, 3, 16, 16))
    assert [s.name for s in chain.segments] == ["stem.0", "stem.1"]


@pytest.mark.parametrize("model,why", [
    (Branches(), "the output of a is the first input of no later module"),
    (Collects(), r"the output of blocks.0 is also read by stack outside blocks.1")])
def test_no_chain_is_one_line_naming_the_model_and_what_broke_it(model, why):
    with pytest.raises(ConfigError, match=f"found no chain of blocks in {type(model).__name__} "
                                          f".*: {why}") as e:
        CheckpointMethod().prepare(model, torch.randn(2, 4), torch.zeros(2, dtype=torch.long))
    assert "\n" not in str(e.value)


def _step(model, x, y):
    model.train()
    torch.manual_seed(1)
    out = model(x)
    loss = cross_entropy(out.flatten(0, -2) if out.dim() == 3 else out, y.flatten())
    loss.backward()
    return loss.detach()


def _same_step(base, method: CheckpointMethod, x, y) -> CheckpointMethod:
    """`method` on a copy of `base` gives none's loss, gradients and buffers, bit for bit."""
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_loss = _step(ref, x, y)
    model = method.wrap(model)
    method.prepare(model, x, y)
    assert torch.equal(_step(model, x, y), ref_loss)
    for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(ref.named_buffers(), model.buffers(), strict=True):
        assert torch.equal(a, b), name
    return method


def _batch(name: str):
    data, model, _ = api.build(MODELS[name])
    x, y = next(data.train.batches(2, torch.device("cpu")))
    return model, x, y


@pytest.mark.slow  # a timm and a transformers model built and profiled: ~4 s each
@pytest.mark.parametrize("name,blocks", [
    ("convnext", ["stages.0.blocks.0", "stages.1.blocks.0", "stages.2.blocks.0",
                  "stages.3.blocks.0"]),
    ("llama", ["lm.model.layers.0", "lm.model.layers.1"])])
def test_checkpoint_on_a_found_chain_is_exact(name, blocks):
    model, x, y = _batch(name)
    method = _same_step(model, CheckpointMethod(strategy="uniform", every=2), x, y)
    names = [s.name for s in method.segments]
    assert [n for n in names if n in blocks] == blocks  # every block, in order
    assert method.plan.groups  # something is recomputed


def test_the_side_inputs_are_carried_into_every_group():
    model = Decoder(n=4)
    x, y = torch.randn(3, 4), torch.tensor([1, 2, 3])
    for strategy, kw in (("uniform", {"every": 2}), ("budget", {"granularity": "block"}),
                         ("budget", {"granularity": "op"}), ("selective", {})):
        _same_step(model, CheckpointMethod(strategy=strategy, profile_repeats=1,
                                           budget_fraction=0.5, **kw), x, y)


def test_side_inputs_the_step_makes_are_held_in_every_row_of_the_plan():
    """The mask every block saves (made by the step, not the batch) is counted once, in every
    row (`held_in`), not as the first block's own: a plan that recomputes every block still
    holds it (the checkpoints keep it for their recompute); so are the position embeddings,
    which no op saves but every checkpoint keeps (`side`). The modelled peak is the
    tracker's."""
    from memtrain.memory import measure

    torch.manual_seed(0)
    model = Decoder(d=64, n=4)
    x, y = torch.randn(16, 4), torch.randint(0, 10, (16,))
    method = CheckpointMethod(strategy="uniform", every=1, profile_repeats=1)
    model = method.wrap(model).train()
    method.prepare(model, x, y)
    p, mask = method.profile, 16 * 64 * 4
    assert p.held_in == 2 * mask  # the first block's input, and the mask
    assert p.side == 64 * 4  # the position embeddings: no op saves them, the checkpoints do
    assert p.inner[0] == p.inner[1] and method.plan.groups == [(i, i) for i in range(4)]
    with measure.PeakTracker(model, x, y, device=x.device) as tracker:
        out = model(x)
        cross_entropy(out, y).backward()
        del out  # the step keeps the output until the update (`Profile.output`)
    # the model leaves out the loss and nll_loss's total weight, a scalar each
    assert tracker.act_peak_bytes - method.plan.peak == 2 * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["convnext", "llama"])
def test_checkpoint_on_a_found_chain_saves_activation_memory(tmp_path, name):
    """The default plan (budget, op granularity) and the model's own checkpointing, each
    measured in a run, hold less activation memory than none."""
    runs = {"none": ["method=none"], "checkpoint": ["method=checkpoint"],
            "native": ["method=checkpoint", "method.strategy=native"]}
    rows = {k: api.run([*v, *MODELS[name], *STEPS], out_dir=tmp_path / k)
            for k, v in runs.items()}
    assert {k: r["status"] for k, r in rows.items()} == dict.fromkeys(runs, "ok"), \
        {k: r.get("error") for k, r in rows.items()}
    assert rows["checkpoint"]["plan_segments"] >= 2
    for k in ("checkpoint", "native"):
        assert rows[k]["mem_peak_act_bytes"] < rows["none"]["mem_peak_act_bytes"], k


@pytest.mark.slow  # a whole run: probes, profile, two steps
def test_checkpoint_runs_a_users_module_through_the_api(tmp_path):
    common = ["dataset=synthetic", "dataset.image_size=8", "dataset.train_size=8",
              "dataset.test_size=4", *STEPS, "method.strategy=uniform", "method.every=2"]
    row = api.run(["method=checkpoint", *common], model=Decoder(n=4), out_dir=tmp_path / "r")
    assert row["status"] == "ok", row.get("error")
    assert row["plan_segments"] == 4 and row["plan_groups"] == "0-1;2-3"


class OwnCheckpointing(Decoder):
    """timm's protocol: `set_grad_checkpointing(True)` checkpoints every block in the forward."""

    grad_checkpointing = False

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def forward(self, x):
        h = self.embed(x.flatten(1)[:, :4])
        mask, pos = torch.ones_like(h), torch.linspace(0, 1, h.shape[1])
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, mask, pos, use_reentrant=False) \
                if self.grad_checkpointing else b(h, mask, pos)
        return self.head(self.norm(h))


@pytest.mark.parametrize("name", [
    "own", *[pytest.param(n, marks=pytest.mark.slow) for n in ("convnext", "llama")]])
def test_native_is_the_models_own_checkpointing_and_exact(name):
    if name == "own":
        model, x, y = OwnCheckpointing(), torch.randn(3, 4), torch.tensor([1, 2, 3])
    else:
        model, x, y = _batch(name)
    method = CheckpointMethod(strategy="native")
    _same_step(model, method, x, y)
    # switched on where the library keeps it (timm: per stage; transformers: per layer)
    flags = [getattr(m, "grad_checkpointing", False) or getattr(m, "gradient_checkpointing", False)
             for m in CheckpointMethod(strategy="native").wrap(copy.deepcopy(model)).modules()]
    assert any(flags) and not method.segments  # no chain of memtrain's


def test_native_is_refused_in_one_line_where_the_model_has_none():
    with pytest.raises(ConfigError, match="method.strategy=native uses the model's own "
                                          "checkpointing .* Decoder .* has neither") as e:
        CheckpointMethod(strategy="native").wrap(Decoder())
    assert "\n" not in str(e.value)


def test_a_changed_op_sequence_says_which_op_and_where():
    class Flips(nn.Module):
        """Runs a ReLU every other call."""

        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x.relu() * 2 if self.calls % 2 else x * 2

    model = nn.Sequential(nn.Linear(4, 4), Flips(), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"between profiling forwards 1 and 2: in segment 1 "
                                          r"\(1\), op 0 was aten.relu.default and is "
                                          r"aten.mul.Tensor") as e:
        opplan.profile_model(model, discover(model), torch.randn(2, 4), repeats=2)
    assert "\n" not in str(e.value)


class Whole(nn.Module):
    """Nothing but modules in sequence: its found chain is its whole forward."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(self.stem(x)))


def test_synthetic_cuts_a_found_chain_that_is_the_whole_forward_and_refuses_the_rest():
    model = remember_input(Whole(), (4,))  # as the builders note their model's input
    x = torch.randn(3, 4)
    with torch.no_grad():
        ref = model(x)
    parts = Synthetic(partitions=2, cuts=[2]).wrap(model)  # found on a sample of its input
    assert [s.name for s in chain_of(model).segments] == ["stem", "body.0", "body.1", "body.2",
                                                          "head"]
    assert len(parts.units) == 5 and list(parts.state_dict()) == list(model.state_dict())
    with torch.no_grad():
        assert parts(x).shape == ref.shape
    with pytest.raises(ConfigError, match="method=synthetic cuts Decoder between the blocks "
                                          "of the chain found on a sample, and cannot: its "
                                          "blocks take side inputs") as e:
        Synthetic(partitions=2).wrap(remember_input(Decoder(), (4,)))
    assert "\n" not in str(e.value)


class Around(nn.Module):
    """Blocks in sequence with code of its own around them, outside any module, as timm's ViT
    and torchvision's VGG have: a learnt offset added to the stem's output, a dropout whose
    mode the forward reads, a flatten and the classifier; `skip` adds the stem's output to the
    last block's in the head (the head then needs more than the last block's output)."""

    def __init__(self, skip: bool = False):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.offset = nn.Parameter(torch.randn(8))
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU())
                                      for _ in range(3)))
        self.classifier = nn.Linear(8, 2)
        self.skip = skip

    def forward(self, x):
        s = self.stem(x) + self.offset
        h = self.blocks(s)
        if self.skip:
            h = h + s
        h = nn.functional.dropout(h, 0.5, self.training)
        return self.classifier(torch.flatten(h, 1))


def test_synthetic_cuts_a_forward_with_code_around_its_blocks():
    """The code before the first block and after the last one becomes the entry and head
    (memtrain/models/ends.py: traced with torch.fx, one trace per mode): the units compose to
    the forward in eval mode and, from one RNG state, in training mode (the head's dropout
    draws the same mask); the entry holds the model's own offset parameter (partition 0 trains
    it); the state dict keeps the model's names. A head that reads the stem's output is refused
    in one line."""
    torch.manual_seed(0)
    model = remember_input(Around(), (4,))
    x = torch.randn(5, 4)
    parts = Synthetic(partitions=2, cuts=[2]).wrap(model)
    assert len(parts.units) == len(chain_of(model).segments) + 2  # entry, segments, head
    assert list(parts.state_dict()) == list(model.state_dict())
    assert any(p is model.offset for p in parts[0].parameters())
    assert not any(p is model.offset for p in parts[1].parameters())
    for mode in (False, True):
        model.train(mode)
        parts.train(mode)
        with torch.no_grad(), torch.random.fork_rng():
            want = model(x)
        with torch.no_grad(), torch.random.fork_rng():
            h = x
            for unit in parts.units:
                h = unit(h)
        torch.testing.assert_close(h, want, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="cannot: its head reads .*, made before its last "
                                          "block, besides that block's output") as e:
        Synthetic(partitions=2).wrap(remember_input(Around(skip=True), (4,)))
    assert "\n" not in str(e.value)


class GridBlock(nn.Module):
    """A block that takes the patch grid as side inputs, as XCiT's do: it mixes each token
    with its neighbour on the grid."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, t, h, w):
        b, _, c = t.shape
        m = t.transpose(1, 2).reshape(b, c, h, w)
        m = m + torch.roll(m, 1, -1)
        return torch.relu(self.lin(m.flatten(2).transpose(1, 2)))


class Grid(nn.Module):
    """Python values of the input's shape around its blocks, as XCiT and PiT have: the blocks
    take the patch grid (h, w); the head expands a class token to the batch size read before
    the blocks and keeps the class tokens by their count."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 8, 2, stride=2)
        self.blocks = nn.ModuleList(GridBlock() for _ in range(3))
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.classifier = nn.Linear(8, 3)

    def forward(self, x):
        b = x.shape[0]
        t = self.stem(x)
        h, w = t.shape[-2:]
        t = t.flatten(2).transpose(1, 2)
        n = self.cls.shape[1]
        for blk in self.blocks:
            t = blk(t, h, w)
        t = torch.cat([self.cls.expand(b, -1, -1), t], 1)
        return self.classifier(t[:, :n].flatten(1))


def test_synthetic_binds_the_python_values_of_the_input_shape_a_cut_must_carry():
    """The blocks' grid and the head's class-token count are constants of the cut (the same
    on the sample and on one sample more), the head's batch size is read off the last block's
    output: the units compose to the forward at another batch size than the sample's, in both
    modes. A block whose side input is a tensor is refused in one line."""
    torch.manual_seed(0)
    model = remember_input(Grid(), (2, 6, 4))
    parts = Synthetic(partitions=2, cuts=[2]).wrap(model)
    assert len(parts.units) == 5 and list(parts.state_dict()) == list(model.state_dict())
    assert chain_of(model).bound == ((("const", 3), ("const", 2)), ())
    x = torch.randn(5, 2, 6, 4)
    for mode in (False, True):
        model.train(mode)
        parts.train(mode)
        with torch.no_grad():
            want = model(x)
            h = x
            for unit in parts.units:
                h = unit(h)
        torch.testing.assert_close(h, want, rtol=0, atol=0)
    parts(x).sum().backward()
    assert model.cls.grad is not None and model.blocks[0].lin.weight.grad is not None
    with pytest.raises(ConfigError, match="its blocks take side inputs besides the previous "
                                          "block's output that are tensors") as e:
        Synthetic(partitions=2).wrap(remember_input(Decoder(), (4,)))
    assert "\n" not in str(e.value)


@pytest.mark.slow  # a whole run: two partitions and recovery
def test_synthetic_runs_on_a_found_chain(tmp_path):
    row = api.run(["method=synthetic", *MODELS["convnext"], *STEPS], out_dir=tmp_path / "r")
    assert row["status"] == "ok", row.get("error")
    assert row["part0.units"].startswith("0-") and row["part1.units"].endswith("-15")


def test_the_coverage_sweep_spans_the_families_and_tabulates_its_rows():
    """benchmarks/coverage.py (make model-coverage, not run here): at least 40 timm
    architectures and 6 transformers types; its table says ok with the peak against none's,
    or the line."""
    from benchmarks.coverage import ARCHS, METHODS, table

    libs = [fam.split()[0] for _, fam, _ in ARCHS]
    assert libs.count("timm") >= 40 and libs.count("transformers") >= 6
    assert {"none", "checkpoint", "native", "synthetic"} <= set(METHODS)
    rows = [{"arch": "a", "family": "timm X", "method": "none", "status": "ok",
             "mem_peak_act_bytes": 200},
            {"arch": "a", "family": "timm X", "method": "checkpoint", "status": "ok",
             "mem_peak_act_bytes": 50},
            {"arch": "a", "family": "timm X", "method": "synthetic", "status": "refused",
             "reason": "method=synthetic cuts A ..."}]
    text = table(rows, ["none", "checkpoint", "synthetic"])
    assert "| timm X | a | ok | ok 0.25 | refused |" in text
    assert "- a / synthetic: refused: method=synthetic cuts A ..." in text
    # one line per method, status and reason: "every architecture" where all share it
    two = [r | {"arch": arch} for arch in ("a", "b") for r in rows]
    text = table(two, ["none", "checkpoint", "synthetic"])
    assert "- every architecture / synthetic: refused: method=synthetic cuts A ..." in text
    text = table([*two, {**two[0], "arch": "c"}], ["none", "synthetic"])
    assert "- a, b / synthetic: refused: method=synthetic cuts A ..." in text


def test_the_committed_coverage_page_is_its_rows_table():
    """docs/results/coverage_cpu.md is what `benchmarks.coverage --table` makes of the
    committed rows, every method they hold a column."""
    from benchmarks import read_rows
    from benchmarks.coverage import page

    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    rows = read_rows(results / "rows" / "coverage_cpu.csv")
    assert (results / "coverage_cpu.md").read_text() == page(rows, "coverage_cpu.csv")
