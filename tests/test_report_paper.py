"""Figures a paper can use as is: display names, the breakdown at the activation peak,
end-to-end throughput of multi-phase runs, timing noise, the budget target, curves of composed
and step-based evaluation, legible failures with their reason, report.md's precision, the two
looks. Fabricated folders (tests/report_fixtures.py: made-up numbers) unless a test trains."""

import json

import matplotlib.colors as mcolors
import numpy as np
import pandas as pd
import pytest
from report_fixtures import MiB, write_run

from memtrain.report import derive, names, plots, style, tables
from memtrain.report.build import analyse, make_report
from memtrain.report.command import main as report_main

PANEL = names.DEFAULT.panel("resnet18", "cifar10")


def _settings(folder, **kw):
    raw, _ = tables.load_runs([folder])
    return analyse(raw, **kw)


def _notes(fig) -> list[str]:
    """Texts of the figure's legends (settings, then the notes under the panels)."""
    return [t.get_text() for leg in fig.legends for t in leg.get_texts()]


def _by_label(settings):
    return settings.set_index("label")


# ---------------------------------------------------------------- names


def test_default_names_are_short():
    n = names.DEFAULT
    row = {"method": "checkpoint", "method.strategy": "budget", "method.budget_fraction": 0.65}
    assert n.setting(row, skip=["method.strategy"]) == "checkpoint b=0.65"
    assert n.setting({"method": "pool", "method.kernel_size": 2, "method.targets": "conv+bn"}) \
        == "pool k=2 conv+bn"
    assert n.setting({"method": "pool", "method.kernel_size": 1.0, "method.targets": "conv"}) \
        == "pool compaction only conv"  # the name covers kernel_size only
    assert n.setting({"method": "prune", "method.prune_head": True}) == "prune head=true"
    compile_ = {"method": "checkpoint", "method.strategy": "compile", "method.budget_fraction": .5}
    assert n.setting(compile_) == "checkpoint compile amb=0.5"  # torch's budget, not b
    assert n.panel("mlp6", "fashion_mnist") == "MLP-6 / Fashion-MNIST"
    assert n.panel("mine", "data") == "mine / data"  # unknown names are kept


@pytest.mark.slow
def test_names_file_and_label_flag_rename_settings(tmp_path, capsys):
    r = tmp_path / "runs"
    for k in (1, 2, 4):
        write_run(r / f"p{k}", method="pool", params={"kernel_size": k})
    write_run(r / "n")
    f = tmp_path / "names.yaml"
    f.write_text("params: {kernel_size: window}\n"
                 "settings: [{method: pool, kernel_size: 4, name: coarse pool}]\n"
                 "models: {resnet18: RN18}\ndatasets: {cifar10: C10}\n")
    assert report_main([str(r), "--names", str(f), "--label", "pool window=2:Pool (2×2)",
                        "--format", "png"]) == 0
    labels = set(pd.read_csv(r / "settings.csv")["label"])
    # the built-in rule still names k=1; the user's rule wins for k=4
    assert labels == {"none", "pool compaction only", "Pool (2×2)", "coarse pool"}
    md = (r / "report.md").read_text()
    assert "## RN18 / C10" in md and "| Pool (2×2) |" in md
    drawn = pd.read_csv(r / "figures" / "tradeoff.csv")
    assert set(drawn["panel"]) == {"RN18 / C10"} and "Pool (2×2)" in set(drawn["label"])


