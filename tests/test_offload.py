"""method=offload on the CPU: the run is refused in one line; the pack/unpack and prefetch logic
run with `HostMover` (host copies of CPU tensors) and a recording mover in place of CUDA's."""

import contextlib

import pytest
import torch
from conftest import conf_options, shallow, tiny_data
from torch import nn

from memtrain import api
from memtrain.errors import ConfigError
from memtrain.losses import cross_entropy
from memtrain.memory import measure
from memtrain.methods.offload import HostMover, Offloader, OffloadMethod
from memtrain.methods.quantize import ActivationQuantizer
from memtrain.run import runner

# make test-compat runs this file on the oldest torch: saved-tensor hooks
pytestmark = pytest.mark.compat

TINY = ["dataset=synthetic", "dataset.image_size=16", "dataset.train_size=8",
        "dataset.test_size=8", "trainer=smoke", "trainer.max_steps=1", "trainer.batch_size=2"]


class Recording(HostMover):
    """HostMover that logs what it moves, by the host tensor's position in the forward."""

    def __init__(self):
        super().__init__("cpu")
        self.log: list[tuple[str, int]] = []
        self._ids: dict[int, int] = {}

    def to_host(self, t):
        host = super().to_host(t)
        self._ids[id(host)] = len(self._ids)
        self.log.append(("host", self._ids[id(host)]))
        return host

    def to_device(self, host):
        self.log.append(("fetch", self._ids[id(host)]))
        return super().to_device(host)

    def prefetch(self, host):
        self.log.append(("prefetch", self._ids[id(host)]))
        return self._ids[id(host)], super().to_device(host)

    def wait(self, ticket):
        self.log.append(("wait", ticket[0]))
        return ticket[1]


def _mlp(depth: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(32, 32), nn.Tanh())])


def _grads(model: nn.Module, x: torch.Tensor, hooks=None) -> list[torch.Tensor]:
    model.zero_grad()
    if hooks is None:
        model(x).square().sum().backward()
    else:
        with hooks:
            out = model(x)
        out.square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("prefetch", [False, True])
def test_offload_is_lossless_and_brings_every_tensor_back_once(prefetch):
    model, x = _mlp(), torch.randn(4, 32)
    mover = Recording()
    assert all(torch.equal(a, b) for a, b in
               zip(_grads(model, x), _grads(model, x, Offloader(mover, 0, prefetch))))
    moved = [i for what, i in mover.log if what == "host"]
    back = sorted(i for what, i in mover.log if what in ("fetch", "wait"))
    assert moved and back == moved  # each tensor to the host once, back once
    fetched = [i for what, i in mover.log if what == "fetch"]
    if not prefetch:
        assert fetched == sorted(moved, reverse=True)  # backward's order: last saved first
        return
    # with prefetch only backward's first tensor is fetched on demand; every other one was
    # started while the one after it was in use, and waited for when needed
    assert fetched == [max(moved)]
    log = mover.log[len(moved):]
    for i in moved[:-1]:
        assert log.index(("prefetch", i)) < log.index(("wait", i))
        assert log.index(("prefetch", i)) > log.index(("fetch" if i + 1 == max(moved)
                                                       else "wait", i + 1))


def test_small_tensors_parameters_and_the_input_stay():
    model, x = _mlp(2), torch.randn(4, 32)
    mover = Recording()
    saver = Offloader(mover, min_bytes=4 * 32 * 4 + 1)  # bigger than every activation
    _grads(model, x, saver)
    assert mover.log == []
    mover = Recording()
    _grads(model, x.requires_grad_(), Offloader(mover))
    assert len([e for e in mover.log if e[0] == "host"]) == 2  # the Tanh outputs: no weights


def test_a_storage_saved_twice_is_offloaded_once():
    a = torch.randn(8, 8, requires_grad=True)
    mover = Recording()
    with Offloader(mover):
        h = a * 2
        out = (h * h).sum()  # mul saves h twice (self and other)
    out.backward()
    assert [e for e in mover.log if e[0] == "host"] == [("host", 0)]
    torch.testing.assert_close(a.grad, 8 * a.detach())


