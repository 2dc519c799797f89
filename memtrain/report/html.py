"""report.html: report.md as one self-contained page to share (a mail attachment, a chat upload):
its tables, text and every figure embedded as a base64 PNG, no file or address outside it.

Rendered by Python-Markdown (the `tables` extension) from the report.md text itself, so the two
say the same. Raw HTML in the text (an error message quoting `<...>`) is shown as text, never
interpreted: the package's raw-HTML processors are switched off.
"""

from __future__ import annotations

import base64
import html
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 76rem; margin: 2rem auto; padding: 0 1rem;
       color: #222; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.5rem 0 1.2rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.5rem; text-align: left; }
th { background: #f3f3f3; }
tbody tr:nth-child(even) { background: #fafafa; }
img { max-width: 100%; height: auto; }
code { background: #f3f3f3; padding: 0 0.2rem; }
"""


def embed_figures(root: ET.Element, pngs: Mapping[str, bytes]) -> None:
    """Every figure (an `img` whose alt text is the figure's name) as a data: URI; an image
    without PNG bytes becomes its name in brackets (the page refers to no file)."""
    for parent in root.iter():
        for img in [c for c in parent if c.tag == "img"]:
            name = img.get("alt", "")
            if name in pngs:
                img.set("src", "data:image/png;base64,"
                        + base64.b64encode(pngs[name]).decode("ascii"))
            else:
                text = ET.Element("span")
                text.text, text.tail = f"[figure {name}: no PNG]", img.tail
                parent[list(parent).index(img)] = text


def render(markdown_text: str, pngs: Mapping[str, bytes], out: Path) -> str | None:
    """The page for report.md's text with `pngs` (figure name -> PNG bytes) embedded; None
    when the markdown package is not installed (the caller says so)."""
    try:
        import markdown
        from markdown.treeprocessors import Treeprocessor
    except ImportError:
        return None

    class Embed(Treeprocessor):
        def run(self, root: ET.Element) -> None:
            embed_figures(root, pngs)

    md = markdown.Markdown(extensions=["tables"], output_format="html")
    md.preprocessors.deregister("html_block")  # raw HTML in the text stays text
    md.inlinePatterns.deregister("html")
    md.treeprocessors.register(Embed(md), "memtrain_embed", 0)  # after the inline patterns
    body = md.convert(markdown_text)
    title = html.escape(f"memtrain report: {Path(out).name}")
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{title}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{body}\n"
            f"</body>\n</html>\n")
