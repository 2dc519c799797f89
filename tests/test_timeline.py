"""`trainer.memory_timeline=true`: the accounting step's memory over its ops (timeline.parquet),
held against the row's tracked peak and against what each method does to a step's shape."""

import pandas as pd
import pytest

from memtrain import api, timeline

pytestmark = pytest.mark.compat  # reads torch's MemTracker internals (measure.PeakTracker)

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8", "trainer.device=cpu",
        "trainer.threads=1", "trainer.memory_timeline=true"]


def _run(tmp_path, *extra):
    row = api.run([*TINY, *extra], out_dir=tmp_path / "r")
    assert row["status"] == "ok", row.get("error")
    df = pd.read_parquet(tmp_path / "r" / row["memory_timeline"])
    return row, df


def test_timeline_peak_is_the_rows_tracked_peak_and_files_are_written(tmp_path):
    row, df = _run(tmp_path)
    assert list(df.columns) == timeline.COLUMNS
    assert set(df["category"]) == set(timeline.CATEGORIES)
    totals = df.groupby("event")["bytes"].sum()  # an independent sum over the tidy rows
    assert int(totals.max()) == row["mem_timeline_peak_bytes"] == row["mem_tracker_peak_bytes"] \
        == row["mem_peak_alloc_bytes"]  # exact: the same tracker, the same moments
    assert row["mem_timeline_events"] == len(totals) > 10
    assert list(dict.fromkeys(df.sort_values("event")["phase"])) == ["forward", "backward",
                                                                     "optimizer"]
    w = timeline.wide(df)
    # parameters are there from the first event on; gradients appear only from backward
    assert (w["params"] == row["mem_params_bytes"]).all()
    assert (w.loc[w["phase"] == "forward", "grads"] == 0).all()
    assert w.loc[w["phase"] == "backward", "grads"].max() > 0
    assert any(m.startswith("MLP.") for m in w.loc[w["phase"] == "forward", "module"])
    for ext in ("png", "pdf"):
        assert (tmp_path / "r" / f"timeline.{ext}").stat().st_size > 1000


def _act_rises_in_backward(df) -> int:
    w = timeline.wide(df)
    return int((w.loc[w["phase"] == "backward", "act"].diff() > 0).sum())


def test_checkpoint_timeline_shows_recomputation_in_backward(tmp_path):
    """Activations never grow in none's backward (backward's own allocations are temporaries);
    under checkpointing each recomputed segment brings its activations back there."""
    _, none = _run(tmp_path / "none", "method=none")
    row, ckpt = _run(tmp_path / "ckpt", "method=checkpoint", "method.strategy=uniform")
    assert _act_rises_in_backward(none) == 0
    assert _act_rises_in_backward(ckpt) >= 4  # mlp6: a rise per recomputed segment at least
    assert int(ckpt.groupby("event")["bytes"].sum().max()) == row["mem_peak_alloc_bytes"]
    # the report: a panel per method, each panel's peak its row's, none's peak the reference
    from memtrain.report.build import make_report

    rep = make_report([tmp_path], tmp_path / "report", formats=("png",))
    drawn = pd.read_csv(tmp_path / "report" / "figures" / "timeline.csv")
    assert rep.figures["timeline"] and list(drawn["label"]) == ["none", "checkpoint"]
    none_row = rep.runs[rep.runs["method"] == "none"].iloc[0]
    assert list(drawn["peak_bytes"]) == [none_row["mem_peak_alloc_bytes"],
                                         row["mem_peak_alloc_bytes"]]
    assert (drawn["baseline_peak_bytes"] == none_row["mem_peak_alloc_bytes"]).all()


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
    assert int(per_part.max()) == row["mem_timeline_peak_bytes"] == row["mem_peak_alloc_bytes"]
    for p in parts:
        assert int(per_part[p]) == row[f"{p}.mem_tracker_peak_bytes"]


def test_timeline_off_writes_nothing(tmp_path):
    row = api.run(TINY[:-1], out_dir=tmp_path / "r")
    assert row["status"] == "ok" and "memory_timeline" not in row
    assert not (tmp_path / "r" / timeline.FILE).exists()


@pytest.mark.gpu
def test_cuda_timeline_peak_against_the_allocator(tmp_path):
    """CUDA only (not run on this project's CPU machine): the timeline comes from the tracker
    there too; its peak is held within 1% to the allocator peak of the next step (the same
    shape: the row's CUDA peak is the timed steps'), and
    the shared allocator history still dumps a snapshot torch can read."""
    import pickle

    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    args = [a for a in TINY if a != "trainer.device=cpu"]
    row = api.run([*args, "trainer.device=cuda", "trainer.memory_snapshot=true",
                   "trainer.warmup_steps=0", "trainer.max_steps=2"], out_dir=tmp_path / "r")
    assert row["status"] == "ok", row.get("error")
    assert row["mem_timeline_peak_bytes"] == row["mem_tracker_peak_bytes"]
    assert abs(row["mem_timeline_peak_bytes"] / row["mem_peak_alloc_bytes"] - 1) < 0.01
    with open(row["memory_snapshot"], "rb") as f:
        snap = pickle.load(f)
    assert "segments" in snap and "device_traces" in snap
