"""Module surgery shared by the methods: swap submodules, recast one as another class."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def swap_modules(model: nn.Module, match: Callable[[str, nn.Module], bool],
                 make: Callable[[str, nn.Module], nn.Module]) -> list[str]:
    """Replace every submodule for which `match(qualified_name, module)` holds with
    `make(qualified_name, module)`, in place; returns the names replaced.

    The walk collects first and swaps afterwards, so a replacement is never itself visited.
    """
    targets = [(name, mod) for name, mod in model.named_modules() if name and match(name, mod)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(name, mod))
    return [name for name, _ in targets]


def recast(module: nn.Module, cls: type, **attrs) -> nn.Module:
    """A `cls` instance sharing `module`'s parameters, buffers and settings (same state_dict
    keys, same Parameter objects) plus `attrs`."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    new.__dict__.update(attrs)
    return new


def is_hf_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's linear layers: y = x @ W + b, W stored [in, out])."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith(
        "transformers.")


def is_timm_conv2d_same(module: nn.Module) -> bool:
    """timm's Conv2dSame (TensorFlow's "SAME": the input padded per call, asymmetric where the
    size needs it, then an unpadded convolution; create_conv2d's choice where padding depends
    on the input size)."""
    return type(module).__name__ == "Conv2dSame" and type(module).__module__.startswith("timm.")


def is_timm_cond_conv2d(module: nn.Module) -> bool:
    """timm's CondConv2d (create_conv2d's choice with num_experts > 0: EfficientNet-CondConv,
    CoAtNet's cc variants): each sample's kernel mixed from `num_experts` kernels by routing
    weights it is called with, then one grouped convolution over the batch (groups x B), the
    input padded per call where `dynamic_padding` says so."""
    return type(module).__name__ == "CondConv2d" and type(module).__module__.startswith("timm.")


def cond_conv_kernels(module: nn.Module, routing_weights: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A CondConv2d call's kernels and biases as its forward mixes them, in autograd: each
    sample's from the experts by its routing weights, stacked for one convolution grouped by
    sample ([n * out, in / groups, kh, kw] and [n * out])."""
    n = routing_weights.shape[0]
    weight = torch.matmul(routing_weights, module.weight).view(
        n * module.out_channels, module.in_channels // module.groups, *module.kernel_size)
    bias = None if module.bias is None else torch.matmul(routing_weights, module.bias).view(-1)
    return weight, bias


def is_linear(module: nn.Module) -> bool:
    """An nn.Linear computing F.linear(x, weight, bias) and nothing else: nn.Linear itself, or
    timm's Linear (its classifier heads; it differs only under TorchScript). Other subclasses
    (quantized or adapter layers) compute something else."""
    cls = type(module)
    return cls is nn.Linear or (cls.__name__ == "Linear" and cls.__module__.startswith("timm.")
                                and isinstance(module, nn.Linear))


def is_timm_bn_act(module: nn.Module) -> bool:
    """timm's BatchNormAct2d: nn.BatchNorm2d's forward, then its `drop` and `act` submodules."""
    return (type(module).__name__ == "BatchNormAct2d"
            and type(module).__module__.startswith("timm.")
            and isinstance(module, nn.BatchNorm2d))


def linear_of_conv1d(module: nn.Module) -> nn.Linear:
    """The nn.Linear that computes what a transformers Conv1D computes: its weight transposed
    (a copy, the same values), its bias the same Parameter."""
    nx, nf = module.weight.shape
    linear = nn.Linear.__new__(nn.Linear)  # no init of its own (fake tensors too)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = nx, nf
    with torch.no_grad():
        linear.weight = nn.Parameter(module.weight.t().contiguous(),
                                     requires_grad=module.weight.requires_grad)
    linear.register_parameter("bias", getattr(module, "bias", None))  # the same, or None
    return linear
