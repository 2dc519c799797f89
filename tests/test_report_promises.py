"""Promises that hold for every report figure at once, on the made-up study of
tests/report_fixtures.py (two models, eight settings, three seeds, two kinds of failure) plus
a checkpoint budget that failed in both of its seeds: every panel title names model and
dataset, every failed setting is shown or listed in every figure it belongs to, and report.md
names where its peaks came from.
Test data only: none of these numbers were measured."""

import pytest
from report_fixtures import MiB, fabricate_study, write_run

from memtrain.report import draw, names, plots, style, tables
from memtrain.report.build import analyse, make_report

MODELS = {"resnet18": "ResNet-18", "resmlp12": "ResMLP-12"}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """(runs, settings, metrics) of the made-up study with a failed checkpoint budget added."""
    root = fabricate_study(tmp_path_factory.mktemp("study") / "runs")
    for seed in (0, 1):  # a budget setting that failed in every seed (resnet18 only)
        write_run(root / f"fail{seed}", method="checkpoint", seed=seed, status="error",
                  peak=float("nan"), act=float("nan"), test_acc=None,
                  params={"strategy": "budget", "budget_fraction": 0.1},
                  extra={"error": "RuntimeError: budget 0.1 is below the smallest plan"})
    raw, _ = tables.load_runs([root])
    runs, settings, _ = analyse(raw)
    return runs, settings, tables.load_metrics(runs["run_dir"])


@pytest.fixture(scope="module")
def figures(study):
    runs, settings, metrics = study
    made, why = plots.all_plots(settings, metrics, style.memory_metric(runs))
    assert not why, why  # every figure applies to this study
    yield {p.name: p for p in made}
    for p in made:
        plots.plt.close(p.fig)