def test_bad_names_are_one_line_errors(tmp_path, capsys):
    write_run(tmp_path / "runs" / "a")
    bad = tmp_path / "bad.yaml"
    bad.write_text("colours: {pool: red}\n")
    assert report_main([str(tmp_path / "runs"), "--names", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown key 'colours'" in err and "params" in err
    assert report_main([str(tmp_path / "runs"), "--names", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert report_main([str(tmp_path / "runs"), "--label", "no separator"]) == 2
    assert "LABEL:NEW NAME" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "report.md").exists()  # refused before any work


def test_a_rename_that_would_merge_settings_is_not_applied(tmp_path):
    r = tmp_path / "runs"
    for k in (2, 4):
        write_run(r / f"p{k}", method="pool", params={"kernel_size": k})
    disp = names.load(None, {"pool k=2": "pool", "pool k=4": "pool"})
    _, settings, _ = _settings(r, names=disp)
    assert sorted(settings["label"]) == ["pool k=2", "pool k=4"]


# ---------------------------------------------------------------- throughput and timing noise


def _synthetic(folder, seed=0, recovery=None, p90=0.1):
    """A two-partition run: part0 100 steps at 0.1 s, part1 100 steps at 0.05 s, batch 128;
    its top-level step time is the largest phase's (as methods/synthetic/phases.py writes it)."""
    phases = {"part0": (100, 0.1, p90), "part1": (100, 0.05, 0.05)}
    if recovery:
        phases["recovery"] = recovery
    extra = {"steps": sum(s for s, _, _ in phases.values()), "step_time_s_p90": p90}
    for p, (steps, med, q90) in phases.items():
        extra.update({f"{p}.steps": steps, f"{p}.step_time_s_median": med,
                      f"{p}.step_time_s_p90": q90, f"{p}.throughput_samples_s": 128 / med})
    return write_run(folder, method="synthetic", seed=seed, throughput=1280.0, step_time=0.1,
                     extra=extra)


def test_multi_phase_throughput_is_end_to_end(tmp_path):
    r = tmp_path / "runs"
    write_run(r / "n", throughput=1280.0, step_time=0.1, extra={"steps": 100,
                                                                "step_time_s_p90": 0.11})
    _synthetic(r / "s")
    _synthetic(r / "rec", seed=1, recovery=(50, 0.1, 0.1))
    write_run(r / "n1", seed=1, throughput=1280.0, step_time=0.1)
    runs, settings, _ = _settings(r)
    by = runs.set_index(runs["run_dir"].str.rsplit("/", n=1).str[-1])
    # 100 steps of 128 samples through both partitions in 100 x 0.1 + 100 x 0.05 = 15 s
    assert by.loc["s", "throughput_e2e_samples_s"] == pytest.approx(12800 / 15)
    assert by.loc["s", "throughput_rel"] == pytest.approx((12800 / 15) / 1280)
    assert by.loc["s", "step_time_rel"] == pytest.approx(1.5)
    assert by.loc["s", "steps_e2e"] == pytest.approx(100) and by.loc["s", "n_phases"] == 2
    # a whole-model recovery phase adds its samples and its time: 19200 samples in 20 s
    assert by.loc["rec", "throughput_e2e_samples_s"] == pytest.approx(19200 / 20)
    # a single-phase run keeps its own figure
    assert by.loc["n", "throughput_e2e_samples_s"] == 1280.0 and by.loc["n", "n_phases"] == 1


@pytest.mark.slow
def test_noisy_timing_is_flagged_in_table_figure_and_report(tmp_path):
    r = tmp_path / "runs"
    write_run(r / "n", step_time=0.1, extra={"step_time_s_p90": 0.12})
    write_run(r / "p", method="pool", step_time=0.1, extra={"step_time_s_p90": 0.2})
    _synthetic(r / "s", p90=0.1)  # part1's p90/median is 1.0, part0's 1.0: quiet
    _synthetic(r / "s2", seed=1, p90=0.16)  # part0: 1.6, above the threshold
    runs, settings, _ = _settings(r)
    assert derive.NOISY_P90_OVER_MEDIAN == 1.5
    flags = dict(zip(runs["run_dir"].str[-2:], runs["timing_noisy"]))
    assert flags == {"/n": False, "/p": True, "/s": False, "s2": True}
    s = _by_label(settings)
    assert bool(s.loc["pool", "timing_noisy"]) and bool(s.loc["synthetic", "timing_noisy"])
    assert not bool(s.loc["none", "timing_noisy"])
    t = plots.throughput(settings, style.memory_metric(runs))
    (ax,) = t.fig.axes
    faces = {ln.get_label(): ln.get_markerfacecolor() for ln in ax.get_lines()
             if not ln.get_label().startswith("_")}
    assert faces["pool"] == "white" and faces["none"] != "white"
    assert any("noisy" in x for x in _notes(t.fig))
    plots.plt.close(t.fig)
    make_report([r], tmp_path / "out", formats=["png"])
    md = (tmp_path / "out" / "report.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| pool |"))
    assert "†" in row and "†" not in next(ln for ln in md.splitlines()
                                          if ln.startswith("| none |"))


# ---------------------------------------------------------------- breakdown


def test_breakdown_is_taken_at_the_activation_peak(tmp_path):
    r = tmp_path / "runs"
    at_act = {"params": 10 * MiB, "grads": 0.0, "optim": 10 * MiB, "act": 30 * MiB,
              "other": 1 * MiB}
    write_run(r / "n", peak=60 * MiB, act=30 * MiB, at_act_peak=at_act)
    write_run(r / "c", method="checkpoint", peak=60 * MiB, act=12 * MiB,
              at_act_peak={**at_act, "act": 12 * MiB})
    write_run(r / "x", method="prune", status="error", peak=float("nan"),
              at_peak={k: float("nan") for k in at_act},
              extra={"error": "RuntimeError: boom\nTraceback ..."})
    _, settings, _ = _settings(r)
    b = plots.breakdown(settings)
    (ax,) = b.fig.axes
    assert "activation peak" in ax.get_xlabel()
    act = b.data[b.data["kind"] == "act"].set_index("label")["width"]
    assert act["none"] == pytest.approx(30) and act["checkpoint"] == pytest.approx(12)
    assert "prune" not in set(b.data["label"])  # nothing measured...
    assert any("not measured (error 1/1)" in t.get_text() for t in ax.texts)  # ...and said so
    assert "prune" in [t.get_text() for t in ax.get_yticklabels()]
    plots.plt.close(b.fig)
    # summaries without the activation-peak breakdown: the total peak's, and the axis says so
    old = settings.drop(columns=[c for c in settings if c.startswith("mem_at_act_peak")])
    b = plots.breakdown(old)
    assert "peak of the step" in b.fig.axes[0].get_xlabel()
    plots.plt.close(b.fig)


def test_trainer_records_the_breakdown_at_the_activation_peak(tmp_path):
    from memtrain import api

    row = api.run(["model=mlp6", "trainer=smoke", "dataset.image_size=8",
                   "trainer.device=cpu"], out_dir=tmp_path / "run")
    at = {k: row[f"mem_at_act_peak_{k}_bytes"] for k in ("params", "grads", "optim", "act",
                                                          "other")}
    assert at["act"] == row["mem_peak_act_bytes"] > 0  # the moment of the activation peak
    assert at["params"] == row["mem_params_bytes"]
    assert at["optim"] == row["mem_optim_bytes"]  # SGD momentum exists after the warm-up
    assert at["grads"] == 0  # zero_grad(set_to_none) before the forward of the step
    assert sum(at.values()) <= row["mem_tracker_peak_bytes"]
    # the batch (8 x 1 x 8 x 8 fp32) is in other
    assert at["other"] >= 8 * 8 * 8 * 4


# ---------------------------------------------------------------- budget


def _ckpt(folder, b, act, plan, seed=0, status="ok", overhead=0.2):
    return write_run(folder, method="checkpoint", seed=seed, status=status, act=act * MiB,
                     step_time=(1 + overhead) * 128 / 1000,
                     params={"strategy": "budget", "budget_fraction": b},
                     extra={"plan_peak_bytes": plan * 100, "plan_baseline_peak_bytes": 100,
                            "plan_overhead": overhead - 0.05})


def test_budget_figure_shows_target_planned_and_measured(tmp_path):
    r = tmp_path / "runs"
    write_run(r / "n", act=50 * MiB)
    _ckpt(r / "a", 0.5, 26.0, 0.48)
    _ckpt(r / "b", 0.8, 41.0, 0.79, overhead=0.1)
    _ckpt(r / "c", 0.3, 20.0, 0.3, status="error")
    runs, settings, _ = _settings(r)
    bud = plots.budget(settings, style.memory_metric(runs))
    target = next(a for a in bud.fig.axes if a.get_title() == f"{PANEL}: budget")
    data = bud.data[bud.data["kind"] == "target"].set_index("x")
    assert data.loc[0.5, "y"] == pytest.approx(26 / 50)  # measured / none's activation peak
    assert data.loc[0.5, "planned"] == pytest.approx(0.48)
    assert 0.3 not in data.index  # failed: listed, not drawn
    diag = [ln for ln in target.get_lines() if ln.get_linestyle() == "--"]
    assert diag and np.allclose(diag[0].get_xdata(), diag[0].get_ydata())  # y = x: the target
    hollow = [ln for ln in target.get_lines() if ln.get_markerfacecolor() == "white"]
    assert sorted(ln.get_ydata()[0] for ln in hollow) == pytest.approx([0.48, 0.79])
    assert "failed: checkpoint b=0.3 (error 1/1)" in _notes(bud.fig)
    plots.plt.close(bud.fig)
    # every budget run failed: no budget figure (the failures figure shows them)
    for d in ("a", "b"):
        f = r / d / "summary.json"
        f.write_text(f.read_text().replace('"status": "ok"', '"status": "error"'))
    runs, settings, _ = _settings(r)
    assert plots.budget(settings, style.memory_metric(runs)) is None


# ---------------------------------------------------------------- curves


def _metrics(folder, rows):
    lines = ["step,epoch,split,name,value"] + [f"{s},{e},test,acc,{v}" for s, e, v in rows]
    (folder / "metrics.csv").write_text("\n".join(lines) + "\n")


def test_composed_evaluation_is_placed_at_the_end_never_at_epoch_minus_one(tmp_path):
    r = tmp_path / "runs"
    for seed in (0, 1):
        _metrics(write_run(r / f"n{seed}", seed=seed, extra={"epochs_done": 3}),
                 [(10, 0, 0.5), (20, 1, 0.6), (30, 2, 0.7)])
        _metrics(_synthetic(r / f"s{seed}", seed=seed) , [(200, -1, 0.4 + seed / 100)])
        f = r / f"s{seed}" / "summary.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), "epochs_done": 3}))
    runs, settings, _ = _settings(r)
    c = plots.curves(settings, tables.load_metrics(runs["run_dir"]))
    syn = c.data[c.data["label"] == "synthetic"]
    assert list(syn["x"]) == [3] and syn["y"].iloc[0] == pytest.approx(40.5)
    assert (c.data["x"] > 0).all() and set(c.data["axis"]) == {"epoch"}
    assert "synthetic: evaluated after all phases" in _notes(c.fig)
    plots.plt.close(c.fig)


def test_curves_use_steps_when_evaluated_within_epochs(tmp_path):
    r = tmp_path / "runs"
    for seed in (0, 1):
        _metrics(write_run(r / f"n{seed}", seed=seed),
                 [(5, 0, 0.3), (10, 0, 0.4), (15, 1, 0.5), (20, 1, 0.6 + seed / 100)])
        _metrics(_synthetic(r / f"s{seed}", seed=seed), [(200, -1, 0.4)])
    runs, settings, _ = _settings(r)
    c = plots.curves(settings, tables.load_metrics(runs["run_dir"]))
    assert c.fig.axes[0].get_xlabel() == "step"
    none = c.data[c.data["label"] == "none"]
    assert list(none["x"]) == [5, 10, 15, 20] and none["y"].iloc[-1] == pytest.approx(60.5)
    # synthetic's composed model at its end-to-end step count (100), not at 200 phase steps
    assert list(c.data.loc[c.data["label"] == "synthetic", "x"]) == [100]
    plots.plt.close(c.fig)


# ---------------------------------------------------------------- failures and report.md


def _contrast(color: str) -> float:
    """WCAG contrast ratio of black text on `color`."""
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
           for c in mcolors.to_rgb(color)]
    return (0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2] + 0.05) / 0.05


