"""Every experiment preset runs (lightning-hydra-template's pattern): each conf/experiment/*.yaml
is composed with trainer=smoke at tiny sizes and its last sweep point (a method setting, not the
baseline) trains a few steps and leaves an ok row. A preset that composes but cannot run fails
here. One point per preset keeps it affordable on 2 cores; test_every_experiment_composes
(test_config.py) composes them all."""

import shlex

import pytest
import yaml
from conftest import CONF, conf_options, language_model, tiny_data

from memtrain import api

TINY = ["trainer=smoke", "trainer.max_steps=2", "trainer.warmup_steps=1", "trainer.batch_size=4",
        "trainer.eval_max_batches=1", "dataset=synthetic", "dataset.image_size=32",
        "dataset.train_size=16", "dataset.test_size=8", "trainer.epochs=1"]
# A language model's preset (transformer_study) keeps its token data and its point's sequence
# length; the decoder shrinks to one narrow layer (its options, not its code, are what the
# preset sets) and the batch to two.
SMALL_DECODER = ["model.layers=1", "model.width=32", "model.heads=2"]
TINY_LM = [*(o for o in TINY if not o.startswith("dataset")), "trainer.batch_size=2",
           "dataset.train_size=4", "dataset.test_size=2", *SMALL_DECODER]


def tiny(exp: str) -> list[str]:
    """TINY, or TINY_LM where the preset's model reads tokens."""
    defaults = yaml.safe_load((CONF / "experiment" / f"{exp}.yaml").read_text())["defaults"]
    model = next((d["override /model"] for d in defaults
                  if isinstance(d, dict) and "override /model" in d), None)
    return TINY_LM if model and language_model(model) else TINY


def last_point(exp: str) -> list[str]:
    """The overrides of the preset's last sweep point (of its last variant, if it has some)."""
    sweeper = yaml.safe_load((CONF / "experiment" / f"{exp}.yaml").read_text())
    sweeper = sweeper.get("hydra", {}).get("sweeper", {})
    params = dict(sweeper.get("params") or {})
    if sweeper.get("variants"):  # hydra/sweeper=variants: a line of overrides each
        params.update(t.split("=", 1) for t in shlex.split(sweeper["variants"][-1]))
    # the dataset is replaced by tiny synthetic data below, whatever the sweep names; glob(*)
    # sweeps every option of the group, in Hydra's (sorted) order
    choices = {k: conf_options(k) if v == "glob(*)" else str(v).split(",")
               for k, v in params.items() if k != "dataset"}
    return [f"{k}={v[-1]}" for k, v in choices.items()]


CASES = [(exp, last_point(exp)) for exp in conf_options("experiment")]


def test_every_preset_is_covered():
    assert {exp for exp, _ in CASES} == set(conf_options("experiment"))
    assert "compare_all" in {exp for exp, _ in CASES}


def estimates_only(exp: str) -> bool:
    """A preset of estimates (trainer.estimate, trainer.max_steps=0): its points are no runs
    of one process (sharding_study: one rank of N, without the ranks)."""
    trainer = yaml.safe_load((CONF / "experiment" / f"{exp}.yaml").read_text()).get("trainer")
    return bool(trainer and trainer.get("estimate") and trainer.get("max_steps") == 0)


@pytest.mark.slow
@pytest.mark.parametrize("exp,point", CASES, ids=[f"{e}-{'-'.join(p)}" for e, p in CASES])
def test_every_preset_smoke_runs(exp, point, tmp_path):
    if estimates_only(exp):  # its own step count (0), tiny data of its point's model
        model = next(p.split("=", 1)[1] for p in point if p.startswith("model="))
        # a decoder shrunk as TINY_LM shrinks it: what the preset sets are its options
        small = SMALL_DECODER if language_model(model) else []
        row = api.run([f"experiment={exp}", *point, *tiny_data(model), *small],
                      out_dir=tmp_path)
        assert row["status"] == "ok", row.get("error")
        assert row["mem_estimate_bytes"] > 0 and "mem_estimate_error" not in row
        return
    row = api.run([f"experiment={exp}", *point, *tiny(exp)], out_dir=tmp_path)
    assert row["status"] == "ok", row.get("error")
    assert row["mem_act_saved_bytes"] > 0


def test_compare_all_is_every_method_on_four_models():
    params = yaml.safe_load((CONF / "experiment" / "compare_all.yaml").read_text())
    params = params["hydra"]["sweeper"]["params"]
    assert params["method"] == "glob(*)"  # every conf/method/*.yaml, a new one included
    assert params["model"].split(",") == ["resnet50", "resmlp24", "efficientnet_b0", "mlp6"]
    cfg, _ = api.compose(["experiment=compare_all", "method=pool"])
    assert cfg.method.kernel_size == api.compose(["method=pool"])[0].method.kernel_size


def quick_points() -> list[list[str]]:
    """Every job of the quick study (`make run`): each variant line, its comma sweeps expanded."""
    sweeper = yaml.safe_load((CONF / "experiment" / "quick.yaml").read_text())["hydra"]["sweeper"]
    points = []
    for line in sweeper["variants"]:
        pairs = [t.split("=", 1) for t in shlex.split(line)]
        sweep = [(k, v.split(",")) for k, v in pairs]
        method = next(vs for k, vs in sweep if k == "method")
        rest = [f"{k}={vs[0]}" for k, vs in sweep if k != "method"]
        points += [[f"method={m}", *rest] for m in method]
    return points


@pytest.mark.slow
@pytest.mark.study  # 6 runs at the study's size: 5.5 min alone, past make test's budget
def test_quick_study_methods_each_change_memory_and_train_above_chance(tmp_path):
    """The guard of `make run`, at the size the study runs (16 px, batch 64, 40 steps): it holds
    every method that runs on a CPU (offload needs a GPU; a stack is no method of its own), every
    method's row lies below the none row of its own model (resnet18; mlp6 for prune) in saved
    bytes and both activation peaks (it does something), and every row's test accuracy is above
    chance (0.10 on the 10 synthetic classes)."""
    rows = {" ".join(p): api.run(["experiment=quick", *p, "trainer.progress=false"],
                                 out_dir=tmp_path / str(i))
            for i, p in enumerate(quick_points())}
    assert {r["method"] for r in rows.values()} == \
        {m for m in conf_options("method") if m != "offload" and "+" not in m}
    base = {r["model"]: r for r in rows.values() if r["method"] == "none"}
    assert set(base) == {r["model"] for r in rows.values()}, "a model without its none row"
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row.get("error"))
        assert row["test_acc"] > 0.10, (name, row["test_acc"])
        if row["method"] != "none":
            for col in ("mem_act_saved_bytes", "mem_peak_act_bytes", "mem_peak_act_temp_bytes"):
                none = base[row["model"]][col]
                assert row[col] < none, (name, col, row[col], none)
