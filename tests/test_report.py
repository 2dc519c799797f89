"""memtrain-report on run folders fabricated with known numbers (tests/report_fixtures.py),
plus one real 2x2 multirun whose Hydra callback writes the report into the sweep folder."""

import json
import logging
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from conftest import job_dir, run_memtrain
from report_fixtures import MiB, fabricate_study, write_run

from memtrain.report import plots, style, tables
from memtrain.report.build import analyse, make_report
from memtrain.report.command import main as report_main
from memtrain.report.names import DEFAULT as NAMES

FIGURES = ("cost", "tradeoff", "breakdown", "throughput", "curves", "budget", "failures")
RESNET, RESMLP = NAMES.panel("resnet18", "cifar10"), NAMES.panel("resmlp12", "cifar10")


def _panel(fig, title):
    return next(ax for ax in fig.axes if ax.get_title() == title)


@pytest.fixture
def small(tmp_path):
    """Two seeds of none and pool (fp32), a bf16 pair, and a pool run with no baseline."""
    r = tmp_path / "runs"
    write_run(r / "a", seed=0, peak=100 * MiB, act=50 * MiB, throughput=1000, test_acc=0.90)
    write_run(r / "b", seed=1, peak=100 * MiB, act=50 * MiB, throughput=1100, test_acc=0.92)
    pool = {"kernel_size": 2}
    write_run(r / "c", method="pool", params=pool, seed=0, peak=60 * MiB, act=20 * MiB,
              throughput=800, test_acc=0.88)
    write_run(r / "d", method="pool", params=pool, seed=1, peak=50 * MiB, act=25 * MiB,
              throughput=990, test_acc=0.89)
    write_run(r / "e", precision="bf16", peak=70 * MiB, act=30 * MiB, throughput=2000)
    write_run(r / "f", method="pool", params=pool, precision="bf16", peak=35 * MiB,
              act=10 * MiB, throughput=1500, test_acc=0.85)
    write_run(r / "g", method="pool", params=pool, batch_size=256, peak=90 * MiB)
    return r


def _runs(folder, **kw):
    raw, skipped = tables.load_runs([folder])
    runs, settings, warnings = analyse(raw, **kw)
    return runs.set_index(runs["run_dir"].str.rsplit("/", n=1).str[-1]), settings, warnings


def test_relative_columns_and_baseline_matching(small, caplog):
    with caplog.at_level(logging.WARNING):
        runs, _, warnings = _runs(small)
    c, d, f = runs.loc["c"], runs.loc["d"], runs.loc["f"]
    assert c["mem_peak_rel"] == pytest.approx(0.6) and d["mem_peak_rel"] == pytest.approx(0.5)
    assert c["mem_act_rel"] == pytest.approx(0.4) and d["mem_act_rel"] == pytest.approx(0.5)
    assert c["throughput_rel"] == pytest.approx(0.8) and d["throughput_rel"] == pytest.approx(0.9)
    assert c["step_time_rel"] == pytest.approx(1.25)
    assert c["test_acc_delta"] == pytest.approx(-0.02)
    assert d["test_acc_delta"] == pytest.approx(-0.03)
    assert c["baseline_run_dir"].endswith("/a") and d["baseline_run_dir"].endswith("/b")
    # the bf16 run is compared with the bf16 baseline, not the fp32 one of the same seed
    assert f["baseline_run_dir"].endswith("/e") and f["mem_peak_rel"] == pytest.approx(0.5)
    assert runs.loc["a", "mem_peak_rel"] == 1.0 and runs.loc["a", "test_acc_delta"] == 0.0
    # batch 256 has no baseline: NaN and a warning, no crash
    g = runs.loc["g"]
    assert math.isnan(g["mem_peak_rel"]) and math.isnan(g["test_acc_delta"])
    assert len(warnings) == 1 and "no method=none baseline" in warnings[0] and "256" in warnings[0]
    assert "no method=none baseline" in caplog.text


