"""`memtrain-report A B --compare` (one report over several sweeps, each row naming its source)
and report.html (self-contained: every figure embedded) on fabricated run folders
(tests/report_fixtures.py: made-up numbers)."""

import base64
import re

import pandas as pd
import pytest
from report_fixtures import MiB, write_run

from memtrain.report.build import make_report
from memtrain.report.command import main as report_main


def _sweep(folder, none_peak, pool_peak, acc_drop, status="ok", error=None):
    """none and pool k=2, seeds 0 and 1; the same run_ids in every sweep (the same configs run
    twice: the rows of one source must not replace the other's)."""
    for seed in (0, 1):
        write_run(folder / f"n{seed}", seed=seed, peak=none_peak * MiB, act=none_peak / 2 * MiB,
                  test_acc=0.90, extra={"run_id": f"none-{seed}"})
        write_run(folder / f"p{seed}", method="pool", params={"kernel_size": 2}, seed=seed,
                  peak=pool_peak * MiB, act=pool_peak / 2 * MiB, test_acc=0.90 - acc_drop,
                  status=status, extra={"run_id": f"pool-{seed}",
                                        **({"error": error} if error else {})})
    return folder


@pytest.fixture
def two(tmp_path):
    return (_sweep(tmp_path / "cpu", 100, 60, 0.02),
            _sweep(tmp_path / "gpu", 200, 80, 0.04))


def _table(md: str) -> pd.DataFrame:
    lines = [x for x in md.splitlines() if x.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in x.strip("|").split("|")] for x in lines[1:]]
    return pd.DataFrame([r for r in rows if r != head], columns=head)


def test_compare_names_each_rows_source_and_relates_it_to_its_own_baseline(two, tmp_path,
                                                                             capsys):
    cpu, gpu = two
    assert report_main([str(cpu), f"big={gpu}", "--compare", "--no-figures"]) == 0
    out = cpu.parent / "compare"  # the default: beside the first source
    runs = pd.read_csv(out / "summary.csv")
    assert len(runs) == 8  # the same run_ids in both sources: none replaced
    assert sorted(runs["source"].unique()) == ["big", "cpu"]
    rel = runs.set_index(["source", "method", "trainer.seed"])["mem_peak_rel"]
    assert rel["cpu", "pool", 0] == pytest.approx(60 / 100)  # its own sweep's none
    assert rel["big", "pool", 0] == pytest.approx(80 / 200)
    md = (out / "report.md").read_text()
    assert "Compared: `big`, `cpu`" in md
    t = _table(md)
    assert list(t.columns[:3]) == ["setting", "source", "seeds"]
    got = {(r["setting"], r["source"]): (r["peak / none"], r["Δ acc (pts)"])
           for _, r in t.iterrows()}
    assert got == {("none", "big"): ("1.00", "+0.0"), ("pool", "big"): ("0.40", "-4.0"),
                   ("none", "cpu"): ("1.00", "+0.0"), ("pool", "cpu"): ("0.60", "-2.0")}
    settings = pd.read_csv(out / "settings.csv")
    assert sorted(settings["label"]) == ["none [big]", "none [cpu]", "pool [big]", "pool [cpu]"]
    assert "source" in capsys.readouterr().out  # the terminal table names it too


def test_compare_refuses_two_sources_with_one_label(two, tmp_path, capsys):
    cpu, gpu = two
    assert report_main([f"x={cpu}", f"x={gpu}", "--compare", "--out",
                        str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "both labelled 'x'" in err and "A=PATH B=PATH" in err


@pytest.mark.slow  # every figure drawn: ~5 s
def test_report_html_embeds_every_figure_and_refers_to_no_file(two, tmp_path):
    cpu, gpu = two
    rep = make_report([cpu, gpu], tmp_path / "out", compare=True, formats=("pdf",))
    assert rep.figures  # drawn as PDF only: the page still gets each as PNG
    page = (tmp_path / "out" / "report.html").read_text()
    srcs = re.findall(r'<img alt="([^"]+)" src="([^"]+)"', page)
    assert sorted(name for name, _ in srcs) == sorted(rep.figures)
    for _, src in srcs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r'(src|href)="(?!data:)', page)  # no file, no address outside
    assert "<th>source</th>" in page and "<td>gpu</td>" in page  # the tables, as tables


@pytest.mark.slow
def test_report_html_takes_the_png_files_and_shows_text_as_text(tmp_path):
    r = _sweep(tmp_path / "r", 100, 60, 0.02, status="error",
               error="RuntimeError: <script>alert(1)</script> & co")
    rep = make_report([r], tmp_path / "out", formats=("png",))
    page = (tmp_path / "out" / "report.html").read_text()
    for name in rep.figures:
        png = (tmp_path / "out" / "figures" / f"{name}.png").read_bytes()
        assert f'src="data:image/png;base64,{base64.b64encode(png).decode()}"' in page
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in page
