"""The registry walker: every method of conf/method (with the variants that change what its run
measures, and at its defaults) on every model of conf/model, prepared and estimated without
training.

Registry-wide tests take their cases from here rather than writing a matrix of their own, so a new
method, model or variant is covered by every registry-wide claim at once (tests/test_registry.py).
Two levels, chosen for what each claim needs:

- `measured(case)`: on the two small reference models (`MEASURED`: an MLP, a CNN with BatchNorm
  and ReLU) a real run of three steps with `trainer.estimate=true`, so one row holds both the
  accounting step's measured columns and the GPU-free estimate of the same step.
- `estimated(case)`: on every model, `trainer.estimate=true` with `trainer.max_steps=0`: the
  model built, the method applied and prepared (a checkpoint plan profiled and solved) and one
  training step run on fake tensors, no data and no training. The estimate is held to the
  measured columns by `measured` on the reference models, so its columns stand for a run's.

Every result is cached for the worker's session: one `none` baseline per model, shared by every
method's case and made once for both xdist workers (conftest.shared_row).
"""

from __future__ import annotations

import atexit
import itertools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from conftest import conf_options, language_model, layered, own_models, shallow, shared_row

from memtrain import api

METHODS = conf_options("method")
MODELS = own_models()  # the by-name families and the module: tests/test_models_by_name.py
# the reference models of measured rows: an MLP, a CNN, and one transformer of each family
MEASURED = ("mlp6", "resnet18", "gpt_nano", "vit_tiny")
# A stack's members are walked on every model; the stack itself on the MLP, the CNN and one
# transformer, the decoder (its quantize-inside-checkpoint accounting is the slowest case on the
# CPU; its code reads the members' hooks and plans, not the model's family).
STACK_MODELS = ("mlp6", "resnet18", "gpt_nano")
# The models whose runs walk each method's variants too (the variants' claims do not depend on
# the model family).
VARIANT_MODELS = ("mlp6", "resnet18")
# The models with a number of layers (the transformers) run two of them: every layer is the same
# module, so two hold every claim one or twelve would (a chain of more than one block), at the
# cost of two.
TWO_LAYERS = tuple(m for m in MODELS if layered(m))


@dataclass(frozen=True)
class Case:
    method: str
    model: str
    extra: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return " ".join([self.model, self.method, *self.extra])

    def overrides(self, size: list[str]) -> list[str]:
        if language_model(self.model):  # the same sizes in tokens: sequences of 16
            size = [*LM_DATA, *(o for o in size if not o.startswith("dataset"))]
        return [f"model={self.model}", f"method={self.method}", *size, *shallow(self.model),
                *self.extra]


