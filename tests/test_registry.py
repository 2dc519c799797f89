"""Registry-wide claims, every case from the walker (tests/walker.py): every method of conf/method
(and the variants that change what its run measures) on every model of conf/model.

1. The GPU-free estimate predicts what a run measures: the tracker's total peak
   (`mem_tracker_peak_bytes`, the CPU's `mem_peak_alloc_bytes`) and its activation peak
   (`mem_peak_act_bytes`, recomputation included), both within 10%, on the reference models.
2. Memory honesty against `none` on the same model, seed and batch: a method that reports fewer
   saved bytes than none must not have a higher activation peak, with or without backward's
   temporaries (the columns may not tell opposite stories), in the measured columns on the
   reference models and in the estimate's columns on every other model.
3. A walked case a method cannot run (walker.REFUSED: prune on a ResNet of basic blocks without
   prune_head) is refused up front in one line (ConfigError), the line the walker names.
4. Every method at its defaults runs on every model (prepared, its plan made and its step
   estimated) or refuses in one line with the reason the walker names (AT_DEFAULTS_REFUSED:
   prune where it would prune nothing, offload without a GPU).
"""

import pytest
import torch
import walker
from conftest import deep_marks
from walker import Case

from memtrain.errors import ConfigError

PAIRS = {"mem_estimate_bytes": "mem_tracker_peak_bytes",
         "mem_estimate_act_bytes": "mem_peak_act_bytes"}
MEASURED = {"saved": "mem_act_saved_bytes", "act": "mem_peak_act_bytes",
            "act+temp": "mem_peak_act_temp_bytes"}
ESTIMATED = {"saved": "mem_estimate_saved_bytes", "act": "mem_estimate_act_bytes",
             "act+temp": "mem_estimate_act_temp_bytes"}

# Make test-compat walks the same cases: the estimate runs on fake tensors under torch's
# MemTracker, and the methods' saved-tensor hooks and kernels run under both.
pytestmark = [pytest.mark.compat]


def _row(case: Case, level: str) -> dict:
    fetch = walker.measured if level == "measured" else walker.estimated
    try:
        row = fetch(case)
    except ConfigError as e:  # a method may refuse a model or the CPU up front (offload)
        if case.method == "offload":
            pytest.skip(f"offload runs on CUDA only (its hooks are tested on the CPU in "
                        f"test_offload): {e}")
        raise
    assert row["status"] == "ok", row.get("error")
    assert "mem_estimate_error" not in row, row["mem_estimate_error"]
    return row


def _no_loss_in_activation_peak(case: Case, row: dict, level: str) -> None:
    cols = MEASURED if level == "measured" else ESTIMATED
    base = _row(Case("none", case.model), level)
    saved = row[cols["saved"]] / base[cols["saved"]]
    for peak in ("act", "act+temp"):  # the activation peak, and with backward's temporaries
        act = row[cols[peak]] / base[cols[peak]]
        if saved < 1:
            assert act <= 1, (f"{case.id} ({level}): saved bytes x{saved:.3f} but {peak} peak "
                              f"x{act:.3f}")


def _known(cases: list[Case]) -> list:
    """The cases, a known defect (walker.KNOWN) as a strict xfail (it fails once fixed), a
    deeper twin's (conftest.TWINS) marked deep: make check-studies walks it."""
    return [pytest.param(c, marks=[*deep_marks(c.model), *(
        [pytest.mark.xfail(strict=True, reason=walker.KNOWN[c])] if c in walker.KNOWN else [])])
        for c in cases]


@pytest.mark.slow
@pytest.mark.parametrize("case", _known(walker.measured_cases()), ids=lambda c: c.id)
def test_estimate_predicts_the_measured_step_and_savings_are_honest(case):
    row = _row(case, "measured")
    if case.method == "synthetic":  # the row is the largest phase's, and so is the estimate
        assert row["mem_estimate_phase"] == row["synthetic_largest_phase"]
        assert row["mem_estimate_act_phase"] == row["synthetic_largest_act_phase"]
    for est, real in PAIRS.items():
        ratio = row[est] / row[real]
        print(f"{case.id}: {est}/{real} = {ratio:.4f}")
        assert abs(ratio - 1) < 0.10, (est, row[est], real, row[real])
    _no_loss_in_activation_peak(case, row, "measured")


@pytest.mark.slow
@pytest.mark.breadth  # the wide models: their ops are the reference models' on the old torch
@pytest.mark.parametrize("case", _known(walker.estimated_cases(
    [m for m in walker.MODELS if m not in walker.MEASURED])), ids=lambda c: c.id)
def test_every_method_prepares_on_every_model_and_its_estimate_is_honest(case):
    row = _row(case, "estimated")
    _no_loss_in_activation_peak(case, row, "estimated")


@pytest.mark.slow
@pytest.mark.parametrize("case", walker.refused_cases(), ids=lambda c: c.id)
def test_a_walked_case_a_method_cannot_run_is_refused_in_one_line(case):
    with pytest.raises(ConfigError) as refused:
        walker.run_refused(case)
    line = str(refused.value)
    assert "\n" not in line and walker.REFUSED[case] in line, line


def test_the_walks_run_every_method_at_its_defaults_on_every_model():
    """Claim 4's pairs: the measured and estimated walks (their tests assert status ok) and
    the at-defaults cases below are every method (a stack on STACK_MODELS) on every model."""
    every = {(m, model) for model in walker.MODELS for m in walker.METHODS
             if "+" not in m or model in walker.STACK_MODELS}
    rest = {(c.method, c.model) for c in walker.at_defaults_cases()}
    assert walker.walked_at_defaults() | rest == every
    assert not walker.walked_at_defaults() & rest


@pytest.mark.slow
@pytest.mark.breadth
@pytest.mark.parametrize("case", _known(walker.at_defaults_cases()), ids=lambda c: c.id)
def test_every_method_at_its_defaults_runs_on_every_model_or_refuses_in_one_line(case):
    why = walker.AT_DEFAULTS_REFUSED.get((case.method, case.model))
    if case.method == "offload" and torch.cuda.is_available():
        why = None
    if why is None:
        row = walker.estimated(case)
        assert row["status"] == "ok", row.get("error")
        assert "mem_estimate_error" not in row, row["mem_estimate_error"]
        return
    with pytest.raises(ConfigError) as refused:
        walker.estimated(case)
    line = str(refused.value)
    assert "\n" not in line and why in line, line
