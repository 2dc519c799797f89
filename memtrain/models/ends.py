"""The entry and head of a chain found by tracing, as modules: the forward before its first
segment and after its last one, cut out of the model's own code with torch.fx.

A chain found on a sample (`discover.py`) knows its segments but not the code around them:
timm's ViT adds a class token and position embeddings before its blocks and pools after them,
torchvision's VGG flattens before its classifier, outside any module. The synthetic method
cuts the model into partitions, each a run of units (entry, segments, head), so it needs that
code as modules. `split(model, chain, sample)` traces the model's forward symbolically with
every module a leaf but the ones that hold the segments (a stage's container is traced
through to its blocks), then copies the graph before the first segment's call into `entry`
(the batch in, the first segment's input out) and the graph after the last segment's call into
`head` (the last segment's output in, the model's output out). Both are GraphModules over the
model's own modules and parameters (nothing copied). The cut holds only if the head needs
nothing but the last segment's output, and the composition equals the model's forward on the
sample; otherwise `split` says why in one line.

Python values the forward computes from its input's shape before the first segment (XCiT's
patch grid, which its blocks take as side inputs; the batch size its head expands a class
token to; PiT's class-token count) do not stop the cut: the graph is run on the sample and on
a sample one larger, and a value that is the same in both is a constant of the cut (the run's
inputs share the sample's shape past the batch), one that is the batch size in both is read
off the tensor that crosses the cut. Segments that take such side inputs are bound to them
(`Chain.bound`); a tensor made before the cut and read after it still stops it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import is_fake

from memtrain.models.chain import BATCH, Chain, keep_found, noted_sample
from memtrain.models.discover import unchanged


class _Tracer(fx.Tracer):
    """Every module a leaf but the root and `through` (the segments' containers), so only code
    around the segments is traced, and each segment is one call."""

    def __init__(self, through: set[str]):
        super().__init__()
        self.through = through

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname not in self.through


def _qualnames(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules(remove_duplicate=False)}


def _copy(src: list[fx.Node], graph: fx.Graph, env: dict[fx.Node, Any],
          free: set[fx.Node], known=None) -> str | None:
    """Copy `src` (in order) into `graph` through `env`; a node whose input is not in `env`
    is copied too when it reads no input of the forward (a parameter, a constant), or stands
    for what `known(n)` returns (a constant, or a node of `graph` that reads it off the
    input), else the line why the copy cannot stand alone."""

    def find(n: fx.Node) -> Any:
        if n not in env:
            if n in free:
                got = known(n) if known is not None else _UNKNOWN
                if got is _UNKNOWN:
                    raise _Needs(n)
                env[n] = got
                return got
            for a in n.all_input_nodes:
                find(a)
            env[n] = graph.node_copy(n, lambda a: env[a])
        return env[n]

    try:
        for n in src:
            if n.op == "output":
                graph.output(fx.map_arg(n.args[0], find))
            else:
                for a in n.all_input_nodes:
                    find(a)
                env[n] = graph.node_copy(n, lambda a: env[a])
    except _Needs as e:
        return (f"its head reads {e.node.name}, made before its last block, besides that "
                "block's output")
    return None


_UNKNOWN = object()


class _Values:
    """The values of a traced forward's nodes on the sample and on a sample one larger
    (`bind`), run once, when first asked; tensors as their shapes."""

    def __init__(self, model: nn.Module, graph: fx.Graph, sample: Any):
        self.model, self.graph, self.sample = model, graph, sample

    @functools.cached_property
    def runs(self) -> list[dict[fx.Node, Any]]:
        gm = fx.GraphModule(self.model, self.graph)
        runs = []
        bigger = torch.cat([self.sample, self.sample[:1]])
        for x in (self.sample, bigger):
            rec = _Recorder(gm)
            with unchanged(self.model, x), torch.no_grad():
                rec.run(x)
            runs.append(rec.got)
        return runs

    def bind(self, n: Any) -> Any:
        """What `n` is for every batch of the sample's shape: ("const", value), BATCH, or
        _UNKNOWN (a tensor, or a value that follows the batch otherwise)."""
        if not isinstance(n, fx.Node):
            return ("const", n) if _plain(n) else _UNKNOWN
        if not isinstance(self.sample, torch.Tensor) or not self.sample.dim():
            return _UNKNOWN
        a, b = (r.get(n, _UNKNOWN) for r in self.runs)
        if a is _UNKNOWN or b is _UNKNOWN or not _plain(a):
            return _UNKNOWN
        if a == b:
            return ("const", a)
        size = self.sample.shape[0]
        if type(a) is int and (a, b) == (size, size + 1):
            return BATCH
        return _UNKNOWN

    def batch_first(self, n: fx.Node) -> bool:
        """Whether `n` is a tensor whose first dimension is the batch."""
        a, b = (r.get(n) for r in self.runs)
        size = self.sample.shape[0]
        return (isinstance(a, tuple) and a[:1] == ("tensor",) and a[1][:1] == (size,)
                and b[1][:1] == (size + 1,))


class _Recorder(fx.Interpreter):
    """Runs a graph, keeping each node's value (a tensor as ("tensor", its shape))."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.got: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        v = super().run_node(n)
        self.got[n] = ("tensor", tuple(v.shape)) if isinstance(v, torch.Tensor) else v
        return v


def _plain(v: Any) -> bool:
    """A Python value that a cut can hold as a constant: numbers, strings, None, and tuples
    or lists of them (a shape)."""
    if v is None or type(v) in (int, float, bool, str):
        return True
    return isinstance(v, (tuple, list)) and all(_plain(x) for x in v)


class _Needs(Exception):
    def __init__(self, node: fx.Node):
        super().__init__(node.name)
        self.node = node


def _depends_on_input(nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes that read the forward's input, directly or through others."""
    out: set[fx.Node] = set()
    for n in nodes:
        if n.op == "placeholder" or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def with_ends(model: nn.Module, chain: Chain) -> Chain:
    """`chain` (found by tracing, code of the model's own around its blocks) with that code as
    its entry and head modules, cut out of the forward traced with torch.fx on the input the
    builder noted (`split`), so the model can be cut between its units; the chain with the
    reason where that fails. Any other chain as it is. Kept for the model, as `chain_of`'s."""
    if chain.cuttable() is None or chain.why_not:
        return chain
    sample = noted_sample(model)
    got = "no input of the model was noted to trace its forward on" if sample is None else \
        split(model, chain, sample)
    if isinstance(got, str):
        chain = dataclasses.replace(chain, why_not=got)
    else:
        chain = dataclasses.replace(chain, entry=got[0], head=got[1], bound=got[2], ends=True)
    keep_found(model, chain)
    return chain


def split(model: nn.Module, chain: Chain, sample: Any) -> tuple[
        nn.Module | None, nn.Module | None, tuple | None] | str:
    """(entry, head, bound) of `chain`: the ends as modules (None where the forward has no
    code there) and the side inputs its segments are bound to (None: they take none), or why
    the forward cannot be cut there, in a line. torch.fx records `self.training` as a
    constant, so the forward is traced in each mode and each end runs the trace of its own
    mode (`_Modal`)."""
    was = model.training
    cut: dict[bool, tuple] = {}
    try:
        for mode in (True, False):
            model.train(mode)
            got = _split(model, chain, sample)
            if isinstance(got, str):
                return got
            cut[mode] = got
    finally:
        model.train(was)
    if cut[True][2] != cut[False][2]:
        return "its blocks take other side inputs in training than in eval mode"
    entry, head = (None if cut[True][k] is None else _Modal(cut[True][k], cut[False][k])
                   for k in (0, 1))
    bound = cut[True][2]
    why = _check(model, chain, entry, head, bound, sample)
    return why if why is not None else (entry, head, bound)


class _Modal(nn.Module):
    """One end of the forward traced in training mode and in eval mode: runs the one of its
    mode (the same modules and parameters)."""

    def __init__(self, train: fx.GraphModule, eval_: fx.GraphModule | None):
        super().__init__()
        self.traced_train, self.traced_eval = train, eval_

    def forward(self, x: torch.Tensor) -> Any:
        return (self.traced_train if self.training or self.traced_eval is None
                else self.traced_eval)(x)


_SIDE = ("its blocks take side inputs besides the previous block's output that are tensors or "
         "follow the batch otherwise (a mask, position embeddings), which a cut would have to "
         "carry")


def _split(model: nn.Module, chain: Chain, sample: Any) -> tuple[
        fx.GraphModule | None, fx.GraphModule | None, tuple | None] | str:
    """`split` in the model's current mode, unchecked."""
    names = _qualnames(model)
    first = chain.segments[0].modules()[0]
    last = chain.segments[-1].modules()[-1]
    seg_names = [names.get(id(m)) for s in chain.segments for m in s.modules()]
    if None in seg_names:
        return "its blocks are no submodules of it"
    through = {n.rsplit(".", k)[0] for n in seg_names for k in range(1, n.count(".") + 1)}
    try:
        graph = _Tracer(through).trace(model)
    except Exception as e:  # Python control flow on values torch.fx cannot trace
        line = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        return f"torch.fx cannot trace its forward around its blocks ({line})"
    nodes = list(graph.nodes)
    calls = {n.target: i for i, n in enumerate(nodes) if n.op == "call_module"}
    seg_set = set(seg_names)
    seg_calls = [n for n in nodes if n.op == "call_module" and n.target in seg_set]
    if len(seg_calls) != len(seg_names) or names[id(first)] not in calls or \
            names[id(last)] not in calls:
        return "torch.fx sees its blocks called other than once each, in order"
    if sum(n.op == "placeholder" for n in nodes) != 1:
        return "its forward takes more than the batch"
    i0, i1 = calls[names[id(first)]], calls[names[id(last)]]
    start = nodes[i0]
    values = _Values(model, graph, sample)
    bound = None
    if len(start.args) != 1 or start.kwargs:  # side inputs: each a constant or the batch size
        if any(n.args[1:] != start.args[1:] or n.kwargs != start.kwargs for n in seg_calls):
            return "its blocks take different side inputs"
        args = tuple(values.bind(a) for a in start.args[1:])
        kwargs = tuple((k, values.bind(v)) for k, v in sorted(start.kwargs.items()))
        if any(b is _UNKNOWN for b in (*args, *(b for _, b in kwargs))):
            return _SIDE
        bound = (args, kwargs)
    free = _depends_on_input(nodes[:i1 + 1])
    # entry: the batch in, the first block's input out
    entry = None
    if start.args[0] is not nodes[0]:
        g = fx.Graph()
        env: dict[fx.Node, Any] = {}
        for n in nodes[:i0]:
            env[n] = g.node_copy(n, lambda a: env[a])
        g.output(env[start.args[0]])
        entry = _module(model, g, "Entry")
    # head: the last block's output in, the model's output out; a Python value made before
    # it stands in as a constant, or as the batch size read off that output
    g = fx.Graph()
    h = g.placeholder("h")
    env = {nodes[i1]: h}

    def known(n: fx.Node) -> Any:
        b = values.bind(n)
        if b == BATCH and values.batch_first(nodes[i1]):
            return g.call_method("size", (h, 0))
        return b[1] if isinstance(b, tuple) and b[:1] == ("const",) else _UNKNOWN

    why = _copy(nodes[i1 + 1:], g, env, free - {nodes[i1]}, known)
    if why is not None:
        return why
    outs = [n for n in g.nodes if n.op == "output"]
    head = None if outs and outs[0].args[0] is h else _module(model, g, "Head")
    return entry, head, bound


def _module(model: nn.Module, graph: fx.Graph, name: str) -> fx.GraphModule:
    """The graph as a module over the model's own modules and parameters, unused code dropped."""
    gm = fx.GraphModule(model, graph, class_name=name)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return fx.GraphModule(model, gm.graph, class_name=name)  # only what is still used


def _check(model: nn.Module, chain: Chain, entry: nn.Module | None, head: nn.Module | None,
           bound: tuple | None, sample: Any) -> str | None:
    """None when head(segments(entry(x))) is the model's forward on the sample in both modes
    (training mode from the same RNG state, BatchNorm statistics put back), else why not."""
    units = dataclasses.replace(chain, entry=entry, head=head, bound=bound).units()
    was = model.training
    try:
        for mode in (False, True):
            model.train(mode)
            for m in units:
                m.train(mode)
            # each from the same RNG state, BatchNorm statistics put back after each
            with unchanged(model, sample), torch.no_grad():
                want = model(sample)
            with unchanged(model, sample), torch.no_grad():
                got = sample
                for m in units:
                    got = m(got)
            # on fake tensors (the estimate's models) the shapes alone: no values there; a
            # run's own model is real and checked in full
            if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) or \
                    got.shape != want.shape or not (
                        is_fake(want) or torch.allclose(got, want, rtol=1e-4, atol=1e-5)):
                return "its forward cut at its blocks' ends does not give its output again"
    finally:
        model.train(was)
    return None
