"""Model builders. Each takes the data-derived `num_classes` and `input_shape` plus keyword
arguments that are exactly the keys of its conf/model/*.yaml; beside each, the chain rule of its
model type (`chain.py`: the segments methods checkpoint or cut between). Models by name from a
library's registry (`vision.py`: timm, torchvision; `hf.py`: transformers) and the user's own
module (`user.py`) are built offline (`memtrain.config.offline`), on fake tensors where the
estimate asks (`fake.py`)."""

from memtrain.models.chain import Chain, Segment, chain_of
from memtrain.models.cnn import efficientnet_b0, resnet18, resnet34, resnet50
from memtrain.models.hf import hf_model
from memtrain.models.mlp import MLP, mlp6
from memtrain.models.resmlp import resmlp12, resmlp24
from memtrain.models.transformer import GPT, gpt2_small, gpt_nano, vit_b16, vit_tiny
from memtrain.models.user import user_module
from memtrain.models.vision import timm_model, torchvision_model

__all__ = ["GPT", "MLP", "Chain", "Segment", "chain_of", "efficientnet_b0", "gpt2_small",
           "gpt_nano", "hf_model", "mlp6", "resmlp12", "resmlp24", "resnet18", "resnet34",
           "resnet50", "timm_model", "torchvision_model", "user_module", "vit_b16", "vit_tiny"]
