"""Defaults that train: every model (globbed from conf/model) with its default recipe (the default
optimizer plus conf/recipe/<model>_<optim>.yaml where one exists) learns on the default
synthetic data within a short schedule: no divergence, better than chance.

`make test` holds the claim with one seed per model (seed 0), a deeper twin (STUDY_ONLY) through
its guarded twin's run of the same recipe, mlp6 through test_train.py's guard of the same recipe
(GUARDED_ELSEWHERE), ResNet-50 through the committed study of the unchanged command (STUDIED);
`make check-studies` runs three seeds (0-2) of every model into runs/studies/recipes, and
docs/results/studies/recipes/ is the committed report of that study (`memtrain-report`: mean
and std over the seeds)."""

import math

import pytest
from conftest import CONF, language_model, own_models

from memtrain import api

# Small images keep this cheap. EfficientNet (stride 32: its later stages see 2x2 and 1x1 maps at
# 16 px) stayed at chance at 16 px with lr 0.01, 0.03 and 0.1; at 32 px, the data's default, it
# trains.
# ResMLP (4 px patches below 128 px) at 8 px: 4 tokens, a quarter of 16 px's compute (resmlp24's
# three runs took 680 s of the suite at 16 px); it learns there too: test accuracy after the 64
# steps, seeds 0-2, resmlp12 0.269/0.267/0.295, resmlp24 0.258/0.290/0.279 (CPU, 2026-11-24).
IMAGE_SIZE = {"efficientnet_b0": 32, "mlp6": 32, "resmlp12": 8, "resmlp24": 8}
# mlp6 (no normalisation; nn.Linear's default init) sits near chance for its first ~100 steps:
# it gets the schedule and image size of the usage page's mlp6 check (200 steps of 64, 32 px).
# ViT-B/16 (two layers) clears the bar by more than twice within 32 steps on seeds 0-2, GPT-2
# small (two layers) by more than half a nat.
SCHEDULE = {"mlp6": ["trainer.max_steps=200", "trainer.batch_size=64"],
            "gpt2_small": ["trainer.max_steps=32", "trainer.batch_size=16"],
            "vit_b16": ["trainer.max_steps=32", "trainer.batch_size=32"]}
# The full-size transformers train two of their layers here (width, heads and recipe their
# own): twelve layers of width 768 are minutes a step on the CPU. gpt_nano and vit_tiny, the
# same shapes at CPU size, train whole.
SHALLOW = {"gpt2_small": ["model.layers=2"], "vit_b16": ["model.layers=2"]}
SHORT_DATA = ["dataset.train_size=2048", "dataset.test_size=1000"]
SHORT = ["trainer.warmup_steps=1",
         "trainer.account_memory=false", "trainer.threads=1", "trainer.progress=false",
         "trainer.device=cpu"]
CHANCE = 1 / 10  # the synthetic dataset's ten classes; 1000 test samples: std 0.0095 at chance
# A deeper twin of a guarded model, with the twin's recipe (the same optimizer, no recipe file
# of its own, the same kind of blocks): make test guards that recipe on the twin, the study runs
# the deeper model's three seeds (resnet34 44 s, resmlp24 28 s of make test's CPU before).
# test_twins_share_their_guards_recipe holds the premise.
STUDY_ONLY = {"resnet34": "resnet18", "resmlp24": "resmlp12"}
# A model whose recipe of its own only the study trains, too dear for make test (ResNet-50's 64
# steps: about 100 s of the 2-core machine's CPU): make test holds that the command the study ran
# is still the command it would run (the same run_id as the committed seed-0 row) and that the
# committed rows show every seed learning; the recipe's mechanism (zero-initialised residual
# branches) is held on the built model. A change of the recipe, the model's options or the
# schedule changes the run_id: run the study again (make check-studies) and commit its report.
STUDIED = {"resnet50": "conf/recipe/resnet50_sgd.yaml: lr 0.05 and zero-initialised residual "
                       "branches"}
