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
from arceus.model.spec import ModelSpec, split_global_param_name
from arceus.model.tied import tied_groups


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
    """Layers [start, end); children are named by their global layer index. A copy of a tied weight
    (arceus.model.tied) starts as its group's first member does, built here where another stage holds that."""
    if not 0 <= start < end <= spec.num_layers:
        raise ValueError(f"layer range [{start}, {end}) is not inside the model's {spec.num_layers} layers")
    layers = nn.Sequential(OrderedDict((str(i), build_layer(spec, i, seed)) for i in range(start, end)))
    tied_copies_initialised(spec, layers, start, end, seed)
    return layers


def tied_copies_initialised(spec: ModelSpec, layers: nn.Sequential, start: int, end: int, seed: int) -> None:
    """Set the copies of tied weights (arceus.model.tied) that layers [start, end) hold to their group's first
    member as seeded, that layer built here where another stage holds it: every copy starts equal."""
    for group in tied_groups(spec):
        copies = [m for m in group.held(start, end) if m != group.members[0]]
        if not copies:
            continue
        first, name = split_global_param_name(group.members[0])
        source = layers if start <= first < end else nn.Sequential(OrderedDict([(str(first),
                                                                                  build_layer(spec, first, seed))]))
        value = source.get_parameter(f"{first}.{name}")
        with torch.no_grad():
            for member in copies:
                layers.get_parameter(member.removeprefix("layers.")).copy_(value)


def build_full_model(spec: ModelSpec, seed: int) -> nn.Sequential:
    """The single-process reference: every layer, initialised exactly as any split would be; the members of a tied
    group are one parameter here (its first's, under every member's name), so autograd sums their gradients."""
    model = build_layers(spec, 0, spec.num_layers, seed)
    for group in tied_groups(spec):
        shared = model.get_parameter(group.members[0].removeprefix("layers."))
        for member in group.members[1:]:
            layer, name = split_global_param_name(member)
            module = model.get_submodule(str(layer))
            if hasattr(module, "share_parameter"):  # a captured layer's graph computes with the shared one too
                module.share_parameter(name, shared)
            else:
                owner, _, leaf = name.rpartition(".")
                setattr(module.get_submodule(owner), leaf, shared)
    return model


def global_param_name(local_name: str) -> str:
    """A `build_layers` parameter name ("2.weight") as its model-wide name ("layers.2.weight")."""
    return f"layers.{local_name}"


def named_global_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in module.named_parameters():
        yield global_param_name(name), param
