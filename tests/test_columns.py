"""memtrain/columns.py, the one list of a row's columns: an undeclared column fails where it is
written (the suite runs with MEMTRAIN_STRICT_COLUMNS=1, conftest.py) and only warns in a user's
run; families cover the flattened options and the phases' copies; docs/outputs.md's table is
generated from the list; the rows of the committed studies hold no column the list lacks."""

import csv
import json
import logging

import pytest
from conftest import ROOT

from memtrain import columns, record


def test_the_suite_checks_every_summary_it_writes():
    assert columns.strict()  # conftest.py: every write_summary of the suite is checked


def test_an_undeclared_column_fails_the_test_that_writes_it(tmp_path):
    with pytest.raises(columns.UndeclaredColumn, match="'mem_peak_typo_bytes'.*columns.py"):
        record.write_summary(tmp_path, {"status": "ok", "mem_peak_typo_bytes": 1})
    assert not (tmp_path / "summary.json").exists()


def test_a_users_run_only_warns_and_keeps_its_row(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(columns.STRICT_ENV)
    with caplog.at_level(logging.WARNING, logger="memtrain.columns"):
        record.write_summary(tmp_path, {"status": "ok", "my_score": 0.5})
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "status": "ok", "my_score": 0.5, columns.SCHEMA: columns.SCHEMA_VERSION}
    assert "undeclared column 'my_score'" in caplog.text


def test_rows_of_an_older_schema_are_named_in_the_docs_captions():
    """A row without `schema_version` is of schema 1 (NaN where a CSV mixes rows); the docs'
    provenance line says what older rows' columns hold, and nothing of current rows."""
    import pandas as pd

    from tools.study import view

    assert [columns.schema_of({columns.SCHEMA: v}) for v in (None, float("nan"), 2.0, "2", "x")] \
        == [1, 1, 2, 2, 1]
    assert columns.schema_caption([columns.SCHEMA_VERSION] * 2) == ""
    old = view.provenance(pd.DataFrame({columns.SCHEMA: [None, float(columns.SCHEMA_VERSION)]}))
    assert old["schema"].startswith("rows of schema 1 ") and columns.SCHEMA_BEFORE[2] in \
        old["schema"]
    assert view.provenance(pd.DataFrame({"status": ["ok"]}))["schema"] == old["schema"]
    assert view.provenance(pd.DataFrame({columns.SCHEMA: [columns.SCHEMA_VERSION]}))[
        "schema"] == ""


@pytest.mark.parametrize("name,declared,unit", [
    ("mem_peak_act_bytes", True, "bytes"),
    ("method.kernel_size", True, "option"),
    ("method.quantize.bits", True, "option"),  # a stack member's option
    ("trainer.batch_size", True, "option"),
    ("part0.mem_peak_act_bytes", True, "bytes"),  # a phase's copy: the column's unit
    ("part3.units", True, "text"),
    ("recovery.test_acc", True, "fraction"),
    ("mem_at_act_peak_optim_bytes", True, "bytes"),
    ("mem_estimate_at_peak_buffers_bytes", True, "bytes"),
    ("mem_at_peak_buffers_bytes", False, None),  # not one of the family's words
    ("part0.part1.steps", False, None),  # no copy of a copy
    ("recovery.nosuch", False, None),
    ("lab", False, None),
])
def test_families_and_phase_copies(name, declared, unit):
    assert columns.declared(name) is declared
    assert columns.unit(name) == unit


def test_labels_and_axes_are_the_reports():
    assert columns.label("method.kernel_size") == "k"
    assert columns.label("method.quantize.bits") == "bits"  # no short name: the option's own
    assert columns.label("mem_at_act_peak_optim_bytes") == "optimizer state"
    assert columns.axis("mem_peak_act_bytes") == "activation memory"
    assert columns.label("mem_peak_act_bytes") == "act. peak"
    assert columns.label("nosuch") == "nosuch"


def test_every_declaration_is_complete():
    names = [c.name for c in columns.COLUMNS]
    assert len(names) == len(set(names))
    for c in columns.COLUMNS:
        assert c.kind in columns.KINDS, c
        assert c.unit in columns.UNITS or c.unit == "as <column>", c
        assert c.writer and c.meaning and "\n" not in c.meaning, c


def test_the_outputs_page_holds_the_generated_table():
    """`python -m memtrain.columns --write docs/outputs.md` after a change to the list."""
    text = (ROOT / "docs" / "outputs.md").read_text(encoding="utf-8")
    assert columns.with_table(text) == text, "docs/outputs.md's column table is stale: run " \
        "`python -m memtrain.columns --write docs/outputs.md`"


def test_the_committed_studies_hold_only_declared_columns():
    """The rows measured on other machines (a GPU's columns too): every raw column of the
    committed summary.csv files is declared; the rest is what the report derives."""
    from memtrain.report import tables

    derived = {*tables.RATIOS.values(), *tables.DELTAS.values(), "is_baseline",
               "baseline_run_dir", "label", "n_phases", "throughput_e2e_samples_s",
               "step_time_e2e_s", "steps_e2e", "timing_noise", "timing_noisy", "error_short",
               "plan_peak_rel", "plan_overhead_pct"}
    files = sorted((ROOT / "docs" / "results").rglob("summary.csv"))
    assert files
    for f in files:
        with open(f, encoding="utf-8") as fh:
            head = next(csv.reader(fh))
        assert not [c for c in head if c not in derived and not columns.declared(c)], f


def test_the_report_ratios_are_declared_once_the_peak_first():
    """Each ratio the report adds divides a declared column (or one the report derives end to
    end), has one name and a one-line definition naming that column; the headline one is the
    step's total peak, and the report computes exactly these."""
    from memtrain.report import tables

    names = [r.name for r in columns.RATIOS]
    assert len(set(names)) == len(names)
    assert columns.RATIOS[0] is columns.HEADLINE
    assert (columns.HEADLINE.name, columns.HEADLINE.of) == ("mem_peak_rel", columns.PEAK)
    assert columns.HEADLINE.axis() == "peak / none (mem_peak_alloc_bytes)"
    for r in columns.RATIOS:
        assert columns.declared(r.of) or r.of.endswith("_e2e_samples_s") or \
            r.of == "step_time_e2e_s", r
        assert f"`{r.of}`" in r.definition() and "\n" not in r.definition(), r
        assert columns.ratio(r.name) is r
    assert {r.of: r.name for r in columns.RATIOS} == tables.RATIOS