def test_match_and_baseline_are_configurable(small):
    # without the seed in the match keys, both fp32 baselines match: their mean is used
    runs, _, warnings = _runs(small, match=["model", "dataset", "trainer.precision",
                                            "trainer.batch_size"])
    assert runs.loc["c", "throughput_rel"] == pytest.approx(800 / 1050)
    assert any("2 method=none runs match" in w for w in warnings)
    # pool as the baseline: the bf16 pool run is its own; none runs have no pool of equal seed...
    runs, _, _ = _runs(small, baseline="method=pool")
    assert runs.loc["a", "mem_peak_rel"] == pytest.approx(100 / 60)
    assert runs.loc["c", "mem_peak_rel"] == 1.0


def test_seeds_aggregate_to_mean_and_std(small):
    _, settings, _ = _runs(small)
    s = settings.set_index(["method", "trainer.precision", "trainer.batch_size"])
    pool = s.loc[("pool", "fp32", 128)]
    assert pool["n_runs"] == 2 and pool["seeds"] == "0,1" and pool["status"] == "ok"
    assert pool["mem_peak_rel"] == pytest.approx(0.55)
    assert pool["mem_peak_rel_std"] == pytest.approx(np.std([0.6, 0.5], ddof=1))
    assert pool["test_acc"] == pytest.approx(0.885)
    assert pool["test_acc_std"] == pytest.approx(np.std([0.88, 0.89], ddof=1))
    one = s.loc[("pool", "fp32", 256)]
    assert one["n_runs"] == 1 and math.isnan(one["mem_peak_alloc_bytes_std"])


def test_failed_runs_are_counted_not_averaged(tmp_path):
    r = tmp_path / "r"
    write_run(r / "a", seed=0, test_acc=0.9)
    write_run(r / "b", seed=1, test_acc=0.8)
    write_run(r / "c", seed=2, test_acc=None, status="diverged")
    _, settings, _ = _runs(r)
    (row,) = settings.to_dict("records")
    assert row["n_runs"] == 3 and row["n_ok"] == 2
    assert row["status"] == "ok 2/3, diverged 1/3" and row["worst_status"] == "diverged"
    assert row["test_acc"] == pytest.approx(0.85)


def test_labels_name_what_varies(tmp_path):
    r = tmp_path / "r"
    for k in (2, 4):
        write_run(r / f"p{k}", method="pool", params={"kernel_size": k, "mode": "upsample"})
    write_run(r / "n1", extra={"optim.lr": 0.1})
    write_run(r / "n2", extra={"optim.lr": 0.2})
    _, settings, _ = _runs(r)
    assert set(settings["label"]) == {"pool k=2", "pool k=4", "none lr=0.1", "none lr=0.2"}
    assert tables.constant_params(settings) == {"pool": {"method.mode": "upsample"}}


def test_every_method_has_a_place_a_colour_and_a_label(tmp_path, monkeypatch):
    """Order and colours come from conf/report/methods.yaml and the conf/method listing, never
    from a list in the code: a new method (its conf/method YAML alone) is placed after the
    listed ones, a stack after its members, in a colour of its own, labelled by its name."""
    import shutil

    from conftest import conf_options

    from memtrain import paths
    from memtrain.report import names

    order = names.method_order()
    assert order[0] == "none" and set(conf_options("method")) <= set(order)
    assert order.index("checkpoint+quantize") > order.index("quantize")
    conf = tmp_path / "conf"
    shutil.copytree(paths.conf_dir(), conf)
    for new in ("zeta", "pool+zeta"):
        (conf / "method" / f"{new}.yaml").write_text("_target_: elsewhere.Zeta\n")
    monkeypatch.setattr(paths, "conf_dir", lambda: conf)
    names.conf_methods.cache_clear()
    try:
        order = names.method_order()
        colours = [style.method_color(m) for m in order]
    finally:
        monkeypatch.undo()
        names.conf_methods.cache_clear()
    assert order[-2:] == ["zeta", "pool+zeta"] and order[:-2] == names.method_order()
    assert len(set(colours)) == len(colours)  # a spare colour no listed method uses
    r = tmp_path / "r"
    write_run(r / "n")
    write_run(r / "z", method="zeta", peak=80 * MiB)
    write_run(r / "q", method="quantize", params={"bits": 4}, peak=60 * MiB)
    _, settings, _ = _runs(r)
    assert list(style.order_settings(settings)["label"]) == ["none", "quantize", "zeta"]
    assert style.setting_styles(settings)["zeta"]["color"] not in names.METHODS.values()


