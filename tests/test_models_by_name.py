"""Models by name and the user's own module (memtrain/models/{vision,hf,user,offline,fake}.py).

Any timm architecture, torchvision classification model or transformers causal LM type by name,
offline with random weights; a module of the user's through the API (or a factory named by
MEMTRAIN_MODEL on the command line). Every method runs on them or refuses in one line, the
GPU-free estimate and find_max_batch work, and run_ids tell two models apart. Everything at
tiny sizes: timm and torchvision at 32 px, transformers with 2 layers of width 64, batch 2.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch
from conftest import ROOT, USER_FACTORY, conf_options, run_memtrain, shared_row
from torch import nn

from memtrain import api, record
from memtrain.config import loader, offline
from memtrain.errors import ConfigError
from memtrain.losses import cross_entropy
from memtrain.models import hf, user

IMAGES = ["dataset=synthetic", "dataset.image_size=32", "dataset.train_size=8",
          "dataset.test_size=4"]
TOKENS = ["dataset=tokens", "dataset.seq_len=16", "dataset.vocab_size=64",
          "dataset.train_size=8", "dataset.test_size=4"]
# One of each family (convolutional, attention-only, torchvision's, two decoders), each made
# small through its own keyword arguments (timm's depths and widths, torchvision's width_mult,
# transformers' sizes): a few hundred thousand parameters
MODELS = {
    "convnext": ["model=timm", "model.name=convnext_atto", "+model.kwargs.depths=[1,1,1,1]",
                 "+model.kwargs.dims=[16,32,64,128]", *IMAGES],
    "vit": ["model=timm", "model.name=vit_tiny_patch16_224", "+model.kwargs.depth=2",
            "+model.kwargs.embed_dim=64", "+model.kwargs.num_heads=2", *IMAGES],
    "torchvision": ["model=torchvision", "+model.kwargs.width_mult=0.25", *IMAGES],
    "llama": ["model=hf", "model.name=llama", "model.config.hidden_size=64", *TOKENS],
    "gpt2": ["model=hf", "model.name=gpt2", "model.config.hidden_size=64", *TOKENS],
}
STEPS = ["trainer=smoke", "trainer.batch_size=2", "trainer.max_steps=2", "trainer.warmup_steps=1",
         "trainer.eval_max_batches=1", "trainer.device=cpu", "trainer.threads=1"]
ESTIMATE = [*STEPS, "trainer.max_steps=0", "trainer.estimate=true"]  # built, applied, estimated


class TinyNet(nn.Module):
    """A user's module, defined here: conv-ReLU, pooling, linear."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        return self.fc(self.conv(x))


# ---------------------------------------------------------------- built offline, trained whole


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_built_from_the_data_offline_and_every_param_trains(name):
    data, net, _ = api.build(MODELS[name])
    x, y = next(data.train.batches(2, torch.device("cpu")))
    out = net(x)
    assert out.shape == ((2, 16, 64) if data.task == "lm" else (2, 10))
    cross_entropy(out, y).backward()
    assert not [n for n, p in net.named_parameters() if p.requires_grad and p.grad is None]
    assert all(os.environ[k] == "1" for k in offline.OFFLINE_ENV)  # the hub clients: offline
    if name == "vit":  # the architecture takes the data's size: 32 px, 2x2 patches of 16
        assert net.patch_embed.img_size == (32, 32) and net.patch_embed.num_patches == 4


@pytest.mark.slow
def test_the_data_sets_channels_and_sizes_the_config_names():
    _, tv, _ = api.build(["model=torchvision", *IMAGES, "dataset.channels=1"])
    stem = next(m for m in tv.modules() if isinstance(m, nn.Conv2d))
    assert stem.in_channels == 1
    _, timm_net, _ = api.build(["model=timm", "+model.kwargs.drop_path_rate=0.1", *IMAGES,
                                "dataset.channels=1", "dataset.num_classes=7"])
    assert timm_net.stem[0].in_channels == 1 and timm_net.head.fc.out_features == 7
    assert max(b.drop_path.drop_prob for s in timm_net.stages for b in s.blocks
               if hasattr(b.drop_path, "drop_prob")) == pytest.approx(0.1)