# Beyond each method's defaults: the options that change what its run measures. Checkpoint's
# other plans are not timed before training (`time_plan`, timed at the defaults: the same code
# for every plan): their claims are bytes, and timing runs the model again, eight passes.
VARIANTS: dict[str, list[list[str]]] = {
    "checkpoint": [["method.strategy=uniform", "method.time_plan=false"],
                   ["method.strategy=sqrt", "method.time_plan=false"],
                   ["method.strategy=selective"]],
    "synthetic": [["method.right_input=left"],
                  ["method.recovery_epochs=1", "trainer.epochs=2", "dataset.train_size=64"]],
    "prune": [["method.sparsity=0.9", "method.block_size=16", "method.prune_shared=true"],
              ["method.block_size=16", "method.prune_head=true"]],
    "pool": [["method.targets=conv+bn"]],
}
# A method's defaults where they cannot hold on the small sizes walked: a stack's plan at the
# exact uniform schedule (its budget plan measures each candidate in a tracked step), not timed
# before training (its forwards and backwards through quantize, timed in pairs); prune's
# default 32x32 blocks do not fit the walked batch of 16 rows on mlp6 (the run refuses it).
# (Checkpoint's default budget, 0.5 of none's activation peak, below mlp6's smallest feasible
# plan at ~0.62, is raised to that plan: its defaults are walked.)
DEFAULTS: dict[str, list[str]] = {
    "prune": ["method.block_size=16"],
    "checkpoint+quantize": ["method.checkpoint.strategy=uniform",
                            "method.checkpoint.profile_repeats=1",
                            "method.checkpoint.time_plan=false"],
}
# The estimate-level walk of the other models: one configuration per method, its defaults.
ESTIMATED: dict[str, list[str]] = {"prune": []}
# The walked cases a method refuses up front, each with a piece of its one-line ConfigError: the
# refusal is the claim (test_registry.py), and the case is in no other test's walk. Prune on a
# ResNet of basic blocks: each 1x1 conv (the downsample) reads the block input its sibling 3x3
# conv keeps, so no input could be freed; with prune_head the classifier's could, but not below
# the activation peak.
REFUSED: dict[Case, str] = {
    **{Case("synthetic", m): "method=synthetic trains each partition to predict synthetic labels"
       for m in MODELS if language_model(m)},
    # transformers have no ReLU and no convolution beyond a ViT's patch embedding (which reads
    # the batch): pool would change nothing
    **{Case("pool", m): "it would change nothing" for m in MODELS
       if m.startswith(("gpt", "vit"))},
    Case("prune", "resnet18", ("method.block_size=16",)): "method=prune prunes nothing in ResNet",
    Case("prune", "resnet34"): "method=prune prunes nothing in ResNet: none of its 3 prunable",
    # with prune_head the classifier's input is the one it could free, but that input is alive
    # at the end of the forward, the activation peak, where its blocks would be made beside it
    # (measured before the plan knew it: saved x0.999 of none's, activation peak x1.001)
    Case("prune", "resnet18", ("method.block_size=16", "method.prune_head=true")):
        "are alive at the activation peak",
}

MEASURED_SIZE = ["dataset=synthetic", "dataset.image_size=16", "dataset.train_size=32",
                 "dataset.test_size=8", "trainer=smoke", "trainer.max_steps=3",
                 "trainer.batch_size=16", "trainer.eval_max_batches=1", "trainer.seed=0",
                 "trainer.estimate=true"]
LM_DATA = ["dataset=tokens", "dataset.seq_len=16", "dataset.train_size=32", "dataset.test_size=8"]
ESTIMATED_SIZE = ["dataset=synthetic", "dataset.image_size=32", "dataset.train_size=16",
                  "dataset.test_size=8", "trainer=smoke", "trainer.max_steps=0",
                  "trainer.batch_size=8", "trainer.seed=0", "trainer.estimate=true"]

# Every method at its own defaults on every model runs, or refuses in one line with the reason
# (AT_DEFAULTS_REFUSED). The walks above hold most pairs already: the measured walk runs the
# reference models' methods at their defaults (but prune and the stack, DEFAULTS), the
# estimated walk every other model's (but the stack, on STACK_MODELS only); `at_defaults_cases`
# are the rest, and test_registry.py checks that together they are every pair. The estimated
# walk's batch of 8 is below prune's default block of 32 rows, which mlp6's Linear inputs need
# (the trainer's default batch, 128, has them): that case runs at 32.
AT_DEFAULTS_SIZE: dict[tuple[str, str], list[str]] = {("prune", "mlp6"): ["trainer.batch_size=32"]}
_NO_GPU = "nothing to offload to (use trainer.device=cuda)"
AT_DEFAULTS_REFUSED: dict[tuple[str, str], str] = {
    # the walked refusals at the method's defaults (prune on resnet34, pool and synthetic on
    # the transformers), and prune on resnet18 without the walk's smaller block
    **{(c.method, c.model): why for c, why in REFUSED.items() if not c.extra},
    ("prune", "resnet18"): "method=prune prunes nothing in ResNet",
    # on a machine without CUDA (the test expects it to run where there is one)
    **{("offload", m): _NO_GPU for m in MODELS},
}

# Known defects the walk finds, each a strict xfail in test_registry.py (it fails once fixed, so
# the entry goes): case -> what was measured.
KNOWN: dict[Case, str] = {
    # ViT-B/16 on two layers, 32 px (5 tokens), batch 8: prune's peak rule takes none's
    # activation peak to be at the forward's end; here the step peaks elsewhere, above none's
    Case("prune", "vit_b16"): "saved bytes x0.919 of none's but the activation peak x1.194",
}