def test_pareto_front():
    x = pd.Series([1.0, 0.5, 0.3, 0.6, 0.2])
    y = pd.Series([90, 89, 85, 88, 80])
    assert plots.pareto_front(x, y) == [4, 2, 1, 0]


def _series(ax, label):
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
    return line.get_xdata()[0], line.get_ydata()[0]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = fabricate_study(tmp_path_factory.mktemp("study") / "s", seeds=(0, 1), epochs=3,
                           source="tracker")
    raw, _ = tables.load_runs([root])
    runs, settings, _ = analyse(raw)
    return root, runs, settings


@pytest.mark.slow
def test_figures_plot_the_table(study):
    root, runs, settings = study
    mem = style.memory_metric(runs)  # the headline ratio, on the CPU as on CUDA
    assert (mem.col, mem.rel) == ("mem_peak_alloc_bytes", "mem_peak_rel")
    assert mem.axis("none") == "peak / none (mem_peak_alloc_bytes)"  # one line, the column
    by = settings.assign(panel=[NAMES.panel(m, "cifar10") for m in settings["model"]]
                         ).set_index(["panel", "label"])
    p = plots.tradeoff(settings, mem)
    assert {ax.get_title() for ax in p.fig.axes} == {RESNET, RESMLP}  # model and dataset
    for ax in p.fig.axes:
        for ln in ax.get_lines():
            if ln.get_label().startswith("_") or ln.get_label() == "Pareto front":
                continue
            row = by.loc[(ax.get_title(), ln.get_label())]
            x, y = _series(ax, ln.get_label())
            assert x == pytest.approx(row["mem_peak_rel"])
            assert y == pytest.approx(row["test_acc"] * 100)
    # the diverged setting is not a point: it is listed in the panel
    resmlp = _panel(p.fig, RESMLP)
    assert "prune s=0.9" not in [ln.get_label() for ln in resmlp.get_lines()]
    notes = [t.get_text() for leg in p.fig.legends for t in leg.get_texts()]
    assert f"{RESMLP}: failed: prune s=0.9 (diverged 2/2)" in notes  # listed under the panels
    assert len(p.data) == (settings["n_ok"] > 0).sum()

    t = plots.throughput(settings, mem)
    ax = _panel(t.fig, RESNET)
    x, y = _series(ax, "pool k=2")
    row = by.loc[(RESNET, "pool k=2")]
    assert y == pytest.approx(row["throughput_samples_s"])
    assert x == pytest.approx(row[mem.col] / MiB)

    b = plots.breakdown(settings)
    ax = _panel(b.fig, RESNET)
    widths = sum(patch.get_width() for patch in ax.patches)
    peaks = settings.loc[settings["model"] == "resnet18", "mem_peak_alloc_bytes"].sum() / MiB
    assert widths == pytest.approx(peaks)  # the stacked parts add up to each peak

    bud = plots.budget(settings, mem)
    ax = _panel(bud.fig, RESNET + ": memory against overhead")
    (curve,) = [ln for ln in ax.get_lines() if ln.get_label() == "_budget"]
    ck = by.loc[RESNET].loc[lambda d: d["method"] == "checkpoint"].sort_values(
        "method.budget_fraction")
    np.testing.assert_allclose(curve.get_xdata(), (ck["step_time_rel"] - 1) * 100)
    np.testing.assert_allclose(curve.get_ydata(), ck["mem_peak_rel"])
    for made in (p, t, b, bud):
        plots.plt.close(made.fig)


def test_learning_curves_average_seeds(study):
    root, runs, settings = study
    c = plots.curves(settings, tables.load_metrics(runs["run_dir"]))
    ax = _panel(c.fig, RESNET)
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == "none"]
    none = runs[(runs["model"] == "resnet18") & (runs["method"] == "none")]
    m = tables.load_metrics(none["run_dir"]).query("split == 'test' and name == 'acc'")
    expect = m.groupby("epoch")["value"].mean() * 100
    np.testing.assert_allclose(line.get_xdata(), expect.index + 1)
    np.testing.assert_allclose(line.get_ydata(), expect.to_numpy())
    plots.plt.close(c.fig)


