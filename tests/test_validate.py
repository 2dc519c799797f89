"""Malformed overrides: each fails before training with one line that names the problem.

Adding a case (a method's parameter, say) is one line in BAD: the overrides and the expected
message. Cases run in-process through the same checks as the CLI (`loader.check_overrides`, then
the job's own validation in `api.run`); a few go through the real command for the exit code,
the single stderr line and the missing traceback.
"""

import json

import pytest
from conftest import NO_REPORT, job_dir, run_memtrain

from memtrain import api
from memtrain.config import loader
from memtrain.errors import ConfigError

TINY = ["trainer=smoke", "model=mlp6", "dataset.image_size=8"]

BAD = [
    # unknown keys, groups and options
    (["trainer.batchsize=3"], "unknown option trainer.batchsize; did you mean trainer.batch_size?"),
    (["trainer.lr=0.1"], "unknown option trainer.lr; did you mean optim.lr?"),
    (["optim.momentun=0.5"], "unknown option optim.momentun; did you mean optim.momentum?"),
    (["optim.betas=[0.9,0.99]"], "unknown option optim.betas; optim has: optim.name, optim.lr"),
    (["foo=1"], "unknown option foo; the config has: dataset, optim, model, method, trainer"),
    (["model=resnet99"], "unknown model 'resnet99'; choose one of: efficientnet_b0"),
    (["model=convnext_atto"], "; or a library's model by name: model=timm|torchvision|hf "
                              "model.name=convnext_atto"),
    (["optim=adam"], "unknown optim 'adam'; choose one of: adamw, sgd; did you mean 'adamw'?"),
    (["trainer=smok"], "unknown trainer 'smok'; choose one of: default, smoke"),
    # wrong types and syntax
    (["trainer.batch_size=abc"], "trainer.batch_size must be an integer, got 'abc'"),
    (["trainer.batch_size=2.5"], "trainer.batch_size must be an integer, got 2.5"),
    (["trainer.compile=maybe"], "trainer.compile must be true or false, got 'maybe'"),
    (["model.widths=512"], "model.widths must be a list such as [1, 2], got 512"),
    (["trainer.batch_size=["], "cannot parse the override 'trainer.batch_size=['"),
    (['hydra.sweeper.variants=[method=none,"method=prune method.sparsity=0.5"]'],
     "quote each variant: 'hydra.sweeper.variants=[\"method=none\""),
    # out of range, with the valid range or choices
    (["trainer.batch_size=0"], "trainer.batch_size must be in [1, inf], got 0"),
    (["trainer.batch_size=100000"], "trainer.batch_size=100000 is larger than the training split"),
    (["trainer.epochs=0"], "trainer.epochs must be in [1, inf], got 0"),
    (["trainer.precision=fp8"],
     "trainer.precision must be one of fp32, bf16, fp16, bf16-true, got 'fp8'"),
    (["trainer.device=tpu"], "trainer.device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["trainer.fault=segfault"], "trainer.fault must be one of oom, nan, error, sigterm, hang"),
    (["trainer.gpu_memory_gb=0"], "trainer.gpu_memory_gb must be in (0, inf], got 0"),
    (["trainer.save_every=-1"], "trainer.save_every must be in [0, inf], got -1"),
    (["optim.lr=-1"], "optim.lr must be in (0, 3.4e+38], got -1"),
    (["optim.schedule=linear"], "optim.schedule must be one of cosine, step, constant"),
    (["dataset.num_classes=1"], "dataset.num_classes must be >= 2, got 1"),
    (["model.widths=[8,8]"], "model.widths must list 5 positive hidden widths"),
    # image size too small for a model
    (["dataset.image_size=2"], "dataset.image_size must be >= 4 for synthetic, got 2"),
    (["model=resnet18", "model.small_input=false"], "needs images of >= 32 px, got 8x8"),
    (["model=resmlp12", "dataset.image_size=10"], "model.patch_size=4 must divide the image"),
    (["model=efficientnet_b0", "dataset.image_size=4"], "needs images of >= 8 px, got 4x4"),
    # missing dataset folders name the path tried
    (["dataset=cifar10", "dataset.data_dir=/nonexistent/cifar"],
     "dataset cifar10 not found (looked in /nonexistent/cifar)"),
    (["dataset=imagenet", "dataset.data_dir=/nonexistent/inet"],
     "dataset imagenet not found (looked in /nonexistent/inet/train"),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[" ".join(b[0]) for b in BAD])
@pytest.mark.slow
def test_malformed_override_is_one_line(in_tmp, overrides, expected):
    args = [*TINY, *overrides]
    with pytest.raises(ConfigError) as e:
        loader.check_overrides(args)
        api.run(args, out_dir=in_tmp / "r")
    msg = str(e.value)
    assert expected in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("overrides,expected", [
    (["trainer.batchsize=3"], "memtrain: error: unknown option trainer.batchsize; did you mean "
                              "trainer.batch_size?"),  # make test-fast: the core claim
    pytest.param(["trainer.batch_size=abc"], "memtrain: error: trainer.batch_size must be an "
                 "integer", marks=pytest.mark.slow),
    pytest.param(["trainer.gpu_memory_gb=-2"], "memtrain: error: trainer.gpu_memory_gb must be "
                 "in (0, inf]", marks=pytest.mark.slow),
])
def test_cli_exits_2_with_one_line(in_tmp, overrides, expected):
    p = run_memtrain(*TINY, *overrides, cwd=in_tmp, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().startswith(expected), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stdout + p.stderr


@pytest.mark.slow
def test_hydra_verbose_shows_the_traceback(in_tmp):
    p = run_memtrain(*TINY, "trainer.batchsize=3", "hydra.verbose=true", cwd=in_tmp, timeout=300)
    assert p.returncode == 2 and "Traceback" in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("memtrain: error: unknown option")


@pytest.mark.slow
def test_bad_value_in_a_multirun_is_that_jobs_row(in_tmp):
    p = run_memtrain("-m", *TINY, "trainer.batch_size=0,8", "hydra.sweep.dir=sw", NO_REPORT,
                     cwd=in_tmp, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads((job_dir(in_tmp / "sw", i) / "summary.json").read_text()) for i in (0, 1)]
    assert rows[0]["status"] == "error"
    assert rows[0]["error"] == "trainer.batch_size must be in [1, inf], got 0"
    assert rows[1]["status"] == "ok"
    assert "memtrain: 2 jobs: ok 1, error 1" in p.stdout


def test_method_sweep_checks_keys_against_each_option():
    from hydra import compose

    from memtrain.config import validate

    seen = []
    with loader.session():
        validate.check_values(validate.parse(["trainer=default,smoke", "trainer.batch_size=3"]),
                              lambda o: seen.append(o) or compose("config", overrides=o))
    assert sorted(seen) == [["trainer=default"], ["trainer=smoke"]]
