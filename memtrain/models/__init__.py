"""Model builders. Each takes the data-derived `num_classes` and `input_shape` plus keyword
arguments that are exactly the keys of its conf/model/*.yaml; beside each, the chain rule of its
model type (`chain.py`: the segments methods checkpoint or cut between)."""

from memtrain.models.chain import Chain, Segment, chain_of
from memtrain.models.cnn import efficientnet_b0, resnet18, resnet34, resnet50
from memtrain.models.mlp import MLP, mlp6
from memtrain.models.resmlp import resmlp12, resmlp24

__all__ = ["MLP", "Chain", "Segment", "chain_of", "efficientnet_b0", "mlp6", "resmlp12",
           "resmlp24", "resnet18", "resnet34", "resnet50"]
