"""Every model (globbed from conf/model) exposes one chain, and both methods that cut a model read
it: a new model needs its builder, a chain rule for a new type, and its YAML, nothing else."""

import pytest
import torch
from conftest import language_model, own_models, shallow, tiny_data

from memtrain import api
from memtrain.methods.checkpoint.segments import discover
from memtrain.methods.synthetic import Synthetic
from memtrain.models import chain_of


def _model(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    # a transformer at two of its layers: a chain of more than one block, as at twelve
    data, model, _ = api.build([f"model={name}", *shallow(name), *tiny_data(name, image_size=32)])
    x, _ = next(data.train.batches(2, torch.device("cpu")))
    return model.eval(), x  # eval: no dropout or stochastic depth, BatchNorm's running stats


@pytest.mark.parametrize("name", own_models())  # a registered chain each
@pytest.mark.slow
def test_units_compose_to_the_forward_and_both_methods_read_them(name):
    model, x = _model(name)
    chain = chain_of(model)
    h = x
    with torch.no_grad():
        for unit in chain.units():
            h = unit(h)
        torch.testing.assert_close(h, model(x))
    # checkpoint's segments are the chain's, by name
    assert [s.name for s in discover(model)] == [s.name for s in chain.segments]
    # synthetic cuts between the same units and keeps the plain model's names under any cuts
    # (a language model has no classes to label: refused, test_transformers.py)
    if language_model(name):
        return
    keys = list(model.state_dict())
    n_units = len(chain.units())
    parts = Synthetic(partitions=2, cuts=[n_units // 2]).wrap(model)
    assert len(parts.units) == n_units
    assert list(parts.state_dict()) == keys
    with torch.no_grad():  # between cuts only the fixed standardisation is added
        assert parts(x).shape == model(x).shape
