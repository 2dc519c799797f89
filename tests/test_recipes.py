"""Defaults that train: every model (globbed from conf/model) with its default recipe (the default
optimizer plus conf/recipe/<model>_<optim>.yaml where one exists) learns on the default
synthetic data within a short schedule: no divergence, better than chance.

`make check-studies` runs three seeds (0-2) of every model into runs/studies/recipes, and
docs/results/studies/recipes/ is the committed report of that study (`memtrain-report`: mean
and std over the seeds). `make test` trains seed 0 of the models whose recipe run is cheap
(GUARDS), mlp6 through test_train.py's guard of the same recipe (GUARDED_ELSEWHERE), and holds
every other model (STUDIED) to the committed study: the command the study ran is still the
command it would run, and every seed of it learned."""

import math

import pytest
from conftest import CONF, language_model, own_models

from memtrain import api

# Small images keep this cheap. EfficientNet (stride 32: its later stages see 2x2 and 1x1 maps at
# 16 px) stayed at chance at 16 px with lr 0.01, 0.03 and 0.1; at 32 px, the data's default, it
# trains.
# ResMLP (4 px patches below 128 px) at 8 px: 4 tokens, a quarter of 16 px's compute; it learns
# there too (the committed study's rows).
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
# The models whose recipe run make test trains (seed 0): a few CPU-seconds each, a CNN-free
# decoder and two encoders on the default optimizer. ViT-B/16 (two layers) clears the bar by
# more than twice within 32 steps on seeds 0-2.
GUARDS = ("gpt_nano", "vit_tiny", "vit_b16")
# The models whose recipe run only the study trains, too dear for make test (tens of seconds of
# CPU each at this schedule): make test holds that the command the study ran is
# still the command it would run (the same run_id as the committed rows, seeds 0-2) and that
# the committed rows show every seed learning. A change of the recipe, the model's options or
# the schedule changes the run_id: run the study again (make check-studies) and commit its
# report. Training itself stays guarded in make test on the GUARDS, mlp6 (test_train.py), and
# a BatchNorm CNN at twelve epochs (test_pool.py's accuracy guard).
STUDIED = {
    "resnet18": "the default optimizer on BasicBlock ResNets, 64 steps at 16 px",
    "resnet34": "resnet18's recipe on more of the same blocks",
    "resnet50": "conf/recipe/resnet50_sgd.yaml: lr 0.05 and zero-initialised residual branches",
    "efficientnet_b0": "conf/recipe/efficientnet_b0_sgd.yaml at 32 px (at 16 px its later "
                       "stages see 2x2 maps and it stayed at chance)",
    "resmlp12": "the default optimizer on ResMLP at 8 px (4 tokens)",
    "resmlp24": "resmlp12's recipe on more of the same blocks",
    "gpt2_small": "the default optimizer on GPT-2 small's width, two of its layers, 32 steps",
}
# A model whose recipe another guard in make test already trains at this schedule or longer:
# test_train.py's documented mlp6 command is mlp6's recipe (conf/recipe/mlp6_sgd.yaml) for the
# same 200 steps of 64 at 32 px, on more data, held to twice chance (here 1.5x).
GUARDED_ELSEWHERE = {"mlp6": "test_train.py::test_mlp6_default_recipe_trains"}
CASES = [pytest.param(model, seed, id=f"{model}-{seed}",
                      marks=pytest.mark.guard if seed == 0 and model in GUARDS
                      else pytest.mark.study)
         for model in own_models() for seed in (0, 1, 2)]


def test_every_model_is_guarded_or_studied():
    """Each model's recipe is trained in make test (GUARDS, GUARDED_ELSEWHERE) or held to the
    committed study (STUDIED), one of the three."""
    kinds = [set(GUARDS), set(GUARDED_ELSEWHERE), set(STUDIED)]
    assert set().union(*kinds) == set(own_models())
    assert sum(map(len, kinds)) == len(own_models())


def _learned(model: str, row: dict) -> bool:
    """The recipes' bar: next tokens below 0.8 of the context-free model's loss, images above
    1.5 x chance (a committed row's values are text)."""
    if language_model(model):
        return str(row["learned"]) == "True" and \
            float(row["test_loss"]) < 0.8 * float(row["unigram_loss"])
    return float(row["test_acc"]) > 1.5 * CHANCE


def _command(model: str, seed: int) -> list[str]:
    """The recipe run of `model` and `seed`: its schedule, data size and depth."""
    schedule = SCHEDULE.get(model, ["trainer.max_steps=64", "trainer.batch_size=32"])
    data = (["dataset.seq_len=32", "dataset.train_size=2048", "dataset.test_size=64"]
            if language_model(model) else
            [f"dataset.image_size={IMAGE_SIZE.get(model, 16)}", *SHORT_DATA])
    return [f"model={model}", *data, *SHALLOW.get(model, []), f"trainer.seed={seed}",
            *schedule, *SHORT]


@pytest.mark.parametrize("model", sorted(STUDIED))
def test_a_studied_recipe_is_the_one_the_committed_study_trained(model):
    """The committed study's rows of `model` (docs/results/studies/recipes) are the runs make
    check-studies would make now (each seed's config the same, so its run_id), and every seed
    learned there."""
    import csv

    from memtrain.config import loader

    rows = [r for r in csv.DictReader((CONF.parent / "docs/results/studies/recipes/summary.csv")
                                      .open()) if r["model"] == model]
    assert [r["trainer.seed"] for r in rows] == ["0", "1", "2"], STUDIED[model]
    for seed, row in enumerate(rows):
        cfg, _ = api.compose(_command(model, seed))
        assert loader.run_id(cfg) == row["run_id"], (
            f"{model}'s recipe run (seed {seed}) changed since the committed study "
            f"({STUDIED[model]}): run make check-studies and commit docs/results/studies/recipes")
        assert row["status"] == "ok" and math.isfinite(float(row["train_loss"])), row
        assert _learned(model, row), (model, seed, row["test_acc"], row["test_loss"])


@pytest.mark.slow  # builds ResNet-50
def test_resnet50s_recipe_starts_each_bottleneck_as_the_identity():
    """ResNet-50's recipe (conf/recipe/resnet50_sgd.yaml, lr 0.05): its zero-initialised
    residual branches start each block as the identity (every bottleneck's last BatchNorm
    scale is zero)."""
    cfg, _ = api.compose(_command("resnet50", 0))
    assert cfg.model.zero_init_residual and cfg.optim.lr == 0.05
    _, net, _ = api.build(["model=resnet50", "dataset.image_size=16"])
    last = [b.bn3.weight for b in net.modules() if type(b).__name__ == "Bottleneck"]
    assert len(last) == 16 and all(not w.any() for w in last)


@pytest.mark.slow
@pytest.mark.parametrize("model,seed", CASES)
def test_default_recipe_trains(study_dir, model, seed):
    row = api.run(_command(model, seed), out_dir=study_dir("recipes") / f"{model}_seed{seed}")
    assert row["status"] == "ok", (row["status"], row.get("error"))
    assert math.isfinite(row["train_loss"])
    assert _learned(model, row), (row.get("test_acc"), row.get("test_loss"))