def test_failures_figure_is_legible_and_gives_the_reason(tmp_path):
    assert min(_contrast(c) for c in style.STATUS_COLORS.values()) >= 7  # WCAG AAA
    r = tmp_path / "runs"
    write_run(r / "n")
    write_run(r / "p", method="pool", status="error",
              extra={"error": "ValueError: method.kernel_size=0 must be >= 1\n  File ..."})
    write_run(r / "q", method="prune", status="oom",
              extra={"error": "CUDA out of memory. Tried to allocate 2.00 GiB"})
    _, settings, _ = _settings(r)
    f = plots.failures(settings)
    texts = [t.get_text() for t in f.fig.texts]
    assert any("[1] ValueError: method.kernel_size=0 must be >= 1" in t for t in texts)
    assert not any("File ..." in t for t in texts)  # the first line only
    cells = {t.get_text() for t in f.fig.axes[0].texts}
    assert {"error 1/1 [1]", "oom 1/1 [2]", "ok 1/1"} <= cells
    assert all(t.get_color() == "black" for t in f.fig.axes[0].texts)
    plots.plt.close(f.fig)


@pytest.mark.slow
def test_report_md_precision_units_and_reasons(tmp_path):
    r = tmp_path / "runs"
    write_run(r / "n0", seed=0, peak=3 * 2**30, throughput=1000.0, test_acc=0.9)
    write_run(r / "n1", seed=1, peak=3 * 2**30, throughput=1000.0, test_acc=0.9)
    write_run(r / "p0", method="pool", seed=0, peak=1.2 * 2**30, throughput=1150.0,
              test_acc=0.8812)
    write_run(r / "p1", method="pool", seed=1, peak=1.3 * 2**30, throughput=1230.0,
              test_acc=0.8901)
    write_run(r / "x", method="prune", status="error", peak=float("nan"), source=None,
              extra={"error": "RuntimeError: shapes do not match\nTraceback"})
    make_report([r], tmp_path / "out", formats=["png"])
    md = (tmp_path / "out" / "report.md").read_text()
    head = next(ln for ln in md.splitlines() if ln.startswith("| setting"))
    assert "peak GiB (CPU tracker)" in head  # the failed run without a source is not "mixed"
    pool = next(ln for ln in md.splitlines() if ln.startswith("| pool |")).split(" | ")
    assert pool[2] == "1.25 ± 0.07"  # GiB, two decimals for values below 10
    assert pool[3] == "0.42 ± 0.02"  # ratio, two decimals, the spread too
    assert "1190 ± 57" in pool and "88.6 ± 0.6" in pool and "-1.4 ± 0.6" in pool
    assert "- prune (error 1/1): RuntimeError: shapes do not match" in md
    assert "Traceback" not in md


