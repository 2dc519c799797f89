"""The package import graph, read from the source (ast): no cycle between memtrain's packages,
kernels/ a leaf, the report free of torch. Every import counts, those inside functions too (a
lazy import is still a dependency); only a script's `if __name__ == "__main__":` block does not
(it runs when the file is executed, never when it is imported)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from conftest import ROOT

# where each package's files are (kernels/ installs as memtrain.kernels)
SOURCES = {"memtrain": ROOT / "memtrain", "memtrain.kernels": ROOT / "kernels"}
PACKAGES = ("memtrain.methods", "memtrain.models", "memtrain.report", "memtrain.bench",
            "memtrain.study", "memtrain.kernels")


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in SOURCES.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = f
    return out


def _is_main_block(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _imports(path: Path, module: str, is_pkg: bool) -> set[str]:
    """Absolute names of everything the file imports, the `__main__` block left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    tree.body = [n for n in tree.body if not _is_main_block(n)]
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


def package_of(module: str) -> str:
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
    # the bottom layer: the core (memtrain/*.py) never reaches into methods, models, report,
    # benchmarks or kernels; it instantiates methods and models by their `_target_` names
    assert not edges.get("memtrain"), edges["memtrain"]


def test_the_core_has_no_module_cycle():
    """The core's modules (memtrain/*.py) form a DAG, lazy imports included."""
    core = {m: {d for d in deps if package_of(d) == "memtrain"}
            for m, deps in graph().items() if package_of(m) == "memtrain"}
    assert _cycle(core) is None, " -> ".join(_cycle(core))


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
    deps = _imports(ROOT / "memtrain" / "methods" / "synthetic.py", "memtrain.methods.synthetic",
                    False)
    assert "memtrain.methods._workers" in deps  # imported inside `fit`


def test_the_report_reaches_only_torch_free_core_modules():
    """report/ takes from the core only the record, the column list and the conf/ path, and
    nothing it reaches, transitively, imports torch (it runs where torch is not installed)."""
    edges, mods = graph(), _modules()
    reached, todo = set(), [m for m in edges if package_of(m) == "memtrain.report"]
    while todo:
        for d in edges[todo.pop()] - reached:
            reached.add(d)
            todo.append(d)
    core = {m for m in reached if package_of(m) == "memtrain"}
    assert core <= {"memtrain", "memtrain.record", "memtrain.columns", "memtrain.paths"}, core
    for m in core | {m for m in mods if package_of(m) == "memtrain.report"}:
        f = mods[m]
        assert not {d for d in _imports(f, m, f.name == "__init__.py")
                    if d.split(".")[0] == "torch"}, m


def test_nothing_imports_the_studies():
    """study/ sits on top: it imports the report and the core, nothing imports it."""
    for m, deps in graph().items():
        if package_of(m) != "memtrain.study":
            assert not {d for d in deps if package_of(d) == "memtrain.study"}, m
