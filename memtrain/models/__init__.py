"""Model builders. Each takes the data-derived `num_classes` and `input_shape` plus keyword
arguments that are exactly the keys of its conf/model/*.yaml; beside each, the chain rule of its
model type (`chain.py`: the segments methods checkpoint or cut between)."""

from memtrain.models.chain import Chain, Segment, chain_of
from memtrain.models.cnn import efficientnet_b0, resnet18, resnet34, resnet50
from memtrain.models.mlp import MLP, mlp6
from memtrain.models.resmlp import resmlp12, resmlp24
from memtrain.models.transformer import GPT, gpt2_small, gpt_nano, vit_b16, vit_tiny

__all__ = ["GPT", "MLP", "Chain", "Segment", "chain_of", "efficientnet_b0", "gpt2_small",
           "gpt_nano", "mlp6", "resmlp12", "resmlp24", "resnet18", "resnet34", "resnet50",
           "vit_b16", "vit_tiny"]