@pytest.mark.slow
def test_slide_look_is_larger_than_paper(tmp_path):
    r = tmp_path / "runs"
    write_run(r / "n")
    write_run(r / "p", method="pool", peak=60 * MiB, act=20 * MiB)
    runs, settings, _ = _settings(r)
    mem = style.memory_metric(runs)
    sizes = {}
    for look in ("paper", "slide"):
        with style.using(look):
            p = plots.tradeoff(settings, mem)
        sizes[look] = (p.fig.get_size_inches()[0], p.fig.axes[0].title.get_fontsize())
        plots.plt.close(p.fig)
    assert sizes["paper"] == (style.PAPER.panel_w, 7)
    assert sizes["slide"] == (style.SLIDE.panel_w, 15)
    assert report_main([str(r), "--style", "slide", "--format", "png"]) == 0
    with pytest.raises(ValueError, match="paper, slide"):
        make_report([r], style="poster")


@pytest.mark.slow
def test_callback_passes_style_and_names(tmp_path):
    from omegaconf import OmegaConf

    from memtrain.report.callback import ReportCallback

    r = tmp_path / "sweep"
    write_run(r / "0")
    write_run(r / "1", method="pool", params={"kernel_size": 2})
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(r)}}})
    names_cfg = OmegaConf.create({"labels": {"pool": "Pool"}, "models": {"resnet18": "RN"}})
    ReportCallback(style="slide", names=names_cfg, formats=["png"]).on_multirun_end(cfg)
    assert set(pd.read_csv(r / "settings.csv")["label"]) == {"none", "Pool"}
    assert "## RN / CIFAR-10" in (r / "report.md").read_text()


@pytest.mark.slow
def test_notes_sit_under_the_panels_and_legend_hiding_no_data(tmp_path):
    r = tmp_path / "runs"
    for model in ("resnet18", "resmlp12"):
        write_run(r / f"n{model}", model=model)
        write_run(r / f"p{model}", model=model, method="pool", status="oom", test_acc=None)
    runs, settings, _ = _settings(r)
    p = plots.tradeoff(settings, style.memory_metric(runs))
    renderer = p.fig.canvas.get_renderer()
    legend, notes = (leg.get_window_extent(renderer) for leg in p.fig.legends)
    lowest_axes = min(ax.get_tightbbox(renderer).y0 for ax in p.fig.axes)
    assert notes.y1 <= legend.y0 + 1 and legend.y1 <= lowest_axes + 1  # pixels
    assert all(ax.get_legend() is None for ax in p.fig.axes)
    texts = _notes(p.fig)  # two panels: each note names its panel
    assert f"{PANEL}: failed: pool (oom 1/1)" in texts
    plots.plt.close(p.fig)
