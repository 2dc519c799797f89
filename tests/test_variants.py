"""hydra/sweeper=variants: a baseline and a method's variants in one multirun, one folder."""

from __future__ import annotations

import json

import pytest
from conftest import run_memtrain

from memtrain.config.sweeper import variant_overrides

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8"]


def test_variant_overrides_replace_the_common_keys_they_set():
    common = ["method=pool", "trainer.seed=0,1", "model=mlp6"]
    assert variant_overrides(common, "method=prune method.sparsity=0.5,0.9") == \
        ["trainer.seed=0,1", "model=mlp6", "method=prune", "method.sparsity=0.5,0.9"]
    assert variant_overrides(common, "method=none") == \
        ["trainer.seed=0,1", "model=mlp6", "method=none"]


def _study(folder, variants: list[str]) -> None:
    (folder / "experiment").mkdir(parents=True)
    lines = "".join(f"      - {v}\n" for v in variants)
    (folder / "experiment" / "study.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /hydra/sweeper: variants\n"
        "hydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      trainer.seed: 0,1\n"
        f"    variants:\n{lines}")


@pytest.mark.slow
def test_a_baseline_and_variants_sweep_into_one_folder(in_tmp):
    _study(in_tmp / "c", ["method=none", "method=prune method.sparsity=0.5,0.9"])
    p = run_memtrain("--config-dir", str(in_tmp / "c"), "experiment=study", *TINY,
                     "trainer.batch_size=32",  # prune's 32-row blocks (smoke's batch is 8)
                     "hydra.sweep.dir=sw", cwd=in_tmp, timeout=600)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(f.read_text()) for f in (in_tmp / "sw").glob("*/summary.json")]
    got = sorted((r["method"], r.get("method.sparsity"), r["trainer.seed"], r["status"])
                 for r in rows)
    assert got == sorted([("none", None, s, "ok") for s in (0, 1)]
                         + [("prune", sp, s, "ok") for sp in (0.5, 0.9) for s in (0, 1)])
    assert (in_tmp / "sw" / "report.md").exists()  # one folder, one report


@pytest.mark.slow
def test_a_bad_variant_is_one_line_before_any_job(in_tmp):
    _study(in_tmp / "c", ["method=none", "method=prune method.sparsty=0.5"])
    p = run_memtrain("-m", "--config-dir", str(in_tmp / "c"), "experiment=study", *TINY,
                     "hydra.sweep.dir=sw", cwd=in_tmp, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip() == (
        "memtrain: error: hydra.sweeper.variants[1] (method=prune method.sparsty=0.5): unknown "
        "option method.sparsty; did you mean method.sparsity?")
    assert not (in_tmp / "sw").exists()


@pytest.mark.slow
def test_variants_on_the_command_line_are_checked():
    from memtrain.config import loader
    from memtrain.errors import ConfigError

    good = 'hydra.sweeper.variants=["method=none","method=prune method.sparsity=0.5,0.9"]'
    loader.check_overrides(["hydra/sweeper=variants", good, *TINY], multirun=True)
    loader.check_overrides(["hydra/sweeper=variants", good, *TINY, "method=pool"])  # one job
    bad = 'hydra.sweeper.variants=["method=none","method=prune method.sparsity=1.5,abc"]'
    with pytest.raises(ConfigError) as e:
        loader.check_overrides(["hydra/sweeper=variants", bad, *TINY], multirun=True)
    assert str(e.value) == ("hydra.sweeper.variants[1] (method=prune method.sparsity=1.5,abc): "
                            "method.sparsity must be a number, got 'abc'")
    with pytest.raises(ConfigError, match="variants need hydra/sweeper=variants$"):
        loader.check_overrides([good, *TINY], multirun=True)


def test_split_arguments_stays_hydras_static_method():
    """Hydra's Sweeper contract: `split_arguments(overrides, max_batch_size)` is a static
    method; the variants sweeper's is the basic sweeper's (its variants expand in `sweep`)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra_plugins.memtrain_sweeper import VariantSweeper

    parsed = OverridesParser.create().parse_overrides(["a=1,2", "b=3"])
    expected = [[["a=1", "b=3"]], [["a=2", "b=3"]]]
    assert VariantSweeper.split_arguments(parsed, 1) == expected
    assert BasicSweeper.split_arguments(parsed, 1) == expected
