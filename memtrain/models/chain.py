"""A model's chain of segments: the one place that says which parts of a forward run in sequence.

timm's precedent is `checkpoint_seq(self.blocks, x)` behind `set_grad_checkpointing()`: the model
itself knows which of its parts form a chain. Here each model family registers a rule beside its
builder (`@chain_rule("torchvision.models.resnet.ResNet")` in cnn.py) that returns its `Chain`;
the checkpoint method recomputes groups of consecutive segments, the synthetic method cuts the
model between units. Adding a model = its builder with a chain rule beside it + its YAML.

A model whose type registers no rule (timm's, torchvision's, transformers', a user's module)
has its chain found on a sample batch instead (`discover.py`: one traced forward), once per
model object: every later call returns the same chain. Registered rules win.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrain.errors import ConfigError
from memtrain.run import distributed


@dataclass(frozen=True)
class Segment:
    """`parent.<attrs[0]>`, ..., `parent.<attrs[-1]>` called in sequence by the model."""

    name: str
    parent: nn.Module
    attrs: tuple[str, ...]

    def modules(self) -> list[nn.Module]:
        return [getattr(self.parent, a) for a in self.attrs]


def children(name: str, seq: nn.Module) -> list[Segment]:
    """One segment per child of `seq` (a stage of blocks), named `<name>.<child>`."""
    return [Segment(f"{name}.{k}", seq, (k,)) for k, _ in seq.named_children()]


@dataclass(frozen=True)
class Chain:
    """The model's forward as a pure chain: model(x) == head(s_n(...s_1(entry(x)))).

    Segment i's output is segment i+1's only input and nothing else happens in between, so any
    run of consecutive segments can be recomputed as one unit (checkpoint) and the model can be
    cut between any two (synthetic). `entry` and `head` are the forward before the first and
    after the last segment (None: nothing there), as modules that share the model's parameters.
    """

    segments: list[Segment]
    entry: nn.Module | None = None
    head: nn.Module | None = None
    # found by tracing (`discover.py`), not registered: its segments may take side inputs
    # (the same for every segment: a causal mask, position embeddings), and entry and head are
    # None because the forward around the segments is no module (unless `whole`: the segments
    # are the whole forward, nothing before or after them)
    found: bool = False
    side: bool = False
    whole: bool = False
    # a found chain's entry and head cut out of the traced forward (ends.py `with_ends`), or
    # why they could not be
    ends: bool = False
    why_not: str = ""
    # the side inputs a cut binds its segments to, ((arg, ...), ((name, arg), ...)), each
    # ("const", value) or BATCH (ends.py: values of the input's shape, not tensors); None: none
    bound: tuple | None = None

    def cuttable(self) -> str | None:
        """Why the model cannot be cut between its units (synthetic), or None."""
        if not self.found or self.whole or self.ends:
            return None
        if self.why_not:
            return self.why_not
        if self.side:
            return ("its blocks take side inputs besides the previous block's output (a mask, "
                    "position embeddings), which a cut would have to carry")
        return "the forward runs code of its own before or after its blocks, outside any module"

    def units(self) -> list[nn.Module]:
        """entry, each segment, head, each as one module: their composition is the forward
        (a segment of several modules becomes an nn.Sequential of them, or a `Bound` of them
        with the side inputs they are bound to; nothing moves)."""
        segs = [Bound(m, *self.bound) if self.bound is not None else
                m[0] if len(m) == 1 else nn.Sequential(*m)
                for m in (s.modules() for s in self.segments)]
        return [u for u in (self.entry, *segs, self.head) if u is not None]


BATCH = ("batch",)  # a bound side input that is the batch size: read off the segment's input


class Bound(nn.Module):
    """A segment's modules called in sequence with the side inputs the forward passed them,
    fixed for a cut (`Chain.bound`: constants, or the batch size read off the input)."""

    def __init__(self, modules: list[nn.Module], args: tuple, kwargs: tuple):
        super().__init__()
        self.blocks = nn.ModuleList(modules)
        self.args, self.kwargs = args, kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def value(b: tuple) -> Any:
            return x.shape[0] if b == BATCH else b[1]

        args = [value(b) for b in self.args]
        kwargs = {k: value(b) for k, b in self.kwargs}
        for m in self.blocks:
            x = m(x, *args, **kwargs)
        return x


Rule = Callable[[nn.Module], Chain]
_RULES: dict[str, Rule] = {}


def chain_rule(*classes: str) -> Callable[[Rule], Rule]:
    """Register `rule(model) -> Chain` for models of these classes, named "module.QualName"
    (no import of the class needed); a subclass uses its nearest registered class's rule."""

    def register(rule: Rule) -> Rule:
        for c in classes:
            _RULES[c] = rule
        return rule

    return register


_FOUND: weakref.WeakKeyDictionary[nn.Module, Chain] = weakref.WeakKeyDictionary()
# what a builder knows of its model's input: (one sample's shape, vocabulary or None: images)
_INPUTS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], int | None]] = \
    weakref.WeakKeyDictionary()
