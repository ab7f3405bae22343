"""Tensor parallelism of any model whose architecture supports it (the registry checks a split): build a rank's
layers, and cut or gather a stage's checkpoint tensors (a checkpoint always holds the
unsplit stage, so any split resumes from any other)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch import nn

from arceus.model.build import LAYERS, TensorParallelLayers, build_layer, tied_copies_initialised
from arceus.model.expected_state import ExpectedState
from arceus.model.registry import tensor_parallel_split
from arceus.model.seeding import layer_generator
from arceus.model.sharding import AllReduce, GatheredState, Shard, parameter_of, slice_state
from arceus.model.spec import ModelSpec


def _layers(spec: ModelSpec) -> TensorParallelLayers:
    tensor_parallel_split(spec)  # SpecError naming the architectures that split
    layers = LAYERS[spec.type].tensor_parallel
    assert layers is not None, f"{spec.type} splits in the registry but has no tensor-parallel layers"
    return layers


def build_parallel_layers(
    spec: ModelSpec, start: int, end: int, seed: int, shard: Shard, all_reduce: AllReduce
) -> nn.Sequential:
    """`build_layers` for rank `shard.rank` of a tensor-parallel stage: the split layers hold the rank's
    slice of the weights the unsplit layers get from the same seed; the others (cheap next to them: an
    embedding, a head) are replicated, computed whole on every rank."""
    if not 0 <= start < end <= spec.num_layers:
        raise ValueError(f"layer range [{start}, {end}) is not inside the model's {spec.num_layers} layers")
    layers, split = _layers(spec), spec.split_layers()
    built = nn.Sequential(
        OrderedDict(
            (
                str(i),
                layers.build_layer(spec, i, layer_generator(seed, i), shard, all_reduce)
                if i in split
                else build_layer(spec, i, seed),
            )
            for i in range(start, end)
        )
    )
    tied_copies_initialised(spec, built, start, end, seed)  # tied weights are in the replicated layers
    return built


def slice_state_tensors(spec: ModelSpec, shard: Shard, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank `shard.rank`'s part of an unsplit stage's checkpoint tensors (weights and optimizer state)."""
    return slice_state(_layers(spec).shard_rows, spec, shard, full)


def sliced_shape(spec: ModelSpec, shard: Shard, name: str, shape: Sequence[int]) -> list[int]:
    """The shape of rank `shard.rank`'s part of the unsplit stage's checkpoint tensor `name` of `shape`: what
    `slice_state_tensors` cuts, without a tensor."""
    cut = _layers(spec).shard_rows(spec, shard, parameter_of(name)) if shape else None  # 0-dim: Adam's step
    sliced = list(shape)
    if cut is not None:
        sliced[cut[0]] = cut[1].numel()
    return sliced


def rank_expected_state(spec: ModelSpec, expected: ExpectedState, shard: Shard) -> ExpectedState:
    """What rank `shard.rank` of the stage `expected` describes holds: its part of each tensor, under the unsplit
    stage's checkpoint names."""
    weights = {
        name: (dtype, sliced_shape(spec, shard, name, shape)) for name, (dtype, shape) in expected.weights.items()
    }
    return replace(expected, weights=weights, shard=shard)


def gather_state_tensors(spec: ModelSpec, shards: Sequence[Mapping[str, torch.Tensor]]) -> GatheredState:
    """The unsplit stage's checkpoint tensors from every rank's (`shards[r]` is rank r's), put together one
    at a time as they are read."""
    return GatheredState(_layers(spec).shard_rows, spec, shards)