@pytest.mark.slow
def test_report_writes_every_figure_and_marks_failures(study, tmp_path):
    root, _, settings = study
    rep = make_report([root], tmp_path / "out")
    assert set(rep.figures) == set(FIGURES) and not rep.not_drawn
    for name in FIGURES:
        for ext in ("png", "pdf"):
            assert (tmp_path / "out" / "figures" / f"{name}.{ext}").stat().st_size > 1000
        drawn = pd.read_csv(tmp_path / "out" / "figures" / f"{name}.csv")
        assert len(drawn) > 0
    fail = pd.read_csv(tmp_path / "out" / "figures" / "failures.csv").set_index(["panel", "label"])
    assert fail.loc[(RESMLP, "prune s=0.9"), "status"] == "diverged 2/2"
    assert fail.loc[(RESNET, "pool k=4"), "text"] == "ok 2/2"
    assert len(fail) == len(settings)  # every setting is on the map, failed or not
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"## {RESNET}" in md and "diverged 2/2" in md
    assert "pool: mode=upsample" in md and "checkpoint: strategy=budget" in md
    csv = pd.read_csv(tmp_path / "out" / "summary.csv")
    pq = pd.read_parquet(tmp_path / "out" / "summary.parquet")
    assert len(csv) == len(pq) == 2 * 8 * 2 and "mem_peak_rel" in pq


@pytest.mark.slow
def test_corrupt_and_missing_summaries_are_skipped(small, capsys):
    (small / "bad").mkdir()
    (small / "bad" / "summary.json").write_text("{not json")
    (small / "unfinished" / ".hydra").mkdir(parents=True)
    assert report_main([str(small), "--format", "png"]) == 0
    err = capsys.readouterr().err
    assert "skipped" in err and "bad" in err and "unfinished" in err
    md = (small / "report.md").read_text()
    assert "## Skipped folders" in md and "no summary.json" in md
    assert len(pd.read_csv(small / "summary.csv")) == 7
    assert not list((small / "figures").glob("*.pdf"))  # --format png only


def test_figures_draws_only_the_figures_named(small, tmp_path, capsys):
    """--figures NAME[,NAME]: those figures alone (report.md shows them), the others neither
    drawn nor said to be missing; a name of no figure is one line, exit 2, before any file."""
    assert report_main([str(small), "--figures", "tradeoff,nosuch", "--out",
                        str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no figure named nosuch" in err and "budget" in err
    assert not (tmp_path / "bad").exists()
    assert report_main([str(small), "--format", "png", "--figures", "tradeoff,breakdown",
                        "--out", str(tmp_path / "two")]) == 0
    assert sorted(p.name for p in (tmp_path / "two" / "figures").glob("*.png")) == \
        ["breakdown.png", "tradeoff.png"]
    md = (tmp_path / "two" / "report.md").read_text()
    assert "figures/tradeoff.png" in md and "figures/cost.png" not in md
    assert "cost: not drawn" not in md


def test_cli_errors_and_mixed_types(tmp_path, capsys):
    assert report_main([str(tmp_path / "nope")]) == 2
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2  # no input, as a missing folder
    r = tmp_path / "r"
    write_run(r / "a", method="checkpoint", params={"segments": 2})
    write_run(r / "b", method="checkpoint", params={"segments": "auto"})
    assert report_main([str(r), "--baseline", "bogus"]) == 2  # bad input: one line, exit 2
    assert "--baseline must look like" in capsys.readouterr().err
    assert report_main([str(r), "--no-figures"]) == 0  # no none run at all: NaN, not a crash
    assert set(pd.read_parquet(r / "summary.parquet")["method.segments"]) == {"2", "auto"}
    assert not (r / "figures").exists()


@pytest.mark.slow
def test_report_never_imports_torch():
    code = ("import sys, memtrain.report.tables, memtrain.report.plots, memtrain.report.command, "
            "memtrain.report.build, memtrain.report.markdown, memtrain.report.style, "
            "memtrain.report.callback; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_callback_logs_instead_of_raising(tmp_path, caplog):
    from omegaconf import OmegaConf

    from memtrain.report.callback import ReportCallback

    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "missing")}}})
    with caplog.at_level(logging.WARNING):
        ReportCallback().on_multirun_end(cfg)
    assert "report of the sweep failed" in caplog.text


