"""A new method is a module and a YAML, nothing else edited: it gets a row, a report label and a
place in the figures. The module lives in a package of the user's, trusted through the
`memtrain.trusted` entry point (docs/SECURITY.md), the YAML in a `--config-dir` of theirs."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest
from conftest import run_memtrain

TOY = '''"""A toy method: it changes nothing but its name (enough to follow it through)."""


class Toy:
    name = "toy"

    def __init__(self, note: str = "hello"):
        self.note = note

    def wrap(self, model):
        return model
'''


@pytest.mark.slow
def test_a_toy_method_gets_a_row_a_label_and_a_place_in_the_figures(in_tmp):
    pkg = in_tmp / "site" / "toymethods"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(TOY)
    dist = in_tmp / "site" / "toymethods-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toymethods\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[memtrain.trusted]\ntoy = toymethods\n")
    (in_tmp / "mine" / "method").mkdir(parents=True)
    (in_tmp / "mine" / "method" / "toy.yaml").write_text("_target_: toymethods.Toy\nnote: hi\n")
    env = {"PYTHONPATH": os.pathsep.join([str(in_tmp / "site"), os.environ.get("PYTHONPATH",
                                                                                "")])}
    p = run_memtrain("-m", "--config-dir", str(in_tmp / "mine"), "method=none,toy",
                     "trainer=smoke", "model=mlp6", "dataset.image_size=8", "hydra.sweep.dir=sw",
                     "+hydra.callbacks.report.formats=[png]",  # the figures' data is read
                     cwd=in_tmp, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(f.read_text()) for f in (in_tmp / "sw").glob("*/summary.json")]
    toy = next(r for r in rows if r["method"] == "toy")
    assert toy["status"] == "ok" and toy["method.note"] == "hi"
    report = (in_tmp / "sw" / "report.md").read_text()
    assert "| toy" in report  # its own label in the tables
    drawn = pd.read_csv(in_tmp / "sw" / "figures" / "tradeoff.csv")
    assert {"none", "toy"} <= set(drawn["method"])  # a point of the trade-off figure
