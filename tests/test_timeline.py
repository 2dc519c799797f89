"""`trainer.memory_timeline=true`: the accounting step's memory over its ops (timeline.parquet),
the bytes each module saved (saved_by_module.csv) and checkpoint's plan per segment (plan.csv),
held against the row's columns, against independent counts, against what each method does to
a step's shape, and (on CUDA, or on a made-up allocator history here) against the allocator."""

import pandas as pd
import pytest

from memtrain import api
from memtrain.columns import PEAK, SAVED
from memtrain.memory import allocator, by_module, timeline

pytestmark = pytest.mark.compat  # reads torch's MemTracker internals (measure.PeakTracker)

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8", "trainer.device=cpu",
        "trainer.threads=1", "trainer.memory_timeline=true"]
MLP6_WIDTHS = (1024, 1024, 512, 512, 256)  # conf/model/mlp6.yaml
BATCH, CLASSES = 8, 10  # trainer=smoke's batch, the synthetic images' classes


def _run(tmp_path, *extra):
    row = api.run([*TINY, *extra], out_dir=tmp_path / "r")
    assert row["status"] == "ok", row.get("error")
    df = pd.read_parquet(tmp_path / "r" / row["memory_timeline"])
    return row, df


@pytest.mark.slow  # a run, then its figure drawn (PNG and PDF): ~3-4 s
def test_timeline_peak_is_the_rows_tracked_peak_and_files_are_written(tmp_path):
    row, df = _run(tmp_path)
    assert list(df.columns) == timeline.COLUMNS
    assert set(df["category"]) == set(timeline.TRACKED)  # no allocator, nothing untracked
    totals = df.groupby("event")["bytes"].sum()  # an independent sum over the tidy rows
    assert int(totals.max()) == row["mem_timeline_peak_bytes"] == row["mem_tracker_peak_bytes"] \
        == row[PEAK]  # exact: the same tracker, the same moments
    assert row["mem_timeline_events"] == len(totals) > 10
    assert row["mem_timeline_source"] == "tracker" and row["mem_timeline_step"] == "accounting"
    assert row["mem_accounting_step_s"] > 0
    assert list(dict.fromkeys(df.sort_values("event")["phase"])) == ["forward", "backward",
                                                                     "optimizer"]
    w = timeline.wide(df)
    # parameters are there from the first event on; gradients appear only from backward
    assert (w["params"] == row["mem_params_bytes"]).all()
    assert (w.loc[w["phase"] == "forward", "grads"] == 0).all()
    assert w.loc[w["phase"] == "backward", "grads"].max() > 0
    assert not w["recompute"].any()  # nothing recomputed without checkpointing
    # forward events name the Linear or ReLU they ran in, in the model's order
    fwd = [m for m in dict.fromkeys(w.loc[w["phase"] == "forward", "module"]) if m]
    assert fwd[:5] == ["MLP.0", "MLP.1.0", "MLP.1.1", "MLP.2.0", "MLP.2.1"]
    for ext in ("png", "pdf"):
        assert (tmp_path / "r" / f"timeline.{ext}").stat().st_size > 1000
    # per module, counted by hand: each in-place ReLU saves its output (the Linear's, B x
    # width fp32) and is the first to save it; the next Linear saves that storage again
    # (counted once) and the batch and the weights are no step's own; outside every module the
    # loss keeps log_softmax's output (B x classes) and nll_loss its 4-byte total weight
    saved = by_module.read(tmp_path / "r", row["saved_by_module"])
    got = dict(zip(saved["module"], saved["bytes"]))
    want = {f"MLP.{i + 1}.1": BATCH * w * 4 for i, w in enumerate(MLP6_WIDTHS)}
    want[""] = BATCH * CLASSES * 4 + 4
    assert got == want
    assert saved["bytes"].sum() == row[SAVED] and saved["storages"].sum() == \
        row["mem_act_saved_tensors"]
    assert "plan_table" not in row  # none has no plan


def _act_rises_in_backward(df) -> int:
    w = timeline.wide(df)
    return int((w.loc[w["phase"] == "backward", "act"].diff() > 0).sum())


def _groups(text: str) -> list[tuple[int, int]]:
    return [tuple(map(int, g.split("-"))) for g in text.split(";") if g]


