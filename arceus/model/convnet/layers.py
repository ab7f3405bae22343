"""A CNN's layers: Conv2d (same padding) + activation + MaxPool2d(2) per conv layer, then flatten + Linear."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from arceus.model.convnet.spec import ConvNetSpec, Shape
from arceus.model.torch_layers import ACTIVATION_FUNCTIONS, init_like_torch


class ConvLayer(nn.Module):
    """One conv layer; its parameters are `conv.weight` and `conv.bias`."""

    def __init__(
        self, in_shape: Shape, out_channels: int, kernel_size: int, activation: str, generator: torch.Generator
    ) -> None:
        super().__init__()
        self.in_shape = in_shape
        self.activation = activation
        self.conv = nn.Conv2d(in_shape[0], out_channels, kernel_size, padding=kernel_size // 2)
        init_like_torch(self.conv.weight, self.conv.bias, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Layer 0 gets the dataset's flat rows; later layers get [B, C, H, W] already (a no-op).
        x = x.reshape(x.shape[0], *self.in_shape)
        return F.max_pool2d(ACTIVATION_FUNCTIONS[self.activation](self.conv(x)), 2)


class ConvNetHead(nn.Module):
    """Flatten + Linear to the logits; its parameters are `linear.weight` and `linear.bias`."""

    def __init__(self, in_features: int, classes: int, generator: torch.Generator) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, classes)
        init_like_torch(self.linear.weight, self.linear.bias, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


def convnet_layer(spec: ConvNetSpec, index: int, generator: torch.Generator) -> nn.Module:
    """Layer `index`, initialised from `generator` only."""
    shapes = spec.shapes()
    if index == spec.num_layers - 1:
        return ConvNetHead(math.prod(shapes[-1]), spec.classes, generator)
    return ConvLayer(shapes[index], spec.channels[index], spec.kernel_size, spec.activation, generator)