def _applies(method: str, model: str) -> bool:
    return "+" not in method or model in STACK_MODELS


def _walk_measured() -> list[Case]:
    """Every method with its defaults and each variant on the MLP and the CNN; on the
    transformers each method (a stack too) at its defaults: the variants' claims do not
    depend on the model family."""
    return [Case(method, model, tuple(extra)) for model in MEASURED for method in METHODS
            if _applies(method, model)
            for extra in [_defaults(method, model),
                          *(VARIANTS.get(method, []) if model in VARIANT_MODELS else [])]]


def _defaults(method: str, model: str) -> list[str]:
    """DEFAULTS, but a stack on a two-layer transformer runs at its own defaults (its budget
    plan, measured in tracked steps, is quick there): the walk then holds its defaults too."""
    return [] if "+" in method and model in TWO_LAYERS else DEFAULTS.get(method, [])


def _walk_estimated(models) -> list[Case]:
    return [Case(method, model, tuple(ESTIMATED.get(method, DEFAULTS.get(method, []))))
            for model in models for method in METHODS if _applies(method, model)]


def measured_cases() -> list[Case]:
    """Every method with its defaults and each variant, on the reference models."""
    return [c for c in _walk_measured() if c not in REFUSED]


def estimated_cases(models: tuple[str, ...] | list[str] = MODELS) -> list[Case]:
    """Every method (one configuration each) on every model."""
    return [c for c in _walk_estimated(models) if c not in REFUSED]


def refused_cases() -> list[Case]:
    """The walked cases a method refuses (REFUSED), each one the walk makes (a stale entry
    fails here rather than testing a case nobody walks)."""
    walked = {*_walk_measured(), *_walk_estimated(MODELS)}
    assert set(REFUSED) <= walked, set(REFUSED) - walked
    return list(REFUSED)


def run_refused(case: Case) -> dict:
    """Run a refused case at the level the walk would (measured on the reference models)."""
    return measured(case) if case.model in MEASURED else estimated(case)


_ROWS: dict[tuple[str, ...], dict] = {}  # overrides -> row, for this worker's session
_ROOT = Path(tempfile.mkdtemp(prefix="mt-walker-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)  # the worker's runs, when it ends
_FOLDERS = itertools.count()  # one fresh folder a run (a refused run leaves its folder behind)
def _run(overrides: list[str]) -> dict:
    """The row of a run (a ConfigError propagates: a method may refuse a model or the CPU); a
    `none` row, the baseline of every case of its model, made once for the session's workers
    (conftest.shared_row)."""
    key = tuple(overrides)
    if key not in _ROWS:
        make = lambda: api.run(overrides, out_dir=_ROOT / str(next(_FOLDERS)))  # noqa: E731
        _ROWS[key] = shared_row(("walker", *key), make) if "method=none" in key else make()
    return _ROWS[key]


def measured(case: Case) -> dict:
    """The row of a real three-step run with its estimate (reference models only)."""
    assert case.model in MEASURED, case
    return _run(case.overrides(MEASURED_SIZE))


def estimated(case: Case) -> dict:
    """The row of a prepare-and-estimate run: no data step, no training."""
    return _run(case.overrides(ESTIMATED_SIZE))


def walked_at_defaults() -> set[tuple[str, str]]:
    """(method, model) pairs the measured and estimated walks run at the method's defaults and
    hold to `status == ok` (offload's, skipped there without a GPU, are not)."""
    others = [m for m in MODELS if m not in MEASURED]
    ran = {(c.method, c.model) for c in [*measured_cases(), *estimated_cases(others)]
           if not c.extra}
    return {(method, model) for method, model in ran if method != "offload"}


def at_defaults_cases() -> list[Case]:
    """The methods at their defaults on the models no other walk runs them at their defaults
    (a stack on STACK_MODELS only, as everywhere), estimate-level."""
    done = walked_at_defaults()
    return [Case(method, model, tuple(AT_DEFAULTS_SIZE.get((method, model), [])))
            for model in MODELS for method in METHODS
            if _applies(method, model) and (method, model) not in done]

