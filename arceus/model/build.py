"""Build torch modules for a range of a model's layers, identically wherever the range is cut.

Each layer draws its initial weights from its own generator seeded by (seed, layer_index) only, so
stage [1, 3) on one machine holds exactly the weights layers 1 and 2 have in the single-process model.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from arceus.model.gpt import gpt_layer
from arceus.model.spec import GPTSpec, ModelSpec

_SEED_STRIDE = 1_000_003  # a prime, so (seed, layer) pairs do not collide for any realistic depth
_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}


def layer_generator(seed: int, layer_index: int) -> torch.Generator:
    """The generator that initialises `layer_index`; depends on nothing else."""
    return torch.Generator().manual_seed((seed * _SEED_STRIDE + layer_index) % 2**63)


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
        # nn.Linear's default distribution, drawn from our generator instead of the global one.
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5), generator=generator)
            bound = 1 / math.sqrt(in_features)
            nn.init.uniform_(self.bias, -bound, bound, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return _ACTIVATIONS[self.activation](y) if self.activation else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}"
        )


def build_layers(spec: ModelSpec, start: int, end: int, seed: int) -> nn.Sequential:
    """Layers [start, end) of the model; children are named by their global layer index."""
    if not 0 <= start < end <= spec.num_layers:
        raise ValueError(f"layer range [{start}, {end}) is not inside the model's {spec.num_layers} layers")
    if isinstance(spec, GPTSpec):
        return nn.Sequential(
            OrderedDict((str(i), gpt_layer(spec, i, layer_generator(seed, i))) for i in range(start, end))
        )
    last = spec.num_layers - 1
    inputs, outputs = spec.layer_input_features(), spec.layer_output_features()
    layers = OrderedDict(
        (
            str(i),
            MLPLayer(inputs[i], outputs[i], None if i == last else spec.activation, layer_generator(seed, i)),
        )
        for i in range(start, end)
    )
    return nn.Sequential(layers)


def build_full_model(spec: ModelSpec, seed: int) -> nn.Sequential:
    """The single-process reference: every layer, initialised exactly as any split would be."""
    return build_layers(spec, 0, spec.num_layers, seed)


def global_param_name(local_name: str) -> str:
    """A `build_layers` parameter name ("2.weight") as its model-wide name ("layers.2.weight")."""
    return f"layers.{local_name}"


def named_global_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in module.named_parameters():
        yield global_param_name(name), param
