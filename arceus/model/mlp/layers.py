"""An MLP's layers: Linear, then the activation on every layer but the last."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from arceus.model.mlp.spec import MLPSpec
from arceus.model.torch_layers import ACTIVATION_FUNCTIONS, init_like_torch


class MLPLayer(nn.Module):
    """Linear, optionally followed by an activation; parameters named `weight` and `bias` like nn.Linear."""

    def __init__(
        self, in_features: int, out_features: int, activation: str | None, generator: torch.Generator
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        init_like_torch(self.weight, self.bias, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return ACTIVATION_FUNCTIONS[self.activation](y) if self.activation else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}"
        )


def mlp_layer(spec: MLPSpec, index: int, generator: torch.Generator) -> MLPLayer:
    """Layer `index`, initialised from `generator` only."""
    last = index == spec.num_layers - 1
    return MLPLayer(
        spec.layer_sizes[index], spec.layer_sizes[index + 1], None if last else spec.activation, generator
    )
