"""The import graph, read from the source (ast): no cycle between memtrain's modules nor its
packages, no method importing another, kernels/ a leaf, the report free of torch, and the tools
beside the package (benchmarks/, tools/) on top, imported by nothing of memtrain. Every import
counts, those inside functions too (a lazy import is still a dependency); only a script's
`if __name__ == "__main__":` block does not (it runs when the file is executed, never when it is
imported)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from conftest import ROOT

from tools import architecture
from tools.architecture import is_main_block  # the same walk as the docs' module map

# where each package's files are (kernels/ installs as memtrain.kernels; benchmarks/ and tools/
# are not installed: they run from a checkout)
SOURCES = {"memtrain": ROOT / "memtrain", "memtrain.kernels": ROOT / "kernels",
           "benchmarks": ROOT / "benchmarks", "tools": ROOT / "tools"}
# memtrain.api is the facade on top of the package (runs, sweeps and their report from Python):
# it may import every package; nothing of memtrain imports it
PACKAGES = ("memtrain.api", "memtrain.methods", "memtrain.models", "memtrain.report",
            "memtrain.kernels", "benchmarks", "tools")
TOOLS = ("benchmarks", "tools")  # beside the package, never part of it


def _modules() -> dict[str, Path]:
    return architecture.modules(ROOT, {k: v.relative_to(ROOT) for k, v in SOURCES.items()})


def _imports(path: Path, module: str, is_pkg: bool) -> set[str]:
    """Absolute names of everything the file imports, the `__main__` block left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    tree.body = [n for n in tree.body if not is_main_block(n)]
    base = module if is_pkg else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from its package upwards
                root = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                name = f"{root}.{node.module}" if node.module else root
            else:
                name = node.module
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


# the method contract: the core's side of the methods' interface, kept where method authors look;
# it counts as the core (the runner, the probes and the strategies call methods through it)
CONTRACT = "memtrain.methods.base"


def package_of(module: str) -> str:
    if module == CONTRACT:
        return "memtrain"
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")), "memtrain")


def graph() -> dict[str, set[str]]:
    """module -> the memtrain modules it imports."""
    mods = _modules()
    return {m: {i for i in _imports(f, m, f.name == "__init__.py") if i in mods} - {m}
            for m, f in mods.items()}


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        path.pop()
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for m, deps in graph().items():
        edges.setdefault(package_of(m), set()).update(
            package_of(d) for d in deps if package_of(d) != package_of(m))
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))
    # the bottom layer: the core (the top level's modules and config/, memory/, run/) never
    # reaches into methods, models, report, benchmarks or kernels; it instantiates methods and
    # models by their `_target_` names
    assert not edges.get("memtrain"), edges["memtrain"]


def test_no_module_cycle_anywhere():
    """All of memtrain's modules (the core, every package, kernels/) form a DAG, lazy imports
    included: an import inside a function hides a cycle from Python, not from this test. A
    package's `__init__` counts as a module: `from pkg import mod` imports it, so inside a
    package that re-exports (methods/checkpoint/, methods/synthetic/) modules import each
    other by full module name (`import memtrain.methods.checkpoint.plan as planner`)."""
    edges = graph()
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def method_of(module: str) -> str | None:
    """The method a module belongs to: `memtrain.methods.<name>` (a module or a folder); None for
    common/, the methods package itself and everything outside it."""
    parts = module.split(".")
    if parts[:2] != ["memtrain", "methods"] or len(parts) < 3 or parts[2] == "common" \
            or module == CONTRACT:
        return None
    return ".".join(parts[:3])