# A model whose recipe another guard in make test already trains at this schedule or longer:
# test_train.py's documented mlp6 command is mlp6's recipe (conf/recipe/mlp6_sgd.yaml) for the
# same 200 steps of 64 at 32 px, on more data, held to twice chance (here 1.5x).
GUARDED_ELSEWHERE = {"mlp6": "test_train.py::test_mlp6_default_recipe_trains"}
CASES = [pytest.param(model, seed, id=f"{model}-{seed}",
                      marks=pytest.mark.guard
                      if seed == 0 and model not in (*STUDY_ONLY, *GUARDED_ELSEWHERE, *STUDIED)
                      else pytest.mark.study)
         for model in own_models() for seed in (0, 1, 2)]


def test_twins_share_their_guards_recipe():
    """Each STUDY_ONLY model composes the same optimizer, recipe choice and dataset as its
    guarded twin, and its model options differ from the twin's in the class alone."""
    for deep, twin in STUDY_ONLY.items():
        (a, ca), (b, cb) = api.compose([f"model={deep}"]), api.compose([f"model={twin}"])
        for choices in (ca, cb):  # the optional conf/recipe/<model>_<optim>.yaml: none
            assert not (CONF / "recipe" / f"{choices['recipe']}.yaml").exists(), choices
        assert a.optim == b.optim and a.dataset == b.dataset
        assert {k: v for k, v in a.model.items() if k != "_target_"} == \
            {k: v for k, v in b.model.items() if k != "_target_"}
        assert a.model._target_ != b.model._target_


def _command(model: str, seed: int) -> list[str]:
    """The recipe run of `model` and `seed`: its schedule, data size and depth."""
    schedule = SCHEDULE.get(model, ["trainer.max_steps=64", "trainer.batch_size=32"])
    data = (["dataset.seq_len=32", "dataset.train_size=2048", "dataset.test_size=64"]
            if language_model(model) else
            [f"dataset.image_size={IMAGE_SIZE.get(model, 16)}", *SHORT_DATA])
    return [f"model={model}", *data, *SHALLOW.get(model, []), f"trainer.seed={seed}",
            *schedule, *SHORT]


@pytest.mark.slow  # builds ResNet-50: about 2.4 s
@pytest.mark.parametrize("model", sorted(STUDIED))
def test_a_studied_recipe_is_the_one_the_committed_study_trained(model):
    """The committed study's rows of `model` (docs/results/studies/recipes) are the run make
    check-studies would make now (seed 0: the same config, so the same run_id), and every seed
    learned there; the recipe's zero-initialised residual branches start each block as the
    identity (every bottleneck's last BatchNorm scale is zero)."""
    import csv

    from memtrain.config import loader

    rows = [r for r in csv.DictReader((CONF.parent / "docs/results/studies/recipes/summary.csv")
                                      .open()) if r["model"] == model]
    assert [r["trainer.seed"] for r in rows] == ["0", "1", "2"], STUDIED[model]
    cfg, _ = api.compose(_command(model, 0))
    assert loader.run_id(cfg) == rows[0]["run_id"], (
        f"{model}'s recipe run changed since the committed study ({STUDIED[model]}): run make "
        "check-studies and commit docs/results/studies/recipes")
    assert all(r["status"] == "ok" and float(r["test_acc"]) > 1.5 * CHANCE for r in rows), rows
    assert cfg.model.zero_init_residual and cfg.optim.lr == 0.05
    _, net, _ = api.build([f"model={model}", "dataset.image_size=16"])
    last = [b.bn3.weight for b in net.modules() if type(b).__name__ == "Bottleneck"]
    assert len(last) == 16 and all(not w.any() for w in last)


@pytest.mark.slow
@pytest.mark.parametrize("model,seed", CASES)
def test_default_recipe_trains(study_dir, model, seed):
    row = api.run(_command(model, seed), out_dir=study_dir("recipes") / f"{model}_seed{seed}")
    assert row["status"] == "ok", (row["status"], row.get("error"))
    assert math.isfinite(row["train_loss"])
    if language_model(model):  # next tokens: below the context-free model's loss
        assert row["learned"] and row["test_loss"] < 0.8 * row["unigram_loss"], row["test_loss"]
    else:
        assert row["test_acc"] > 1.5 * CHANCE, row["test_acc"]
