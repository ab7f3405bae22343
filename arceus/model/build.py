"""Build torch modules for a range of a model's layers, identically wherever the range is cut.

Each layer draws its initial weights from its own generator (`arceus.model.seeding`), so any split of the
model starts from exactly the weights of the single-process model. Each architecture's torch layers are named
in `LAYERS`, beside its torch-free entry in the registry (`arceus.model.registry.ARCHITECTURES`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from arceus.model.convnet.layers import convnet_layer
from arceus.model.gpt import parallel as gpt_parallel
from arceus.model.gpt.layers import gpt_layer
from arceus.model.llama import parallel as llama_parallel
from arceus.model.llama.layers import llama_layer
from arceus.model.mlp.layers import mlp_layer
from arceus.model.seeding import layer_generator
from arceus.model.sharding import AllReduce, Shard, ShardRows
from arceus.model.spec import ModelSpec


@dataclass(frozen=True)
class TensorParallelLayers:
    """An architecture's layers split over the ranks of a tensor-parallel group (the registry's
    `TensorParallelSplit` says whether a size fits)."""

    # Rank `shard.rank`'s part of split layer `index`, holding exactly its slice of the unsplit layer's
    # initial weights, computing through `all_reduce`.
    build_layer: Callable[[Any, int, torch.Generator, Shard, AllReduce], nn.Module]
    # (dim, indices) of a rank's part of an unsplit parameter, or None where it is replicated.
    shard_rows: ShardRows


@dataclass(frozen=True)
class ArchitectureLayers:
    # Layer `index` of the model, initialised from `generator` only.
    build_layer: Callable[[Any, int, torch.Generator], nn.Module]
    tensor_parallel: TensorParallelLayers | None = None


def _exported_layer(spec: Any, index: int, generator: torch.Generator) -> nn.Module:
    # Imported on first use: torch.export (and sympy beneath it) doubles the start-up CPU of every agent and
    # driver, and only exported models need it.
    from arceus.model.exported.layers import exported_layer

    return exported_layer(spec, index, generator)


# model_config.type -> its torch layers; the same keys as the registry's ARCHITECTURES.
LAYERS: dict[str, ArchitectureLayers] = {
    "mlp": ArchitectureLayers(mlp_layer),
    "transformer": ArchitectureLayers(
        gpt_layer, TensorParallelLayers(gpt_parallel.parallel_layer, gpt_parallel.shard_rows)
    ),
    "convnet": ArchitectureLayers(convnet_layer),
    "llama": ArchitectureLayers(
        llama_layer, TensorParallelLayers(llama_parallel.parallel_layer, llama_parallel.shard_rows)
    ),
    "exported": ArchitectureLayers(_exported_layer),
}


def build_layer(spec: ModelSpec, index: int, seed: int) -> nn.Module:
    """Layer `index` of the model, initialised from (seed, index) only."""
    return LAYERS[spec.type].build_layer(spec, index, layer_generator(seed, index))


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
