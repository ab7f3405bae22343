"""A CNN's layers: Conv2d (same padding) + activation + MaxPool2d(2) per conv layer, then flatten + Linear."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from arceus.model.convnet.spec import ConvNetSpec, Shape

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}


class ConvLayer(nn.Module):
    """One conv layer; its parameters are `conv.weight` and `conv.bias`."""

    def __init__(
        self, in_shape: Shape, out_channels: int, kernel_size: int, activation: str, generator: torch.Generator
    ) -> None:
        super().__init__()
        self.in_shape = in_shape
        self.activation = activation
        self.conv = nn.Conv2d(in_shape[0], out_channels, kernel_size, padding=kernel_size // 2)
        _init_from(self.conv, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Layer 0 gets the dataset's flat rows; later layers get [B, C, H, W] already (a no-op).
        x = x.reshape(x.shape[0], *self.in_shape)
        return F.max_pool2d(_ACTIVATIONS[self.activation](self.conv(x)), 2)


class ConvNetHead(nn.Module):
    """Flatten + Linear to the logits; its parameters are `linear.weight` and `linear.bias`."""

    def __init__(self, in_features: int, classes: int, generator: torch.Generator) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, classes)
        _init_from(self.linear, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


def _init_from(module: nn.Conv2d | nn.Linear, generator: torch.Generator) -> None:
    """torch's default distribution for the module, drawn from `generator` instead of the global RNG, so a
    layer has the same weights on whichever stage builds it."""
    with torch.no_grad():
        nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
        bound = 1 / math.sqrt(module.weight[0].numel())  # 1/sqrt(fan_in)
        nn.init.uniform_(module.bias, -bound, bound, generator=generator)


def convnet_layer(spec: ConvNetSpec, index: int, generator: torch.Generator) -> nn.Module:
    """Layer `index`, initialised from `generator` only."""
    shapes = spec.shapes()
    if index == spec.num_layers - 1:
        return ConvNetHead(math.prod(shapes[-1]), spec.classes, generator)
    return ConvLayer(shapes[index], spec.channels[index], spec.kernel_size, spec.activation, generator)
