"""benchmarks/native.py: the budget plan against the model's own checkpointing. Its rows at a
tiny size (a 2-layer llama of width 32, one round of one step, no re-plans): the budget is
native's measured activation peak, the plan holds it or its row says by how much and why not,
and the verdict reads the rounds' ratios. On a fake runner: the re-plan loop and the fallback
from op to block plans; the interleaving alternates the order; the table reads back from CSV."""

from __future__ import annotations

import pytest
import torch

import benchmarks as bench
from benchmarks import native
from benchmarks.checkpoint import write_csv

TINY = native.Case("llama_tiny", ("model=hf", "model.name=llama", "model.config.hidden_size=32",
                                  "dataset.seq_len=16", "dataset.vocab_size=64",
                                  "dataset.train_size=4", "dataset.test_size=2"), 2)


@pytest.fixture(scope="module")
def row():
    """The benchmark's row of the tiny llama (its imports and three plans: seconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return native.measure_case(TINY, rounds=1, reps=1, warmup=0, replans=0)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_the_plan_is_asked_for_natives_peak_and_holds_it_or_says_why(row):
    assert row["budget_bytes"] == row["native_act_peak_bytes"]
    assert row["native_act_peak_bytes"] < row["none_act_peak_bytes"]  # native saves
    assert row["planner_act_peak_bytes"] < row["none_act_peak_bytes"]
    over = row["planner_act_peak_bytes"] - row["budget_bytes"]
    assert row["within_budget"] == (over <= 0)
    if over > 0:  # a loss on memory is said as one, with its bytes
        assert f"{over} bytes over" in row["plan_note"]
    else:
        assert row["plan_note"] == ""
    assert row["plan_granularity"] in ("op", "block")
    assert row["plan_granularity"] in row["granularities_tried"].split(", ")
    for n in native.VARIANTS:
        assert row[f"{n}_act_temp_peak_bytes"] >= row[f"{n}_act_peak_bytes"] > 0
        assert row[f"{n}_step_s"] > 0


@pytest.mark.slow
def test_the_ratio_and_verdict_are_the_rounds(row):
    assert row["ratio_min"] <= row["planner_vs_native"] <= row["ratio_max"]
    assert row["verdict"] == native.verdict([row["ratio_min"], row["ratio_max"]])


def test_the_verdict_needs_every_round():
    assert native.verdict([0.9, 0.95]) == "planner faster"
    assert native.verdict([1.01, 1.2]) == "planner slower"
    assert native.verdict([0.9, 1.1]) == "equal within spread"
    assert native.verdict([1.0]) == "equal within spread"


def test_the_rounds_alternate_the_order():
    calls: list[str] = []
    steps = {n: (lambda n=n: calls.append(n)) for n in ("a", "b", "c")}
    out = native.interleaved(steps, rounds=2, reps=2, device=torch.device("cpu"))
    assert calls == ["a", "a", "b", "b", "c", "c", "c", "c", "b", "b", "a", "a"]
    assert {n: len(v) for n, v in out.items()} == {"a": 2, "b": 2, "c": 2}


@pytest.mark.slow
def test_the_table_reads_back_from_csv(row, tmp_path):
    path = tmp_path / "native.csv"
    write_csv(str(path), [row])
    back = bench.read_rows(path)
    assert native.table(back) == native.table([row])
    lines = native.table([row]).splitlines()
    assert lines[2].startswith("| llama_tiny | 2 | ")
    assert ("| yes |" if row["within_budget"] else "| no (+") in lines[2]


class FakeRunner:
    """A plan whose measured activation peak is `MEASURED(granularity, asked bytes)`; the
    planner raises a budget below `LEAST[granularity]` to it, as memtrain's does."""
    MEASURED = {"op": lambda b: b + 100, "block": lambda b: b + 300}
    LEAST = {"op": 0, "block": 0}
    asked: list[tuple[str, int]] = []

    def __init__(self, case, method, x, y):
        opts = dict(o.split("=", 1) for o in method)
        self.g, b = opts["method.granularity"], int(opts["method.budget_bytes"])
        least = self.LEAST[self.g]
        self.columns = {"plan_peak_bytes": max(b, least), "plan_granularity": self.g,
                        **({"plan_budget_raised_to_bytes": least} if b < least else {})}
        self.peak = self.MEASURED[self.g](max(b, least))
        FakeRunner.asked.append((self.g, b))

    def step(self):
        pass

    def peaks(self):
        return self.peak, self.peak + 1


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(native, "Runner", FakeRunner)
    FakeRunner.asked = []
    FakeRunner.LEAST = {"op": 0, "block": 0}
    FakeRunner.MEASURED = {"op": lambda b: b + 100, "block": lambda b: b + 300}
    return FakeRunner


def test_a_plan_over_the_budget_is_asked_again_below_by_its_excess(fake):
    plan, got = native.plan_within(TINY, 1000, None, None, warmup=0, granularity="op")
    assert fake.asked == [("op", 1000), ("op", 900)]
    assert (got["peaks"][0], got["first_act_peak"], got["replans"], got["asked"]) == \
        (1000, 1100, 1, 900)


def test_re_plans_stop_at_the_cap_and_at_the_least_modelled_peak(fake):
    fake.MEASURED = {"op": lambda b: 1100, "block": lambda b: b}  # never under
    _, got = native.plan_within(TINY, 1000, None, None, 0, "op", replans=2)
    assert [b for _, b in fake.asked] == [1000, 900, 800] and got["replans"] == 2
    fake.asked, fake.LEAST = [], {"op": 950, "block": 0}
    _, got = native.plan_within(TINY, 1000, None, None, 0, "op", replans=2)
    assert [b for _, b in fake.asked] == [1000, 900] and got["raised"] == 950


def test_an_op_plan_over_the_budget_gives_way_to_a_block_plan_that_holds_it(fake):
    fake.LEAST = {"op": 1000, "block": 0}  # the op plan cannot go lower; it measures 1100
    plan, got = native.best_plan(TINY, 1000, None, None, 0, "op")
    assert fake.asked == [("op", 1000), ("op", 900), ("block", 1000), ("block", 700)]
    assert plan.g == "block" and got["tried"] == "op, block"
    assert (got["peaks"][0], got["first_act_peak"], got["replans"]) == (1000, 1100, 2)


def test_of_two_plans_over_the_budget_the_lower_is_kept(fake):
    fake.LEAST = {"op": 1000, "block": 1000}  # op measures 1100, block 1300
    plan, got = native.best_plan(TINY, 1000, None, None, 0, "op")
    assert plan.g == "op" and got["tried"] == "op, block" and got["peaks"][0] == 1100