def test_hf_sizes_are_derived_unless_given_and_mapped_to_each_type():
    transformers = pytest.importorskip("transformers")
    llama = transformers.AutoConfig.for_model("llama")
    # llama's head size 128, MLP ratio 11008 / 4096: at width 256, 2 heads, MHA, MLP 688
    assert hf.sizes("llama", llama, {"hidden_size": 256, "num_attention_heads": None}) == {
        "hidden_size": 256, "num_attention_heads": 2, "head_dim": 128,
        "num_key_value_heads": 2, "intermediate_size": 688}
    gpt2 = transformers.AutoConfig.for_model("gpt2")  # head size 64, n_inner None (4x)
    assert hf.sizes("gpt2", gpt2, {"hidden_size": 128, "num_key_value_heads": None,
                                   "intermediate_size": 256}) == {
        "hidden_size": 128, "num_attention_heads": 2, "n_inner": 256}
    data, net, _ = api.build(MODELS["gpt2"])
    assert (net.lm.config.n_embd, net.lm.config.n_layer, net.lm.config.n_head) == (64, 2, 1)
    assert net.lm.config.vocab_size == 64 and net.lm.config.n_positions == 16
    for given, keys in [({"hidden_size": 96, "num_attention_heads": 5},
                         "hidden_size=96 is not a multiple of model.config.num_attention_heads=5"),
                        ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3},
                         "num_key_value_heads=3 must divide model.config.num_attention_heads=4"),
                        ({"hidden_size": 64, "num_key_value_head": 2},
                         "no such key; closest: num_key_value_heads")]:
        with pytest.raises(ConfigError, match=keys):
            hf.sizes("llama", llama, given)


# ---------------------------------------------------------------- bad input, in one line


@pytest.mark.parametrize("args,match", [
    (["model=timm", "model.name=convnext_atoo"], "no such model in timm .*closest: convnext_atto"),
    (["model=torchvision", "model.name=resnet19"], "closest: resnet18"),
    (["model=hf", "model.name=lama"], "no such model in transformers' model types.*llama"),
    (["model=hf", "model.name=t5"], "t5 has no causal LM class"),
    (["model=timm", "model.name=resnet50.a1_in1k"], "a tag only chooses pretrained weights"),
    (["-m", "model=timm", "model.name=resnet18,resnt50"], "closest: resnet50"),
    (["model=hf", "+model.config.vocab_size=9"], "set by the run .dataset.vocab_size"),
])
def test_a_name_or_key_that_does_not_exist_is_one_line(in_tmp, cli_checks, args, match):
    p = cli_checks(*args, *IMAGES[:2])
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert re.search(match, p.stderr), p.stderr
    assert not (in_tmp / "runs").exists()


@pytest.mark.slow
def test_without_transformers_model_hf_says_how_to_install(in_tmp, cli_checks, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    p = cli_checks("model=hf")
    assert p.returncode == 2 and "pip install 'memtrain[hf]'" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match=r"needs transformers.*memtrain\[hf\]"):
        hf.hf_model(64, (16,), "llama", {})


@pytest.mark.slow
def test_an_image_size_the_architecture_cannot_take_is_refused():
    with pytest.raises(ConfigError, match="model.name=convnext_atto cannot take 16x16 images: "
                                          ".*made for 224x224 .dataset.image_size=224"):
        api.build(["model=timm", *IMAGES, "dataset.image_size=16"])
    with pytest.raises(ConfigError, match="model=timm classifies images"):
        api.build(["model=timm", *TOKENS])


# ---------------------------------------------------------------- every method, one line or ok


