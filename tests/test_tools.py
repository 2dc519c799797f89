"""The tools beside the package (benchmarks/, tools/) run from a checkout: every module that the
Makefile, scripts/*.sh and the study's plan start with `python -m` is found from the repository's
root, and each benchmark's and tool's command line answers --help (its `main(argv)`, all in this
process rather than a subprocess each)."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re

import pytest
from conftest import ROOT

import benchmarks
from tools.study import study_plan as plan

# `python -m X` as the Makefile and the scripts spell it: $(BIN)/python, $(RESULTS_PY), "$PY",
# $(PYTHON), coverage run
RUN = re.compile(r"(?:python3?|PY\)|PY\"|PYTHON\)|coverage run) -m ([A-Za-z_][\w.]*)")
# a package run as `python -m PKG` whose __main__ hands over to this module's main
MAIN = {"tools.study": "tools.study.results"}


def commands() -> dict[str, set[str]]:
    """file -> the modules it runs with `python -m` (the study's plan: every part's steps at
    the smoke size)."""
    out = {str(p.relative_to(ROOT)): set(RUN.findall(p.read_text(encoding="utf-8")))
           for p in [ROOT / "Makefile", *sorted((ROOT / "scripts").glob("*.sh"))]}
    ctx = plan.Context("cpu", ROOT / "runs" / "unused", plan.PROFILES["smoke"])
    out["tools/study/study_plan.py"] = {s.argv[1] for part in plan.PARTS
                                  for s in plan.BUILDERS[part](ctx) if s.argv[0] == "-m"}
    return out


def command_lines() -> list[str]:
    """Every benchmark (each module of benchmarks/) and every tool (the study, the docs
    generator, the docs' pictures, the module map): the modules run as commands."""
    found = [f"benchmarks.{m.name}" for m in pkgutil.iter_modules(benchmarks.__path__)]
    return sorted([*found, "tools.docs", "tools.doc_figures", "tools.study", "tools.architecture"])


def test_every_module_a_command_runs_is_found_from_the_checkout():
    """A command that names a module that moved (or never was) fails here, not on a GPU box."""
    named = commands()
    assert {"tools.docs", "tools.doc_figures", "tools.study", "benchmarks.kernels",
            "benchmarks.prune"} <= named["Makefile"]
    assert "tools.study" in named["scripts/gpu-results.sh"]
    assert {"memtrain", "benchmarks.overhead", "benchmarks.kernels", "pytest"} <= \
        named["tools/study/study_plan.py"]
    missing = sorted(f"{file}: python -m {m}" for file, mods in named.items() for m in mods
                     if importlib.util.find_spec(m) is None)
    assert missing == [], missing
    ours = {m for mods in named.values() for m in mods if m.split(".")[0] in ("benchmarks",
                                                                               "tools")}
    assert ours <= set(command_lines()), ours - set(command_lines())


def test_each_benchmark_and_tool_answers_help(capsys):
    """`python -m benchmarks.<name> --help` for every benchmark, and the study's, the docs
    generator's and the pictures' --help: usage on stdout, exit 0."""
    names = command_lines()
    assert len(names) >= 13 and "benchmarks.ranks" in names
    failed = []
    for name in names:
        main = importlib.import_module(MAIN.get(name, name)).main
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        out = capsys.readouterr().out
        if e.value.code != 0 or not out.startswith("usage:"):
            failed.append(f"{name}: exit {e.value.code}, {out[:80]!r}")
    assert failed == [], failed


def test_every_deliberate_break_finds_its_line():
    """scripts/check-breaks.sh breaks each core claim by replacing one exact line of the code:
    each line is still there, once (a refactor that moves it would leave the script unable to
    break anything, and it found out only when run)."""
    import shlex

    text = (ROOT / "scripts" / "check-breaks.sh").read_text()
    calls = [[w for w in shlex.split(c) if w != "\n"]  # the lines' continuations
             for c in re.findall(r"^break_one (.+?)(?=\n\S)", text, flags=re.M | re.S)]
    assert len(calls) == 5, calls
    for path, old, _new, test, _claim in calls:
        assert (ROOT / path).read_text().count(old) == 1, (path, old)
        assert (ROOT / test).exists(), test


def test_the_tests_make_test_runs_beside_are_in_the_files_it_collects_for_them():
    """make test runs the tests marked BESIDE (the SLURM ones) in a session of their own that
    collects BESIDE_FILES alone, while the main session leaves that mark out: a test marked so
    in any other file would run in neither."""
    make = (ROOT / "Makefile").read_text()
    mark = re.search(r"^BESIDE := (\S+)$", make, flags=re.M)[1]
    files = set(re.search(r"^BESIDE_FILES := (.+)$", make, flags=re.M)[1].split())
    marked = {f"tests/{p.name}" for p in (ROOT / "tests").glob("*.py")
              if re.search(rf"pytest\.mark\.{mark}\b", p.read_text())}
    assert marked and marked <= files, (marked, files)