@pytest.mark.slow
def test_checkpoint_timeline_shows_recomputation_and_the_table_its_plan(tmp_path):
    """Activations never grow in none's backward (backward's own allocations are temporaries);
    under checkpointing each recomputed group brings its activations back there, marked as a
    recomputation in its own segments. The plan the run applied is written per segment, and
    report.md's per-module table says for every module what the plan does with its segment."""
    none, none_df = _run(tmp_path / "none", "method=none")
    row, ckpt = _run(tmp_path / "ckpt", "method=checkpoint")  # budget: recomputes some, keeps
    assert _act_rises_in_backward(none_df) == 0
    assert _act_rises_in_backward(ckpt) >= 2
    assert int(ckpt.groupby("event")["bytes"].sum().max()) == row[PEAK]
    groups = _groups(row["plan_groups"])
    kept = set(range(row["plan_segments"])) - {i for a, e in groups for i in range(a, e + 1)}
    assert groups and kept  # mlp6 at this budget: both kinds of segment
    # one recomputation span per group, in backward's order (last group first), each running
    # only the modules of its group's segments (mlp6's segments are its blocks 1..5)
    w = timeline.wide(ckpt)
    spans = [(a, b) for rec, a, b in timeline.spans(w, "recompute") if rec]
    assert len(spans) == len(groups)
    for (a, b), (first, last) in zip(spans, reversed(groups)):
        assert (w.loc[a:b, "phase"] == "backward").all()
        blocks = {int(m.split(".")[1]) - 1 for m in w.loc[a:b, "module"]}
        assert blocks == set(range(first, last + 1))
    # plan.csv: the row's groups, segment by segment
    plan = by_module.read(tmp_path / "ckpt" / "r", row["plan_table"])
    assert list(plan["segment"]) == list(range(row["plan_segments"]))
    assert list(plan["modules"]) == [str(i + 1) for i in range(row["plan_segments"])]
    for i, r in plan.iterrows():
        g = next((f"{a}-{e}" for a, e in groups if a <= i <= e), "")
        assert (r["decision"], r["group"]) == (("recompute", g) if g else ("keep", ""))
    # report.md's table: a row per module, what the plan does with it beside its bytes
    from memtrain.report.build import make_report

    rep = make_report([tmp_path], tmp_path / "report", formats=("png",), html=False)
    text = (tmp_path / "report" / "report.md").read_text()
    head = next(ln for ln in text.splitlines() if ln.startswith("| module |"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    rows = {c[0]: c for c in ([x.strip() for x in ln.strip("|").split("|")]
                              for ln in text.splitlines()[text.splitlines().index(head) + 2:]
                              if ln.startswith("|"))}
    at = cols.index("checkpoint: plan")
    modules = [m for m in rows if m not in ("other modules", "**total**")]
    assert modules and all(m.startswith(("1.", "2.", "3.", "4.", "5.")) or m == by_module.OUTSIDE
                           for m in modules)
    for m in modules:
        said = rows[m][at]
        if m == by_module.OUTSIDE:
            assert said == ""
            continue
        seg = int(m.split(".")[0]) - 1
        g = next(((a, e) for a, e in groups if a <= seg <= e), None)
        assert said == "kept" if g is None else said.startswith(f"recomputed (group {g[0]}-"
                                                                f"{g[1]})"), (m, said)
    # the report's figures: a timeline panel per method, each peak its row's
    drawn = pd.read_csv(tmp_path / "report" / "figures" / "timeline.csv")
    assert rep.figures["timeline"] and list(drawn["label"]) == ["none", "checkpoint"]
    assert list(drawn["peak_bytes"]) == [none[PEAK], row[PEAK]]
    assert (drawn["baseline_peak_bytes"] == none[PEAK]).all()
    assert list(drawn["recomputed_events"]) == [0, int(w["recompute"].sum())]
    assert {"layers", "anatomy"} <= set(rep.figures)


@pytest.mark.slow
def test_synthetic_timeline_shows_its_phases(tmp_path):
    """One accounting step per partition, end to end; the row's peak is the largest phase's."""
    row, df = _run(tmp_path, "method=synthetic")
    parts = list(dict.fromkeys(df.sort_values("event")["part"]))
    assert parts == [f"part{j}" for j in range(len(parts))] and len(parts) >= 2
    for _, g in df.groupby("part"):
        assert list(dict.fromkeys(g.sort_values("event")["phase"])) == [
            "forward", "backward", "optimizer"]
    per_part = df.groupby(["part", "event"])["bytes"].sum().groupby("part").max()
    assert int(per_part.max()) == row["mem_timeline_peak_bytes"] == row[PEAK]
    for p in parts:
        assert int(per_part[p]) == row[f"{p}.mem_tracker_peak_bytes"]
    saved = by_module.read(tmp_path / "r", row["saved_by_module"])
    for p in parts:  # each phase's modules add up to its own saved bytes
        assert saved.loc[saved["part"] == p, "bytes"].sum() == row[f"{p}.{SAVED}"]
    # a partition's layers keep their names in the whole model (mlp6's blocks 1..5), so they
    # line up with none's in the report's per-module table
    assert set(saved["module"]) - {""} <= {f"Partitioned.{i}.{j}" for i in range(1, 6)
                                           for j in (0, 1)}


def test_timeline_off_writes_nothing(tmp_path):
    row = api.run(TINY[:-1], out_dir=tmp_path / "r")
    assert row["status"] == "ok" and "memory_timeline" not in row
    for name in (timeline.FILE, by_module.SAVED_FILE, by_module.PLAN_FILE):
        assert not (tmp_path / "r" / name).exists()
    assert row["mem_accounting_step_s"] > 0  # the comparison a recorded run's cost is read by


# ---------------------------------------------------------------- the acceptance sweep


SWEEP = ("none", "checkpoint", "quantize", "pool")


def _sweep(root):
    """`memtrain -m method=none,checkpoint,quantize,pool model=resnet18 trainer=smoke
    trainer.memory_timeline=true` then `memtrain-report`, in this process, at 8 px."""
    from memtrain.report.build import make_report

    rows = {}
    for m in SWEEP:
        rows[m] = api.run(["trainer=smoke", "model=resnet18", "dataset.image_size=8",
                           "dataset.train_size=16", "dataset.test_size=8", "trainer.max_steps=2",
                           "trainer.device=cpu", "trainer.threads=1",
                           "trainer.memory_timeline=true", f"method={m}"], out_dir=root / m)
        assert rows[m]["status"] == "ok", rows[m].get("error")
    rep = make_report([root], root / "report", formats=("png",), html=False)
    return root, rows, rep


@pytest.mark.slow
def test_the_sweeps_timeline_per_layer_and_anatomy_figures(tmp_path):
    """One sweep, its three figures checked in turn (one test: a fixture shared by three tests
    ran once per xdist worker that took one of them)."""
    sweep = _sweep(tmp_path)
    _timeline_has_a_panel_per_method_at_each_rows_peak(sweep)
    _per_layer_figure_and_table_hold_each_runs_modules(sweep)
    _checkpoint_anatomy_follows_its_plan(sweep)


def _timeline_has_a_panel_per_method_at_each_rows_peak(sweep):
    root, rows, rep = sweep
    drawn = pd.read_csv(root / "report" / "figures" / "timeline.csv")
    assert sorted(drawn["label"]) == sorted(SWEEP) and rep.figures["timeline"]
    for _, d in drawn.iterrows():  # the CPU's timeline is the tracker's: no kernel scratch
        row = rows[d["label"]]
        assert d["peak_bytes"] == row["mem_tracker_peak_bytes"] == row["mem_timeline_peak_bytes"]
        assert row[PEAK] >= row["mem_tracker_peak_bytes"]  # the allocator's: scratch in
        assert d["baseline_peak_bytes"] == rows["none"]["mem_tracker_peak_bytes"]
    assert drawn.set_index("label").loc["checkpoint", "recomputed_events"] > 0
    assert (drawn.set_index("label").drop(index="checkpoint")["recomputed_events"] == 0).all()


def _per_layer_figure_and_table_hold_each_runs_modules(sweep):
    """The figure's bars are each run's saved_by_module.csv gathered onto none's 12 largest
    modules (summed here by hand), and the table's totals are the rows' saved bytes."""
    root, rows, rep = sweep
    from memtrain.report.plots_timeline import module_tables

    drawn = pd.read_csv(root / "report" / "figures" / "layers.csv", keep_default_na=False,
                        dtype={"module": str})
    files = {m: by_module.read(root / m, rows[m]["saved_by_module"]) for m in SWEEP}
    none = files["none"].assign(name=files["none"]["module"].map(timeline.short_module))
    # the largest first, equals in the order the step first saved them
    top = none.groupby("name", sort=False)["bytes"].sum().sort_values(ascending=False,
                                                                      kind="stable")
    top = list(top.index[:by_module.TOP])
    assert list(dict.fromkeys(drawn["module"])) == top
    for m, f in files.items():
        names = f["module"].map(timeline.short_module)
        for mod in top:
            inside = names.map(lambda n, mod=mod: n == mod or n.startswith(mod + "."))
            # a deeper baseline module of the top takes its own bytes (the longest name)
            deeper = [t for t in top if t != mod and t.startswith(mod + ".")]
            for t in deeper:
                inside &= ~names.map(lambda n, t=t: n == t or n.startswith(t + "."))
            got = drawn[(drawn["module"] == mod) & (drawn["label"] == m)]["bytes"]
            assert int(got.iloc[0]) == int(f.loc[inside, "bytes"].sum()), (m, mod)
        assert f["bytes"].sum() == rows[m][SAVED]
    (t, plans), = module_tables(rep.runs).values()
    assert {m: int(t.loc["total", m]) for m in t.columns} == {m: rows[m][SAVED] for m in SWEEP}
    assert set(plans) == {"checkpoint"}  # the only run with a plan
    text = (root / "report" / "report.md").read_text()
    assert "Where the activations live" in text and "| checkpoint: plan |" in text


def _checkpoint_anatomy_follows_its_plan(sweep):
    root, rows, rep = sweep
    drawn = pd.read_csv(root / "report" / "figures" / "anatomy.csv", keep_default_na=False,
                        dtype={"group": str})
    groups = {f"{a}-{e}" for a, e in _groups(rows["checkpoint"]["plan_groups"])}
    seg = drawn[drawn["what"] == "segment"]
    assert len(seg) == rows["checkpoint"]["plan_segments"]
    assert set(seg.loc[seg["decision"] == "recompute", "group"]) == groups
    rec = drawn[drawn["what"] == "recomputed"]
    assert set(rec["group"]) == groups  # every recomputed group seen running in backward


# ---------------------------------------------------------------- CUDA: the allocator history


def test_allocator_events_take_the_trackers_categories():
    """A made-up allocator history: blocks alive at the start keep the tracker's category, an
    allocation takes the category of the storage the tracker saw at its address and size (in
    512-byte blocks), one it never saw is untracked (a workspace), frees give back what their
    allocation took, and each event takes the phase and module of the first tracker event at
    or after it."""
    t0 = 1000.0
    start = [(0x1000, 2048, "params"), (0x9000, 512, "other")]
    births = [(0x3000, 1000, "act"), (0x5000, 4096, "grads")]
    marks = [(0.001, "forward", "M.a", False), (0.002, "forward", "M.b", False),
             (0.003, "backward", "M.b", True), (0.004, "optimizer", "", False)]

    def e(action, addr, size, t):
        return {"action": action, "addr": addr, "size": size, "time_us": (t0 + t) * 1e6}

    entries = [e("alloc", 0x3000, 1000, 0.0005),            # act, 1024 in blocks
               e("segment_alloc", 0xA000, 2 << 20, 0.0011),  # no allocated bytes: no event
               e("alloc", 0x4000, 100, 0.0015),              # never a tensor: untracked 512
               e("free_requested", 0x4000, 100, 0.0016),
               e("free_completed", 0x4000, 100, 0.0016),     # counted at the request
               e("alloc", 0x5000, 4096, 0.0025),             # grads
               e("free_requested", 0x3000, 1000, 0.0026),
               e("alloc", 0x3000, 2000, 0.0031),             # same address, other size: no
               e("free_requested", 0x9000, 512, 0.0035)]     # the batch, from the start
    events = timeline.from_allocator(entries, start, births, marks, t0)
    df = timeline.table(events, categories=timeline.CATEGORIES)
    w = timeline.wide(df)
    cats = ["params", "other", "act", "grads", "untracked"]
    assert w[cats].to_dict("records") == [
        {"params": 2048, "other": 512, "act": 1024, "grads": 0, "untracked": 0},
        {"params": 2048, "other": 512, "act": 1024, "grads": 0, "untracked": 512},
        {"params": 2048, "other": 512, "act": 1024, "grads": 0, "untracked": 0},
        {"params": 2048, "other": 512, "act": 1024, "grads": 4096, "untracked": 0},
        {"params": 2048, "other": 512, "act": 0, "grads": 4096, "untracked": 0},
        {"params": 2048, "other": 512, "act": 0, "grads": 4096, "untracked": 2048},
        {"params": 2048, "other": 0, "act": 0, "grads": 4096, "untracked": 2048}]
    assert list(w["phase"]) == ["forward", "forward", "forward", "backward", "backward",
                                "optimizer", "optimizer"]
    assert list(w["module"])[:2] == ["M.a", "M.b"] and list(w["recompute"])[3:5] == [True, True]
    assert timeline.peak(df)["bytes"] == 2048 + 512 + 4096 + 2048


def test_a_steps_history_is_cut_from_the_shared_ring_buffer():
    def e(i):
        return {"action": "alloc", "addr": i, "size": 512, "time_us": i, "stream": 0}

    before = [e(1), e(2)]
    assert allocator.step_entries(before, [e(1), e(2), e(3), e(4)]) == [e(3), e(4)]
    assert allocator.step_entries(before, [e(2), e(3), e(4)]) == [e(3), e(4)]  # went round
    assert allocator.step_entries([], [e(5)]) == [e(5)]  # recording started with the step
    with pytest.raises(allocator.HistoryLost, match="max_entries"):
        allocator.step_entries(before, [e(3), e(4), e(5)])  # the step's start overwritten


def test_the_snapshot_and_the_timeline_share_one_recorder(monkeypatch, tmp_path):
    """`trainer.memory_snapshot` records the whole run; a step's timeline holds the same
    recorder inside it and letting go of it does not stop the snapshot's recording, which is
    dumped before recording stops (mocked: no CUDA here)."""
    import torch

    from memtrain.run import faults

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda *a, **k: calls.append(("record", a, k)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot",
                        lambda path: calls.append(("dump", path)))
    with faults.MemorySnapshot(True, torch.device("cuda"), tmp_path):
        assert calls == [("record", ("all",), {"context": "all",
                                               "max_entries": allocator.MAX_ENTRIES})]
        allocator.History.hold(context=None)  # a step's timeline (StepHistory)
        allocator.History.release()
        assert len(calls) == 1 and allocator.History.recording()
    assert calls[1] == ("dump", str(tmp_path / faults.SNAPSHOT))
    assert calls[2] == ("record", (None,), {})
    assert not allocator.History.recording()


@pytest.mark.gpu
def test_cuda_timeline_is_the_allocators_and_the_snapshot_stays_whole(tmp_path):
    """CUDA only (skipped without one): the timeline is the accounting step's allocator history;
    its peak is `torch.cuda.max_memory_allocated` over that step within 1% (the history
    records requested sizes, counted here in 512-byte blocks), the parameters are there from
    the first event, and the snapshot recorded beside it still holds the steps after the
    timeline's (one recorder, not stopped) and loads in torch's own reader."""
    import pickle

    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from torch.cuda import _memory_viz

    args = [a for a in TINY if a != "trainer.device=cpu"]
    row = api.run([*args, "trainer.device=cuda", "trainer.memory_snapshot=true"],
                  out_dir=tmp_path / "r")
    assert row["status"] == "ok", row.get("error")
    assert row["mem_timeline_source"] == "cuda" and "mem_timeline_note" not in row
    step_peak = row["mem_timeline_alloc_peak_bytes"]
    assert abs(row["mem_timeline_peak_bytes"] / step_peak - 1) < 0.01
    w = timeline.wide(pd.read_parquet(tmp_path / "r" / row["memory_timeline"]))
    assert abs(w["params"].iloc[0] / row["mem_params_bytes"] - 1) < 0.01
    assert set(w["phase"]) >= {"forward", "backward", "optimizer"}
    with open(row["memory_snapshot"], "rb") as f:
        snap = pickle.load(f)
    assert "segments" in snap and "device_traces" in snap
    allocs = sum(e["action"] == "alloc" for trace in snap["device_traces"] for e in trace)
    assert allocs > row["mem_timeline_events"]  # the whole run, not the one step
    assert _memory_viz.segsum(snap) and _memory_viz.trace(snap)