# What each method does on these models: runs, or refuses in one line with this reason.
# checkpoint and synthetic find the chain of blocks where no rule is registered
# (tests/test_chains.py); synthetic cuts where nothing runs outside the chain (timm's ConvNeXt,
# run in test_chains.py; not torchvision's MobileNetV3, which flattens in its forward); pool
# needs a convolution,
# ReLU or max-pool beyond the input's; prune, a Linear or 1x1 convolution whose input its
# blocks would free (at these sizes a ViT's rows, batch 2 x 5 tokens, are fewer than a block;
# MobileNet's 1x1 convolutions read inputs that other ops keep); offload, a GPU (on any
# model); synthetic, class labels.
PRUNES_NOTHING = "method=prune prunes nothing in {}"
REFUSED = {
    ("synthetic", "llama"): "method=synthetic trains each partition to predict synthetic labels",
    ("synthetic", "gpt2"): "method=synthetic trains each partition to predict synthetic labels",
    ("pool", "vit"): "VisionTransformer has none of these .* it would change nothing",
    ("pool", "llama"): "it would change nothing",
    ("pool", "gpt2"): "it would change nothing",
    ("prune", "vit"): PRUNES_NOTHING.format("VisionTransformer"),
    ("prune", "torchvision"): PRUNES_NOTHING.format("MobileNetV3"),
    ("offload", "llama"): "nothing to offload to",
}
# Run for real (two steps, the acceptance's pairs: quantize saves against none on every family,
# pool on a convolutional one), or built, applied and estimated on fake tensors (none on every
# family: each builds there; the other methods where they run). timm's VisionTransformer under
# synthetic and the stack is memtrain's vit_tiny's class, walked in tests/walker.py.
MEASURED = [(m, n) for n in MODELS for m in ("none", "quantize")] + [("pool", "convnext")]
ESTIMATED = [("none", n) for n in MODELS] + [
    ("pool", "torchvision"), ("synthetic", "torchvision"), ("prune", "convnext"),
    ("prune", "llama"), ("prune", "gpt2"),
    *[("checkpoint", n) for n in MODELS], ("checkpoint+quantize", "convnext")]


@pytest.mark.parametrize("method,model", sorted(REFUSED))
def test_a_method_that_cannot_run_refuses_in_one_line(tmp_path, method, model):
    with pytest.raises(ConfigError, match=REFUSED[method, model]) as e:
        if method in ("prune", "offload"):  # prune plans on a batch; offload sees the device
            api.run([f"method={method}", *MODELS[model], *ESTIMATE], out_dir=tmp_path / "r")
        else:  # the others refuse where they wrap the model
            api.build([f"method={method}", *MODELS[model]])
    assert "\n" not in str(e.value)


_ROWS: dict[tuple[str, str, str], dict] = {}


def _row(tmp_path_factory, method: str, model: str, level: str) -> dict:
    """A run's row, kept for the worker; none's, every case's baseline, for both workers."""
    if (method, model, level) not in _ROWS:
        size = STEPS if level == "measured" else ESTIMATE

        def make() -> dict:
            return api.run([f"method={method}", *MODELS[model], *size],
                           out_dir=tmp_path_factory.mktemp(f"{method}_{model}"))
        _ROWS[method, model, level] = shared_row(("by_name", method, model, level), make) \
            if method == "none" else make()
    row = _ROWS[method, model, level]
    assert row["status"] == "ok", row.get("error")
    return row