def _method_imports(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) wherever a module of one method imports a module of another."""
    return sorted((m, d) for m, deps in edges.items() for d in deps
                  if method_of(m) and method_of(d) and method_of(m) != method_of(d))


def test_no_method_imports_another():
    """A method (a module or folder of memtrain/methods, common/ aside) imports the core,
    models/, kernels/ and common/, never another method, lazy imports included: what two methods
    share lives in common/, and a stack builds its members by their `_target_`."""
    assert _method_imports(graph()) == []


def test_the_contract_reaches_no_method():
    """The core imports the method contract (methods/base.py) and nothing else of methods/;
    the contract imports only the core's bottom (errors, losses), so the core reaching it never
    reaches a method, lazy imports included."""
    edges = graph()
    assert edges[CONTRACT] <= {"memtrain.errors", "memtrain.losses"}, edges[CONTRACT]
    core = [m for m in edges if package_of(m) == "memtrain" and m != CONTRACT]
    assert {d for m in core for d in edges[m] if d.startswith("memtrain.methods")} == {CONTRACT}


# the core's packages, one per concern (memtrain/<concern>/), each with the modules outside it
# that it may import: a layer reaches down, never up
LAYERS = {
    # the config front (composing and checking conf/): the bottom (errors, paths, the row's
    # names, the optimizers' signatures) and the job checks it runs before Hydra starts a job
    # (preflight, beside the packages: it reaches the run's probes, the data and the loggers)
    "memtrain.config": {"memtrain", "memtrain.errors", "memtrain.paths", "memtrain.record",
                        "memtrain.optim", "memtrain.preflight"},
    # the measurement of a step's memory: the one list of columns, nothing of the run (the
    # strategy leaves its buffers where the measurement looks, measure.COMM_BUFFERS)
    "memtrain.memory": {"memtrain.columns"},
    # the data: the datasets and their splits, on the bottom alone (errors)
    "memtrain.data": {"memtrain.errors"},
    # the run (its probes and the estimate, which runs its step on fake tensors, included): the
    # config front, the measurement, the data, the method contract, the job checks and the
    # bottom; never the command line, the API, the report
    "memtrain.run": {"memtrain", "memtrain.errors", "memtrain.losses", "memtrain.optim",
                     "memtrain.record", "memtrain.columns", "memtrain.data", CONTRACT,
                     "memtrain.preflight", "memtrain.config.*", "memtrain.memory.*"},
}


def _allowed(module: str, below: set[str]) -> bool:
    """`module` is one of `below`, or under a package `below` names as `pkg.*`."""
    return module in below or any(
        p.endswith(".*") and (module == p[:-2] or module.startswith(p[:-1])) for p in below)


def test_each_layer_imports_only_what_is_below_it():
    """A package of the core imports, outside itself, only what LAYERS lists for it, lazy
    imports included: the config front imports nothing of the run, the measurement or the data
    (the job checks it calls do); the measurement never reaches the config or the run; the run
    never reaches the command line, the API or the report."""
    edges = graph()
    # every package of the core has its layer (Hydra's plugins aside: they sit on top, with the
    # command line)
    packages = {".".join(m.split(".")[:2]) for m, f in _modules().items()
                if package_of(m) == "memtrain" and m.count(".") >= 1 and f.name == "__init__.py"}
    assert packages - {"memtrain.hydra_plugins"} == set(LAYERS), packages
    for layer, below in LAYERS.items():
        inside = [m for m in edges if m == layer or m.startswith(layer + ".")]
        assert inside, layer
        out = {d for m in inside for d in edges[m]
               if not (d == layer or d.startswith(layer + "."))}
        assert all(_allowed(d, below) for d in out), \
            (layer, sorted(d for d in out if not _allowed(d, below)))


def test_the_layer_check_names_a_module_or_a_whole_package():
    below = {"memtrain.columns", "memtrain.config.*"}
    assert _allowed("memtrain.columns", below) and _allowed("memtrain.config", below)
    assert _allowed("memtrain.config.loader", below)
    assert not _allowed("memtrain.configs", below) and not _allowed("memtrain.run.train", below)
    # the real graph has an edge the layers forbid were it not listed: the run imports the loader
    assert "memtrain.config.loader" in graph()["memtrain.run.runner"]


def test_kernels_are_a_leaf():
    """kernels/ imports torch, triton (numpy for the oracles) and itself, nothing of memtrain."""
    mods = _modules()
    allowed = {"torch", "triton", "numpy", "memtrain.kernels", *sys.stdlib_module_names}
    for m, f in mods.items():
        if package_of(m) != "memtrain.kernels":
            continue
        for name in _imports(f, m, f.name == "__init__.py"):
            top = name.split(".")[0]
            assert name.startswith("memtrain.kernels") or top in allowed - {"memtrain"}, (m, name)


def test_report_never_imports_torch():
    for m, f in _modules().items():
        if package_of(m) == "memtrain.report":
            deps = _imports(f, m, f.name == "__init__.py")
            assert not {d for d in deps if d.split(".")[0] == "torch"}, m


def test_the_checker_sees_a_cycle():
    """The checker itself can fail: a cycle, and a lazy import inside a function, are found."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    deps = _imports(ROOT / "memtrain" / "methods" / "synthetic" / "phases.py",
                    "memtrain.methods.synthetic.phases", False)
    assert "memtrain.methods.synthetic.workers" in deps  # imported inside `fit`


