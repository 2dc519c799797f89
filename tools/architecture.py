"""The module map of docs/architecture.md, drawn from the code: memtrain's packages, their
modules, and which package imports which (read from the source with ast, lazy imports included,
a script's `if __name__ == "__main__":` block left out, as tests/test_imports.py reads them).

    python -m tools.architecture            # rewrite the map between the page's markers
    python -m tools.architecture --check    # exit 1 when the committed map differs

The map sits between `BEGIN` and `END` in docs/architecture.md; everything between them is this
module's output (tests/test_architecture_map.py holds the committed map equal to the code's).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = Path("docs/architecture.md")
BEGIN = "<!-- module-map:begin (python -m tools.architecture) -->\n"
END = "<!-- module-map:end -->"
# where each installed package's files are (kernels/ installs as memtrain.kernels)
SOURCES = {"memtrain": Path("memtrain"), "memtrain.kernels": Path("kernels")}
# the units of the map: memtrain's top level (its modules outside any package) and each package
# below it; a method's folder and the methods' shared code are part of methods/
DEPTH = 2  # memtrain.<package>


def modules(root: Path = ROOT, sources: dict[str, Path] = SOURCES) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `sources` (dotted prefix -> folder
    relative to `root`; by default memtrain/ and kernels/)."""
    out = {}
    for prefix, folder in sources.items():
        for f in sorted((root / folder).rglob("*.py")):
            parts = list(f.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = f
    return out


def is_main_block(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def imports(path: Path, module: str) -> set[str]:
    """Absolute names of everything a file imports (`from pkg import name` names pkg.name too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    tree.body = [n for n in tree.body if not is_main_block(n)]
    base = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                root = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                name = f"{root}.{node.module}" if node.module else root
            else:
                name = node.module
            out |= {name} | {f"{name}.{a.name}" for a in node.names}
    return out


def unit(module: str, packages: set[str]) -> str:
    """The package a module belongs to on the map (`packages`: the modules that are a folder's
    `__init__`): `memtrain` for the top level's own modules, `memtrain.<package>` below it."""
    parts = module.split(".")
    if len(parts) < DEPTH or (len(parts) == DEPTH and module not in packages):
        return "memtrain"
    return ".".join(parts[:DEPTH])


def graph(root: Path = ROOT) -> tuple[dict[str, list[str]], dict[str, set[str]], set[str]]:
    """(package -> its modules, module -> the memtrain modules it imports, the packages)."""
    mods = modules(root)
    packages = {m for m, f in mods.items() if f.name == "__init__.py"}
    members: dict[str, list[str]] = {}
    for m in mods:
        members.setdefault(unit(m, packages), []).append(m)
    edges = {m: {i for i in imports(f, m) if i in mods} - {m} for m, f in mods.items()}
    return members, edges, packages


def _short(module: str, package: str, packages: set[str]) -> str:
    """A module's name inside its package on the map (`memtrain.config.loader` -> `loader`, a
    subpackage's module with its folder: `checkpoint/plan`, the subpackage's `__init__`:
    `checkpoint/`)."""
    return module[len(package) + 1:].replace(".", "/") + ("/" if module in packages else "")


def render(root: Path = ROOT) -> str:
    """The map: one row per package (the top level first), its modules (a package's
    own `__init__` left out), and what it imports outside itself: another package by name, the top
    level's modules one by one."""
    members, edges, packages = graph(root)
    order = ["memtrain"] + sorted(p for p in members if p != "memtrain")
    lines = ["| package | modules | imports |", "|---|---|---|"]
    for p in order:
        shown = sorted(_short(m, p, packages) for m in members[p] if m != p)
        out = {d for m in members[p] for d in edges[m]} - set(members[p])
        names = sorted({unit(d, packages) for d in out} - {"memtrain"})
        top = sorted(d.rpartition(".")[2] for d in out
                     if unit(d, packages) == "memtrain" and d != "memtrain")
        uses = [f"`{q}`" for q in names] + ([f"top level: {', '.join(top)}"] if top else [])
        name = f"`{p}`" + (" (top level)" if p == "memtrain" else "")
        listed = ", ".join(f"`{m}`" for m in shown)
        lines.append(f"| {name} | {listed} | {'; '.join(uses) or 'nothing'} |")
    return "\n".join(lines) + "\n"


def with_map(text: str, block: str) -> str:
    """`text` with the map between its markers replaced; markers missing or twice is an error."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{PAGE}: one pair of markers {BEGIN.strip()} ... {END} expected")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return head + BEGIN + block + END + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.architecture",
                                 description="draw docs/architecture.md's module map")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when the committed map differs from the code's")
    args = ap.parse_args(argv)
    path = ROOT / PAGE
    text = path.read_text(encoding="utf-8")
    new = with_map(text, render())
    if new == text:
        return 0
    if args.check:
        print(f"{PAGE}: the module map differs from the code: run python -m tools.architecture",
              file=sys.stderr)
        return 1
    path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