def test_around_quantize_it_moves_the_quantized_bytes_and_accounting_sees_host_bytes():
    """Offload outer, quantize inner: the host copies are the packed uint8 buffers, and the
    accounting of a GPU run (here: told the run is on cuda) files them as host bytes."""
    model, x = _mlp(), torch.randn(64, 32)
    plain = measure.SavedBytes(measure.alive_before_step(model, x), torch.device("cuda"))
    with plain:
        model(x)
    mover = Recording()
    saved = measure.SavedBytes(measure.alive_before_step(model, x), torch.device("cuda"))
    with saved, Offloader(mover), ActivationQuantizer(4, 256):
        model(x).sum().backward()
    assert saved.bytes == 0 and 0 < saved.host_bytes < plain.host_bytes / 4
    assert [e for e in mover.log if e[0] == "host"]  # the offloader moved the packed buffers
    assert plain.bytes == 0  # on a "cuda" run, CPU storages are host memory, not device memory


def test_on_the_cpu_the_run_is_one_line_before_training(tmp_path):
    with pytest.raises(ConfigError, match="nothing to offload to") as e:
        api.run(["model=mlp6", "method=offload", *TINY], out_dir=tmp_path / "r")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r" / "metrics.csv").read_text().strip().splitlines()[1:]


@pytest.mark.parametrize("model", conf_options("model"))
@pytest.mark.slow
def test_every_model_trains_the_same_with_offload(model, user_factory):
    """Registry-wide: forward and backward of every model with its saved tensors through the
    offloader (host copies on the CPU) give none's gradients, bit for bit (a transformer at two
    of its layers: the same hooks on every layer)."""
    trainer = [o for o in TINY if not o.startswith("dataset")]
    cfg, _ = api.compose([f"model={model}", *shallow(model), *tiny_data(model), *trainer])
    data = runner.build_data(cfg)
    x, y = next(iter(data.train.batches(2, torch.device("cpu"))))
    grads = []
    for hooks in (None, Offloader(HostMover("cpu"), min_bytes=0)):
        torch.manual_seed(0)
        net = runner.make_model(cfg, data)[0].train()
        with hooks or contextlib.nullcontext():
            out = net(x)
        cross_entropy(out, y).backward()
        grads.append([p.grad for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("kwargs,match", [({"min_bytes": -1}, "method.min_bytes"),
                                          ({"prefetch": "yes"}, "true or false")])
def test_bad_options_are_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        OffloadMethod(**kwargs)


@pytest.mark.slow  # two estimates on fake tensors
@pytest.mark.parametrize("min_kib", [64, 129])
def test_the_estimate_counts_what_stays_on_the_card(min_kib):
    """The GPU-free estimate (fake tensors, the CPU standing in for the card; memtrain-willfit's
    offload rows): a host copy is none of the card's memory. On mlp6 the saved bytes none keeps
    are every hidden ReLU output (4 x batch x width bytes, one storage with the next Linear's
    input) and the logits' few bytes; offload keeps on the card those below `min_bytes`, a count
    by hand, and its activation peak falls with them."""
    from memtrain.config import loader
    from memtrain.optim import build_optimizer
    from memtrain.preflight import build_data, kwargs_of
    from memtrain.run import estimate

    batch, est = 64, {}
    for method in ("none", "offload"):
        cfg, _ = loader.compose(["model=mlp6", f"method={method}", "dataset.image_size=16",
                                 *([f"method.min_bytes={min_kib * 1024}"] * (method != "none"))])
        data, optim = build_data(cfg), kwargs_of(cfg.optim)
        est[method] = estimate.estimate_peak(
            lambda c=cfg, d=data: runner.make_model(c, d),
            lambda m, o=optim: build_optimizer(m, **o), data.input_shape, data.num_classes, batch)
    net = runner.make_model(cfg, data)[0]
    hidden = [4 * batch * m.out_features for m in net.modules() if isinstance(m, nn.Linear)][:-1]
    moved = sum(b for b in hidden if b >= min_kib * 1024)
    if min_kib == 64:  # every hidden output is at least 64 KiB at this batch
        assert moved == sum(hidden)
    else:  # 129 KiB keeps the 256-wide ones on the card
        assert 0 < moved < sum(hidden)
    assert est["offload"]["mem_estimate_saved_bytes"] == \
        est["none"]["mem_estimate_saved_bytes"] - moved
    assert est["offload"]["mem_estimate_act_bytes"] < est["none"]["mem_estimate_act_bytes"]