@pytest.mark.slow
@pytest.mark.parametrize("method,model", MEASURED)
def test_quantize_and_pool_save_against_none(tmp_path_factory, method, model):
    row = _row(tmp_path_factory, method, model, "measured")
    none = _row(tmp_path_factory, "none", model, "measured")
    if method != "none":
        assert row["mem_act_saved_bytes"] < none["mem_act_saved_bytes"]
        assert row["mem_peak_act_bytes"] < none["mem_peak_act_bytes"], (
            row["mem_peak_act_bytes"], none["mem_peak_act_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("method,model", ESTIMATED)
def test_the_estimate_builds_each_family_on_fake_tensors(tmp_path_factory, method, model):
    row = _row(tmp_path_factory, method, model, "estimated")
    assert "mem_estimate_error" not in row and row["mem_estimate_act_bytes"] > 0
    none = _row(tmp_path_factory, "none", model, "estimated")
    if method != "none":  # the method's own step, not none's
        assert row["mem_estimate_act_bytes"] < none["mem_estimate_act_bytes"]


def test_every_method_and_model_is_walked():
    """Every (method, model) pair is refused or runs above, or is a pair the walker holds."""
    walked = {*REFUSED, *MEASURED, *ESTIMATED}
    elsewhere = {("synthetic", "vit"), ("synthetic", "convnext"), ("checkpoint+quantize", "vit"),
                 *{("offload", m) for m in MODELS if m != "llama"},
                 *{("checkpoint+quantize", m) for m in ("torchvision", "llama", "gpt2")}}
    assert walked | elsewhere == {(m, n) for m in conf_options("method") for n in MODELS}


def test_prune_finds_transformers_conv1d():
    _, net, method = api.build(["method=prune", "method.block_size=16", *MODELS["gpt2"]])
    assert not [m for m in net.modules() if type(m).__name__ == "Conv1D"]
    assert len(method.pruned) == 8  # 2 layers x (c_attn, attn c_proj, c_fc, mlp c_proj)


# ---------------------------------------------------------------- the estimate, two ways


@pytest.mark.slow
def test_timm_resnet50_is_estimated_as_memtrains_own(tmp_path):
    """The same network two ways (timm's ResNet-50 and memtrain's, torchvision's, at 64 px: the
    ImageNet stem both; below 64 px memtrain's takes a CIFAR stem): estimates within 1%
    (parameters and activations to the byte)."""
    common = ["dataset.image_size=64", "dataset.train_size=8", "dataset.test_size=4", *ESTIMATE]
    a = api.run(["model=timm", "model.name=resnet50", *common], out_dir=tmp_path / "timm")
    b = api.run(["model=resnet50", *common], out_dir=tmp_path / "own")
    assert a["params"] == b["params"]
    assert a["mem_estimate_bytes"] == pytest.approx(b["mem_estimate_bytes"], rel=0.01)
    assert a["mem_estimate_act_bytes"] == b["mem_estimate_act_bytes"]


@pytest.mark.slow
def test_find_max_batch_on_a_transformers_model(tmp_path):
    cap = 0.02  # GiB: a few dozen sequences of 16 tokens
    row = api.run([*MODELS["llama"], *ESTIMATE, "trainer.estimate=false",
                   "trainer.find_max_batch=true", f"trainer.gpu_memory_gb={cap}",
                   "trainer.cuda_context_gb=0", "trainer.max_batch_headroom=0"],
                  out_dir=tmp_path / "r")
    assert row["status"] == "ok" and row["max_batch_size"] >= 1, row.get("error")


# ---------------------------------------------------------------- your own module


@pytest.mark.slow  # the command line's run: a memtrain process (its imports, ~5 s)
def test_the_api_runs_a_module_as_the_command_line_runs_its_factory(tmp_path):
    """api.sweep over a module defined here writes the job folders, rows and report of a sweep;
    its rows have the columns of the command line's run of the same net from a file
    (MEMTRAIN_MODEL), whose run_id is its own."""
    net = TinyNet()
    before = [p.detach().clone() for p in net.parameters()]
    common = ["dataset.train_size=8", "dataset.test_size=4", *STEPS]
    rows = api.sweep(common, model=net, methods=["none", "quantize"], out_dir=tmp_path / "api")
    assert [r["status"] for r in rows] == ["ok", "ok"], [r.get("error") for r in rows]
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # copies trained
    assert rows[1]["mem_act_saved_bytes"] < rows[0]["mem_act_saved_bytes"]
    assert (rows[0]["model"], rows[0]["model.name"]) == ("module", "TinyNet")
    for num, row in enumerate(rows):
        assert (tmp_path / "api" / f"{num}_{row['run_id']}" / record.SUMMARY).is_file()
    assert (tmp_path / "api" / "report.md").is_file()
    env = {"MEMTRAIN_MODEL": USER_FACTORY, "OMP_NUM_THREADS": "1"}
    p = run_memtrain("model=module", "method=quantize", *common,
                     f"hydra.run.dir={tmp_path / 'cli'}", cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    cli = json.loads((tmp_path / "cli" / record.SUMMARY).read_text())
    assert set(cli) == set(rows[1]) and cli["model.name"] == "make_net"
    assert cli["run_id"] != rows[1]["run_id"]


@pytest.mark.parametrize("reads_a_value", [False, True], ids=["meta", "reads-a-value"])
def test_a_run_of_probes_alone_makes_its_model_without_weights(tmp_path, monkeypatch,
                                                                reads_a_value):
    """trainer.max_steps=0 (the estimate alone): the run's own model is made on the meta device
    (no storage, no initialisation: a model larger than the machine's memory is estimated) and
    its estimate's on fake tensors; a model whose construction reads a tensor's value, which
    the meta device has not, is made as usual (and the row says why it has no estimate: fake
    tensors have no value either). Either way the row counts its parameters."""
    from torch._subclasses.fake_tensor import FakeTensor

    import memtrain.models

    made, mlp6 = [], memtrain.models.mlp6

    def recorded(*args, **kwargs):
        if reads_a_value:
            torch.tensor([1.0, 2.0]).sum().item()
        net = mlp6(*args, **kwargs)
        p = next(net.parameters())
        made.append("meta" if p.is_meta else "fake" if isinstance(p, FakeTensor) else "real")
        return net

    recorded.__module__ = mlp6.__module__  # memtrain's builder, recording what it made
    monkeypatch.setattr(memtrain.models, "mlp6", recorded)
    over = ["model=mlp6", "model.widths=[16,16,16,16,16]", "dataset=synthetic",
            "dataset.image_size=8", *ESTIMATE]
    row = api.run(over, out_dir=tmp_path)
    assert row["status"] == "ok", row.get("error")
    assert row["params"] == sum(p.numel() for p in mlp6(10, (3, 8, 8), widths=[16] * 5)
                                .parameters())
    if reads_a_value:  # nor have fake tensors a value: the row says why it has no estimate
        assert "DataDependentOutput" in row["mem_estimate_error"], row
        assert made == ["real"], made
    else:
        assert row["mem_estimate_bytes"] > 0
        assert made == ["meta", "fake"], made


@pytest.mark.slow
def test_two_modules_never_share_a_run_id(user_factory, monkeypatch, tmp_path):
    def rid(model=None):  # no model: the command line's model=module
        over = api.with_module(["method=none"], model) if model else ["model=module"]
        return loader.run_id(api.compose(over)[0])

    class Other(TinyNet):  # the same tree and shapes, another class
        pass

    net = TinyNet()
    ids = {rid(net), rid(TinyNet(width=16)), rid(Other()), rid(lambda: TinyNet(classes=5))}
    assert len(ids) == 4
    assert rid(net) == rid(TinyNet()) == rid(TinyNet)  # the same architecture: the same run
    # the command line's factories: a hash of the factory's name and source
    cli = rid()
    other = tmp_path / "mine.py"
    other.write_text((ROOT / "tests" / "user_model.py").read_text() + "\n# changed\n")
    monkeypatch.setenv("MEMTRAIN_MODEL", f"{other}:make_net")
    assert len({cli, rid(), *ids}) == 6
    # and by name: two timm models, two kwargs
    by_name = {loader.run_id(api.compose(o)[0]) for o in (
        ["model=timm"], ["model=timm", "model.name=resnet18"],
        ["model=timm", "+model.kwargs.drop_rate=0.1"])}
    assert len(by_name) == 3


@pytest.mark.slow
def test_each_run_starts_from_the_modules_weights_and_a_factory_is_called(tmp_path):
    net = TinyNet()
    common = ["dataset.train_size=8", "dataset.test_size=4", *STEPS, "trainer.estimate=false"]
    a = api.run(common, out_dir=tmp_path / "a", model=net)
    b = api.run(common, out_dir=tmp_path / "b", model=net)
    assert a["train_loss"] == b["train_loss"] and a["run_id"] == b["run_id"]
    calls = []

    def make(num_classes, input_shape, width=8):
        calls.append((num_classes, input_shape, width))
        return TinyNet(width, num_classes)

    row = api.run([*common, "+model.kwargs.width=4"], out_dir=tmp_path / "c", model=make)
    assert row["status"] == "ok" and row["params"] == sum(
        p.numel() for p in TinyNet(4).parameters())
    assert calls[-1] == (10, (3, 32, 32), 4)


def test_a_module_is_reached_only_through_the_api_or_the_environment(in_tmp, cli_checks,
                                                                      monkeypatch):
    monkeypatch.delenv("MEMTRAIN_MODEL", raising=False)
    with pytest.raises(ConfigError, match="model=module builds the nn.Module handed to "
                                          "memtrain.api.run.*neither is given"):
        api.build(["model=module"])
    with pytest.raises(ConfigError, match="model= of the API runs your module"):
        api.with_module(["model=resnet18"], TinyNet())
    monkeypatch.setenv("MEMTRAIN_MODEL", "nowhere.py:make")
    with pytest.raises(ConfigError, match="MEMTRAIN_MODEL=nowhere.py:make: no such file"):
        user.user_module(10, (3, 8, 8))