def _texts(fig) -> list[str]:
    """Every piece of text a reader of the figure sees."""
    out = [t.get_text() for t in fig.texts]
    out += [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        out += [t.get_text() for t in (*ax.texts, *ax.get_xticklabels(), *ax.get_yticklabels())]
    return [t.replace("\n", ", ") for t in out if t]  # a cell's 'ok 2/3\noom 1/3' too


@pytest.mark.slow
def test_every_panel_title_names_model_and_dataset(figures):
    panels = {names.DEFAULT.panel(m, "cifar10") for m in MODELS}
    assert panels == {f"{n} / CIFAR-10" for n in MODELS.values()}
    for name, p in figures.items():
        if name == "failures":  # one grid: its columns are the panels
            (ax,) = p.fig.axes
            assert {t.get_text() for t in ax.get_xticklabels()} == panels
            continue
        titles = [ax.get_title() for ax in p.fig.axes if ax.get_visible()]
        assert titles, name
        for t in titles:  # 'ResNet-18 / CIFAR-10' or 'ResNet-18 / CIFAR-10: budget'
            assert any(t == panel or t.startswith(f"{panel}: ") for panel in panels), (name, t)
        assert {next(pl for pl in panels if t.startswith(pl)) for t in titles} == panels, name


def _failed(settings):
    return settings[settings["worst_status"] != "ok"]


def test_every_failed_setting_is_in_every_figure(study, figures):
    _, settings, _ = study
    failed = _failed(settings)
    # the three kinds: failed in every seed (two of them), and failed in one seed of three
    assert sorted(zip(failed["label"], failed["status"])) == [
        ("checkpoint b=0.1", "error 2/2"), ("pool k=4", "ok 2/3, oom 1/3"),
        ("prune s=0.9", "diverged 3/3")]
    for name, p in figures.items():
        texts = _texts(p.fig)
        for r in failed.itertuples():
            if name == "budget" and r.method != "checkpoint":
                continue  # the budget figure is about checkpoint's budgets only
            panel = names.DEFAULT.panel(r.model, r.dataset)
            # a note naming panel, setting and status, or a labelled cell, tick or bar
            shown = any(r.label in t and r.status in t for t in texts) or (
                r.label in texts and any(r.status in t for t in texts))
            assert shown, (name, panel, r.label, r.status)


def test_partly_failed_settings_are_drawn_and_marked_in_every_figure(study, figures):
    """pool k=4 lost one seed of three on resnet18: drawn from the ok seed, and every figure that
    draws it says that the point is the mean of the ok runs only."""
    for name in ("tradeoff", "throughput"):
        texts = _texts(figures[name].fig)
        assert any("mean of ok runs: pool k=4 (ok 2/3, oom 1/3)" in t for t in texts), name
        drawn = figures[name].data
        assert ((drawn["label"] == "pool k=4")
                & (drawn["panel"] == "ResNet-18 / CIFAR-10")).any(), name
    curves = _texts(figures["curves"].fig)
    assert any("includes failed runs: pool k=4 (ok 2/3, oom 1/3)" in t for t in curves)


def test_budget_figure_lists_the_failed_budget(figures):
    texts = _texts(figures["budget"].fig)
    assert any("ResNet-18 / CIFAR-10" in t and "failed: checkpoint b=0.1 (error 2/2)" in t
               for t in texts)
    target = figures["budget"].data
    assert not (target["label"] == "checkpoint b=0.1").any()  # listed, not drawn


def test_failure_figure_gives_every_failed_setting_its_reason(study, figures):
    cells = figures["failures"].data.set_index(["panel", "label"])
    assert cells.loc[("ResNet-18 / CIFAR-10", "checkpoint b=0.1"), "reason"] \
        == "RuntimeError: budget 0.1 is below the smallest plan"
    assert cells.loc[("ResMLP-12 / CIFAR-10", "prune s=0.9"), "worst_status"] == "diverged"
    assert any("[1] RuntimeError: budget 0.1" in t for t in _texts(figures["failures"].fig))


@pytest.mark.parametrize(("sources", "said"), [
    (("tracker", "tracker"), "CPU tracker"),
    (("cuda", "cuda"), "CUDA"),
    (("cuda", "tracker"), "mixed"),
])
@pytest.mark.slow
def test_report_md_names_where_the_peaks_came_from(tmp_path, sources, said):
    r = tmp_path / "runs"
    write_run(r / "n", source=sources[0], peak=2 * 2**30)
    write_run(r / "p", method="pool", source=sources[1], peak=int(1.5 * 2**30), act=30 * MiB)
    make_report([r], tmp_path / "out", formats=["png"])
    md = (tmp_path / "out" / "report.md").read_text()
    head = next(ln for ln in md.splitlines() if ln.startswith("| setting"))
    assert f"peak GiB ({said})" in head
    assert ("mixed" in md) == (said == "mixed")  # one source: the word never appears
    none = next(ln for ln in md.splitlines() if ln.startswith("| none |")).split(" | ")
    assert none[2] == "2.00"  # fixed precision: GiB with two decimals below 10


def test_report_md_leads_with_the_headline_ratio_reserved_beside_it(tmp_path):
    """report.md's first table: the step's total peak and its ratio to none first, CUDA's
    reserved peak beside it, then the detail ratios; each ratio defined once above the
    tables, the headline one first."""
    r = tmp_path / "runs"
    cuda = {"device": "cuda:0"}
    write_run(r / "n", source="cuda", peak=2 * 2**30,
              extra={**cuda, "mem_peak_reserved_bytes": 2.5 * 2**30})
    write_run(r / "p", method="pool", source="cuda", peak=1.5 * 2**30, act=25 * MiB,
              extra={**cuda, "mem_peak_reserved_bytes": 2 * 2**30})
    make_report([r], tmp_path / "out", figures=False)
    md = (tmp_path / "out" / "report.md").read_text()
    head = next(ln for ln in md.splitlines() if ln.startswith("| setting"))
    assert head.startswith("| setting | seeds | peak GiB (CUDA) | peak / none | reserved GiB | "
                           "reserved / none | act.+temp. peak / none | saved act. / none |")
    pool = next(ln for ln in md.splitlines() if ln.startswith("| pool |"))
    assert pool.startswith("| pool | 1 | 1.50 | 0.75 | 2.00 | 0.80 | 0.50 | 0.50 |")
    lines = md.splitlines()
    ratio = next(i for i, ln in enumerate(lines) if ln.startswith("- The memory ratio, "))
    assert lines[ratio].startswith("- The memory ratio, `peak / none`: `mem_peak_alloc_bytes` "
                                   "over none's, the step's total peak (CUDA: the allocated peak")
    assert lines[ratio + 1].startswith("- Detail: `reserved / none`: `mem_peak_reserved_bytes`")


@pytest.mark.slow
def test_seeds_timed_under_different_load_are_flagged_noisy(tmp_path):
    """Each run steady (p90 = 1.1 x median) but none's two seeds 2x apart: the load changed
    between runs, so its times are flagged in the table, report.md and the budget's cost panel;
    seeds 1.4x apart are not."""
    r = tmp_path / "runs"
    for seed, t in ((0, 0.1), (1, 0.2)):
        write_run(r / f"n{seed}", seed=seed, step_time=t, throughput=128 / t,
                  extra={"step_time_s_p90": 1.1 * t})
    for seed, t in ((0, 0.1), (1, 0.14)):
        write_run(r / f"c{seed}", method="checkpoint", seed=seed, step_time=t,
                  throughput=128 / t, act=25 * MiB, extra={"step_time_s_p90": 1.1 * t},
                  params={"strategy": "budget", "budget_fraction": 0.5})
    runs, settings, _ = analyse(tables.load_runs([r])[0])
    assert not runs["timing_noisy"].any()  # no run is noisy within itself
    noisy = dict(zip(settings["label"], settings["timing_noisy"]))
    assert noisy == {"none": True, "checkpoint": False}
    bud = plots.budget(settings, style.memory_metric(runs))
    assert "noisy timing: none, the baseline of every overhead here" in _texts(bud.fig)
    assert not any("noisy timing: checkpoint" in t for t in _texts(bud.fig))
    plots.plt.close(bud.fig)
    make_report([r], tmp_path / "out", formats=["png"])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "†" in next(ln for ln in md.splitlines() if ln.startswith("| none |"))
    assert "seeds' step times that far apart" in md


def _more(root):
    """Rows for the figures the study does not draw: predictions only (estimates), a sequence
    length sweep (sequence), a world-size sweep (sharding), and two seeds whose accuracy changes
    are float noise (cost: 0.1 + 0.2 - 0.3 = 5.6e-17)."""
    for name, method, peak in (("en", "none", 400), ("eq", "quantize", 220)):
        write_run(root / "est" / name, method=method, peak=float("nan"), act=float("nan"),
                  test_acc=None, extra={"mem_estimate_bytes": peak * MiB,
                                        "trainer.gpu_memory_gb": 0.25, "trainer.max_steps": 0})
    for n in (128, 256, 512):
        for method, f in (("none", 1.0), ("checkpoint", 0.4)):
            write_run(root / "seq" / f"{method}{n}", method=method, model="gpt_nano",
                      dataset="text", act=f * n * n * 64.0, peak=f * n * n * 64.0 + MiB,
                      extra={"dataset.seq_len": n})
    for n, strategy in ((1, "single"), (2, "fsdp"), (4, "fsdp")):
        write_run(root / "shard" / f"s{n}", model="resmlp12", peak=(40 + 200 / n) * MiB,
                  extra={"trainer.world_size": n, "trainer.strategy": strategy})
    for seed in (0, 1):
        write_run(root / "zero" / f"n{seed}", seed=seed, test_acc=0.3)
        write_run(root / "zero" / f"c{seed}", method="checkpoint", seed=seed,
                  test_acc=0.1 + 0.2, peak=70 * MiB, params={"budget_fraction": 0.5})
    return root


@pytest.fixture(scope="module")
def more(tmp_path_factory):
    """{part: its settings} of `_more`'s rows."""
    root = _more(tmp_path_factory.mktemp("more"))
    out = {}
    for part in ("est", "seq", "shard", "zero"):
        runs, settings, _ = analyse(tables.load_runs([root / part])[0])
        out[part] = (runs, settings)
    return out


def _others(more) -> list:
    zero_runs, zero = more["zero"]
    return [plots.estimates(more["est"][1]), plots.sequence(more["seq"][1]),
            plots.sharding(more["shard"][1]), plots.cost(zero, style.memory_metric(zero_runs))]


def _readable(made: list) -> None:
    for p in made:
        assert draw.layout_problems(p.fig) == [], p.name
        assert p.caption, p.name  # what the axes mean, in full


@pytest.mark.slow
def test_every_figure_renders_with_no_overlapping_text_and_no_offset(figures, more):
    """Every report figure: no text over another (a panel's axis label over the next panel, a
    legend, a tick), no offset or exponent above an axis (float noise of 1e-17 drew ticks 0-2.5
    under '1e-17'), axis labels of one line (the definitions are the captions')."""
    others = _others(more)
    assert [p.name for p in others] == ["estimates", "sequence", "sharding", "cost"]
    _readable([*figures.values(), *others])
    zero = others[-1].data
    assert (zero.loc[zero["row"] == "accuracy", "y"].abs() < 1e-12).all()  # the noise drawn
    for p in others:
        plots.plt.close(p.fig)


@pytest.mark.slow  # every figure drawn again in the slide look: ~10 s
def test_every_figure_renders_readably_in_the_slide_look(study, more):
    runs, settings, metrics = study
    with style.using("slide"):
        made, _ = plots.all_plots(settings, metrics, style.memory_metric(runs))
        made += _others(more)
    _readable(made)
    for p in made:
        plots.plt.close(p.fig)


def test_the_memory_axis_is_the_headline_ratio_named_by_its_column(figures, more):
    """Every figure's main memory axis is the step's total peak relative to none, named by its
    exact column; the caption defines it."""
    axis = "peak / none (mem_peak_alloc_bytes)"
    labels = {name: {lab for ax in p.fig.axes for lab in (ax.get_xlabel(), ax.get_ylabel())}
              for name, p in figures.items()}
    for name in ("cost", "tradeoff", "budget"):
        assert axis in labels[name], (name, labels[name])
        assert "`mem_peak_alloc_bytes` over none's, the step's total peak" in \
            figures[name].caption
    assert "peak (MiB)" in labels["throughput"]
    # the budget's left panel: the planner's target, activations alone, labelled as detail
    assert "act. peak / none (mem_peak_act_bytes)" in labels["budget"]


def test_rows_without_an_accounting_step_say_their_peaks_were_not_measured():
    """Estimate-only or probe-only runs (trainer.max_steps=0) measured no peak: the report's
    memory line and a figure's caption say so instead of naming a source."""
    import pandas as pd

    mem = style.memory_metric(pd.DataFrame({"method": ["none", "pool"]}))
    assert mem.source == style.NOT_MEASURED
    assert mem.caption("none").endswith("; none measured: probes or estimates only")
    both = style.memory_metric(pd.DataFrame({"mem_peak_source": ["cuda", None]}))
    assert both.source == "CUDA max allocated"