SAMPLES = 2  # samples of the batch the chain is traced on


def remember_input(model: nn.Module, input_shape: tuple[int, ...],
                   vocab: int | None = None) -> nn.Module:
    """Note the input a builder made `model` for (token ids below `vocab`, else images), so its
    chain can be found before any batch is seen (`chain_of` without a sample: synthetic cuts
    the model in `wrap`). Returns `model`."""
    _INPUTS[model] = (tuple(input_shape), vocab)
    return model


def noted_sample(model: nn.Module) -> torch.Tensor | None:
    """A random batch of the input the model's builder noted, on its parameters' device and
    dtype (fake under the estimate's fake mode); the global RNG untouched. None: not noted."""
    spec = _INPUTS.get(model)
    if spec is None:
        return None
    shape, vocab = spec
    p = next(model.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    dtype = p.dtype if p is not None and p.dtype.is_floating_point else None
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if vocab is not None:
            return torch.randint(0, vocab, (SAMPLES, *shape), device=device)
        return torch.randn(SAMPLES, *shape, device=device, dtype=dtype)


def registered(model: nn.Module) -> Chain | None:
    """The chain of the model's registered rule (its class's or nearest base's), else the chain
    found on it before (`chain_of` with a sample), else None."""
    for cls in type(model).__mro__:
        rule = _RULES.get(f"{cls.__module__}.{cls.__qualname__}")
        if rule is not None:
            chain = rule(model)
            if chain.segments:
                return chain
            break
    return _FOUND.get(model)


def model_class(model: nn.Module) -> type:
    """The class a message names the model by: a transformers model inside memtrain's wrapper
    (hf.py's CausalLM) as itself."""
    return type(model.lm if type(model).__module__ == "memtrain.models.hf" else model)


def chain_of(model: nn.Module, who: str = "this method", sample: Any = None) -> Chain:
    """The model's chain: its registered rule's, else found by one traced forward of `sample`
    (the first samples of a batch of the model's input; without one, a random batch of the
    input its builder noted: `remember_input`; `discover.py`), once per model.
    ConfigError naming `who` when there is none: no rule and no sample, or the trace found no
    chain (the line says what broke it)."""
    chain = registered(model)
    if chain is not None:
        return chain
    cls = model_class(model)
    if sample is None:
        sample = noted_sample(model)
    if sample is None:
        known = ", ".join(sorted(_RULES, key=lambda c: c.rsplit(".", 1)[-1]))
        raise ConfigError(f"{who} has no segment rule for model type {cls.__name__} "
                          f"({cls.__module__}.{cls.__qualname__}): it needs the model's chain "
                          f"of segments before any batch is seen, which only these types "
                          f"register: {known} (memtrain/models/chain.py: a @chain_rule beside "
                          f"the builder)")
    from memtrain.models.discover import find

    if isinstance(sample, torch.Tensor) and sample.dim() and sample.shape[0] > SAMPLES:
        sample = sample[:SAMPLES]
    found = find(model, sample)
    if not found.names:
        raise ConfigError(f"{who}: found no chain of blocks in {cls.__name__} "
                          f"({cls.__module__}.{cls.__qualname__}), where each block's output "
                          f"is the next one's input: {found.why} (a @chain_rule registers one: "
                          f"memtrain/models/chain.py)")
    segments = []
    for names in found.names:
        parent_name, _, _ = names[0].rpartition(".")
        parent = model.get_submodule(parent_name)
        attrs = tuple(n.rpartition(".")[2] for n in names)
        name = names[0] if len(names) == 1 else f"{names[0]}+{len(names) - 1}"
        segments.append(Segment(name, parent, attrs))
    chain = Chain(segments, found=True, side=found.side, whole=found.whole)
    _FOUND[model] = chain
    return chain


@chain_rule("torch.nn.modules.container.Sequential")
def _sequential(model: nn.Module) -> Chain:
    # Any nn.Sequential is a chain of its children.
    return Chain([Segment(k, model, (k,)) for k, _ in model.named_children()])


@distributed.blocks_rule
def _blocks(model: nn.Module) -> list[list[nn.Module]] | None:
    """FSDP's units (`trainer.strategy=fsdp`): one per segment of the model's chain (registered,
    or found on the batch a method prepared on), the units the methods already recompute and
    cut between (torchtitan shards a transformer per block)."""
    try:
        return [s.modules() for s in chain_of(model, "trainer.strategy=fsdp").segments]
    except ConfigError:  # no chain: the root alone is sharded
        return None


def keep_found(model: nn.Module, chain: Chain) -> None:
    """Let `chain` stand for the chain found on `model` before (ends.py: the same segments,
    with their entry and head): later `chain_of` calls return it."""
    if _FOUND.get(model) is not None:
        _FOUND[model] = chain
