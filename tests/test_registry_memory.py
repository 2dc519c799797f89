"""Registry-wide memory honesty: every method x every model (globbed from conf/), against none
on the same model, seed and batch. A method that reports fewer saved bytes than none must not
have a higher tracked activation peak: the two columns may not tell opposite stories."""

import pytest
from conftest import conf_options

from memtrain import api
from memtrain.errors import ConfigError

TINY = ["dataset=synthetic", "dataset.image_size=32", "dataset.train_size=16",
        "dataset.test_size=8", "trainer=smoke", "trainer.max_steps=2", "trainer.batch_size=8",
        "trainer.eval_max_batches=1", "trainer.seed=0"]
METHODS = [m for m in conf_options("method") if m != "none"]
# budget plans need a feasible budget, which depends on the model: the exact uniform schedule
# runs everywhere (budget plans have their own tests in test_checkpoint.py)
EXTRA = {"checkpoint": ["method.strategy=uniform"],
         "checkpoint+quantize": ["method.checkpoint.strategy=uniform",
                                 "method.checkpoint.profile_repeats=1"]}
_BASE: dict[str, dict] = {}


def _run(tmp_path, model: str, method: str) -> dict:
    row = api.run([f"model={model}", f"method={method}", *TINY, *EXTRA.get(method, [])],
                  out_dir=tmp_path / f"{model}_{method}")
    assert row["status"] == "ok", row.get("error")
    return row


# A stack's members run on every model in their own cases; the stack itself on one model of
# each kind (an MLP; a CNN with BatchNorm and ReLU), as its quantize-inside-checkpoint path is
# the slowest case on the CPU (resnet50: 377 s alone)
STACK_MODELS = ("mlp6", "resnet18")
CASES = [(method, model) for method in METHODS for model in conf_options("model")
         if "+" not in method or model in STACK_MODELS]


@pytest.mark.slow
@pytest.mark.parametrize("method,model", CASES)
def test_a_saving_in_saved_bytes_is_no_loss_in_activation_peak(tmp_path, model, method):
    if model not in _BASE:  # one baseline per model for the whole parametrisation
        _BASE[model] = _run(tmp_path, model, "none")
    try:
        row = _run(tmp_path, model, method)
    except ConfigError as e:  # a method may refuse a model or the CPU up front (offload)
        pytest.skip(f"{method} does not apply to {model}: {e}")
    base = _BASE[model]
    saved = row["mem_act_saved_bytes"] / base["mem_act_saved_bytes"]
    act = row["mem_peak_act_bytes"] / base["mem_peak_act_bytes"]
    if saved < 1:
        assert act <= 1, f"{method} on {model}: saved bytes x{saved:.3f} but act peak x{act:.3f}"
