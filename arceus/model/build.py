"""Build torch modules for a range of a model's layers, identically wherever the range is cut.

Each layer draws its initial weights from its own generator (`arceus.model.seeding`), so any split of the
model starts from exactly the weights of the single-process model. The architecture's own layers come
from the registry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from torch import nn

from arceus.model.registry import architecture_of
from arceus.model.seeding import layer_generator
from arceus.model.spec import ModelSpec


def build_layer(spec: ModelSpec, index: int, seed: int) -> nn.Module:
    """Layer `index` of the model, initialised from (seed, index) only."""
    return architecture_of(spec).build_layer(spec, index, layer_generator(seed, index))


def build_layers(spec: ModelSpec, start: int, end: int, seed: int) -> nn.Sequential:
    """Layers [start, end); children are named by their global layer index."""
    if not 0 <= start < end <= spec.num_layers:
        raise ValueError(f"layer range [{start}, {end}) is not inside the model's {spec.num_layers} layers")
    return nn.Sequential(OrderedDict((str(i), build_layer(spec, i, seed)) for i in range(start, end)))


def build_full_model(spec: ModelSpec, seed: int) -> nn.Sequential:
    """The single-process reference: every layer, initialised exactly as any split would be."""
    return build_layers(spec, 0, spec.num_layers, seed)


def global_param_name(local_name: str) -> str:
    """A `build_layers` parameter name ("2.weight") as its model-wide name ("layers.2.weight")."""
    return f"layers.{local_name}"


def named_global_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in module.named_parameters():
        yield global_param_name(name), param
