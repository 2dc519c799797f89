"""docs/architecture.md's module map (tools/architecture.py) is the code's: its packages, their
modules and which package imports which, read from the source."""

from __future__ import annotations

import pytest

from tools import architecture


@pytest.mark.slow
def test_the_committed_map_is_the_codes():
    text = (architecture.ROOT / architecture.PAGE).read_text(encoding="utf-8")
    assert architecture.with_map(text, architecture.render()) == text, \
        "run: python -m tools.architecture (docs/architecture.md's module map is stale)"


def _tree(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_map_follows_the_imports(tmp_path):
    """A package, its modules (a subpackage's by folder), what it imports outside itself: the
    top level's modules by name, another package by its name, lazy imports counted, a script's
    `__main__` block not."""
    _tree(tmp_path, {
        "memtrain/__init__.py": "",
        "memtrain/errors.py": "",
        "memtrain/runner.py": "from memtrain.config import loader\n",
        "memtrain/config/__init__.py": "",
        "memtrain/config/loader.py": "def f():\n    from memtrain import errors\n",
        "memtrain/config/groups.py": "if __name__ == '__main__':\n    import memtrain.runner\n",
        "memtrain/methods/__init__.py": "",
        "memtrain/methods/checkpoint/__init__.py": "",
        "memtrain/methods/checkpoint/plan.py": "from ...config.loader import x\n",
        "kernels/__init__.py": "",
    })
    lines = architecture.render(tmp_path).splitlines()
    assert lines[2:] == [
        "| `memtrain` (top level) | `errors`, `runner` | `memtrain.config` |",
        "| `memtrain.config` | `groups`, `loader` | top level: errors |",
        "| `memtrain.kernels` |  | nothing |",
        "| `memtrain.methods` | `checkpoint/`, `checkpoint/plan` | `memtrain.config` |",
    ]


def test_a_hand_edit_or_a_missing_marker_is_found():
    block = "| a |\n"
    text = f"head\n{architecture.BEGIN}| old |\n{architecture.END}\ntail\n"
    assert architecture.with_map(text, block) == \
        f"head\n{architecture.BEGIN}{block}{architecture.END}\ntail\n"
    for broken in ("no markers\n", text + architecture.BEGIN):
        with pytest.raises(ValueError, match="one pair of markers"):
            architecture.with_map(broken, block)
