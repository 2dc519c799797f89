"""The docs: README.md a front page of at most 15 KB whose links reach the pages' headings in one
click, one page per topic under docs/ (each at most 30 KB, the architecture at most 25 KB),
every link and anchor whole both on GitHub and on the site, and the site built by
`mkdocs build --strict` with anchor validation (mkdocs.yml, `make docs`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
KB = 1024
# memtrain-report's and the study's own outputs, committed beside their rows: no hand-written
# pages (mkdocs.yml's not_in_nav)
GENERATED = ("results/rows/", "results/studies/", "results/2026-11-23_cpu/")
# the headings a newcomer reaches from README in one click: (page, heading)
TASKS = {
    "study your own model": ("docs/extending.md", "Your own model"),
    "add a method": ("docs/extending.md", "Your own method"),
    "sweep on SLURM": ("docs/clusters.md", "SLURM"),
    "estimate without a GPU": ("docs/estimate.md", "The GPU-free estimate"),
    "read a report": ("docs/reports.md", "Reading a report"),
}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def pages() -> list[Path]:
    """The hand-written pages of docs/."""
    return sorted(p for p in DOCS.rglob("*.md")
                  if not p.relative_to(DOCS).as_posix().startswith(GENERATED))


def prose(path: Path) -> list[str]:
    """The file's lines outside code fences, inline code removed."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        lines.append("" if fenced else re.sub(r"`[^`\n]*`", "", line))
    return lines


def heading_texts(path: Path) -> list[str]:
    """Each heading's text as rendered: code spans kept as their text, links as their text."""
    texts, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip())
            texts.append(text.replace("`", ""))
    return texts


def github_slug(text: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, each
    space a `-` (not collapsed)."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def site_slug(text: str) -> str:
    """The site's anchor of a heading (Python-Markdown's toc, as mkdocs-material uses it)."""
    from markdown.extensions.toc import slugify

    return slugify(text, "-")


def anchors(path: Path) -> set[str]:
    return {github_slug(t) for t in heading_texts(path)}


def links(path: Path) -> list[str]:
    return [m for line in prose(path) for m in LINK.findall(line)]


def broken_links(path: Path, inside: Path) -> list[str]:
    """`file: link` for each relative link of `path` whose file is missing or outside `inside`,
    or whose anchor no heading of its page has."""
    bad = []
    for link in links(path):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        dest = (path.parent / target).resolve() if target else path
        if not dest.is_relative_to(inside.resolve()) or not dest.exists():
            bad.append(f"{path.relative_to(ROOT)}: {link}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.relative_to(ROOT)}: {link} (no such heading)")
    return bad


def test_readme_is_a_front_page_of_at_most_15_kb():
    """Each later feature adds its page and at most a line here."""
    assert (ROOT / "README.md").stat().st_size <= 15 * KB


def test_every_page_is_at_most_30_kb_and_the_architecture_at_most_25():
    sizes = {p.relative_to(ROOT).as_posix(): p.stat().st_size for p in pages()}
    assert {p: s for p, s in sizes.items() if s > 30 * KB} == {}
    assert sizes["docs/architecture.md"] <= 25 * KB
    assert len(sizes) > 20  # the walk found the pages


def test_links_stay_inside_and_reach_their_headings():
    """Pages link only inside docs/ (code is named in backticks), README.md inside the
    repository, and every anchor is a heading of its page: the same Markdown reads on GitHub
    and on the site."""
    bad = broken_links(ROOT / "README.md", ROOT)
    for page in pages():
        bad += broken_links(page, DOCS)
    assert bad == []


def test_the_link_check_finds_what_is_broken(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\n## Some part\n")
    (tmp_path / "x.py").write_text("")
    (docs / "b.md").write_text("[ok](a.md#some-part) [gone](a.md#other) [out](../x.py) "
                               "[missing](c.md) `[code](c.md)` [web](https://a.b/c)\n"
                               "```\n[fenced](c.md)\n```\n")
    assert broken_links(docs / "b.md", docs) == [
        "docs/b.md: a.md#other (no such heading)", "docs/b.md: ../x.py", "docs/b.md: c.md"]


def test_every_heading_has_the_same_anchor_on_github_and_on_the_site():
    different = [(p.relative_to(ROOT).as_posix(), t) for p in [ROOT / "README.md", *pages()]
                 for t in heading_texts(p) if github_slug(t) != site_slug(t)]
    assert different == []


@pytest.mark.parametrize("task", TASKS)
def test_readme_reaches_each_task_in_one_click(task):
    """README.md links straight to the heading that says how."""
    page, heading = TASKS[task]
    assert heading in heading_texts(ROOT / page), (task, page)
    assert f"{page}#{github_slug(heading)}" in links(ROOT / "README.md"), task


def _build(config: Path, site: Path) -> None:
    """`mkdocs build --strict` in process: mkdocs' Abort on any warning."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    build(load_config(str(config), strict=True, site_dir=str(site)))


@pytest.mark.slow  # mkdocs-material renders every page: several seconds on 2 cores
def test_the_site_builds_strict(tmp_path, monkeypatch):
    """`make docs`: every page in the nav or named not-in-nav, every link and anchor whole."""
    pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["validation"]["anchors"] == "warn"  # a broken anchor fails a strict build
    _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert (tmp_path / "site" / "methods" / "checkpoint" / "index.html").is_file()


@pytest.mark.slow  # two small mkdocs builds
def test_a_broken_anchor_fails_the_strict_build(tmp_path, monkeypatch):
    """The site's validation (mkdocs.yml's, on a two-page site) fails on an anchor no heading
    has, and passes once it is whole."""
    pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")
    from mkdocs.exceptions import Abort

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    ours = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## Some part\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump({"site_name": "t", "theme": {"name": "material"},
                                      "validation": ours["validation"]}))
    (tmp_path / "docs" / "index.md").write_text("# A\n\n[b](b.md#no-such-part)\n")
    with pytest.raises(Abort):
        _build(config, tmp_path / "site")
    (tmp_path / "docs" / "index.md").write_text("# A\n\n[b](b.md#some-part)\n")
    _build(config, tmp_path / "site")
