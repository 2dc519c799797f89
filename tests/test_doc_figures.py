"""The docs' pictures of the report's figures (docs/figures/, `make results-figures`) are
drawn from committed rows by the report's own figure functions: each draws again here, and the
values it draws equal the committed `<name>.csv` beside the PNG (the figure's data: images differ
across matplotlib versions, so the pixels are not compared), and it reads: no text over another,
no offset notation, axis labels of one line."""

import pytest

from memtrain.report import draw
from tools import doc_figures


@pytest.mark.slow  # the figure drawn and stamped: ~4 s
@pytest.mark.parametrize("screen", doc_figures.SCREENS, ids=lambda s: s.name)
def test_each_picture_draws_again_from_its_committed_rows(screen, tmp_path):
    made = doc_figures.plot(screen)
    assert draw.layout_problems(made[0].fig) == [], screen.name
    png = doc_figures.draw(screen, out=tmp_path, made=made)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    committed = doc_figures.ROOT / doc_figures.OUT / png.name
    assert committed.is_file(), f"{committed} is not committed: make results-figures"
    data = doc_figures.ROOT / doc_figures.OUT / f"{screen.name}.csv"
    assert data.is_file(), f"{data} is not committed: make results-figures"
    assert (tmp_path / data.name).read_text() == data.read_text(), \
        f"{data.name}: the figure's values differ from its rows: make results-figures"