@pytest.mark.slow
def test_multirun_leaves_report_in_sweep_folder(in_tmp):
    p = run_memtrain("-m", "trainer=smoke", "model=mlp6", "dataset.image_size=8",
                     "trainer.seed=0,1", "optim.lr=0.01,0.02", cwd=in_tmp, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    (sweep,) = [d for d in in_tmp.glob("runs/multirun/*/*") if d.is_dir()]
    summary = pd.read_csv(sweep / "summary.csv")
    assert len(summary) == 4 and set(summary["status"]) == {"ok"}
    assert (summary["mem_peak_rel"] == 1.0).all()  # every run is a none run: its own baseline
    settings = pd.read_csv(sweep / "settings.csv")
    assert sorted(settings["label"]) == ["none lr=0.01", "none lr=0.02"]
    assert (settings["n_runs"] == 2).all()
    md = (sweep / "report.md").read_text()
    assert "none lr=0.02" in md and "CPU" in md
    for name in ("tradeoff", "breakdown", "throughput"):
        assert (sweep / "figures" / f"{name}.png").stat().st_size > 1000
        assert (sweep / "figures" / f"{name}.pdf").stat().st_size > 1000
    drawn = pd.read_csv(sweep / "figures" / "tradeoff.csv")
    assert sorted(drawn["y"]) == pytest.approx(sorted(settings["test_acc"] * 100))
    assert json.loads((job_dir(sweep, 0) / "summary.json").read_text())["status"] == "ok"
    # PDF font subsetting stays quiet (fontTools logs every glyph table at INFO)
    assert " pruned" not in p.stdout + p.stderr


@pytest.mark.slow
def test_budget_figure_draws_one_series_per_strategy(study):
    _, _, settings = study
    ck = settings["method"] == "checkpoint"
    comp = settings[ck].assign(**{"method.strategy": "compile", "label": lambda d: d["label"]
                                  + " compile", "step_time_rel": lambda d: d["step_time_rel"] + 1})
    strategy = pd.Series("budget", index=settings.index).where(ck)
    agg = pd.concat([settings.assign(**{"method.strategy": strategy}), comp], ignore_index=True)
    bud = plots.budget(agg, style.memory_metric(agg))
    ax = _panel(bud.fig, RESNET + ": memory against overhead")
    lines = {ln.get_label(): ln for ln in ax.get_lines() if ln.get_label() in ("_budget",
                                                                               "_compile")}
    assert set(lines) == {"_budget", "_compile"}  # never one curve through both
    for name, rows in (("_budget", settings[ck]), ("_compile", comp)):
        r = rows[rows["model"] == "resnet18"].sort_values("method.budget_fraction")
        np.testing.assert_allclose(lines[name].get_xdata(), (r["step_time_rel"] - 1) * 100)
    assert any(t.get_text().startswith("amb=") for t in ax.texts)
    plots.plt.close(bud.fig)
    # granularity: op and block plans are two series, never one curve
    blk = settings[ck].assign(**{"method.strategy": "budget", "method.granularity": "block",
                                 "label": lambda d: d["label"] + " block"})
    agg2 = pd.concat([settings.assign(**{"method.strategy": strategy,
                                         "method.granularity": pd.Series("op", index=settings.index)
                                         .where(ck)}), blk], ignore_index=True)
    bud = plots.budget(agg2, style.memory_metric(agg2))
    ax = _panel(bud.fig, RESNET + ": memory against overhead")
    styles = {ln.get_label(): ln.get_linestyle() for ln in ax.get_lines()}
    assert styles.get("_budget") == "-" and styles.get("_budget block") == "--"
    plots.plt.close(bud.fig)


@pytest.mark.slow
def test_an_estimate_only_sweep_has_its_table_and_figure(tmp_path):
    """`trainer.estimate=true trainer.max_steps=0` rows hold predictions only: the report gives
    them their own table (predicted peak, activation peak and saved bytes against none's
    prediction, whether it fits the GPU memory asked for) and figure, exit 0."""
    import json

    r = tmp_path / "r"
    measured = ("mem_peak_alloc_bytes", "mem_peak_act_bytes", "mem_act_saved_bytes",
                "mem_peak_act_temp_bytes",
                "throughput_samples_s", "step_time_s_median", "test_acc", "test_acc5",
                "train_loss", "mem_peak_source")
    for name, method, peak, act, saved in (("n", "none", 400, 200, 150),
                                           ("q", "quantize", 220, 60, 22.5),
                                           ("c", "checkpoint", 280, 100, 75)):
        f = write_run(r / name, method=method,
                      params={"budget_fraction": 0.5} if method == "checkpoint" else None,
                      extra={"mem_estimate_bytes": peak * MiB, "mem_estimate_act_bytes": act * MiB,
                             "mem_estimate_saved_bytes": saved * MiB,
                             "trainer.gpu_memory_gb": 0.25, "trainer.estimate": True,
                             "trainer.max_steps": 0}) / "summary.json"
        row = json.loads(f.read_text())
        for k in measured:
            row.pop(k, None)
        row["test_acc"] = None
        f.write_text(json.dumps(row))
    assert report_main([str(r)]) == 0
    md = (r / "report.md").read_text()
    assert "| setting | predicted peak MiB | / none | predicted act. peak / none | " \
        "predicted saved act. / none | fits 0.25 GiB |" in md
    assert "| quantize | 220 | 0.55 | 0.30 | 0.15 | yes |" in md
    assert "| none | 400 | 1.00 | 1.00 | 1.00 | no |" in md
    drawn = pd.read_csv(r / "figures" / "estimates.csv").set_index("label")
    assert drawn.loc["checkpoint", "predicted_peak_bytes"] == 280 * MiB
    assert drawn.loc["quantize", "predicted_rel"] == pytest.approx(0.55)
    assert set(drawn["gpu_memory_bytes"]) == {0.25 * 2**30}
    # a bar over the cap is the one that does not fit (hatched); nothing measured: no budget
    assert drawn["fits"].to_dict() == {"none": False, "quantize": True, "checkpoint": False}
    assert not (r / "figures" / "budget.png").exists()
    assert "budget: not drawn (no measured method=checkpoint run" in md


@pytest.mark.slow
def test_accuracy_stays_in_its_range_chance_is_drawn_and_not_learning_is_flagged(tmp_path):
    """Error bars stop at 0% and 100%; the chance level (1 / classes) is a line; a setting with
    a run that did not learn (run.learned) is hollow in the figure and said in the table."""
    r = tmp_path / "r"
    for seed, acc in enumerate((0.02, 0.40)):  # mean 0.21, std 0.27: the bar would reach -6%
        write_run(r / f"p{seed}", method="pool", seed=seed, test_acc=acc, peak=60 * MiB,
                  extra={"chance_acc": 0.1, "learned": acc > 0.2, "test_samples": 2000})
        write_run(r / f"n{seed}", seed=seed, test_acc=0.9, extra={"chance_acc": 0.1,
                                                                   "learned": True})
    assert report_main([str(r)]) == 0
    drawn = pd.read_csv(r / "figures" / "tradeoff.csv").set_index("label")
    pool = drawn.loc["pool"]
    assert pool["y"] == pytest.approx(21.0) and pool["yerr"] > 21.0
    assert pool["yerr_low"] == pytest.approx(21.0) and pool["yerr_high"] == pool["yerr"]
    assert bool(pool["did_not_learn"]) and not bool(drawn.loc["none", "did_not_learn"])
    assert list(drawn["chance"]) == pytest.approx([10.0, 10.0])
    assert "| ok, did not learn 1/2 |" in (r / "report.md").read_text()


def test_a_run_that_did_not_learn_says_why():
    from memtrain.run.learned import classifier

    ok = classifier(0.9, 0.3, 10, 2000)
    assert ok["learned"] is True and ok["chance_acc"] == 0.1 and "not_learned_why" not in ok
    # 2 sigma over 2000 samples at p = 0.1: 0.0134
    near = classifier(0.11, 2.0, 10, 2000)
    assert near["learned"] is False and "not above chance 0.1000 by 2 sigma (0.0134 over 2000" \
        in near["not_learned_why"]
    assert classifier(0.12, 2.0, 10, 2000)["learned"] is True
    diverged = classifier(0.5, 18.3, 10, 2000)  # trainer=smoke's loss of 18-28
    assert diverged["learned"] is False and "train loss 18.3 is not below ln(10) = 2.303" in \
        diverged["not_learned_why"]
    assert "learned" not in classifier(float("nan"), 0.1, 10, 100)  # never evaluated


@pytest.mark.slow
def test_the_cost_figure_comes_first_and_answers_the_question(tmp_path):
    """Memory relative to none on x; accuracy change (points) and step-time overhead (%) on two
    aligned rows; seeds as error bars, an overhead's stopped at -100% (no step takes less than
    no time); the first figure of report.md."""
    r = tmp_path / "r"
    for seed, (tput, acc) in enumerate(((1000.0, 0.9), (1000.0, 0.9))):
        write_run(r / f"n{seed}", seed=seed, throughput=tput, test_acc=acc)
    for seed, (tput, acc) in enumerate(((4000.0, 0.86), (500.0, 0.82))):  # -75% and +100%
        write_run(r / f"p{seed}", method="pool", seed=seed, throughput=tput, test_acc=acc,
                  peak=60 * MiB, act=25 * MiB)
    assert report_main([str(r)]) == 0
    md = (r / "report.md").read_text()
    assert md.index("![cost]") < md.index("![tradeoff]")
    drawn = pd.read_csv(r / "figures" / "cost.csv")
    acc = drawn[drawn["row"] == "accuracy"].set_index("label")
    over = drawn[drawn["row"] == "overhead"].set_index("label")
    # x: the headline memory ratio, the step's total peak over none's (60 / 100 MiB)
    assert acc.loc["pool", "x"] == pytest.approx(0.6) and over.loc["pool", "x"] == \
        pytest.approx(0.6)
    assert "`peak / none`: `mem_peak_alloc_bytes` over none's" in md  # its caption
    assert acc.loc["pool", "y"] == pytest.approx(-6.0)  # (0.86 + 0.82) / 2 - 0.9, in points
    assert over.loc["pool", "y"] == pytest.approx(12.5)  # step times 0.25x and 2x: mean 1.125
    assert over.loc["pool", "yerr"] > 100  # the seeds' std, wider than the room below
    assert over.loc["pool", "y"] - over.loc["pool", "yerr_low"] == pytest.approx(-100.0)
    assert acc.loc["none", "y"] == 0 and over.loc["none", "y"] == 0


HOSTILE = ("<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "[x](javascript:a())")


def test_run_fields_are_text_in_report_md_as_in_report_html(tmp_path):
    """A method's name, a model's, an error and a warning from a run's row are shown as written
    in report.md (entities, no link), never read as HTML: the same text report.html shows."""
    r = tmp_path / "runs"
    write_run(r / "a", model=HOSTILE[1])
    write_run(r / "b", method=HOSTILE[0], model=HOSTILE[1], status="error",
              extra={"error": f"RuntimeError: {HOSTILE[2]} {HOSTILE[0]}"})
    assert report_main([str(r), "--no-figures"]) == 0
    md = (r / "report.md").read_text()
    for tag in ("<script", "<img", "](javascript"):
        assert tag not in md
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in md and "&lt;img src=x" in md
    page = (r / "report.html").read_text()
    assert "<script" not in page and "<img" not in page and 'href="javascript' not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "[x](javascript:a())" in page


def test_a_row_of_impossible_types_is_skipped_naming_its_column(tmp_path, capsys):
    """`{"status": "ok", "method": null, "model": 5}` is no run: the row is skipped with one
    line naming the column and what goes there (memtrain/columns.py); the others report."""
    r = tmp_path / "runs"
    write_run(r / "good")
    bad = [({"method": None, "model": 5}, "column 'method' holds None, null where text goes"),
           ({"model": 5}, "column 'model' holds 5, a number where text goes"),
           ({"status": "done"}, "column 'status' holds 'done', no status"),
           ({"learned": "yes"}, "column 'learned' holds 'yes', text where true or false goes"),
           ({"mem_peak_alloc_bytes": True}, "holds True, a boolean where a number goes")]
    for i, (foreign, _) in enumerate(bad):
        write_run(r / f"bad{i}", seed=i + 1, foreign=foreign)
    assert report_main([str(r), "--no-figures"]) == 0
    err = capsys.readouterr().err
    for i, (_, why) in enumerate(bad):
        (line,) = [ln for ln in err.splitlines() if f"bad{i}/summary.json" in ln]
        assert why in line
    assert list(pd.read_csv(r / "summary.csv")["run_dir"].str.rsplit("/", n=1).str[-1]) == ["good"]


def test_terminal_table_baseline_first_one_format_per_column_ratios_defined(tmp_path, capsys):
    """memtrain-report's screen table: none first (checkpoint sorts before it by name), each
    column in one number format, the headline ratio (`peak/none`) and the detail defined under
    it; a peak where no activation is alive says so (its act_at_peak_% is 0)."""
    r = tmp_path / "r"
    at_update = {"params": 40 * MiB, "grads": 40 * MiB, "optim": 20 * MiB, "act": 0.0,
                 "other": 0.0}  # the peak is the optimizer's update: no activation alive
    for seed in (0, 1):
        write_run(r / f"n{seed}", seed=seed, peak=100 * MiB, act=2 * MiB, at_peak=at_update,
                  throughput=2150.5, test_acc=0.91234)
        write_run(r / f"c{seed}", method="checkpoint", seed=seed, peak=100 * MiB, act=1 * MiB,
                  saved=0.54 * MiB, at_peak=at_update, throughput=31.25, test_acc=0.9,
                  params={"budget_fraction": 0.5})
    assert report_main([str(r), "--no-figures"]) == 0
    out = capsys.readouterr().out.splitlines()
    table = pd.read_fwf(pd.io.common.StringIO("\n".join(out[:5])), dtype=str)
    assert list(table["method"]) == ["none", "none", "checkpoint", "checkpoint"]
    assert list(table["peak/none"]) == ["1.00"] * 4  # the headline ratio, two decimals
    assert list(table["saved/none"]) == ["1.00", "1.00", "0.27", "0.27"]
    assert list(table["act_at_peak_%"]) == ["0.0"] * 4
    assert list(table["samples_s"]) == ["2150", "2150", "31", "31"]  # one format: whole
    assert list(table["test_acc_%"]) == ["91.2", "91.2", "90.0", "90.0"]
    legend = "\n".join(out[5:])
    assert "peak/none: mem_peak_alloc_bytes over none's, the step's total peak" in legend
    assert "saved/none: mem_act_saved_bytes over none's" in legend
    assert "act_at_peak_%: the activations' share of the step's peak" in legend


def test_not_learning_is_read_back_from_a_summary_csv_and_the_figure_says_why(tmp_path):
    """Rows read from a committed summary.csv hold `learned` as 1.0/0.0 (a column with gaps):
    a setting whose runs did not learn is still flagged, and the cost figure names it with its
    accuracy, chance and each phase's accuracy on its own task (synthetic: a partition's on
    its labels)."""
    r = tmp_path / "r"
    for seed in (0, 1):
        write_run(r / f"n{seed}", seed=seed, test_acc=0.9, extra={"chance_acc": 0.1,
                                                                   "learned": True})
        write_run(r / f"s{seed}", method="synthetic", seed=seed, test_acc=0.1, peak=80 * MiB,
                  extra={"chance_acc": 0.1, "learned": False, "part0.test_acc": 0.2,
                         "part1.test_acc": 1.0, "part0.steps": 10, "part1.steps": 10,
                         "part0.step_time_s_median": 0.1, "part1.step_time_s_median": 0.3,
                         "part0.throughput_samples_s": 1280.0,
                         "part1.throughput_samples_s": 426.7})
    make_report([r], tmp_path / "out", figures=False)
    raw = tables.load_summary_csv(tmp_path / "out" / "summary.csv")
    assert set(raw["learned"].dropna()) == {0.0, 1.0}
    runs, settings, _ = analyse(raw)
    flagged = settings.set_index("label")["did_not_learn"]
    assert flagged.to_dict() == {"none": False, "synthetic": True}
    p = plots.cost(settings, style.memory_metric(runs))
    notes = [t.get_text() for leg in p.fig.legends for t in leg.get_texts()]
    assert "did not learn: synthetic (2/2 runs): test accuracy 10.0%, chance 10.0%; each " \
        "phase on its own task: part0 20%, part1 100%" in notes
    plots.plt.close(p.fig)