def test_from_a_package_imports_its_init(tmp_path):
    """`from pkg import mod` (the edge a package's own module must avoid when the package's
    `__init__` imports that module) names pkg as well as pkg.mod; a full module name does not."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from memtrain.methods.checkpoint import ops\n"
                 "import memtrain.methods.checkpoint.plan as planner\n")
    deps = _imports(f, "memtrain.methods.checkpoint.compaction", False)
    assert {"memtrain.methods.checkpoint", "memtrain.methods.checkpoint.ops",
            "memtrain.methods.checkpoint.plan"} <= deps
    pkg = "memtrain.methods.checkpoint"
    assert _cycle({pkg: {f"{pkg}.strategies"}, f"{pkg}.strategies": {f"{pkg}.compaction"},
                   f"{pkg}.compaction": deps}) is not None


def test_the_checker_sees_a_method_import():
    """One method importing another is found; a method's own modules and common/ are not."""
    edges = {"memtrain.methods.quantize": {"memtrain.methods.pool",
                                           "memtrain.methods.common.compact"},
             "memtrain.methods.checkpoint.compaction": {"memtrain.methods.checkpoint.plan",
                                                     "memtrain.methods.common.compact"},
             "memtrain.methods.stack": {"memtrain.methods.synthetic"}}
    assert _method_imports(edges) == [
        ("memtrain.methods.quantize", "memtrain.methods.pool"),
        ("memtrain.methods.stack", "memtrain.methods.synthetic")]
    # the real graph has the edges the test looks at: into common/, and inside a method
    real = graph()
    assert "memtrain.methods.common.compact" in real["memtrain.methods.quantize"]
    assert "memtrain.methods.checkpoint.plan" in real["memtrain.methods.checkpoint.ops"]


def test_the_report_reaches_only_torch_free_core_modules():
    """report/ takes from the core only the record, the column list, the conf/ path, the
    timeline's table and figure and the per-module files (memtrain.memory.by_module), and
    nothing it reaches, transitively, imports torch (it runs where torch is not installed)."""
    edges, mods = graph(), _modules()
    reached, todo = set(), [m for m in edges if package_of(m) == "memtrain.report"]
    while todo:
        for d in edges[todo.pop()] - reached:
            reached.add(d)
            todo.append(d)
    core = {m for m in reached if package_of(m) == "memtrain"}
    assert core <= {"memtrain", "memtrain.record", "memtrain.columns", "memtrain.paths",
                    "memtrain.memory", "memtrain.memory.timeline",
                    "memtrain.memory.by_module"}, core
    for m in core | {m for m in mods if package_of(m) == "memtrain.report"}:
        f = mods[m]
        assert not {d for d in _imports(f, m, f.name == "__init__.py")
                    if d.split(".")[0] == "torch"}, m


def test_nothing_of_memtrain_imports_the_tools():
    """benchmarks/ and tools/ sit on top, beside the package: they import memtrain, nothing of
    memtrain (nor kernels/) imports them, so the installed wheel, which leaves them out, misses
    nothing; and benchmarks/ never imports tools/ (the docs generator renders benchmarks' tables,
    not the other way)."""
    edges = graph()
    assert {"benchmarks.kernels", "tools.docs", "tools.study.results"} <= set(edges)
    assert "benchmarks.ranks" in edges["tools.docs"]  # the edge the checks look along exists
    for m, deps in edges.items():
        if package_of(m) not in TOOLS:
            assert not {d for d in deps if package_of(d) in TOOLS}, m
        elif package_of(m) == "benchmarks":
            assert not {d for d in deps if package_of(d) == "tools"}, m


def test_the_training_loop_reads_in_one_screen():
    """train.train stays under 100 lines (docstring included): what is not the loop's order of
    events goes into the helpers beside it (docs/architecture.md, the training loop)."""
    tree = ast.parse((ROOT / "memtrain" / "run" / "train.py").read_text(encoding="utf-8"))
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train"]
    assert fn.end_lineno - fn.lineno + 1 < 100, fn.end_lineno - fn.lineno + 1
